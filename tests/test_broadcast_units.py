"""Broadcast fast path, in one process: header and layout validation, the rendezvous file, and
the group behaviours that threads can show without spawning (abort when a member does not
acknowledge, a sender that goes away, an unreachable rendezvous)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from dbsync import DBSyncError, Sender, StoreFullError
from dbsync.nccl import (
    BroadcastError,
    BroadcastReceiver,
    BroadcastSender,
    RendezvousError,
    read_record,
)
from dbsync.nccl.group import resolve_backend
from dbsync.nccl.layout import ALIGN, Header, bucket_plan
from dbsync.nccl.rendezvous import RendezvousRecord, rendezvous_path
from dbsync.store import Store

TIMEOUT = 1.5


def specs(n: int = 5) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(f"t{i}", torch.float32, (i, 3)) for i in range(n)] + [
        ("scalar", torch.bfloat16, ()), ("empty", torch.int8, (0,))]


def test_header_round_trip_and_layout_cache() -> None:
    header = Header.build(7, 2, 3, 128, specs())
    cache: dict[str, Any] = {}
    again = Header.loads(header.dumps(), cache)
    assert again == header
    nxt = Header.build(8, 2, 4, 128, specs())
    parsed = Header.loads(nxt.dumps(), cache)
    assert parsed.version == 8 and parsed.seq == 4 and parsed.entries == header.entries
    assert all(e.offset % ALIGN == 0 for e in header.entries)


def test_the_sender_s_header_is_kept_while_the_tensors_keep_their_layout() -> None:
    """A push's header is built once and kept while names, dtypes, shapes and settings stay:
    for the same tensors updated in place (the quick check) and for new tensors of the same
    layout; a tensor reshaped or viewed as another dtype at the same address, a name or a
    setting changed, each build a header of the new layout."""
    from dbsync.nccl.layout import HeaderCache

    cache = HeaderCache()
    built: list[Header] = []

    def header(pairs: list[tuple[str, torch.Tensor]], settings: tuple = ("x", None, 128)
               ) -> Header:
        def build() -> Header:
            built.append(Header.build(1, 1, 1, 128, [(n, t.dtype, tuple(t.shape))
                                                     for n, t in pairs]))
            return built[-1]
        return cache.header(pairs, settings, build)

    pairs = [(f"t{i}", torch.zeros(i + 1, 4)) for i in range(6)]
    first = header(pairs)
    for t in dict(pairs).values():
        t.add_(1)  # the optimizer's in-place step
    assert header(pairs) is first
    moved = [(n, t.clone()) for n, t in pairs]
    assert header(moved) is first  # new tensors, same layout
    assert cache.kept.states.matches([t for _, t in moved])  # (their states, taken once)
    assert header(moved) is first
    assert len(built) == 1
    reshaped = list(pairs)
    reshaped[2] = ("t2", pairs[2][1].view(4, 3))
    assert header(reshaped).entries[2].shape == (4, 3)
    retyped = list(pairs)
    retyped[1] = ("t1", pairs[1][1].view(torch.int32))
    assert header(retyped).entries[1].dtype == "int32"
    assert header([("u0", pairs[0][1]), *pairs[1:]]).entries[0].name == "u0"
    assert header(pairs, ("x", torch.bfloat16, 128)) is not header(pairs)
    assert len(built) == 6
    assert [e.shape for e in header(pairs).entries] == [(i + 1, 4) for i in range(6)]


META = b'{"version": 1, "epoch": 1, "seq": 1}\n'


@pytest.mark.parametrize("bad", [
    b"not json\n{}",
    META + b'{"bucket_bytes": 100, "checksum": null, "tensors": []}',
    META + b'{"bucket_bytes": 64, "checksum": null, "tensors": [["a", "f32", [1]]]}',
    META + b'{"bucket_bytes": 64, "checksum": null, "tensors": [["a", "float32", [-1]]]}',
    META + b'{"bucket_bytes": 64, "checksum": "md5", "tensors": [["a", "float32", [1]]]}',
    META + b'{"bucket_bytes": 64, "checksum": null, "tensors": [["", "float32", [1]]]}',
    META + b'{"bucket_bytes": 64, "tensors": [["a", "float32", [1]]]}',
])
def test_malformed_headers_are_refused(bad: bytes) -> None:
    with pytest.raises(BroadcastError):
        Header.loads(bad)


def test_bucket_plan_covers_every_byte_once() -> None:
    header = Header.build(1, 1, 1, 192, [(f"t{i}", torch.uint8, (n,))
                                         for i, n in enumerate([1, 500, 0, 64, 191, 7])])
    seen: dict[int, list[tuple[int, int]]] = {}
    for b, pieces in enumerate(bucket_plan(header)):
        lo, hi = header.buckets()[b]
        for i, start, end in pieces:
            off = header.entries[i].offset
            assert lo <= off + start < off + end <= hi
            seen.setdefault(i, []).append((start, end))
    for i, e in enumerate(header.entries):
        ranges = seen.get(i, [])
        assert sum(end - start for start, end in ranges) == e.nbytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_rendezvous_file_written_atomically_and_withdrawn(tmp_path: Any) -> None:
    with Sender(tmp_path, durable=False) as sender:
        bs = BroadcastSender(sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT)
        record = read_record(sender.store)
        assert record is not None and record.port == bs.port and record.backend == "gloo"
        assert record.members == () and record.world_size == 1
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
        bs.close()
        assert read_record(sender.store) is None


def test_bad_rendezvous_file_is_reported(tmp_path: Any) -> None:
    store = Store(tmp_path, create=True)
    with open(rendezvous_path(store), "w") as f:
        f.write('{"format": "dbsync-broadcast", "format_version": 99}')
    with pytest.raises(RendezvousError, match="upgrade dbsync on this host"):
        read_record(store)
    with open(rendezvous_path(store), "w") as f:  # a sender from before doorbells
        f.write('{"format": "dbsync-broadcast", "format_version": 1}')
    with pytest.raises(RendezvousError, match="sender runs an older dbsync: upgrade it"):
        read_record(store)
    rec = RendezvousRecord("id", "127.0.0.1", 1234, "gloo", 3, ("a",), 64, 1.0)
    assert RendezvousRecord.loads(rec.dumps(), "x").members == ("a",)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "directory", "deep nesting",
                                  "huge"])
def test_a_hostile_rendezvous_path_sends_receivers_to_the_filesystem(tmp_path: Any,
                                                                    kind: str) -> None:
    """ROOT/broadcast.json is anyone's to write: whatever lies there, a receiver takes the
    version from the filesystem at once (it used to hang on a FIFO, read /dev/zero until out
    of memory, or raise)."""
    from dbsync.vllm.transport import offered_backend

    root = str(tmp_path / "store")
    with Sender(root, durable=False) as sender:
        sender.push({"w": torch.arange(10.0)})
    path = rendezvous_path(Store(root))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "deep nesting":  # (within the size bound: the JSON parser's own limit)
        with open(path, "w") as f:
            f.write("[" * 30_000 + "]" * 30_000)
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 30)  # (sparse: a gigabyte that costs no disk)
    started = time.monotonic()
    with pytest.raises(RendezvousError, match="broadcast.json"):
        read_record(Store(root))
    assert time.monotonic() - started < 1  # (nothing is read through: no gigabyte, no FIFO)
    started = time.monotonic()
    assert offered_backend(root) is None  # (what vLLM workers poll each second: the same)
    assert time.monotonic() - started < 1
    got: dict[str, torch.Tensor] = {}
    receiver = BroadcastReceiver(root, timeout=3)
    try:
        started = time.monotonic()
        version = receiver.receive(lambda pairs: got.update((n, t.clone()) for n, t in pairs),
                                   timeout=10)
        assert time.monotonic() - started < 10
    finally:
        receiver.close()
    assert version == 1 and receiver.last_source == "filesystem"
    assert torch.equal(got["w"], torch.arange(10.0))


def test_close_from_another_thread_ends_a_receive_under_way(tmp_path: Any) -> None:
    """A background receiving thread can be shut down: close() returns, and the receive it
    was in raises (close() used to wait for the receive, forever without a timeout)."""
    root = str(tmp_path / "store")
    with Sender(root, durable=False) as sender:
        sender.push({"w": torch.ones(2)})
    receiver = BroadcastReceiver(root, timeout=3)
    assert receiver.receive(lambda pairs: None) == 1
    outcome: list[BaseException | int | None] = []
    thread = threading.Thread(target=lambda: _record(outcome, receiver.receive, lambda p: None))
    thread.start()
    while not receiver._lock.locked():  # (the handshake: the receive is waiting)
        assert thread.is_alive()
        time.sleep(0.001)
    closing = threading.Thread(target=receiver.close)
    closing.start()
    closing.join(10)
    thread.join(10)
    assert not closing.is_alive() and not thread.is_alive()
    assert isinstance(outcome[0], DBSyncError) and "closed" in str(outcome[0])
    with pytest.raises(DBSyncError, match="closed"):
        receiver.receive(lambda pairs: None, timeout=0)


def _record(outcome: list[Any], call: Any, *args: Any) -> None:
    try:
        outcome.append(call(*args))
    except BaseException as exc:  # noqa: BLE001 - the outcome under test
        outcome.append(exc)


def test_argument_errors_say_what_to_do(tmp_path: Any) -> None:
    with pytest.raises(BroadcastError, match="CUDA device"):
        resolve_backend("nccl", torch.device("cpu"))
    with Sender(tmp_path, durable=False) as sender:
        with pytest.raises(DBSyncError, match="multiple of 64"):
            BroadcastSender(sender, device="cpu", bucket_bytes=100)
        with pytest.raises(DBSyncError, match="join_timeout must be a finite number"):
            BroadcastSender(sender, device="cpu", join_timeout=-1)
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds >= 0, "
                           "not nan"):
            BroadcastSender(sender, device="cpu", timeout=float("nan"))
        with pytest.raises(DBSyncError, match="port must be 0"):
            BroadcastSender(sender, device="cpu", port=99999)
        closed = BroadcastSender(sender, device="cpu", address="127.0.0.1")
        closed.close()
        with pytest.raises(DBSyncError, match="closed"):  # (it used to publish silently)
            closed.push({"w": torch.ones(2)})
        assert sender.latest_version() is None
    with pytest.raises(DBSyncError) as bad:  # one error listing every bad setting
        BroadcastReceiver(tmp_path, timeout=0, fallback_timeout=-5, depth=0)
    assert all(word in str(bad.value) for word in ("timeout must", "fallback_timeout must",
                                                   "depth must"))
    assert not os.listdir(os.path.join(tmp_path, "readers"))  # nothing was registered


def test_a_broadcast_sender_that_cannot_start_leaves_the_store_free(tmp_path: Any) -> None:
    """A port in use (or a backend the device cannot take): a BroadcastError saying what to
    do, and the store's writer lock is released at once, so the next try in the same process
    works. (The raw torch error kept the lock while the traceback lived, as a notebook keeps
    it: the retry was refused as "another writer".)"""
    import socket

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        with pytest.raises(BroadcastError, match="pass port=0 for a free port") as failed:
            BroadcastSender(tmp_path, device="cpu", port=busy.getsockname()[1])
        with pytest.raises(BroadcastError, match="CUDA device"):
            BroadcastSender(tmp_path, device="cpu", backend="nccl")
        kept = failed  # (the traceback, and all it references, still alive)
        sender = BroadcastSender(tmp_path, device="cpu", address="127.0.0.1")
        try:
            assert sender.port != busy.getsockname()[1]
        finally:
            sender.close()
        del kept


def _receive_in_thread(rx: BroadcastReceiver, out: dict[str, Any], **kw: Any) -> threading.Thread:
    def run() -> None:
        got: dict[str, torch.Tensor] = {}

        def load(pairs: Any) -> None:
            got.clear()
            got.update({n: t.clone() for n, t in pairs})

        try:
            out["version"] = rx.receive(load, **kw)
            out["source"], out["got"], out["error"] = rx.last_source, got, rx.last_error
        except Exception as exc:  # noqa: BLE001 - checked by the test
            out["exception"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_member_that_does_not_acknowledge_aborts_the_push_for_all(tmp_path: Any) -> None:
    """Two members; one stops calling receive. The push is aborted after the timeout, the
    other member (already waiting for the first bucket) reads it from the filesystem, and the
    version is published."""
    root = str(tmp_path)
    weights = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 3)}
    with Sender(root, durable=False) as sender, BroadcastSender(
            sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT, join_timeout=10,
            bucket_bytes=1024) as bs, BroadcastReceiver(
            root, reader_id="busy", timeout=TIMEOUT, address="127.0.0.1") as busy, \
            BroadcastReceiver(root, reader_id="keen", timeout=TIMEOUT,
                              address="127.0.0.1") as keen:
        outs: list[dict[str, Any]] = [{}, {}]
        threads = [_receive_in_thread(rx, o, timeout=30) for rx, o in zip((busy, keen), outs,
                                                                            strict=True)]
        assert bs.wait_for_joins(2, 10)
        assert bs.push(weights) == 1
        for t in threads:
            t.join(20)
        assert [o["source"] for o in outs] == ["broadcast", "broadcast"], outs
        assert bs.members == ("busy", "keen")

        out: dict[str, Any] = {}
        thread = _receive_in_thread(keen, out, timeout=30)
        time.sleep(0.1)
        weights2 = {k: v + 1 for k, v in weights.items()}
        t0 = time.monotonic()
        assert bs.push(weights2) == 2
        assert time.monotonic() - t0 < TIMEOUT + 2
        assert "busy" in bs.last_push_stats["error"]
        thread.join(20)
        assert out["version"] == 2 and out["source"] == "filesystem", out
        assert all(torch.equal(out["got"][k], v) for k, v in weights2.items())
        # The member learns of the abort either from the sender's notice or from its own
        # collective timing out first (under load); both end in the filesystem copy above.
        assert any(word in (out["error"] or "") for word in ("aborted", "timeout")), out


def test_receiver_without_or_with_dead_rendezvous_uses_the_filesystem(tmp_path: Any) -> None:
    root = str(tmp_path)
    with Sender(root, durable=False) as sender:
        sender.push({"x": torch.ones(4)})
        rx = BroadcastReceiver(root, timeout=TIMEOUT)
        assert rx.receive(lambda pairs: [t.clone() for _, t in pairs], timeout=5) == 1
        assert rx.last_source == "filesystem" and not rx.is_member
        # a rendezvous file whose sender is gone (a stale file, a wrong address): the
        # connect attempt runs beside the filesystem, never before it (it held every receive
        # up for the 9-13 s torch's client spends on it), and its failure is reported
        record = RendezvousRecord("gone", "127.0.0.1", 9, "gloo", 1, (), 64, 1.0)
        with open(rendezvous_path(sender.store), "wb") as f:
            f.write(record.dumps())
        sender.push({"x": torch.zeros(4)})
        t0 = time.monotonic()
        assert rx.receive(lambda pairs: [t.clone() for _, t in pairs], timeout=20) == 2
        assert time.monotonic() - t0 < 2
        assert rx.last_source == "filesystem"
        deadline = time.monotonic() + 60  # (the attempt ends within its timeout and retries)
        while "cannot reach" not in (rx.last_error or "") and time.monotonic() < deadline:
            assert rx.receive(lambda pairs: None, timeout=0.5) is None  # (nothing newer)
        assert "cannot reach" in (rx.last_error or "") and "trying again in 5 s" in rx.last_error
        rx.close()


def test_sender_closing_sends_members_to_the_filesystem(tmp_path: Any) -> None:
    root = str(tmp_path)
    with Sender(root, durable=False) as sender:
        bs = BroadcastSender(sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT)
        with BroadcastReceiver(root, timeout=TIMEOUT, address="127.0.0.1") as rx:
            out: dict[str, Any] = {}
            thread = _receive_in_thread(rx, out, timeout=30)
            assert bs.wait_for_joins(1, 10)
            assert bs.push({"x": torch.ones(8)}) == 1
            thread.join(20)
            assert out["source"] == "broadcast"
            bs.close()
            sender.push({"x": torch.full((8,), 2.0)})
            out = {}
            thread = _receive_in_thread(rx, out, timeout=30)
            thread.join(20)
            assert out["version"] == 2 and out["source"] == "filesystem"
            assert torch.equal(out["got"]["x"], torch.full((8,), 2.0))


def test_version_republished_after_a_failed_publish_replaces_the_broadcast_copy(
        tmp_path: Any) -> None:
    """The filesystem publish of a broadcast version fails; the next push reuses its number
    with other bytes. A member that took the first broadcast must end with the bytes the
    manifest describes, not the unpublished ones."""
    root = str(tmp_path)
    with Sender(root, durable=False) as sender, BroadcastSender(
            sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT,
            join_timeout=10) as bs, BroadcastReceiver(
            root, reader_id="r", timeout=TIMEOUT, address="127.0.0.1") as rx:
        first: dict[str, Any] = {}
        thread = _receive_in_thread(rx, first, timeout=20)
        assert bs.wait_for_joins(1, 10)
        publish, calls = sender.store.publish_head, []

        def fail_once(manifest: Any, durable: bool) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise OSError(28, "No space left on device")
            publish(manifest, durable)

        sender.store.publish_head = fail_once  # type: ignore[method-assign]
        with pytest.raises(StoreFullError, match="nothing was published"):
            bs.push({"x": torch.ones(4)})
        thread.join(20)
        assert first["version"] == 1 and first["source"] == "broadcast"
        assert sender.latest_version() is None  # never published

        second: dict[str, Any] = {}
        thread = _receive_in_thread(rx, second, timeout=10)
        time.sleep(0.2)
        assert bs.push({"x": torch.full((4,), 2.0)}) == 1
        thread.join(20)
        assert second["version"] == 1, second
        assert torch.equal(second["got"]["x"], torch.full((4,), 2.0))


def test_whole_version_receiver_hands_out_tensors_that_stay_valid(tmp_path: Any) -> None:
    """``whole_version=True`` (vLLM staging): what ``receive`` handed out is its own memory,
    still exact after a later version arrived; nothing is copied out."""
    root = str(tmp_path)
    gen = torch.Generator().manual_seed(5)
    first = {f"w{i}": torch.randn(40, 13, generator=gen) for i in range(6)}
    second = {k: v * 3 for k, v in first.items()}
    with Sender(root, durable=False) as sender, BroadcastSender(
            sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT, join_timeout=10,
            bucket_bytes=1024) as bs, BroadcastReceiver(
            root, reader_id="w", timeout=TIMEOUT, address="127.0.0.1",
            whole_version=True) as rx:
        kept: list[dict[str, torch.Tensor]] = []
        done = threading.Event()

        def run() -> None:
            for _ in range(2):
                rx.receive(lambda pairs: kept.append(dict(pairs)), timeout=30)
            done.set()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert bs.wait_for_joins(1, 10)
        assert bs.push(first) == 1
        assert bs.push(second) == 2
        assert done.wait(30)
        assert rx.last_source == "broadcast" and rx.last_stats["verified_buckets"] > 3
        for got, want in zip(kept, (first, second), strict=True):
            assert list(got) == list(want)
            assert all(torch.equal(got[k], v) for k, v in want.items())


def test_key_watch_rings_per_key_moves_on_and_reports_a_lost_store() -> None:
    """``KeyWatch`` on a real ``TCPStore``: it rings once per key of its sequence as they are
    set (in order, without being told), a new target releases the wait on the old one (the
    owner sets that key), ``close`` returns only once the thread has ended (a thread still in
    the store's C++ wait when the interpreter finalizes aborts the process: 11 of 30 exits
    right after ``close`` did, before it joined), and a store that goes away is reported in
    ``failed`` with ``rung`` set, so a waiting caller wakes."""
    import datetime

    import torch.distributed as dist

    from dbsync.nccl.keywatch import KeyWatch

    box = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))]
    port = box[0].port

    def connect() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False,
                             timeout=datetime.timedelta(seconds=10))

    released: list[str] = []

    def release(key: str) -> None:
        released.append(key)
        box[0].set(key, "moved")

    watch = KeyWatch(connect, release, name="test-keywatch")
    assert not watch.wait(0.05)  # nothing watched yet
    watch.watch(lambda n: f"a/{n}", 1)
    box[0].set("a/1", "x")
    assert watch.wait(10)
    watch.clear()
    box[0].set("a/2", "x")  # the watch moved on to a/2 by itself
    assert watch.wait(10)
    watch.clear()
    assert not watch.wait(0.05)

    watch.watch(lambda n: f"b/{n}", 7)  # releases the wait on a/3
    deadline = time.monotonic() + 10
    while "a/3" not in released and time.monotonic() < deadline:
        time.sleep(0.01)  # the release happens in watch(); its thread re-targets
    assert released == ["a/3"]
    assert not watch.wait(0.1)  # the release is not a ring
    box[0].set("b/7", "x")
    assert watch.wait(10) and watch.working
    watch.close()
    assert released[-1] == "b/8" and not watch.working
    assert not any(t.name == "test-keywatch" for t in threading.enumerate())  # not joined here

    lost = KeyWatch(connect, release, name="test-keywatch-lost")
    lost.watch(lambda n: f"c/{n}", 1)
    box[0].set("c/1", "x")
    assert lost.wait(10)  # connected, and now waiting for c/2
    lost.clear()
    box.clear()  # the store's server goes away with its last reference
    assert lost.wait(30)
    assert lost.failed is not None and "lost the store connection" in lost.failed
    assert not lost.working


def _joined(name: str) -> bool:
    for t in threading.enumerate():
        if t.name == name:
            t.join(10)
    return not any(t.name == name for t in threading.enumerate())


def test_a_receiver_dropped_without_close_is_collected_and_its_doorbell_ends(
        tmp_path: Any) -> None:
    """The doorbell's thread holds nothing of its receiver: a receiver dropped without
    ``close`` is collected (its lease thread and buffers go with it) and its doorbell thread
    ends."""
    import gc
    import weakref

    root = str(tmp_path)
    with Sender(root, durable=False) as sender, BroadcastSender(
            sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT) as bs:
        rx = BroadcastReceiver(root, reader_id="dropped", timeout=TIMEOUT,
                               address="127.0.0.1")
        out: dict[str, Any] = {}
        thread = _receive_in_thread(rx, out, timeout=30)
        assert bs.wait_for_joins(1, 10)
        assert bs.push({"x": torch.ones(8)}) == 1
        thread.join(20)
        assert out["source"] == "broadcast" and rx.is_member
        assert any(t.name == "dbsync-bell-dropped" for t in threading.enumerate())
        gone = weakref.ref(rx)
        del rx, thread
        gc.collect()
        assert gone() is None
        assert _joined("dbsync-bell-dropped")


def test_the_sender_store_keeps_only_the_last_pushes_keys(tmp_path: Any, monkeypatch: Any
                                                          ) -> None:
    """A push's header (the whole layout), acknowledgements, doorbells and confirmation are
    deleted two pushes later, also across an epoch change: the sender's store does not grow
    with every push. Members wake by their doorbells alone (the periodic epoch re-read is
    pushed out of the test's reach): for every push, and when a second member joining ends
    the epoch the first one waits in."""
    from dbsync.nccl import member, receiver
    from dbsync.nccl import rendezvous as rv

    monkeypatch.setattr(member, "MEMBER_EPOCH_CHECK_SECONDS", 120.0)
    monkeypatch.setattr(receiver, "MEMBER_EPOCH_CHECK_SECONDS", 120.0)
    root = str(tmp_path)
    with Sender(root, durable=False) as sender, BroadcastSender(
            sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT) as bs, \
            BroadcastReceiver(root, reader_id="m", timeout=TIMEOUT, address="127.0.0.1") as rx:
        out: dict[str, Any] = {}
        thread = _receive_in_thread(rx, out, timeout=60)
        assert bs.wait_for_joins(1, 10)
        for version in range(1, 5):
            if version > 1:
                out = {}
                thread = _receive_in_thread(rx, out, timeout=60)
            assert bs.push({"x": torch.full((8,), float(version))}) == version
            thread.join(20)
            assert out["source"] == "broadcast" and out["version"] == version
        kv, first_epoch = bs.membership.kv, bs.epoch

        def kept(epoch: int, seq: int, members: tuple[str, ...] = ("m",)) -> list[bool]:
            keys = [rv.push_key(epoch, seq), rv.published_key(epoch, seq)]
            for m in members:
                keys += [rv.ack_key(epoch, seq, m), rv.bell_key(epoch, seq, m)]
            return [kv.check([key]) for key in keys]

        assert kept(first_epoch, 1) == [False] * 4 and kept(first_epoch, 2) == [False] * 4
        assert kept(first_epoch, 3) == [True] * 4 and kept(first_epoch, 4) == [True] * 4
        # the member was woken by its doorbell for each of the four pushes (it is not polled)
        bell = rx.link.bell
        assert bell is not None and bell.working
        deadline = time.monotonic() + 10
        while bell.rings < 4 and time.monotonic() < deadline:
            bell.wait(0.1)  # the fourth ring may still be on its way to the watch thread
        assert bell.rings == 4

        # a second member: the next push ends the epoch; "m", waiting for push 5 of the
        # first epoch, is rung out of it and takes pushes 5 to 7 in the second epoch
        with BroadcastReceiver(root, reader_id="m2", timeout=TIMEOUT,
                               address="127.0.0.1") as rx2:
            for version in range(5, 8):
                outs: list[dict[str, Any]] = [{}, {}]
                threads = [_receive_in_thread(r, o, timeout=60, newer_than=version - 1)
                           for r, o in zip((rx, rx2), outs, strict=True)]
                if version == 5:
                    assert bs.wait_for_joins(2, 10)
                assert bs.push({"x": torch.full((8,), float(version))}) == version
                for t in threads:
                    t.join(30)
                assert [o.get("version") for o in outs] == [version, version], outs
                assert [o.get("source") for o in outs] == ["broadcast"] * 2, outs
            assert bs.epoch > first_epoch and bs.members == ("m", "m2")
            both = ("m", "m2")
            # the first epoch's last two pushes are gone too, and so is the new one's first
            assert kept(first_epoch, 3) == [False] * 4 and kept(first_epoch, 4) == [False] * 4
            assert kept(bs.epoch, 1, both) == [False] * 6
            assert kept(bs.epoch, 2, both) == [True] * 6 and kept(bs.epoch, 3, both) == [True] * 6
