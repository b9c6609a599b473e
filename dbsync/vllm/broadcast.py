"""Broadcast transport for vLLM engines, in two halves that import nothing of each other:

- ``dbsync.vllm.transport`` (driver side: the controller, the server): which transport a
  worker uses (``TRANSPORTS``, ``check_transport``, ``choose_transport``). No
  ``torch.distributed``, no ``dbsync.nccl``.
- ``dbsync.vllm.staging`` (worker side): ``Stager``, ``StagingReceiver``, ``Staged``: each
  worker stages the versions the trainer broadcasts, verified on its device, and applies a
  staged copy only under the manifest the sender confirmed.

This module re-exports both for existing imports; the worker-side names are loaded only when
asked for, so importing it (as the controller does) pulls in nothing worker-side.
"""

from __future__ import annotations

from typing import Any

from .transport import TRANSPORTS, check_transport, choose_transport, local_device

_WORKER_SIDE = ("Staged", "StagingReceiver", "Stager")

__all__ = ["TRANSPORTS", "check_transport", "choose_transport", "local_device", *_WORKER_SIDE]


def __getattr__(name: str) -> Any:
    if name in _WORKER_SIDE:
        from . import staging

        return getattr(staging, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
