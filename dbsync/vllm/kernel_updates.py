"""Layers whose kernel keeps a copy of its own that vLLM's weight update leaves stale (worker
side). Both were measured on the CPU build: after a swap the engine answered as neither version
while reporting the new one, and nothing failed.

- Mixture-of-experts layers. vLLM 0.32's unquantized fused-MoE method prepares a layer's
  experts in two steps at start-up: ``convert_to_unquantized_kernel_format``, then the kernel's
  own ``fused_experts.process_weights_after_loading`` (on CPU: pad the intermediate dimension
  and prepack into the grouped-GEMM layout). A weight update (vLLM's layerwise reload, which
  every swap goes through) runs the first step and skips the second, so the new experts land
  in the kernel's storage in checkpoint layout and are read as prepacked.
  ``prepare_moe_updates(model)`` makes each such layer's update run the second step too, on the
  layer as the reload rebuilt it, before the reload copies the result into the kernel's
  storage.
- Tied layers (an LM head that shares the token embedding's weight: Qwen2-0.5B, Llama 3.2 1B
  ...). On CPU the LM head keeps a prepacked copy of that weight for its matrix product. A
  checkpoint stores the shared weight once, under the embedding's name (``save_pretrained``
  drops the tied name), so in an update the head receives nothing: the reload puts the shared
  weight back, new, but the head's prepacked copy stays old. ``TiedLayers`` finds the layers
  that share a weight, notes which of them received nothing in the update under way, and
  prepares those again once the reload has put the shared weight back.

Hazards, stated plainly:
- Only the CPU build's layers are changed, and only unquantized methods: the MoE method where
  its kernel's preparation is not the no-op of vLLM's base class, and tied layers whose
  method is vLLM's unquantized embedding method (its preparation does nothing off CPU).
  Quantized layers are updated as vLLM does it.
- It relies on vLLM internals (``moe_kernel.fused_experts``, ``process_weights_after_loading``,
  the layerwise reload's per-layer counts); where they are missing, nothing is changed (said
  once at INFO), except that tied layers are then prepared again after every update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

def prepare_moe_updates(model: Any) -> int:
    """Make every unquantized fused-MoE layer of ``model`` whose kernel has a preparation of
    its own run it in weight updates too. Call once per model (before its first update: the
    layers and their methods stay for the engine's life). Returns how many layers it
    changed."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0  # (GPU kernels' preparations are skipped in updates on purpose: CUDA
            # graphs hold their tensors' addresses; vLLM keeps those updates right itself)
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError as exc:
        log.info("dbsync: vLLM's fused-MoE internals are not where expected (%s); MoE layers "
                 "are updated as vLLM does it", exc)
        return 0
    changed = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        prepare = getattr(type(experts), "process_weights_after_loading", None)
        if prepare is None or prepare is FusedMoEExperts.process_weights_after_loading:
            continue  # (no preparation of its own: the update path is complete)
        method.process_weights_after_loading = _preparing_on_update(
            method, method.process_weights_after_loading)
        changed += 1
    if changed:
        log.info("dbsync: %d MoE layer(s) prepare their experts for the kernel (%s) at every "
                 "weight update", changed, type(experts).__name__)
    return changed


def _preparing_on_update(method: Any, original: Callable[[Any], None]) -> Callable[[Any], None]:
    def process_weights_after_loading(layer: Any) -> None:
        updating = getattr(method, "moe_kernel", None) is not None
        original(layer)
        if updating and not _pre_processed():
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return process_weights_after_loading


def _pre_processed() -> bool:
    """Whether vLLM is loading weights already in the kernel's layout (then there is nothing
    to prepare)."""
    try:
        from vllm.model_executor.utils import is_weights_pre_processed
    except ImportError:
        return False
    return bool(is_weights_pre_processed())


class TiedLayers:
    """The layers of a model that share their weight with another layer (found before the
    first update, while the sharing is intact: the reload takes it apart until it ends)."""

    def __init__(self, model: Any):
        self.layers = _tied_layers(model)
        if self.layers:
            log.info("dbsync: %d layer(s) share a weight with another (%s); one that receives "
                     "nothing in an update is prepared again after it", len(self.layers),
                     ", ".join(sorted({type(m).__name__ for m in self.layers})))

    def unloaded(self) -> list[Any]:
        """The tied layers that received no weights in the update under way (call before the
        reload is finalized, which forgets the counts); all of them where the counts are not
        to be found."""
        if not self.layers:
            return []
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        except ImportError:
            return list(self.layers)
        unloaded = []
        for layer in self.layers:
            info = LAYERWISE_INFO.get(layer)
            if not getattr(info, "load_numel", 0):
                unloaded.append(layer)
        return unloaded

    @staticmethod
    def prepare_again(layers: list[Any]) -> None:
        """Run each layer's preparation again on its (shared, now new) weight."""
        for layer in layers:
            layer.quant_method.process_weights_after_loading(layer)


def _tied_layers(model: Any) -> list[Any]:
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )
    except ImportError as exc:
        log.info("dbsync: vLLM's embedding method is not where expected (%s); tied layers are "
                 "updated as vLLM does it", exc)
        return []
    by_weight: dict[int, list[Any]] = {}
    for layer in model.modules():
        weight = getattr(layer, "_parameters", {}).get("weight")
        if weight is not None and isinstance(getattr(layer, "quant_method", None),
                                             UnquantizedEmbeddingMethod):
            by_weight.setdefault(id(weight), []).append(layer)
    return [layer for group in by_weight.values() if len(group) > 1 for layer in group]
