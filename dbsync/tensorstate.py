"""What per-tensor work kept from one push or load to the next depends on: the state of every
tensor (type, device, address, dtype, shape, contiguity, neg and conj bits), read a column at a
time and compared whole.

Columns are read with ``map`` over unbound tensor methods, so no Python frame runs per tensor:
at 20,000 tensors a comparison costs about half of building one tuple per tensor. Kept columns
hold ints, bools, tuples of ints, and the (long-lived) tensor type and dtype objects only, so
keeping them adds nothing for Python's cycle collector to walk but the columns themselves.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

_GETTERS: list[Callable[[Any], Any]] = []


def _getters() -> list[Callable[[Any], Any]]:
    """The column getters (torch is imported only once a tensor is looked at)."""
    if not _GETTERS:
        import torch

        t = torch.Tensor
        _GETTERS.extend((type, operator.attrgetter("is_cpu"), t.data_ptr,
                         operator.attrgetter("dtype"), operator.attrgetter("shape"),
                         t.is_contiguous, t.is_neg, t.is_conj))
    return _GETTERS


_SHAPE = 4


class States:
    """The states of a sequence of tensors, as columns (see the module docstring)."""

    __slots__ = ("columns",)

    def __init__(self, columns: tuple[list[Any], ...]):
        self.columns = columns

    @classmethod
    def of(cls, tensors: Sequence[Any]) -> States | None:
        """The states of ``tensors``, or None if one is not a strided tensor with memory (a
        non-tensor, a sparse tensor: anything whose attributes do not read)."""
        try:
            columns = [list(map(get, tensors)) for get in _getters()]
        except (AttributeError, TypeError, RuntimeError):
            return None
        columns[_SHAPE] = list(map(tuple, columns[_SHAPE]))  # (torch.Size: tracked objects)
        return cls(tuple(columns))

    def matches(self, tensors: Sequence[Any]) -> bool:
        """Whether ``tensors`` are in exactly these states (column by column, stopping at the
        first difference)."""
        if len(tensors) != len(self.columns[0]):
            return False
        try:
            # (a torch.Size equals the tuple of its dims: shapes compare without converting)
            return all(list(map(get, tensors)) == kept
                       for get, kept in zip(_getters(), self.columns, strict=True))
        except (AttributeError, TypeError, RuntimeError):
            return False

    @property
    def addresses(self) -> list[int]:
        return self.columns[2]

    @property
    def all_cpu_contiguous(self) -> bool:
        return all(self.columns[1]) and all(self.columns[5])
