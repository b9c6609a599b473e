"""The dbsync error family. Every error says what went wrong, names the tensors or paths, and
says what to do about it."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator


class DBSyncError(Exception):
    """Base class of every error dbsync raises on purpose."""


class InvalidWeightsError(DBSyncError, ValueError):
    """The weights handed to ``push`` cannot be published (bad names, non-tensors, unreadable
    source). Raised before any byte is written: nothing is published."""


class SourceChangedError(DBSyncError):
    """A file of the path pushed was rewritten in place while the push read it, so the
    version could have mixed two files' tensors: nothing was published. Push again once the
    file is written (save to a temporary name and rename it into place)."""


class InvalidArgumentError(DBSyncError, ValueError):
    """An argument given to dbsync is malformed or out of range (a reader id, a timeout, a
    thread count). Raised before anything is read, written or started."""


def check_seconds(value: object, what: str, none: str | None = None) -> float | None:
    """``value`` as a number of seconds >= 0 (None allowed where ``none`` says what it means,
    and infinity taken as None there); else ``InvalidArgumentError`` naming ``what`` (NaN, a
    bool or a string are refused: a NaN timeout would wait forever, a NaN interval spin)."""
    if none is not None and (value is None or value == float("inf")):
        return None
    if (isinstance(value, int | float) and not isinstance(value, bool)
            and 0 <= value < float("inf")):
        try:
            return float(value)
        except OverflowError:  # (an int beyond any float: longer than the universe's age)
            if none is not None:
                return None
    allowed = "" if none is None else f" (or None: {none})"
    raise InvalidArgumentError(f"{what} must be a finite number of seconds >= 0{allowed}, "
                               f"not {value!r}")


def short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)`` for a message, cut short past ``limit`` characters (a 10,000-character
    name, a list of tensors) and saying how long it was."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit * 3 // 4]}... ({len(text)} characters)"


def check_int(value: object, what: str, least: int, none: str | None = None) -> int | None:
    """``value`` as an int >= ``least`` (None allowed where ``none`` says what it means);
    else ``InvalidArgumentError`` naming ``what`` (a bool, a float or a string are refused)."""
    if none is not None and value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return int(value)
    allowed = "" if none is None else f" (or None: {none})"
    raise InvalidArgumentError(f"{what} must be an integer >= {least}{allowed}, not {value!r}")


def check_flag(value: object, what: str, none: str | None = None) -> bool | None:
    """``value`` if it is a bool (or None where ``none`` says what it means); else
    ``InvalidArgumentError`` (a string such as "false" would read as true)."""
    if isinstance(value, bool) or (none is not None and value is None):
        return value  # type: ignore[return-value]
    allowed = "" if none is None else f" (or None: {none})"
    raise InvalidArgumentError(f"{what} must be True or False{allowed}, not {value!r}")


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
        #: the damaged version, where the raiser knows it
        self.version: int | None = None


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


class SelfHeldSlotError(DBSyncError):
    """A push would wait for ever: the thread that pushes holds the slot it must write open
    itself (a snapshot of the same store, opened in the same thread)."""


class ReaderIdInUseError(DBSyncError):
    """Another open receiver (of this process, or alive on some host) uses this reader id:
    give each receiver its own, or leave it unset."""


class SlotHeldError(DBSyncError):
    """Live readers held the slot a push must write for longer than the Sender's
    ``reader_timeout``: nothing was published (a writer never overwrites a version a live
    reader holds)."""


class StoreBusyError(DBSyncError):
    """Another writer holds the store's writer lock."""


class UnsupportedFormatError(FormatError):
    """A store file was written in a format version this dbsync does not read."""

    def __init__(self, source: str, found: object):
        from .format import FORMAT_VERSION

        self.found = found
        #: False for a store of an older format (the trainer's next push with this dbsync
        #: rewrites it: a reader may wait for that), True for a newer or unknown one
        self.newer = not (isinstance(found, int) and not isinstance(found, bool)
                          and found < FORMAT_VERSION)
        if not self.newer:
            what = (f"it was written by an older dbsync in format {found} (release 0.{found}."
                    f"x); this dbsync (0.{FORMAT_VERSION}.x) reads format {FORMAT_VERSION}. "
                    "Upgrade the trainer: its next push with this release rewrites the store "
                    "and continues the version numbers (readers of this release wait for it); "
                    "or read it with the release that wrote it")
        else:
            what = (f"its format_version {str(found)[:20]} is not supported by this dbsync "
                    f"(it reads version {FORMAT_VERSION}); upgrade dbsync on this host")
        super().__init__(f"{source}: {what}")


class StoreNotFoundError(NothingPublishedError):
    """The store root does not exist (a typo, or a volume that is not mounted)."""


class _StoreOSError(DBSyncError, OSError):
    """A store error that is also the ``OSError`` it comes from: ``errno`` is set, and the
    message is the plain one (``OSError(code, text)`` would prefix it with ``[Errno N]``)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code

    def __reduce__(self) -> tuple:  # (errno too, across processes)
        return type(self), (str(self), self.errno)


class StoreUnreachableError(StoreNotFoundError, _StoreOSError):
    """The store's directory cannot be opened by this process: no permission (``EACCES``),
    or its mount is dead or hung (``ENOTCONN``: a FUSE daemon gone; ``ESTALE``, ``EIO``: an
    NFS server). Also an ``OSError`` with that ``errno``; often transient: a remounted store
    is read again by the next call."""


class StoreFullError(_StoreOSError):
    """A push did not fit on the store's filesystem (also an ``OSError``: ``errno`` is
    ENOSPC or EDQUOT). Nothing was published; the partial files were removed where the
    filesystem still allowed it."""


class StoreReadOnlyError(_StoreOSError):
    """The store's filesystem is read-only (also an ``OSError``: ``errno`` is EROFS), mounted
    so or remounted read-only after an error. Nothing was published."""


class ResourceLimitError(_StoreOSError):
    """This process ran out of something it needs (memory or address space, memory mappings,
    open files, threads): a limit of the process or host, not damage in the store. Nothing
    was applied and nothing is recorded against the version; raise the limit (the message
    names it) or free some, then try again. Also an ``OSError`` (``errno`` ENOMEM, EMFILE,
    ENFILE or EAGAIN)."""


#: errno -> what ran out, and the limit to look at
_RESOURCES = {
    errno.ENOMEM: "memory or address space (the `ulimit -v` limit, the container's memory "
                  "limit, or the `vm.max_map_count` limit on memory mappings)",
    errno.EMFILE: "open files (the `ulimit -n` limit of this process)",
    errno.ENFILE: "open files on this host (the `fs.file-max` limit)",
    errno.EAGAIN: "threads (the `ulimit -u` limit, or the container's pids.max)",
}


_NOT_DAMAGE = ("nothing is known to be damaged, and nothing was applied or recorded against "
               "the version")


def resource_limit(exc: BaseException, doing: str, outcome: str = _NOT_DAMAGE
                   ) -> ResourceLimitError | None:
    """The ``ResourceLimitError`` for ``exc`` if it says the process ran out of a resource
    (``MemoryError``, an ``OSError`` of ENOMEM / EMFILE / ENFILE, a thread that could not be
    started), else None. ``doing``: what failed, e.g. "opening version 3"."""
    if isinstance(exc, ResourceLimitError):
        return exc
    if isinstance(exc, MemoryError):
        code: int | None = errno.ENOMEM
    elif isinstance(exc, OSError):  # (not EAGAIN: a busy lock or socket says that too)
        code = exc.errno if exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE) else None
    elif isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        code = errno.EAGAIN
    else:
        return None
    what = _RESOURCES.get(code)  # type: ignore[arg-type]
    if what is None:
        return None
    return ResourceLimitError(
        f"{doing}: this process ran out of {what}; {outcome}: raise that limit or free some, "
        "then try again", code)


@contextlib.contextmanager
def resources_named(doing: str, outcome: str = _NOT_DAMAGE) -> Iterator[None]:
    """Turn running out of a resource inside the block into a ``ResourceLimitError`` that
    names the limit (see ``resource_limit``); other errors pass unchanged."""
    try:
        yield
    except (MemoryError, OSError, RuntimeError) as exc:
        named = resource_limit(exc, doing, outcome)
        if named is None or named is exc:
            raise
        raise named from exc


class StoreRewoundError(DBSyncError):
    """The manifest went backwards within one training run (a restored older copy)."""


class ReceiverRefusedError(DBSyncError):
    """A receiver refused or failed to apply a version (``wait_for_receivers`` fails fast)."""

    def __init__(self, message: str, refusals: dict[str, str] | None = None):
        super().__init__(message)
        #: reader id -> reason
        self.refusals: dict[str, str] = dict(refusals or {})


class StalenessError(DBSyncError):
    """``max_lag``: receivers stayed too many versions behind for longer than the timeout."""


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message (C++ errors from torch carry pages of
    stack frames after it), or the exception's type name when it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
