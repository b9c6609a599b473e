"""The protocol guarantees of docs/FORMAT.md, each shown with real processes and files."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from _workers import expected_values
from conftest import worker_cmd

import dbsync
from dbsync.leases import LeaseMonitor
from dbsync.store import Store


def wait_for_file(path: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path):
            return open(path).read()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def test_slow_readers_never_apply_a_mixed_set(root, tmp_path, worker_env):
    """A fast writer and three slow readers in separate processes: every applied set holds
    exactly one version's values, and the writer kept publishing meanwhile."""
    writer = subprocess.Popen(worker_cmd("writer", root, "0", "0.005"), env=worker_env,
                              stdout=subprocess.PIPE, text=True)
    try:
        readers = [
            subprocess.Popen(worker_cmd("reader", root, "4", delay, str(tmp_path / f"r{i}.json")),
                             env=worker_env)
            for i, delay in enumerate(["0.01", "0.03", "0.002"])
        ]
        for r in readers:
            assert r.wait(timeout=120) == 0
    finally:
        writer.kill()
        out, _ = writer.communicate()
    pushed = [int(x) for x in out.split()]
    applied = []
    for i in range(3):
        for record in json.load(open(tmp_path / f"r{i}.json")):
            assert record["values"] == expected_values(record["version"]), record  # one version
            applied.append(record["version"])
    assert len(pushed) > 10, "the writer should have published many versions meanwhile"
    assert len(set(applied)) > 3, "readers should have seen several versions"


def test_sigkill_of_writer_at_random_points_leaves_last_version_loadable(root, worker_env):
    rng = random.Random(1234)
    with dbsync.Sender(root) as sender:
        last = sender.push({"w": torch.ones(1)})
    for _ in range(5):
        writer = subprocess.Popen(worker_cmd("writer", root, "0", "0", "8", "262144"),
                                  env=worker_env, stdout=subprocess.PIPE, text=True)
        writer.stdout.readline()  # it has published once: now kill it somewhere mid-push
        time.sleep(rng.uniform(0.0, 0.15))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        receiver = dbsync.Receiver(root)
        seen: list[set[float]] = []
        version = receiver.load(lambda pairs, seen=seen: seen.append(
            {float(v) for _, t in pairs for v in t.float().unique()}))
        receiver.close()
        assert version > last
        assert seen == [{float(version)}], "the published version must be whole"
        last = version
    with dbsync.Sender(root) as sender:  # a new writer continues from the last version
        assert sender.push({"w": torch.ones(1)}) == last + 1


def test_live_reader_blocks_reuse_of_its_slot(root):
    with dbsync.Sender(root, lease_timeout=30) as sender:
        sender.push({"w": torch.full((4,), 1.0)})
        receiver = dbsync.Receiver(root, lease_timeout=30)
        with receiver.open() as snap:  # holds slot a (version 1)
            assert sender.push({"w": torch.full((4,), 2.0)}) == 2  # slot b: free
            future = sender.push({"w": torch.full((4,), 3.0)}, blocking=False)  # slot a: held
            time.sleep(1.0)
            assert not future.done(), "the writer must wait for the reader's slot"
            assert [float(t[0]) for _, t in snap.tensors()] == [1.0]
        assert future.result(timeout=10) == 3


@pytest.mark.parametrize("how", ["killed", "killed, not reaped", "stopped"])
def test_dead_reader_stops_blocking_the_writer(root, tmp_path, worker_env, how, caplog):
    """A killed reader (pid gone) frees its slot at once, also while its parent has not
    reaped it (a zombie: before, taken for alive for its whole lease timeout); a frozen one
    (SIGSTOP: alive but no heartbeat) after the lease timeout, on the writer's clock."""
    timeout = 2.0
    caplog.set_level(logging.INFO, logger="dbsync")
    with dbsync.Sender(root, lease_timeout=timeout) as sender:
        sender.push({"w": torch.ones(4)})
        ready = tmp_path / "ready"
        holder = subprocess.Popen(worker_cmd("hold", root, str(ready)),
                                  env={**worker_env, "LEASE": "2"})
        try:
            assert wait_for_file(str(ready)) == "1"
            if how == "killed":
                holder.kill()
                holder.wait()  # reaped, as a dead reader on another process tree would be
            elif how == "killed, not reaped":
                holder.kill()
                deadline = time.monotonic() + 30
                while (open(f"/proc/{holder.pid}/stat").read().rpartition(")")[2].split()[0]
                       != "Z" and time.monotonic() < deadline):
                    time.sleep(0.01)  # (until the kernel made it a zombie)
            else:
                holder.send_signal(signal.SIGSTOP)
            sender.push({"w": torch.full((4,), 2.0)})
            start = time.monotonic()
            assert sender.push({"w": torch.full((4,), 3.0)}) == 3  # reuses the held slot
            waited = time.monotonic() - start
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
    if how.startswith("killed"):
        assert waited < 1.0
    else:
        assert timeout * 0.9 <= waited < timeout + 3.0
        # the wait's outcome is said, not only its start
        assert any("is free after" in r.getMessage() and "judged dead" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_default_lease_timeout_is_30_seconds(root):
    assert LeaseMonitor(Store(root, create=True)).timeout == 30.0


def test_stalled_reader_finds_out_its_lease_expired(root):
    """A reader frozen past the lease timeout must not silently trust what it read."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(4)})
        receiver = dbsync.Receiver(root, lease_timeout=0.5)
        with pytest.raises(dbsync.LeaseExpiredError, match="load again"):
            def stall(pairs):
                list(pairs)
                receiver._keeper._ended = True  # frozen: its heartbeat writes no more
                # (pushed from the Sender's own thread, as by a trainer elsewhere: a push from
                # the thread that holds the slot is refused at once, SelfHeldSlotError)
                sender.push({"w": torch.full((4,), 2.0)}, blocking=False).result()
                start = time.monotonic()
                sender.push({"w": torch.full((4,), 3.0)}, blocking=False).result()  # reuses
                # the stalled reader's slot
                assert time.monotonic() - start < 0.5 + 1.0  # the reader's own timeout

            receiver.load(stall)


STOPPED_READER = """
import json, sys, dbsync
rx = dbsync.Receiver(sys.argv[1], lease_timeout=1.0)
def apply(pairs):
    list(pairs)
    print("READY", flush=True)  # (stopped here; continued, it waits for the parent's word)
    sys.stdin.readline()
try:
    rx.load(apply)
    print(json.dumps({"error": None}))
except dbsync.LeaseExpiredError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_a_reader_stopped_past_its_lease_is_told_it_stalled_not_sent_to_mount_caches(root):
    """A reader process stopped (SIGSTOP, a VM pause) past its lease timeout while applying;
    the writer reused its slot. Continued, its lease thread renews at once, before the load
    checks the slot, so the check found a lease renewed in time and blamed NFS or FUSE
    caches (DEPLOY.md's mount options), sending the operator the wrong way. It now says the
    process stalled, and for how long."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(4)})
        reader = subprocess.Popen([sys.executable, "-c", STOPPED_READER, root],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=dict(os.environ, PYTHONPATH=os.path.dirname(
                                      os.path.dirname(os.path.abspath(__file__)))))
        try:
            assert reader.stdout.readline().strip() == "READY"
            reader.send_signal(signal.SIGSTOP)
            sender.push({"w": torch.full((4,), 2.0)})
            sender.push({"w": torch.full((4,), 3.0)})  # (reuses its slot once judged dead)
            reader.send_signal(signal.SIGCONT)
            # (the handshake: the lease renewed again, after the stop, before the check)
            lease = os.path.join(root, "readers")
            beat = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                leases = [n for n in os.listdir(lease) if n.endswith(".json")]
                record = Store(root).read_lease(leases[0][:-5]) if leases else None
                if record is not None and time.time() - record["updated_at"] < 0.5:
                    beat = record["beat"]
                    break
                time.sleep(0.05)
            assert beat is not None, "the continued reader never renewed its lease"
            reader.stdin.write("go\n")
            reader.stdin.flush()
            out = json.loads(reader.stdout.readline())
        finally:
            reader.kill()
            reader.wait()
    assert out["error"] == "LeaseExpiredError", out
    assert "was stalled (stopped, or starved of CPU)" in out["message"], out["message"]
    assert "NFS or FUSE caches" not in out["message"]


OTHER_HOLDER = """
import sys, dbsync
rx = dbsync.Receiver(sys.argv[1], reader_id="engine-0", lease_timeout=30)
with rx.open() as snap:
    print("HOLDING", snap.version, flush=True)
    sys.stdin.readline()
"""


def test_a_reader_id_another_process_took_is_never_written_over(root):
    """A store removed and made anew at its path while an engine ran: the new run's engine
    claimed the same reader id (the old engine's lease was gone with the old directory), and
    the old engine's next heartbeat replaced the new engine's lease with its own. The new
    engine's hold vanished and the writer reused the slot it was reading. A keeper now reads
    its lease before renewing it: another process's lease there makes it stop writing, for
    good, and say so (``store_problem()``, a WARNING); the other's hold stays seen."""
    with dbsync.Sender(root, reader_timeout=1.0) as sender:
        sender.push({"w": torch.ones(4)})
        with dbsync.Receiver(root, reader_id="engine-0", lease_timeout=30) as old:
            lease = os.path.join(root, "readers", "engine-0.json")
            os.remove(lease)  # (as with the old directory: the new one has no lease of it)
            other = subprocess.Popen([sys.executable, "-c", OTHER_HOLDER, root],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=os.path.dirname(
                                         os.path.dirname(os.path.abspath(__file__)))))
            try:
                assert other.stdout.readline().split() == ["HOLDING", "1"]
                assert old._keeper.write() is False  # (its next heartbeat)
                assert Store(root).read_lease("engine-0")["pid"] == other.pid
                problem = old.store_problem()
                assert problem is not None and "in use by another process too" in problem
                assert f"pid {other.pid}" in problem
                assert sender.push({"w": torch.full((4,), 2.0)}) == 2  # (the other slot)
                with pytest.raises(dbsync.SlotHeldError, match="engine-0"):
                    sender.push({"w": torch.full((4,), 3.0)})  # (the slot engine-0 reads)
            finally:
                other.kill()
                other.wait()


@pytest.mark.parametrize("use", ["with block", "copy_into"])
def test_a_stalled_snapshot_says_its_views_cannot_be_trusted(root, use):
    """A snapshot opened by hand (``with receiver.open() as snap``) whose reader froze past its
    lease timeout while its views were in use: the writer reused the slot, and the views now
    show the next version's bytes. The block's exit (or ``copy_into``, an apply of its own)
    raises ``LeaseExpiredError`` instead of letting the mix pass."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(4)})
        receiver = dbsync.Receiver(root, lease_timeout=0.5)
        dest = {"w": torch.zeros(4)}
        with pytest.raises(dbsync.LeaseExpiredError, match="cannot be trusted"):
            with receiver.open() as snap:
                views = dict(snap.tensors())
                receiver._keeper._ended = True  # frozen: its heartbeat writes no more
                sender.push({"w": torch.full((4,), 2.0)}, blocking=False).result()
                # (reuses the stalled reader's slot; from the Sender's thread, as above)
                sender.push({"w": torch.full((4,), 3.0)}, blocking=False).result()
                assert torch.equal(views["w"], torch.full((4,), 3.0))  # (what it would apply)
                if use == "copy_into":
                    snap.copy_into(dest)
        receiver.close()


def test_a_load_whose_lease_went_unrenewed_reads_again_when_its_slot_is_intact(root, caplog):
    """A reader whose lease went unrenewed for a while (a process starved of CPU) while its
    slot still holds the version cannot trust what it read, but need not fail: the load
    reads it again (renewing the lease first), and says why at INFO."""
    import logging

    calls = []
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.full((4,), 7.0)})
        with dbsync.Receiver(root) as receiver:
            def stalled_once(pairs):
                calls.append([float(t.sum()) for _, t in pairs])
                if len(calls) == 1:  # as if the lease thread had not run for 100 s
                    receiver._keeper.last_ok = time.monotonic() - 100

            with caplog.at_level(logging.INFO, logger="dbsync"):
                assert receiver.load(stalled_once) == 1
    assert calls == [[28.0], [28.0]]
    said = [r.getMessage() for r in caplog.records if "reading version 1 again" in
            r.getMessage()]
    assert len(said) == 1 and "stalled (stopped, or starved of CPU)" in said[0]
    assert all(r.levelno < logging.WARNING for r in caplog.records)


def test_wait_sees_a_flip_with_polling_only(root):
    """Where no inotify events arrive, polling alone must notice the flip."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(1)})
        receiver = dbsync.Receiver(root, poll_interval=0.05)
        seen: list[int] = []
        watcher = dbsync.Watcher(root, seen.append, poll_interval=0.05, use_polling=True).start()
        try:
            sender.push({"w": torch.ones(1)})
            sender.push({"w": torch.ones(1)})
            deadline = time.monotonic() + 5
            while seen[-1:] != [3] and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            watcher.stop()
        assert watcher.mode == "polling"
        assert seen in ([1, 3], [1, 2, 3])  # two quick flips may fall into one poll
        assert receiver.wait(newer_than=2, timeout=1) == 3


def test_mount_type_picks_polling_for_network_and_fuse(tmp_path):
    from dbsync.watch import mount_type

    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 8:1 / / rw - ext4 /dev/vda rw\n"
        "40 22 0:50 / /mnt/nfs rw - nfs4 server:/export rw\n"
        "41 22 0:51 / /mnt/view rw - fuse bindfs rw\n"
        "42 22 0:52 / /mnt/lus rw - lustre mgs@tcp:/fs rw\n"
        "43 22 0:53 / /mnt/a\\011tab\\134and\\040more rw - nfs server:/x rw\n"
    )
    assert mount_type("/mnt/a\ttab\\and more/store", str(info)) == "nfs"
    assert mount_type("/mnt/nfs/store", str(info)) == "nfs4"
    assert mount_type("/mnt/view/x", str(info)) == "fuse"
    assert mount_type("/mnt/lus", str(info)) == "lustre"
    assert mount_type("/home/x", str(info)) == "ext4"


def _bindfs_view(tmp_path):
    import shutil

    if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse"):
        pytest.skip("bindfs/FUSE not available here (.ci/run installs it)")
    base, view = tmp_path / "base", tmp_path / "view"
    base.mkdir()
    view.mkdir()
    subprocess.run(["bindfs", str(base), str(view)], check=True)
    return str(base), str(view)


def test_fuse_view_without_inotify_events_is_polled(tmp_path):
    """Publish into the backing directory, watch through a FUSE view of it: the view gets no
    inotify events (as on NFS from another host), so only automatic polling sees the flips."""
    base, view = _bindfs_view(tmp_path)
    try:
        from dbsync.watch import needs_polling

        assert needs_polling(view) and not needs_polling(base)
        with dbsync.Sender(base) as sender:
            sender.push({"w": torch.ones(2)})
            seen: list[int] = []
            with dbsync.Watcher(view, seen.append, poll_interval=0.1) as watcher:
                assert watcher.mode == "polling"
                sender.push({"w": torch.full((2,), 2.0)})
                deadline = time.monotonic() + 10
                while 2 not in seen and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert seen == [1, 2]
            got = {}
            dbsync.Receiver(view).load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
            assert torch.equal(got["w"], torch.full((2,), 2.0))
    finally:
        subprocess.run(["umount", view], check=False)


def test_a_fuse_volume_mounted_over_a_watched_root_is_polled_from_then_on(tmp_path):
    """A watcher started on an empty local directory (the reader came up before the volume);
    then the store's FUSE view is mounted there. It chose inotify from the local filesystem,
    which never fires for changes made through the backing directory: it noticed flips only
    at its 5 s safety look, skipping versions. It now polls from the moment the mount
    appears, at its poll interval."""
    import shutil

    if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse"):
        pytest.skip("bindfs/FUSE not available here (.ci/run installs it)")
    base, view = tmp_path / "base", tmp_path / "view"
    base.mkdir()
    view.mkdir()
    seen: list[tuple[int, float]] = []
    arrived = threading.Condition()

    def noticed(version: int) -> None:
        with arrived:
            seen.append((version, time.monotonic()))
            arrived.notify_all()

    with dbsync.Sender(base) as sender, dbsync.Watcher(
            str(view), noticed, poll_interval=0.1, safety_interval=30) as watcher:
        assert watcher.mode == "inotify"
        sender.push({"w": torch.ones(2)})
        subprocess.run(["bindfs", str(base), str(view)], check=True)
        try:
            with arrived:
                assert arrived.wait_for(lambda: seen, timeout=10), "the mounted store"
            assert watcher.mode == "polling"
            for expected in (2, 3):
                flipped = time.monotonic()
                assert sender.push({"w": torch.full((2,), float(expected))}) == expected
                with arrived:
                    assert arrived.wait_for(lambda e=expected: seen[-1][0] == e, timeout=10)
                assert seen[-1][1] - flipped < 10.0  # (its safety look: 30 s)
            assert [v for v, _ in seen] == [1, 2, 3]
        finally:
            watcher.stop()
            subprocess.run(["umount", str(view)], check=False)


def test_inotify_watcher_reacts_without_waiting_for_a_poll(root):
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(1)})
        seen: list[int] = []
        with dbsync.Watcher(root, seen.append, poll_interval=60, use_polling=False) as watcher:
            assert watcher.mode == "inotify"
            time.sleep(0.2)
            sender.push({"w": torch.ones(1)})
            deadline = time.monotonic() + 3  # far less than the 60 s poll interval
            while 2 not in seen and time.monotonic() < deadline:
                time.sleep(0.01)
        assert seen == [1, 2]


@pytest.mark.parametrize("error", [dbsync.IncompatibleWeightsError, RuntimeError])
def test_a_watch_callback_that_fails_is_said_plainly_or_with_its_traceback(root, caplog,
                                                                         error):
    """A callback failing with a dbsync error (a refused version, a stalled lease) is a
    WARNING saying why, without a traceback; anything else (a bug in the callback) is an
    ERROR with its traceback. Either way ``last_error`` holds it."""
    import logging
    import threading

    failed = threading.Event()

    def callback(version: int) -> None:
        failed.set()
        raise error(f"no thanks to version {version}")

    with dbsync.Sender(root) as sender, caplog.at_level(logging.INFO, logger="dbsync"):
        sender.push({"w": torch.ones(4)})
        with dbsync.Watcher(root, callback, poll_interval=0.05) as watcher:
            assert failed.wait(30)
            deadline = time.monotonic() + 30
            while watcher.last_error is None and time.monotonic() < deadline:
                time.sleep(0.01)  # (set as the callback returns, in the watcher's thread)
    assert isinstance(watcher.last_error, error)
    said = [r for r in caplog.records if "callback failed for version 1" in r.getMessage()]
    assert len(said) == 1
    if error is RuntimeError:
        assert said[0].levelno == logging.ERROR and said[0].exc_info is not None
    else:
        assert said[0].levelno == logging.WARNING and said[0].exc_info is None
        assert "no thanks to version 1" in said[0].getMessage()


def test_a_stalled_reader_whose_slot_shrank_is_told_not_killed(root):
    """As above, but the writer reuses the slot with a smaller layout: the shard was truncated
    under the stalled reader's mappings, and reading them killed it with SIGBUS, without a
    word (a serving engine gone after a VM pause met a change of model shape). A shard of
    another size is now a new file: the reader keeps the old inode and is told."""
    big = {f"w{i}": torch.full((1 << 18,), 1.0) for i in range(8)}  # 8 MiB in all
    with dbsync.Sender(root) as sender:
        sender.push(big)
        receiver = dbsync.Receiver(root, lease_timeout=0.5)
        seen = []
        with pytest.raises(dbsync.LeaseExpiredError, match="load again"):
            def stall(pairs):
                receiver._keeper._ended = True  # frozen: its heartbeat writes no more
                for small in (2.0, 3.0):  # (from the Sender's thread, as in the tests above)
                    sender.push({"w0": torch.full((16,), small)}, blocking=False).result()
                seen.extend(float(t.sum()) for _, t in pairs)  # every old view still reads

            receiver.load(stall)
        assert seen == [float(1 << 18)] * 8
        receiver.close()
