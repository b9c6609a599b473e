"""Which destinations of a copy share memory in part: the bytes of one would be written
into the other (views of one buffer that overlap), whatever their strides.

A destination is a span of bytes [lo, hi) from its first to its last element. A contiguous
tensor (or one that is contiguous after permuting its dims, such as ``w.t()``) fills its span;
a strided one (a column ``buf[:, 0]``, a diagonal) has gaps, so two strided views can share a
span without sharing a byte. Those are told apart by their runs of adjacent bytes, computed
only for pairs whose spans overlap.

The same memory seen the same way under two names (tied weights: same address, dtype, shape
and strides) is not an overlap here; the caller handles ties.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

#: a strided destination with more runs than this is taken as filling its whole span
MAX_RUNS = 1 << 20
#: exact comparisons per call; past it, overlapping spans count as sharing memory
MAX_EXACT = 4096


class Span(NamedTuple):
    lo: int
    hi: int
    name: str
    #: the tensor, when it does not fill its span (None: it does)
    strided: Any = None
    #: the tensor (looked at only when another span has the same bounds: tied weights?)
    tensor: Any = None


def span_of(name: str, tensor: Any) -> Span | None:
    """``tensor``'s span (None: no bytes: empty, or no memory of its own or none that can be
    read, as for some wrapper tensors, which torch copies into)."""
    numel = tensor.numel()
    try:
        address = tensor.data_ptr()
    except (RuntimeError, AttributeError):
        return None
    if not numel or not address:
        return None
    size = tensor.element_size()
    if tensor.is_contiguous():
        return Span(address, address + numel * size, name, None, tensor)
    low = high = 0
    for stride, dim in zip(tensor.stride(), tensor.shape, strict=True):
        reach = stride * (dim - 1)
        if reach < 0:
            low += reach
        else:
            high += reach
    lo, hi = address + low * size, address + (high + 1) * size
    dense = hi - lo == numel * size  # (elements never overlap: expanded tensors are refused)
    return Span(lo, hi, name, None if dense else tensor, tensor)


def _runs(tensor: Any) -> tuple[Any, int] | None:
    """(sorted start addresses, bytes per run) of ``tensor``'s runs of adjacent elements, or
    None when there are more than ``MAX_RUNS``."""
    import torch

    dims = sorted((abs(s), d) for s, d in zip(tensor.stride(), tensor.shape, strict=True)
                  if d > 1)
    run, k = 1, 0
    while k < len(dims) and dims[k][0] == run:
        run *= dims[k][1]
        k += 1
    outer = dims[k:]
    if math.prod(d for _, d in outer) > MAX_RUNS:
        return None
    # (the first element's address is the lowest only for positive strides)
    size = tensor.element_size()
    low = sum(s * (d - 1) for s, d in zip(tensor.stride(), tensor.shape, strict=True) if s < 0)
    starts = torch.zeros(1, dtype=torch.int64)
    for stride, dim in outer:
        starts = (starts[:, None] + torch.arange(dim, dtype=torch.int64) * stride).reshape(-1)
    starts = (starts + low) * size + tensor.data_ptr()
    return starts.sort().values, run * size


def _share_bytes(a: Span, b: Span) -> bool:
    import torch

    runs_a = _runs(a.strided) if a.strided is not None else (
        torch.tensor([a.lo], dtype=torch.int64), a.hi - a.lo)
    runs_b = _runs(b.strided) if b.strided is not None else (
        torch.tensor([b.lo], dtype=torch.int64), b.hi - b.lo)
    if runs_a is None or runs_b is None:
        return True
    (starts_a, len_a), (starts_b, len_b) = runs_a, runs_b
    # for each run of a, the last run of b starting before it ends: shared if that one
    # ends after the run of a starts
    j = torch.searchsorted(starts_b, starts_a + len_a, side="left") - 1
    ok = j >= 0
    return bool(((starts_b[j.clamp(min=0)] + len_b > starts_a) & ok).any())


def _tied(a: Span, b: Span) -> bool:
    """One tensor under two names: the same memory seen the same way (dtype, shape,
    strides; a span with no tensor given is taken as its contiguous bytes)."""
    if (a.lo, a.hi) != (b.lo, b.hi):
        return False
    x, y = a.tensor, b.tensor
    if x is None or y is None:
        return x is y and a.strided is None and b.strided is None
    return (x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.shape == y.shape
            and x.stride() == y.stride())


def partial_overlaps(spans: list[Span]) -> dict[str, str]:
    """{name: why} for destinations that share memory in part with another (see the module
    docstring)."""
    found: dict[str, str] = {}
    active: list[Span] = []
    reach = -1  # the furthest end of the active spans
    exact = 0
    for span in sorted(spans):
        if span.lo >= reach:  # (the common case: no span before reaches this one)
            active, reach = [span], span.hi
            continue
        active = [a for a in active if a.hi > span.lo]
        for other in active:
            if _tied(other, span):
                continue
            if other.strided is not None or span.strided is not None:
                exact += 1
                if exact <= MAX_EXACT and not _share_bytes(other, span):
                    continue
            found[span.name] = f"shares part of its memory with {other.name} in the target"
            found.setdefault(other.name,
                             f"shares part of its memory with {span.name} in the target")
        active.append(span)
        reach = max(reach, span.hi)
    return found


#: why a destination whose memory is not writable is refused
READ_ONLY = ("its memory is read-only (a read-only mapping, such as a tensor made from a file "
             "mapped for reading): load into tensors with memory of their own (.clone())")


def read_only(spans: list[Span]) -> dict[str, str]:
    """{name: ``READ_ONLY``} for spans of this process's memory (CPU tensors only) that do not
    lie wholly in writable mappings (``/proc/self/maps``; where it cannot be read, {}): a
    copy into them would fail part way (EFAULT) or crash the process."""
    import bisect

    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    starts: list[int] = []
    ends: list[int] = []
    for line in lines:
        bounds, _, rest = line.partition(b" ")
        if rest[1:2] != b"w":
            continue
        lo, _, hi = bounds.partition(b"-")
        start, end = int(lo, 16), int(hi, 16)
        if ends and ends[-1] == start:  # (adjacent writable mappings: one range)
            ends[-1] = end
        else:
            starts.append(start)
            ends.append(end)
    found = {}
    for span in spans:
        k = bisect.bisect_right(starts, span.lo) - 1
        if k < 0 or span.hi > ends[k]:
            found[span.name] = READ_ONLY
    return found
