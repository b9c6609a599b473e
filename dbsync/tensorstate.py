"""What per-tensor work kept from one push or load to the next depends on: the state of every
tensor (type, device, address, dtype, shape, strides, neg and conj bits), compared whole.

Two ways to compare, chosen once per process:
- torch's own tensor-match check (the one ``torch.compile`` runs before reusing compiled code:
  type, dispatch keys (device, neg, conj), dtype, shape, strides, in C++), plus the address
  column: ~4 ms at 20,000 tensors on a 2-core VM;
- or, where that check is missing or does not behave as expected (it is torch's internal API,
  tried on a few tensors first), columns read with ``map`` over unbound tensor methods, so no
  Python frame runs per tensor: ~13 ms at 20,000 tensors.

torch's check also compares ``requires_grad`` and the calling thread's dispatch settings
(``torch.inference_mode()``): states taken with another of those never match, so whatever was
kept is planned again (slower, never wrong).

Kept columns hold ints, bools, tuples of ints, and the (long-lived) tensor type and dtype
objects only; the check keeps only metadata. Neither holds a tensor, and keeping them adds
nothing for Python's cycle collector to walk but the columns themselves.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

_GETTERS: list[Callable[[Any], Any]] = []
_MATCHER: list[Any] = []  # [the tensor-match class, or None where it is not usable]


def _getters() -> list[Callable[[Any], Any]]:
    """The column getters (torch is imported only once a tensor is looked at)."""
    if not _GETTERS:
        import torch

        t = torch.Tensor
        _GETTERS.extend((type, operator.attrgetter("is_cpu"), t.data_ptr,
                         operator.attrgetter("dtype"), operator.attrgetter("shape"),
                         t.is_contiguous, t.is_neg, t.is_conj))
    return _GETTERS


#: positions of the address, dtype, shape and contiguity columns in ``States.columns``
ADDRESS = 2
DTYPE = 3
SHAPE = 4
CONTIGUOUS = 5
#: tensors per call of the tensor-match check
CHUNK = 512


def _match_class() -> Any:
    """torch's tensor-match check (``torch._C._dynamo.guards.TensorGuards``) if it is there
    and tells apart, on a few small tensors, every change this module must see; else None."""
    if _MATCHER:
        return _MATCHER[0]
    found = None
    try:
        import torch
        from torch._C._dynamo.guards import TensorGuards

        base = torch.zeros(4, 6)
        cplx = torch.zeros(3, dtype=torch.complex64)
        changed = [torch.zeros(4, 6, dtype=torch.float64), torch.zeros(6, 4), base.t(),
                   torch._neg_view(base), torch.nn.Parameter(base), torch.zeros(24)]
        guard = _build(TensorGuards, [base])
        conj = _build(TensorGuards, [cplx])
        if guard.check(base) and guard.check(base.view(4, 6)) and not any(
                guard.check(c) for c in changed) and not guard.check(None) and conj.check(
                cplx) and not conj.check(cplx.conj()):
            found = TensorGuards
    except Exception as exc:  # noqa: BLE001 (internal API: any failure means "not usable")
        log.info("torch's tensor-match check is not usable here (%s: %s); tensor states are "
                 "compared a column at a time", type(exc).__name__, exc)
    else:
        if found is None:
            log.info("torch's tensor-match check does not tell apart the changes dbsync must "
                     "see; tensor states are compared a column at a time")
    _MATCHER.append(found)
    return found


def _build(cls: Any, tensors: Sequence[Any]) -> Any:
    return cls(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


class States:
    """The states of a sequence of tensors (see the module docstring)."""

    __slots__ = ("columns", "_match")

    def __init__(self, columns: tuple[list[Any], ...], match: Any = None):
        self.columns = columns
        self._match = match

    @classmethod
    def of(cls, tensors: Sequence[Any]) -> States | None:
        """The states of ``tensors``, or None if one is not a strided tensor with memory (a
        non-tensor, a sparse tensor: anything whose attributes do not read)."""
        try:
            columns = [list(map(get, tensors)) for get in _getters()]
        except (AttributeError, TypeError, RuntimeError):
            return None
        columns[SHAPE] = list(map(tuple, columns[SHAPE]))  # (torch.Size: tracked objects)
        match = None
        matcher = _match_class()
        if matcher is not None:
            try:
                match = [_build(matcher, tensors[lo:lo + CHUNK])
                         for lo in range(0, len(tensors), CHUNK)]
            except Exception as exc:  # noqa: BLE001 (internal API: fall back to columns)
                log.info("torch's tensor-match check refused these tensors (%s); comparing "
                         "columns", exc)
        return cls(tuple(columns), match)

    def matches(self, tensors: Sequence[Any]) -> bool:
        """Whether ``tensors`` are in exactly these states (the addresses first, then the
        rest, stopping at the first difference)."""
        if len(tensors) != len(self.columns[0]):
            return False
        getters = _getters()
        try:
            if self._match is not None:
                # (a chunk at a time: each call holds the GIL, which other threads, such as
                # a verify's hashing threads, get between two calls)
                address, addresses = getters[ADDRESS], self.columns[ADDRESS]
                for k, match in enumerate(self._match):
                    chunk = tensors[k * CHUNK:(k + 1) * CHUNK]
                    if (list(map(address, chunk)) != addresses[k * CHUNK:(k + 1) * CHUNK]
                            or not match.check(*chunk)):
                        return False
                return True
            order = [ADDRESS] + [k for k in range(len(getters)) if k != ADDRESS]
            # (a torch.Size equals the tuple of its dims: shapes compare without converting)
            return all(list(map(getters[k], tensors)) == self.columns[k] for k in order)
        except (AttributeError, TypeError, RuntimeError):
            return False

    def same_layout(self, tensors: Sequence[Any]) -> bool:
        """Whether ``tensors`` have these dtypes and shapes (wherever they lie)."""
        if len(tensors) != len(self.columns[0]):
            return False
        getters = _getters()
        try:
            return all(list(map(getters[k], tensors)) == self.columns[k]
                       for k in (DTYPE, SHAPE))
        except (AttributeError, TypeError, RuntimeError):
            return False

    @property
    def addresses(self) -> list[int]:
        return self.columns[ADDRESS]

    @property
    def all_cpu_contiguous(self) -> bool:
        return all(self.columns[1]) and all(self.columns[CONTIGUOUS])
