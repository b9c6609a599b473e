"""A transformers model's weights under its checkpoints' names, as views of its own tensors.

transformers (5 and later) keeps some weights in memory in another layout than its checkpoints
and vLLM's weight loaders use: a mixture-of-experts layer holds one fused tensor per projection
(``mlp.experts.gate_up_proj`` of shape [experts, 2 x intermediate, hidden],
``mlp.experts.down_proj``), where a checkpoint names one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``). ``save_pretrained`` converts back with the model's
conversion mapping. ``checkpoint_views`` runs the same conversion (transformers' own, so the
names and values are exactly what ``save_pretrained`` writes), except that the split of a
fused projection gives views of the fused tensor where transformers copies each part: a push
of a 30B MoE model from GPU memory must not first copy two thirds of it there.

A Sender publishes an ``nn.Module`` of transformers under its checkpoint's names (what a served
engine expects); ``Receiver.load(module)`` takes such a version into the module's own tensors
through the same views.

Cost: the conversion runs in Python on every push and every load into such a module: 0.05-0.27
s for the 18,867 checkpoint tensors of a Qwen3-30B-A3B-shaped model (531 in memory; 2-core VM,
measured on the meta device).

Hazards: the conversion mapping is transformers' internal API (``core_model_loading``,
``conversion_mapping``); where it is missing or fails, the module's own names are used (said
once at INFO). A view may be non-contiguous where a conversion transposes; ``destinations``
uses the views for writing only if every one of them shares memory with the model's own
tensors (else a copy would take the bytes and the model would keep its old weights).
"""

from __future__ import annotations

import bisect
import copy
import logging
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

_TOLD: set[str] = set()


def is_transformers_model(module: Any) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (without importing
    transformers: only a model of it can exist if it was imported)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def checkpoint_views(model: Any, state: Mapping[str, Any]) -> dict[str, Any] | None:
    """``state`` (``model``'s state_dict, names as the model has them) under the checkpoint's
    names, in checkpoint order; None where ``model`` is no transformers model, has no
    conversion (its names are its checkpoint's) or it cannot be run here."""
    if not is_transformers_model(model):
        return None
    conversions = _viewing_conversions(model)
    if not conversions:
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion

        converted = revert_weight_conversion(_WithConversions(model, conversions), dict(state))
    except Exception as exc:  # noqa: BLE001 (internal API: any failure means "not here")
        _tell_once(type(model).__name__, f"transformers' conversion to checkpoint names failed "
                   f"({type(exc).__name__}: {exc}); its own names are used")
        return None
    if set(converted) == set(state):
        return None
    return converted


def destinations(model: Any, state: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """Where a load of a version whose tensors are ``names`` writes into ``model``: its own
    tensors ``state`` (its state_dict with ``keep_vars``), or views of them under the
    checkpoint's names where the version has those and not the model's own (a transformers
    model's fused MoE experts, published by a Sender). ``state`` where the views would not
    write into the model; a mismatch of names is then said by the caller's check."""
    if not is_transformers_model(model) or all(name in state for name in names):
        return state  # (checked first: a look at every name costs ~1 ms a load at 20,000)
    views = checkpoint_views(model, state)
    return views if views is not None and _writable(views, state) else state


def _writable(views: Mapping[str, Any], state: Mapping[str, Any]) -> bool:
    """Whether writing into every tensor of ``views`` writes into the tensors of ``state``
    (each view lies within the memory of one of them)."""
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                   for t in state.values() if hasattr(t, "untyped_storage"))
    starts = [s for s, _ in spans]
    for view in views.values():
        if not hasattr(view, "untyped_storage"):
            return False
        at = view.untyped_storage().data_ptr()
        k = bisect.bisect_right(starts, at) - 1
        if k < 0 or at >= spans[k][0] + spans[k][1]:
            return False
    return True


class _WithConversions:
    """``model`` with other conversions (transformers reads them from the model)."""

    def __init__(self, model: Any, conversions: list[Any]):
        self._model = model
        self._weight_conversions = conversions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _viewing_conversions(model: Any) -> list[Any] | None:
    """The model's conversion mapping (as ``revert_weight_conversion`` finds it), with each
    concatenation's reverse (a split) giving views instead of copies."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Chunk,
            Concatenate,
            PrefixChange,
            WeightConverter,
        )
    except ImportError:
        return None

    class ViewChunk(Chunk):
        def convert(self, input_dict: dict[str, Any], source_patterns: list[str],
                    target_patterns: list[str], **kwargs: Any) -> dict[str, Any]:
            import torch

            tensors = next(iter(input_dict.values()))
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            targets = self.get_target_patterns(target_patterns, **kwargs)
            return dict(zip(targets, torch.chunk(tensor, len(targets), dim=self.dim),
                            strict=True))

    class ViewConcatenate(Concatenate):
        @property
        def reverse_op(self) -> Any:
            return ViewChunk(self.dim, self.num_shards_attribute)

    try:
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                           if not isinstance(c, PrefixChange)]
        conversions = copy.deepcopy(list(conversions or ()))
        for conversion in conversions:
            if isinstance(conversion, WeightConverter):
                conversion.operations = [
                    ViewConcatenate(op.dim, op.num_shards_attribute)
                    if type(op) is Concatenate else op for op in conversion.operations]
    except Exception as exc:  # noqa: BLE001 (internal API)
        _tell_once(type(model).__name__, f"its conversion mapping could not be read "
                   f"({type(exc).__name__}: {exc}); its own names are used")
        return None
    return conversions


def _tell_once(kind: str, what: str) -> None:
    if kind not in _TOLD:
        _TOLD.add(kind)
        log.info("dbsync: %s: %s", kind, what)
