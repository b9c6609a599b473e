"""Receiving one version's bucket stream and handing it out as (name, tensor) pairs.

Two bucket buffers: while the caller consumes the tensors of bucket k, bucket k+1 is already
arriving; bucket k+2 is posted into bucket k's buffer as soon as the caller asks for the first
tensor after bucket k.

Hazards, stated plainly:
- A tensor lying wholly inside one bucket is handed out as a *view of the bucket buffer*. It is
  valid only until the caller asks for the next tensor of a later bucket: copy what you keep
  (vLLM's ``load_weights`` copies into its parameters, as it must for the filesystem path).
- With header checksums each tensor is verified before it is handed out, so a damaged tensor
  never reaches the caller, but tensors before it in the stream already did; the receiver then
  re-applies the complete version from the filesystem.
- Every bucket wait is bounded by the group's timeout; on failure the group is closed and the
  iteration raises ``BroadcastError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import fileio
from .errors import BroadcastError
from .group import Group
from .layout import Entry, Header, bucket_plan


def checksum_of(raw: torch.Tensor) -> str:
    """xxh3_64 of a flat uint8 tensor's bytes (copied to host first when on a GPU)."""
    host = raw if raw.device.type == "cpu" else raw.to("cpu")
    return fileio.checksum(fileio.tensor_bytes(host.contiguous()))


def typed(entry: Entry, raw: torch.Tensor) -> torch.Tensor:
    dtype = entry.torch_dtype
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype, device=raw.device)
    return (raw if dtype == torch.uint8 else raw.view(dtype)).reshape(entry.shape)


class IncomingVersion:
    """Iterate once to receive; ``drain()`` finishes an iteration the caller abandoned.

    ``verify_now``: check header checksums before handing out each tensor. ``hash_after``:
    record each tensor's checksum in ``checksums`` for a check against the manifest later."""

    def __init__(self, group: Group, header: Header, buffers: list[torch.Tensor],
                 verify_now: bool, hash_after: bool,
                 views: dict[tuple[Any, ...], torch.Tensor] | None = None,
                 cancelled: Callable[[], str | None] | None = None,
                 plan: list[list[tuple[int, int, int]]] | None = None):
        self.group = group
        self.plan = bucket_plan(header) if plan is None else plan
        self.views = {} if views is None else views
        self.cancelled = cancelled
        self.header = header
        self.buffers = buffers
        self.verify_now = verify_now and header.has_checksums
        self.hash_after = hash_after
        self.checksums: list[str] = []
        self.complete = False
        self._iter: Iterator[tuple[str, torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._iter is None:
            self._iter = self._receive()
        return self._iter

    def drain(self) -> None:
        for _ in self:
            pass

    def _emit(self, i: int, raw: torch.Tensor, view: torch.Tensor | None = None
              ) -> tuple[str, torch.Tensor]:
        entry = self.header.entries[i]
        if self.verify_now or self.hash_after:
            got = checksum_of(raw)
            if self.verify_now and got != entry.checksum:
                raise BroadcastError(
                    f"tensor {entry.name!r} of version {self.header.version} arrived with "
                    f"checksum {got}, sent as {entry.checksum}; reading the version from the "
                    "filesystem instead")
            if self.hash_after:
                self.checksums.append(got)
        return entry.name, typed(entry, raw) if view is None else view

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        header, group = self.header, self.group
        entries = header.entries
        buckets = header.buckets()
        plan = self.plan
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        works: list[Any] = [None, None]
        partial: dict[int, torch.Tensor] = {}
        next_i = 0  # next entry to hand out (manifest order)
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        hashing = self.verify_now or self.hash_after
        views = self.views
        try:
            for b in range(min(2, len(buckets))):
                lo, hi = buckets[b]
                works[b] = group.broadcast(self.buffers[b][: hi - lo])
            for b, (lo, _hi) in enumerate(buckets):
                k = b % 2
                what = f"bucket {b} of {len(buckets)} of version {header.version}"
                if b == 0:  # the sender may still be collecting acknowledgements
                    group.wait(works[k], what, 2 * group.timeout, self.cancelled)
                else:
                    group.wait(works[k], what)
                works[k] = None
                buf = self.buffers[k]
                for i, start, end in plan[b]:
                    entry = entries[i]
                    at = entry.offset + start - lo
                    view = None
                    if start == 0 and end == entry.nbytes:
                        if hashing:
                            raw = buf[at: at + entry.nbytes]
                        else:  # the common case: a cached view, no per-tensor slicing
                            key = (k, at, entry.dtype, entry.shape)
                            view = views.get(key)
                            if view is None:
                                view = views[key] = typed(entry, buf[at: at + entry.nbytes])
                            raw = empty
                    else:
                        whole = partial.get(i)
                        if whole is None:
                            whole = partial[i] = torch.empty(entry.nbytes, dtype=torch.uint8,
                                                             device=device)
                        whole[start:end].copy_(buf[at: at + end - start])
                        if end != entry.nbytes:
                            continue
                        raw = partial.pop(i)
                    while next_i < i:  # zero-byte tensors come in their manifest place
                        yield self._emit(next_i, empty)
                        next_i += 1
                    yield self._emit(i, raw, view)
                    next_i = i + 1
                if b + 2 < len(buckets):
                    lo2, hi2 = buckets[b + 2]
                    works[k] = group.broadcast(buf[: hi2 - lo2])
            while next_i < len(entries):
                yield self._emit(next_i, empty)
                next_i += 1
            self.complete = True
        finally:
            if not self.complete:
                group.close()  # unfinished collectives: the group is unusable
