"""What per-tensor work kept from one push or load to the next depends on: one value per tensor,
read in a single pass, compared whole.

A state holds only ints, bools and tuples of ints, so Python's cycle collector stops tracking
it after one collection: a kept list of 20,000 states does not make every full collection of
the process slower (tuples holding ``torch.Size`` or dtype objects would stay tracked).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

#: (type id, is_cpu, address, dtype code, shape, contiguous, neg bit, conj bit)
State = tuple[Any, ...]


class _Codes(dict):
    """dtype -> a small int, assigned on first sight (under a lock: two dtypes never share)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __missing__(self, dtype: Any) -> int:
        with self._lock:
            return self.setdefault(dtype, len(self))


_DTYPE_CODES = _Codes()


def states(tensors: Sequence[Any]) -> list[State] | None:
    """Every tensor's ``State``, or None if one is not a strided tensor with memory (a
    non-tensor, a sparse tensor: anything whose attributes do not read)."""
    codes = _DTYPE_CODES
    try:
        return [(id(type(t)), t.is_cpu, t.data_ptr(), codes[t.dtype], tuple(t.shape),
                 t.is_contiguous(), t.is_neg(), t.is_conj()) for t in tensors]
    except (AttributeError, TypeError, RuntimeError):
        return None
