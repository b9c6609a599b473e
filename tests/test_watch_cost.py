"""What an idle watcher costs: how often it reads the manifest when nothing changes, how fast it
notices a flip, and what it does with a garbled manifest (one log line, no spinning)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time

import pytest
import torch

import dbsync
from dbsync.format import MANIFEST_FILE
from dbsync.store import Store
from dbsync.watch import MIN_CHECK_INTERVAL, RunVersion, Watcher, read_head


class Counting:
    """The real head read, counting its calls (each one is an open + read)."""

    def __init__(self, root: str):
        self.store = Store(root)
        self.calls = 0

    def __call__(self) -> bytes | None:
        self.calls += 1
        return self.store.read_head_bytes()


class Seen:
    """Callback recording versions; ``until(v)`` waits (bounded) for ``v`` to be reported."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.at: dict[int, float] = {}
        self._cond = threading.Condition()

    def __call__(self, version: int) -> None:
        with self._cond:
            self.versions.append(version)
            self.at[version] = time.monotonic()
            self._cond.notify_all()

    def until(self, version: int, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: version in self.versions, timeout)


def idle(seconds: float) -> None:
    """Let time pass (the quantity measured is what happens meanwhile)."""
    threading.Event().wait(seconds)


@pytest.fixture
def store(root) -> str:
    with dbsync.Sender(root, durable=False) as sender:
        sender.push({"w": torch.ones(4)})
    return root


def push(root: str, value: float) -> int:
    with dbsync.Sender(root, durable=False) as sender:
        return sender.push({"w": torch.full((4,), value)})


def test_idle_inotify_watcher_reads_a_handful_of_times_and_notices_a_flip_fast(store):
    probe, seen = Counting(store), Seen()
    with Watcher(store, seen, use_polling=False, probe=probe) as watcher:
        assert watcher.mode == "inotify" and seen.until(1)
        # Others reading the manifest (opens, reads, closes) must not wake the watcher.
        reader = dbsync.Receiver(store)
        for _ in range(500):
            assert reader.latest_version() == 1
        idle(2.0)
        idle_reads = probe.calls
        assert idle_reads <= 2, f"{idle_reads} manifest reads in 2 idle seconds"
        published = time.monotonic()
        assert push(store, 2.0) == 2
        assert seen.until(2)
        noticed = seen.at[2] - published
        reader.close()
    assert seen.versions == [1, 2]
    assert noticed < 0.5, f"flip noticed after {noticed * 1000:.0f} ms"
    assert probe.calls - idle_reads <= 3  # one flip = a few events, coalesced
    assert watcher.parses <= watcher.reads == probe.calls


def test_unchanged_manifest_is_not_parsed_again(store):
    heads: list[RunVersion] = []

    def head(raw: bytes) -> RunVersion:
        heads.append(read_head(Store(store), raw))
        return heads[-1]

    seen = Seen()
    with Watcher(store, seen, use_polling=True, poll_interval=0.02, head=head) as watcher:
        assert seen.until(1)
        idle(0.5)
        assert watcher.reads >= 10  # it polled
        assert len(heads) == 1  # but parsed only once: the bytes never changed
        push(store, 3.0)
        assert seen.until(2)
    assert len(heads) == 2


def test_garbled_manifest_is_logged_once_and_never_spins(store, caplog):
    caplog.set_level(logging.INFO, logger="dbsync")
    seen = Seen()
    path = os.path.join(store, MANIFEST_FILE)
    with Watcher(store, seen, use_polling=False, safety_interval=0.02) as watcher:
        assert seen.until(1)
        with open(path, "rb") as f:
            good = f.read()
        with open(path, "wb") as f:  # in place, not atomic: several events
            f.write(b'{"format": "dbsync", "format_')
        idle(2.0)  # (a head that is no JSON is read again for 1.3 s before it is damage)
        assert isinstance(watcher.last_error, dbsync.FormatError)
        assert watcher.reads <= 2.0 / 0.02 + 10  # the safety rate, nothing more
        assert watcher.parses <= 4  # once per change of the bytes, not per look
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and MANIFEST_FILE in warnings[0].getMessage()
        with open(path + ".tmp", "wb") as f:
            f.write(good)
        os.replace(path + ".tmp", path)  # repaired by hand
        push(store, 4.0)
        assert seen.until(2)
        assert watcher.last_error is None
    assert seen.versions == [1, 2]
    assert any("reads well again" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("raised", [SystemExit(3), asyncio.CancelledError()],
                         ids=["SystemExit", "CancelledError"])
def test_a_callback_raising_systemexit_or_cancelled_keeps_the_watcher_going(store, raised,
                                                                             caplog):
    """A callback that calls sys.exit() or runs cancelled asyncio code: kept in
    ``last_error`` and logged, and the next version is delivered. (Both ended the watcher's
    thread unheard: no later version, ``last_error`` None.)"""
    caplog.set_level(logging.INFO, logger="dbsync")
    seen, error_then = Seen(), []

    def callback(version: int) -> None:
        if version == 1:
            seen(version)
            raise raised
        error_then.append(watcher.last_error)  # (what the first callback left)
        seen(version)

    with Watcher(store, callback, use_polling=False) as watcher:
        assert seen.until(1)
        push(store, 2.0)
        assert seen.until(2)
    assert seen.versions == [1, 2] and error_then == [raised]
    assert any("callback failed for version 1" in r.getMessage() for r in caplog.records)


def test_stop_cuts_the_rereads_of_a_garbled_head_short(store, monkeypatch):
    """A head that is no JSON is read again for 1.3 s (FUSE caches); a watcher stopped in the
    middle of that stops at once and judges nothing."""
    path = os.path.join(store, MANIFEST_FILE)
    with open(path, "wb") as f:
        f.write(b'{"format": "dbsync", "format_')
    reads = 0
    in_long_pause = threading.Event()
    read_small = Store.read_small

    def counting(self, parts, limit):
        nonlocal reads
        raw = read_small(self, parts, limit)
        if parts == (MANIFEST_FILE,):
            reads += 1
            if reads == 3:  # the next pause is the 1 s one
                in_long_pause.set()
        return raw

    monkeypatch.setattr(Store, "read_small", counting)
    watcher = Watcher(store, Seen(), use_polling=True, poll_interval=0.02).start()
    try:
        assert in_long_pause.wait(10)
    finally:
        began = time.monotonic()
        watcher.stop()
        took = time.monotonic() - began
    assert took < 0.5, f"stop() took {took:.2f} s"
    assert reads == 3 and watcher.last_error is None


def test_polling_is_bounded_and_stop_is_immediate(store):
    seen = Seen()
    with Watcher(store, seen, use_polling=True, poll_interval=0) as watcher:
        assert seen.until(1)
        start = watcher.reads
        idle(0.5)
        assert watcher.reads - start <= 0.5 / MIN_CHECK_INTERVAL + 5
        assert watcher.parses == 1
    slow = Watcher(store, Seen(), use_polling=True, poll_interval=60).start()
    t0 = time.monotonic()
    slow.stop()
    assert time.monotonic() - t0 < 1.0


def test_a_new_run_is_followed_even_with_a_lower_version(store, caplog):
    """The head is (run id, version): a different run id restarts the count."""
    caplog.set_level(logging.INFO, logger="dbsync")
    state: dict[str, object] = {"bytes": b"1", "head": RunVersion("run-a", 5)}
    seen = Seen()
    with Watcher(store, seen, use_polling=True, poll_interval=0.01,
                 probe=lambda: state["bytes"], head=lambda raw: state["head"]) as watcher:
        assert seen.until(5)
        state.update(bytes=b"2", head=RunVersion("run-a", 6))
        assert seen.until(6)
        state.update(bytes=b"3", head=RunVersion("run-b", 1))
        assert seen.until(1)
        assert watcher.run_id == "run-b" and watcher.last_version == 1
        state.update(bytes=b"4", head=RunVersion("run-b", 2))
        assert seen.until(2)
    assert seen.versions == [5, 6, 1, 2]
    assert sum("new training run" in r.getMessage() for r in caplog.records) == 1


def test_last_version_reset_asks_for_a_retry(store):
    """A caller whose apply failed resets ``last_version``; the next look reports again."""
    seen = Seen()
    fail = [True]

    def on_version(version: int) -> None:
        seen(version)
        if fail[0]:
            fail[0] = False
            watcher.last_version = None  # retry
    watcher = Watcher(store, on_version, use_polling=False, safety_interval=0.05)
    with watcher:
        assert seen.until(1)
        deadline = time.monotonic() + 5
        while seen.versions.count(1) < 2 and time.monotonic() < deadline:
            idle(0.02)
    assert seen.versions == [1, 1]


def test_store_directory_replaced_is_watched_again(root):
    push(root, 1.0)
    seen = Seen()
    with Watcher(root, seen, use_polling=False, poll_interval=0.05, safety_interval=60):
        assert seen.until(1)
        shutil.rmtree(root)
        push(root, 1.0)
        push(root, 2.0)  # version 2 of the new store: newer than 1
        assert seen.until(2, timeout=5)  # long before the 60 s safety look


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_manifest_that_is_not_a_regular_file_never_blocks_the_watcher(store, tmp_path, caplog,
                                                                       kind):
    """A FIFO would block a plain open; a symlink would read outside the store."""
    caplog.set_level(logging.WARNING, logger="dbsync")
    path = os.path.join(store, MANIFEST_FILE)
    with open(path, "rb") as f:
        good = f.read()
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        outside = tmp_path / "outside.json"
        outside.write_bytes(good)
        os.symlink(outside, path)
    seen = Seen()
    watcher = Watcher(store, seen, use_polling=True, poll_interval=0.02).start()
    try:
        idle(0.5)
        assert isinstance(watcher.last_error, dbsync.FormatError)
        assert seen.versions == []
        assert watcher.parses == 0  # never handed to the parser
        assert len([r for r in caplog.records if "cannot read" in r.getMessage()]) == 1
        os.unlink(path)
        with open(path + ".tmp", "wb") as f:
            f.write(good)
        os.replace(path + ".tmp", path)
        assert seen.until(1)
    finally:
        t0 = time.monotonic()
        watcher.stop()
        assert time.monotonic() - t0 < 1.0


def test_starting_and_stopping_leaves_nothing_behind(store):
    """Receiver.wait starts and stops a watcher per call: stop() must be quick and every
    thread and file descriptor must go (the process's inotify instance after lingering
    ``LINGER`` seconds for the next watch)."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def inotify_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "dbsync-inotify"]

    for thread in inotify_threads():  # (an earlier test's instance, lingering)
        thread.join(timeout=5)
    before = fds()
    took = []
    for _ in range(20):
        watcher = Watcher(store, Seen(), use_polling=False).start()
        t0 = time.monotonic()
        watcher.stop()
        took.append(time.monotonic() - t0)
    for thread in inotify_threads():
        thread.join(timeout=5)
    assert not inotify_threads()
    assert fds() == before
    assert max(took) < 0.1, took


def test_a_root_symlink_re_pointed_to_another_store_is_followed_at_once(tmp_path):
    """ROOT is a "current" symlink that an operator re-points from one store to the next
    (blue/green): the watcher notices at once, not at its next safety look."""
    import threading

    blue, green, current = tmp_path / "blue", tmp_path / "green", tmp_path / "current"
    with dbsync.Sender(blue) as sender:
        sender.push({"w": torch.ones(4)})
    with dbsync.Sender(green) as sender:
        sender.push({"w": torch.ones(4)})
        sender.push({"w": torch.ones(4)})
    os.symlink(blue, current)
    seen: list[int] = []
    got_two = threading.Event()

    def callback(version: int) -> None:
        seen.append(version)
        if version == 2:
            got_two.set()

    with dbsync.Watcher(current, callback, safety_interval=120, use_polling=False):
        os.symlink(green, tmp_path / "next")
        os.replace(tmp_path / "next", current)  # re-pointed atomically
        assert got_two.wait(30), "re-pointing ROOT was not noticed before the safety look"
    assert seen[-1] == 2


def test_poll_intervals_and_timeouts_that_are_no_time(store):
    """Infinity (or more than an hour) polls hourly instead of killing the watcher's thread
    (OverflowError) unheard; NaN is refused where it is given (it polled ~100 times a
    second, and a NaN timeout waited forever)."""
    from dbsync.watch import MAX_POLL_INTERVAL

    seen = Seen()
    with Watcher(store, seen, use_polling=True, poll_interval=float("inf")) as watcher:
        assert watcher.poll_interval == MAX_POLL_INTERVAL and seen.until(1)
        assert watcher._thread.is_alive()
    with pytest.raises(dbsync.InvalidArgumentError, match="poll_interval"):
        Watcher(store, seen, poll_interval=float("nan"))
    with pytest.raises(dbsync.InvalidArgumentError, match="poll_interval"):
        dbsync.Receiver(store, poll_interval=float("nan"))
    with dbsync.Receiver(store) as rx:
        for bad in (float("nan"), -1.0, "5"):
            with pytest.raises(dbsync.InvalidArgumentError, match="timeout must be a finite"):
                rx.wait(timeout=bad)
        assert rx.wait(newer_than=0, timeout=float("inf")) == 1  # (infinity: no bound)
    with dbsync.Sender(store, durable=False) as sender:
        with pytest.raises(ValueError, match="timeout must be a finite"):
            sender.wait_for_receivers(1, 1, timeout=float("nan"))


_MANY_WAITS_SCRIPT = r"""
import json, os, sys, threading, time
import torch, dbsync
from dbsync import inotify

root, waits = sys.argv[1], int(sys.argv[2])
# This user namespace allows two inotify instances; another program of the user holds one.
with open("/proc/sys/user/max_inotify_instances", "w") as f:
    f.write("2")
other = inotify._lib().inotify_init1(0)
assert other >= 0
receivers = [dbsync.Receiver(root, poll_interval=120) for _ in range(waits)]
got, woke = [], []
lock = threading.Lock()

def wait(receiver):
    version = receiver.wait(newer_than=1, timeout=60)
    with lock:
        got.append(version)
        woke.append(time.monotonic())

threads = [threading.Thread(target=wait, args=(r,)) for r in receivers]
for t in threads:
    t.start()
deadline = time.monotonic() + 60
while sum(t.name == "dbsync-watch" for t in threading.enumerate()) < waits:
    assert time.monotonic() < deadline, "the waits did not start"
    threading.Event().wait(0.01)


def is_inotify(fd):
    try:
        return "inotify" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # (the fd listdir itself used)
        return False

instances = sum(map(is_inotify, os.listdir("/proc/self/fd")))
with dbsync.Sender(root, durable=False) as sender:
    sender.push({"w": torch.full((4,), 2.0)})
    flipped = time.monotonic()
for t in threads:
    t.join()
# one wait after another (a serving loop): the instance lingers between them, no second one
for _ in range(30):
    assert receivers[0].wait(newer_than=2, timeout=0.01) is None
print(json.dumps({"got": got, "slowest": max(woke) - flipped, "instances": instances}))
"""


def test_many_concurrent_waits_share_one_inotify_instance(store, tmp_path):
    """A server with 40 `Receiver.wait` calls in flight, on a host whose user has one inotify
    instance left (the kernel's per-user limit, 128 by default, shared by every process of
    the user): every wait still notices the flip at once (not at its 120 s poll), because
    the process's watches share one instance; and so do waits made one after another."""
    import json
    import subprocess
    import sys

    if not os.path.exists("/proc/sys/user/max_inotify_instances"):
        pytest.skip("no per-namespace inotify limits on this kernel")
    script = tmp_path / "waits.py"
    script.write_text(_MANY_WAITS_SCRIPT)
    done = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, str(script),
                           store, "40"], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["got"] == [2] * 40
    assert result["slowest"] < 4.0, result  # (the waits look by themselves every 5 s)
    assert result["instances"] == 2, result  # (its own and the other program's)
    assert "no inotify watch" not in done.stderr


def test_a_forked_child_and_its_parent_both_notice_a_flip_at_once(store):
    """A process with a running watcher forks (a data-loader worker, a server's pre-fork):
    the child's watcher must not read the parent's inotify instance (it would take the
    parent's events), and both notice the next flip from their own events."""
    seen = Seen()
    ready_r, ready_w = os.pipe()
    with Watcher(store, seen, use_polling=False, skip_current=True, safety_interval=60):
        pid = os.fork()
        if pid == 0:  # the child: its own watcher, then tell the parent it is watching
            code = 1
            try:
                child_seen = Seen()
                with Watcher(store, child_seen, use_polling=False, skip_current=True,
                             safety_interval=60):
                    os.write(ready_w, b"1")
                    code = 0 if child_seen.until(2, timeout=20) else 3
            finally:
                os._exit(code)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        flipped = time.monotonic()
        push(store, 2.0)
        assert seen.until(2, timeout=20)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child did not notice the flip"
    assert seen.at[2] - flipped < 10.0  # (its safety look: 60 s)


def test_waits_without_an_inotify_watch_warn_once_and_still_notice_flips(store, tmp_path):
    """No inotify watch can be set (the user's watches used up): each `Receiver.wait` call
    warned again (887 warnings in 14 s from 100 waiting threads). It is said once per store
    and reason, and the waits fall back to polling at their interval."""
    import subprocess
    import sys

    if not os.path.exists("/proc/sys/user/max_inotify_watches"):
        pytest.skip("no per-namespace inotify limits on this kernel")
    script = tmp_path / "waits.py"
    script.write_text(r"""
import logging, sys, threading, time
import torch, dbsync
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
with open("/proc/sys/user/max_inotify_watches", "w") as f:
    f.write("0")
root = sys.argv[1]
receiver = dbsync.Receiver(root, poll_interval=0.05)
for _ in range(5):
    assert receiver.wait(newer_than=1, timeout=0.1) is None
got = []
waiter = threading.Thread(target=lambda: got.append(receiver.wait(newer_than=1, timeout=30)))
waiter.start()
with dbsync.Sender(root, durable=False) as sender:
    sender.push({"w": torch.full((4,), 2.0)})
    flipped = time.monotonic()
waiter.join()
with dbsync.Watcher(root, lambda v: None, poll_interval=0.05) as watcher:
    mode = watcher.mode  # (it says what it does: no inotify watch could be set)
print(got[0], round(time.monotonic() - flipped, 3), mode)
""")
    done = subprocess.run(["unshare", "--user", "--map-root-user", sys.executable, str(script),
                           store], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    version, seconds, mode = done.stdout.split()
    assert version == "2" and float(seconds) < 2.0 and mode == "polling"
    warnings = [line for line in done.stderr.splitlines() if "no inotify watch" in line]
    assert len(warnings) == 1, warnings
    assert "max_user_watches" in warnings[0]
