"""Paced device work: bucket checksums and copies that run on a bounded number of SMs, so a
receiver's own work shares its GPU with the broadcast streaming at the same time.

Why: a broadcast is a chain through every member's GPU. A copy or a reduction launched with
torch's defaults takes every SM and as much memory bandwidth as the GPU has for a fraction of
a millisecond; the NCCL kernel running beside it slows in that moment, and with it the whole
chain (with three receivers that each copy out, 0.79x of a raw broadcast on 4x H100). The same
work spread over the bucket's transfer time on a few SMs costs the stream little. See
docs/BROADCAST.md for the measurements that chose the defaults.

The sender's fused pack-and-seal pass (``PackSeal``) lives here too; it is not paced (it runs
beside the NCCL kernel on its high-priority stream, and the first bucket's pass has the GPU to
itself), only fused: one read of each source byte, one write of each bucket byte.

Triton kernels on CUDA (Triton ships with PyTorch's CUDA builds); on CPU, or where Triton is
missing, the same results come from plain torch operations (``available`` and
``pack_available`` say which).

Hazards, stated plainly:
- ``CopyTable`` and ``VerifyCopy`` write through raw device addresses taken from the tensors
  when the plan was built: reuse a plan only for the same, unmoved tensors; every
  destination must stay allocated until the work finished on the current stream (the caller
  synchronizes or keeps references), and sources and destinations must not overlap.
- The kernels are compiled on first use in a process (a second or two per kernel and CTA
  count), and checked once per device (``available``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import first_line

log = logging.getLogger("dbsync.nccl.paced")

#: int64 words per checksum row (checksum.ROW_BYTES / 8)
ROW_WORDS = 512
#: CTAs of the paced kernels, as a fraction of the device's SMs (0 = that default): verifying
#: (alone or fused with the copy) on 3/4 of them, plain copies on 3/8 (measured on 4x H100 with
#: three receivers, docs/BROADCAST.md: fewer CTAs fall behind the stream, more slow it)
DEFAULT_PROGRAMS = 0
VERIFY_SHARE = 0.75
COPY_SHARE = 0.375
_ROWS_PER_STEP = 8  # checksum rows per CTA per step (32 KiB in flight)
_WARPS = 4
_COPY_BLOCK = 4096  # int64 words per CTA per step (32 KiB in flight)
#: CTAs of the sender's fused pack-and-seal pass, per SM, and its shape (fastest of 18 shapes
#: on an H100, bench/probe_pack.py); it runs beside the NCCL kernel of the bucket before,
#: whose high-priority stream gets the SMs first
PACK_SHARE = 2.0
_PACK_ROWS_PER_STEP = 4
_PACK_WARPS = 8
#: replay each bucket's pack-and-seal launch from a CUDA graph (see ``PackSeal``)
USE_GRAPHS = True


@functools.cache
def _kernels() -> Any:
    """The compiled Triton kernels, or None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton: torch operations instead
        return None

    @triton.jit
    def row_sums_kernel(src, out, rows, PROGRAMS: tl.constexpr, ROW: tl.constexpr,
                        STEP: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, ROW)
        step_rows = tl.arange(0, STEP)
        for first in range(pid * STEP, rows, PROGRAMS * STEP):
            r = first + step_rows
            inside = r < rows
            words = tl.load(src + r[:, None] * ROW + cols[None, :], mask=inside[:, None],
                            other=0)
            tl.store(out + r, tl.sum(words, axis=1), mask=inside)

    @triton.jit
    def copy_many_kernel(table, items, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for i in range(0, items):
            dst = tl.load(table + 3 * i).to(tl.pointer_type(tl.int64))
            src = tl.load(table + 3 * i + 1).to(tl.pointer_type(tl.int64))
            words = tl.load(table + 3 * i + 2)
            for first in range(pid * BLOCK, words, PROGRAMS * BLOCK):
                at = first + offs
                inside = at < words
                tl.store(dst + at, tl.load(src + at, mask=inside), mask=inside)

    # a module global: Triton looks up the functions a kernel calls in its module
    global piece_words

    @triton.jit
    def piece_words(seg_start, seg_end, seg_address, seg, valid, at):
        # for rows whose piece ``seg`` is ``valid``: the addresses, in those pieces' own
        # memory, of the bucket words ``at``, and which of the words the pieces hold (the
        # tables of ``_segment_tables``)
        start = tl.load(seg_start + seg, mask=valid, other=0)
        end = tl.load(seg_end + seg, mask=valid, other=0)
        base = tl.load(seg_address + seg, mask=valid, other=0).to(tl.pointer_type(tl.int64))
        into = valid[:, None] & (at >= start[:, None]) & (at < end[:, None])
        return base[:, None] + (at - start[:, None]), into

    @triton.jit
    def verify_copy_kernel(src, sums, rows, seg_first, seg_count, seg_start, seg_end, seg_dst,
                           bad, PROGRAMS: tl.constexpr, ROW: tl.constexpr,
                           STEP: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, ROW)
        step_rows = tl.arange(0, STEP)
        damaged = tl.zeros([STEP], dtype=tl.int32)
        for first in range(pid * STEP, rows, PROGRAMS * STEP):
            r = first + step_rows
            inside = r < rows
            at = r[:, None] * ROW + cols[None, :]  # word index in the bucket
            words = tl.load(src + at, mask=inside[:, None], other=0)
            ok = (tl.sum(words, axis=1) == tl.load(sums + r, mask=inside, other=0)) & inside
            damaged += (inside & (ok == 0)).to(tl.int32)
            seg0 = tl.load(seg_first + r, mask=inside, other=0)
            count = tl.load(seg_count + r, mask=ok, other=0)
            for k in range(0, tl.max(count, axis=0)):
                dst, into = piece_words(seg_start, seg_end, seg_dst, seg0 + k,
                                        ok & (k < count), at)
                tl.store(dst, words, mask=into)
        total = tl.sum(damaged, axis=0)
        if total > 0:
            tl.atomic_add(bad, total)

    @triton.jit
    def pack_seal_kernel(dst, sums, rows, programs, seg_first, seg_count, seg_start, seg_end,
                         seg_src, ROW: tl.constexpr, STEP: tl.constexpr):
        # ``programs`` is a runtime argument, not a constexpr: a CTA count needs no compile
        # of its own (beyond Triton's usual specializations of integer arguments)
        pid = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, ROW)
        step_rows = tl.arange(0, STEP)
        for first in range(pid * STEP, rows, programs * STEP):
            r = first + step_rows
            inside = r < rows
            at = r[:, None] * ROW + cols[None, :]  # word index in the bucket
            seg0 = tl.load(seg_first + r, mask=inside, other=0)
            count = tl.load(seg_count + r, mask=inside, other=0)
            words = tl.zeros([STEP, ROW], dtype=tl.int64)
            covered = tl.zeros([STEP, ROW], dtype=tl.int32)
            for k in range(0, tl.max(count, axis=0)):
                src, into = piece_words(seg_start, seg_end, seg_src, seg0 + k,
                                        inside & (k < count), at)
                words += tl.load(src, mask=into, other=0)
                covered += into.to(tl.int32)
            # words no piece covers keep what the buffer holds (written before, or padding)
            words += tl.load(dst + at, mask=inside[:, None] & (covered == 0), other=0)
            tl.store(dst + at, words, mask=inside[:, None])
            tl.store(sums + r, tl.sum(words, axis=1), mask=inside)

    return row_sums_kernel, copy_many_kernel, verify_copy_kernel, pack_seal_kernel


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def programs_for(device: torch.device, share: float) -> int:
    """CTAs for a paced kernel on ``device``: ``DEFAULT_PROGRAMS`` if set, else ``share`` of
    its SMs (at least 8). ``share`` above 1 runs at full speed (no stream left to share)."""
    if DEFAULT_PROGRAMS:
        return DEFAULT_PROGRAMS
    return max(8, int(_sm_count(cuda_index(device)) * share))


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` ("cuda" alone: the device current now)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def available(device: torch.device) -> bool:
    """Whether paced kernels run on ``device``: a CUDA device, Triton importable, and the
    kernels compiled and ran there once on a tiny input (checked once per device; a failure
    is logged and torch operations are used instead)."""
    return device.type == "cuda" and _kernels() is not None and _works_on(cuda_index(device))


def pack_available(device: torch.device) -> bool:
    """Whether the sender's fused pack-and-seal pass (``PackSeal``) runs on ``device``: a
    CUDA device, Triton importable, and the kernel compiled and matched torch's packing and
    row sums once there (checked once per device; a failure is logged and the sender packs
    and seals with torch operations instead)."""
    return device.type == "cuda" and _kernels() is not None and _packs_on(cuda_index(device))


def _passes(index: int, check: Callable[[torch.device], None], what: str, instead: str
            ) -> bool:
    """Run ``check`` (it raises if a kernel's result differs from torch's) on cuda:``index``;
    any failure is logged once, saying ``what`` and what is done ``instead``: a broken
    toolchain must never break a broadcast."""
    device = torch.device("cuda", index)
    try:
        with torch.cuda.device(device):
            check(device)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("%s on cuda:%d (%s: %s); %s", what, index, type(exc).__name__,
                    first_line(exc), instead)
        return False
    return True


@functools.cache
def _works_on(index: int) -> bool:
    return _passes(index, _check_paced, "paced Triton kernels do not run",
                   "using torch operations instead (correct, slower broadcasts)")


@functools.cache
def _packs_on(index: int) -> bool:
    return _passes(index, _check_pack, "the fused pack-and-seal Triton kernel does not run",
                   "packing with torch operations instead")


def _check_paced(device: torch.device) -> None:
    words = torch.arange(2 * ROW_WORDS, dtype=torch.int64, device=device).view(2, -1)
    sums = words.sum(dim=1)
    if not torch.equal(row_sums(words, 2, probing=True), sums):
        raise RuntimeError("row sums differ from torch's")
    out = torch.zeros(2 * ROW_WORDS * 8, dtype=torch.uint8, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    plan = VerifyCopy([(out, 0)], out.numel(), device)
    plan.run(words, sums, bad, 2)
    copy = torch.zeros_like(words)
    CopyTable([(copy, words)], probing=True).run(2)
    if not (torch.equal(out.view(torch.int64).view(2, -1), words) and int(bad) == 0
            and torch.equal(copy, words)):
        raise RuntimeError("the kernels' results differ from torch's")


def _pack_case(device: torch.device) -> tuple[list[torch.Tensor], PackSeal, torch.Tensor,
                                              torch.Tensor]:
    """A packing test case: (sources, their ``PackSeal``, a bucket buffer filled with 7s, the
    sealed bytes torch makes of them). A gap after the first piece, a piece across rows, the
    last piece cut short."""
    gen = torch.Generator(device=device).manual_seed(0)
    srcs = [torch.randint(-2**62, 2**62, (n,), dtype=torch.int64, device=device,
                          generator=gen) for n in (700, 3, 2 * ROW_WORDS)]
    at = [0, 704, 1024]
    payload = 8 * (at[-1] + srcs[-1].numel()) - 40
    rows = -(-payload // (ROW_WORDS * 8))
    body = rows * ROW_WORDS * 8
    buf = torch.full((body + 8 * rows,), 7, dtype=torch.uint8, device=device)
    want = buf.clone()
    words = want[:body].view(torch.int64)
    want[payload:body].zero_()
    for src, a in zip(srcs, at, strict=True):
        n = min(src.numel(), payload // 8 - a)
        words[a:a + n] = src[:n]
    want[body:].view(torch.int64)[:] = words.view(rows, ROW_WORDS).sum(dim=1)
    pieces = [(src.data_ptr(), 8 * a, min(8 * src.numel(), payload - 8 * a))
              for src, a in zip(srcs, at, strict=True)]
    return srcs, PackSeal(pieces, payload, device), buf, want


def _check_pack(device: torch.device) -> None:
    _, pack, buf, want = _pack_case(device)
    for attempt in ("launched", "replayed from its graph", "replayed again"):
        buf.fill_(7)
        pack.run(buf, 2)
        if not torch.equal(buf, want):
            raise RuntimeError(f"the fused packing ({attempt}) differs from torch's")


def row_sums(words: torch.Tensor, programs: int | None = None,
             probing: bool = False) -> torch.Tensor:
    """``words.sum(dim=1)`` of a contiguous ``int64[rows, ROW_WORDS]`` tensor (sums modulo
    2**64), on ``programs`` CTAs (default: ``VERIFY_SHARE`` of the SMs) where paced kernels
    run. ``probing``: launch the kernel without asking ``available`` (its own check)."""
    if words.dtype != torch.int64 or words.dim() != 2 or words.shape[1] != ROW_WORDS or (
            not words.is_contiguous()):
        raise ValueError(f"row_sums needs a contiguous int64 tensor of {ROW_WORDS} columns")
    if words.shape[0] == 0 or not (probing or available(words.device)):
        return words.sum(dim=1)
    programs = programs or programs_for(words.device, VERIFY_SHARE)
    row_sums_kernel = _kernels()[0]
    out = torch.empty(words.shape[0], dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):  # Triton launches on the current device's stream
        row_sums_kernel[(programs,)](words, out, words.shape[0], PROGRAMS=programs,
                                     ROW=ROW_WORDS, STEP=_ROWS_PER_STEP, num_warps=_WARPS)
    return out


def _word_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous()
            and src.is_contiguous() and dst.device == src.device
            and dst.data_ptr() % 8 == 0 and src.data_ptr() % 8 == 0
            and (dst.numel() * dst.element_size()) % 8 == 0)


class CopyTable:
    """A reusable plan for copying many (destination, source) pairs of same-dtype, same-shape
    tensors: the pairs that can be copied as int64 words on a CUDA device go into a device
    table copied in one paced launch; the rest are left to ``Tensor.copy_``
    (``fallback``). Build it once and reuse it while no tensor moves or is replaced."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 probing: bool = False):
        self.device = pairs[0][0].device if pairs else torch.device("cpu")
        paced = probing or available(self.device)
        rows: list[int] = []
        self.fallback: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if dst.numel() == 0:
                continue
            if paced and _word_copyable(dst, src):
                rows += [dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size() // 8]
            else:
                self.fallback.append((dst, src))
        self.items = len(rows) // 3
        self.table = (torch.tensor(rows, dtype=torch.int64).to(self.device)
                      if self.items else None)

    def run(self, programs: int | None = None) -> None:
        """Enqueue every copy on the current stream (no host sync): the word copies in one
        paced launch on ``programs`` CTAs (default: ``COPY_SHARE`` of the SMs), then the
        fallback ones."""
        if self.items:
            programs = programs or programs_for(self.device, COPY_SHARE)
            copy_many_kernel = _kernels()[1]
            with torch.cuda.device(self.device):  # Triton uses the current device's stream
                copy_many_kernel[(programs,)](self.table, self.items, PROGRAMS=programs,
                                              BLOCK=_COPY_BLOCK, num_warps=8)
        for dst, src in self.fallback:
            dst.copy_(src, non_blocking=True)


class VerifyCopy:
    """Verify a sealed bucket and copy it out in one paced pass that reads each byte once:
    each CTA sums a few checksum rows, compares them with the sender's row sums, and writes
    only the rows that match to their destinations (a row may feed several tensors). Rows
    that do not match are counted into a device flag; nothing of them is written.

    ``pieces``: (destination, offset in the bucket) pairs; each destination a contiguous
    uint8 view whose address, offset and length are multiples of 8 (``fits`` tells), the
    pieces in the bucket not overlapping. Built once per bucket layout and destination set
    (the caller rebuilds it when either changes)."""

    def __init__(self, pieces: Sequence[tuple[torch.Tensor, int]], payload_bytes: int,
                 device: torch.device):
        self.rows = -(-payload_bytes // (ROW_WORDS * 8))
        (self.seg_first, self.seg_count, self.seg_start, self.seg_end,
         self.seg_dst) = _segment_tables(
            [(d.data_ptr(), at, d.numel()) for d, at in pieces], self.rows, device)

    @staticmethod
    def fits(dst: torch.Tensor, offset: int) -> bool:
        return (dst.is_contiguous() and dst.data_ptr() % 8 == 0 and offset % 8 == 0
                and dst.numel() % 8 == 0)

    def run(self, words: torch.Tensor, sums: torch.Tensor, bad: torch.Tensor,
            programs: int | None = None) -> None:
        """Enqueue on the current stream: verify ``words`` (``int64[rows, ROW_WORDS]``, the
        bucket's padded payload) against ``sums`` (``int64[rows]``) and copy out the rows that
        match; ``bad`` (``int32[1]``) is increased by the number of rows that do not."""
        if words.shape[0] != self.rows or sums.numel() != self.rows:
            raise ValueError("VerifyCopy.run: the bucket does not have the planned rows")
        programs = programs or programs_for(words.device, VERIFY_SHARE)
        verify_copy_kernel = _kernels()[2]
        with torch.cuda.device(words.device):  # Triton uses the current device's stream
            verify_copy_kernel[(programs,)](
                words, sums, self.rows, self.seg_first, self.seg_count, self.seg_start,
                self.seg_end, self.seg_dst, bad, PROGRAMS=programs, ROW=ROW_WORDS,
                STEP=_ROWS_PER_STEP, num_warps=_WARPS)


    def simulate(self, words: torch.Tensor, sums: torch.Tensor, bad: torch.Tensor) -> None:
        """What ``run`` does, in plain torch operations on any device (slow: for tests of the
        plan's tables on machines without a GPU)."""
        got = words.sum(dim=1)
        ok = got == sums
        bad += int((~ok).sum())
        flat = words.reshape(-1)
        first, count = self.seg_first.tolist(), self.seg_count.tolist()
        starts, ends, dsts = (self.seg_start.tolist(), self.seg_end.tolist(),
                              self.seg_dst.tolist())
        for row in range(self.rows):
            if not bool(ok[row]):
                continue
            lo, hi = row * ROW_WORDS, (row + 1) * ROW_WORDS
            for seg in range(first[row], first[row] + count[row]):
                a, b = max(lo, starts[seg]), min(hi, ends[seg])
                if a >= b:
                    continue
                dst = _from_address(dsts[seg] + 8 * (a - starts[seg]), b - a, words.device)
                dst.copy_(flat[a:b])


class PackSeal:
    """The sender's side of a sealed bucket in one pass: gather the bucket's pieces from the
    caller's tensors into the bucket buffer and write each checksum row's sum after the
    padded payload (``checksum.seal``'s result, bit for bit), reading each source byte and
    writing each bucket byte once, in one launch.

    ``pieces``: (source address, offset in the bucket, bytes) of raw, same-dtype, contiguous
    sources on the bucket's device, every number a multiple of 8, the pieces not
    overlapping. Words of the padded payload no piece covers keep what the buffer holds:
    the caller writes every other piece (a cast, an odd-sized tensor) into the buffer first,
    on the same stream; ``run`` zeroes the padding after the payload.

    Hazards: the kernel reads the sources through raw addresses taken when the plan was
    built: reuse a plan only while every source is the same, unmoved, contiguous tensor of
    the same dtype, and keep them alive until the pass finished on the current stream. Built
    once per bucket layout, buffer and set of sources (the caller rebuilds it when any
    changes).

    On CUDA the launch (the padding's zeroing and the kernel) is captured into a CUDA graph
    per buffer on its second use (the first launches directly) and replayed from then on: a
    Triton launch costs 40-75 us of host time in a warm loop and 245 us on a host that idled
    between pushes, a replay 80 us there (measured on an H100 host). A capture that fails is
    logged and the kernel launched directly from then on."""

    def __init__(self, pieces: Sequence[tuple[int, int, int]], payload_bytes: int,
                 device: torch.device):
        if any(x % 8 for piece in pieces for x in piece):
            raise ValueError("PackSeal: every address, offset and size must be a multiple of 8")
        self.payload_bytes = payload_bytes
        self.rows = -(-payload_bytes // (ROW_WORDS * 8))
        self.device = device
        (self.seg_first, self.seg_count, self.seg_start, self.seg_end,
         self.seg_src) = _segment_tables(
            pieces, self.rows, device)
        #: False: launch directly (graphs off, or a capture failed)
        self._use_graph = USE_GRAPHS
        #: the captured launch and its key (buffer address, buffer bytes, programs)
        self._graph: tuple[tuple[int, int, int], Any] | None = None
        self._warm: tuple[int, int, int] | None = None  # launched directly once for this key

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        body = self.rows * ROW_WORDS * 8
        if buffer.dtype != torch.uint8 or buffer.numel() < body + 8 * self.rows:
            raise ValueError("PackSeal: the buffer is not a uint8 tensor of the sealed bucket")
        if body > self.payload_bytes:
            buffer[self.payload_bytes:body].zero_()
        return buffer[:body].view(torch.int64), buffer[body:body + 8 * self.rows].view(
            torch.int64)

    def run(self, buffer: torch.Tensor, programs: int | None = None) -> None:
        """Enqueue on the current stream: pack the pieces into ``buffer`` (the bucket buffer,
        uint8, large enough for the sealed bucket) and write the row sums after the padded
        payload, on ``programs`` CTAs (default: ``PACK_SHARE`` per SM). No host sync."""
        programs = programs or programs_for(buffer.device, PACK_SHARE)
        if not self._use_graph:
            self._launch(buffer, programs)
            return
        key = (buffer.data_ptr(), buffer.numel(), programs)
        if self._graph is None or self._graph[0] != key:
            if self._warm != key:
                # launched directly once first: Triton compiles and loads a kernel variant on
                # its first launch, which a capturing stream does not allow
                self._warm = key
                self._launch(buffer, programs)
                return
            self._graph = self._capture(buffer, programs, key)
            if self._graph is None:
                self._use_graph = False
                self._launch(buffer, programs)
                return
        with torch.cuda.device(buffer.device):  # replays on the current stream
            self._graph[1].replay()

    def _launch(self, buffer: torch.Tensor, programs: int) -> None:
        words, sums = self._views(buffer)
        pack_seal_kernel = _kernels()[3]
        with torch.cuda.device(buffer.device):  # Triton uses the current device's stream
            pack_seal_kernel[(programs,)](
                words, sums, self.rows, programs, self.seg_first, self.seg_count,
                self.seg_start, self.seg_end, self.seg_src, ROW=ROW_WORDS,
                STEP=_PACK_ROWS_PER_STEP, num_warps=_PACK_WARPS)

    def _capture(self, buffer: torch.Tensor, programs: int, key: tuple[int, int, int]
                 ) -> tuple[tuple[int, int, int], Any] | None:
        """Capture ``_launch(buffer, programs)`` into a CUDA graph on a side stream (nothing
        runs; no host sync). Returns (key, graph), or None after a failure (logged)."""
        device = buffer.device
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        try:
            with torch.cuda.device(device), torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._launch(buffer, programs)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - launch directly instead
            log.info("capturing the pack-and-seal launch on %s failed (%s: %s); launching it "
                     "directly", device, type(exc).__name__, first_line(exc))
            return None
        return key, graph

    def simulate(self, buffer: torch.Tensor) -> None:
        """What ``run`` does, in plain torch operations on CPU tensors (for tests of the
        plan's tables on machines without a GPU)."""
        words, sums = self._views(buffer)
        first, count = self.seg_first.tolist(), self.seg_count.tolist()
        starts, ends, srcs = (self.seg_start.tolist(), self.seg_end.tolist(),
                              self.seg_src.tolist())
        done: set[int] = set()
        for row in range(self.rows):
            for seg in range(first[row], first[row] + count[row]):
                if seg not in done:
                    done.add(seg)
                    words[starts[seg]:ends[seg]] = _from_address(
                        srcs[seg], ends[seg] - starts[seg], buffer.device)
        sums.copy_(words.view(self.rows, ROW_WORDS).sum(dim=1))


def _segment_tables(pieces: Sequence[tuple[int, int, int]], rows: int, device: torch.device
                    ) -> tuple[torch.Tensor, ...]:
    """Device tables of ``pieces`` (address, byte offset in the bucket, bytes; not
    overlapping) for the row-wise kernels: per checksum row the first piece reaching into it
    and how many do (int32), then per piece, sorted by offset, its first and end word in the
    bucket and its address (int64)."""
    import numpy as np

    order = sorted(range(len(pieces)), key=lambda j: pieces[j][1])
    starts = np.array([pieces[j][1] // 8 for j in order], dtype=np.int64)
    ends = starts + np.array([pieces[j][2] // 8 for j in order], dtype=np.int64)
    addresses = np.array([pieces[j][0] for j in order], dtype=np.int64)
    row_start = np.arange(rows, dtype=np.int64) * ROW_WORDS
    first = np.searchsorted(ends, row_start, side="right")
    last = np.searchsorted(starts, row_start + ROW_WORDS, side="left")
    count = np.maximum(last - first, 0)

    def upload(a: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype).to(device)

    one = np.zeros(1, np.int64)
    return (upload(np.minimum(first, max(len(starts) - 1, 0)), torch.int32),
            upload(count, torch.int32),
            upload(starts if len(starts) else one, torch.int64),
            upload(ends if len(ends) else one, torch.int64),
            upload(addresses if len(addresses) else one, torch.int64))


def _from_address(address: int, words: int, device: torch.device) -> torch.Tensor:
    """An int64 tensor over ``words`` words of memory at ``address`` (CPU only; for
    ``VerifyCopy.simulate``)."""
    import ctypes

    if device.type != "cpu":
        raise ValueError("simulate runs on CPU tensors only")
    buffer = (ctypes.c_int64 * words).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.int64, count=words)
