"""Receiving one version's bucket stream and handing it out as (name, tensor) pairs.

``depth`` bucket buffers rotate (default 3 on GPUs): while the caller consumes the tensors of
bucket k, buckets k+1 and k+2 are already arriving; bucket k+depth is posted into bucket k's
buffer as soon as the caller asks for the first tensor after bucket k. With sealed buckets
(the sender's default) each bucket is verified on this receiver's device when it lands,
before any tensor that ends in it is handed out.

Hazards, stated plainly:
- A tensor lying wholly inside one bucket is handed out as a *view of the bucket buffer*. It is
  valid only until the caller asks for the next tensor of a later bucket: copy what you keep
  (vLLM's ``load_weights`` copies into its parameters, as it must for the filesystem path).
- A damaged bucket stops the iteration (``DamagedBucketError``) before any tensor ending in it
  is handed out, but tensors of earlier buckets already were; the receiver then re-applies the
  complete version from the filesystem. The rest of the stream is drained first, so the other
  members and the group are unaffected.
- Every bucket wait is bounded by the group's timeout; on failure the group is closed and the
  iteration raises ``BroadcastError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import checksum, paced
from .errors import BroadcastError
from .group import Group
from .layout import Entry, Header, bucket_plan

#: ``before_verify(bucket_index, payload)``: a test hook run on each bucket before it is checked
BeforeVerify = Callable[[int, torch.Tensor], None]
#: A fused pass runs on every SM (not paced) when less than this share of a bucket is left to
#: arrive after its bucket: the little stream left is slowed only briefly, and a paced pass
#: of a full bucket would otherwise still run well after the last byte landed. The last
#: bucket's pass always runs on every SM.
FULL_SPEED_BELOW = 0.5


class DamagedBucketError(BroadcastError):
    """A bucket arrived with bytes that do not match the sender's checksum. Nothing ending in
    it was handed out; the rest of the stream was drained, so the group is still usable."""


def _raw_writable(dst: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dst`` takes the bytes as they are: a plain tensor with memory of its own (a
    wrapper subclass may have none) on the receiving device, of that dtype, contiguous, no
    lazy neg/conj bit."""
    return (type(dst) in (torch.Tensor, torch.nn.Parameter) and dst.dtype == dtype
            and dst.device == device and dst.is_contiguous() and dst.data_ptr() != 0
            and not dst.is_neg() and not dst.is_conj())


@dataclass(frozen=True)
class ByteWindow:
    """A ``copy_into`` destination that keeps only part of a tensor: bytes ``[lo, hi)`` of its
    published bytes (row-major, as broadcast) land in ``into``, a contiguous uint8 tensor of
    ``hi - lo`` bytes on the receiving device; the rest of the tensor is received and verified
    but not kept (``lo == hi``: nothing kept)."""

    lo: int
    hi: int
    into: torch.Tensor

    def check(self, entry: Entry, device: torch.device) -> None:
        """Raise ``ValueError`` unless this window fits ``entry`` and takes raw bytes."""
        into = self.into
        if not 0 <= self.lo <= self.hi <= entry.nbytes:
            raise ValueError(f"window [{self.lo}, {self.hi}) of {entry.name!r} is outside its "
                             f"{entry.nbytes} bytes")
        if (into.dtype != torch.uint8 or into.numel() != self.hi - self.lo
                or not into.is_contiguous() or into.device != device):
            raise ValueError(f"the window of {entry.name!r} must land in a contiguous uint8 "
                             f"tensor of {self.hi - self.lo} bytes on {device}")


def _target(dst: Any) -> torch.Tensor:
    """The tensor a ``copy_into`` destination writes into."""
    return dst.into if isinstance(dst, ByteWindow) else dst


def typed(entry: Entry, raw: torch.Tensor) -> torch.Tensor:
    dtype = entry.torch_dtype
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype, device=raw.device)
    return (raw if dtype == torch.uint8 else raw.view(dtype)).reshape(entry.shape)


class IncomingVersion:
    """Iterate once to receive; ``drain()`` finishes an iteration the caller abandoned.

    ``verify``: check each sealed bucket before handing out its tensors (the header must name
    a checksum algorithm; the receiver refuses unsealed pushes when it verifies)."""

    def __init__(self, group: Group, header: Header, buffers: list[torch.Tensor],
                 verify: bool, views: dict[tuple[Any, ...], torch.Tensor] | None = None,
                 cancelled: Callable[[], str | None] | None = None,
                 plan: list[list[tuple[int, int, int]]] | None = None,
                 before_verify: BeforeVerify | None = None, whole_version: bool = False):
        self.group = group
        self.plan = bucket_plan(header) if plan is None else plan
        self.views = {} if views is None else views
        self.cancelled = cancelled
        self.header = header
        self.buffers = buffers
        self.verify = verify and header.has_checksums
        self.before_verify = before_verify
        #: True when ``buffers`` are regions of one allocation of the whole version (handed
        #: out tensors stay valid), False when they are reused bucket buffers
        self.whole_version = whole_version
        #: buckets checked against their checksums
        self.verified_buckets = 0
        #: why the version cannot be used (a damaged bucket), else None
        self.damaged: str | None = None
        self.complete = False
        self._iter: Iterator[tuple[str, torch.Tensor]] | None = None
        self._works: list[Any] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._iter is None:
            self._iter = self._receive()
        return self._iter

    def drain(self) -> None:
        for _ in self:
            pass

    def start(self) -> None:
        """Post the receives of the first buckets now (before the caller starts iterating),
        so the sender's stream starts at once. Idempotent."""
        if self._works is None:
            buckets = self.header.buckets()
            depth = len(self.buffers)
            self._works = [None] * depth
            for b in range(min(depth, len(buckets))):
                self._works[b] = self._post(b, buckets)

    def _post(self, b: int, buckets: list[tuple[int, int]]) -> Any:
        lo, hi = buckets[b]
        wire = checksum.wire_bytes(hi - lo, self.header.has_checksums)
        return self.group.broadcast(self.buffers[b % len(self.buffers)][:wire])

    def _check(self, b: int, buf: torch.Tensor, payload: int, pace: bool = True) -> None:
        if self.before_verify is not None:
            self.before_verify(b, buf[:payload])
        if not checksum.check(buf, payload, pace=pace):
            self.damaged = (f"bucket {b} of version {self.header.version} arrived damaged (its "
                            "checksum does not match the sender's); reading the version from "
                            "the filesystem")
            return
        self.verified_buckets += 1

    def _arrived(self, b: int, buckets: list[tuple[int, int]], works: list[Any]
                 ) -> torch.Tensor:
        """Wait for bucket ``b`` (bounded; the first one may also wait for the other members
        to acknowledge) and return its buffer."""
        k = b % len(self.buffers)
        group = self.group
        group.wait(works[k], f"bucket {b} of {len(buckets)} of version {self.header.version}",
                   2 * group.timeout if b == 0 else None, self.cancelled)
        works[k] = None
        return self.buffers[k]

    def _verify_or_drain(self, b: int, buckets: list[tuple[int, int]], works: list[Any],
                         pace: bool = True) -> None:
        """Check bucket ``b`` on the host; if damaged, take part in the rest of the stream and
        raise ``DamagedBucketError`` (the group stays usable)."""
        lo, hi = buckets[b]
        self._check(b, self.buffers[b % len(self.buffers)], hi - lo, pace)
        if self.damaged is not None:
            self._drain_after(b, buckets, works)
            self.complete = True  # every collective taken part in
            raise DamagedBucketError(self.damaged)

    def _drain_after(self, b: int, buckets: list[tuple[int, int]], works: list[Any]) -> None:
        """Take part in the broadcasts of the buckets after ``b`` without looking at them, so
        the group stays usable for the other members (and for this one's next push).
        Receives are posted in bucket order, as the sender sends: collectives are matched by
        the order they are issued in."""
        depth = len(self.buffers)
        if b + depth < len(buckets) and works[b % depth] is None:
            works[b % depth] = self._post(b + depth, buckets)  # bucket b's buffer is free
        for j in range(b + 1, len(buckets)):
            k = j % depth
            if works[k] is None:
                works[k] = self._post(j, buckets)
            self.group.wait(works[k], f"bucket {j} of version {self.header.version}")
            works[k] = None
            if j + depth < len(buckets):
                works[k] = self._post(j + depth, buckets)

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        header, group = self.header, self.group
        entries = header.entries
        buckets = header.buckets()
        plan = self.plan
        depth = len(self.buffers)
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        partial: dict[int, torch.Tensor] = {}
        next_i = 0  # next entry to hand out (manifest order)
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        views = self.views
        try:
            self.start()
            works = self._works
            assert works is not None
            for b, (lo, _hi) in enumerate(buckets):
                k = b % depth
                buf = self._arrived(b, buckets, works)
                if self.verify:
                    self._verify_or_drain(b, buckets, works, pace=b + 1 < len(buckets))
                for i, start, end in plan[b]:
                    entry = entries[i]
                    at = entry.offset + start - lo
                    view = None
                    if start == 0 and end == entry.nbytes:
                        key = (k, at, entry.dtype, entry.shape)  # cached: no per-tensor slicing
                        view = views.get(key)
                        if view is None:
                            view = views[key] = typed(entry, buf[at: at + entry.nbytes])
                    else:
                        whole = partial.get(i)
                        if whole is None:
                            whole = partial[i] = torch.empty(entry.nbytes, dtype=torch.uint8,
                                                             device=device)
                        whole[start:end].copy_(buf[at: at + end - start])
                        if end != entry.nbytes:
                            continue
                        view = typed(entry, partial.pop(i))
                    while next_i < i:  # zero-byte tensors come in their manifest place
                        yield self._emit(next_i, empty)
                        next_i += 1
                    yield entry.name, view
                    next_i = i + 1
                if b + depth < len(buckets):
                    works[k] = self._post(b + depth, buckets)
            while next_i < len(entries):
                yield self._emit(next_i, empty)
                next_i += 1
            self.complete = True
        finally:
            if not self.complete:
                group.close()  # unfinished collectives: the group is unusable

    def copy_into(self, dest: dict[str, torch.Tensor],
                  plans: dict[int, Any] | None = None) -> None:
        """Receive the whole version straight into ``dest`` (name -> existing tensor; the
        caller checked that every entry's name is there with its shape, and that dtypes are
        equal or both floating: cast; or name -> ``ByteWindow``: only those bytes are kept),
        instead of iterating. No byte is written before the
        checksum row (4 KiB) it lies in verified.

        On CUDA with Triton, each bucket is verified and copied out in one paced pass while
        the stream goes on, with no host sync (``paced.VerifyCopy``): a checksum row is
        written only if it matches the sender's row sum, and the count of rows that did not
        is read once at the end. A damaged bucket then raises ``DamagedBucketError`` after
        the stream ended, having written every row that verified, in that bucket and the
        others: ``dest`` then holds parts of two versions until the caller re-applies the
        version from the filesystem. Elsewhere (CPU, a cast, a tensor subclass, a tensor on
        another device, an odd-sized or misaligned tensor) a bucket is checked on the host
        first, then copied (with verification off: copied unchecked). ``plans``: the
        receiver's cache of per-bucket copy plans."""
        if self._iter is not None:
            raise BroadcastError("copy_into after iterating the same version")
        self._iter = iter(())
        header, group = self.header, self.group
        buckets = header.buckets()
        depth = len(self.buffers)
        device = self.buffers[0].device
        for entry in header.entries:
            if isinstance(dest[entry.name], ByteWindow):
                dest[entry.name].check(entry, device)
        plans = {} if plans is None else plans
        fused = self.verify and paced.available(device)
        bad_rows = torch.zeros(len(buckets), dtype=torch.int32, device=device) if fused else None
        on_device = 0  # buckets verified in the fused pass
        partial: dict[int, torch.Tensor] = {}
        try:
            self.start()
            works = self._works
            assert works is not None
            for b, (lo, hi) in enumerate(buckets):
                k = b % depth
                buf = self._arrived(b, buckets, works)
                plan = self._bucket_plan(b, buf, lo, hi, dest, plans, partial, fused)
                if isinstance(plan, paced.VerifyCopy):
                    assert bad_rows is not None
                    if self.before_verify is not None:
                        self.before_verify(b, buf[:hi - lo])
                    # little or nothing streams after it: full speed
                    tail = header.total_bytes - hi <= FULL_SPEED_BELOW * header.bucket_bytes
                    plan.run(checksum.words_view(buf, hi - lo),
                             checksum.trailer_view(buf, hi - lo), bad_rows[b:b + 1],
                             paced.programs_for(device, 2.0) if tail else None)
                    on_device += 1
                else:
                    table, by_torch = plan
                    if self.verify:
                        self._verify_or_drain(b, buckets, works)
                    table.run()
                    for dst, src in by_torch:
                        dst.copy_(src() if callable(src) else src)
                if b + depth < len(buckets):
                    works[k] = self._post(b + depth, buckets)
            if device.type == "cuda" and bad_rows is None:
                torch.cuda.current_stream(device).synchronize()  # copies into host memory
            if bad_rows is not None:
                bad = bad_rows.nonzero()  # one host sync for the whole version
                if bad.numel():
                    self.damaged = (f"bucket {int(bad[0])} of version {header.version} arrived "
                                    "damaged (its checksum does not match the sender's); "
                                    "reading the version from the filesystem")
                    self.complete = True
                    raise DamagedBucketError(self.damaged)
                self.verified_buckets += on_device
            self.complete = True
        finally:
            if not self.complete:
                group.close()

    def _bucket_plan(self, b: int, buf: torch.Tensor, lo: int, hi: int,
                     dest: dict[str, torch.Tensor], plans: dict[int, Any],
                     partial: dict[int, torch.Tensor], fused: bool) -> Any:
        """How bucket ``b`` lands in ``dest`` (reused while the layout, the buffer and the
        destination tensors, their addresses, dtypes and contiguity stay the same): a
        ``paced.VerifyCopy`` when every piece takes raw, word-aligned bytes and the bucket is
        verified on the device; else a ``paced.CopyTable`` of the raw pieces plus
        (destination, source) pairs for torch (a cast, a tensor subclass, a non-contiguous
        destination), where a tensor split across buckets is assembled first and copied once
        complete."""
        entries = self.header.entries
        pieces = self.plan[b]
        targets = [dest[entries[i].name] for i, _, _ in pieces]
        state = [(t.data_ptr(), t.dtype, t.is_contiguous()) for t in map(_target, targets)]
        cached = plans.get(b)
        # Push after push the same layout lands in the same tensors: reuse the plan without
        # building a byte view per tensor again (microseconds each: at MoE tensor counts,
        # tens of milliseconds per push).
        if (cached is not None and cached[0] is pieces and cached[1] == buf.data_ptr()
                and cached[3] == state
                and all(x is y for x, y in zip(cached[2], targets, strict=True))):
            return cached[4]
        raw: list[tuple[torch.Tensor, int]] = []
        by_torch: list[tuple[torch.Tensor, Any]] = []
        for i, start, end in pieces:
            entry = entries[i]
            at = entry.offset + start - lo
            window = dest[entry.name]
            if isinstance(window, ByteWindow):  # only the bytes it keeps, raw (checked)
                first, stop = max(start, window.lo), min(end, window.hi)
                if first < stop:
                    raw.append((window.into[first - window.lo:stop - window.lo],
                                at + first - start))
                continue
            dst = window.detach()
            if _raw_writable(dst, entry.torch_dtype, buf.device):
                raw.append((dst.reshape(-1).view(torch.uint8)[start:end], at))
            elif start == 0 and end == entry.nbytes:
                by_torch.append((dst, typed(entry, buf[at:at + end])))
            else:
                whole = partial.get(i)
                if whole is None:
                    whole = partial[i] = torch.empty(entry.nbytes, dtype=torch.uint8,
                                                     device=buf.device)
                by_torch.append((whole[start:end], buf[at:at + end - start]))
                if end == entry.nbytes:
                    by_torch.append((dst, lambda e=entry, i=i: typed(e, partial.pop(i))))
        plan: Any
        if fused and not by_torch and all(paced.VerifyCopy.fits(d, at) for d, at in raw):
            plan = paced.VerifyCopy(raw, hi - lo, buf.device)
        else:
            plan = (paced.CopyTable([(d, buf[at:at + d.numel()]) for d, at in raw]), by_torch)
        # by_torch holds this version's assembly buffers: such a plan is built again each time
        plans[b] = None if by_torch else (pieces, buf.data_ptr(), targets, state, plan)
        return plan

    def _emit(self, i: int, raw: torch.Tensor) -> tuple[str, torch.Tensor]:
        entry = self.header.entries[i]
        return entry.name, typed(entry, raw)
