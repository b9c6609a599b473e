"""Sender: publish complete versions of a set of weights into a store.

push = collect and validate -> snapshot (when needed) -> wait until the free slot has no live
reader -> check free space -> stamp the slot "writing" -> parallel buffered writes into
preallocated shard files -> fsync -> index + slot stamp -> the flip (atomic head replace).

Guarantees (docs/FORMAT.md, each with a test): a push that fails or is killed at any point
leaves the previous version current and intact; a push that fails removes what it wrote (a
full disk stays as usable as before the push); the slot the head points to is never written;
versions increase by one per push, continuing after a writer restart, within one run id.

Hazards: one push runs at a time; a second ``push`` waits for the snapshot buffer that the push
before the previous one used. With ``durable=False`` (meant for same-host ``/dev/shm``), a
power loss may leave the current version pointing at incomplete data. A Sender holds the
store's writer lock until ``close()``; one dropped without ``close()`` releases it when it is
garbage-collected (in CPython, as soon as the last reference goes).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import logging
import math
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from . import fileio, gcpause, memlimit, sources, tensorstate
from .adapters import looks_like_an_adapter, refuse_unservable
from .errors import (
    DBSyncError,
    FormatError,
    InvalidArgumentError,
    InvalidWeightsError,
    SourceChangedError,
    StoreBusyError,
    StoreFullError,
    StoreReadOnlyError,
    StoreUnreachableError,
    check_flag,
    check_seconds,
    resource_limit,
    resources_named,
    short_repr,
)
from .format import (
    INDEX_FILE,
    MAX_VERSION,
    SHARD_BYTES,
    SLOTS,
    Head,
    dtype_name,
    plan_shards,
    shard_file,
)
from .leases import (
    DEFAULT_LEASE_TIMEOUT,
    LeaseMonitor,
    WaitShare,
    check_lease_timeout,
    prune_abandoned,
)
from .numbering import continue_from_store, refuse_newer_format
from .pushlayout import LayoutCache, PushLayout
from .sourcefiles import SourceFiles
from .staleness import wait_for_lag
from .status import printable, wait_for_receivers
from .store import HELD_SPACE, MOUNT_READ_ERRNOS, WRITING, Store, check_root_path

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
#: a running Sender looks for abandoned reader files (``prune_abandoned``) at most every
#: PRUNE_EVERY lease timeouts, and at most once per PRUNE_MIN_S seconds
PRUNE_EVERY = 4
PRUNE_MIN_S = 60.0
#: ``push`` accepts: an ``nn.Module``, a mapping of names to tensors, a ``TensorDict``, or a
#: path (``.safetensors`` file, checkpoint directory, ``.pt``/``.bin`` state dict, tensordict
#: memmap directory, PEFT adapter directory).
if TYPE_CHECKING:
    from tensordict import TensorDictBase

    Weights = torch.nn.Module | Mapping[str, torch.Tensor] | TensorDictBase | str | \
        os.PathLike[str]
else:
    Weights = Any


class PushInterrupted(KeyboardInterrupt):
    """Ctrl-C during a blocking ``push``. ``published_version`` is the version that was
    published anyway (the flip had already happened), or None: nothing was published."""

    def __init__(self, published_version: int | None):
        super().__init__()
        self.published_version = published_version


class _AnotherWriter(StoreBusyError):
    """Another writer published while this Sender's push ran (``Sender._check_head_unchanged``)."""


class _Ticket:
    """One submitted push's place in the count of pending pushes. Until the push starts,
    whoever withdraws it (its caller, interrupted while submitting; a cancellation) takes it
    out of the count, exactly once; once started, the push counts itself out. It holds the
    counter, not the Sender: a staging buffer keeps the future, and the Sender must still go
    by reference counting alone once dropped."""

    __slots__ = ("_lock", "_pending", "_state", "waiter")

    def __init__(self, lock: threading.Lock, pending: list[int], waiter: int | None = None):
        self._lock, self._pending, self._state = lock, pending, "new"
        #: the thread that waits for the push (a blocking push's caller), else None
        self.waiter = waiter

    def enter(self) -> None:
        """Count the push in (before it is submitted)."""
        with self._lock:
            self._pending[0] += 1
            self._state = "queued"

    def start(self) -> bool:
        """Called by the push as it starts: False if it was withdrawn (it must not run)."""
        with self._lock:
            if self._state == "withdrawn":
                return False
            self._state = "started"
            return True

    def withdraw(self) -> None:
        """Take a push that has not started out of the count (a started one counts itself)."""
        with self._lock:
            if self._state == "queued":
                self._state = "withdrawn"
                self._pending[0] -= 1

    def withdraw_if_cancelled(self, future: Future[int]) -> None:
        if future.cancelled():
            self.withdraw()


class _Aborted(DBSyncError):
    pass


class _HostBuffer:
    """A reusable host staging buffer (pinned when CUDA is available) that snapshots tensors
    so the caller may modify its weights as soon as ``push`` returns."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        #: (dtypes and shapes, views of ``_buf`` for them) of the last snapshot
        self._views: tuple[list, list[torch.Tensor]] | None = None
        #: the publish that reads this buffer (reuse waits for it)
        self.user: Future[int] | None = None

    def snapshot(self, pairs: sources.Pairs, dtype: torch.dtype | None) -> sources.Pairs:
        """Copy into the buffer, converting floating tensors to ``dtype`` during the copy (no
        converted second copy of the model on the GPU)."""
        dtypes = [sources.target_dtype(t, dtype) for _, t in pairs]
        sizes = [t.numel() * d.itemsize for (_, t), d in zip(pairs, dtypes, strict=True)]
        total = sum(fileio.aligned(n) for n in sizes)
        if self._buf is None or self._buf.numel() < total:
            pin = torch.cuda.is_available()
            self._buf = self._views = None
            memlimit.check_room(total, "snapshotting a background push into host memory",
                                "Nothing was published: push with blocking=True (it writes "
                                "from the weights themselves, with no copy)")
            self._buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        # The buffer's views are kept while the tensors keep their dtypes and shapes: making
        # them is most of a snapshot's Python work at tens of thousands of small tensors.
        layout = [(dt, t.shape) for (_, t), dt in zip(pairs, dtypes, strict=True)]
        if self._views is None or self._views[0] != layout:
            views, offset = [], 0
            for (dt, shape), size in zip(layout, sizes, strict=True):
                views.append(self._buf[offset : offset + size].view(dt).view(shape) if size
                             else torch.empty(shape, dtype=dt))
                offset += fileio.aligned(size)
            self._views = (layout, views)
        views = self._views[1]
        out: sources.Pairs = [(name, v) for (name, _), v in zip(pairs, views, strict=True)]
        targets = [v for v, size in zip(views, sizes, strict=True) if size]
        origins = [t for (_, t), size in zip(pairs, sizes, strict=True) if size]
        devices = {t.device for t in origins if t.is_cuda}
        # (one call: a background push's Python work runs beside it, see ``copy_all``)
        sources.copy_all(targets, origins, non_blocking=bool(devices))
        for device in devices:  # (every GPU the weights are spread over, not the current)
            torch.cuda.synchronize(device)
        return out


#: every Sender alive in this process (see ``_drop_inherited_locks``)
_LIVE_SENDERS: weakref.WeakSet[Sender] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child (a DataLoader worker, a multiprocessing process): close the child's
    copies of its parent's writer-lock descriptors at once. A ``flock`` lasts while any copy
    of the descriptor is open: a child that outlived a killed trainer kept the store locked,
    and the restarted trainer was refused for as long as the child lived."""
    for sender in list(_LIVE_SENDERS):
        fd, sender._lock_fd[0] = sender._lock_fd[0], None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


os.register_at_fork(after_in_child=_drop_inherited_locks)


#: the name prefix of a Sender's writer threads
_WRITER_THREADS = "dbsync-write"
#: seconds an exit waits quietly for pending background pushes before saying so, and the
#: most it waits for them (then they are abandoned before their flip: one waiting for a slot
#: that this very process's snapshot holds would never finish)
EXIT_QUIET_SECONDS = 5.0
EXIT_WAIT_SECONDS = 60.0


def _finish_background_pushes() -> None:
    """At interpreter exit, before the standard library's thread pools stop taking work:
    let background pushes still pending finish (a script whose last push was
    ``blocking=False`` and that never called ``close()`` lost that version: its writes were
    refused once the pools shut down). Bounded by ``EXIT_WAIT_SECONDS`` in all; past it, or
    on Ctrl-C, every pending push stops before its flip, and a WARNING says so."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for sender in list(_LIVE_SENDERS):
        if os.getpid() != sender._pid or sender._lock_fd[0] is None:
            continue
        _finish_pending_pushes(sender, deadline, "exiting", "at exit")


#: in a Sender's publisher thread, ``owner`` is that Sender's ``_publisher_token`` (a plain
#: object: the thread keeps no Sender alive)
_publisher_mark = threading.local()


def _mark_publisher_thread(token: object) -> None:
    _publisher_mark.owner = token


def _finish_pending_pushes(sender: Sender, deadline: float, who: str, when: str) -> None:
    """Wait for ``sender``'s pending pushes until ``deadline``; past it, or on Ctrl-C, stop
    them before their flip (nothing more is published) and say so. Never raises."""
    try:
        pending = sender._publisher.submit(int)  # (runs after every push queued before it)
    except RuntimeError:
        return
    if pending.done():
        return
    with sender._numbering:
        pushes = sender._pending[0]
    if pushes:  # (else the pool runs housekeeping only: waited for without a word)
        log.info("finishing the background push(es) into %s (%s)", sender.store.root, who)
    told = False
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                pending.result(timeout=max(0.0, min(left, EXIT_QUIET_SECONDS)))
                break
            except TimeoutError:
                if left <= EXIT_QUIET_SECONDS:
                    raise
                if not told:
                    told = True
                    log.warning("%s waits up to %.0f s more (%.0f s in all) for a background "
                                "push into %s to be published; it waits for readers or a lag "
                                "bound (Ctrl-C abandons it, publishing nothing)", who,
                                max(0.0, deadline - time.monotonic()), EXIT_WAIT_SECONDS,
                                sender.store.root)
    except BaseException as exc:  # (past the bound, or Ctrl-C: never raised from here)
        for abort in list(getattr(sender, "_live_aborts", ())):
            abort.set()
        log.warning("abandoned the background push(es) into %s %s (%s): nothing more was "
                    "published; it still serves %s", sender.store.root, when,
                    "interrupted" if isinstance(exc, KeyboardInterrupt) else
                    f"not done within {EXIT_WAIT_SECONDS:.0f} s",
                    f"version {sender._version}" if sender._version else "no version")


# (threading's exit hooks run newest first: this one before concurrent.futures' own, which
# was registered when this module imported it)
_register_exit_hook = getattr(threading, "_register_atexit", None)
if _register_exit_hook is not None:
    _register_exit_hook(_finish_background_pushes)


#: the Senders whose ``progress`` callback the current thread is running (a thread-local
#: mark: a pool's set of threads is filled only after a new thread has started working)
_in_progress = threading.local()


def _inside_progress_of(sender: object) -> bool:
    """Whether the current thread is running a ``progress`` callback of ``sender``'s push."""
    return any(other is sender for other in getattr(_in_progress, "senders", ()))


def _takes_progress_arguments(progress: Callable[..., Any]) -> bool:
    """Whether ``progress`` can be called as ``progress(bytes_done, bytes_total)`` (True when
    Python cannot tell, as for some builtins)."""
    try:
        inspect.signature(progress).bind(0, 0)
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def _release(lock_fd: list[int | None], pools: list[ThreadPoolExecutor], pid: int,
             store: Store) -> None:
    """Finalizer shared by ``close()`` and garbage collection (holds no Sender reference).
    It may run in a pool's own thread (the publisher dropping the last reference after a
    background push): that pool is shut down without waiting for itself. In a forked child
    it only closes its copies of the descriptors: unlocking would release the parent's
    lock (a ``flock`` belongs to the open file, which the child shares)."""
    if os.getpid() != pid:
        fd, lock_fd[0] = lock_fd[0], None
        if fd is not None:
            os.close(fd)
        store.unpin()
        return
    for pool in pools:
        try:
            pool.shutdown(wait=True)
        except RuntimeError:  # "cannot join current thread": its work is done
            pool.shutdown(wait=False)
    fd = lock_fd[0]
    if fd is not None:
        lock_fd[0] = None
        Store.unlock_writer(fd)
    store.unpin()


def _index_columns(pairs: sources.Pairs, places: list[tuple[int, int]]) -> dict[str, list]:
    """The index's tensor columns but ``range`` (see ``format.dump_index``)."""
    return {
        "name": [name for name, _ in pairs],
        "dtype": [dtype_name(t.dtype) for _, t in pairs],
        "shape": [list(t.shape) for _, t in pairs],
        "shard": [shard for shard, _ in places],
        "offset": [offset for _, offset in places],
    }


def refuse_if_rewritten(watched: SourceFiles | None) -> None:
    """Raise ``SourceChangedError`` if a file of the path pushed was rewritten in place since
    the push began reading it (its version could mix the old and new files' tensors)."""
    if watched is None:
        return
    changed = watched.changed()
    if changed:
        raise SourceChangedError(
            f"{watched.path} changed while it was being published ({', '.join(changed[:5])}"
            f"{' ...' if len(changed) > 5 else ''} rewritten in place); nothing was published. "
            "Push again once it is written; save checkpoints to a temporary name and rename "
            "them into place, so that a push never reads a file being written")


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the directory ``path`` names now (following symlinks), or None if
    it is gone. Other errors (ESTALE, EIO) are raised: they say nothing about which it is."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


class Sender:
    """Publishes versions into ``root``. One Sender per store (it takes the writer lock).

    ``num_threads``: parallel writers. ``dtype``: convert floating tensors (e.g.
    ``torch.bfloat16``; float8 tensors keep their dtype, as integers do). ``strategy``: how
    an ``nn.Module`` becomes names ("state_dict" or "tensordict"). ``durable``: fsync data and
    directories before the flip (default; turn off only for ``/dev/shm``). ``lease_timeout``:
    how long a reader that stopped heart-beating and states no timeout of its own may keep a
    slot. ``max_lag``: a push waits (up to
    ``max_lag_timeout`` seconds, then raises ``StalenessError``) while any live receiver that
    reports loads is more than ``max_lag`` versions behind the current version.
    ``reader_timeout``: the longest a push waits for live readers to release the slot it must
    write (then ``SlotHeldError``, nothing published); None (default) waits as long as they
    hold it, warning every minute (a reader that dies is waited out after its lease timeout).

    Hazards: a Sender belongs to the process that created it; a forked child's push raises,
    and the child drops its copy of the writer lock at once (a child outliving the trainer
    does not keep the store locked). An exception raised in the caller while a blocking push
    waits (Ctrl-C, a signal handler's) stops that push before its flip. A process started
    some other way that inherited the lock's descriptor (``subprocess`` with ``close_fds=False``
    and ``pass_fds``) keeps the store locked while it lives."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        num_threads: int = 8,
        dtype: torch.dtype | None = None,
        strategy: str = "state_dict",
        durable: bool = True,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        max_lag: int | None = None,
        max_lag_timeout: float | None = None,
        reader_timeout: float | None = None,
    ):
        sources.check_target_dtype(dtype, InvalidArgumentError)
        if strategy not in sources.STRATEGIES:
            raise InvalidArgumentError(f"strategy must be one of {sources.STRATEGIES}, not "
                                       f"{strategy!r}")
        if isinstance(num_threads, bool) or not hasattr(num_threads, "__index__") or (
                num_threads.__index__() < 1):
            raise InvalidArgumentError(f"num_threads must be an int of at least 1, not "
                                       f"{num_threads!r}")
        if max_lag is not None and not (isinstance(max_lag, int | float)
                                        and not isinstance(max_lag, bool) and max_lag >= 0):
            raise InvalidArgumentError(f"max_lag must be a number >= 0 (or None for no bound), "
                                       f"not {max_lag!r}")
        check_seconds(max_lag_timeout, "max_lag_timeout", none="wait as long as it takes")
        reader_timeout = check_seconds(reader_timeout, "reader_timeout",
                                       none="wait as long as readers hold it")
        check_flag(durable, "durable")
        check_lease_timeout(lease_timeout)
        check_root_path(root)
        refuse_newer_format(root)  # before anything is created or removed in it
        self.store = Store(root, create=True)
        # (pinned before it is locked: the lock and every later write are in the directory
        # ROOT names now, even once ROOT names another one)
        pinned = self.store.pin()
        try:
            lock_fd = self.store.lock_writer()
        except BaseException:
            self.store.unpin()
            raise
        self.dtype = dtype
        self.strategy = strategy
        self.durable = durable
        self.max_lag = max_lag
        self.max_lag_timeout = max_lag_timeout
        self.reader_timeout = reader_timeout
        self._lock_fd: list[int | None] = [lock_fd]
        #: the directory locked: pushes refuse to go on once ROOT names another one
        self._locked_root = (pinned.st_dev, pinned.st_ino)
        self._pid = os.getpid()
        self._io = ThreadPoolExecutor(num_threads.__index__(), thread_name_prefix=_WRITER_THREADS)
        self._publisher_token = object()
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="dbsync-publish",
                                             initializer=_mark_publisher_thread,
                                             initargs=(self._publisher_token,))
        self._finalizer = weakref.finalize(self, _release, self._lock_fd,
                                           [self._publisher, self._io], self._pid, self.store)
        _LIVE_SENDERS.add(self)
        try:
            self.store.remove_temp_files()
            #: ``_head_seen``: (run id, version) of the head as this Sender last saw it (its
            #: own last version once it published; None: none, or unreadable): another head
            #: means another writer (``_check_head_unchanged``)
            self._run_id, self._version, self._slot, self._head_seen = (
                continue_from_store(self.store))
        except BaseException:
            # Release now: the traceback (a notebook keeps the last one) still references
            # this half-built Sender, so garbage collection would not run for a long time.
            self._finalizer()
            raise
        self._kind: str | None = None
        self._lease_timeout = lease_timeout
        self._pruned_at = -math.inf
        self._prune_abandoned()
        self._leases = LeaseMonitor(self.store, lease_timeout)
        self._wait_share = WaitShare()  # (a WARNING when pushes mostly wait for readers)
        #: target shard size (bytes); the same weights always get the same layout
        self.shard_bytes = SHARD_BYTES
        self._buffers = (_HostBuffer(), _HostBuffer())
        self._next_buffer = 0
        self._layouts = LayoutCache()
        self._push_lock = threading.Lock()
        #: guards ``_version`` with ``_pending[0]`` (pushes submitted, not yet published or
        #: failed), which ``next_version`` adds up (in a list: a future's callback counts in
        #: it without holding the Sender)
        self._numbering = threading.Lock()
        self._pending = [0]
        #: cleared while a snapshot runs: background writes wait for it (see ``push``)
        self._writes_allowed = threading.Event()
        self._writes_allowed.set()
        #: the newest push's stop event (each push has its own: Ctrl-C while waiting for one
        #: push never stops another, such as a background push still writing)
        self._abort = threading.Event()
        #: the stop events of the pushes submitted and not yet ended
        self._live_aborts: set[threading.Event] = set()
        #: the error of the last push that failed (background pushes included), else None
        self.last_error: BaseException | None = None
        self.last_push_seconds: dict[str, float] = {}

    @property
    def root(self) -> str:
        return self.store.root

    def _check_root_unchanged(self) -> None:
        """Refuse to publish once ROOT is no longer the directory this Sender locked (removed
        and made anew by a new run, or a symlink re-pointed): another writer may hold the new
        one's lock, and numbering on from this Sender's versions would mix two runs."""
        fd = self._lock_fd[0]
        try:
            st = None if fd is None else os.fstat(fd)
        except OSError as exc:  # (ENOTCONN: a FUSE daemon killed; ESTALE: the file removed)
            raise DBSyncError(
                f"the lock this Sender holds on {self.store.root} cannot be reached any more "
                f"({exc.strerror or exc}: its mount was lost or remounted since it locked it); "
                "nothing was published. Another writer may hold the store now: close this "
                "Sender and create a new one to publish there") from None
        held = None if st is None else (st.st_dev, st.st_ino)
        try:
            now = _identity(self.store.root)
            lock = _identity(self.store.lock_path)
        except OSError:
            return  # (the push meets the same error where it matters, and says it)
        if now != self._locked_root or lock != held:  # (the lock's inode cannot be reused
            # while this Sender holds it open; a directory's can)
            where = "is gone" if now is None else "is another directory now"
            raise DBSyncError(
                f"{self.store.root} {where} (removed and made anew, or a symlink re-pointed) "
                "since this Sender locked it; nothing was published. Its lock guards the old "
                "directory, not this one: close this Sender and create a new one to publish "
                "there")

    def _moved_error(self) -> DBSyncError | None:
        """``_check_root_unchanged``'s error, or None: what a push's write error means when
        ROOT was removed (the pinned directory's files are gone) or now names another one."""
        try:
            self._check_root_unchanged()
        except DBSyncError as exc:
            return exc
        return None

    def _check_head_unchanged(self) -> None:
        """Refuse to publish when the head is no longer this Sender's last (another writer
        published meanwhile: two writers at once, where the writer lock does not keep them
        apart, such as through two mounts whose locks do not meet). Numbering on from a stale
        version would give one version number two contents. An unreadable head, or none, is
        left to the push."""
        try:
            head = self.store.read_head()
        except (DBSyncError, OSError):
            return
        if head is None or (head.run_id, head.version) == self._head_seen:
            return
        writer = head.writer if isinstance(head.writer, dict) else {}
        raise _AnotherWriter(
            f"another writer published version {head.version} into {self.store.root} (host "
            f"{printable(str(writer.get('host')))[:64]}, pid {writer.get('pid')}) since this "
            f"Sender's version {self._version}: two writers publish here at once, and the "
            "writer lock did not keep them apart (locks that do not meet across these mounts? "
            "docs/FORMAT.md, section 8). Nothing was published. Stop one of them; a new Sender "
            "continues from the store")

    @property
    def run_id(self) -> str:
        """Identity of this store's run: readers follow a new run instead of ignoring it."""
        return self._run_id

    def latest_version(self) -> int | None:
        head = self.store.read_head()
        return None if head is None else head.version

    @property
    def next_version(self) -> int:
        """The version the next push will publish, after those still pending (background
        pushes not yet published count as if they will be: one that fails leaves its number
        to the next)."""
        with self._numbering:
            return self._version + self._pending[0] + 1

    @overload
    def push(self, weights: Weights, blocking: Literal[True] = True,
             progress: Progress | None = None,
             adapter_config: dict[str, Any] | None = None) -> int: ...

    @overload
    def push(self, weights: Weights, blocking: Literal[False],
             progress: Progress | None = None,
             adapter_config: dict[str, Any] | None = None) -> Future[int]: ...

    def check_ready(self, kind: str = "weights") -> None:
        """Raise what ``push`` of a version of ``kind`` ("weights" or "adapter") would raise
        before it reads anything: this Sender closed or used from a forked child, or the store
        holding versions of the other kind. For a caller that acts on a push before making
        it (a broadcast sends the weights first): nothing is read or written here."""
        self._check_usable()
        self._check_kind(kind)

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise DBSyncError(
                f"this Sender was created in process {self._pid}, and this is a forked child "
                f"({os.getpid()}): its writer threads and the store's writer lock stay with "
                "the parent. Push from the parent, or create the Sender in the process that "
                "pushes (the parent's must be closed first: one writer per store)")
        if self._lock_fd[0] is None:
            raise DBSyncError("this Sender is closed; create a new one")

    def push(self, weights: Weights, blocking: bool = True,
             progress: Progress | None = None,
             adapter_config: dict[str, Any] | None = None) -> int | Future[int]:
        """Publish ``weights`` as the next version.

        ``blocking=True`` returns the new version (an int) once it is published (durable and
        flipped); Ctrl-C meanwhile raises ``PushInterrupted`` saying whether it was published.
        ``blocking=False`` returns a ``Future[int]`` as soon as the weights are snapshotted to
        host memory; the caller may then modify them. Errors in the background surface from
        ``future.result()``, in ``last_error`` and in the log. ``progress(bytes_done,
        bytes_total)`` is called from writer threads."""
        self._check_usable()
        check_flag(blocking, "blocking")
        if blocking and _inside_progress_of(self):
            raise DBSyncError("a blocking push was called from a push's progress callback, "
                              "which runs in the push's own writer threads: it would wait for "
                              "the push it runs in. Push after push() returns, or with "
                              "blocking=False")
        if progress is not None and not (callable(progress)
                                         and _takes_progress_arguments(progress)):
            raise InvalidArgumentError(f"progress must be a callable taking (bytes_done, "
                                       f"bytes_total), not {short_repr(progress)}; nothing "
                                       "was written")
        future: Future[int] | None = None
        try:
            with self._push_lock:
                with gcpause.paused():
                    # The same tensors as a recent push (names, addresses, dtypes, shapes...):
                    # already validated and planned; else validated here, before any I/O.
                    # (A background push writes the snapshot's tensors: looked up by the writer.)
                    # (before the path is read: what is read later is checked against it)
                    watched = (SourceFiles(os.fspath(weights))
                               if isinstance(weights, str | os.PathLike) else None)
                    pairs = sources.pairs_of(weights, self.strategy)  # dtype is applied below
                    if not pairs:
                        sources.validate(pairs)  # raises: nothing to publish
                    layout = None
                    if blocking:
                        layout = self._layouts.find([name for name, _ in pairs],
                                                    [t for _, t in pairs], self._layout_settings())
                    if layout is None:
                        sources.validate(pairs)
                adapter = (sources.plain_adapter_config(adapter_config)
                           if adapter_config is not None else sources.adapter_config_of(weights))
                self._check_kind("adapter" if adapter is not None else "weights")  # (early)
                if adapter is not None:  # (what holds whatever the model: before any I/O)
                    refuse_unservable(adapter, [(n, tuple(t.shape), t.dtype) for n, t in pairs])
                elif looks_like_an_adapter([n for n, _ in pairs]):
                    log.warning("every tensor pushed to %s is named as a PEFT LoRA weight "
                                "(base_model.model....lora_A/lora_B), but no adapter "
                                "configuration came with them: they are published as full "
                                "weights. To publish an adapter, push its directory "
                                "(adapter_config.json next to adapter_model.safetensors) or "
                                "pass adapter_config=", self.store.root)
                on_cpu = layout is not None or all(t.is_cpu for _, t in pairs)  # (kept: on CPU)
                needs_copy = not blocking or not on_cpu
                if needs_copy:
                    buffer = self._buffers[self._next_buffer]
                    self._next_buffer ^= 1
                    if buffer.user is not None:
                        # The push before the previous one may still read this buffer. Its error
                        # (if any) belongs to its own future, and was logged.
                        buffer.user.exception()
                    # The trainer waits for this copy: background writes of earlier versions
                    # pause meanwhile (after their current chunk) instead of competing with it.
                    self._writes_allowed.clear()
                    try:
                        with gcpause.paused():
                            pairs = buffer.snapshot(pairs, self.dtype)
                    finally:
                        self._writes_allowed.set()
                    refuse_if_rewritten(watched)
                    watched = None  # (copied whole: what happens to the files now is no matter)
                    layout = None  # the snapshot's own tensors, found by the writer
                else:
                    buffer = None
                    if layout is None:  # (a kept layout's tensors needed nothing)
                        with gcpause.paused():
                            pairs = sources.materialize_all(pairs, self.dtype)
                abort = self._abort = threading.Event()
                self._live_aborts.add(abort)
                ticket = _Ticket(self._numbering, self._pending,
                                 threading.get_ident() if blocking else None)
                try:
                    ticket.enter()
                    try:
                        future = self._publisher.submit(self._publish_and_report, not blocking,
                                                        ticket, pairs, progress, adapter, layout,
                                                        watched, abort)
                    except RuntimeError as exc:  # (shut down: close() from another thread won,
                        # or the interpreter is exiting)
                        named = resource_limit(exc, "starting the push's thread",
                                               "nothing was published")
                        if named is not None:  # (the process's thread limit)
                            raise named from None
                        if "interpreter shutdown" in str(exc) or sys.is_finalizing():
                            raise DBSyncError("the interpreter is exiting: no push can start "
                                              "now; nothing was published (push before the "
                                              "program ends)") from None
                        raise DBSyncError("this Sender was closed (by another thread) while "
                                          "this push waited its turn; nothing was published; "
                                          "create a new one") from None
                    future.add_done_callback(ticket.withdraw_if_cancelled)
                    if buffer is not None:
                        buffer.user = future
                except BaseException:
                    # Ctrl-C (or a signal handler's exception) inside the submit may land after
                    # the push was queued: it stops before its flip, and is counted out once.
                    abort.set()
                    ticket.withdraw()
                    raise
            if not blocking:
                return future
            return future.result()
        except BaseException as raised:
            if future is None:
                raise  # (nothing submitted; or withdrawn while submitting, above)
            if future.done() and not future.cancelled() and future.exception() is raised:
                raise  # the push's own failure
            # The caller's own exception while it waited: Ctrl-C, or one a signal handler
            # raised (preemption). The push stops before its flip, as for Ctrl-C: publishing
            # later, from tensors the caller may change once it has the exception, would
            # publish a mix.
            abort.set()
            exc = future.exception()
            published = None if exc is not None else future.result()
            if isinstance(raised, KeyboardInterrupt):
                raise PushInterrupted(published) from None
            raised.add_note(
                f"dbsync: this exception stopped a push into {self.store.root}: " + (
                    "nothing was published" if published is None else
                    f"version {published} had been published already"))
            raise

    def _gate(self, abort: threading.Event) -> None:
        """Called by writer threads before each write: waits while a snapshot runs, and
        stops an interrupted push's writes (Ctrl-C) instead of writing the rest."""
        self._writes_allowed.wait()
        if abort.is_set():
            raise _Aborted("push interrupted while writing; nothing was published")

    def _publish_and_report(self, background: bool, ticket: _Ticket, *args: Any) -> int:
        """``_publish``, recording its outcome in ``last_error`` and, for a background push
        (whose future nobody may ever read), logging its failure: both before the future
        completes, so its caller sees them as soon as it sees the result."""
        abort = args[-1]
        try:
            if not ticket.start():
                raise _Aborted("push interrupted while it was submitted; nothing was published")
            try:
                with resources_named(f"pushing into {self.store.root}",
                                     "nothing was published"):
                    version = self._publish(*args, waiter=ticket.waiter)
            except BaseException as exc:
                with self._numbering:
                    self._pending[0] -= 1
                self.last_error = None if isinstance(exc, _Aborted) else exc
                if background and self.last_error is not None:
                    # (WARNING: the caller gets the error from the future and may handle it,
                    # a full disk retried, say; ERROR is for what nobody handles)
                    log.warning("background push into %s failed: %s (raised by its future's "
                                "result(); also in last_error)", self.store.root, exc)
                raise
        finally:
            self._live_aborts.discard(abort)
        self.last_error = None
        with contextlib.suppress(RuntimeError):  # (shut down meanwhile: close() prunes nothing)
            self._publisher.submit(self._prune_abandoned)  # (after the push: never delays it)
        return version

    def _check_kind(self, kind: str) -> None:
        """A store holds one kind of version (full weights or LoRA adapters)."""
        current = self._kind
        if current is None:
            try:
                head = self.store.read_head()
            except (FormatError, OSError):
                head = None
            current = None if head is None else head.kind
        if current is not None and current != kind:
            raise InvalidWeightsError(
                f"{self.store.root} holds {current} versions; these are {kind}. A store holds "
                "one kind: publish them into another ROOT; nothing was written"
            )

    def _publish(self, pairs: sources.Pairs, progress: Progress | None,
                 adapter: dict[str, Any] | None, layout: PushLayout | None,
                 watched: SourceFiles | None, abort: threading.Event,
                 waiter: int | None = None) -> int:
        t0 = time.perf_counter()
        self._writes_allowed.wait()  # a snapshot of the next push runs: let it have the CPU
        lagged = wait_for_lag(self._leases, self._version, self.max_lag, self.max_lag_timeout,
                              abort, waiter, _Aborted)
        self._check_root_unchanged()
        version = self._version + 1
        if version > MAX_VERSION:
            raise DBSyncError(f"{self.store.root} is at version {self._version}, the highest a "
                              "store can name; nothing was published. Start a new run in a "
                              "fresh directory")
        slot = SLOTS[0] if self._slot is None else SLOTS[1 - SLOTS.index(self._slot)]
        waited = self._leases.wait_until_free(slot, stop=abort, waiter=waiter,
                                              timeout=self.reader_timeout)
        share = self._wait_share.add(waited, time.monotonic())
        if share is not None:
            log.warning("pushes to %s spent %.0f%% of the last %.0f s waiting for readers to "
                        "release the slot they write: slow readers set the push rate (`dbsync "
                        "status %s` names those the next push waits for; reader_timeout bounds "
                        "a wait)", self.store.root, 100 * share, self._wait_share.window,
                        self.store.root)
        if abort.is_set():
            raise _Aborted("push interrupted while waiting for readers; nothing was published")
        self._check_root_unchanged()  # (again: the wait may have been long)
        self._check_head_unchanged()
        # (again, in the one thread that publishes: a push checked while another of the
        # other kind was still pending, on an empty store, must not follow it)
        self._check_kind("adapter" if adapter is not None else "weights")
        t1 = time.perf_counter()

        with gcpause.paused():
            layout = layout or self._layout(pairs)
        sizes, shard_sizes = layout.sizes, layout.shard_sizes
        self._check_space(slot, shard_sizes)
        # From here on the slot is not a complete version: say so before touching its data.
        # (Not fsynced: after a power loss the head still names the other slot, and this
        # stamp only matters to live readers, which see it through the page cache or, on
        # NFS, at their next open.) On a full disk this first write already fails: the slot
        # then holds nothing usable either, and is freed like any failed push.
        try:
            self.store.write_stamp(slot, WRITING, None, durable=False)
            # Shards this layout does not use go first: the space check counted them as room
            # (a model whose shards are fewer than before fits where the old ones were).
            keep = {INDEX_FILE, *(shard_file(i) for i in range(len(shard_sizes)))}
            self.store.remove_slot_files(slot, keep)
            # The index is built while the shards are being fsynced: at tens of thousands of
            # tensors that Python work would otherwise add to the push.
            index = b""

            def make_index(checksums: list[str]) -> None:  # runs during the shards' fsyncs
                nonlocal index
                with gcpause.paused():
                    template = layout.index_template(
                        lambda: _index_columns(pairs, layout.places), adapter)
                    index = template.fill(self._run_id, version, checksums)

            self._write(slot, layout, progress, make_index, abort)
            refuse_if_rewritten(watched)  # (the files were read while the shards were written)
            t2 = time.perf_counter()
            self._check_head_unchanged()  # (before the index: the other writer's slot now?)
            self.store.write_index(slot, index, durable=self.durable)
            self.store.write_stamp(slot, version, self._run_id, durable=self.durable,
                                   sync_dir=False)
            if self.durable:
                self.store.sync_slot(slot)  # one directory fsync for the unlinks and replaces
            if abort.is_set():
                raise _Aborted("push interrupted before the flip; nothing was published")
        except BaseException as exc:
            if isinstance(exc, _AnotherWriter):
                raise  # (the slot's files may be the other writer's now: left alone)
            # (worded before the partial files are removed, which frees space and inodes)
            plain: BaseException | None = (
                self._moved_error() or self._plain_error(exc, version, sum(sizes),
                                                         "the partial files were removed")
                if isinstance(exc, OSError) else None)
            self._free_slot(slot)
            if plain is not None:
                raise plain from exc
            raise
        head = Head(
            run_id=self._run_id, version=version, slot=slot,
            kind="adapter" if adapter is not None else "weights",
            index_checksum=fileio.checksum(index), index_nbytes=len(index),
            created_at=time.time(), durable=self.durable, tensor_count=len(pairs),
            total_bytes=sum(sizes), writer={"host": socket.gethostname(), "pid": os.getpid()},
        )
        self._check_root_unchanged()  # (last: the write may have been long)
        self._check_head_unchanged()
        try:
            self.store.publish_head(head, durable=self.durable)
        except OSError as exc:
            if not self._flipped(head):
                plain = self._plain_error(exc, version, sum(sizes),
                                          "the previous version stays current")
                if plain is not None:
                    raise plain from exc
                raise
            # (the rename landed, its directory's fsync did not: readers see this version)
            log.warning("version %d of %s was published, but making the flip durable failed "
                        "(%s): a crash of the store's host may bring version %d back",
                        version, self.store.root, exc.strerror or exc, self._version)
        try:  # (after the flip: tells a head restored later from a writer that died first)
            self.store.write_published(slot, version, self._run_id)
        except OSError as exc:
            log.info("could not note in slot %s of %s that version %d was published (%s); "
                     "a head restored from an older copy may not be told apart",
                     slot, self.store.root, version, exc.strerror or exc)
        with self._numbering:  # (published: counted in _version, no longer pending)
            self._version, self._slot, self._kind = version, slot, head.kind
            self._head_seen = (self._run_id, version)
            self._pending[0] -= 1
        t3 = time.perf_counter()
        self.last_push_seconds = {"wait_for_lag": lagged, "wait_for_readers": waited,
                                  "write": t2 - t1, "flip": t3 - t2, "total": t3 - t0}
        log.debug("published version %d into slot %s of %s: %d tensors, %d bytes, %.3f s "
                  "(waited %.3f s for readers)", version, slot, self.store.root, len(pairs),
                  sum(sizes), t3 - t0, waited)
        return version

    def _prune_abandoned(self) -> None:
        """Remove the files of readers gone for good (``prune_abandoned``: leases and temp
        files of readers killed mid-write), at start and then at most every
        ``PRUNE_EVERY`` lease timeouts (a long-lived trainer would otherwise list them at
        every push for as long as it lives)."""
        now = time.monotonic()
        if now - self._pruned_at < max(PRUNE_MIN_S, PRUNE_EVERY * self._lease_timeout):
            return
        self._pruned_at = now
        try:
            prune_abandoned(self.store, self._lease_timeout)
        except (OSError, FormatError) as exc:
            log.info("could not look for abandoned reader files in %s: %s", self.store.root,
                     exc)
        except Exception:  # (a bug here must not fail a push or the start of a Sender)
            log.exception("looking for abandoned reader files in %s failed", self.store.root)

    def _flipped(self, head: Head) -> bool:
        """Whether the store's head is ``head`` (read back after a failed head write)."""
        try:
            now = self.store.read_head()
        except (OSError, DBSyncError):
            return False
        return now is not None and (now.run_id, now.version) == (head.run_id, head.version)

    def _plain_error(self, exc: OSError, version: int, nbytes: int, after: str
                     ) -> OSError | None:
        """A full or read-only store's write error ``exc`` as one that says what happened and
        what to do (``after``: what became of the partial version, when the store was full);
        None for other errors (raised as they are)."""
        if isinstance(exc, DBSyncError):
            return None  # (said plainly already)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            what, todo = self.store.what_ran_out(exc.errno)
            return StoreFullError(
                f"{what} while writing version {version} ({nbytes} bytes); nothing was "
                f"published and {after}. {todo}, then push again", exc.errno)
        if exc.errno == errno.EROFS:
            return StoreReadOnlyError(
                f"the filesystem of {self.store.root} is read-only (mounted so, or remounted "
                f"read-only after an error: see the kernel log) while writing version {version}; "
                "nothing was published. Make it writable, then push again", exc.errno)
        if exc.errno in MOUNT_READ_ERRNOS:  # (EIO, ESTALE: a write the mount or disk failed)
            return StoreUnreachableError(
                f"{self.store.root}: {exc.strerror or exc} while writing version {version}: "
                f"the store's mount or disk failed a write; nothing was published and "
                f"{after}. Check the mount (and the kernel log), then push again", exc.errno)
        return None


    def _check_space(self, slot: str, shard_sizes: list[int]) -> None:
        """Refuse before writing anything if the new shards cannot fit (files reused in place
        count with their current size)."""
        try:
            have = self.store.slot_file_sizes(slot)
            free = self.store.free_bytes()
        except OSError:
            return  # cannot tell here: the writes themselves will say
        need = sum(max(0, size - have.get(shard_file(i), 0)) for i, size in
                   enumerate(shard_sizes))
        reclaim = sum(n for name, n in have.items() if name.startswith("shard-") and name not in
                      {shard_file(i) for i in range(len(shard_sizes))})
        if need > free + reclaim:
            version_bytes = sum(shard_sizes)
            try:
                st = os.statvfs(self.store.root)
                capacity = st.f_blocks * st.f_frsize
            except OSError:
                capacity = 0
            two = ""
            if capacity and 2 * version_bytes > capacity:
                # (the other slot holds the current version while this one is written)
                two = (f" A store keeps two versions (the current one is served while the next "
                       f"is written): it needs about {2 * version_bytes} bytes, and this "
                       f"filesystem holds {capacity} in all. Give the store a larger "
                       "filesystem, or publish in a smaller dtype.")
            raise StoreFullError(
                f"version {self._version + 1} needs {need} more bytes in {self.store.root} but "
                f"its filesystem has {free} free; nothing was written." + (two or (
                    " Free space there (or publish in a smaller dtype), then push again"
                    + HELD_SPACE)),
                errno.ENOSPC)

    def _free_slot(self, slot: str) -> None:
        try:  # (first: a stamp naming a version that was never flipped to would make the
            # next writer number past it, taking the head for one restored from a backup)
            self.store.write_stamp(slot, WRITING, None, durable=False)
        except OSError as exc:
            log.info("could not mark slot %s of %s as free: %s", slot, self.store.root, exc)
            if exc.errno == errno.EROFS:
                try:
                    untouched = self.store.read_stamp(slot)[0] not in (WRITING, None)
                except (OSError, FormatError):
                    untouched = False
                if untouched:  # (read-only before the push's first write: the slot still
                    # holds the older version it is stamped with, and nothing can be removed)
                    return
        try:
            freed = self.store.remove_slot_files(slot)
            log.info("push into %s failed: removed %d bytes of partial files from slot %s",
                     self.store.root, freed, slot)
        except OSError as exc:
            log.warning("push into %s failed and its partial files in slot %s could not be "
                        "removed: %s", self.store.root, slot, exc)

    def _layout_settings(self) -> tuple[Any, ...]:
        return (self.shard_bytes, self.dtype)

    def _layout(self, pairs: sources.Pairs) -> PushLayout:
        """The kept layout of these tensors, or a new one (kept for the next pushes)."""
        names = [name for name, _ in pairs]
        tensors = [t for _, t in pairs]
        layout = self._layouts.find(names, tensors, self._layout_settings())
        if layout is not None:
            return layout
        tensor_states = tensorstate.States.of(tensors)
        if tensor_states is None or not tensor_states.all_cpu_contiguous:
            raise ValueError("the writer needs contiguous CPU tensors")  # pragma: no cover
        sizes = [t.nbytes for t in tensors]
        places, shard_sizes = plan_shards(sizes, self.shard_bytes)
        layout = PushLayout.build(names, tensor_states, self._layout_settings(), places,
                                  shard_sizes, sizes)
        self._layouts.add(layout)
        return layout

    def _write(self, slot: str, layout: PushLayout, progress: Progress | None,
               while_syncing: Callable[[list[str]], None], abort: threading.Event) -> None:
        """Write and fsync every shard; ``while_syncing(checksums)`` (every checked range's,
        in order) runs while the last batch of shards is being fsynced."""
        shard_sizes = layout.shard_sizes
        on_bytes = None
        if progress is not None:
            total, done, lock = sum(layout.sizes), [0], threading.Lock()

            def on_bytes(n: int) -> None:
                with lock:
                    done[0] += n
                    _in_progress.senders = (*getattr(_in_progress, "senders", ()), self)
                    try:
                        progress(done[0], total)
                    finally:
                        _in_progress.senders = _in_progress.senders[:-1]

        # Shards are written in batches (bounded open files, ``fileio.SHARDS_OPEN_AT_ONCE``).
        # Tensors fill shards in order, so a batch of shards is a run of tensors.
        checksums: list[str] = []
        for first, last, batch in layout.batches:
            fds: list[int] = []
            try:
                for shard in range(first, last):
                    fds.append(self.store.open_shard_for_write(slot, shard, shard_sizes[shard]))
                last_batch = last == len(shard_sizes)
                checksums += fileio.write_shards(
                    fds, batch, self._io, self.durable, on_bytes,
                    (lambda sums, before=checksums: while_syncing(before + sums)) if last_batch
                    else None, gate=functools.partial(self._gate, abort))
            finally:
                for fd in fds:
                    os.close(fd)
        if not shard_sizes:  # nothing to write (an empty version)
            while_syncing([])

    def wait_for_receivers(self, version: int, count: int, timeout: float | None = None
                           ) -> bool:
        """Wait until at least ``count`` receivers report ``version`` (or newer) loaded;
        False on timeout. Raises ``ReceiverRefusedError`` at once if a receiver refused or
        failed to apply it."""
        return wait_for_receivers(self.store, version, count, timeout)

    def close(self) -> None:
        """Finish the pending pushes (their errors stay in their futures), release the writer
        lock. Waits ``EXIT_WAIT_SECONDS`` at most: a push still waiting then (for receivers to
        catch up under ``max_lag``, or for a slot a reader holds) is abandoned before its flip
        (nothing published; a WARNING says so), as on Ctrl-C here. Not from a ``progress``
        callback (a writer thread of the push it would wait for)."""
        if _inside_progress_of(self):
            raise DBSyncError("Sender.close() was called from a push's progress callback, which "
                              "runs in the push's own writer threads and would wait for "
                              "itself; raise an exception there to stop the push, and close "
                              "the Sender from the thread that called push()")
        if (self._finalizer.alive and os.getpid() == self._pid
                and getattr(_publisher_mark, "owner", None) is not self._publisher_token):
            # (bounded: a push waiting for a lag bound or a held slot may never finish)
            _finish_pending_pushes(self, time.monotonic() + EXIT_WAIT_SECONDS, "close()",
                                   "by close()")
        self._finalizer()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise DBSyncError(
            f"a Sender cannot be pickled or copied (it holds {self.store.root}'s writer lock, "
            "threads and staging buffers of this process): create one in the process that "
            "publishes, from the store's path (with several processes, in one of them)")
