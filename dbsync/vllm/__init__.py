"""dbsync for vLLM: the ``dbsync`` weight-transfer backend, the swap controller, in-process
attachment for ``vllm.LLM``/``AsyncLLM``, and ``serve-vllm`` (``dbsync.vllm.server``).

Importing this package imports vLLM. The server module is not imported here (it pulls in the
HTTP stack); use ``dbsync.vllm.server.serve`` / ``main``.
"""

from .controller import SwapController, SwapError
from .engine import engine_args
from .inprocess import Attachment, apply_latest, attach
from .lora import LoRAAttachment, attach_lora
from .plugin import BACKEND, register

__all__ = [
    "BACKEND",
    "Attachment",
    "LoRAAttachment",
    "SwapController",
    "SwapError",
    "apply_latest",
    "attach",
    "attach_lora",
    "engine_args",
    "register",
]
