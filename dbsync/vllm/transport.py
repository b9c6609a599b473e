"""Which transport an engine's workers use: driver-side helpers, importable without the
broadcast machinery (no ``torch.distributed``, no ``dbsync.nccl``, no worker-side module).

"auto" uses the broadcast when the sender offers one (``ROOT/broadcast.json``) with a backend
the worker can join (NCCL with CUDA, gloo on CPU), else the filesystem.
"""

from __future__ import annotations

import json

from ..errors import DBSyncError, FormatError
from ..format import MAX_RENDEZVOUS_BYTES
from ..store import Store

TRANSPORTS = ("auto", "filesystem", "broadcast")
#: the file a BroadcastSender writes into the store (``dbsync.nccl.rendezvous``)
RENDEZVOUS_FILE = "broadcast.json"


def local_device() -> str:
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise DBSyncError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    return transport


def offered_backend(root: str) -> str | None:
    """The backend ``ROOT/broadcast.json`` offers ("nccl" or "gloo"), or None when there is
    no readable offer. Advisory, as the file is: the receiver validates it fully on joining."""
    try:  # (with the store's bounds: the file is anyone's to write, see read_record)
        raw = Store(root, create=False).read_small((RENDEZVOUS_FILE,), MAX_RENDEZVOUS_BYTES)
        record = None if raw is None else json.loads(raw.decode("utf-8"))
    except (OSError, FormatError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("format") != "dbsync-broadcast":
        return None
    backend = record.get("backend")
    return backend if backend in ("nccl", "gloo") else None


def choose_transport(root: str, transport: str, device: str | None = None) -> str:
    """Resolve "auto" to "broadcast" or "filesystem" for a worker on ``device`` (default:
    this process's device): broadcast only when ``ROOT/broadcast.json`` names the backend
    that device can join."""
    if check_transport(transport) != "auto":
        return transport
    backend = offered_backend(root)
    if backend is None:
        return "filesystem"
    wanted = "nccl" if (device or local_device()).startswith("cuda") else "gloo"
    return "broadcast" if backend == wanted else "filesystem"
