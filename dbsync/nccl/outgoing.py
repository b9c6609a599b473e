"""Sending one version's bucket stream: pack the tensors into bucket buffers (converting dtype
per bucket, on the way out), seal each bucket with its checksum, broadcast it.

``depth`` buffers rotate; bucket k+depth is packed into bucket k's buffer once the host saw
bucket k's broadcast finish (each wait bounded by the group's timeout). Packing runs on the
caller's current stream, so work already queued there (the optimizer step) is seen; no CUDA
stream ever waits on a broadcast.

Measured (2x H100, 8 GiB, docs/BROADCAST.md): letting the device order buffer reuse instead
(every bucket enqueued at once, a private stream waiting on each broadcast) was 7% slower: each
pack then starts at the very moment the next broadcast kernel starts, and slows it down.

Hazards, stated plainly:
- The caller's tensors are read until ``send`` returns; do not modify them before.
- A tensor that spans buckets and needs a dtype conversion is converted alone into a temporary
  (the size of that one tensor); no other converted copy is made.
- After a failure the group is closed (its communicator aborted, which also ends the device
  waits of the private stream); a new epoch must form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import checksum
from .group import Group
from .layout import Header, bucket_plan, flat_bytes

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


class OutgoingStream:
    """Owns the bucket buffers of one sender and streams versions through a ``Group``.

    ``depth`` buffers rotate (packing bucket k + depth waits for bucket k's broadcast).
    ``checksums``: seal every bucket (see ``checksum``)."""

    def __init__(self, device: torch.device, bucket_bytes: int, checksums: bool = True,
                 depth: int = 2):
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.checksums = checksums
        self.depth = depth
        self._buffers: list[torch.Tensor] = []
        self._plan: tuple[bytes, BucketPlan] | None = None

    def _buffers_for(self, header: Header) -> list[torch.Tensor]:
        size = checksum.buffer_bytes(min(self.bucket_bytes, max(header.total_bytes, 1)))
        if not self._buffers or self._buffers[0].numel() < size:
            self._buffers, self._plan = [], None  # free the old set first
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(self.depth)]
        return self._buffers

    def plan(self, header: Header) -> BucketPlan:
        """The bucket plan of ``header``'s layout (cached; build it ahead with ``prepare``)."""
        buffers = self._buffers_for(header)
        layout = header.layout_bytes
        if self._plan is None or (self._plan[0] is not layout and self._plan[0] != layout):
            self._plan = (layout, BucketPlan(header, buffers))
        return self._plan[1]

    prepare = plan

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

    def _pack(self, b: int, header: Header, pairs: Pairs, plan: BucketPlan,
              buffers: list[torch.Tensor], flats: dict[int, torch.Tensor]) -> torch.Tensor:
        """Copy bucket ``b``'s bytes into its buffer (converting dtypes), seal it, and return
        the slice to broadcast."""
        lo, hi = plan.buckets[b]
        buf = buffers[b % len(buffers)]
        indices, views = plan.whole[b]
        if indices:
            srcs = [pairs[i][1].detach() for i in indices]
            try:
                torch._foreach_copy_(views, srcs, non_blocking=True)
            except (RuntimeError, TypeError):
                for view, src in zip(views, srcs, strict=True):
                    view.copy_(src, non_blocking=True)
        for i, start, end, at in plan.split[b]:
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
        if self.checksums:
            return buf[:checksum.seal(buf, hi - lo)]
        return buf[:hi - lo]
