"""Sending one version's bucket stream: pack the tensors into bucket buffers (converting dtype
per bucket, on the way out), seal each bucket with its checksum, broadcast it.

``depth`` buffers rotate; bucket k+depth is packed into bucket k's buffer once the host saw
bucket k's broadcast finish (each wait bounded by the group's timeout). Packing runs on the
caller's current stream, so work already queued there (the optimizer step) is seen; no CUDA
stream ever waits on a broadcast.

On CUDA a sealed bucket is packed and sealed in one pass and one launch (``paced.PackSeal``:
each source byte read once, each bucket byte written once, the row sums written as the rows
go), with a plan built once per bucket and reused while the caller's tensors stay the same;
pieces it cannot take are copied in with torch first. Measured on an H100 (256 MiB,
``bench/probe_pack.py``): 0.28-0.31 ms against 0.40-0.41 ms for torch's copies and seal, and
40-75 us of host time to enqueue against 220-250 us.

Measured (2x H100, 8 GiB, docs/BROADCAST.md): letting the device order buffer reuse instead
(every bucket enqueued at once, a private stream waiting on each broadcast) was 7% slower: each
pack then starts at the very moment the next broadcast kernel starts, and slows it down.

Hazards, stated plainly:
- The caller's tensors are read until ``send`` returns; do not modify them before.
- A tensor that spans buckets and needs a dtype conversion is converted alone into a temporary
  (the size of that one tensor); no other converted copy is made.
- After a failure the group is closed (its communicator aborted, which also ends the device
  waits of the private stream); a new epoch must form.
- The fused pass reads the caller's tensors through raw addresses kept in its plan; a plan is
  used only while each source has the address, contiguity, dtype, type and lazy bits it was
  built for (checked per bucket and push), and the tensors are alive while ``send`` runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .. import sources
from ..errors import first_line
from . import checksum, paced
from .group import Group
from .layout import Header, bucket_plan, flat_bytes

log = logging.getLogger(__name__)

Pairs = Sequence[tuple[str, torch.Tensor]]
#: split tensor pieces: (entry index, start, end, offset in the bucket)
Piece = tuple[int, int, int, int]


class BucketPlan:
    """Per bucket: the tensors lying wholly inside it with their typed views of the bucket
    buffer they are packed into, and the byte ranges of tensors split across buckets. Built
    once per layout and buffer set (the same model pushes the same layout every time)."""

    def __init__(self, header: Header, buffers: list[torch.Tensor]):
        self.buckets = header.buckets()
        self.whole: list[tuple[list[int], list[torch.Tensor]]] = []
        self.split: list[list[Piece]] = []
        for b, pieces in enumerate(bucket_plan(header)):
            lo = self.buckets[b][0]
            buf = buffers[b % len(buffers)]
            indices, views, split = [], [], []
            for i, start, end in pieces:
                entry = header.entries[i]
                at = entry.offset + start - lo
                if start == 0 and end == entry.nbytes:
                    indices.append(i)
                    views.append(buf[at:at + end].view(entry.torch_dtype).view(entry.shape))
                else:
                    split.append((i, start, end, at))
            self.whole.append((indices, views))
            self.split.append(split)


#: what a bucket's fused packing was planned for, per source in plan order: address,
#: contiguity, dtype, type, and whether a lazy negation or conjugation bit is set
SourceState = tuple[int, bool, torch.dtype, type, bool]
#: a bucket's fused packing: the plan, the sources' states it was built for, and the pieces
#: left to torch (whole tensors with their views, split pieces)
FusedBucket = tuple[paced.PackSeal, list[SourceState], tuple[list[int], list[torch.Tensor]],
                    list[Piece]]


def _state(t: torch.Tensor) -> SourceState:
    return (t.data_ptr(), t.is_contiguous(), t.dtype, type(t), t.is_neg() or t.is_conj())


class OutgoingStream:
    """Owns the bucket buffers of one sender and streams versions through a ``Group``.

    ``depth`` buffers rotate (packing bucket k + depth waits for bucket k's broadcast).
    ``checksums``: seal every bucket (see ``checksum``). ``fused``: on CUDA, pack and seal
    each sealed bucket in one pass and one launch (``paced.PackSeal``; default: where its
    kernel compiles and matches torch, checked when this object is created: a second or two,
    once per device and process); pieces it cannot take (a cast, a source on another device,
    a non-contiguous or odd-sized tensor) are copied in with torch first."""

    def __init__(self, device: torch.device, bucket_bytes: int, checksums: bool = True,
                 depth: int = 2, fused: bool | None = None):
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.checksums = checksums
        self.depth = depth
        self.fused = paced.pack_available(device) if fused is None else fused
        if device.type == "cuda":  # ("cuda" alone: whichever device is current when used)
            self.device = torch.device("cuda", paced.cuda_index(device))
        self._index = self.device.index
        self._buffers: list[torch.Tensor] = []
        self._plan: tuple[bytes, BucketPlan] | None = None
        self._fused: dict[int, FusedBucket] = {}  # per bucket, for the current plan
        self._moved: dict[int, list[SourceState]] = {}  # per bucket: seen once, not planned

    def _buffers_for(self, header: Header) -> list[torch.Tensor]:
        size = checksum.buffer_bytes(min(self.bucket_bytes, max(header.total_bytes, 1)))
        if not self._buffers or self._buffers[0].numel() < size:
            self._buffers, self._plan, self._fused, self._moved = [], None, {}, {}  # free first
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(self.depth)]
        return self._buffers

    def plan(self, header: Header) -> BucketPlan:
        """The bucket plan of ``header``'s layout (cached; build it ahead with ``prepare``)."""
        buffers = self._buffers_for(header)
        layout = header.layout_bytes
        if self._plan is None or (self._plan[0] is not layout and self._plan[0] != layout):
            self._plan, self._fused, self._moved = (layout, BucketPlan(header, buffers)), {}, {}
        return self._plan[1]

    def prepare(self, header: Header, pairs: Pairs | None = None) -> BucketPlan:
        """Build ``header``'s bucket plan (and, given the tensors, every bucket's fused
        packing plan) ahead of a push, so the push only checks that they still hold."""
        plan = self.plan(header)
        if pairs is not None and self.fused and self.checksums:
            for b in range(len(plan.buckets)):
                self._fused_bucket(b, header, pairs, plan, build=True)
        return plan

    @torch.no_grad()
    def send(self, group: Group, header: Header, pairs: Pairs) -> None:
        """Broadcast every bucket of ``pairs`` (laid out by ``header``) to ``group``. Returns
        when every broadcast finished. Raises ``BroadcastError`` (the group is then closed)."""
        plan = self.plan(header)
        buffers = self._buffers
        works: list[Any] = []
        flats: dict[int, torch.Tensor] = {}
        for b in range(len(plan.buckets)):
            if b >= self.depth:  # the buffer is free once the host saw its broadcast end
                self._wait(group, works[b - self.depth], b - self.depth, header)
            works.append(group.broadcast(self._pack(b, header, pairs, plan, buffers, flats)))
        for b in range(max(0, len(works) - self.depth), len(works)):
            self._wait(group, works[b], b, header)

    def _wait(self, group: Group, work: Any, b: int, header: Header) -> None:
        group.wait(work, f"bucket {b} of version {header.version}")

    def _fused_bucket(self, b: int, header: Header, pairs: Pairs, plan: BucketPlan,
                      build: bool = False) -> FusedBucket | None:
        """Bucket ``b``'s fused packing plan for these tensors: reused while every source of
        the bucket keeps its ``SourceState`` (the layout, hence shapes, and the buffers are
        those of ``plan``). Built for the bucket's first push (or with ``build``); after its
        sources moved, built only once the same sources come twice in a row (None
        meanwhile: pack with torch), so a caller that hands over fresh tensors every push
        never pays for building (the tables' upload waits for the current stream). The
        tables take 8 bytes per 4 KiB checksum row on the device, 0.2% of the version."""
        indices, views = plan.whole[b]
        split = plan.split[b]
        order = list(indices) + [i for i, _, _, _ in split]
        state = [_state(pairs[i][1]) for i in order]
        cached = self._fused.get(b)
        if cached is not None and cached[1] == state:
            return cached
        if cached is not None and not build and self._moved.get(b) != state:
            self._moved[b] = state
            return None
        self._moved.pop(b, None)
        lo, hi = plan.buckets[b]
        entries = header.entries

        def raw(i: int, src: SourceState) -> bool:
            """Whether the source's memory holds the bytes to send as they are."""
            tensor, entry = pairs[i][1], entries[i]
            address, contiguous, dtype, kind, lazy_bit = src
            return (contiguous and dtype == entry.torch_dtype and not lazy_bit
                    and kind in (torch.Tensor, torch.nn.Parameter)
                    and address != 0 and address % 8 == 0
                    and entry.nbytes % 8 == 0 and entry.nbytes > 0
                    and tensor.is_cuda and tensor.get_device() == self._index)

        fits = dict(zip(order, (raw(i, src) for i, src in zip(order, state, strict=True)),
                        strict=True))
        pieces = [(state[k][0], entries[i].offset - lo, entries[i].nbytes)
                  for k, i in enumerate(indices) if fits[i]]
        pieces += [(pairs[i][1].data_ptr() + start, at, end - start)
                   for i, start, end, at in split if fits[i]]
        left = ([i for i in indices if not fits[i]],
                [v for i, v in zip(indices, views, strict=True) if not fits[i]])
        fused = (paced.PackSeal(pieces, hi - lo, self.device), state, left,
                 [p for p in split if not fits[p[0]]])
        self._fused[b] = fused
        return fused

    def _pack(self, b: int, header: Header, pairs: Pairs, plan: BucketPlan,
              buffers: list[torch.Tensor], flats: dict[int, torch.Tensor]) -> torch.Tensor:
        """Copy bucket ``b``'s bytes into its buffer (converting dtypes), seal it, and return
        the slice to broadcast."""
        lo, hi = plan.buckets[b]
        buf = buffers[b % len(buffers)]
        if self.fused and self.checksums:
            try:
                fused = self._fused_bucket(b, header, pairs, plan)
                if fused is not None:
                    pack, _, (indices, views), split = fused
                    self._copy_in(header, pairs, indices, views, split, buf, flats)
                    pack.run(buf)
                    return buf[:checksum.wire_bytes(hi - lo, True)]
            except Exception as exc:  # noqa: BLE001 - a kernel that fails here must not fail the push
                # (a new specialisation that does not compile, its tables out of memory):
                # this bucket and every later one are packed with torch, which rewrites all of
                # the bucket's bytes; nothing was sent from it yet
                log.warning("the fused pack-and-seal pass failed on %s (%s: %s); packing with "
                            "torch operations from now on", self.device, type(exc).__name__,
                            first_line(exc))
                self.fused, self._fused, self._moved = False, {}, {}
        indices, views = plan.whole[b]
        self._copy_in(header, pairs, indices, views, plan.split[b], buf, flats)
        if self.checksums:
            return buf[:checksum.seal(buf, hi - lo)]
        return buf[:hi - lo]

    @staticmethod
    def _copy_in(header: Header, pairs: Pairs, indices: list[int], views: list[torch.Tensor],
                 split: list[Piece], buf: torch.Tensor, flats: dict[int, torch.Tensor]
                 ) -> None:
        """Copy whole tensors into their views of the bucket buffer and split pieces into
        their ranges (converting dtypes), with torch, on the current stream."""
        if indices:
            sources.copy_all(views, [pairs[i][1] for i in indices], non_blocking=True)
        for i, start, end, at in split:
            entry = header.entries[i]
            flat = flats.get(i)
            if flat is None:
                src = pairs[i][1].detach()
                if src.dtype != entry.torch_dtype:
                    src = src.to(entry.torch_dtype)  # this one tensor, converted alone
                flat = flats[i] = flat_bytes(src)
            buf[at:at + end - start].copy_(flat[start:end], non_blocking=True)
            if end == entry.nbytes:
                del flats[i]
