"""Which bytes of each checkpoint tensor a worker's ``load_weights`` reads (worker side).

Under tensor parallelism each vLLM worker's weight loaders read only part of most checkpoint
tensors: a column-parallel weight's rows for this rank, a vocabulary shard of the embedding,
all of a replicated norm. ``ReadRecorder`` watches one real apply (a ``TorchDispatchMode``, as
vLLM's own layerwise reload counts loaded elements) and records, per tensor, the byte range
that holds every element any operation read (views taken on the way do not count). The
broadcast staging then keeps only those ranges (``ByteWindows``); ``ReadGuard`` watches each
later apply from them and stops it before any operation reads a byte outside them.

Hazards, stated plainly:
- Only operations dispatched through torch on the applying thread, while the mode is entered,
  are seen. A loader that reads a tensor's memory another way (``tolist()``, NumPy, printing a
  tensor, DLPack, a C extension given a data pointer, another thread) is not recorded, and the
  guard cannot stop it: do not use windows with such loaders (``DBSYNC_STAGE_WINDOWS=0`` turns
  them off). The vLLM backend enters the mode for ``receive_weights`` and again for
  ``finish_weight_update`` (where vLLM's layerwise reload replays deferred loads).
- A window is the hull of what was read: a row-parallel weight (this rank's columns of every
  row) spans nearly the whole tensor, so its window saves little.
- Windows hold for the layout they were recorded on (names, dtypes, shapes) and the engine
  that recorded them (its tensor-parallel rank and size never change while it runs).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import DBSyncError

#: (name, dtype, shape) of every tensor of a version, in order
Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def layout_of(pairs: Iterable[tuple[str, Any]]) -> Layout:
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in pairs)


class OutsideWindowError(DBSyncError):
    """An apply from staged windows read a byte that was not staged. Raised before that
    operation ran: nothing it would have computed from unstaged bytes was written."""


@dataclass(frozen=True)
class ByteWindows:
    """What one worker reads of each tensor of one layout: name -> (lo, hi) byte range of the
    tensor's row-major bytes (``lo == hi``: nothing)."""

    layout: Layout
    ranges: dict[str, tuple[int, int]]

    @property
    def full_bytes(self) -> int:
        return sum(_nbytes(dtype, shape) for _, dtype, shape in self.layout)

    @property
    def kept_bytes(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges.values())


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class _Intervals:
    """The tracked tensors living in one storage: sorted byte intervals -> name."""

    __slots__ = ("ref", "starts", "ends", "names", "nested")

    def __init__(self, ref: weakref.ref) -> None:
        self.ref = ref
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.names: list[str] = []
        #: two tracked tensors share bytes: look through every interval
        self.nested = False

    def add(self, start: int, end: int, name: str) -> None:
        at = bisect.bisect_right(self.starts, start)
        if (at and self.ends[at - 1] > start) or (at < len(self.starts)
                                                   and self.starts[at] < end):
            self.nested = True
        self.starts.insert(at, start)
        self.ends.insert(at, end)
        self.names.insert(at, name)

    def overlapping(self, lo: int, hi: int) -> Iterator[tuple[str, int, int]]:
        """(name, first, stop) relative to each tracked tensor overlapping [lo, hi)."""
        at = 0 if self.nested else max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while at < len(self.starts) and self.starts[at] < hi:
            start, end = self.starts[at], self.ends[at]
            if end > lo:
                yield self.names[at], max(lo, start) - start, min(hi, end) - start
            at += 1


class ReadRecorder(TorchDispatchMode):
    """Record, per tracked tensor, the hull of the bytes read by operations run inside this
    mode. ``track(name, tensor)`` each tensor before handing it to the loader."""

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, _Intervals] = {}
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.read: dict[str, list[int]] = {}

    def track(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self._layout.append((name, tensor.dtype, tuple(tensor.shape)))
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            storage = tensor.untyped_storage()
            key = id(storage)
            intervals = self._storages.get(key)
            if intervals is None or intervals.ref() is not storage:
                ref = weakref.ref(storage, lambda _, key=key: self._storages.pop(key, None))
                intervals = self._storages[key] = _Intervals(ref)
            start = tensor.storage_offset() * tensor.element_size()
            intervals.add(start, start + nbytes, name)
        return tensor

    def tracked(self, pairs: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            yield name, self.track(name, tensor)

    def windows(self) -> ByteWindows:
        """The recorded ranges, widened to 8-byte words (the broadcast's copy unit)."""
        ranges: dict[str, tuple[int, int]] = {}
        for name, dtype, shape in self._layout:
            got = self.read.get(name)
            if got is None:
                ranges[name] = (0, 0)
            else:
                ranges[name] = (got[0] // 8 * 8, min(-(-got[1] // 8) * 8, _nbytes(dtype, shape)))
        return ByteWindows(tuple(self._layout), ranges)

    def _reads(self, x: Any) -> Iterator[tuple[str, int, int]]:
        if not isinstance(x, torch.Tensor) or not self._storages or x.is_meta:
            return
        numel = x.numel()
        if not numel:
            return
        try:
            storage = x.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass)
            return
        intervals = self._storages.get(id(storage))
        if intervals is None or intervals.ref() is not storage:
            return
        size = x.element_size()
        lo = x.storage_offset() * size
        span = sum((n - 1) * abs(s) for n, s in zip(x.shape, x.stride(), strict=True))
        yield from intervals.overlapping(lo, lo + (span + 1) * size)

    def _note(self, name: str, first: int, stop: int) -> None:
        got = self.read.get(name)
        if got is None:
            self.read[name] = [first, stop]
        else:
            got[0], got[1] = min(got[0], first), max(got[1], stop)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func.is_view:
            # A composite op that may return a view (``to``, ``contiguous``, ``reshape``)
            # reaches a mode whole under inference mode: run its parts inside this mode, so a
            # copy it makes is seen. A true view reads nothing (what is done with it is seen).
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
            return func(*args, **kwargs)
        for leaf in tree_leaves((args, kwargs)):
            for name, first, stop in self._reads(leaf):
                self._note(name, first, stop)
        return func(*args, **kwargs)


class ReadGuard(ReadRecorder):
    """Stop an apply from staged windows before any operation reads a byte of a tracked
    tensor outside its window (``OutsideWindowError``)."""

    def __init__(self, windows: ByteWindows) -> None:
        super().__init__()
        self._allowed = windows.ranges

    def _note(self, name: str, first: int, stop: int) -> None:
        lo, hi = self._allowed.get(name, (0, 0))
        if first < lo or stop > hi:
            raise OutsideWindowError(
                f"the model's weight loader read bytes [{first}, {stop}) of {name!r}, but this "
                f"worker staged only [{lo}, {hi}) of it (recorded on an earlier apply); "
                "nothing was computed from the unstaged bytes. The next apply reads the "
                "filesystem and records again; if this repeats, set DBSYNC_STAGE_WINDOWS=0")
        super()._note(name, first, stop)
