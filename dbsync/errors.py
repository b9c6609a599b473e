"""The dbsync error family. Every error says what went wrong, names the tensors or paths, and
says what to do about it."""

from __future__ import annotations


class DBSyncError(Exception):
    """Base class of every error dbsync raises on purpose."""


class InvalidWeightsError(DBSyncError, ValueError):
    """The weights handed to ``push`` cannot be published (bad names, non-tensors, unreadable
    source). Raised before any byte is written: nothing is published."""


class NothingPublishedError(DBSyncError):
    """The store holds no published version yet."""


class FormatError(DBSyncError):
    """A manifest or slot does not follow docs/FORMAT.md (unknown format version, bad field,
    a file name that would escape the store)."""


class DamagedVersionError(DBSyncError):
    """A published version failed verification (checksum, size, missing file). Nothing from it
    was handed to ``load_weights``."""

    def __init__(self, message: str, damaged: dict[str, str] | None = None):
        super().__init__(message)
        #: tensor name -> what is wrong with it
        self.damaged: dict[str, str] = dict(damaged or {})


class IncompatibleWeightsError(DBSyncError):
    """A published version does not fit the model it would be applied to (missing or
    unexpected names, wrong shapes or dtypes). Nothing was applied."""

    def __init__(self, message: str, problems: dict[str, str] | None = None):
        super().__init__(message)
        #: tensor name -> why it does not fit
        self.problems: dict[str, str] = dict(problems or {})


class LeaseExpiredError(DBSyncError):
    """A reader held a slot longer than the lease timeout and the writer may have reused it:
    what was read during that time cannot be trusted. Load again."""


class StoreBusyError(DBSyncError):
    """Another writer holds the store's writer lock."""
