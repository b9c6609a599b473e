"""dbsync: publish trainer weights through a shared directory and hot-swap them into running
vLLM engines: never torn, never silently stale."""

from .errors import (
    DamagedVersionError,
    DBSyncError,
    FormatError,
    IncompatibleWeightsError,
    InvalidWeightsError,
    LeaseExpiredError,
    NothingPublishedError,
    ReceiverRefusedError,
    StalenessError,
    StoreBusyError,
    StoreFullError,
    StoreNotFoundError,
    StoreRewoundError,
    UnsupportedFormatError,
)
from .format import FORMAT_VERSION
from .receiver import Receiver, Snapshot
from .sender import PushInterrupted, Sender
from .watch import Watcher

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "DBSyncError",
    "DamagedVersionError",
    "FormatError",
    "IncompatibleWeightsError",
    "InvalidWeightsError",
    "LeaseExpiredError",
    "NothingPublishedError",
    "PushInterrupted",
    "ReceiverRefusedError",
    "StalenessError",
    "StoreFullError",
    "StoreNotFoundError",
    "StoreRewoundError",
    "UnsupportedFormatError",
    "Receiver",
    "Sender",
    "Snapshot",
    "StoreBusyError",
    "Watcher",
    "__version__",
]
