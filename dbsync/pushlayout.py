"""A push's per-tensor work, done once per model instead of once per push.

Push after push a trainer publishes the same tensors: the same names, and tensors at the same
addresses with the same dtype, shape and strides (updated in place by the optimizer; the
staging buffer's views of a background push lie at the same places every time). Everything a
push derives from that alone (which shard and offset each tensor goes to, the byte view it is
written from, the grouping of small tensors into writes and checked ranges, the index but for
its checksums) is kept in a ``PushLayout`` and reused while a look at every tensor's state
(``tensorstate``) finds each as it was.
At 20,000 tensors that pass costs a fraction of validating, planning and indexing again.

Hazard, stated plainly: a kept layout holds raw addresses (its byte views do not keep the
tensors alive); it is used only after the pass found a tensor of the same type, device,
address, dtype, shape and strides at each of them, in the caller's current pairs.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import fileio
from .format import dump_index
from .tensorstate import States


def adapter_key(adapter: dict[str, Any] | None) -> str:
    """The adapter configuration as it is now (a dict the caller edits in place between two
    pushes must not compare equal to itself as it was)."""
    return json.dumps(adapter, default=repr)  # (as dump_index writes it: keys unsorted)


class IndexTemplate:
    """``format.dump_index``'s bytes with the run id, version and checksums left open: built
    once per layout, filled per push (at 20,000 tensors about 1 ms instead of ~20)."""

    def __init__(self, columns: dict[str, list], ranges: dict[str, list], shards: Sequence[int],
                 adapter: dict[str, Any] | None):
        marks = [f"\x01{os.urandom(8).hex()}{i}" for i in range(3)]
        ranges = {**ranges, "checksum": marks[2]}  # type: ignore[dict-item]
        text = dump_index(marks[0], marks[1], columns, ranges, shards,  # type: ignore[arg-type]
                          adapter)
        parts: list[bytes] = []
        for mark in marks:
            before, sep, text = text.partition(json.dumps(mark).encode())
            if not sep:
                raise AssertionError("index template mark not found")  # pragma: no cover
            parts.append(before)
        self.parts = (*parts, text)
        self.adapter_key = adapter_key(adapter)

    def fill(self, run_id: str, version: int, checksums: list[str]) -> bytes:
        """The index of ``version`` of ``run_id`` with these (hex) checksums of its ranges."""
        p = self.parts
        run = json.dumps(run_id, ensure_ascii=False).encode("utf-8")
        # hex digests: nothing to escape (json.dumps of 20,000 of them costs milliseconds)
        sums = ('["' + '","'.join(checksums) + '"]').encode() if checksums else b"[]"
        return b"".join((p[0], run, p[1], str(int(version)).encode(), p[2], sums, p[3]))


@dataclass
class PushLayout:
    """Everything one push derives from its names and tensor states (see the module)."""

    names: list[str]
    states: States
    #: the plan's own inputs besides the tensors: shard size and the Sender's dtype
    settings: tuple[Any, ...]
    sizes: list[int]
    places: list[tuple[int, int]]
    shard_sizes: list[int]
    #: per batch of at most ``fileio.SHARDS_OPEN_AT_ONCE`` shards: (first, last, placed)
    batches: list[tuple[int, int, fileio.Placed]]
    #: each tensor's checked range, and the ranges' shard, offset and nbytes columns (one
    #: range per write task, in the order ``fileio.write_shards`` returns their checksums)
    range_of_tensor: list[int]
    range_columns: dict[str, list[int]]
    index: IndexTemplate | None = field(default=None)

    @classmethod
    def build(cls, names: list[str], tensor_states: States,
              settings: tuple[Any, ...], places: list[tuple[int, int]], shard_sizes: list[int],
              sizes: list[int]) -> PushLayout:
        views = fileio.views_at(tensor_states.addresses, sizes)
        shards = [shard for shard, _ in places]
        offsets = [offset for _, offset in places]
        batches = []
        for first in range(0, len(shard_sizes), fileio.SHARDS_OPEN_AT_ONCE):
            last = min(first + fileio.SHARDS_OPEN_AT_ONCE, len(shard_sizes))
            lo, hi = bisect.bisect_left(shards, first), bisect.bisect_left(shards, last)
            batches.append((first, last, fileio.Placed.of(
                views[lo:hi], [s - first for s in shards[lo:hi]] if first else shards[lo:hi],
                offsets[lo:hi])))
        range_of_tensor: list[int] = []
        columns: list[list[int]] = [[], [], []]
        for first, _, placed in batches:
            of_tensor, batch_columns = fileio.range_columns(placed, first)
            before = len(columns[0])
            range_of_tensor += [r + before for r in of_tensor] if before else of_tensor
            for column, more in zip(columns, batch_columns, strict=True):
                column += more
        return cls(names, tensor_states, settings, sizes, places, shard_sizes, batches,
                   range_of_tensor, dict(zip(("shard", "offset", "nbytes"), columns,
                                             strict=True)))

    def index_template(self, columns: Callable[[], dict[str, list]],
                       adapter: dict[str, Any] | None) -> IndexTemplate:
        """The index template of this layout and ``adapter`` (``columns()``: the tensor
        columns but ``range``, called only to build it)."""
        if self.index is None or self.index.adapter_key != adapter_key(adapter):
            self.index = IndexTemplate({**columns(), "range": self.range_of_tensor},
                                       self.range_columns, self.shard_sizes, adapter)
        return self.index


class LayoutCache:
    """The layouts of the last two pushes (a background push alternates two staging
    buffers, so two layouts recur)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._kept: list[PushLayout] = []

    def find(self, names: list[str], tensors: Sequence[Any], settings: tuple[Any, ...]
             ) -> PushLayout | None:
        """The kept layout of exactly these names, settings and tensors in the states it
        was built for, or None."""
        for layout in self._kept:
            if (layout.settings == settings and layout.names == names
                    and layout.states.matches(tensors)):
                return layout
        return None

    def add(self, layout: PushLayout) -> None:
        self._kept = [layout, *self._kept][: self.keep]
