"""A fleet on one machine: readers in their own PID and UTS namespaces (other hosts, containers
sharing the writer's hostname), read-only bind mounts, small tmpfs stores that fill up,
injected ESTALE/EIO, trainers that restart. Real processes, real mounts, real files; each
test asserts what was applied, which version, and how long the writer waited.

Namespaces and mounts need root and util-linux's ``unshare`` (CI runs as root); elsewhere
those tests skip, saying so."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _workers import expected_values, weights_for
from fleet_mounts import FuseView, ext4_that_fails, needs_root, read_only_view, tmpfs

import dbsync
from dbsync.format import MANIFEST_FILE
from dbsync.store import Store
from dbsync.testing import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "fleet_workers.py")
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "FLEET_HOST_UTS": str(os.stat("/proc/self/ns/uts").st_ino)}


# ---- helpers -------------------------------------------------------------------------------
def fill(directory: str, name: str = "filler") -> str:
    """Write a file until the filesystem says ENOSPC; returns its path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return path


def worker(*args: str) -> list[str]:
    return [sys.executable, WORKERS, *args]


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(worker(*args), env=ENV, start_new_session=True)


def in_namespace(hostname: str | None, pid: int | None, *args: str) -> subprocess.Popen:
    """A worker in a new PID namespace (pid ``pid`` there), and a new UTS namespace with
    ``hostname`` if given (another host), else sharing the writer's hostname (a container
    with ``--network host`` / ``hostNetwork``). Killing the returned process kills it all."""
    cmd = ["unshare", "--pid", "--fork", "--kill-child"]
    if hostname is not None:
        cmd.append("--uts")
    cmd += worker("namespaced", hostname or "-", "-" if pid is None else str(pid), *args)
    return subprocess.Popen(cmd, env=ENV, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def wait_json(path: Any, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> Any:
    """The JSON a worker writes (atomically) at ``path``; fails early if the worker died."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None and not os.path.exists(path):
            raise AssertionError(f"worker exited with {proc.returncode} before writing {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} was not written within {timeout} s")
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def pid_free_here() -> int:
    """A pid that no process has in this (the writer's) PID namespace (near pid_max, where
    this namespace's own pids are unlikely to reach during the test)."""
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read()) - 1
    for pid in range(top, 1000, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid")


def values_of(pairs: Any) -> list[float]:
    return sorted({float(v) for _, t in pairs for v in t.float().unique()})


def load(receiver: dbsync.Receiver, timeout: float = 20.0) -> tuple[int, list[float]]:
    """(version, distinct values applied) of one load, which must finish within ``timeout``
    (a hung load fails the test instead of hanging it)."""
    return bounded(lambda: _load(receiver), timeout)


def _load(receiver: dbsync.Receiver) -> tuple[int, list[float]]:
    got: list[list[float]] = []
    version = receiver.load(lambda pairs: got.append(values_of(pairs)))
    assert len(got) == 1
    return version, got[0]


def bounded(fn: Callable[[], Any], timeout: float) -> Any:
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"still blocked after {timeout} s (wedged)")
    if error:
        raise error[0]
    return result[0]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The real `dbsync` command, in its own process."""
    return subprocess.run([sys.executable, "-m", "cli.main", *args], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def used_bytes(path: str) -> int:
    return shutil.disk_usage(path).used


# ---- 1. lease write failures never wedge a receiver ----------------------------------------
@needs_root
def test_lease_write_failures_never_wedge_a_receiver(tmp_path):
    """A full disk makes every lease write fail (ENOSPC): loads go on without a lease
    (private verified copies) and keep working, the one whose lease expired meanwhile too (it
    reads again, leaseless); once there is space again, the receiver leases and acknowledges
    again."""
    with tmpfs(tmp_path / "small", "2m") as small:
        root = os.path.join(small, "store")
        with dbsync.Sender(root, lease_timeout=1.0) as sender:
            sender.push(weights_for(1))
            receiver = dbsync.Receiver(root, lease_timeout=1.0)
            assert load(receiver) == (1, [1.0])
            fillers: list[str] = []

            def fill_then_stall(pairs: Any) -> None:  # the disk fills during a leased load,
                list(pairs)                            # which then outlasts its lease
                if not fillers:
                    fillers.append(fill(small))
                    time.sleep(1.2)

            assert bounded(lambda: receiver.load(fill_then_stall), 20) == 1
            assert receiver.loaded_version == 1
            filler = fillers[0]
            for _ in range(3):  # the first failed lease write used to wedge every later load
                assert load(receiver) == (1, [1.0])
            snap = bounded(receiver.open, 10)
            with snap:
                assert not snap.leased, "no lease can be written on a full disk"
            os.unlink(filler)
            assert sender.push(weights_for(2)) == 2
            assert load(receiver) == (2, [2.0])
            lease = Store(root).read_leases()[receiver.reader_id]
            assert lease["loaded_version"] == 2, "acknowledgements resume once leases fit"
            deadline = time.monotonic() + 5  # and the heartbeat survived the failed writes
            while Store(root).read_leases()[receiver.reader_id]["beat"] == lease["beat"]:
                assert time.monotonic() < deadline, "the heartbeat stopped"
                time.sleep(0.05)
            receiver.close()


def test_senders_restarting_while_receivers_loop_never_hang(root, tmp_path):
    """A trainer restarting (a new Sender per checkpoint) while two receivers loop loads:
    no receiver hangs, every load applies exactly one whole version."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    # A receiver's lease write caught in flight (its temp file, before the rename): a Sender
    # starting now must leave it alone, or the receiver's rename fails.
    in_flight = os.path.join(root, "readers", f".tmp-r1.json-{os.getpid()}-0a1b2c3d")
    open(in_flight, "w").close()
    dbsync.Sender(root).close()
    assert os.path.exists(in_flight), "a Sender removed a live receiver's temp file"
    os.unlink(in_flight)

    stop = str(tmp_path / "stop")
    outs = [str(tmp_path / f"reader{i}.json") for i in range(2)]
    readers = [spawn("reader_loop", root, out, stop, "1.0", "10") for out in outs]
    try:
        version = 1
        for i in range(100):  # a Sender per checkpoint, and others that only start (re-runs)
            with dbsync.Sender(root, lease_timeout=1.0) as sender:
                if i % 10 == 0:
                    version = sender.push(weights_for(version + 1))
        open(stop, "w").close()
        for reader in readers:  # (a bound for a hang, not a speed: 2 cores run 3 processes)
            assert reader.wait(timeout=120) == 0, "a receiver failed"
    finally:
        for reader in readers:
            kill(reader)
    for out in outs:
        loads = wait_json(out)["loads"]
        assert len(loads) >= 10
        for record in loads:
            assert record["values"] == expected_values(record["version"]), record  # one version
    assert version == 11


# ---- 2. a full disk ------------------------------------------------------------------------
@needs_root
def test_full_store_frees_a_failed_push_and_keeps_serving(tmp_path):
    """On a small tmpfs: a push that cannot fit, a push onto a full disk and a disk that
    fills up during a push all fail with StoreFullError and leave no partial files (the space
    is back); the current version still loads and verifies; a push that fits then works."""
    with tmpfs(tmp_path / "small", "4m") as small:
        root = os.path.join(small, "store")
        with dbsync.Sender(root, lease_timeout=1.0) as sender:
            sender.push(weights_for(1))
            sender.push(weights_for(2))
            receiver = dbsync.Receiver(root, lease_timeout=1.0)
            assert load(receiver) == (2, [2.0])

            before = used_bytes(small)  # too big: refused before a byte is written
            with pytest.raises(dbsync.StoreFullError, match="nothing was"):
                sender.push({"w": torch.zeros(2 << 20)})
            assert used_bytes(small) == before

            fillers = [fill(small, "filler1")]  # a full disk (the slot's files are reusable)
            assert shutil.disk_usage(small).free < 4096
            with pytest.raises(dbsync.StoreFullError, match="nothing was published"):
                sender.push(weights_for(3))
            assert shutil.disk_usage(small).free >= 6 * 4096 * 4 // 2, "partial files freed"

            # The disk fills up while the push writes (another process writes a log ...).
            def fill_during_write(done: int, total: int) -> None:
                if len(fillers) == 1:
                    fillers.append(fill(small, "filler2"))

            with pytest.raises(dbsync.StoreFullError, match="partial files were removed"):
                sender.push(weights_for(3), progress=fill_during_write)
            assert len(fillers) == 2
            assert shutil.disk_usage(small).free >= 6 * 4096 * 4 // 2, "partial files freed"
            free_slot = os.path.join(root, "slots", "a")
            assert not [f for f in os.listdir(free_slot) if f.startswith("shard-")]

            # Still full: the current version loads (leaseless) and verifies.
            assert load(receiver) == (2, [2.0])
            verified = cli("verify", root)
            assert verified.returncode == 0, verified.stderr
            assert "version 2 OK" in verified.stdout

            for filler in fillers:
                os.unlink(filler)
            assert sender.push(weights_for(3)) == 3
            assert load(receiver) == (3, [3.0])
            receiver.close()


@needs_root
def test_a_push_with_fewer_shards_fits_where_the_old_ones_were(tmp_path):
    """A nearly full store whose model changed to fewer, larger shards: the push fits once the
    slot's unused shards are gone, as the space check counted (before: "no space left ...
    Free space there", and a retry with nothing freed worked)."""
    with tmpfs(tmp_path / "small", "20m") as small:
        with dbsync.Sender(os.path.join(small, "store")) as sender:
            sender.shard_bytes = 2 * 2**20
            old = {f"w{i}": torch.full((2**19,), float(i)) for i in range(4)}  # 4 x 2 MiB
            sender.push(old)
            sender.push(old)
            assert sender.push({"big": torch.ones(9 * 2**18)}) == 3  # one 9 MiB shard
            # a version more than half the filesystem: the advice says two versions are kept
            # (before: "Free space there" on a filesystem holding nothing but the store)
            with pytest.raises(dbsync.StoreFullError, match="keeps two versions"):
                sender.push({"big": torch.ones(3 * 2**20)})
            with dbsync.Receiver(os.path.join(small, "store")) as rx:
                assert rx.latest_version() == 3


@needs_root
def test_a_store_out_of_inodes_says_so(tmp_path):
    """A filesystem with space left but no free inodes (``df -h`` shows room) fails a push
    that needs new files with a StoreFullError that names inodes, not space; the current
    version still loads, and once files are removed the push works."""
    with tmpfs(tmp_path / "few", "16m", "nr_inodes=40") as few:
        root = os.path.join(few, "store")
        with dbsync.Sender(root, lease_timeout=1.0) as sender:
            sender.push(weights_for(1))
            sender.push(weights_for(2))  # (steady state: the next push reuses a slot's files,
            # which a failed push removes, freeing inodes before the error is worded)
            fillers = []
            with contextlib.suppress(OSError):
                while True:
                    fillers.append(os.path.join(few, f"f{len(fillers)}"))
                    open(fillers[-1], "w").close()
            with pytest.raises(dbsync.StoreFullError, match="nothing was published") as caught:
                sender.push({f"t{i}": torch.ones(8) for i in range(3)})  # (one more file)
            message = str(caught.value)
            assert "no free inodes" in message and "df -i" in message, message
            receiver = dbsync.Receiver(root, lease_timeout=1.0)
            assert load(receiver) == (2, [2.0])
            for filler in fillers:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(filler)
            assert sender.push(weights_for(3)) == 3
            assert load(receiver) == (3, [3.0])
            receiver.close()


@needs_root
def test_a_new_store_on_a_full_filesystem_says_so_and_works_once_there_is_room(tmp_path):
    """A new ROOT on a filesystem with no inodes left: ``Sender(root)`` fails with a
    StoreFullError that says what ran out (before: a bare "No space left on device", and the
    process kept the writer lock, so every later Sender and `dbsync push` there was refused
    as "another writer" until it exited). With no space left (inodes free) the Sender opens
    and the push says what ran out. Once there is room both work, in the same process."""
    with tmpfs(tmp_path / "full", "4m", "nr_inodes=32") as full:
        fillers = []
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.path.join(full, f"f{len(fillers)}"))
                open(fillers[-1], "w").close()
        root = os.path.join(full, "store")
        with pytest.raises(dbsync.StoreFullError, match="no free inodes") as caught:
            dbsync.Sender(root)
        assert "nothing was published" in str(caught.value)
        for filler in fillers:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(filler)
        with open(os.path.join(full, "space"), "wb") as f:  # now no space, inodes free
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            with dbsync.Sender(root) as sender:
                with pytest.raises(dbsync.StoreFullError,
                                   match=r"Free space there .*`lsof \+L1` lists such files"):
                    sender.push(weights_for(1))
                os.unlink(os.path.join(full, "space"))
                f.truncate(0)
                assert sender.push(weights_for(1)) == 1
        with dbsync.Sender(root) as again:
            assert again.push(weights_for(2)) == 2


# ---- 3. read-only views ----------------------------------------------------------------------
@needs_root
def test_a_receiver_started_while_its_store_was_read_only_registers_once_writable(tmp_path):
    """A store briefly read-only (a failover, a remount) when a receiver starts: it loads
    without a lease, and registers at a load once the store is writable again, so the
    trainer counts it (before: never, for its whole life)."""
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
        with read_only_view(base, base):  # (the store's own path, read-only for a while)
            receiver = dbsync.Receiver(base, reader_id="engine-1", lease_timeout=1.0)
            assert receiver.read_only
            assert load(receiver) == (1, [1.0])
        try:
            version = sender.push(weights_for(2))
            assert load(receiver) == (2, [2.0])
            assert not receiver.read_only
            assert sender.wait_for_receivers(version, count=1, timeout=10)
            status = json.loads(cli("status", base, "--json").stdout)
            assert _state(status, "engine-1") == "idle", status["receivers"]
        finally:
            receiver.close()


@needs_root
@pytest.mark.parametrize("how", ["bind", "bindfs"])
def test_read_only_view_serves_load_wait_watch_status_verify(tmp_path, how):
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
        with read_only_view(base, tmp_path / "view", how) as view:
            receiver = dbsync.Receiver(view, lease_timeout=1.0)
            assert receiver.read_only
            assert load(receiver) == (1, [1.0])
            with pytest.raises(dbsync.StoreReadOnlyError, match="read-write mount") as caught:
                dbsync.Sender(view)  # (an OSError with its errno, as the docs say)
            assert caught.value.errno == errno.EROFS
            seen: list[int] = []
            got_2 = threading.Event()
            watcher = receiver.watch(lambda v: (seen.append(v), v == 2 and got_2.set()),
                                     poll_interval=0.05)
            try:
                waited: list[int | None] = []
                waiter = threading.Thread(
                    target=lambda: waited.append(receiver.wait(newer_than=1, timeout=20)))
                waiter.start()
                assert sender.push(weights_for(2)) == 2
                waiter.join(30)
                assert waited == [2]
                assert got_2.wait(20), f"the watcher saw {seen}"
            finally:
                watcher.stop()
            assert seen == [1, 2]
            assert load(receiver) == (2, [2.0])

            status = cli("status", view, "--json")
            assert status.returncode == 0, status.stderr
            info = json.loads(status.stdout)
            assert info["version"] == 2 and info["leases_writable"] is False
            verified = cli("verify", view)
            assert verified.returncode == 0, verified.stderr
            assert "version 2 OK" in verified.stdout
            receiver.close()
        assert os.listdir(os.path.join(base, "readers")) == [], "nothing registered via ro"


def _soak(tmp_path: Any, base: str, view: str, *, versions: int, min_loads: int, lease: str,
          per_sender: int, pause: float) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """A writer process publishing into ``base`` (a new Sender every ``per_sender`` pushes,
    ``pause`` s apart; content = the version) and a reader process loading through ``view``
    again and again (leases of ``lease`` s), until the writer has published ``versions``
    versions and the reader has made ``min_loads`` loads; both must exit 0 (a reader dies on
    any error but "load again"). Returns the reader's and the writer's records, and the
    loads that applied values of more than one version."""
    stop, done = str(tmp_path / "stop"), str(tmp_path / "done")
    writer = spawn("writer_loop", base, stop, str(per_sender), str(tmp_path / "writer.json"),
                   str(pause))
    reader = spawn("reader_loop", view, str(tmp_path / "reader.json"), done, lease,
                   str(min_loads))
    try:
        deadline = time.monotonic() + 60
        while (Store(base).read_head().version < versions and reader.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)  # the soak runs until the writer has published that many
        open(done, "w").close()  # then the reader stops (after at least min_loads loads)
        assert reader.wait(timeout=60) == 0, "the reader failed"
        open(stop, "w").close()
        assert writer.wait(timeout=30) == 0, "the writer failed"
    finally:
        open(stop, "w").close()
        kill(reader)
        kill(writer)
    result = wait_json(tmp_path / "reader.json")
    torn = [r for r in result["loads"] if r["values"] != expected_values(r["version"])]
    return result, wait_json(tmp_path / "writer.json"), torn


@needs_root
@pytest.mark.parametrize("how", ["bind", "bindfs"])
def test_read_only_view_soak_has_no_torn_applies(tmp_path, how):
    """A writer publishing without pause (a new Sender every 3 pushes) and a reader loading
    through a read-only view, over and over: every load applies exactly one version. Through
    bindfs (FUSE, whose attribute cache can report a just-replaced head at the old one's size
    for a second) no load fails on a head read cut short either."""
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
    with read_only_view(base, tmp_path / "view", how) as view:
        # (through FUSE a reader sees a new head about once a second, when the kernel's
        # cached entry expires: the writer's 40 versions are spread over ~8 s there)
        result, pushed, torn = _soak(tmp_path, base, view, versions=40, min_loads=60,
                                     lease="1.0", per_sender=3,
                                     pause=0.2 if how == "bindfs" else 0)
    assert result["read_only"] is True
    versions = [r["version"] for r in result["loads"]]
    print(f"soak: {len(versions)} loads of {len(set(versions))} versions, {result['retried']} "
          f"refused as replaced meanwhile; {len(pushed['pushed'])} pushes by {pushed['senders']} "
          "Senders")
    assert torn == [], f"{len(torn)} torn applies"
    applied_then_failed = [e for e in result["errors"] if e["applied"]]
    assert applied_then_failed == [], "a load that applied a whole verified copy failed"
    assert len(versions) >= 60 and len(set(versions)) >= 5, versions
    assert pushed["senders"] >= 3 and len(pushed["pushed"]) >= 10


@needs_root
def test_leased_loads_through_a_caching_fuse_mount_never_call_a_reused_slot_damaged(tmp_path):
    """Receivers on a caching FUSE mount (bindfs with ``auto_cache``, which keeps a file's
    pages while its attributes look unchanged, as many FUSE filesystems do, and libfuse's
    default 1 s attribute and entry caches), the trainer writing the store directly (as
    from another host) every 0.1 s. The mount can show a head and slot stamp from its cache
    while the shards already hold the writer's next version in that slot: a leased load then
    found bytes that did not match their checksums and raised ``DamagedVersionError`` within
    a few seconds, which serve-vllm refuses and reports to the trainer. Such a load now looks
    again for as long as those caches last, sees the slot moved on, and reads again: every
    load applies exactly one whole version, and none is called damaged."""
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
    fuse = FuseView(base, tmp_path / "view", options="auto_cache")
    try:
        result, _, torn = _soak(tmp_path, base, fuse.mount(), versions=80, min_loads=20,
                                lease="30", per_sender=5, pause=0.1)
    finally:
        fuse.close()
    versions = [r["version"] for r in result["loads"]]
    print(f"caching FUSE soak: {len(versions)} loads of {len(set(versions))} versions, "
          f"{result['retried']} said to load again")
    assert torn == [] and len(versions) >= 20 and len(set(versions)) >= 3, versions
    assert result["read_only"] is False  # (leased: its lease written through the mount)


@needs_root
def test_a_hung_mount_holds_no_timed_wait_past_its_timeout_and_silences_no_watcher(
        tmp_path, monkeypatch, caplog):
    """A mount that stops answering (its FUSE daemon stopped here; a hard-mounted NFS server
    away) blocks every read inside the kernel. ``Receiver.wait(timeout=1)`` returned after 34
    s, when the mount came back, and a watcher said nothing meanwhile. Now the timed wait
    returns None in time, the watcher's ``read_problem`` (``/dbsync/status``, ``dbsync
    watch``) says the store does not answer, and both go on once it answers again."""
    import logging
    import signal

    from dbsync import slowcalls
    from dbsync import watch as watch_module
    from dbsync.watch import Watcher

    monkeypatch.setattr(slowcalls, "SLOW_CALL_WARN_S", 0.5)
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
    fuse = FuseView(base, tmp_path / "view")
    view = fuse.mount()
    seen: list[int] = []
    arrived = threading.Event()
    rx = dbsync.Receiver(view, read_only=True)
    watcher = Watcher(view, lambda v: (seen.append(v), arrived.set()), poll_interval=0.1,
                      skip_current=True).start()
    monkeypatch.setattr(watch_module, "STOP_JOIN_S", 0.5)
    stuck = Watcher(view, lambda v: None, poll_interval=0.1).start()
    daemon = fuse._daemon.pid
    try:
        with caplog.at_level(logging.WARNING, logger="dbsync"):
            os.kill(daemon, signal.SIGSTOP)
            start = time.monotonic()
            assert rx.wait(newer_than=1, timeout=1.0) is None
            took = time.monotonic() - start
            assert took < 1.0 + dbsync.receiver._WAIT_GRACE_S + 1.0, took
            deadline = time.monotonic() + 30
            while not (watcher.read_problem or "").count("has not returned"):
                assert time.monotonic() < deadline, watcher.read_problem
                threading.Event().wait(0.05)  # (a bounded pause between looks at a status)
            # A watcher stopped meanwhile (`dbsync watch` taking Ctrl-C or SIGTERM) returns:
            # its thread, blocked in the kernel, is left behind (it waited for the mount).
            stopping = threading.Thread(target=stuck.stop, daemon=True)
            stopping.start()
            stopping.join(10)
            assert not stopping.is_alive(), "stop() waited for a mount that does not answer"
            os.kill(daemon, signal.SIGCONT)
        with dbsync.Sender(base) as sender:
            sender.push(weights_for(2))
        assert arrived.wait(30) and seen == [2]
        assert rx.wait(newer_than=1, timeout=30) == 2
        assert watcher.read_problem is None
        assert f"reading {view}/dbsync.json has not returned for 0.5 s" in caplog.text
        assert "did not answer in time (a hung mount?); returning None" in caplog.text
        assert "did not stop within 0 s: it waits in a call its mount does not answer" in (
            caplog.text)
    finally:
        os.kill(daemon, signal.SIGCONT)
        watcher.stop()
        rx.close()
        fuse.close()


@needs_root
def test_status_on_a_read_only_view_does_not_call_a_reader_with_a_lagging_clock_dead(tmp_path):
    """On a read-only view ``dbsync status`` cannot write the probe that gives it the
    store's clock, and judged each lease by its own ``updated_at``: a live reader on a host
    whose clock lags 40 s was shown dead. The lease files' times (the store's clock) are
    used against this host's instead."""
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
    lease = {"reader_id": "skewed", "host": "node7", "boot_id": None, "pidns": None,
             "pid": 4242, "pid_start": None, "reads_format": 3, "lease_timeout": 5.0,
             "state": "idle", "slot": None, "version": None, "held": [],
             "loaded_version": 1, "loaded_run_id": None, "loaded_at": None, "refused": None,
             "beat": 7, "updated_at": time.time() - 40}  # (its host's clock, 40 s behind)
    Store(base).write_lease("skewed", lease)  # (just written: its file is fresh)
    with read_only_view(base, tmp_path / "view") as view:
        done = subprocess.run([sys.executable, "-m", "cli.main", "status", "--json", view],
                              cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    info = json.loads(done.stdout)
    [reader] = info["receivers"]
    assert reader["state"] != "dead" and reader["seconds_since_seen"] < 20, reader


@needs_root
def test_operator_commands_on_a_hung_mount_say_so_instead_of_hanging(tmp_path):
    """``dbsync status`` (and ``--json``, ``verify``, ``watch``) on a mount that stopped
    answering hung for good at their first look at ROOT, printing nothing: an on-call
    engineer's terminal, or a monitoring script, wedged. They now say the mount does not
    answer, exit 1, and ``--json`` still prints its one JSON object."""
    import signal

    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
    fuse = FuseView(base, tmp_path / "view", options="attr_timeout=0,entry_timeout=0")
    view = fuse.mount()
    daemon = fuse._daemon.pid
    run_cli = ("import sys, cli.main as m; m.HUNG_ROOT_S = 1.0; "
               "sys.argv = ['dbsync', *sys.argv[1:]]; m.main()")
    try:
        os.kill(daemon, signal.SIGSTOP)
        for args in (["status", view], ["status", "--json", view], ["verify", view],
                     ["watch", "--json", view]):
            done = subprocess.run([sys.executable, "-c", run_cli, *args], cwd=REPO, env=ENV,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 1, (args, done.stdout, done.stderr)
            assert "does not answer" in done.stderr and "hung mount" in done.stderr, args
            if "--json" in args:
                assert "does not answer" in json.loads(done.stdout)["error"]
    finally:
        os.kill(daemon, signal.SIGCONT)
        fuse.close()


@needs_root
@pytest.mark.parametrize("access", ["leased", "read-only"])
def test_a_shard_a_caching_mount_serves_from_stale_pages_is_read_again_not_called_damaged(
        tmp_path, access):
    """A caching mount (bindfs ``auto_cache``; NFS revalidates the same way, by attributes)
    keeps a file's pages while its attributes look unchanged. A reader that read a shard
    while the writer was still writing it (a head its cache showed late) can keep those
    pages although the file has changed since, when the writes left no newer time than the
    one it saw (the time is set before the bytes land, and to a clock tick). Its next load of
    that slot, stamp and head right, hashed the old pages and raised ``DamagedVersionError``
    for a whole version: 1 in ~10 runs of the soak above on a loaded machine. Here the race
    is made certain: after version 3 is written into version 1's slot, its shards' times are
    set back to what the reader saw. The load drops the mount's cached pages of the ranges
    that did not match, reads them again, and applies version 3, every byte of it."""
    base = tmp_path / "base"
    with dbsync.Sender(str(base)) as sender:
        sender.push(weights_for(1))  # slot a
        fuse = FuseView(base, tmp_path / "view",
                        options="auto_cache" + (",ro" if access == "read-only" else ""))
        try:
            receiver = dbsync.Receiver(fuse.mount())
            got = {name: torch.zeros_like(t) for name, t in weights_for(3).items()}
            assert receiver.load(got) == 1  # (slot a's pages now in the mount's cache)
            shards = sorted((base / "slots" / "a").glob("shard*"))
            assert shards
            seen = {path: os.stat(path).st_mtime_ns for path in shards}
            assert sender.push(weights_for(2)) == 2  # slot b
            assert sender.push(weights_for(3)) == 3  # slot a, its shards rewritten in place
            for path, mtime in seen.items():  # (the write the attributes did not reveal)
                os.utime(path, ns=(mtime, mtime))
            assert receiver.wait(newer_than=2, timeout=30) == 3  # (the mount's head cache)
            assert receiver.load(got) == 3
            assert receiver.read_only is (access == "read-only")
            assert sorted(got) == sorted(weights_for(3))
            assert all(torch.equal(got[k], v) for k, v in weights_for(3).items())
            receiver.close()
        finally:
            fuse.close()


@needs_root
def test_a_read_only_snapshot_stays_usable_after_its_slot_is_reused(tmp_path):
    """A snapshot opened through a read-only view holds a private copy; once every checksum of
    that copy matched, it is the version, even if the writer has reused the slot since (no
    lease there keeps it out). Before, ``tensors()`` then raised (a private class of
    ``LeaseExpiredError`` saying "what was read cannot be trusted"), at random under a busy
    writer: 6 of 291 opens in a field test."""
    base = str(tmp_path / "base")
    with dbsync.Sender(base) as sender:
        sender.push(weights_for(1))
        with read_only_view(base, tmp_path / "view") as view:
            receiver = dbsync.Receiver(view)
            with receiver.open() as snap:
                assert not snap.leased
                assert sender.push(weights_for(2)) == 2
                assert sender.push(weights_for(3)) == 3  # into version 1's slot
                assert Store(base).read_stamp(snap.manifest.slot)[0] == 3
                got = dict(snap.tensors())
                assert snap.version == 1
                assert {float(t.flatten()[0]) for t in got.values()} == {1.0}
                assert sorted(got) == sorted(weights_for(1))
                snap.check_unchanged()  # (as serve-vllm's controller does after an apply)
            receiver.close()


# ---- 4, 5. containers and other hosts --------------------------------------------------------
@needs_root
@pytest.mark.parametrize("where", ["container", "other-host"])
def test_live_reader_in_another_namespace_keeps_its_slot(root, tmp_path, where):
    """container: the writer's hostname, another PID namespace (its pid means nothing to the
    writer). other-host: its own hostname and a lease timeout (2 s) four times the writer's
    (0.5 s). Either way a live, heart-beating reader holding version 1 for 1.5 s is waited for,
    and the bytes it reads at the end are still version 1's."""
    hostname = None if where == "container" else "reader-host"
    pid = pid_free_here()
    with dbsync.Sender(root, lease_timeout=0.5) as sender:
        sender.push(weights_for(1))
        ready, out = tmp_path / "ready.json", tmp_path / "out.json"
        reader = in_namespace(hostname, pid, "hold", root, str(ready), str(out), "4.0", "1.5")
        try:
            info = wait_json(ready, reader)
            assert info["version"] == 1 and info["leased"]
            assert info["host"] == (hostname or socket.gethostname())
            if where == "container":
                assert info["pid"] == pid and not os.path.exists(f"/proc/{pid}")
            assert sender.push(weights_for(2)) == 2  # the other slot: free
            start = time.monotonic()
            assert sender.push(weights_for(3)) == 3  # the reader's slot
            flipped = time.monotonic()
            held = wait_json(out, reader)
        finally:
            kill(reader)
    assert held == {**held, "version": 1, "values": [1.0], "trusted": True}
    assert flipped >= held["released_at"], "the writer rewrote a slot a live reader held"
    assert sender.last_push_seconds["wait_for_readers"] <= flipped - start
    assert flipped - start >= 0.5, "the hold outlasted the writer's own lease timeout"


@needs_root
def test_status_judges_a_container_reader_by_its_beat(root, tmp_path):
    """A receiver with the writer's hostname in another PID namespace: its pid means nothing
    here, so `dbsync status` must not call it dead while it beats (nor alive once it stops)."""
    with dbsync.Sender(root, lease_timeout=1.0) as sender:
        sender.push(weights_for(1))
    ready = tmp_path / "ready.json"
    idle = in_namespace(None, pid_free_here(), "idle", root, str(ready), "1.0")
    try:
        reader_id = wait_json(ready, idle)["reader_id"]
        status = json.loads(cli("status", root, "--json").stdout)
        assert _state(status, reader_id) == "idle", status["receivers"]
    finally:
        kill(idle)


@needs_root
def test_a_reader_id_in_use_is_refused_until_its_reader_is_gone(root, tmp_path):
    """Two receivers sharing a reader id would overwrite each other's lease, and the writer
    could reuse a slot one of them reads. A receiver asking for an id that a live reader uses
    is refused: another open receiver of this process, a live process here (at once), a
    reader on another host whose beat moves (within a beat). Once that reader is gone the id
    is free: at once for a dead pid here, after the lease stood still for its own timeout
    for another host."""
    timeout = 1.0
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    mine = dbsync.Receiver(root, reader_id="engine-0")
    with pytest.raises(dbsync.ReaderIdInUseError, match="another open Receiver of this process"):
        dbsync.Receiver(root, reader_id="engine-0")
    mine.close()
    dbsync.Receiver(root, reader_id="engine-0").close()

    here_ready, far_ready = tmp_path / "here.json", tmp_path / "far.json"
    here = spawn("idle", root, str(here_ready), "30", "engine-1")
    far = in_namespace("far-host", None, "idle", root, str(far_ready), str(timeout), "engine-2")
    try:
        pid = wait_json(here_ready, here)["pid"]
        wait_json(far_ready, far)
        with pytest.raises(dbsync.ReaderIdInUseError, match=f"process {pid} on this host"):
            dbsync.Receiver(root, reader_id="engine-1")
        start = time.monotonic()
        with pytest.raises(dbsync.ReaderIdInUseError, match="a reader on host far-host"):
            dbsync.Receiver(root, reader_id="engine-2")
        assert time.monotonic() - start < timeout, "a moving beat is seen within a beat"
    finally:
        kill(here)
        kill(far)
    start = time.monotonic()
    with dbsync.Receiver(root, reader_id="engine-1") as taken:
        assert time.monotonic() - start < 0.5 * timeout  # its pid is gone: no wait
        assert taken.load(lambda pairs: None) == 1
    start = time.monotonic()
    with dbsync.Receiver(root, reader_id="engine-2") as taken:
        waited = time.monotonic() - start
        assert timeout <= waited <= 3 * timeout, waited
        assert Store(root).read_lease("engine-2")["host"] == socket.gethostname()


def test_a_reader_id_whose_pid_now_names_another_process_is_taken_over(root, tmp_path):
    """A receiver killed in a container, restarted in a new container with the same hostname:
    the kernel reuses freed PID-namespace numbers, so the new container can match the dead
    one's host, boot and namespace, and the dead reader's pid can be a sidecar's by now. The
    restarted receiver was refused ("written by process N on this host, which is alive") for
    as long as that process lived. A lease names when its process started: a pid alive but
    started later is another process, and the id is taken over at once."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    ready = tmp_path / "ready.json"
    reader = spawn("idle", root, str(ready), "30", "engine-3")
    try:
        dead_pid = wait_json(ready, reader)["pid"]
    finally:
        kill(reader)
    sidecar = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    try:
        store = Store(root)
        lease = store.read_lease("engine-3")
        assert lease["pid"] == dead_pid and isinstance(lease["pid_start"], int)
        store.write_lease("engine-3", dict(lease, pid=sidecar.pid))  # (the pid, reused)
        start = time.monotonic()
        with dbsync.Receiver(root, reader_id="engine-3") as taken:
            assert time.monotonic() - start < 1.0  # (no wait: its process is known gone)
            assert taken.load(lambda pairs: None) == 1
        with open(f"/proc/{sidecar.pid}/stat") as f:
            sidecar_start = int(f.read().rsplit(")", 1)[1].split()[19])
        # (the sidecar's own lease, as a receiver in it would write: it is alive)
        store.write_lease("engine-3", dict(lease, pid=sidecar.pid, pid_start=sidecar_start))
        with pytest.raises(dbsync.ReaderIdInUseError, match=f"process {sidecar.pid} on this"):
            dbsync.Receiver(root, reader_id="engine-3")
    finally:
        sidecar.stdin.close()
        sidecar.wait(10)


def _state(status: dict[str, Any], reader_id: str) -> str | None:
    for record in status["receivers"]:
        if record["id"] == reader_id:
            return record["state"]
    return None


@needs_root
def test_a_reader_dead_on_another_host_holds_up_max_lag_pushes_once(root, tmp_path):
    """`dbsync push --max-lag 0` once per checkpoint (a writer per push): a reader killed on
    another host, left behind, made every such push wait one lease timeout to see it dead,
    push after push, until its lease was removed minutes later. The first writer to see it
    dead leaves a note of the lease as it stood; the next writers find it unchanged and go on
    at once."""
    timeout = 1.0
    with dbsync.Sender(root, lease_timeout=timeout) as sender:
        sender.push(weights_for(1))
    ready = tmp_path / "ready.json"
    reader = in_namespace("far-host", None, "loaded", root, str(ready), str(timeout))
    try:
        assert wait_json(ready, reader)["version"] == 1
    finally:
        kill(reader)
    waits = []
    for version in range(2, 8):
        with dbsync.Sender(root, lease_timeout=timeout, max_lag=0) as sender:
            assert sender.push(weights_for(version)) == version
            seconds = sender.last_push_seconds
            waits.append(seconds["wait_for_lag"] + seconds["wait_for_readers"])
    print(f"max_lag pushes, one writer each, past a dead reader: waits {waits}")
    assert 0.5 * timeout <= waits[1] <= 1.5 * timeout, waits  # (version 3: it lags by 1)
    assert max(waits[2:]) < 0.3 * timeout, waits
    with dbsync.Receiver(root) as rx:
        dest = {k: torch.zeros_like(v) for k, v in weights_for(7).items()}
        assert rx.load(dest) == 7 and all(torch.equal(dest[k], v)
                                          for k, v in weights_for(7).items())


@needs_root
def test_dead_reader_on_another_host_costs_one_timeout(root, tmp_path):
    """A reader on another host (own UTS and PID namespaces) SIGKILLed while holding a slot
    stalls the writer once (<= 1.5 x lease_timeout over 10 pushes), is shown dead, and its
    lease is removed after the grace period. A SIGKILLed idle receiver is shown dead too."""
    timeout = 1.0
    with dbsync.Sender(root, lease_timeout=timeout) as sender:
        sender.push(weights_for(1))
        ready, idle_ready = tmp_path / "ready.json", tmp_path / "idle.json"
        holder = in_namespace("far-host", None, "hold", root, str(ready), str(tmp_path / "o"),
                              str(timeout), "forever")
        idle = spawn("idle", root, str(idle_ready), str(timeout))
        try:
            assert wait_json(ready, holder)["version"] == 1
            idle_id = wait_json(idle_ready, idle)["reader_id"]
        finally:
            kill(holder)
            kill(idle)
        leases = Store(root).read_leases()
        (far_id,) = [r for r, lease in leases.items() if lease.get("host") == "far-host"]
        first = json.loads(cli("status", root, "--json").stdout)
        assert _state(first, idle_id) == "dead", first["receivers"]
        library = dbsync.status.store_status(Store(root))  # the same, for library users
        assert _state(library, idle_id) == "dead", library["receivers"]

        stalls = []
        for version in range(2, 12):
            assert sender.push(weights_for(version)) == version
            stalls.append(sender.last_push_seconds["wait_for_readers"])
        print(f"dead reader on another host: writer stall over 10 pushes {sum(stalls):.3f} s "
              f"(lease_timeout {timeout} s)")
        assert 0.5 * timeout <= sum(stalls) <= 1.5 * timeout, stalls

        # `dbsync status` judges another host's lease by wall clock, with a margin (twice its
        # timeout): let that pass. No push meanwhile, so the writer removes nothing yet.
        last_beat = leases[far_id]["updated_at"]
        time.sleep(max(0.0, last_beat + 2 * timeout + 0.1 - time.time()))
        status = json.loads(cli("status", root, "--json").stdout)
        assert _state(status, far_id) == "dead", status["receivers"]
        lease_file = os.path.join(root, "readers", f"{far_id}.json")
        assert os.path.exists(lease_file), "shown dead before it is removed"
        deadline = time.monotonic() + 4 * timeout
        version = 11
        while os.path.exists(lease_file) and time.monotonic() < deadline:
            time.sleep(0.1)  # the grace period is a time: let it pass, pushing meanwhile
            version = sender.push(weights_for(version + 1))
        assert not os.path.exists(lease_file), "a dead lease is removed after the grace period"
        assert not os.path.exists(os.path.join(root, "readers", f"{idle_id}.json"))


@needs_root
def test_dead_reader_costs_one_timeout_across_writer_restarts(root, tmp_path):
    """`dbsync push` once per checkpoint: every push is a new Sender, knowing nothing of what
    earlier ones saw. A reader on another host SIGKILLed while holding a slot still costs one
    timeout in total, not one per push: once its slot was rewritten, its hold is void."""
    timeout = 1.0
    with dbsync.Sender(root, lease_timeout=timeout) as sender:
        sender.push(weights_for(1))
    ready = tmp_path / "ready.json"
    holder = in_namespace("far-host", None, "hold", root, str(ready), str(tmp_path / "o"),
                          str(timeout), "forever")
    try:
        assert wait_json(ready, holder)["version"] == 1
    finally:
        kill(holder)
    stalls = []
    for version in range(2, 8):
        with dbsync.Sender(root, lease_timeout=timeout) as sender:
            assert sender.push(weights_for(version)) == version
            stalls.append(sender.last_push_seconds["wait_for_readers"])
    assert sum(stalls) <= 1.5 * timeout, stalls


@pytest.mark.parametrize("host_of_the_noting_writer", ["this host", "an earlier pod"])
def test_a_starting_writer_removes_reader_files_abandoned_long_ago(root,
                                                                  host_of_the_noting_writer):
    """Leases of readers that died on other hosts are removed by the second writer that
    starts once they have not been written for their timeout, the grace and a margin, judged
    by the store's own clock (file times), when the first left a note that the lease stood
    still since; a live reader's lease and an in-flight temp file stay. The first writer may
    have run under another host name on the same machine (a trainer started as a new pod
    each time): its notes count all the same (they did not, and dead leases piled up for
    ever)."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    readers = os.path.join(root, "readers")
    with dbsync.Receiver(root, lease_timeout=1.0) as live:
        an_hour_ago = time.time() - 3600
        record = Store(root).read_leases()[live.reader_id]
        record.update(host="far-host", pid=4242, boot_id="other-boot", updated_at=an_hour_ago)
        abandoned = os.path.join(readers, "far-host-4242-0a1b2c3d.json")
        with open(abandoned, "w") as f:
            json.dump(record, f)
        old_tmp = os.path.join(readers, ".tmp-far-host-4242-0a1b2c3d.json-4242-00ff00ff")
        in_flight = os.path.join(readers, f".tmp-{live.reader_id}.json-{os.getpid()}-0a0b0c0d")
        for path in (old_tmp, in_flight):
            open(path, "w").close()
        for path in (abandoned, old_tmp):
            os.utime(path, (an_hour_ago, an_hour_ago))
        before = json.loads(cli("status", root, "--json").stdout)
        assert _state(before, "far-host-4242-0a1b2c3d") == "dead", before["receivers"]

        dbsync.Sender(root, lease_timeout=1.0).close()  # `dbsync push` starting up
        note = os.path.join(readers, ".stale-far-host-4242-0a1b2c3d")
        assert os.path.exists(abandoned) and os.path.exists(note)  # noted, not yet removed
        assert not os.path.exists(old_tmp)  # (a temp file goes on age alone)
        with open(note) as f:  # that writer started 2 min ago (on this host's clock)
            noted = json.load(f)
        if host_of_the_noting_writer != "this host":  # (what it writes under that name)
            noted["clock"] = ["trainer-pod-7f9c", *noted["clock"][1:]]
        with open(note, "w") as f:
            json.dump(dict(noted, noted_at=time.monotonic() - 120), f)
        dbsync.Sender(root, lease_timeout=1.0).close()  # the next `dbsync push`

        assert not os.path.exists(abandoned) and not os.path.exists(note)
        assert os.path.exists(in_flight), "a temp file being written was removed"
        assert os.path.exists(os.path.join(readers, f"{live.reader_id}.json"))
        assert load(live) == (1, [1.0])
        after = json.loads(cli("status", root, "--json").stdout)
        assert [r["id"] for r in after["receivers"]] == [live.reader_id]
        os.unlink(in_flight)


def test_a_note_left_by_a_writer_with_a_lagging_clock_removes_no_lease(root):
    """Where clients stamp files with their own clocks (Lustre), a starting writer whose clock
    lagged left a note that looked old at once, and the next writer, seconds later, removed
    the lease of a live reader (not renewed since: it renews every timeout / 4) and could
    overwrite its slot. The time since a note is now read from the noting host's monotonic
    clock: a note seconds old, or one left on another host, removes nothing."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    readers = os.path.join(root, "readers")
    with dbsync.Receiver(root, lease_timeout=1.0) as holder, holder.open() as snap:
        lease = os.path.join(readers, f"{holder.reader_id}.json")
        note = os.path.join(readers, f".stale-{holder.reader_id}")
        an_hour_ago = time.time() - 3600
        with holder._keeper.lock:  # (no renewal meanwhile: the beat stands still)
            os.utime(lease, (an_hour_ago, an_hour_ago))  # (its host's clock lags an hour)
            dbsync.Sender(root, lease_timeout=1.0).close()  # writer X notes it ...
            assert os.path.exists(note)
            os.utime(note, (an_hour_ago, an_hour_ago))  # ... by a clock that lags too
            dbsync.Sender(root, lease_timeout=1.0).close()  # writer Y, seconds later
            assert os.path.exists(lease), "a live reader's lease was removed"
            with open(note) as f:
                noted = json.load(f)
            with open(note, "w") as f:  # noted long ago, but on another host's clock
                json.dump(dict(noted, clock=["far-host", "other-boot", None],
                               noted_at=time.monotonic() - 3600), f)
            dbsync.Sender(root, lease_timeout=1.0).close()
            assert os.path.exists(lease), "a live reader's lease was removed"
        with dbsync.Sender(root, lease_timeout=1.0) as sender:
            assert sender.push(weights_for(2)) == 2  # (the other slot)
        assert {float(t.flatten()[0]) for _, t in snap.tensors()} == {1.0}
        snap.check_unchanged()


def test_a_starting_writer_keeps_old_looking_leases_of_live_readers(root, caplog):
    """A lease whose file time looks old (a reader's clock lagging where clients set file
    times, as on Lustre, or a clock stepped forward) is not removed while its reader lives:
    a starting writer notes it, and the next one keeps it because its beat moved (with a
    WARNING about clocks), here for a local reader holding version 1 and for one of another
    host; a lease that stood still between the two starts goes, and a local one whose pid is
    gone goes at once. Before, every `dbsync push` removed such leases and overwrote the slot
    under the reader."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    readers = os.path.join(root, "readers")
    long_ago = time.time() - 600

    def backdate(*paths: str, when: float = long_ago) -> None:
        for path in paths:
            os.utime(path, (when, when))

    def start_a_writer() -> None:  # `dbsync push` starting up
        dbsync.Sender(root, lease_timeout=1.0).close()

    def noted_ago(seconds: float, *notes: str) -> None:  # (by this host's monotonic clock)
        for note in notes:
            with open(note) as f:
                noted = json.load(f)
            with open(note, "w") as f:
                json.dump(dict(noted, noted_at=time.monotonic() - seconds), f)

    with dbsync.Receiver(root, lease_timeout=1.0) as holder, holder.open() as snap:
        lease = os.path.join(readers, f"{holder.reader_id}.json")
        own_note = os.path.join(readers, f".stale-{holder.reader_id}")
        record = Store(root).read_leases()[holder.reader_id]
        far_record = dict(record, host="far-host", pid=4242, boot_id="other-boot", beat=7)
        far = os.path.join(readers, "far-host-4242-0a1b2c3d.json")
        far_note = os.path.join(readers, ".stale-far-host-4242-0a1b2c3d")
        dead_record = dict(record, pid=_dead_pid())  # (a reader of this host that is gone)
        dead = os.path.join(readers, "dead-local-0a1b2c3d.json")
        for path, rec in ((far, far_record), (dead, dead_record)):
            with open(path, "w") as f:
                json.dump(rec, f)
        backdate(far, dead)

        with holder._keeper.lock:  # (no renewal of the holder's lease meanwhile)
            beat = Store(root).read_leases()[holder.reader_id]["beat"]
            backdate(lease)
            start_a_writer()
        assert not os.path.exists(dead), "a dead local reader's lease stayed"
        assert all(map(os.path.exists, (lease, own_note, far, far_note)))

        def holder_renewed(since: int) -> int:
            deadline = time.monotonic() + 30
            while (now := Store(root).read_leases()[holder.reader_id]["beat"]) == since:
                assert time.monotonic() < deadline, "the holder never renewed its lease"
                time.sleep(0.05)
            return now

        beat = holder_renewed(beat)  # the holder renews (its beat moves) ...
        far_record["beat"] = 8  # ... and so does the far reader
        with open(far, "w") as f:
            json.dump(far_record, f)
        backdate(far)
        with holder._keeper.lock:  # their file times still look old
            beat = Store(root).read_leases()[holder.reader_id]["beat"]
            backdate(lease)
            noted_ago(120, own_note, far_note)  # noted 2 min ago
            with caplog.at_level(logging.WARNING, logger="dbsync"):
                start_a_writer()
            assert os.path.exists(lease), "a live reader's lease was removed"
        assert os.path.exists(far), "a lease whose beat moved was removed"
        warned = [r.getMessage() for r in caplog.records if "renews its lease" in r.getMessage()]
        assert len(warned) == 2 and all("clock" in w for w in warned), warned

        noted_ago(120, far_note)
        start_a_writer()  # the far lease stood still since it was noted: gone now
        assert not os.path.exists(far) and not os.path.exists(far_note)
        assert os.path.exists(lease)

        holder_renewed(beat)
        with dbsync.Sender(root, lease_timeout=1.0) as sender:  # (the holder's lease is
            # fresh again: its note goes)
            assert sender.push(weights_for(2)) == 2  # (into the other slot)
        assert not os.path.exists(own_note)
        assert {float(t.flatten()[0]) for _, t in snap.tensors()} == {1.0}
        snap.check_unchanged()


def _dead_pid() -> int:
    """A pid of this host and PID namespace whose process has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---- 6. a new run at the same path -------------------------------------------------------------
def test_new_run_is_followed_and_rewind_refused(root, caplog):
    with dbsync.Sender(root) as sender:
        for version in range(1, 6):
            sender.push(weights_for(version))
        old_run = sender.run_id
    receiver = dbsync.Receiver(root, poll_interval=0.05)
    assert load(receiver) == (5, [5.0])
    seen: list[int] = []
    new_run_seen = threading.Event()
    watcher = receiver.watch(lambda v: (seen.append(v), v == 3 and new_run_seen.set()))
    try:
        shutil.rmtree(root)  # a new training run at the same path
        with dbsync.Sender(root) as sender:
            heads = []
            for version in (1, 2, 3):
                assert sender.push(weights_for(version)) == version
                heads.append(open(os.path.join(root, MANIFEST_FILE), "rb").read())
            assert sender.run_id != old_run
            assert new_run_seen.wait(20), f"the watcher saw only {seen}"
        assert receiver.wait(newer_than=5, timeout=10) == 3
        with caplog.at_level(logging.INFO, logger="dbsync"):
            assert load(receiver) == (3, [3.0])
        assert any("new run" in r.getMessage() and r.name.startswith("dbsync")
                   for r in caplog.records)
        assert seen[0] == 5 and seen[-1] == 3

        # A restored older head within the same run: refused loudly, nothing loaded.
        with open(os.path.join(root, ".restored"), "wb") as f:
            f.write(heads[1])
        os.replace(os.path.join(root, ".restored"), os.path.join(root, MANIFEST_FILE))
        applied: list[Any] = []
        with pytest.raises(dbsync.StoreRewoundError, match="version 3 to 2"):
            receiver.load(applied.append)
        assert applied == [] and receiver.loaded_version == 3
        # ... and the watcher says so until a newer version comes (serve-vllm's
        # store_problem: an operator saw nothing but a log line)
        rewound = wait_until(lambda: watcher.rewound, 20, 0.02, "the watcher to see the rewind")
        assert "went back from version 3 to 2 in the same run" in rewound

        # The trainer restarts on the restored store: it numbers on past what readers report
        # loaded, so the receiver takes its next push instead of ignoring it as one it has.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dbsync"), dbsync.Sender(root) as sender:
            assert sender.push(weights_for(7)) == 4
        assert any("restored from an older copy" in r.getMessage() for r in caplog.records)
        assert load(receiver) == (4, [7.0])
        wait_until(lambda: watcher.rewound is None, 20, 0.02, "the rewind to be over")
    finally:
        watcher.stop()
        receiver.close()


def test_a_new_run_at_the_path_never_waits_for_holds_of_the_old_run(root, tmp_path):
    """A reader (another process) holds version 1 of run 1 while the store is removed and made
    anew by a new training run; its heartbeat writes its lease, still holding slot "a" version
    1, into the new store. That hold names a version of another store: the new run's pushes
    into slot "a" (empty, then its own version 1) do not wait for it, while the reader, alive,
    keeps reading its old version's bytes."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    ready, out = tmp_path / "ready.json", tmp_path / "out.json"
    reader = spawn("hold", root, str(ready), str(out), "2.0", "forever")
    sender = None
    try:
        assert wait_json(ready, reader)["version"] == 1
        shutil.rmtree(root)  # a new training run at the same path
        sender = dbsync.Sender(root, lease_timeout=2.0)
        deadline = time.monotonic() + 20
        while not Store(root).read_leases():  # the old reader's next heartbeat
            assert time.monotonic() < deadline, "the reader's lease never came back"
            time.sleep(0.05)
        (lease,) = Store(root).read_leases().values()
        assert lease["held"][0][:2] == ["a", 1]
        for version in (1, 2, 3):  # slot a (empty), b, a (the new run's version 1)
            assert bounded(lambda v=version: sender.push(weights_for(10 + v)), 20) == version
            assert sender.last_push_seconds["wait_for_readers"] < 1.0
        assert reader.poll() is None
    finally:
        kill(reader)  # (first: a push still waiting for its hold ends, and close() returns)
        if sender is not None:
            sender.close()
    with dbsync.Receiver(root) as receiver:
        assert load(receiver) == (3, [13.0])


# ---- 7. transient errors -----------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO])
@pytest.mark.parametrize("target", ["dbsync.json", "index.json", "dbsync-slot.json", "shard"])
def test_transient_error_opening_a_version_marks_nothing_loaded(root, monkeypatch, code,
                                                                 target):
    """An ESTALE or EIO while opening version 2 (its head, index, stamp or a shard) raises,
    applies nothing, acknowledges nothing; the next load after the hiccup works."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
        receiver = dbsync.Receiver(root)
        assert load(receiver) == (1, [1.0])
        sender.push(weights_for(2))
    real = Store.open_regular

    def flaky(self: Store, parts: tuple[str, ...]) -> int:
        if parts[-1] == target or (target == "shard" and parts[-1].startswith("shard-")):
            raise OSError(code, os.strerror(code))
        return real(self, parts)

    monkeypatch.setattr(Store, "open_regular", flaky)
    applied: list[Any] = []
    with pytest.raises((OSError, dbsync.DBSyncError)):
        receiver.load(applied.append)
    assert applied == [], "nothing may be handed over"
    assert receiver.loaded_version == 1
    assert Store(root).read_leases()[receiver.reader_id]["loaded_version"] == 1
    monkeypatch.undo()
    assert load(receiver) == (2, [2.0])
    receiver.close()


# ---- 8. objects that hold the lock --------------------------------------------------------------
def test_dropped_or_failed_senders_release_the_lock(root, tmp_path, monkeypatch):
    dbsync.Sender(root).push({"w": torch.ones(2)})  # dropped without close()
    assert dbsync.Sender(root).push({"w": torch.full((2,), 2.0)}) == 2
    # dropped after a background push, its future still kept in a staging buffer: released
    # by reference counting alone (no cycle collection), once its publisher lets go of it
    gc.disable()
    try:
        background, released = dbsync.Sender(root), threading.Event()
        weakref.finalize(background, released.set)
        background.push({"w": torch.ones(2)}, blocking=False).result()
        del background
        assert released.wait(10), "a dropped Sender was kept alive"
        dbsync.Sender(root).close()
    finally:
        gc.enable()

    def eio(self: Store) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Store, "read_head", eio)
    with pytest.raises(OSError) as failed:  # kept alive, like a notebook's last traceback
        dbsync.Sender(root)
    monkeypatch.undo()
    gc.collect()
    with dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.full((2,), 3.0)}) == 4
    assert failed.value.errno == errno.EIO

    dropped = dbsync.Receiver(root)  # dropped without close(): its lease goes with it
    lease_file = os.path.join(root, "readers", f"{dropped.reader_id}.json")
    assert os.path.exists(lease_file)
    del dropped
    gc.collect()
    assert not os.path.exists(lease_file)
    assert not [t for t in threading.enumerate() if t.name == "dbsync-lease"]

    typo = str(tmp_path / "stroe")
    with pytest.raises(dbsync.StoreNotFoundError, match="does not exist"):
        dbsync.Receiver(typo)
    assert not os.path.exists(typo)


def test_closing_a_receiver_keeps_its_open_snapshots_safe_and_ends_everything_else(root):
    """A receiver closed (a shutdown path in another thread) while a snapshot is open: the
    snapshot's slot stays held until the snapshot closes (a push into it waits, the view keeps
    its bytes), then the lease goes. A wait() under way raises at once, the receiver's
    watchers stop, and open / load / wait / watch afterwards raise."""
    n = 1 << 16
    with dbsync.Sender(root, lease_timeout=1.0) as sender:
        sender.push({"w": torch.ones(n)})
        receiver = dbsync.Receiver(root, lease_timeout=1.0)
        snap = receiver.open()
        view = dict(snap.tensors())["w"]
        woken: list[tuple[BaseException, float]] = []
        waiting = threading.Event()

        def wait() -> None:
            waiting.set()
            try:
                receiver.wait(newer_than=99, timeout=60)
            except dbsync.DBSyncError as exc:
                woken.append((exc, time.monotonic()))

        waiter = threading.Thread(target=wait)
        waiter.start()
        waiting.wait()
        receiver.watch(lambda version: None)
        closed_at = time.monotonic()
        receiver.close()
        waiter.join(10)
        assert woken and "closed while waiting" in str(woken[0][0])
        assert woken[0][1] - closed_at < 1.0
        assert not [t for t in threading.enumerate() if t.name == "dbsync-watch"]
        for inotify in [t for t in threading.enumerate() if t.name == "dbsync-inotify"]:
            inotify.join(5)  # (it closes its inotify instance on its way out, after stop())
            assert not inotify.is_alive(), "a watcher's inotify thread outlived close()"
        for call in (receiver.open, lambda: receiver.load({"w": torch.zeros(n)}),
                     lambda: receiver.wait(timeout=0), lambda: receiver.watch(print)):
            with pytest.raises(dbsync.DBSyncError, match="is closed; create a new one"):
                call()

        assert sender.push({"w": torch.full((n,), 2.0)}) == 2  # the other slot
        into_held = threading.Thread(target=sender.push, args=({"w": torch.full((n,), 3.0)},))
        into_held.start()
        into_held.join(2.5)  # over twice the lease timeout: the closed receiver still beats
        assert into_held.is_alive(), "the writer reused a slot an open snapshot holds"
        assert torch.equal(view, torch.ones(n))
        snap.close()
        into_held.join(10)
        assert sender.latest_version() == 3
        assert sender.last_push_seconds["wait_for_readers"] >= 2.5
    assert not os.listdir(os.path.join(root, "readers")), "the lease goes with the last hold"
    assert not [t for t in threading.enumerate() if t.name == "dbsync-lease"]
    dbsync.Receiver(root, reader_id=receiver.reader_id).close()  # its id is free again

    # a snapshot dropped without close() ends its hold too, the closed receiver's lease with
    # it (not the writer's problem forever)
    dropped = dbsync.Receiver(root)
    forgotten = dropped.open()
    dropped.close()
    assert os.listdir(os.path.join(root, "readers")), "the hold keeps the lease"
    del forgotten
    gc.collect()
    for heartbeat in [t for t in threading.enumerate() if t.name == "dbsync-lease"]:
        heartbeat.join(10)  # (the heartbeat thread ends the hold of a collected snapshot)
    assert not os.listdir(os.path.join(root, "readers"))

    # a read-only receiver sharing a live receiver's id leaves that receiver's lease alone
    with dbsync.Receiver(root, reader_id="live") as live:
        dbsync.Receiver(root, reader_id="live", read_only=True).close()
        assert Store(root).read_lease("live")["pid"] == os.getpid()
        assert live.load(lambda pairs: None) == 3

    # two watchers whose callbacks both close the receiver at once: neither waits forever
    both = threading.Barrier(2)
    closing = dbsync.Receiver(root, poll_interval=0.05)
    closed: list[str] = []
    all_closed = threading.Event()

    def close_from_callback(version: int) -> None:
        both.wait(10)
        closing.close()
        closed.append(threading.current_thread().name)
        if len(closed) == 2:
            all_closed.set()

    closing.watch(close_from_callback)
    closing.watch(close_from_callback)
    assert all_closed.wait(10), "close() from two watcher callbacks deadlocked"


# ---- 9. logging ---------------------------------------------------------------------------------
@needs_root
def test_failed_background_push_is_logged_and_kept(tmp_path, caplog):
    with tmpfs(tmp_path / "small", "2m") as small:
        root = os.path.join(small, "store")
        with dbsync.Sender(root) as sender, caplog.at_level(logging.INFO, logger="dbsync"):
            sender.push(weights_for(1))
            future = sender.push({"w": torch.zeros(1 << 20)}, blocking=False)  # 4 MiB: no fit
            with pytest.raises(dbsync.StoreFullError):
                future.result(timeout=30)
            failure = sender.last_error
            assert isinstance(failure, dbsync.StoreFullError)
            logged = [r for r in caplog.records if r.name.startswith("dbsync")
                      and r.levelno >= logging.WARNING and "background push" in r.getMessage()]
            assert logged and str(failure) in logged[0].getMessage()

            writing, go = threading.Event(), threading.Event()

            def hold_the_write(done: int, total: int) -> None:
                writing.set()
                go.wait(30)

            nxt = sender.push(weights_for(2), blocking=False, progress=hold_the_write)
            assert writing.wait(30)
            assert sender.last_error is failure, "kept while the next push runs"
            go.set()
            assert nxt.result(timeout=30) == 2


@needs_root
def test_default_reader_ids_work_on_any_hostname_and_differ_between_containers(tmp_path):
    """Two containers sharing a hostname the kernel left unset (``(none)``, not a valid id)
    and a pid (each in its own PID namespace): each opens a Receiver without a reader id and
    loads, and their engines' role ids (the vLLM staging reader's) differ, each steady within
    its process."""
    root = str(tmp_path / "store")
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
    outs = [str(tmp_path / f"ids{k}.json") for k in range(2)]
    procs = [in_namespace("(none)", 4242, "default_ids", root, out) for out in outs]
    try:
        got = [wait_json(out, proc) for out, proc in zip(outs, procs, strict=True)]
    finally:
        for proc in procs:
            kill(proc)
    for record in got:
        assert record["version"] == 1
        assert record["receiver"].startswith("_none_-4242-")
        assert record["role"][0] == record["role"][1]
        assert record["role"][0].startswith("_none_-4242-")
        assert record["role"][0].endswith("-vllm-staging")
    assert got[0]["role"][0] != got[1]["role"][0]


@needs_root
def test_a_store_that_turns_read_only_mid_push_is_reported_plainly(tmp_path):
    """The store's filesystem turns read-only in the middle of a push (ext4's
    errors=remount-ro after a disk error): the push says so and what to do, publishes
    nothing, and readers keep loading the version before it."""
    with ext4_that_fails(tmp_path / "disk") as fail:
        root = str(tmp_path / "disk" / "store")
        with dbsync.Sender(root) as sender:
            sender.push(weights_for(1))

            def midway(done: int, total: int) -> None:
                if done > total // 2:
                    fail()

            with pytest.raises(dbsync.StoreReadOnlyError, match="is read-only .* nothing was "
                               "published. Make it writable, then push again") as err:
                sender.push({k: v.repeat(256) for k, v in weights_for(2).items()},
                            progress=midway)
            assert isinstance(err.value, OSError) and err.value.errno == errno.EROFS
        got: list[list[float]] = []
        with dbsync.Receiver(root) as rx:
            assert rx.load(lambda pairs: got.append(values_of(pairs))) == 1
        assert got == [expected_values(1)]


@needs_root
def test_a_mount_whose_path_holds_a_tab_or_backslash_is_told_by_its_own_type(tmp_path):
    """The kernel escapes a mount point's tab, newline and backslash in mountinfo: such a
    mount is still told by its own type (an NFS or FUSE mount there must be polled)."""
    from dbsync.watch import mount_type

    for name in ("with\ttab", "back\\slash", "new\nline", "with space"):
        with tmpfs(tmp_path / name, "1m") as path:
            assert mount_type(os.path.join(path, "store")) == "tmpfs", name


@needs_root
def test_one_reader_id_through_two_bind_mounts_of_a_store_is_refused_in_one_process(tmp_path):
    """A process opening a second Receiver with the id of its first, through another bind
    mount of the same store, is refused as through the same path (the two would overwrite
    each other's lease)."""
    store = tmp_path / "a" / "store"
    with dbsync.Sender(store) as sender:
        sender.push(weights_for(1))
    view = tmp_path / "b"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path / "a"), str(view)], check=True)
    try:
        with dbsync.Receiver(store, reader_id="engine-0"):
            with pytest.raises(dbsync.DBSyncError, match="another open Receiver of this process"):
                dbsync.Receiver(view / "store", reader_id="engine-0")
    finally:
        subprocess.run(["umount", str(view)], check=False)


@needs_root
def test_a_reader_through_an_overlay_over_a_live_store_is_warned(tmp_path, caplog):
    """A store reached through an overlay whose lower layer is the trainer's store (a
    container image built over it) is not reliably seen, and the reader's lease is invisible
    to the trainer: the reader warns, naming both and what to do. A store written through the
    overlay (a shipped store continued in the container), or made inside it (its upper layer,
    as in one container's own filesystem), is fine: no warning."""
    for d in ("store", "upper", "work", "merged"):
        (tmp_path / d).mkdir()
    with dbsync.Sender(tmp_path / "store") as sender:
        sender.push(weights_for(1))
    merged = tmp_path / "merged"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={tmp_path / 'store'},upperdir={tmp_path / 'upper'},"
                    f"workdir={tmp_path / 'work'}", str(merged)], check=True)
    try:
        with caplog.at_level(logging.WARNING, logger="dbsync"):
            dbsync.Receiver(merged).close()
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1
        assert f"whose lower layer {tmp_path / 'store'} holds the store" in warned[0]
        assert "Mount the store directory itself" in warned[0]
        caplog.clear()
        # an image that ships a store, continued by a trainer through the overlay: the store
        # is written through it (its manifest now in the upper layer), nothing to warn of
        with dbsync.Sender(merged) as sender:
            assert sender.push(weights_for(2)) == 2
        with caplog.at_level(logging.WARNING, logger="dbsync"), dbsync.Receiver(merged) as rx:
            assert rx.load(lambda pairs: None) == 2
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        caplog.clear()
        with dbsync.Sender(merged / "own") as sender:
            sender.push(weights_for(1))
        with caplog.at_level(logging.WARNING, logger="dbsync"), \
                dbsync.Receiver(merged / "own") as rx:
            assert rx.load(lambda pairs: None) == 1
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
    finally:
        subprocess.run(["umount", str(merged)], check=False)


def test_a_watched_store_that_vanishes_is_said_and_its_return_followed(root, caplog):
    """The store a watcher follows is removed (unmounted, or a new run about to start): the
    watcher says so once (a WARNING, and ``last_error`` for status pages) instead of going
    quiet, and follows the new run's first version once it is published."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
        old_run = sender.run_id
    seen: list[int] = []
    arrived = threading.Event()
    watcher = dbsync.Watcher(root, lambda v: (seen.append(v), arrived.set()),
                             poll_interval=0.05, use_polling=True)
    with caplog.at_level(logging.WARNING, logger="dbsync"):
        watcher.start()
        try:
            assert arrived.wait(10) and seen == [1]
            arrived.clear()
            shutil.rmtree(root)
            deadline = time.monotonic() + 10
            while watcher.last_error is None:
                assert time.monotonic() < deadline, "the store's removal was never said"
                time.sleep(0.02)
            assert "no longer holds a published version" in str(watcher.last_error)
            with dbsync.Sender(root) as sender:
                sender.push(weights_for(5))
                assert sender.run_id != old_run
            assert arrived.wait(10) and seen == [1, 1]
        finally:
            watcher.stop()
    said = [r for r in caplog.records if "no longer holds" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert watcher.last_error is None


@pytest.mark.parametrize("how", ["made anew", "symlink re-pointed"])
def test_a_sender_whose_root_was_replaced_refuses_to_push(tmp_path, how):
    """A trainer still running (a zombie) after its store was removed and made anew by a new
    run, or after the symlink it was given was re-pointed to another store: its lock guards
    the old directory, so it refuses to push (naming why) instead of publishing into a store
    another writer holds; the new store keeps its own versions."""
    runs = [tmp_path / "run-a", tmp_path / "run-b"]
    for run in runs:
        run.mkdir()
    current = tmp_path / "current"  # (a link to the current run's directory)
    os.symlink(runs[0], current)
    root = str(current / "store")
    old = dbsync.Sender(root)
    try:
        assert old.push(weights_for(1)) == 1
        if how == "made anew":
            shutil.rmtree(root)
            target = root
        else:
            os.unlink(current)
            os.symlink(runs[1], current)
            target = str(runs[1] / "store")
        with dbsync.Sender(target) as new:
            assert new.push(weights_for(7)) == 1
            with pytest.raises(dbsync.DBSyncError, match="since this Sender locked it"):
                old.push(weights_for(2))
            assert new.push(weights_for(8)) == 2
    finally:
        old.close()
    with dbsync.Receiver(target) as receiver:
        assert load(receiver) == (2, [8.0])


@pytest.mark.parametrize("how", ["made anew", "symlink re-pointed"])
def test_a_root_replaced_during_a_push_keeps_the_old_writer_out_of_the_new_store(
        tmp_path, how):
    """ROOT is replaced while a trainer's push is writing (an operator starts a new run at the
    path and its trainer publishes two versions), and the old trainer's push goes on: it used
    to look ROOT up by path for each shard, so its later shards landed in the new run's
    current slot. A leased reader of the new run loaded that version "verified" with tensors
    of the other run, and later loads called it damaged. Now everything the old writer does
    stays in the directory it locked: its push fails saying why, and the new run's version is
    whole."""
    runs = [tmp_path / "run-a", tmp_path / "run-b"]
    for run in runs:
        run.mkdir()
    current = tmp_path / "current"
    os.symlink(runs[0], current)
    root = str(current / "store")
    target = root if how == "made anew" else str(runs[1] / "store")
    many = {f"t{i:03d}": torch.full((4096,), 3.0) for i in range(64)}  # 64 shards of 16 KiB
    replaced = threading.Event()

    def replace_root(done: int, total: int) -> None:  # (from the old push's writer threads)
        if replaced.is_set():
            return
        replaced.set()
        if how == "made anew":
            shutil.rmtree(root)
        else:
            os.unlink(current)
            os.symlink(runs[1], current)
        with dbsync.Sender(target) as new:
            new.push({n: torch.full((4096,), 7.0) for n in many})
            new.push({n: torch.full((4096,), 8.0) for n in many})  # (into slot b, as A's)

    with dbsync.Sender(root, num_threads=1) as old:
        old.shard_bytes = 16 * 1024
        old.push({n: torch.full((4096,), 1.0) for n in many})  # (slot a; the next is b)
        with pytest.raises(dbsync.DBSyncError, match="since this Sender locked it"):
            old.push(many, progress=replace_root)
    assert replaced.is_set()
    with dbsync.Receiver(target) as receiver:
        assert load(receiver) == (2, [8.0])
    verified = subprocess.run([sys.executable, "-m", "cli.main", "verify", target],
                              cwd=REPO, capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_waiting_across_a_new_run_returns_once_then_blocks(root):
    """A receiver that loaded version 2 waits while a new run starts at the path and publishes
    its version 1: ``wait(newer_than=2)`` returns 1 once, and ``wait(newer_than=1)`` then
    waits for that run's version 2 (it returned 1 again at once, forever: a spinning loop)."""
    with dbsync.Sender(root) as sender:
        sender.push(weights_for(1))
        sender.push(weights_for(2))
    with dbsync.Receiver(root, poll_interval=0.05) as receiver:
        assert load(receiver) == (2, [2.0])
        shutil.rmtree(root)
        with dbsync.Sender(root) as sender:
            sender.push(weights_for(11))
            assert receiver.wait(newer_than=2, timeout=10) == 1
            assert receiver.wait(newer_than=1, timeout=0.3) is None
            sender.push(weights_for(12))
            assert receiver.wait(newer_than=1, timeout=10) == 2


@needs_root
def test_a_sender_whose_fuse_mount_died_and_came_back_refuses_to_publish(tmp_path):
    """The FUSE daemon under a trainer's store is killed and the mount made again: the old
    Sender's lock now guards nothing (another writer can take the new mount's lock), so its
    next push is refused, naming the lost lock, and publishes nothing; a new Sender publishes.
    (It went on publishing beside the new writer: the store was damaged over and over.)"""
    base = tmp_path / "base"
    base.mkdir()
    # (no attribute cache: the old lock's fstat asks the dead daemon at once, as it does
    # once the cache expired, after 1 s by default)
    fuse = FuseView(base, tmp_path / "view", options="attr_timeout=0")
    root = os.path.join(fuse.mount(), "store")
    try:
        sender = dbsync.Sender(root, durable=False)
        assert sender.push({"w": torch.ones(4)}) == 1
        fuse.kill()
        fuse.mount()
        with pytest.raises(dbsync.DBSyncError, match="cannot be reached any more") as raised:
            sender.push({"w": torch.full((4,), 2.0)})
        assert "close this Sender and create a new one" in str(raised.value)
        sender.close()
        with dbsync.Receiver(root) as receiver:
            dest = {"w": torch.zeros(4)}
            assert receiver.load(dest) == 1 and torch.equal(dest["w"], torch.ones(4))
        with dbsync.Sender(root, durable=False) as again:
            assert again.push({"w": torch.full((4,), 3.0)}) == 2
    finally:
        fuse.close()


@needs_root
def test_readers_of_a_dead_fuse_mount_get_one_error_class_and_recover_after_a_remount(
        tmp_path):
    """The FUSE daemon under a store is killed (ENOTCONN): a receiver that had loaded from it
    gets ``StoreUnreachableError`` (a ``DBSyncError`` and an ``OSError`` with its errno, saying
    to check the mount) from ``load`` and ``latest_version``, not a bare ``OSError``; once
    remounted, the same receiver loads again. A lazy unmount (the path now shows the empty
    directory under it) is not "nothing published yet, push one"."""
    base = tmp_path / "store"  # mounted as the store's root itself
    with dbsync.Sender(base, durable=False) as sender:
        sender.push({"w": torch.ones(4)})
    fuse = FuseView(base, tmp_path / "view", options="attr_timeout=0,entry_timeout=0")
    root = fuse.mount()
    try:
        with dbsync.Receiver(root) as receiver:
            dest = {"w": torch.zeros(4)}
            assert receiver.load(dest) == 1
            fuse.kill()  # (and lazily unmounted: the path shows the empty directory below)
            with pytest.raises(dbsync.StoreNotFoundError) as raised:
                receiver.load(dest)
            assert "no longer holds a published version" in str(raised.value)
            assert "push one first" not in str(raised.value)
            fuse.mount()
            assert receiver.load(dest) == 1 and torch.equal(dest["w"], torch.ones(4))
        with dbsync.Receiver(root) as receiver:
            receiver.load(dest)
            dead = FuseView(base, tmp_path / "view", options="attr_timeout=0,entry_timeout=0")
            fuse._daemon.kill()  # dead, still mounted: ENOTCONN
            fuse._daemon.wait()
            for call in (lambda: receiver.load(dest), receiver.latest_version):
                with pytest.raises(dbsync.StoreUnreachableError) as raised:
                    call()
                assert isinstance(raised.value, OSError)
                assert raised.value.errno == errno.ENOTCONN
                assert "check the mount" in str(raised.value)
            subprocess.run(["umount", "-l", str(tmp_path / "view")], check=False)
            dead.mount()
            assert receiver.load(dest) == 1
            dead.close()
    finally:
        fuse.close()


@needs_root
def test_two_writers_the_lock_does_not_keep_apart_never_give_a_version_two_contents(tmp_path):
    """Two trainers whose writer locks do not meet (one through a FUSE view, one through the
    directory: as two NFS clients without a working lock service), the first paused while
    the second pushes: the first numbered on from its stale version and flipped, so one
    version number named two contents and watchers ignored the second. It now refuses to
    publish, naming the other writer; the store keeps the other writer's versions intact."""
    base = tmp_path / "base"
    fuse = FuseView(base, tmp_path / "view", options="attr_timeout=0,entry_timeout=0")
    with dbsync.Sender(base) as trainer:
        trainer.push(weights_for(1))
        view = fuse.mount()
        try:
            try:
                stale = dbsync.Sender(view)
            except dbsync.StoreBusyError:
                pytest.skip("the writer locks meet through this bindfs")
            with stale:
                assert trainer.push(weights_for(2)) == 2  # while the other one is paused
                with pytest.raises(dbsync.StoreBusyError, match="another writer published "
                                   f"version 2 into {view}.*pid {os.getpid()}.*Nothing was "
                                   "published"):
                    stale.push(weights_for(99))
            with dbsync.Receiver(base) as receiver:
                assert load(receiver) == (2, expected_values(2))
        finally:
            fuse.close()


@needs_root
def test_a_writer_refused_by_one_in_another_container_is_not_told_it_holds_the_lock(root):
    """Two trainer containers with host networking (the same hostname), each trainer pid 1 of
    its own PID namespace: the second was refused, rightly, but told the lock was held by
    "this process itself" and to close its own Sender. The lock now records the holder's
    boot and PID namespace: it is named as a process of another PID namespace."""
    hold = ("import sys, dbsync; s = dbsync.Sender(sys.argv[1]); print('locked', flush=True); "
            "sys.stdin.read()")
    attempt = ("import os, sys, dbsync\n"
               "try:\n    dbsync.Sender(sys.argv[1])\n"
               "except dbsync.StoreBusyError as exc:\n    print(os.getpid(), exc)\n")
    unshare = ["unshare", "--pid", "--fork", "--kill-child"]
    holder = subprocess.Popen([*unshare, sys.executable, "-c", hold, root], env=ENV,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = subprocess.run([*unshare, sys.executable, "-c", attempt, root], env=ENV,
                                 capture_output=True, text=True, timeout=120)
        assert refused.stdout.startswith("1 another writer holds"), refused
        assert "process 1 of another PID namespace" in refused.stdout, refused.stdout
        assert "this process itself" not in refused.stdout
    finally:
        holder.kill()
        holder.wait()
