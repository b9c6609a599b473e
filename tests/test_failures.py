"""Bad input, damaged stores, and what is never allowed to happen because of them."""

import concurrent.futures
import contextlib
import errno
import json
import os
import shutil
import threading
import time

import pytest
import torch
import xxhash

import dbsync
from dbsync.format import MANIFEST_FILE


def publish(root, weights, **kw):
    with dbsync.Sender(root, **kw) as sender:
        return sender.push(weights)


def setpriv_or_skip(why: str) -> str:
    """util-linux's setpriv (to run as another user, or as root without its file-access
    override); skips the test where it is missing or this is not root."""
    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip(f"needs root and util-linux setpriv {why}")
    return setpriv


def shard_of(root, name):
    """(path of the shard holding ``name``, the tensor's offset in it)."""
    manifest = dbsync.Receiver(root).manifest()
    entry = manifest.entry(name)
    return os.path.join(root, "slots", manifest.slot, f"shard-{entry.shard:05d}.bin"), entry.offset


def test_bad_input_lists_every_bad_key_and_publishes_nothing(root):
    publish(root, {"good": torch.ones(3)})
    before = open(os.path.join(root, MANIFEST_FILE), "rb").read()
    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError) as err:
        sender.push({"ok": torch.ones(1), "lr": 0.1, "step": "ten", 3: torch.ones(1)})
    message = str(err.value)
    assert "'lr'" in message and "'step'" in message and "3" in message and "nothing" in message
    assert open(os.path.join(root, MANIFEST_FILE), "rb").read() == before
    assert dbsync.Receiver(root).latest_version() == 1


def test_push_failing_midway_leaves_current_version(root, tmp_path):
    publish(root, {"w": torch.ones(8)})
    with dbsync.Sender(root) as sender:
        with pytest.raises(dbsync.InvalidWeightsError):
            sender.push(str(tmp_path / "missing.safetensors"))
        bad = tmp_path / "corrupt.safetensors"
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
        with pytest.raises(dbsync.InvalidWeightsError, match="corrupt.safetensors"):
            sender.push(str(bad))
        assert sender.latest_version() == 1
        assert sender.push({"w": torch.full((8,), 2.0)}) == 2


def test_write_failing_after_the_slot_was_touched_publishes_nothing(root, monkeypatch):
    from dbsync import fileio

    publish(root, {"a": torch.ones(8), "b": torch.ones(8)})
    real, calls = fileio._write_task, []

    def fail_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(fileio, "GROUP_BYTES", 16)  # one write task per tensor
    monkeypatch.setattr(fileio, "_write_task", fail_second)
    with dbsync.Sender(root) as sender:
        with pytest.raises(dbsync.StoreFullError, match="nothing was published"):
            sender.push({"a": torch.full((8,), 2.0), "b": torch.full((8,), 2.0)})
        free_slot = os.listdir(os.path.join(root, "slots", "b"))
        assert not [f for f in free_slot if f.startswith("shard-")]  # partial files removed
        assert sender.latest_version() == 1
        got = {}
        dbsync.Receiver(root).load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
        assert torch.equal(got["a"], torch.ones(8)) and torch.equal(got["b"], torch.ones(8))
        monkeypatch.setattr(fileio, "_write_task", real)
        assert sender.push({"a": torch.full((8,), 3.0), "b": torch.ones(8)}) == 2


def test_a_failed_write_stops_the_writes_still_queued(root, monkeypatch):
    """A full disk (or a stopped push) must not go on writing the rest of the version: the
    writes not yet started are dropped once one has failed."""
    import threading

    from dbsync import fileio

    real_write, real_settle, calls = fileio._write_task, fileio.settle, []
    dropped = threading.Event()

    def fail_fifth(*args):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        if len(calls) > 5:  # (the handshake: writes after the failure wait for the drop)
            assert dropped.wait(30)
        return real_write(*args)

    def settle(futures):
        for future in futures:
            future.cancel()
        dropped.set()
        real_settle(futures)

    monkeypatch.setattr(fileio, "GROUP_BYTES", 16)  # one write task per tensor
    monkeypatch.setattr(fileio, "_write_task", fail_fifth)
    monkeypatch.setattr(fileio, "settle", settle)
    weights = {f"t{i}": torch.full((8,), float(i)) for i in range(400)}
    with dbsync.Sender(root, num_threads=2) as sender:
        with pytest.raises(dbsync.StoreFullError, match="nothing was published"):
            sender.push(weights)
        assert sender.latest_version() is None
    assert len(calls) <= 5 + 2  # the failed one, and at most one started per thread after it


class SignalMidPush:
    """A push's progress callback that sends ``signum`` to the main thread at its third
    write, then lets the writers go on only once the push has seen it (its stop event is
    set): ``written`` counts the writes made. One write task per tensor."""

    def __init__(self, monkeypatch, signum: int):
        import threading

        from dbsync import fileio

        monkeypatch.setattr(fileio, "GROUP_BYTES", 16)
        self.signum = signum
        self.main = threading.main_thread().ident
        self.written: list[int] = []
        self.sender: dbsync.Sender | None = None

    def __call__(self, done: int, total: int) -> None:  # (from writer threads)
        import signal

        self.written.append(done)
        if len(self.written) == 3:
            signal.pthread_kill(self.main, self.signum)
        if len(self.written) >= 3:
            assert self.sender is not None and self.sender._abort.wait(30)


def test_ctrl_c_during_a_push_stops_its_writes(root, monkeypatch):
    import signal

    progress = SignalMidPush(monkeypatch, signal.SIGINT)  # Ctrl-C, as a terminal sends it
    weights = {f"t{i}": torch.full((8,), float(i)) for i in range(400)}
    with dbsync.Sender(root, num_threads=2) as sender:
        progress.sender = sender
        with pytest.raises(dbsync.PushInterrupted) as interrupted:
            sender.push(weights, progress=progress)
        assert interrupted.value.published_version is None
        assert sender.latest_version() is None
    assert len(progress.written) < 10  # (all 400 were written before the push gave up)


def test_an_exception_from_a_signal_handler_stops_a_push_like_ctrl_c(root, monkeypatch):
    """A preemption handler (SIGTERM -> raise) fires during a blocking push: the push stops
    before its flip, the caller gets its own exception saying nothing was published, and the
    store still serves the previous version intact. (The push went on and published later,
    mixing values the trainer changed once it had the exception.)"""
    import signal

    class Preempted(Exception):
        pass

    def handler(signum, frame):
        raise Preempted("SIGTERM")

    progress = SignalMidPush(monkeypatch, signal.SIGUSR1)
    previous = signal.signal(signal.SIGUSR1, handler)
    weights = {f"t{i}": torch.full((8,), float(i)) for i in range(400)}
    try:
        with dbsync.Sender(root, num_threads=2) as sender:
            progress.sender = sender
            sender.push({f"t{i}": torch.zeros(8) for i in range(400)})
            with pytest.raises(Preempted) as raised:
                sender.push(weights, progress=progress)
            assert any("nothing was published" in note for note in raised.value.__notes__)
            assert sender.latest_version() == 1
            for tensor in weights.values():
                tensor.fill_(-1.0)  # what a trainer restoring a checkpoint does next
            assert sender.push({"t0": torch.ones(8)}) == 2  # the next push is fine
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(progress.written) < 10


@pytest.mark.parametrize("where", ["_adjust_thread_count", "add_done_callback", "result"])
def test_ctrl_c_as_a_push_is_submitted_publishes_nothing(root, where):
    """Ctrl-C lands as a blocking push is handed to its publishing thread (inside the
    submit, just after it, or as the wait starts): the push stops before its flip, the
    caller hears nothing was published, and the next push takes the next number. (Landing
    inside or just after the submit, the push published anyway, after ``push()`` had raised.)
    The writers hold each write until the push has seen the interrupt (a handshake, not a
    race)."""
    import sys
    import threading

    sender = dbsync.Sender(root, num_threads=2)
    fired = []

    def tracer(frame, event, arg):  # (in the calling thread only: settrace is per thread)
        module = frame.f_globals.get("__name__", "")
        if (event == "call" and not fired and frame.f_code.co_name == where
                and module.startswith("concurrent.futures")):
            fired.append(where)
            raise KeyboardInterrupt
        return None

    def progress(done, total):  # (from writer threads)
        assert sender._abort.wait(30)

    weights = {f"t{i}": torch.full((8,), float(i)) for i in range(4)}
    try:
        with pytest.raises(KeyboardInterrupt) as interrupted:
            sys.settrace(tracer)
            try:
                sender.push(weights, progress=progress)
            finally:
                sys.settrace(None)
        assert fired == [where]
        if isinstance(interrupted.value, dbsync.PushInterrupted):
            assert interrupted.value.published_version is None
        sender._publisher.submit(threading.Event().set).result(30)  # (the push has ended)
        assert sender.latest_version() is None and sender.next_version == 1
        assert sender.push({"w": torch.ones(2)}) == 1
    finally:
        sender.close()
    with dbsync.Receiver(root) as rx:
        assert rx.latest_version() == 1


def test_ctrl_c_on_one_push_leaves_an_earlier_background_push_alone(root):
    """Interrupting a blocking push stops that push only: a background push still writing
    ahead of it publishes (it used to be stopped too, and silently)."""
    import signal
    import sys
    import threading

    main = threading.main_thread()

    def main_waits_for_a_push() -> bool:
        frame = sys._current_frames().get(main.ident)
        while frame is not None:
            if frame.f_code.co_name == "result" and "concurrent" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    interrupted = threading.Event()

    def hold(done: int, total: int) -> None:  # the background push's write, in its thread
        if interrupted.is_set():
            return
        while not main_waits_for_a_push():  # (the handshake: the blocking push waits)
            assert not interrupted.wait(0.005)
        signal.pthread_kill(main.ident, signal.SIGINT)
        assert sender._abort.wait(30)  # the blocking push's own stop event is set
        interrupted.set()

    with dbsync.Sender(root, num_threads=1) as sender:
        background = sender.push({"w": torch.ones(4)}, blocking=False, progress=hold)
        with pytest.raises(dbsync.PushInterrupted) as stopped:
            sender.push({"w": torch.full((4,), 2.0)})
        assert stopped.value.published_version is None
        assert background.result(timeout=60) == 1
        assert sender.latest_version() == 1 and sender.last_error is None
    got = {}
    dbsync.Receiver(root).load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    assert torch.equal(got["w"], torch.ones(4))


def test_close_from_a_background_push_done_callback_releases_the_store(root):
    """A background push's done callback runs in the Sender's publisher thread; ``close()``
    there must not wait for that thread's own queue: it returns, the version stays published
    and the writer lock is free for the next Sender."""
    import threading

    closed = threading.Event()
    sender = dbsync.Sender(root)
    future = sender.push({"w": torch.ones(4)}, blocking=False)
    future.add_done_callback(lambda _: (sender.close(), closed.set()))
    assert closed.wait(60), "close() from the push's done callback did not return"
    assert future.result(timeout=60) == 1
    with dbsync.Sender(root) as again:  # (the lock was released)
        assert again.push({"w": torch.zeros(4)}) == 2


@pytest.mark.parametrize("call", ["close", "blocking push"])
def test_close_from_a_progress_callback_is_refused_and_stops_only_that_push(root, call):
    """``Sender.close()``, or a blocking push, called from a push's progress callback (a
    writer thread of the push it would wait for) deadlocked forever. It is refused there:
    that push stops, publishing nothing, and the Sender goes on. (The push runs in a thread
    joined with a bound, so a deadlock fails this test instead of hanging the suite.)"""
    import threading

    outcome: dict[str, object] = {}
    sender = dbsync.Sender(root, num_threads=2)

    def progress(done: int, total: int) -> None:
        if call == "close":
            sender.close()
        else:
            sender.push({"w": torch.zeros(1000)})

    def run() -> None:
        try:
            sender.push({"w": torch.ones(1000)}, progress=progress)
        except Exception as exc:  # noqa: BLE001 - looked at below
            outcome["error"] = exc
        else:
            outcome["error"] = None
        try:
            outcome["next"] = sender.push({"w": torch.full((1000,), 2.0)})
        finally:
            sender.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"push() deadlocked when its progress callback called {call}"
    assert isinstance(outcome["error"], dbsync.DBSyncError)
    assert "progress callback" in str(outcome["error"])
    assert outcome["next"] == 1  # nothing was published by the stopped push
    got = {}
    with dbsync.Receiver(root) as receiver:
        receiver.load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    assert torch.equal(got["w"], torch.full((1000,), 2.0))


def test_a_child_the_trainer_forked_does_not_keep_the_store_locked(root):
    """A trainer forks (DataLoader workers, multiprocessing) after creating its Sender, then is
    killed: the restarted trainer takes the store while the child still lives. (The child's
    copy of the lock's descriptor kept the store locked for as long as it lived.)"""
    import signal
    import subprocess
    import sys

    trainer = subprocess.Popen([sys.executable, "-c", (
        "import multiprocessing, sys, time, torch, dbsync\n"
        "sender = dbsync.Sender(sys.argv[1], durable=False)\n"
        "sender.push({'w': torch.ones(4)})\n"
        "child = multiprocessing.get_context('fork').Process(target=time.sleep, args=(600,))\n"
        "child.start()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"), str(root)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(trainer.stdout.readline())
        trainer.kill()
        trainer.wait()
        os.kill(child, 0)  # the forked child lives on
        with dbsync.Sender(root, durable=False) as again:
            assert again.push({"w": torch.full((4,), 2.0)}) == 2
    finally:
        trainer.kill()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("where", ["_enter", "_count_out", "_put_back", "_restore"])
def test_ctrl_c_anywhere_in_a_collector_pause_never_leaves_the_collector_off(where):
    """Ctrl-C (a signal handler's exception) lands as one of the pause's own functions is
    entered, as it can in Python 3.11 at any function's first instruction: once the block is
    over, the collector runs again, and so it does after a later pause. (An interrupted pause
    could leave it off for the life of the process.)"""
    import gc
    import sys

    from dbsync import gcpause

    fired = []

    def tracer(frame, event, arg):
        name = frame.f_code.co_name
        if event == "call" and not fired and (
                name == where or (where == "_restore" and name == "_restore"
                                  and frame.f_globals.get("__name__") == "dbsync.gcpause")):
            fired.append(name)
            raise KeyboardInterrupt
        return None

    assert gc.isenabled()
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "_enter":
                sys.settrace(tracer)
            with gcpause.paused():
                sys.settrace(tracer)
    finally:
        sys.settrace(None)
    assert fired == [where]
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_hold_whose_lease_write_ctrl_c_cut_short_never_blocks_the_trainer(root,
                                                                           monkeypatch):
    """Ctrl-C lands while an open writes the lease of its new hold: nothing stays held, so
    the trainer reuses both slots while that receiver lives on (an interrupted open kept its
    hold, and the trainer waited forever, even after the receiver's ``close()``)."""
    import threading

    from dbsync.leasekeeper import LeaseKeeper

    weights = {"w": torch.ones(1024)}
    sender = dbsync.Sender(root, durable=False)
    receiver = dbsync.Receiver(root)
    try:
        sender.push(weights)
        write = LeaseKeeper.write
        cut = []

        def write_cut_short(keeper):
            if keeper.held and not cut:
                cut.append(True)
                write(keeper)
                raise KeyboardInterrupt  # (after the hold was written: the worst moment)
            return write(keeper)

        monkeypatch.setattr(LeaseKeeper, "write", write_cut_short)
        dest = {"w": torch.zeros(1024)}
        with pytest.raises(KeyboardInterrupt):
            receiver.load(dest)
        assert cut
        done = threading.Event()
        pushes = threading.Thread(target=lambda: (sender.push(weights), sender.push(weights),
                                                  done.set()), daemon=True)
        pushes.start()
        assert done.wait(30), "the trainer waits for a hold nobody owns"
        assert receiver.load(dest) == 3 and torch.equal(dest["w"], weights["w"])
    finally:
        receiver.close()
        sender.close()


def test_second_writer_is_refused(root):
    with dbsync.Sender(root), pytest.raises(dbsync.StoreBusyError, match="one Sender"):
        dbsync.Sender(root)


def test_receiver_on_missing_root_is_an_error(root):
    with pytest.raises(dbsync.StoreNotFoundError, match="mounted"):
        dbsync.Receiver(root)
    assert not os.path.exists(root)  # a typo never creates a directory


def test_receiver_on_empty_store_says_what_to_do(root):
    dbsync.Sender(root).close()
    receiver = dbsync.Receiver(root)
    assert receiver.latest_version() is None
    with pytest.raises(dbsync.NothingPublishedError, match="push"):
        receiver.load(lambda pairs: None)


@pytest.mark.parametrize("damage", ["corrupt", "padding", "truncate", "delete"])
def test_damaged_version_never_reaches_load_weights(root, damage):
    """Small neighbours share one checked range (padding included): damage to any of its
    bytes names every tensor in it. A tensor of 4 MiB or more is checked alone."""
    publish(root, {"a": torch.randn(1 << 20), "b": torch.randn(50), "c": torch.randn(10)})
    (path, offset_b), (_, offset_c) = shard_of(root, "b"), shard_of(root, "c")
    assert offset_c - offset_b == 256  # b's 200 bytes, then 56 bytes of zero padding
    if damage in ("corrupt", "padding"):
        for offset in ((offset_b + 17, offset_c + 17) if damage == "corrupt"
                       else (offset_b + 230,)):
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, 12)
    else:
        os.unlink(path)
    calls = []
    with pytest.raises(dbsync.DamagedVersionError) as err:
        dbsync.Receiver(root).load(lambda pairs: calls.append(list(pairs)))
    assert calls == []
    # one error naming every damaged tensor (a shard that is gone or cut damages all of them)
    expected = {"b", "c"} if damage in ("corrupt", "padding") else {"a", "b", "c"}
    assert set(err.value.damaged) == expected
    assert "b, c" in str(err.value)
    if damage != "delete":
        assert all("checksum" in why or "shard" in why for why in err.value.damaged.values())


def test_manifest_pointing_outside_the_slot_is_refused(root):
    publish(root, {"w": torch.ones(2)})
    path = os.path.join(root, "slots", "a", "index.json")
    data = json.loads(open(path, "rb").read())
    data["tensors"]["offset"][0] = 2**40  # past the end of its shard
    raw = json.dumps(data).encode()
    open(path, "wb").write(raw)
    head_path = os.path.join(root, MANIFEST_FILE)
    head = json.loads(open(head_path, "rb").read())  # a consistent forgery: head matches index
    head["index"].update(nbytes=len(raw), checksum=xxhash.xxh3_64_hexdigest(raw))
    open(head_path, "w").write(json.dumps(head))
    calls = []
    with pytest.raises(dbsync.FormatError, match="outside"):
        dbsync.Receiver(root).load(lambda pairs: calls.append(1))
    assert calls == []


def test_future_format_version_is_refused_with_upgrade_hint(root):
    publish(root, {"w": torch.ones(2)})
    path = os.path.join(root, MANIFEST_FILE)
    data = json.loads(open(path, "rb").read())
    data["format_version"] = 99
    open(path, "w").write(json.dumps(data))
    with pytest.raises(dbsync.FormatError, match="upgrade"):
        dbsync.Receiver(root).latest_version()


def test_reader_sees_rewritten_slot_afresh(root):
    """Close-to-open: each load opens the files again, so a reused slot shows new bytes."""
    with dbsync.Sender(root) as sender:
        receiver = dbsync.Receiver(root)
        for value in range(1, 6):  # slot a holds versions 1, 3, 5 in the same files
            sender.push({"w": torch.full((1024,), float(value))})
            got = {}
            receiver.load(lambda pairs, got=got: got.update({n: t.clone() for n, t in pairs}))
            assert torch.equal(got["w"], torch.full((1024,), float(value)))


def test_snapshot_close_twice_is_harmless(root):
    publish(root, {"w": torch.ones(2)})
    receiver = dbsync.Receiver(root)
    with receiver.open() as snap:
        snap.close()
    snap.close()
    with pytest.raises(dbsync.DBSyncError, match="closed"):
        snap.verify()  # nothing is vouched for once its shards are gone
    with receiver.open() as again:  # the receiver is still usable
        assert again.version == 1


def test_helper_reader_loads_are_not_counted_as_receivers(root):
    from dbsync.status import receivers_at

    publish(root, {"w": torch.ones(2)})
    helper = dbsync.Receiver(root, reader_id="stager", report_loaded=False)
    engine = dbsync.Receiver(root, reader_id="engine")
    assert helper.load(lambda pairs: None) == 1 and engine.load(lambda pairs: None) == 1
    helper.load(lambda pairs: None)  # a later lease write must not report it either
    assert receivers_at(helper.store, 1) == ["engine"]


def test_empty_weights_are_refused_and_a_newer_format_store_is_not_rewritten(root):
    from dbsync import sources

    with pytest.raises(dbsync.InvalidWeightsError, match="no tensors"):
        sources.collect({})  # what a BroadcastSender checks before it sends anything
    with dbsync.Sender(root) as sender:
        with pytest.raises(dbsync.InvalidWeightsError, match="no tensors"):
            sender.push({})
        assert sender.latest_version() is None
        sender.push({"w": torch.ones(2)})
    head_path = os.path.join(root, MANIFEST_FILE)
    head = json.load(open(head_path))
    head["format_version"] = 99  # written by a newer dbsync
    with open(head_path, "w") as f:
        json.dump(head, f)
    written = open(head_path, "rb").read()
    with pytest.raises(dbsync.FormatError, match="upgrade dbsync"):
        dbsync.Sender(root)
    assert open(head_path, "rb").read() == written


def test_a_refused_load_is_reported_to_the_trainer(root):
    with dbsync.Sender(root) as sender:
        version = sender.push({"w": torch.ones(2)})
        with dbsync.Receiver(root, reader_id="plain") as rx:
            with pytest.raises(dbsync.IncompatibleWeightsError):
                rx.load({"other": torch.zeros(2)})
            # the trainer learns at once instead of waiting out its timeout
            with pytest.raises(dbsync.ReceiverRefusedError, match="plain refused version"):
                sender.wait_for_receivers(version, 1, timeout=30)


def test_a_push_held_up_by_a_live_reader_says_who_holds_it(root, caplog):
    from dbsync.leases import SLOW_HOLDER_WARN_S, LeaseMonitor

    publish(root, {"w": torch.ones(2)})
    with dbsync.Receiver(root, reader_id="holder") as rx:
        snap = rx.open()
        now = [0.0]

        def sleep(seconds):  # time passes only here; the reader lets go after 12 s
            now[0] += max(seconds, 0.5)
            if now[0] > SLOW_HOLDER_WARN_S + 2:
                snap.close()

        monitor = LeaseMonitor(rx.store, clock=lambda: now[0])
        with caplog.at_level("INFO", logger="dbsync"):
            waited = monitor.wait_until_free(snap.manifest.slot, sleep=sleep)
    assert SLOW_HOLDER_WARN_S < waited < SLOW_HOLDER_WARN_S + 5
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1
    assert "holder" in warned[0].getMessage() and f"pid {os.getpid()}" in warned[0].getMessage()


def test_verify_by_reading_reports_a_shard_cut_short_while_held(root):
    """A shard truncated under a leased snapshot (only a process breaking the protocol can)
    is reported as damaged by a reading verify (dbsync verify's), instead of SIGBUS."""
    publish(root, {"a": torch.ones(1 << 20), "b": torch.full((4096,), 2.0),
                   "empty": torch.ones(0)})  # (b shares its checked range with empty only)
    with dbsync.Receiver(root) as rx, rx.open() as snap:
        assert snap.leased
        snap.verify(by_reading=True)  # intact: passes
        path, offset = shard_of(root, "b")
        os.truncate(path, offset + 100)
        with pytest.raises(dbsync.DamagedVersionError) as err:
            snap.verify(by_reading=True)
    assert list(err.value.damaged) == ["b"]
    assert "shorter than the manifest" in err.value.damaged["b"]


def test_a_shard_this_user_may_not_read_is_not_called_damaged(root):
    """A verify by a process that may not read a shard (root without its file-access
    override, as a locked-down container runs) is told so, not told to publish again."""
    import subprocess
    import sys

    setpriv = setpriv_or_skip("to drop the file-access override")
    publish(root, {"a": torch.ones(8)})
    path, _ = shard_of(root, "a")
    os.chmod(path, 0o000)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    drop = "-dac_override,-dac_read_search"
    out = subprocess.run(
        [setpriv, "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c",
         "from cli.main import main; main()", "verify", str(root)],
        capture_output=True, text=True, cwd=repo, timeout=120,
        env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == 1, out
    assert "nothing is known to be damaged" in out.stderr and "Permission denied" in out.stderr
    assert "fail verification" not in out.stderr and "Publish again" not in out.stderr
    # A load says so with the class and errno the README promises for no permission (*)
    out = subprocess.run(
        [setpriv, "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c",
         "import errno, sys, dbsync\ntry:\n    dbsync.Receiver(sys.argv[1]).load(lambda p: None)\n"
         "except dbsync.StoreUnreachableError as exc:\n"
         "    print(isinstance(exc, OSError), errno.errorcode[exc.errno])", str(root)],
        capture_output=True, text=True, cwd=repo, timeout=120,
        env={**os.environ, "PYTHONPATH": repo})
    assert out.stdout.split() == ["True", "EACCES"], out
    # ... and `dbsync status` on a slot stamp it may not read says so, not DAMAGED (*)
    os.chmod(path, 0o644)
    stamp = os.path.join(os.path.dirname(path), "dbsync-slot.json")
    os.chmod(stamp, 0o000)
    for args in (["status"], ["status", "--json"]):
        out = subprocess.run(
            [setpriv, "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c",
             "from cli.main import main; main()", *args, str(root)],
            capture_output=True, text=True, cwd=repo, timeout=120,
            env={**os.environ, "PYTHONPATH": repo})
        assert out.returncode == 1, out
        said = out.stdout + out.stderr
        assert "Permission denied" in said and "nothing is wrong with the store's contents" in (
            said), out
        assert "DAMAGED" not in said and "publish again" not in said.lower(), out


def test_a_dead_readers_lease_the_writer_may_not_remove_does_not_stop_its_pushes(root):
    """A reader that wrote its lease where the trainer may not delete it (readers/ owned by
    another user, as when an inference pod running as root created it) and then died: the
    trainer's pushes go on (a dead lease holds nothing), and it says once which file it could
    not remove, with its full path."""
    import subprocess
    import sys

    setpriv = setpriv_or_skip("to drop the file-access override")
    publish(root, {"w": torch.ones(16)})
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, dbsync\n"
         "rx = dbsync.Receiver(sys.argv[1], reader_id='pod-reader', lease_timeout=1.0)\n"
         "rx.load(lambda pairs: None); print('ready', flush=True); time.sleep(600)",
         str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"
    finally:
        reader.kill()
        reader.wait()
    readers = os.path.join(root, "readers")
    os.chown(readers, 12345, 12345)  # another user's directory: the trainer may not unlink
    drop = "-dac_override,-dac_read_search,-fowner"
    out = subprocess.run(
        [setpriv, "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c",
         "import logging, sys, torch, dbsync\n"
         "logging.basicConfig(level=logging.WARNING)\n"
         "with dbsync.Sender(sys.argv[1], lease_timeout=1.0) as s:\n"
         "    for v in range(3): print('pushed', s.push({'w': torch.full((16,), float(v))}))",
         str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pushed", "2", "pushed", "3", "pushed", "4"]
    lease = os.path.join(readers, "pod-reader.json")
    assert out.stderr.count(f"could not remove {lease}") == 1, out.stderr
    assert os.path.exists(lease)


def test_a_trainer_with_umask_077_leaves_the_store_reachable_and_a_blocked_path_is_named():
    """Directories a push creates above the store are 0755 whatever the trainer's umask (as
    the store's own are): another account reads the store. Where a directory above it is
    shut, that account is told which one and what to do, not that the store is missing."""
    import pathlib
    import subprocess
    import sys
    import tempfile

    setpriv = setpriv_or_skip("to read as another user")
    # (not pytest's tmp_path: it lies under a directory only its owner may search)
    base = pathlib.Path(tempfile.mkdtemp(prefix="dbsync-umask-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        root = base / "team" / "run1" / "store"
        was = os.umask(0o077)
        try:
            publish(root, {"w": torch.ones(4)})
        finally:
            os.umask(was)
        assert all(os.stat(d).st_mode & 0o777 == 0o755 for d in (root.parent, root.parent.parent))
        reader = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                  "-c", "import sys, dbsync\nprint(dbsync.Receiver(sys.argv[1]).load("
                  "lambda pairs: None))", str(root)]
        out = subprocess.run(reader, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == ["1"], out.stderr
        os.chmod(root.parent.parent, 0o700)
        out = subprocess.run(reader, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert (f"permission denied to this process (uid 65534) at {root.parent.parent};"
                in out.stderr), out.stderr
        assert "does not exist" not in out.stderr
        os.chmod(root.parent.parent, 0o755)
        os.chmod(root, 0o700)  # the store itself shut: one error class, with its errno
        out = subprocess.run(reader[:-2] + [
            "import errno, sys, dbsync\ntry:\n    dbsync.Receiver(sys.argv[1])\n"
            "except dbsync.StoreUnreachableError as exc:\n"
            "    print(isinstance(exc, OSError), errno.errorcode[exc.errno], exc)",
            str(root)], capture_output=True, text=True, timeout=120)
        assert out.stdout.startswith("True EACCES "), (out.stdout, out.stderr)
        assert f"permission denied to this process (uid 65534) at {root};" in out.stdout
    finally:
        shutil.rmtree(base)


def _published_in_format_2(root, weights) -> dict:
    """Publish ``weights`` and rewrite the store as the previous format wrote it (one checksum
    per tensor); returns its head."""
    publish(root, weights)
    head_path = os.path.join(root, MANIFEST_FILE)
    head = json.load(open(head_path))
    index_path = os.path.join(root, "slots", head["slot"], "index.json")
    index = json.load(open(index_path))
    tensors = index["tensors"]
    del tensors["range"], index["ranges"]  # version 2's own columns instead
    tensors["checksum"] = ["0123456789abcdef"] * len(tensors["name"])
    index["format_version"] = head["format_version"] = 2
    raw = json.dumps(index).encode()
    open(index_path, "wb").write(raw)
    head["index"].update(nbytes=len(raw), checksum=xxhash.xxh3_64_hexdigest(raw))
    open(head_path, "w").write(json.dumps(head))
    return head


def test_a_format_2_store_is_refused_by_readers_and_continued_by_a_writer(root):
    """A store written by the previous format (one checksum per tensor): readers say what to
    do and apply nothing; a Sender continues its version numbers in format 3, which readers
    then load."""
    weights = {"a": torch.randn(64), "b": torch.randn(3, 5)}
    head = _published_in_format_2(root, weights)
    head_path = os.path.join(root, MANIFEST_FILE)

    calls = []
    with dbsync.Receiver(root) as rx:
        with pytest.raises(dbsync.FormatError, match="older dbsync in format 2 .release 0.2.x"
                           ".*Upgrade the trainer"):
            rx.load(lambda pairs: calls.append(1))
    assert calls == []
    # A reader upgraded with the trainer waits for its first push (it used to raise at once,
    # and `dbsync watch` exited 1): an older format is not permanent, a newer one is.
    with dbsync.Receiver(root) as waiting, concurrent.futures.ThreadPoolExecutor(1) as pool:
        waited = pool.submit(waiting.wait, 0, 60)
        with pytest.raises(concurrent.futures.TimeoutError):
            waited.result(timeout=0.5)
        with dbsync.Sender(root) as sender:
            assert sender.push({k: v + 1 for k, v in weights.items()}) == 2
        assert waited.result(timeout=30) == 2
    got = {}
    with dbsync.Receiver(root) as rx:
        assert rx.load(lambda pairs: got.update({n: t.clone() for n, t in pairs})) == 2
    assert all(torch.equal(got[k], v + 1) for k, v in weights.items())
    upgraded = json.load(open(head_path))
    assert upgraded["format_version"] == 3
    assert upgraded["run_id"] == head["run_id"]  # (a format upgrade is no new run)


def test_watch_on_a_format_2_store_says_so_once_then_reports_the_upgraded_version(root):
    """`dbsync watch` on a store of the previous format printed the notice twice (its own and
    the watcher's); now once, and it reports the version the upgraded trainer then pushes."""
    import subprocess
    import sys

    _published_in_format_2(root, {"a": torch.ones(8)})
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    watch = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "watch", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo,
        env={**os.environ, "PYTHONPATH": repo})
    try:
        notice = ""
        while "still watching" not in notice:  # (until the watcher itself has said it)
            line = watch.stderr.readline()
            assert line, notice
            notice += line
        with dbsync.Sender(root) as sender:
            assert sender.push({"a": torch.zeros(8)}) == 2
        line = watch.stdout.readline()
    finally:
        watch.terminate()
        _, rest = watch.communicate(timeout=30)
    assert line.startswith("version 2"), line
    assert (notice + rest).count("older dbsync in format 2") == 1, notice + rest


def test_destinations_nothing_can_be_copied_into_are_refused_before_any_byte_lands(root):
    """A meta tensor (a model never materialized), an expanded tensor (elements sharing
    memory) and a value that is not a tensor: one error naming each, nothing applied to the
    tensors that do fit, the refusal recorded for the trainer. A module's extra state
    (``get_extra_state``) is not weights: it is left alone."""
    weights = {"a": torch.ones(4), "b": torch.full((2, 4), 2.0), "m": torch.ones(3),
               "x": torch.ones(2)}
    with dbsync.Sender(root) as sender:
        sender.push(weights)
        with pytest.raises(dbsync.InvalidWeightsError, match="'w': is an uninitialized"):
            sender.push({"w": torch.nn.LazyLinear(2).weight})  # (was torch's ValueError)
    dest = {"a": torch.zeros(4), "b": torch.zeros(1, 4).expand(2, 4),
            "m": torch.empty(3, device="meta"), "x": [0.0, 0.0]}
    with dbsync.Receiver(root) as rx:
        with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
            rx.load(dest)
        problems = refused.value.problems
        assert set(problems) == {"b", "m", "x"}, problems
        assert "expanded" in problems["b"] and "meta" in problems["m"]
        assert "not a tensor" in problems["x"] and "nothing was copied" in str(refused.value)
        assert torch.equal(dest["a"], torch.zeros(4))
        lease = dbsync.store.Store(root).read_lease(rx.reader_id)
        assert lease["refused"]["version"] == 1

        class WithExtraState(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = torch.nn.Parameter(torch.zeros(4))
                self.register_buffer("x", torch.zeros(2))
                self.b = torch.nn.Parameter(torch.zeros(2, 4))
                self.register_buffer("m", torch.zeros(3))

            def get_extra_state(self) -> dict:
                return {"step": 7}

            def set_extra_state(self, state: dict) -> None:
                raise AssertionError("not weights: never set by a load")

        module = WithExtraState()
        assert "_extra_state" in module.state_dict()
        assert rx.load(module) == 1
        for name, want in weights.items():
            assert torch.equal(module.state_dict()[name], want), name
        # ... and pushed from such a module: its tensors, not its extra state (before:
        # refused as "a dict, not a tensor ... a training checkpoint?")
        with torch.no_grad():
            module.a.add_(5)
        with dbsync.Sender(root) as sender:
            assert sender.push(module) == 2
        published = {e.name for e in rx.manifest().tensors}
        assert published == set(weights), published
        again = WithExtraState()
        assert rx.load(again) == 2 and torch.equal(again.a, weights["a"] + 5)
        # A lazy module's parameters (no shape yet): named (was torch's RuntimeError)
        with dbsync.Sender(root) as sender:
            assert sender.push({"weight": torch.ones(2, 3), "bias": torch.ones(2)}) == 3
        with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
            rx.load(torch.nn.LazyLinear(2))
        assert set(refused.value.problems) == {"weight", "bias"}
        assert "lazy module" in refused.value.problems["weight"]


def test_the_same_bytes_seen_another_way_are_not_tied_weights(root):
    """Two destinations over exactly the same bytes seen with other strides (``buf`` and
    ``buf.t()``) or another shape (``buf.view(4)``) are refused as sharing memory (before:
    loaded, the last one copied overwriting the other); the same tensor under two names
    still loads as tied weights."""
    with dbsync.Sender(root) as sender:
        sender.push({"a": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                     "b": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                     "c": torch.tensor([5.0, 6.0, 7.0, 8.0])})
    with dbsync.Receiver(root) as rx:
        for alias in (lambda buf: {"b": buf.t(), "c": torch.zeros(4)},
                      lambda buf: {"b": torch.zeros(2, 2), "c": buf.view(4)}):
            buf = torch.zeros(2, 2)
            dest = {"a": buf, **alias(buf)}
            with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
                rx.load(dest)
            assert "a" in refused.value.problems, refused.value.problems
            assert "shares part of its memory" in refused.value.problems["a"]
            assert not buf.any()
        buf = torch.zeros(2, 2)
        assert rx.load({"a": buf, "b": buf, "c": torch.zeros(4)}) == 1  # tied, equal
        assert torch.equal(buf, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_destinations_in_read_only_memory_are_refused_before_any_byte_lands(root, tmp_path):
    """A destination in a read-only file mapping is refused, named, nothing copied (before:
    a bare "[Errno 14] Bad address" after the other destination had taken the new version;
    a non-contiguous view of it crashed the process in torch's copy)."""
    import mmap

    import numpy as np

    with dbsync.Sender(root) as sender:
        sender.push({"b": torch.ones(4), "a": torch.arange(6.0).reshape(2, 3)})
    path = tmp_path / "ro.bin"
    path.write_bytes(b"\0" * 4096)
    with open(path, "rb") as f, dbsync.Receiver(root) as rx:
        mapped = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)  # (closed when collected)
        with pytest.warns(UserWarning):  # (torch: "the given NumPy array is not writable")
            flat = torch.from_numpy(np.frombuffer(mapped, dtype=np.float32, count=6))
        for view in (flat.reshape(2, 3), flat.reshape(3, 2).t()):
            b = torch.zeros(4)
            with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
                rx.load({"a": view, "b": b})
            assert set(refused.value.problems) == {"a"}, refused.value.problems
            assert "read-only" in refused.value.problems["a"]
            assert torch.equal(b, torch.zeros(4)) and not flat.any()


def test_strided_views_that_share_bytes_are_refused_and_interleaved_ones_load(root):
    """A row and a column of one matrix share an element: refused, named, nothing copied
    (before: loaded, the column holding [1, 2, 2, 2] for [2, 2, 2, 2]). Two views at one
    address with other strides (a column and the diagonal) are not tied weights: refused as
    sharing memory (before: "one tensor in the target"). Columns of one matrix and a
    transposed matrix share no byte: they load the published values."""
    with dbsync.Sender(root) as sender:
        sender.push({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0),
                     "t": torch.arange(6.0).reshape(3, 2)})
    with dbsync.Receiver(root) as rx:
        for make in (lambda buf: (buf[0, :], buf[:, 0]),
                     lambda buf: (buf[:, 0], buf.diagonal())):
            buf = torch.zeros(4, 4)
            a, b = make(buf)
            with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
                rx.load({"a": a, "b": b, "t": torch.zeros(3, 2)})
            assert set(refused.value.problems) == {"a", "b"}, refused.value.problems
            assert "shares part of its memory" in refused.value.problems["b"]
            assert torch.equal(buf, torch.zeros(4, 4))
        buf = torch.zeros(4, 4)
        held = torch.zeros(2, 3)
        dest = {"a": buf[:, 0], "b": buf[:, 1], "t": held.t()}
        assert rx.load(dest) == 1
        assert torch.equal(buf[:, :2], torch.tensor([[1.0, 2.0]] * 4))
        assert torch.equal(buf[:, 2:], torch.zeros(4, 2))
        assert torch.equal(held.t(), torch.arange(6.0).reshape(3, 2))


def test_partly_overlapping_and_distributed_destinations_are_refused_and_views_load(root,
                                                                                     tmp_path):
    """Two destinations that share part of their memory (views of one buffer) are refused,
    named, nothing copied: before, the copy wrote one tensor's bytes into the other and loaded
    values never published (f = [1, 5, 6] for [1, 2, 3]). A distributed tensor (DTensor) is
    refused, named, before any byte lands (before: torch's bare RuntimeError after other
    tensors had landed). Conjugate and negative views load the published values (before:
    torch's batched copy refused them mid-copy)."""
    with dbsync.Sender(root) as sender:
        sender.push({"f": torch.tensor([1.0, 2.0, 3.0]), "g": torch.tensor([5.0, 6.0]),
                     "c": torch.tensor([1 + 2j, 3 - 4j]), "n": torch.tensor([1.0, -2.0]),
                     "z": torch.full((2,), 3.0)})
    with dbsync.Receiver(root) as rx:
        buf = torch.zeros(3)
        overlapping = {"f": buf, "g": buf[1:], "c": torch.zeros(2, dtype=torch.complex64),
                       "n": torch.zeros(2), "z": torch.zeros(2)}
        with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
            rx.load(overlapping)
        assert set(refused.value.problems) == {"f", "g"}, refused.value.problems
        assert "shares part of its memory" in refused.value.problems["g"]
        assert torch.equal(buf, torch.zeros(3)) and torch.equal(overlapping["z"], torch.zeros(2))

        views = {"f": torch.zeros(3), "g": torch.zeros(2),
                 "c": torch.zeros(2, dtype=torch.complex64).conj(),
                 "n": torch._neg_view(torch.zeros(2)), "z": torch.zeros(2)}
        for threads in (1, 8):
            assert rx.load(views, threads=threads) == 1
            assert views["f"].tolist() == [1.0, 2.0, 3.0] and views["g"].tolist() == [5.0, 6.0]
            assert views["c"].tolist() == [1 + 2j, 3 - 4j]
            assert views["n"].tolist() == [1.0, -2.0] and views["z"].tolist() == [3.0, 3.0]

        try:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import distribute_tensor
        except ImportError:
            return
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                    world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            dest = {**{k: torch.zeros_like(v) for k, v in views.items() if k not in "cn"},
                    "c": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2)}
            dest["f"] = distribute_tensor(torch.zeros(3), mesh)
            with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
                rx.load(dest)
            assert set(refused.value.problems) == {"f"}
            assert "DTensor" in refused.value.problems["f"]
            assert torch.equal(dest["g"], torch.zeros(2)), "a tensor landed before the refusal"
        finally:
            dist.destroy_process_group()


def test_tied_weights_load_whether_the_version_stores_them_once_or_twice(root):
    """A model whose output layer is its embedding (one Parameter under two names).
    Checkpoints often store it once (``save_pretrained`` drops the tied name): that loads,
    load after load. Stored twice and equal: loads. Stored twice and different (pushed from
    an untied model): refused naming both, nothing copied, since one copy would silently
    overwrite the other."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(6, 4)
            self.head = torch.nn.Linear(4, 6, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.Parameter(torch.zeros(4))

    big = torch.arange(24.0).reshape(6, 4)
    module = Tied()
    _tied_into_dicts_by_memory(root + "-dict")
    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        for version in (1, 2):  # stored once: the tied name is absent from the version
            sender.push({"embed.weight": big + version, "norm": torch.full((4,), float(version))})
            assert rx.load(module) == version
            assert torch.equal(module.head.weight.detach(), big + version)
            assert torch.equal(module.norm.detach(), torch.full((4,), float(version)))
        sender.push({"embed.weight": big, "head.weight": big.clone(), "norm": torch.ones(4)})
        assert rx.load(module) == 3  # stored twice, equal
        assert torch.equal(module.embed.weight.detach(), big)
        sender.push({"embed.weight": big, "head.weight": big + 1, "norm": torch.ones(4) * 5})
        with pytest.raises(dbsync.IncompatibleWeightsError, match="tied weights") as refused:
            rx.load(module)
        assert "embed.weight" in str(refused.value) and "head.weight" in str(refused.value)
        assert torch.equal(module.norm.detach(), torch.ones(4))  # nothing copied


def test_a_snapshot_hands_out_nothing_of_a_damaged_version_when_its_receiver_verifies(root):
    """``open()`` then ``tensors()`` / ``tensordict()`` / ``copy_into()``: a verifying
    receiver (the default) checks every checksum before the first tensor is handed out, as
    ``load`` does; ``Receiver(verify=False)`` is the opt-out. A closed snapshot says so."""
    publish(root, {"a": torch.zeros(1000), "b": torch.ones(10)})
    path, offset = shard_of(root, "a")
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        f.write(b"\x01")
    with dbsync.Receiver(root) as rx, rx.open() as snap:
        for hand_out in (snap.tensors, snap.tensordict):
            with pytest.raises(dbsync.DamagedVersionError, match="damaged"):
                hand_out()
        dest = {"a": torch.full((1000,), 7.0), "b": torch.full((10,), 7.0)}
        with pytest.raises(dbsync.DamagedVersionError):
            snap.copy_into(dest)
        assert torch.equal(dest["a"], torch.full((1000,), 7.0))
    with dbsync.Receiver(root, verify=False) as rx, rx.open() as snap:
        assert torch.equal(dict(snap.tensors())["b"], torch.ones(10))  # not checked: opted out
    for hand_out in (snap.tensors, snap.tensordict, lambda: snap.copy_into(dest)):
        with pytest.raises(dbsync.DBSyncError, match="snapshot is closed; open it again"):
            hand_out()


def test_settings_and_versions_that_cannot_be_are_refused_clearly(root, tmp_path):
    with pytest.raises(dbsync.DBSyncError, match="lease_timeout must be between"):
        dbsync.Sender(root, lease_timeout=-1)
    # Arguments are ValueErrors naming what was given, raised before the store is touched.
    for bad, what in [(dict(num_threads="8"), "num_threads must be an int of at least 1, not '8'"),
                      (dict(num_threads=0), "num_threads must be"),
                      (dict(max_lag=-1), "max_lag must be a number >= 0"),
                      (dict(max_lag_timeout=float("nan")), "max_lag_timeout must be"),
                      (dict(lease_timeout=float("nan")), "lease_timeout must be")]:
        with pytest.raises(dbsync.InvalidArgumentError, match=what) as raised:
            dbsync.Sender(os.path.join(root, "never-made"), **bad)
        assert isinstance(raised.value, ValueError)
    assert not os.path.exists(os.path.join(root, "never-made"))
    for dtype in (torch.int8, torch.float8_e4m3fn):  # (float8: saturated values, no scales)
        with pytest.raises(dbsync.DBSyncError, match="16 bits or more"):
            dbsync.Sender(root, dtype=dtype)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(dbsync.FormatError, match="a part of its path is a file"):
        dbsync.Sender(str(blocker / "store" / "x"))
    publish(root, {"w": torch.ones(2)})
    with pytest.raises(dbsync.InvalidArgumentError, match="reader id '../x' is not allowed"):
        dbsync.Receiver(root, reader_id="../x")
    with dbsync.Receiver(root) as rx:
        with pytest.raises(dbsync.DBSyncError, match="version 99 is not published.*latest is 1"):
            rx.open(version=99)


def test_no_load_casts_to_or_from_float8(root):
    """A float32 version into a float8 destination (and back) is refused, named, nothing
    copied (before: saturated silently, 1000 -> 448; float8 values loaded unscaled), as a
    Sender refuses to publish in float8; bfloat16 into float32 is still cast."""
    publish(root, {"w": torch.tensor([1000.0, 0.001, -3.3]), "h": torch.ones(2)})
    with dbsync.Receiver(root) as rx:
        dest = {"w": torch.zeros(3, dtype=torch.float8_e4m3fn),
                "h": torch.zeros(2, dtype=torch.bfloat16)}
        with pytest.raises(dbsync.IncompatibleWeightsError) as refused:
            rx.load(dest)
        assert set(refused.value.problems) == {"w"}, refused.value.problems
        assert "float8" in refused.value.problems["w"]
        assert not dest["w"].float().any() and not dest["h"].float().any()
        dest["w"] = torch.zeros(3)
        assert rx.load(dest) == 1 and torch.equal(dest["h"], torch.ones(2, dtype=torch.bfloat16))


def test_call_arguments_that_cannot_be_are_refused_before_anything_is_read(root):
    """Each argument of the public calls that cannot be is an InvalidArgumentError (a
    ValueError) naming it, before anything is read, reported or written (before: bare
    TypeErrors, a NaN ``newer_than`` that waited for ever, "false" taken as true, a load
    target of the wrong kind recorded as a refusal the trainer saw)."""
    publish(root, {"w": torch.ones(2)})
    with dbsync.Receiver(root, reader_id="args") as rx:
        dest = {"w": torch.zeros(2)}
        calls = [(lambda: rx.load(None), "load\\(\\) takes"),
                 (lambda: rx.load([torch.ones(2)]), "load\\(\\) takes"),
                 (lambda: rx.load("model"), "load\\(\\) takes"),
                 (lambda: rx.load(dest, threads=-3), "threads must be"),
                 (lambda: rx.load(dest, threads="8"), "threads must be"),
                 (lambda: rx.load(dest, verify="no"), "verify must be True or False"),
                 (lambda: rx.wait(newer_than=float("nan"), timeout=1), "newer_than must be"),
                 (lambda: rx.open(version=-1), "version must be"),
                 (lambda: rx.watch(None), "callback must be callable"),
                 (lambda: rx.mark_loaded("1"), "version must be an integer"),
                 (lambda: rx.mark_loaded(-3), "version must be an integer"),
                 (lambda: rx.mark_loaded(10**30), "version must be at most"),
                 (lambda: rx.mark_loaded(1, "run-1"), "run_id must be a run id"),
                 (lambda: dbsync.Receiver(root, read_only="false"), "read_only must be")]
        for call, what in calls:
            with pytest.raises(dbsync.InvalidArgumentError, match=what):
                call()
        assert (dbsync.store.Store(root).read_lease("args") or {}).get("refused") is None
        assert torch.equal(dest["w"], torch.zeros(2))
        assert rx.wait(newer_than=0, timeout=10**400) == 1  # (no bound: not an OverflowError)
    with dbsync.Sender(root) as sender:
        for call, what in [(lambda: sender.push({"w": torch.ones(2)}, blocking=None),
                            "blocking must be True or False"),
                           (lambda: sender.push({"w": torch.ones(2)}, progress=5),
                            "progress must be a callable"),
                           (lambda: sender.push({"w": torch.ones(2)},
                                                progress=lambda done: None),
                            "progress must be a callable taking \\(bytes_done, bytes_total"),
                           (lambda: sender.wait_for_receivers(1, count="1"), "count must be"),
                           (lambda: sender.wait_for_receivers(1, count=-1), "count must be")]:
            with pytest.raises(dbsync.InvalidArgumentError, match=what):
                call()
        assert sender.latest_version() == 1
    with pytest.raises(dbsync.InvalidArgumentError, match="16 bits or more"):
        dbsync.Sender(root, dtype="bf16")
    with pytest.raises(dbsync.InvalidArgumentError, match="durable must be True or False"):
        dbsync.Sender(root, durable="no")  # (was taken as durable)
    for make in (dbsync.Sender, dbsync.Receiver):
        for path, what in ((None, "must be a str or a path object, not NoneType"),
                           (root + "\0x", "holds a NUL character")):
            with pytest.raises(dbsync.InvalidArgumentError, match=what):
                make(path)
    with dbsync.Sender(os.fsencode(root)) as sender:  # a bytes path is a path
        assert sender.push({"w": torch.ones(2)}) == 2
    with dbsync.Receiver(os.fsencode(root)) as rx:
        assert rx.latest_version() == 2


def test_a_receiver_started_before_the_first_push_creates_only_its_lease_directory(tmp_path):
    empty = tmp_path / "not-yet-a-store"
    empty.mkdir()
    with dbsync.Receiver(str(empty)) as rx:
        assert sorted(os.listdir(empty)) == ["readers"]
        assert rx.latest_version() is None
    with dbsync.Sender(str(empty)) as sender:  # the writer creates the rest and publishes
        assert sender.push({"w": torch.ones(2)}) == 1


def test_waiting_past_an_opened_version_sees_a_new_run(root):
    """A receiver that opened version 3 (never load()ed) and waits for something newer: a
    new run at the same path counts, even one already at version 2 when the wait starts."""
    with dbsync.Sender(root) as sender:
        for version in (1, 2, 3):
            sender.push({"w": torch.full((2,), float(version))})
    with dbsync.Receiver(root) as rx:
        with rx.open() as snap:
            seen = snap.version
        shutil.rmtree(root)
        with dbsync.Sender(root) as sender:
            sender.push({"w": torch.ones(2)})
            sender.push({"w": torch.ones(2)})
        assert rx.wait(newer_than=seen, timeout=5) == 2


def test_a_writer_on_a_restored_head_numbers_past_what_the_slots_held(root):
    """The head restored from a backup of version 1 while the slots hold versions 2 and 3 of
    the same run, and no reader reports anything (read-only readers write no lease): the next
    push is version 4, never a second, different version 2."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(2)})
        backup = open(os.path.join(root, MANIFEST_FILE), "rb").read()
        sender.push({"w": torch.full((2,), 2.0)})
        sender.push({"w": torch.full((2,), 3.0)})
    with open(os.path.join(root, MANIFEST_FILE), "wb") as f:
        f.write(backup)
    with dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.full((2,), 4.0)}) == 4


def test_a_writer_on_a_head_restored_one_version_back_numbers_past_the_published_one(root):
    """The head restored from a copy of version 2 after version 3 was published into the
    other slot (or a crash undoing a flip whose directory fsync failed): the head's own slot
    still holds version 2, so the other slot's version 3 looked like a writer that died before
    its flip, and the next push was a second, different version 3. A reader that loaded the
    first version 3 without a lease (nothing reported) kept it, labelled as the current one.
    Each slot now notes the version published in it, and the next push is version 4."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(2)})
        sender.push({"w": torch.full((2,), 2.0)})
        backup = open(os.path.join(root, MANIFEST_FILE), "rb").read()
        sender.push({"w": torch.full((2,), 3.0)})
    with dbsync.Receiver(root, read_only=True) as rx:
        dest = {"w": torch.zeros(2)}
        assert rx.load(dest) == 3
        with open(os.path.join(root, MANIFEST_FILE), "wb") as f:
            f.write(backup)
        with dbsync.Sender(root) as sender:
            assert sender.push({"w": torch.full((2,), 33.0)}) == 4
        assert rx.load(dest) == 4 and torch.equal(dest["w"], torch.full((2,), 33.0))


def test_a_push_onto_a_garbled_head_waits_out_a_caching_mount_once(root, caplog):
    """A head that is no JSON is read again after pauses (1.3 s in all: a caching mount can
    show a just-replaced head cut short) before it is called damaged. A push read its head six
    times, pausing each time: 7.8 s to publish a few bytes. The same bytes read again come
    back at once now; the push starts a new run at version 1, as it did."""
    import logging

    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(2)})
    path = os.path.join(root, MANIFEST_FILE)
    with open(path, "rb") as f:
        garbled = f.read()[:30]
    with open(path, "wb") as f:
        f.write(garbled)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dbsync"), dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.full((2,), 2.0)}) == 1
    took = time.monotonic() - start
    assert took < 3 * sum(dbsync.store.REREAD_PAUSES), took
    assert "the next push starts a new run at version 1" in caplog.text
    with dbsync.Receiver(root) as rx:
        dest = {"w": torch.zeros(2)}
        assert rx.load(dest) == 1 and torch.equal(dest["w"], torch.full((2,), 2.0))


def test_adapter_tensors_without_their_config_are_not_taken_silently_for_weights(
        tmp_path, caplog):
    """An adapter saved with ``safe_serialization=False`` (``adapter_model.bin``) was met
    with "push that file itself", which published it as full weights, its configuration
    dropped (and the store then refused real adapters). It is refused now, saying how to save
    it. PEFT LoRA tensors pushed without any configuration are published as weights, as
    asked, with a WARNING saying how to publish an adapter."""
    import logging

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    torch.save({name: torch.zeros(4, 8)}, adapter / "adapter_model.bin")
    root = tmp_path / "store"
    with pytest.raises(dbsync.InvalidWeightsError) as refused:
        with dbsync.Sender(str(root)) as sender:
            sender.push(str(adapter))
    assert "no adapter_model.safetensors (adapter_model.bin" in str(refused.value)
    assert "save_pretrained" in str(refused.value)
    assert not (root / "dbsync.json").exists()
    with caplog.at_level(logging.WARNING, logger="dbsync"), dbsync.Sender(str(root)) as s:
        assert s.push({name: torch.zeros(4, 8),
                       name.replace("lora_A", "lora_B"): torch.zeros(8, 4)}) == 1
    assert "named as a PEFT LoRA weight" in caplog.text and "adapter_config" in caplog.text
    # a configuration holding NaN (Python's JSON reads it): named, before the store is touched
    from safetensors.torch import save_file

    save_file({name: torch.zeros(4, 8)}, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, '
                                                 '"lora_alpha": NaN}')
    with pytest.raises(dbsync.InvalidWeightsError, match="holds NaN or Infinity .'lora_alpha'"):
        dbsync.sources.adapter_config_of(str(adapter))


def _tied_into_dicts_by_memory(root: str) -> None:
    """The same through ``state_dict()`` (no ``keep_vars``: a new tensor object per name, tied
    ones sharing memory), with tensors large enough to be checked alone (compared by their
    range checksums): stored once loads; stored twice and different is refused."""
    embed = torch.nn.Embedding(1 << 18, 5)  # 5 MiB: a checked range of its own
    head = torch.nn.Linear(5, 1 << 18, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, head)
    dest = model.state_dict()
    assert dest["0.weight"] is not dest["1.weight"]
    weight = torch.randn(1 << 18, 5)
    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        sender.push({"0.weight": weight})
        assert rx.load(dest) == 1 and torch.equal(embed.weight.detach(), weight)
        sender.push({"0.weight": weight, "1.weight": weight.clone()})  # twice, equal
        assert rx.load(model.state_dict()) == 2
        assert torch.equal(embed.weight.detach(), weight)
        sender.push({"0.weight": weight, "1.weight": weight + 1})
        with pytest.raises(dbsync.IncompatibleWeightsError, match="tied weights"):
            rx.load(model.state_dict())
        assert torch.equal(embed.weight.detach(), weight)


def test_a_directory_holding_other_files_is_never_made_a_store(tmp_path):
    """A checkpoint directory given as ROOT (or SRC and ROOT swapped) is refused, untouched;
    a mount's lost+found is fine; an empty path (an unset variable) is never the current
    directory."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(dbsync.FormatError, match="not a dbsync store but holds other files"):
        dbsync.Sender(str(checkpoint))
    assert sorted(os.listdir(checkpoint)) == ["config.json"]
    volume = tmp_path / "volume"
    (volume / "lost+found").mkdir(parents=True)
    with dbsync.Sender(str(volume)) as sender:
        assert sender.push({"w": torch.ones(2)}) == 1
    for make in (dbsync.Sender, dbsync.Receiver):
        with pytest.raises(dbsync.StoreNotFoundError, match="path is empty"):
            make("")


def test_a_directory_that_only_looks_like_a_store_is_refused_and_nothing_in_it_removed(
        tmp_path, caplog):
    """A directory with a ``slots/a`` of someone else's files, or a ``dbsync.json`` that is no
    dbsync head, was taken for a store: the first push reusing a slot deleted every file in
    it, and the head was overwritten. Both are refused now, every file left as it was. A real
    store whose head was damaged is still pushed to, and a file someone put into one of its
    slots is left where it is (said at WARNING)."""
    import logging

    slots = tmp_path / "project" / "slots"
    (slots / "a").mkdir(parents=True)
    (slots / "b").mkdir()
    (slots / "a" / "booking.csv").write_text("important")
    (slots / "b" / "other.csv").write_text("important too")
    other = tmp_path / "other-tool"
    other.mkdir()
    (other / "dbsync.json").write_text('{"database": "prod"}')
    for path, named in ((slots.parent, "slots/a/booking.csv, slots/b/other.csv"),
                        (other, "dbsync.json (not a dbsync head)")):
        before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
        for _ in range(2):
            with pytest.raises(dbsync.FormatError, match="not a dbsync store") as refused:
                with dbsync.Sender(str(path)) as sender:
                    sender.push({"w": torch.ones(2)})
            assert named in str(refused.value)
        assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before

    store = tmp_path / "store"
    with dbsync.Sender(str(store)) as sender:
        for v in (1, 2):
            sender.push({"w": torch.full((2,), float(v))})
    (store / "slots" / "a" / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="dbsync"), dbsync.Sender(str(store)) as s:
        assert s.push({"w": torch.full((2,), 3.0)}) == 3  # (into slot a)
    assert (store / "slots" / "a" / "notes.txt").read_text() == "mine"
    assert "notes.txt is not a file dbsync writes; left where it is" in caplog.text
    (store / "slots" / "a" / "notes.txt").unlink()
    (store / "dbsync.json").write_bytes((store / "dbsync.json").read_bytes()[:20])  # damaged
    with dbsync.Sender(str(store)) as sender:
        assert sender.push({"w": torch.full((2,), 4.0)}) == 1  # (a new run: see FORMAT.md)
    with dbsync.Receiver(str(store)) as rx:
        dest = {"w": torch.zeros(2)}
        assert rx.load(dest) == 1 and torch.equal(dest["w"], torch.full((2,), 4.0))


def test_a_push_failing_after_its_stamp_leaves_the_numbering_alone(root, monkeypatch):
    """A push that fails after stamping its slot (here the final directory fsync) frees the
    slot: the next writer continues at the next version, not past a version never published."""
    with dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.ones(2)}) == 1

    def eio(self, slot):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(dbsync.store.Store, "sync_slot", eio)
    with dbsync.Sender(root) as sender, pytest.raises(OSError):
        sender.push({"w": torch.full((2,), 2.0)})
    monkeypatch.undo()
    assert dbsync.store.Store(root).read_stamp("b")[0] == "writing"  # the slot is free
    with dbsync.Sender(root) as sender:
        assert sender.next_version == 2
        assert sender.push({"w": torch.full((2,), 2.0)}) == 2


def test_a_writer_that_died_before_its_flip_leaves_the_numbering_alone(root):
    """A writer killed after stamping its slot with the next version but before the flip:
    nobody saw that version, and the next writer publishes that number itself (a restored
    head is told apart by its own slot's stamp, rewritten since)."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(2)})  # version 1 in slot a
        sender.push({"w": torch.full((2,), 2.0)})  # version 2 in slot b
        run = sender.run_id
    dbsync.store.Store(root).write_stamp("a", 3, run, durable=False)  # died before its flip
    with dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.full((2,), 3.0)}) == 3


def test_a_forked_child_cannot_push_through_its_parents_sender_nor_free_its_lock(root):
    """A forked child (a data-loader or collector worker) has none of the Sender's threads:
    its push used to hang forever. It now raises at once, and the child dropping its copy of
    the Sender leaves the parent's writer lock held (a flock belongs to the shared open file:
    unlocking in the child would have released the parent's)."""
    import warnings

    with dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.ones(3)}) == 1
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads running)
            pid = os.fork()
        if pid == 0:  # the child: report, close its copy of the Sender, leave without cleanup
            try:
                try:
                    sender.push({"w": torch.full((3,), 2.0)})
                    said = "pushed"
                except dbsync.DBSyncError as exc:
                    said = str(exc)
                sender.close()  # (as a `with` block in the child would)
                os.write(write, said.encode()[:4000])
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            said = pipe.read().decode()
        assert os.waitpid(pid, 0)[1] == 0
        assert "forked child" in said and "create the Sender in the process" in said
        with pytest.raises(dbsync.StoreBusyError):  # the parent still holds the lock
            dbsync.Sender(root)
        assert sender.push({"w": torch.full((3,), 3.0)}) == 2
    with dbsync.Receiver(root) as receiver:
        got = {}
        assert receiver.load(lambda pairs: got.update({n: t.clone() for n, t in pairs})) == 2
    assert torch.equal(got["w"], torch.full((3,), 3.0))


def test_a_store_removed_under_a_receiver_is_reported_gone_not_empty(tmp_path):
    """A load after the store's directory went away (removed, or its volume unmounted) says
    so, not that nothing was published yet; the error is still a NothingPublishedError, so
    code that waits for a first version keeps waiting."""
    root = tmp_path / "store"
    publish(root, {"w": torch.ones(4)})
    with dbsync.Receiver(root) as rx:
        shutil.rmtree(root)
        with pytest.raises(dbsync.StoreNotFoundError, match="removed, or its volume unmounted"):
            rx.load(lambda pairs: None)
        with pytest.raises(dbsync.NothingPublishedError):
            rx.load(lambda pairs: None)


def test_a_head_whose_flip_landed_but_not_durably_counts_as_published(root, caplog):
    """The head's rename lands but its directory's fsync fails (a disk turning read-only
    just then): readers see the new version, so the Sender counts it as published, says the
    flip may not be durable, and the next push takes the next number and the other slot."""
    import logging

    with dbsync.Sender(root) as sender:
        assert sender.push({"w": torch.ones(4)}) == 1
        publish = sender.store.publish_head

        def landed_then_failed(head, durable):
            publish(head, durable)
            raise OSError(errno.EROFS, "Read-only file system")

        sender.store.publish_head = landed_then_failed
        with caplog.at_level(logging.WARNING, logger="dbsync"):
            assert sender.push({"w": torch.full((4,), 2.0)}) == 2
        sender.store.publish_head = publish
        assert any("version 2" in r.getMessage() and "durable failed" in r.getMessage()
                   for r in caplog.records)
        assert sender.push({"w": torch.full((4,), 3.0)}) == 3
    got = {}
    with dbsync.Receiver(root) as rx:
        assert rx.load(lambda pairs: got.update({n: t.clone() for n, t in pairs})) == 3
    assert torch.equal(got["w"], torch.full((4,), 3.0))


def test_a_long_lived_trainer_removes_the_temp_files_of_killed_readers(root, monkeypatch):
    """A reader killed while writing its lease leaves ``readers/.tmp-*``: a running Sender
    removes it once it is old (only a newly started Sender did, so a trainer living for
    days listed them at every push)."""
    from dbsync import sender as sender_module

    with dbsync.Sender(root, durable=False) as sender:
        sender.push({"w": torch.ones(4)})
        leftover = os.path.join(sender.store.readers_dir, ".tmp-host-1234.json-1234-abcdef01")
        with open(leftover, "w") as f:
            f.write('{"beat": 1')  # (cut short by the kill)
        hour_ago = time.time() - 3600
        os.utime(leftover, (hour_ago, hour_ago))
        monkeypatch.setattr(sender_module, "PRUNE_MIN_S", 0.0)
        monkeypatch.setattr(sender_module, "PRUNE_EVERY", 0)
        assert sender.push({"w": torch.full((4,), 2.0)}) == 2
        sender._publisher.submit(int).result(30)  # (the look runs right after the push)
        assert not os.path.exists(leftover)


def test_a_long_lived_receiver_keeps_a_bounded_record_of_versions(root):
    """A serving process opens and waits for thousands of versions over days: what it keeps
    per version stays bounded (it kept every version's head record), and the last versions
    it opened can still be opened again while their slots hold them."""
    from dbsync.receiver import KEPT_HEADS

    with dbsync.Sender(root, durable=False) as sender, dbsync.Receiver(root) as rx:
        for value in range(40):
            version = sender.push({"w": torch.full((4,), float(value))})
            assert rx.wait(newer_than=version - 1, timeout=30) == version
            with rx.open() as snap:
                assert snap.version == version
        assert len(rx._heads) <= KEPT_HEADS
        with rx.open(version=40) as snap:
            assert torch.equal(dict(snap.tensors())["w"], torch.full((4,), 39.0))


def test_a_script_ending_with_a_background_push_still_publishes_it(root):
    """The README's asynchronous loop ends with ``push(blocking=False)`` and no ``close()``:
    the version is published before the process exits. (It was abandoned silently: the
    standard library's pools refused its writes once the interpreter began to exit.)"""
    script = ("import sys, torch, dbsync\n"
              "sender = dbsync.Sender(sys.argv[1])\n"
              "sender.push({'w': torch.zeros(1000)})\n"
              "sender.push({f'w{i}': torch.full((1 << 18,), 7.0) for i in range(16)},\n"
              "            blocking=False)\n")
    _script_ends_well(script, root)
    with dbsync.Receiver(root) as rx:
        got = {}
        assert rx.load(lambda pairs: got.update((n, t.clone()) for n, t in pairs)) == 2
    assert len(got) == 16 and torch.equal(got["w15"], torch.full((1 << 18,), 7.0))


def test_a_forked_child_closing_its_copy_of_a_receiver_leaves_the_parents_lease(root):
    """A child forked from a process with a Receiver closes its copy (or exits normally, its
    finalizers running): the parent's lease stays, so the trainer still counts the parent.
    (The child removed it: the parent was invisible until its next heartbeat.)"""
    import multiprocessing as mp

    with dbsync.Sender(root, durable=False) as sender, dbsync.Receiver(
            root, reader_id="parent") as rx:
        version = sender.push({"w": torch.ones(10)})
        rx.load({"w": torch.zeros(10)})
        child = mp.get_context("fork").Process(target=rx.close)
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert os.listdir(os.path.join(root, "readers")) == ["parent.json"]
        assert sender.wait_for_receivers(version, 1, timeout=0)
        pid = os.fork()
        if pid == 0:  # a plain fork whose child runs the interpreter's exit hooks
            import atexit

            try:
                atexit._run_exitfuncs()  # (the Receiver's finalizer among them)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.listdir(os.path.join(root, "readers")) == ["parent.json"]


def test_threads_sharing_a_receiver_while_versions_advance(root):
    """Four threads share one Receiver (``wait`` and ``open``) while a fifth pushes: every
    call returns a published version, none raises. (Keeping the newest head records raced:
    "dictionary changed size during iteration", KeyError.)"""
    import sys
    import threading

    errors: list[BaseException] = []
    stop = threading.Event()
    with dbsync.Sender(root, durable=False) as sender, dbsync.Receiver(root) as rx:
        sender.push({"w": torch.zeros(4)})

        def read() -> None:
            while not stop.is_set():
                try:
                    rx.wait(newer_than=0, timeout=0)
                    with rx.open() as snap:
                        assert snap.version >= 1
                except BaseException as exc:  # noqa: BLE001 - the outcome under test
                    errors.append(exc)

        previous = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # (many switches: the race showed within a second)
        readers = [threading.Thread(target=read) for _ in range(4)]
        try:
            for thread in readers:
                thread.start()
            for value in range(150):
                sender.push({"w": torch.full((4,), float(value))})
        finally:
            stop.set()
            for thread in readers:
                thread.join(60)
            sys.setswitchinterval(previous)
    assert not errors, errors[:3]


def test_a_push_racing_close_from_another_thread_says_the_sender_closed(root):
    """One thread pushes while another closes the Sender: the push raises dbsync's "closed"
    error, never a bare ``RuntimeError`` from the thread pool, and publishes nothing."""
    import threading

    sender = dbsync.Sender(root, durable=False)
    assert sender.push({"w": torch.ones(4)}) == 1
    outcome: list[BaseException | int] = []
    with sender._push_lock:  # (the push waits its turn behind this, then close() wins)
        pusher = threading.Thread(target=lambda: outcome.append(_push_or_error(sender)))
        pusher.start()
        sender.close()
    pusher.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], dbsync.DBSyncError), outcome
    assert "closed" in str(outcome[0])
    with dbsync.Receiver(root) as rx:
        assert rx.latest_version() == 1


def _push_or_error(sender):
    try:
        return sender.push({"w": torch.full((4,), 2.0)})
    except BaseException as exc:  # noqa: BLE001 - the outcome under test
        return exc


def test_an_exit_waiting_on_a_push_that_cannot_finish_gives_up_and_says_so(root,
                                                                           monkeypatch):
    """The last background push needs the slot this very process still reads (a snapshot
    its finalizers would close only later): the exit waits a bounded time, then abandons the
    push before its flip with a WARNING, and the process ends. (It hung forever.)"""
    script = ("import sys, torch, dbsync\n"
              "from dbsync import sender as s\n"
              "s.EXIT_WAIT_SECONDS, s.EXIT_QUIET_SECONDS = 3.0, 1.0\n"
              "tx = dbsync.Sender(sys.argv[1], durable=False)\n"
              "rx = dbsync.Receiver(sys.argv[1])\n"
              "tx.push({'w': torch.zeros(4)})\n"
              "snap = rx.open()\n"
              "tx.push({'w': torch.ones(4)})\n"
              "tx.push({'w': torch.full((4,), 3.0)}, blocking=False)\n")
    done = _script_ends_well(script, root)
    assert "abandoned the background push" in done.stderr and "version 2" in done.stderr
    with dbsync.Receiver(root) as rx:
        assert rx.latest_version() == 2


def _script_ends_well(script: str, root: str):
    """Run ``script`` (given ROOT as its argument) in a fresh interpreter; it must exit 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_senders_and_receivers_refuse_to_be_pickled_saying_what_to_do(root):
    """Handing a Sender or Receiver to a spawned process (multiprocessing pickles it) or
    deep-copying a trainer's state gave ``cannot pickle '_queue.SimpleQueue' object``."""
    import copy
    import pickle

    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        sender.push({"w": torch.ones(2)})
        for what, obj in (("a Sender", sender), ("a Receiver", rx)):
            for attempt in (pickle.dumps, copy.deepcopy):
                with pytest.raises(dbsync.DBSyncError, match=f"{what} cannot be pickled or "
                                   "copied.*create one in"):
                    attempt(obj)
        assert sender.push({"w": torch.ones(2)}) == 2 and rx.load(lambda pairs: None) == 2


def test_a_writer_refused_by_a_stopped_lock_holder_is_told_it_is_stopped(root):
    """A trainer restarted while its predecessor sits stopped (SIGSTOP, a frozen cgroup) got
    advice about processes that exited; it is told that the holder is stopped."""
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, dbsync; s = dbsync.Sender(sys.argv[1]); "
         "print('locked', flush=True); sys.stdin.read()", root],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGSTOP)
        os.waitpid(holder.pid, os.WUNTRACED)  # (returns once it is stopped: the signal is async)
        with pytest.raises(dbsync.StoreBusyError, match=f"process {holder.pid} of this host, "
                           "which is stopped .SIGSTOP, or a frozen cgroup"):
            dbsync.Sender(root)
    finally:
        holder.kill()
        holder.wait()


def test_a_store_symlink_to_a_missing_directory_says_to_create_it(tmp_path):
    """A ROOT that is a symlink ("current" -> a volume's directory) is followed; one whose
    target does not exist yet was called "a symlink, not a directory; dbsync never follows
    links inside a store", which sent users the wrong way. Nothing is created."""
    link = tmp_path / "current"
    link.symlink_to("vol/policy")
    with pytest.raises(dbsync.StoreNotFoundError, match="'vol/policy', which does not exist"):
        dbsync.Sender(link)
    assert not (tmp_path / "vol").exists()
    (tmp_path / "vol" / "policy").mkdir(parents=True)
    with dbsync.Sender(link) as sender:
        assert sender.push({"w": torch.ones(2)}) == 1
    assert (tmp_path / "vol" / "policy" / "dbsync.json").exists()


@pytest.mark.parametrize("kind", ["w.pt", "w.safetensors"])
def test_a_file_rewritten_in_place_while_it_is_pushed_publishes_nothing(root, tmp_path, kind):
    """A path pushed is memory-mapped and read while the shards are written; the trainer
    saved the next checkpoint over it meanwhile (``torch.save`` to the same path rewrites the
    same file). The version published mixed both files' tensors, each with a matching
    checksum, and loaded as verified. Now the push looks at its files again before the flip
    and refuses, naming the file; the previous version stays current."""
    from safetensors.torch import save as safetensors_bytes

    def save(weights: dict, path: str) -> None:  # (in place: the same file, truncated)
        if kind.endswith(".pt"):
            torch.save(weights, path)
        else:
            with open(path, "wb") as f:
                f.write(safetensors_bytes(weights))

    src = str(tmp_path / kind)
    old = {f"w{i:03d}": torch.full((4096,), float(i)) for i in range(128)}
    new = {name: t + 1000 for name, t in old.items()}
    save(old, src)
    rewritten = threading.Event()

    def rewrite_it(done: int, total: int) -> None:  # (from the push's writer thread)
        if not rewritten.is_set():
            rewritten.set()
            save(new, src)

    with dbsync.Sender(root, num_threads=1) as sender:
        assert sender.push({"w000": torch.zeros(4096)}) == 1
        sender.shard_bytes = 64 * 1024  # (many shards: the rewrite lands between two)
        with pytest.raises(dbsync.SourceChangedError, match=f"{kind} rewritten in place"):
            sender.push(src, progress=rewrite_it)
        assert rewritten.is_set() and sender.latest_version() == 1
        assert sender.push(src) == 2  # (written: pushed whole)
    with dbsync.Receiver(root) as rx:
        dest = {name: torch.empty(4096) for name in new}
        assert rx.load(dest) == 2
        assert all(torch.equal(dest[n], new[n]) for n in new)


def test_a_writer_that_mostly_waits_for_readers_is_told_once_in_a_while():
    """One slow reader sets a trainer's push rate, each wait said only at INFO: a writer
    whose pushes spent at least half of the last minute waiting is warned, and then not
    again for five minutes; one that waits a little never is."""
    from dbsync.leases import WaitShare

    slow, quick = WaitShare(), WaitShare()
    warned, never = [], []
    for i in range(1, 81):  # a push every 5.1 s, 5 s of it waiting for a reader
        share = slow.add(5.0, 5.1 * i)
        if share is not None:
            warned.append((round(5.1 * i, 1), round(share, 2)))
        never.append(quick.add(0.05, 1.0 * i))
    assert warned == [(30.6, 0.98), (331.5, 0.98)], warned
    assert set(never) == {None}
