"""The broadcast's parts, each alone, in one process over a real two-rank gloo group (two
threads): the bucket checksum, the outgoing bucket stream (packing, dtype conversion per
bucket, sealing) against the incoming one (verification on the receiver's device before any
tensor is handed out), and the sender's membership bookkeeping."""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dbsync import Sender
from dbsync.nccl import BroadcastError, checksum
from dbsync.nccl import rendezvous as rv
from dbsync.nccl.group import Group
from dbsync.nccl.layout import Header
from dbsync.nccl.membership import Membership
from dbsync.nccl.outgoing import OutgoingStream
from dbsync.nccl.stream import IncomingVersion

TIMEOUT = 5.0


def test_checksum_catches_every_single_byte_flip_and_moved_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    region = torch.randint(0, 256, (16 * checksum.ROW_BYTES,), dtype=torch.uint8, generator=gen)
    base = checksum.region_sums(region)
    for pos in torch.randint(0, region.numel(), (64,), generator=gen).tolist():
        damaged = region.clone()
        damaged[pos] ^= 1 << (pos % 8)
        assert not torch.equal(checksum.region_sums(damaged), base), pos
    swapped = region.view(16, -1).flip(0).reshape(-1)  # every row moved, same words
    assert not torch.equal(checksum.region_sums(swapped), base)
    assert torch.equal(checksum.region_sums(region.clone()), base)
    with pytest.raises(ValueError, match="whole"):
        checksum.region_sums(region[:100])


def test_seal_then_check_and_a_flipped_byte_is_refused() -> None:
    buf = torch.randint(0, 256, (checksum.buffer_bytes(10_000),), dtype=torch.uint8)
    sent = checksum.seal(buf, 10_000)
    assert sent == checksum.wire_bytes(10_000, True) == checksum.padded(10_000) + 64
    assert checksum.check(buf, 10_000)
    buf[9_999] ^= 0x80
    assert not checksum.check(buf, 10_000)


@pytest.fixture
def pair() -> Iterator[tuple[Group, Group]]:
    """A sender group (rank 0) and a receiver group (rank 1) over gloo on 127.0.0.1."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                           timeout=datetime.timedelta(seconds=TIMEOUT))
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:  # one store connection per rank, as across processes
        groups[rank] = Group.create((store, client)[rank], "t/", rank, 2, "gloo",
                                    torch.device("cpu"), TIMEOUT, "127.0.0.1")

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        yield groups[0], groups[1]
    finally:
        for g in groups:
            if g is not None:
                g.close()


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(300, 7, generator=gen)),          # spans buckets
            ("b", torch.randn(5, generator=gen)),
            ("ints", torch.randint(0, 9, (40,), generator=gen)),  # never converted
            ("c", torch.randn(9, 100, generator=gen).t())]       # non-contiguous


def send_and_receive(pair: tuple[Group, Group], pairs: list[tuple[str, torch.Tensor]],
                     header: Header, out: OutgoingStream, depth: int = 2,
                     before_verify: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    sender, receiver = pair
    errors: list[BaseException] = []

    def send() -> None:
        try:
            out.send(sender, header, pairs)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    size = checksum.buffer_bytes(header.bucket_bytes)
    incoming = IncomingVersion(receiver, header, [torch.empty(size, dtype=torch.uint8)
                                                  for _ in range(depth)], verify=True,
                               before_verify=before_verify)
    got: dict[str, torch.Tensor] = {}
    failure: BaseException | None = None
    try:
        for name, t in incoming:
            got[name] = t.clone()
    except BroadcastError as exc:
        failure = exc
    thread.join(30)
    return got, failure or (errors[0] if errors else None)


def test_outgoing_stream_converts_per_bucket_and_every_bucket_is_verified(
        pair: tuple[Group, Group]) -> None:
    pairs = weights(2)
    specs = [(n, torch.bfloat16 if t.is_floating_point() else t.dtype, tuple(t.shape))
             for n, t in pairs]
    header = Header.build(1, 1, 1, 1024, specs, checksum.ALGORITHM)
    out = OutgoingStream(torch.device("cpu"), 1024)
    got, failure = send_and_receive(pair, pairs, header, out, depth=3)
    assert failure is None
    assert list(got) == [n for n, _ in pairs]
    for name, t in pairs:
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert len(header.buckets()) > 3


def test_a_damaged_bucket_stops_before_its_tensors_are_handed_out(
        pair: tuple[Group, Group]) -> None:
    pairs = [(f"t{i}", torch.full((200,), float(i))) for i in range(8)]  # 800 B each
    header = Header.build(1, 1, 1, 1024, [(n, t.dtype, tuple(t.shape)) for n, t in pairs],
                          checksum.ALGORITHM)
    out = OutgoingStream(torch.device("cpu"), 1024)

    def flip(bucket: int, payload: torch.Tensor) -> None:
        if bucket == 2:
            payload[17] ^= 0x01

    got, failure = send_and_receive(pair, pairs, header, out, before_verify=flip)
    assert isinstance(failure, BroadcastError) and "damaged" in str(failure)
    # Tensors ending in buckets 0 and 1 were handed out, nothing ending in bucket 2 or later.
    ends = [(e.offset + e.nbytes - 1) // 1024 for e in header.entries]
    assert list(got) == [e.name for e, end in zip(header.entries, ends, strict=True) if end < 2]


def test_a_failing_fused_pack_falls_back_to_torch_for_good(
        pair: tuple[Group, Group], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A fused pack-and-seal pass that fails at push time (a kernel specialisation that does
    not compile, its tables out of memory) costs nothing sent: that bucket and every later
    one are packed with torch, and the version arrives exact."""
    from dbsync.nccl import paced

    pairs = [(f"t{i}", torch.full((200,), float(i))) for i in range(8)]  # 800 B each
    header = Header.build(1, 1, 1, 1024, [(n, t.dtype, tuple(t.shape)) for n, t in pairs],
                          checksum.ALGORITHM)
    out = OutgoingStream(torch.device("cpu"), 1024, fused=True)
    runs = []

    def fails(self: Any, buffer: torch.Tensor, programs: int | None = None) -> None:
        runs.append(buffer)
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(paced.PackSeal, "run", fails)
    with caplog.at_level("WARNING", logger="dbsync.nccl.outgoing"):
        got, failure = send_and_receive(pair, pairs, header, out)
    assert failure is None and list(got) == [n for n, _ in pairs]
    assert all(torch.equal(got[n], t) for n, t in pairs)
    assert len(runs) == 1 and out.fused is False
    assert "packing with torch operations from now on" in caplog.text


def test_membership_tracks_joins_and_leaves(tmp_path: Any) -> None:
    with Sender(tmp_path, durable=False) as sender:
        m = Membership(sender.store, address="127.0.0.1", port=0, backend="gloo",
                       device=torch.device("cpu"), bucket_bytes=4096, timeout=TIMEOUT,
                       join_timeout=0.3)
        client = dist.TCPStore("127.0.0.1", m.port, is_master=False,
                               timeout=datetime.timedelta(seconds=TIMEOUT))

        def post(reader: str, action: str) -> None:
            n = int(client.add(rv.K_JOINS, 1))
            client.set(rv.join_key(n), json.dumps({"reader_id": reader, "action": action}))

        post("a", "join")
        post("b", "join")
        post("a", "leave")
        assert m.poll_joins() and m.wanted() == ["b"]
        assert not m.poll_joins()
        # "b" never gets ready: the epoch is formed without it, within the join timeout each
        assert m.refresh() is None
        assert m.members == () and m.group is None and m.wanted() == []
        record = rv.read_record(sender.store)
        assert record is not None and record.epoch == m.epoch and record.members == ()
        m.close()
        assert rv.read_record(sender.store) is None


def test_the_controller_side_imports_no_broadcast_machinery() -> None:
    """The driver (controller, server) never loads the receiving machinery: no group, no
    key-value store client, no bucket stream (those live in worker processes)."""
    pytest.importorskip("vllm")  # dbsync.vllm imports it
    code = ("import sys, dbsync.vllm.transport, dbsync.vllm.broadcast; "
            "print(sorted(m for m in sys.modules if m.startswith('dbsync.nccl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


@contextlib.contextmanager
def sender_and_staging(root: str, bucket_bytes: int) -> Iterator[tuple[Any, Any, Any]]:
    """(Sender, BroadcastSender over gloo, a vLLM worker's StagingReceiver that joined it)."""
    from dbsync.nccl import BroadcastSender
    from dbsync.vllm.staging import StagingReceiver

    with Sender(root, durable=False) as sender, BroadcastSender(
            sender, address="127.0.0.1", device="cpu", timeout=TIMEOUT, join_timeout=10,
            bucket_bytes=bucket_bytes) as bs:
        staging = StagingReceiver(root, reader_id="stage", device="cpu", step_timeout=TIMEOUT)
        try:
            assert bs.wait_for_joins(1, 20)
            yield sender, bs, staging
        finally:
            staging.close()


def staged_version(staging: Any, version: int) -> Any:
    """The staged copy of ``version``, once the sender confirmed publishing it."""
    deadline = time.monotonic() + 20
    while (staged := staging.take(version, wait=5)) is None:
        assert time.monotonic() < deadline, staging.last_error
        time.sleep(0.05)  # the sender's confirmation follows its publish
    return staged


def test_staging_receiver_stages_verified_versions_under_the_confirmed_manifest(
        tmp_path: Any) -> None:
    """The vLLM worker's staging receiver (no engine needed): each broadcast version is staged
    verified, bound to the digest of the manifest the sender confirmed; a manifest with other
    checksums under the same version number is refused."""
    pytest.importorskip("vllm")  # dbsync.vllm imports it
    from dbsync.vllm.staging import Staged

    root = str(tmp_path)
    gen = torch.Generator().manual_seed(9)
    weights = {f"w{i}": torch.randn(64, 9, generator=gen) for i in range(5)}
    # 4 KiB buckets: two tensors span buckets, fewer bytes than the two bucket buffers, so the
    # version is received whole (``whole_holds_less``)
    with sender_and_staging(root, bucket_bytes=4096) as (sender, bs, staging):
        assert bs.push(weights) == 1
        staged = staged_version(staging, 1)
        assert staging.last_error is None
        assert [n for n, _ in staged.pairs] == list(weights)
        assert all(torch.equal(t, weights[n]) for n, t in staged.pairs)
        assert staged.matches(root) is None
        manifest = sender.store.require_manifest()
        assert staged.manifest_digest == rv.manifest_digest(manifest)
        forged = Staged(1, "0" * 64, pairs=staged.pairs)
        assert "not the one" in (forged.matches(root) or "")


def test_staging_receives_whole_versions_only_when_that_holds_less() -> None:
    pytest.importorskip("vllm")  # dbsync.vllm imports it
    from dbsync.vllm.staging import whole_holds_less

    def header(bucket: int, sizes: list[int]) -> Header:
        return Header.build(1, 1, 1, bucket, [(f"t{i}", torch.uint8, (n,))
                                              for i, n in enumerate(sizes)], checksum.ALGORITHM)

    # nothing spans a bucket boundary: whole (no duplicate, no bucket buffers)
    assert whole_holds_less(header(1 << 20, [1 << 19] * 8), depth=3)
    # big tensors across boundaries (each duplicated) outweigh three 1 MiB buffers
    assert not whole_holds_less(header(1 << 20, [3 << 20, 3 << 20]), depth=3)
    # small tensors across small buckets: their copies hold less than three buffers
    assert whole_holds_less(header(4096, [5000, 5000]), depth=3)
    assert not whole_holds_less(header(4096, [5000] * 4), depth=3)


def test_staging_receiver_keeps_only_windows_and_a_new_layout_whole(tmp_path: Any) -> None:
    """With windows set, the staging receiver keeps only those bytes of each version (through
    bucket buffers, verified), reuses the allocation once a version was released, and stages
    a version of another layout whole, so that its apply can record again."""
    pytest.importorskip("vllm")  # dbsync.vllm imports it
    from dbsync.vllm.reads import ByteWindows
    from dbsync.vllm.staging import Stager

    root = str(tmp_path)
    gen = torch.Generator().manual_seed(4)
    weights = {f"w{i}": torch.randn(64, 9, generator=gen) for i in range(5)}
    layout = tuple((n, t.dtype, tuple(t.shape)) for n, t in weights.items())
    ranges = {n: (i * 8, i * 8 + 576) for i, n in enumerate(weights)}  # 576 of 2,304 bytes

    with sender_and_staging(root, bucket_bytes=1024) as (_, bs, staging):
        staging.windows = ByteWindows(layout, ranges)
        flats = []
        for version in (1, 2):
            assert bs.push(weights) == version
            staged = staged_version(staging, version)
            assert staged.pairs is None and staged.nbytes == 5 * 576
            for name, t in weights.items():
                lo, hi = ranges[name]
                assert torch.equal(staged.windowed.dest[name].into,
                                   t.reshape(-1).view(torch.uint8)[lo:hi])
            flats.append(staged.windowed.flat.data_ptr())
            staging.release(version)  # applied: its allocation is reused
        assert flats[0] == flats[1]
        wider = {**weights, "extra": torch.randn(7, generator=gen)}
        assert bs.push(wider) == 3
        staged = staged_version(staging, 3)
        assert staged.nbytes == sum(t.nbytes for t in wider.values())
        assert all(torch.equal(staged.windowed.dest[n].into, t.reshape(-1).view(torch.uint8))
                   for n, t in wider.items())
    # the worker's side: that layout was not recorded, so its apply records
    stager = Stager(root, "auto", device="cpu")
    try:
        stager.record(ByteWindows(layout, ranges))
        assert not stager.needs_recording(layout)
        assert stager.needs_recording(staged.windowed.windows.layout)
    finally:
        stager.close()


def test_fused_pack_and_seal_plan_matches_torch_packing_and_seal() -> None:
    """The sender's ``paced.PackSeal`` tables, run through its torch twin on CPU: raw pieces
    crossing rows, tiny ones sharing a row, a gap left for a piece torch writes first, and a
    payload ending inside a row; the buffer equals what packing with torch and
    ``checksum.seal`` give, byte for byte, padding zeroed."""
    from dbsync.nccl import paced

    gen = torch.Generator().manual_seed(5)
    sizes = [8, 3 * checksum.ROW_BYTES + 16, 64, 8, 4096, 24]
    sources = [torch.randint(-2**62, 2**62, (n // 8,), dtype=torch.int64, generator=gen)
               for n in sizes]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + (64 if n >= 64 else 0)
    payload = at  # (ends inside a checksum row: the rest of that row is padding)
    torch_first = 2  # this piece is left to torch: the pass must keep what it wrote
    want = torch.full((checksum.buffer_bytes(payload),), 7, dtype=torch.uint8)
    want[:payload].zero_()
    for src, o in zip(sources, offsets, strict=True):
        want[o:o + src.numel() * 8] = src.view(torch.uint8)
    checksum.seal(want, payload)

    buf = torch.full_like(want, 7)
    buf[:payload].zero_()  # (what the gaps between pieces hold in a reused buffer)
    o = offsets[torch_first]
    buf[o:o + sizes[torch_first]] = sources[torch_first].view(torch.uint8)
    pieces = [(src.data_ptr(), o, src.numel() * 8)
              for k, (src, o) in enumerate(zip(sources, offsets, strict=True))
              if k != torch_first]
    paced.PackSeal(pieces, payload, torch.device("cpu")).simulate(buf)
    assert torch.equal(buf[:checksum.wire_bytes(payload, True)],
                       want[:checksum.wire_bytes(payload, True)])
    with pytest.raises(ValueError, match="multiple of 8"):
        paced.PackSeal([(sources[0].data_ptr(), 4, 8)], payload, torch.device("cpu"))


def test_fused_verify_copy_plan_writes_only_rows_that_verify() -> None:
    """The tables of ``paced.VerifyCopy`` (which rows feed which destinations), run through
    its torch twin on CPU: pieces crossing rows, several tiny ones in one row, gaps, a piece
    ending in the padding row; every byte lands where it belongs, and a flipped byte keeps
    its whole row (4 KiB) out of every destination it feeds while the other rows land."""
    from dbsync.nccl import paced

    gen = torch.Generator().manual_seed(4)
    sizes = [64, 5000 // 8 * 8, 128, 8, 8, 16, 6096, 3 * checksum.ROW_BYTES + 8, 1000]
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n + (64 if n > 64 else 0)
    payload = at
    wire = torch.randint(0, 256, (checksum.buffer_bytes(payload),), dtype=torch.uint8,
                         generator=gen)
    checksum.seal(wire, payload)
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    pieces = list(zip(dests, offsets, strict=True))
    assert all(paced.VerifyCopy.fits(d, o) for d, o in pieces)
    plan = paced.VerifyCopy(pieces, payload, torch.device("cpu"))
    bad = torch.zeros(1, dtype=torch.int32)
    words, sums = checksum.words_view(wire, payload), checksum.trailer_view(wire, payload)
    plan.simulate(words, sums, bad)
    assert int(bad) == 0
    for d, o in pieces:
        assert torch.equal(d, wire[o:o + d.numel()]), o

    for d in dests:
        d.zero_()
    hit = 2 * checksum.ROW_BYTES + 123
    wire[hit] ^= 0x40
    plan.simulate(words, sums, bad)
    assert int(bad) == 1
    row = range(2 * checksum.ROW_BYTES, 3 * checksum.ROW_BYTES)
    for d, o in pieces:
        for i in range(0, d.numel(), 8):
            word = d[i:i + 8]
            if o + i in row:
                assert int(word.count_nonzero()) == 0, (o, i)
            else:
                assert torch.equal(word, wire[o + i:o + i + 8]), (o, i)


def test_byte_windows_keep_only_their_bytes_and_a_damaged_bucket_is_refused(
        pair: tuple[Group, Group]) -> None:
    from dbsync.nccl.stream import ByteWindow, DamagedBucketError

    gen = torch.Generator().manual_seed(5)
    pairs = [("a", torch.randn(300, 8, generator=gen)),   # 9,600 B: spans many buckets
             ("b", torch.randn(64, generator=gen)),
             ("c", torch.randn(16, 16, generator=gen))]
    header = Header.build(1, 1, 1, 1024, [(n, t.dtype, tuple(t.shape)) for n, t in pairs],
                          checksum.ALGORITHM)
    ranges = {"a": (1000, 7400), "b": (0, 0), "c": (0, 1024)}  # across buckets, none, all

    def receive(before_verify: Any = None) -> tuple[dict[str, Any], BaseException | None]:
        sender, receiver = pair
        thread = threading.Thread(target=OutgoingStream(torch.device("cpu"), 1024).send,
                                  args=(sender, header, pairs))
        thread.start()
        size = checksum.buffer_bytes(header.bucket_bytes)
        incoming = IncomingVersion(receiver, header, [torch.empty(size, dtype=torch.uint8)
                                                      for _ in range(2)], verify=True,
                                   before_verify=before_verify)
        dest = {n: ByteWindow(lo, hi, torch.full((hi - lo,), 0xAB, dtype=torch.uint8))
                for n, (lo, hi) in ranges.items()}
        failure = None
        try:
            incoming.copy_into(dest)
        except BroadcastError as exc:
            failure = exc
        thread.join(30)
        return dest, failure

    dest, failure = receive()
    assert failure is None
    for name, t in pairs:
        lo, hi = ranges[name]
        assert torch.equal(dest[name].into, t.reshape(-1).view(torch.uint8)[lo:hi]), name

    def flip(bucket: int, payload: torch.Tensor) -> None:
        if bucket == 3:  # inside a's window
            payload[40] ^= 0x01

    _, failure = receive(before_verify=flip)
    assert isinstance(failure, DamagedBucketError)
    with pytest.raises(ValueError, match="outside its"):
        IncomingVersion(pair[1], header, [torch.empty(2048, dtype=torch.uint8)] * 2,
                        verify=True).copy_into(
            {"a": ByteWindow(0, 10**6, torch.empty(10**6, dtype=torch.uint8)),
             "b": ByteWindow(0, 0, torch.empty(0, dtype=torch.uint8)),
             "c": ByteWindow(0, 0, torch.empty(0, dtype=torch.uint8))})


def test_read_windows_record_what_loaders_read_and_the_guard_stops_other_reads(
        tmp_path: Any) -> None:
    from dbsync import Receiver
    from dbsync.vllm.reads import OutsideWindowError, ReadGuard, ReadRecorder
    from dbsync.vllm.staging import WindowedCopy

    weights = {"column": torch.arange(32, dtype=torch.float32).view(4, 8),
               "row": torch.arange(32, 48, dtype=torch.float32).view(2, 8),
               "unused": torch.arange(48, 51, dtype=torch.float32)}
    with Sender(tmp_path, durable=False) as sender:
        sender.push(weights)
    p_column, p_row = torch.zeros(2, 8), torch.zeros(2, 4)

    def loader(pairs: Any) -> None:
        for name, t in pairs:
            if name == "column":
                p_column.copy_(t.narrow(0, 2, 2))
            elif name == "row":
                p_row.copy_(t.narrow(1, 4, 4))

    # Recorded on an apply from the filesystem: views of the mapped shard file.
    recorder = ReadRecorder()
    with Receiver(tmp_path) as rx, rx.open() as snap, recorder:
        loader(recorder.tracked(snap.tensors()))
    windows = recorder.windows()
    # byte hulls: rows 2-3 exactly; the row-parallel hull spans from row 0's 5th element to
    # the end; nothing of the unused tensor
    assert windows.ranges == {"column": (64, 128), "row": (16, 64), "unused": (0, 0)}
    assert windows.kept_bytes == 112 and windows.full_bytes == 204

    # Staged as windows (bytes a receiver would copy in), applied under the guard: the
    # loader gets exactly what it got from the whole checkpoint.
    staged = WindowedCopy(windows, "cpu")
    for name, t in weights.items():
        lo, hi = windows.ranges[name]
        staged.dest[name].into.copy_(t.reshape(-1).view(torch.uint8)[lo:hi])
    want = p_column.clone(), p_row.clone()
    p_column.zero_()
    p_row.zero_()
    guard = ReadGuard(windows)
    with guard:
        loader(staged.tensors(guard))
    assert torch.equal(p_column, want[0]) and torch.equal(p_row, want[1])
    assert torch.equal(p_column, weights["column"][2:])
    assert torch.equal(p_row, weights["row"][:, 4:])

    # A loader that reads more than was recorded is stopped before the copy runs, also when
    # the read is a composite op that inference mode hands to the mode whole.
    for inference in (False, True):
        p_column.zero_()
        guard = ReadGuard(windows)
        with pytest.raises(OutsideWindowError, match="'column'"), guard, \
                torch.inference_mode(inference):
            for name, t in staged.tensors(guard):
                if name == "column":
                    p_column.copy_(t.narrow(0, 1, 2).to(torch.float64))
        assert not p_column.any()

    # Two tracked tensors sharing bytes (one inside the other): a read of the outer one
    # beyond the inner one is still seen.
    recorder = ReadRecorder()
    outer = torch.arange(100, dtype=torch.uint8)
    recorder.track("outer", outer)
    recorder.track("inner", outer[10:20])
    with recorder:
        outer[30:40].clone()
    assert recorder.read == {"outer": [30, 40]}


_KERNELS_ON_CPU = r"""
import json
import torch
from dbsync.nccl.paced import ROW_WORDS, VerifyCopy, _kernels, _pack_case

_, _, verify_copy, pack_seal = _kernels()
srcs, pack, buf, want = _pack_case(torch.device("cpu"))
payload = pack.payload_bytes
w, sums = pack._views(buf)
pack_seal[(2,)](w, sums, pack.rows, 2, pack.seg_first, pack.seg_count, pack.seg_start,
                pack.seg_end, pack.seg_src, ROW=ROW_WORDS, STEP=4)
out = {"packed": torch.equal(buf, want)}

first = torch.zeros(700, dtype=torch.int64)
last = torch.zeros(2 * ROW_WORDS - 5, dtype=torch.int64)
plan = VerifyCopy([(first.view(torch.uint8), 0), (last.view(torch.uint8), 8 * 1024)],
                  payload, torch.device("cpu"))
w[5] += 1  # row 0 damaged: none of its words may land
bad = torch.zeros(1, dtype=torch.int32)
verify_copy[(2,)](w, sums, plan.rows, plan.seg_first, plan.seg_count, plan.seg_start,
                  plan.seg_end, plan.seg_dst, bad, PROGRAMS=2, ROW=ROW_WORDS, STEP=8)
out.update(bad=int(bad), row0_untouched=bool((first[:ROW_WORDS] == 0).all()),
           row1_copied=torch.equal(first[ROW_WORDS:], srcs[0][ROW_WORDS:]),
           last_copied=torch.equal(last, srcs[2][:last.numel()]))
print(json.dumps(out))
"""


def test_the_triton_kernels_pack_verify_and_copy_byte_exact_in_triton_s_interpreter() -> None:
    """The device kernels themselves (not their torch twins), run by Triton's interpreter on
    CPU: the fused pack-and-seal pass writes exactly torch's packing and row sums, and the
    verify-and-copy pass counts a damaged row, writes none of its words, and lands the others
    in place."""
    pytest.importorskip("triton")
    import os

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _KERNELS_ON_CPU], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"packed": True, "bad": 1, "row0_untouched": True, "row1_copied": True,
                   "last_copied": True}


def test_a_workers_transport_watch_says_a_missing_store_once(tmp_path, monkeypatch, caplog):
    """A vLLM worker watching for a broadcast (``--transport auto``) while the store is
    missing (unmounted, moved away) says so once, at INFO, not an ERROR with a traceback
    every second (before: 5 in 5 s); once the store is back (here: one without a broadcast)
    it is quiet."""
    import logging
    import os

    from dbsync.vllm import staging

    root = str(tmp_path / "store")
    looks: list[bool] = []
    seen = {6: threading.Event(), 12: threading.Event()}
    real = staging.choose_transport

    def counted(*args: Any, **kwargs: Any) -> str:
        looks.append(os.path.isdir(root))
        if len(looks) in seen:
            seen[len(looks)].set()
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "_CHECK_SECONDS", 0.005)
    monkeypatch.setattr(staging, "choose_transport", counted)
    with caplog.at_level(logging.INFO, logger="dbsync"):
        stager = staging.Stager(root, "auto", device="cpu")
        try:
            assert seen[6].wait(30)  # six looks at a missing store
            with Sender(root) as sender:
                sender.push({"w": torch.ones(2)})
            assert seen[12].wait(30)
        finally:
            stager.close()
    said = [r for r in caplog.records if "cannot look for a broadcast" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO and said[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert looks[:6] == [False] * 6 and looks[-1] is True
