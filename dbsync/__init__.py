"""dbsync: publish trainer weights through a shared directory and hot-swap them into running
vLLM engines: never torn, never silently stale.

Names are imported on first use (PEP 562): ``import dbsync`` is cheap, and torch is imported
only once something that needs it (``Sender``, ``Receiver``, ...) is touched. This keeps the
``dbsync`` command quick to start."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"  # (the minor number follows the store format, FORMAT_VERSION)

# public name -> the submodule that defines it
_LAZY = {
    "DBSyncError": "errors",
    "DamagedVersionError": "errors",
    "FormatError": "errors",
    "IncompatibleWeightsError": "errors",
    "InvalidArgumentError": "errors",
    "InvalidWeightsError": "errors",
    "LeaseExpiredError": "errors",
    "NothingPublishedError": "errors",
    "StoreBusyError": "errors",
    "ReceiverRefusedError": "errors",
    "ResourceLimitError": "errors",
    "SelfHeldSlotError": "errors",
    "ReaderIdInUseError": "errors",
    "SlotHeldError": "errors",
    "StalenessError": "errors",
    "SourceChangedError": "errors",
    "StoreFullError": "errors",
    "StoreReadOnlyError": "errors",
    "StoreNotFoundError": "errors",
    "StoreRewoundError": "errors",
    "StoreUnreachableError": "errors",
    "UnsupportedFormatError": "errors",
    "PushInterrupted": "sender",
    "FORMAT_VERSION": "format",
    "Receiver": "receiver",
    "Snapshot": "receiver",
    "Sender": "sender",
    "Watcher": "watch",
}

__all__ = [
    "FORMAT_VERSION",
    "DBSyncError",
    "DamagedVersionError",
    "FormatError",
    "IncompatibleWeightsError",
    "InvalidArgumentError",
    "InvalidWeightsError",
    "LeaseExpiredError",
    "NothingPublishedError",
    "PushInterrupted",
    "Receiver",
    "ReceiverRefusedError",
    "Sender",
    "Snapshot",
    "ResourceLimitError",
    "SelfHeldSlotError",
    "ReaderIdInUseError",
    "SlotHeldError",
    "StalenessError",
    "StoreBusyError",
    "SourceChangedError",
    "StoreFullError",
    "StoreReadOnlyError",
    "StoreNotFoundError",
    "StoreRewoundError",
    "StoreUnreachableError",
    "UnsupportedFormatError",
    "Watcher",
    "__version__",
]

if TYPE_CHECKING:
    from .errors import (
        DamagedVersionError,
        DBSyncError,
        FormatError,
        IncompatibleWeightsError,
        InvalidArgumentError,
        InvalidWeightsError,
        LeaseExpiredError,
        NothingPublishedError,
        ReaderIdInUseError,
        ReceiverRefusedError,
        ResourceLimitError,
        SelfHeldSlotError,
        SlotHeldError,
        SourceChangedError,
        StalenessError,
        StoreBusyError,
        StoreFullError,
        StoreNotFoundError,
        StoreReadOnlyError,
        StoreRewoundError,
        StoreUnreachableError,
        UnsupportedFormatError,
    )
    from .format import FORMAT_VERSION
    from .receiver import Receiver, Snapshot
    from .sender import PushInterrupted, Sender
    from .watch import Watcher


# submodules that ``import dbsync`` used to load, still reachable as attributes
_SUBMODULES = {"errors", "format", "fileio", "store", "sources", "leases", "status", "receiver",
               "sender", "watch"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dbsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
