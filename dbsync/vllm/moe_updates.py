"""Weight updates of mixture-of-experts layers whose kernel keeps its own layout (worker side).

vLLM 0.32's unquantized fused-MoE method prepares a layer's expert weights for its kernel at
start-up, in two steps: ``convert_to_unquantized_kernel_format``, then the kernel's own
``fused_experts.process_weights_after_loading`` (on CPU: pad the intermediate dimension and
prepack into the grouped-GEMM layout). In a weight update (vLLM's layerwise reload, which every
swap goes through) the method runs the first step and skips the second. The new experts then
land in the kernel's storage in checkpoint layout, and the kernel reads them as prepacked: the
engine serves neither the old version nor the new one, and nothing fails. Measured on the CPU
build with a tiny Qwen2-MoE: after a swap the served text matched neither checkpoint.

``prepare_moe_updates(model)`` makes each such layer's update run the second step too, on the
layer as the reload rebuilt it, before the reload copies the result into the kernel's storage;
the copy then holds the new version in the kernel's layout.

Hazards, stated plainly:
- Only the unquantized method is handled, and only where its kernel's preparation is not the
  no-op of vLLM's base class (on GPUs it is, for the Triton kernel: nothing changes there).
  Quantized MoE methods are left as vLLM makes them.
- It relies on vLLM internals (``moe_kernel.fused_experts``, ``process_weights_after_loading``);
  where they are missing, nothing is changed and a line at INFO says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: marks a method whose update already runs the kernel's own preparation
_MARK = "_dbsync_prepares_kernel_on_update"


def prepare_moe_updates(model: Any) -> int:
    """Make every unquantized fused-MoE layer of ``model`` whose kernel has a preparation of
    its own run it in weight updates too (idempotent). Returns how many layers it changed
    in this call."""
    try:
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
        if not isinstance(method, UnquantizedFusedMoEMethod) or getattr(method, _MARK, False):
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        prepare = getattr(type(experts), "process_weights_after_loading", None)
        if prepare is None or prepare is FusedMoEExperts.process_weights_after_loading:
            continue  # (no preparation of its own: the update path is complete)
        method.process_weights_after_loading = _preparing_on_update(
            method, method.process_weights_after_loading)
        setattr(method, _MARK, True)
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
