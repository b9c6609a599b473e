"""Receiver: load exactly one complete, verified version from a store.

``load(target)``: lease the current version's slot -> map its shards -> check every checksum
-> only then hand the tensors over (``load_weights(pairs)``, or a parallel copy into a plain
``nn.Module`` / dict of tensors) -> check the slot was not reused meanwhile -> record the
loaded version (its acknowledgement).

Read-only views (``mount -o ro``, Kubernetes ``ReadOnlyMany``, a directory this user cannot
write) need no lease: the receiver reads a private copy of every shard with ``preadv`` and
verifies the copy (checksums and the slot stamp) before anything is handed over, so a writer
reusing the slot meanwhile costs a retry, never a torn apply. The same happens whenever a lease
cannot be written (a full disk): loads go on, leaseless, and say so in the log.

Hazards, stated plainly:
- Tensors handed to ``load_weights`` are views of the slot's shards (a mapping when leased, a
  private copy otherwise). They are valid only until ``load`` returns: copy what you keep.
- Verification reads every byte once before the apply (a damaged version never reaches
  ``load_weights``); the apply then reads from the page cache. ``verify=False`` skips it and
  relies on the slot stamp and sizes alone.
- Leaseless loads hold one private host copy of the version while they run.
- A receiver keeps one heartbeat thread (a small file write every ``lease_timeout / 4``) so the
  writer and ``dbsync status`` can tell it is alive; ``close()`` (or garbage collection) stops
  it and removes the lease.
"""


from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import gcpause
from .copyplan import PlanCache
from .errors import (
    DamagedVersionError,
    DBSyncError,
    FormatError,
    IncompatibleWeightsError,
    InvalidArgumentError,
    LeaseExpiredError,
    ReaderIdInUseError,
    StoreNotFoundError,
    StoreRewoundError,
    StoreUnreachableError,
    UnsupportedFormatError,
    check_flag,
    check_int,
    check_seconds,
    resources_named,
    short_repr,
)
from .format import (
    MAX_STAMP_BYTES,
    MAX_VERSION,
    SLOT_STAMP_FILE,
    SLOTS_DIR,
    Head,
    Manifest,
    check_reader_id,
    is_run_id,
    is_tensordict,
)
from .leasekeeper import LeaseKeeper
from .leases import (
    DEFAULT_LEASE_TIMEOUT,
    NO_STAMP,
    ReaderIdInUse,
    check_lease_timeout,
    claim_reader_id,
    default_reader_id,
    note_loader,
    release_reader_id,
)
from .snapshot import LeaseNotRenewed, SlotReused, Snapshot
from .store import Store, rereads
from .workers import WorkerPools

if TYPE_CHECKING:
    from .watch import Watcher

log = logging.getLogger(__name__)

__all__ = ["LoadWeights", "Receiver", "Snapshot"]

LoadWeights = Callable[[Iterable[tuple[str, Any]]], Any]
_LEASELESS_RETRIES = 5
#: ``wait(timeout=...)`` threads one receiver may have blocked on a hung mount at once
WAIT_THREADS = 8
#: how long past its deadline a timed wait's thread may take to return before it is given up
_WAIT_GRACE_S = 2.0
#: head records a receiver keeps of versions it opened or waited for (the newest)
KEPT_HEADS = 4


_OVERLAY_CHECKED: set[str] = set()  # roots this process looked at (receivers come per swap)


def _warn_if_under_an_overlay(root: str) -> None:
    """Warn once per root and process if ``root`` is reached through an overlay whose lower
    layer (where it is visible here) holds the store."""
    from .watch import store_in_overlay_lower

    if root in _OVERLAY_CHECKED:
        return
    _OVERLAY_CHECKED.add(root)
    lower = store_in_overlay_lower(root)
    if lower is not None:
        log.warning(
            "%s is reached through an overlay filesystem whose lower layer %s holds the store: "
            "what a trainer writes there is not reliably seen through the overlay (the kernel "
            "leaves changes to a lower layer undefined; versions may be missed or refused as "
            "damaged), and this reader's lease lands in the overlay's upper layer, where the "
            "trainer never sees it. Mount the store directory itself (a bind mount or a "
            "volume)", root, lower)


def _check_applied(snap: Snapshot) -> None:
    """``check_unchanged`` after a callable target was applied: a slot reused meanwhile is
    ``LeaseExpiredError`` for the caller to load again (the target is called once per load,
    so it is not read again here, as it is when the check fails before the apply)."""
    try:
        snap.check_unchanged()
    except SlotReused as exc:
        raise LeaseExpiredError(str(exc)) from None


class Receiver:
    """Reads versions from ``root``, which must exist (a typo is an error, not a new empty
    store to wait on forever). Registers itself (a lease file) on construction, so the writer
    and ``dbsync status`` see it; ``close()`` removes it. On a read-only view it works without
    a lease (see the module docstring); ``read_only=True`` forces that mode."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        reader_id: str | None = None,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        verify: bool = True,
        poll_interval: float | None = None,
        report_loaded: bool = True,
        read_only: bool | None = None,
    ):
        check_flag(read_only, "read_only", none="decided from the store's mount")
        check_flag(verify, "verify")
        check_flag(report_loaded, "report_loaded")
        self.store = Store(root, create=False)
        self.reader_id = check_reader_id(reader_id or default_reader_id(),
                                         InvalidArgumentError)
        self.lease_timeout = check_lease_timeout(lease_timeout)
        self.verify = verify
        self.poll_interval = check_seconds(poll_interval, "poll_interval",
                                           none="the default, 1 s on network filesystems")
        #: False for helper readers (e.g. a worker staging broadcasts) whose loads must not be
        #: counted as an engine serving the version (``dbsync status``, wait_for_receivers).
        self.report_loaded = report_loaded
        self.loaded_version: int | None = None
        self.loaded_run_id: str | None = None
        self.loaded_at: float | None = None
        self._heads: dict[int, Head] = {}
        self._heads_lock = threading.Lock()
        #: the last plan of ``load(module or dict)``, reused load after load of one model
        self.copy_plans = PlanCache()
        #: names of the last target that the version lacks because each is tied to a
        #: published one ({name: published twin}; checked again at every load)
        self._tied_names: dict[str, str] = {}
        self._tokens = itertools.count(1)
        #: token -> the open snapshot holding it, and the tokens of opens under way (holds
        #: in neither are orphans: see ``_release_orphans``)
        self._snapshots: weakref.WeakValueDictionary[int, Snapshot] = (
            weakref.WeakValueDictionary())
        self._opening: set[int] = set()
        self._keeper = LeaseKeeper(self.store, self.reader_id, self.lease_timeout,
                                    report_loaded)
        _warn_if_under_an_overlay(self.store.root)
        #: the store is on a network or FUSE mount (read errors happen there: leased
        #: snapshots verify by reading, never by touching their mappings; see
        #: ``Snapshot.verify``)
        self.on_network_mount = _on_network_mount(self.store.root)
        #: whether it is leaseless for want of permission (not a read-only mount)
        self._lease_denied = False
        self.read_only = self._decide_read_only(read_only)
        #: whether a receiver that found the store read-only looks again at each open (a
        #: statvfs and an access check: microseconds), to register once it can write
        self._may_register = read_only is None and self.read_only
        self._registering = threading.Lock()
        if not self.read_only:
            self._register()
        #: worker threads kept from one load to the next (see ``workers``)
        self.workers = WorkerPools("dbsync-read")
        self._closed = threading.Event()
        self._told_older_format = False  # (an older-format head is logged once)
        self._closing = threading.Lock()
        self._waits: set[threading.Event] = set()  # events of the wait() calls under way
        #: threads that ``wait(timeout=...)`` may have blocked on a hung mount at once
        self._wait_threads = threading.BoundedSemaphore(WAIT_THREADS)
        self._watchers: weakref.WeakSet[Any] = weakref.WeakSet()  # started by watch()
        self._finalizer = weakref.finalize(self, _close_parts, self._keeper, self.workers)

    def _register(self) -> None:
        """Claim the reader id, write the lease and start its heartbeat."""
        try:
            self._keeper.claim = claim_reader_id(self.store, self.reader_id)
        except ReaderIdInUse as exc:
            raise ReaderIdInUseError(
                f"reader id {self.reader_id!r} is in use in {self.store.root}: {exc}. Two "
                "receivers sharing an id overwrite each other's lease, and the writer may "
                "then reuse a slot one of them still reads: give each receiver its own "
                "reader_id (or leave it unset for a unique one)") from None
        try:
            with resources_named(f"starting reader {self.reader_id} of {self.store.root}",
                                 "nothing was registered"):
                self._keeper.write()
                self._keeper.start()
        except BaseException:
            release_reader_id(self._keeper.claim)
            raise

    def _register_if_writable(self) -> None:
        """A receiver that started on a store it could not write (remounted read-only for a
        while, ``readers/`` with the wrong permissions until an operator fixed them) looks
        again now and then, and registers once it can: the writer then sees it and its
        loads count."""
        if not self._may_register or not self._registering.acquire(blocking=False):
            return
        try:
            if not self._may_register or not self.store.writable():
                return
            try:
                self._register()
            except (OSError, DBSyncError) as exc:
                self._may_register = False
                log.info("%s is writable again but reader %s could not register (%s); it "
                         "goes on without a lease", self.store.root, self.reader_id, exc)
                return
            self._may_register = False
            self.read_only = False
            self._lease_denied = False
            log.info("%s is writable now: reader %s registered (a lease, loads acknowledged)",
                     self.store.root, self.reader_id)
        finally:
            self._registering.release()

    def _decide_read_only(self, forced: bool | None) -> bool:
        if forced is not None:
            return forced
        if not os.path.isdir(self.store.readers_dir):
            try:  # a store created before its first push by an older writer, or by hand
                self.store.create_readers_dir()
            except (OSError, FormatError):
                pass
        if self.store.writable():
            return False
        if self.store.mounted_read_only():
            log.info("%s is read-only for this process: reader %s loads without a lease "
                     "(private verified copies) and cannot acknowledge loads", self.store.root,
                     self.reader_id)
        else:  # no permission: more often a mistake than a read-only view by design
            self._lease_denied = True
            log.warning("reader %s may not write its lease in %s: it loads without a lease "
                        "(private verified copies), cannot acknowledge loads, and the trainer "
                        "does not see it (wait_for_receivers, max_lag, `dbsync status`). %s",
                        self.reader_id, self.store.root,
                        self.store.why_lease_unwritable(self.reader_id))
        return True

    # ---- public -------------------------------------------------------------------------
    def store_problem(self) -> str | None:
        """Why this receiver cannot follow its store, as its last lease write found (every
        ``lease_timeout / 4`` seconds), or None. Touches no file: safe to call from an event
        loop while the store hangs. A read-only view (no lease by design) is no problem."""
        if self._keeper.conflict is not None:
            return self._keeper.conflict
        error = self._keeper.error
        if error is None and self.read_only and self._lease_denied:
            error = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        if error is None or error.errno == errno.EROFS:
            return None
        if error.errno in (errno.EACCES, errno.EPERM):
            return (f"this receiver (uid {os.geteuid()}) may not write its lease in "
                    f"{self.store.readers_dir} ({error.strerror or error}): it reads without a "
                    "lease, and the trainer does not see it (wait_for_receivers, max_lag, "
                    "`dbsync status`); the log says how to let it")
        if error.errno == errno.ENOENT:
            return (f"{self.store.root} is missing, or has no readers/ directory (removed or "
                    "unmounted?)")
        return (f"cannot write this reader's lease in {self.store.root} "
                f"({error.strerror or error}): the trainer does not see it")

    def latest_version(self) -> int | None:
        """The current version per the head, without loading anything (reads a small file)."""
        head = self.store.read_head()
        return None if head is None else head.version

    def manifest(self) -> Manifest:
        return self.store.require_manifest()

    def open(self, version: int | None = None, head: Head | None = None) -> Snapshot:
        """Hold and open the current version, or ``version`` if this receiver opened it before,
        or the version ``head`` names (a head record kept by another process, e.g. a rollback
        target), provided its slot still holds it. Use ``with receiver.open() as snap:``.

        Raises ``StoreRewoundError`` if the head went backwards within one run (a restored
        older copy); a new run id is followed (logged) instead."""
        self._check_open()
        check_int(version, "version", 1, none="the current version")
        self._register_if_writable()
        self._release_orphans()
        if head is not None:
            version = head.version
            self._remember(head)
        for _ in range(100):
            head = self._target_head(version)
            token = next(self._tokens)
            self._opening.add(token)
            try:  # (the hold inside: an interrupt while its lease is written leaks nothing)
                leased = not self.read_only and self._keeper.hold(token, head.slot,
                                                                  head.version, head.run_id)
                if version is None and leased:
                    # If the head still names our version after our lease is visible, the
                    # writer cannot start on this slot without first seeing the lease.
                    again = self.store.read_head()
                    if again is None or (again.run_id, again.version) != (head.run_id,
                                                                          head.version):
                        self._keeper.release(token)
                        continue
                manifest = self.store.manifest_in_slot(head.slot, head)
                if manifest is None:
                    self._keeper.release(token)
                    if version is not None:
                        raise self._gone(version)
                    continue
                snap = Snapshot(self, manifest, token, leased)
                self._snapshots[token] = snap
            except SlotReused:  # (a shard the writer replaced meanwhile: NFS's ESTALE)
                self._keeper.release(token)
                if version is not None:
                    raise self._gone(version) from None
                self._check_head_moved(head)
                continue
            except BaseException:
                self._keeper.release(token)
                raise
            finally:
                self._opening.discard(token)
            try:
                snap.check_unchanged()
            except LeaseNotRenewed:  # (this process stalled: not the slot's doing)
                snap.close()
                raise
            except LeaseExpiredError:  # (SlotReused too) the slot is stamped otherwise
                snap.close()
                if version is not None:
                    raise self._gone(version) from None
                self._check_head_moved(head)
                continue
            except BaseException:
                snap.close()
                raise
            self._remember(head)
            return snap
        if not leased:  # (copies the writer spoiled, one after another)
            raise DBSyncError(
                f"the head of {self.store.root} changed 100 times while opening: each time "
                "the writer published, or reused the slot being read, before this reader had "
                "copied it. A reader without a lease (this one may not write "
                f"{self.store.readers_dir}) cannot keep the writer off its slot: let it write "
                "there (it then leases and maps instead of copying), or publish less often")
        raise DBSyncError(f"the head of {self.store.root} changed 100 times while opening; "
                          "is a writer publishing in a tight loop? Publish less often")

    def _remember(self, head: Head) -> None:
        """Keep ``head`` for a later ``open(version)``/``wait(newer_than)`` of its version:
        the few newest only (two slots hold two versions; a receiver lives for days)."""
        with self._heads_lock:  # (threads sharing this receiver open and wait at once)
            self._heads.pop(head.version, None)
            self._heads[head.version] = head
            while len(self._heads) > KEPT_HEADS:
                self._heads.pop(next(iter(self._heads)))

    def _check_head_moved(self, head: Head) -> None:
        """After a read found ``head``'s slot stamped otherwise: fine (read again)
        if the head moved on, as it does before a writer reuses a slot; if it still names that
        version over the looks a caching mount needs (``store.rereads``), the slot's stamp
        is missing or damaged, and reading again cannot help."""
        for _ in rereads():  # (a caching mount can show head and stamp of different moments)
            again = self.store.read_head()
            if again is None or (again.run_id, again.version) != (head.run_id, head.version):
                return
            stamp = self.store.read_stamp(head.slot, absent=NO_STAMP)
            if stamp == (None, None):
                self._check_stamp_readable(head.slot)
                return  # not readable then, readable now (a passing I/O error): again
            if stamp == (head.version, head.run_id):
                return  # stamped right after all: again
        if stamp is NO_STAMP:
            stamp = (None, None)
        path = os.path.join(self.store.slot_dir(head.slot), SLOT_STAMP_FILE)
        why = (f"its stamp ({path}) is missing or unreadable" if stamp == (None, None) else
               f"its stamp ({path}) names version {str(stamp[0])[:40]} of run "
               f"{str(stamp[1])[:40]}")
        error = DamagedVersionError(
            f"version {head.version} in {self.store.root}: the head names slot {head.slot}, but "
            f"{why}, and the head did not move on (a writer reusing the slot would first have "
            "flipped it away): the stamp is missing or damaged. Nothing was applied. Run "
            f"`dbsync verify {self.store.root}` and publish again from the trainer",
            {"<slot stamp>": why})
        error.version = head.version  # (refused by callers as a damaged version is)
        raise error

    def _check_stamp_readable(self, slot: str) -> None:
        """Raise ``StoreUnreachableError`` if ``slot``'s stamp stays unreadable through its
        mount (ESTALE, EIO) for ~1.3 s: opening again and again could not help (it ended in
        "the head changed 100 times" before)."""
        failure: StoreUnreachableError | None = None
        for _ in rereads():
            try:
                self.store.read_record((SLOTS_DIR, slot, SLOT_STAMP_FILE), MAX_STAMP_BYTES)
                return
            except StoreUnreachableError as exc:
                failure = exc
            except (OSError, FormatError):
                return  # (the next look says what it is)
        assert failure is not None
        raise failure

    def _gone(self, version: int) -> DBSyncError:
        return DBSyncError(f"version {version} is no longer held in {self.store.root} (the "
                           "writer reused its slot); open the current version instead")

    def _target_head(self, version: int | None) -> Head:
        if version is not None:
            head = self._heads.get(version)
            current = self.store.read_head()
            if current is not None and current.version == version:
                head = current
            if head is None:
                if current is None or version > current.version:
                    latest = "none yet" if current is None else f"the latest is {current.version}"
                    raise DBSyncError(f"version {version} is not published in "
                                      f"{self.store.root} ({latest}); open the current version "
                                      "(open() without a version)")
                raise self._gone(version)
            return head
        head = self.store.read_head()
        if head is None:
            error = self.store.nothing_published()
            if self.loaded_version is not None and not isinstance(error, StoreNotFoundError):
                error = StoreNotFoundError(
                    f"{self.store.root} no longer holds a published version (this receiver "
                    f"loaded version {self.loaded_version} from it): the store was removed, "
                    "its volume unmounted (the path now shows the directory under the mount), "
                    "or a new run is starting there. Check the mount before pushing there")
            raise error
        if head.run_id == self.loaded_run_id and self.loaded_version is not None and (
                head.version < self.loaded_version):
            raise StoreRewoundError(
                f"{self.store.root} went back from version {self.loaded_version} to "
                f"{head.version} within run {head.run_id}: its head was restored from an older "
                "copy. Nothing was loaded. Publish a new version from the trainer (or start a "
                "new run in a fresh directory)"
            )
        if self.loaded_run_id is not None and head.run_id != self.loaded_run_id:
            log.info("%s holds a new run (%s, version %d; was %s, version %s): following it",
                     self.store.root, head.run_id, head.version, self.loaded_run_id,
                     self.loaded_version)
        return head

    def load(self, target: LoadWeights | Any, verify: bool | None = None,
             threads: int = 8) -> int:
        """Apply the latest complete version, after verifying it, and return that version.

        ``target``: a ``load_weights`` callable (called once with an iterable of (name,
        tensor) in manifest order), or a plain ``nn.Module`` / dict of tensors / TensorDict
        (copied into in place, in ``threads`` parallel threads, names and shapes checked
        first; see ``Snapshot.copy_into``)."""
        self._check_open()
        _check_target(target)
        check_flag(verify, "verify", none="the receiver's own setting")
        check_int(threads, "threads", 1)
        verify = self.verify if verify is None else verify
        with resources_named(f"loading from {self.store.root}",
                             "nothing is known to be damaged and nothing was recorded against "
                             "the version (tensors being copied into when it came may hold "
                             "parts of two versions until the next load)"):
            if callable(target) and not _is_tensor_container(target):
                return self._load(target, verify, threads)  # the callback's objects: not ours
            with gcpause.paused():
                return self._load(target, verify, threads)

    def _load(self, target: LoadWeights | Any, verify: bool, threads: int) -> int:
        for attempt in range(_LEASELESS_RETRIES):
            try:
                snap = self.open()
            except DamagedVersionError as exc:  # (its current slot's stamp is damaged)
                if exc.version is not None:
                    self._refused(exc.version, exc)
                raise
            # (snap is closed in the finally below, not by `with`: the checks
            # after the apply are made here, a read again after a reused slot included)
            try:
                container = not callable(target) or _is_tensor_container(target)
                try:
                    if container:  # (checks after the copy that the slot still holds it)
                        snap.copy_into(target, threads=threads, verify=verify)
                    else:
                        if verify or not snap.leased:
                            snap.verify()
                        target(snap._views())
                        if snap.leased:  # (a private copy was verified before the apply: it
                            _check_applied(snap)  # stays good; a leased slot must hold it)
                except SlotReused:
                    if attempt + 1 < _LEASELESS_RETRIES:
                        log.info("version %d was replaced while %s read it (%s); reading "
                                 "again", snap.version, self.reader_id,
                                 "a lease the writer did not see" if snap.leased else
                                 "without a lease")
                        continue
                    raise
                except LeaseNotRenewed as exc:
                    if attempt + 1 < _LEASELESS_RETRIES:
                        # once is a hiccup; again, the host is too loaded for this lease
                        # timeout, and loads may never finish: said at WARNING
                        log.log(logging.INFO if attempt == 0 else logging.WARNING,
                                "%s; reading version %d again%s", exc, snap.version,
                                "" if attempt == 0 else
                                f" (attempt {attempt + 2}: this host is too loaded to renew a "
                                f"{self.lease_timeout:g} s lease in time; a longer "
                                "lease_timeout lets loads finish)")
                        continue
                    raise
                except (IncompatibleWeightsError, DamagedVersionError) as exc:
                    self._refused(snap.version, exc)
                    raise
                self.mark_loaded(snap.version, snap.run_id)
                return snap.version
            finally:
                snap.close()
        raise AssertionError("unreachable")

    def mark_loaded(self, version: int, run_id: str | None = None) -> None:
        """Record that ``version`` is now applied (shown by ``dbsync status``, counted by
        ``Sender.wait_for_receivers``). Clears an earlier refusal of an older version of the
        same run, or of another run (a load after it is the newer word). ``InvalidArgumentError``
        for a version that is no version number or a run id no writer makes: the record is
        what writers wait for."""
        check_int(version, "version", 1)
        if version > MAX_VERSION:
            raise InvalidArgumentError(f"version must be at most {MAX_VERSION}, not {version}")
        if run_id is not None and not is_run_id(run_id):
            raise InvalidArgumentError(f"run_id must be a run id of the store (32 hex digits, "
                                       f"as Manifest.run_id), not {short_repr(run_id)}")
        head = self._heads.get(version)
        self.loaded_version = version
        self.loaded_run_id = run_id or (head.run_id if head is not None else None)
        self.loaded_at = time.time()
        self._keeper.loaded = {"version": version, "run_id": self.loaded_run_id,
                               "at": self.loaded_at}
        note_loader(self._keeper.claim)
        refused = self._keeper.refused
        if refused and (refused.get("version", 0) <= version or (
                refused.get("run_id") or self.loaded_run_id) != self.loaded_run_id):
            self._keeper.refused = None
        if not self.read_only:
            self._keeper.write()

    def _refused(self, version: int, exc: DBSyncError) -> None:
        """A load refused ``version`` (damaged, or unfit for the target): tell the trainer,
        unless this reader does not report (a helper reader); never hides ``exc``."""
        if not self.report_loaded:
            return
        try:
            self.report_refusal(version, f"{type(exc).__name__}: {exc}")
        except OSError as report_error:
            log.info("could not record the refusal of version %d in %s: %s", version,
                     self.store.root, report_error)

    def report_refusal(self, version: int, reason: str, run_id: str | None = None) -> None:
        """Record that ``version`` (of run ``run_id``; default: the run of the version this
        receiver last saw with that number) was refused or failed to apply, so the trainer
        sees it (``dbsync push --wait-for`` and ``wait_for_receivers`` fail fast naming this
        reader, and ``dbsync status`` shows it, in that run only)."""
        if run_id is None and (head := self._heads.get(version)) is not None:
            run_id = head.run_id
        if run_id is None:  # (not opened here: the current head's run, if it is that version)
            with contextlib.suppress(DBSyncError, OSError):
                current = self.store.read_head()
                if current is not None and current.version == version:
                    run_id = current.run_id
        self._keeper.refused = {"version": version, "reason": str(reason)[:2000],
                                "run_id": run_id, "at": time.time()}
        if not self.read_only:
            self._keeper.write()

    def wait(self, newer_than: int | None = None, timeout: float | None = None) -> int | None:
        """Block until a version newer than ``newer_than`` (default: the loaded one) is
        published, or a new run starts; return its version, or None on timeout. Uses the
        store's watcher (inotify or polling, chosen from the mount type).

        With a ``timeout`` the waiting is done in a thread of its own, so a hung mount (a
        stopped FUSE daemon, an NFS server away: reads that block inside the kernel) cannot
        hold the caller past it: None comes back in time, with a WARNING, and that thread
        stays blocked until the mount answers (at most ``WAIT_THREADS`` such threads per
        receiver; a wait that finds them all blocked waits for one until its timeout)."""
        self._check_open()
        timeout = check_seconds(timeout, "timeout", none="wait as long as it takes")
        check_int(newer_than, "newer_than", -1, none="the loaded version")
        if timeout is None:
            return self._wait_here(newer_than, None, None)
        deadline = time.monotonic() + timeout
        if not self._wait_threads.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            log.warning("wait(timeout=%g) on %s: %d earlier waits are still blocked reading "
                        "the store (a hung mount?); returning None", timeout, self.store.root,
                        WAIT_THREADS)
            return None
        outcome: dict[str, Any] = {}
        done, abandoned = threading.Event(), threading.Event()

        def run() -> None:
            try:
                outcome["version"] = self._wait_here(newer_than, deadline, abandoned)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                outcome["error"] = exc
            finally:
                done.set()
                self._wait_threads.release()

        try:
            threading.Thread(target=run, name="dbsync-wait", daemon=True).start()
        except BaseException:
            self._wait_threads.release()
            raise
        try:
            # (the wait itself returns at its deadline; the grace lets a last look finish)
            finished = done.wait(min(max(0.0, deadline - time.monotonic()) + _WAIT_GRACE_S,
                                     threading.TIMEOUT_MAX))
        except BaseException:  # (Ctrl-C: the thread ends at its next look)
            abandoned.set()
            raise
        if not finished:
            abandoned.set()
            log.warning("wait(timeout=%g) on %s: the store did not answer in time (a hung "
                        "mount?); returning None", timeout, self.store.root)
            return None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["version"]

    def _wait_here(self, newer_than: int | None, deadline: float | None,
                   abandoned: threading.Event | None) -> int | None:
        """``wait`` on this thread (``abandoned``: the caller gave up; return None)."""
        from .watch import Watcher

        floor = self.loaded_version if newer_than is None else newer_than
        floor = 0 if floor is None else floor
        run = self.loaded_run_id
        kept = None if newer_than is None else self._heads.get(newer_than)
        if kept is not None:  # a version it opened
            run = kept.run_id
        if run is None:
            head = self._read_head_quietly()
            run = None if head is None else head.run_id
        event = threading.Event()
        self._waits.add(event)
        try:
            with Watcher(self.store.root, lambda _v: event.set(),
                         poll_interval=self.poll_interval, skip_current=True):
                return self._wait_for(event, floor, run, deadline, abandoned)
        finally:
            self._waits.discard(event)

    def _wait_for(self, event: threading.Event, floor: int, run: str | None,
                  deadline: float | None, abandoned: threading.Event | None = None
                  ) -> int | None:
        while True:
            if self._closed.is_set():
                raise DBSyncError(f"this Receiver of {self.store.root} was closed while "
                                  "waiting for a new version")
            if abandoned is not None and abandoned.is_set():
                return None
            head = self._read_head_quietly()
            if head is not None and (head.version > floor or (
                    run is not None and head.run_id != run)):
                # (kept: a next wait(newer_than=this version) waits within its run, even
                # before anything of that run was loaded)
                self._remember(head)
                return head.version
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            # the watcher wakes us; the bound is only a safety net (no spinning)
            event.wait(5.0 if remaining is None else min(remaining, 5.0))
            event.clear()

    def _read_head_quietly(self) -> Head | None:
        """The head, or None while it cannot be read (a transient problem: a mount away, a
        head being replaced). A head of a newer format is not transient: it raises
        ``UnsupportedFormatError`` (upgrade dbsync here). One of an older format is waited
        out: the trainer's next push with this release rewrites it (logged once)."""
        try:
            return self.store.read_head()
        except UnsupportedFormatError as exc:
            if exc.newer:
                raise
            if not self._told_older_format:
                self._told_older_format = True
                log.warning("%s; waiting for a version in this format", exc)
            return None
        except (DBSyncError, OSError) as exc:
            log.debug("cannot read the head of %s: %s", self.store.root, exc)
            return None

    def watch(self, callback: Callable[[int], Any], **kwargs: Any) -> Watcher:
        """Start a background watcher calling ``callback(version)`` on each new version
        (including the current one at start). Returns the started ``Watcher``; stop() it
        (``close()`` stops it too)."""
        from .watch import Watcher

        kwargs.setdefault("poll_interval", self.poll_interval)
        watcher = Watcher(self.store.root, callback, **kwargs)
        with self._closing:  # (callbacks run in the watcher's thread: no deadlock)
            self._check_open()
            self._watchers.add(watcher)
            watcher.start()
        return watcher

    def close(self) -> None:
        """End this receiver: ``wait()`` calls under way raise, watchers started by
        ``watch()`` stop, and later calls of ``open``, ``load``, ``wait`` and ``watch`` raise.
        The heartbeat stops and the lease is removed once snapshots still open are closed (a
        slot they read stays protected until then). Safe to call more than once."""
        with self._closing:  # (watch() adds under it: no watcher starts unseen)
            self._closed.set()
            watchers, self._watchers = list(self._watchers), weakref.WeakSet()
        for event in list(self._waits):
            event.set()
        for watcher in watchers:  # (only the first close joins them: two callbacks that
            watcher.stop()  # close at once must not wait for each other)
        self._release_orphans()
        self._finalizer()

    def _release_orphans(self) -> None:
        """End holds that no snapshot owns and no ``open`` is making: an open cut short by
        an interrupt (Ctrl-C) at the wrong moment, which would keep the slot from the writer
        for as long as this receiver lives."""
        # (``_opening`` first: an open registers its snapshot before it leaves ``_opening``,
        # so a token seen in neither, in this order, has no snapshot at all)
        orphans = [t for t in list(self._keeper.held)
                   if t not in self._opening and t not in self._snapshots]
        for token in orphans:
            self._keeper.release(token)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise DBSyncError(f"this Receiver of {self.store.root} is closed; create a new one")

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise DBSyncError(
            f"a Receiver cannot be pickled or copied (its lease of {self.store.root} is kept "
            "by a thread of this process): create one in each process that reads, from the "
            "store's path")


def _close_parts(keeper: LeaseKeeper, workers: WorkerPools) -> None:
    keeper.close()
    workers.close()


def _on_network_mount(root: str) -> bool:
    from .watch import needs_polling

    return needs_polling(root)


def _check_target(target: Any) -> None:
    """Refuse (before anything is read or reported) a load target that is none of the kinds
    ``load`` takes."""
    if callable(target) or _is_tensor_container(target) or is_tensordict(target):
        return
    raise InvalidArgumentError(
        f"load() takes a load_weights callable, an nn.Module, a dict of tensors or a "
        f"TensorDict, not {type(target).__name__} {short_repr(target, 60)}; nothing was read")


def _is_tensor_container(target: Any) -> bool:
    import torch

    return isinstance(target, torch.nn.Module | Mapping)

