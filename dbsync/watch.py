"""Notice new versions: inotify (``dbsync.inotify``) where events arrive, polling where they
cannot, chosen from the mount type. An idle watcher costs (almost) nothing.

How a look at the store works (``Watcher._check``):

1. *Probe*: read the head (``dbsync.json``, a small record) afresh with
   ``Store.read_head_bytes`` (no symlink followed, no FIFO waited on, size bounded) and
   compare its bytes with the last ones seen; when nothing changed, that is the end of it.
2. *Parse*: only when the bytes changed, parse those same bytes into (run id, version)
   (``read_head``, the one function that knows how).
3. *Decide*: a higher version of the same run, or any version of a different run (a new
   training run at the same path starts again at 1), is reported to the callback.

When it looks:

- inotify mode: on events for the manifest file only: moved to, created, closed after a
  write, modified. Opens, reads and closes without a write are not even asked of the kernel,
  so the watcher's own reads never wake it (they once did: 100,000 reads in 10 idle seconds),
  and no event is held back (watchdog's observer, used before, held renames up to 0.5 s).
  A burst of events costs one look; two looks are never closer than ``MIN_CHECK_INTERVAL``.
  A safety look every ``SAFETY_POLL_INTERVAL`` seconds catches anything the events missed,
  and a deleted or replaced store directory is watched again once it is back. The root is
  also ``stat``-ed every ``poll_interval`` (no read): a volume mounted over ROOT sends no
  event. When another filesystem appears at ROOT (an NFS or FUSE volume mounted, or
  unmounted, after the watcher started) the mode is chosen again from its type.
- polling mode (NFS, Lustre, CIFS, FUSE: their clients get no inotify events for changes made
  elsewhere): every ``poll_interval`` seconds (at least ``MIN_CHECK_INTERVAL``). Polling
  *opens and reads* the manifest rather than ``stat``-ing its path: on NFS ``stat`` answers
  from the attribute cache (up to ``acregmax``, 60 s by default), an open revalidates
  (close-to-open consistency).

Every sleep is on an ``Event``: ``stop()`` returns at once.

Errors: a manifest that cannot be read or parsed is logged once per change of the store's
content (a garbled manifest that stays garbled is one warning, not one per look), and at most
once per ``ERROR_LOG_INTERVAL`` seconds while the content keeps changing; ``last_error`` holds
the latest problem and is cleared once the store reads well again.

Callbacks run on one thread, one at a time, never twice for the same (run, version). A
callback that raises is logged and kept in ``last_error``; the watcher goes on.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import DBSyncError, InvalidArgumentError, resources_named
from .format import MANIFEST_FILE, Head
from .inotify import APPEARS, LOST, DirectoryWatch
from .slowcalls import said_if_slow
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 1.0
SAFETY_POLL_INTERVAL = 5.0
MIN_CHECK_INTERVAL = 0.01
#: the longest poll interval used (a longer one, or infinity, is taken as this)
MAX_POLL_INTERVAL = 3600.0
ERROR_LOG_INTERVAL = 30.0
#: how often one process warns that a root gets no inotify watch (``Receiver.wait`` makes a
#: watcher per call: the warning is per root and reason, not per watcher)
NO_WATCH_WARN_INTERVAL = 600.0
_no_watch_warned: dict[tuple[str, int | None], float] = {}
_no_watch_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _no_watch_lock
    _no_watch_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)

_REMOTE_TYPES = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "9p",
    "beegfs", "afs", "fuse", "fuseblk", "virtiofs", "panfs", "orangefs", "weka", "wekafs",
}


def mount_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """Filesystem type of the mount holding ``path`` ("unknown" if it cannot be told)."""
    found = mount_of(path, mountinfo)
    return "unknown" if found is None else found[1]


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo"
             ) -> tuple[str, str, str] | None:
    """(mount point, filesystem type, its options) of the mount holding ``path``, or None if
    it cannot be told."""
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if len(fields) < 5 or not after:
            continue
        point = _unescape(fields[4])
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (
                best is None or len(point) >= len(best[0])):
            best = (point, after[0], after[2] if len(after) > 2 else "")
    return best


def store_in_overlay_lower(root: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The directory of an overlay filesystem's lower layer that holds the store ``root`` is
    reached through (None if ``root`` is not on an overlay, or no lower layer visible here
    holds a store there). A trainer writing that directory is not reliably seen through the
    overlay (the kernel leaves changes to a lower layer undefined), and a reader's lease lands
    in the overlay's upper layer, where the trainer never sees it. None too where the upper
    layer holds the store's manifest (visible here): the store is written through the
    overlay (an image that ships a store, continued by a trainer in the container)."""
    found = mount_of(root, mountinfo)
    if found is None or found[1] != "overlay":
        return None
    point, _, options = found
    inside = os.path.relpath(os.path.realpath(root), point)
    for option in options.split(","):
        key, _, value = option.partition("=")
        if key == "upperdir" and os.path.isfile(
                os.path.join(_unescape(value), inside, MANIFEST_FILE)):
            return None
    for option in options.split(","):
        key, _, value = option.partition("=")
        if key in ("lowerdir", "lowerdir+"):
            for lower in value.split(":"):
                candidate = os.path.normpath(os.path.join(_unescape(lower), inside))
                if os.path.isfile(os.path.join(candidate, MANIFEST_FILE)):
                    return candidate
    return None


def _unescape(field: str) -> str:
    """A mountinfo path as it is: the kernel writes space, tab, newline and backslash as
    three octal digits after a backslash (``\\040``, ``\\011``, ``\\012``, ``\\134``)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


_OCTAL = re.compile(r"\\([0-7]{3})")


def needs_polling(path: str) -> bool:
    kind = mount_type(path)
    return kind in _REMOTE_TYPES or kind.startswith(("fuse.", "nfs"))


@dataclass(frozen=True)
class RunVersion:
    """What the watcher follows: which training run, which version of it."""

    run_id: str | None
    version: int


def read_head(store: Store, raw: bytes) -> RunVersion:
    """(run id, version) of the head bytes ``raw`` (what ``store.read_head_bytes()`` returned,
    so the bytes compared are the bytes parsed). The only place the watcher learns a version.
    Raises ``FormatError`` for a head that is not dbsync's."""
    head = Head.loads(raw, store.manifest_path)
    return RunVersion(head.run_id, head.version)


class Watcher:
    """Calls ``callback(version)`` for each new version published in ``root`` (and for the
    current one when started, unless ``skip_current``).

    ``use_polling``: None = decide from the mount type. ``poll_interval``: seconds between
    polls (default 1.0; at least ``MIN_CHECK_INTERVAL``). ``probe`` and ``head``: injectable
    for tests (defaults: ``store.read_head_bytes`` and ``read_head``).

    ``reads`` and ``parses`` count the probes and the head reads made so far.

    Hazard: a new training run at the same path (a different run id) is reported even though
    its version is lower than the last one seen; the callback receives only the version."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        callback: Callable[[int], Any],
        poll_interval: float | None = None,
        use_polling: bool | None = None,
        skip_current: bool = False,
        *,
        probe: Callable[[], bytes | None] | None = None,
        head: Callable[[bytes], RunVersion] | None = None,
        safety_interval: float = SAFETY_POLL_INTERVAL,
    ):
        if not callable(callback):
            raise InvalidArgumentError(f"the watcher's callback must be callable (it is called "
                                       f"with each new version), not {callback!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.callback = callback
        interval = DEFAULT_POLL_INTERVAL if poll_interval is None else poll_interval
        if not (isinstance(interval, int | float) and not isinstance(interval, bool)
                and interval >= 0):  # (NaN fails the comparison)
            raise InvalidArgumentError(f"poll_interval must be a number of seconds >= 0, not "
                                       f"{poll_interval!r}")
        self.poll_interval = min(max(interval, MIN_CHECK_INTERVAL), MAX_POLL_INTERVAL)
        self.safety_interval = max(safety_interval, self.poll_interval)
        self.polling = needs_polling(self.root) if use_polling is None else use_polling
        #: chosen from the mount type, and chosen again when another mount appears at ROOT
        self._mode_from_mount = use_polling is None
        self._root_identity: tuple[int, int] | None = _identity(self.root)
        self.skip_current = skip_current
        store = Store(self.root, create=False)
        self._probe = probe or (lambda: store.read_head_bytes(known=self._seen, stop=self._stop))
        self._read_head = head or (lambda raw: read_head(store, raw))
        self.last_error: BaseException | None = None
        self.reads = 0
        self.parses = 0
        self._head: RunVersion | None = None
        self._seen: bytes | None = None  # the head bytes last parsed (or refused)
        self._read_failing = False
        self._logged_key: object = None
        self._logged_at = float("-inf")
        self._pending: tuple[object, BaseException] | None = None
        self._skipped = 0  # distinct problems replaced before they could be logged
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer: DirectoryWatch | None = None
        self._link_observer: DirectoryWatch | None = None  # (where ROOT is a symlink)
        self._watched: tuple[int, int] | None = None  # (st_dev, st_ino) of the watched root
        self._rewatch = threading.Event()
        #: events noticed (counted before ``_wake`` is set, by the inotify thread alone): a
        #: look is due when it moved, however the wake-up and the clearing interleave
        self._events = 0
        self._unwatched_because = "the directory was replaced"  # (said once watched again)
        #: while a look has not returned for long (a hung mount): what the watchdog said
        self._hang: str | None = None
        #: the head went back within one run, and no newer version came since (see
        #: ``rewound``)
        self._rewound: str | None = None

    # ---- public -------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """"inotify", or "polling": chosen for the mount, or while no inotify watch could be
        set up (the inotify limits reached, the root missing: retried meanwhile)."""
        return "polling" if self.polling or self._rewatch.is_set() else "inotify"

    @property
    def last_version(self) -> int | None:
        """The last version reported (or recorded at start with ``skip_current``)."""
        return None if self._head is None else self._head.version

    @last_version.setter
    def last_version(self, value: int | None) -> None:
        """Forget versions after ``value``: the next look reports the current version again
        if it is newer (how a caller asks for a failed version to be retried; that look is
        the next event or poll, at the latest after ``safety_interval``)."""
        run = None if self._head is None else self._head.run_id
        self._head = None if value is None else RunVersion(run, value)
        self._seen = None

    @property
    def read_problem(self) -> str | None:
        """Why the store's manifest cannot be read now (garbled, another format, unreachable,
        a read that has not returned for ``SLOW_CALL_WARN_S`` seconds: a hung mount), as the
        last look found; None while it reads well."""
        if self._hang is not None:
            return self._hang
        error = self.last_error if self._read_failing else None
        return None if error is None else f"{type(error).__name__}: {error}"

    @property
    def rewound(self) -> str | None:
        """What the last look found if the store's head went back within one run (a version
        older than one already reported: an older copy restored), until a newer version or
        a new run comes; None otherwise."""
        return self._rewound

    @property
    def run_id(self) -> str | None:
        """The run id of the last version reported (None before one, or for stores without
        run ids)."""
        return None if self._head is None else self._head.run_id

    def start(self) -> Watcher:
        """Start watching. Raises ``ResourceLimitError`` (naming the limit) where the process
        cannot start the watcher's threads; nothing is left running then."""
        if self.skip_current:
            self._check(notify=False)
        with resources_named(f"starting a watcher of {self.root}", "nothing is watched"):
            try:
                if not self.polling:
                    self._start_observer()
                self._thread = threading.Thread(target=self._run, name="dbsync-watch",
                                                daemon=True)
                self._thread.start()
            except BaseException:
                self._thread = None
                self._stop_observer()
                raise
        return self

    def stop(self) -> None:
        """Stop at once (every sleep is interruptible) and join the threads. Hazard: a thread
        blocked in a call its mount does not answer (a hung NFS or FUSE mount) cannot be
        interrupted; it is waited for ``STOP_JOIN_S`` seconds, then left behind (a daemon
        thread, with a WARNING), so that a process stopping is not held up by it."""
        self._stop.set()
        self._wake.set()
        self._stop_observer()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)
            if self._thread.is_alive():  # (a daemon thread: it ends with the process)
                log.warning("dbsync watcher: the watcher of %s did not stop within %.0f s: "
                            "it waits in a call its mount does not answer (an NFS server "
                            "gone, a FUSE daemon stopped); left behind", self.root,
                            STOP_JOIN_S)
            else:
                self._stop_observer()  # (one the loop restarted meanwhile)
        self._thread = None

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        clock = time.monotonic
        seen_events, first, safety_due = 0, True, clock() + self.safety_interval
        while not self._stop.is_set():
            self._wake.clear()
            events = self._events
            woken, seen_events = first or events != seen_events, events
            first = False
            # (a stat: is another directory or mount there? It blocks on a hung mount, as a
            # read of the head does: watched the same way)
            try:
                with said_if_slow(f"reading {os.path.join(self.root, MANIFEST_FILE)}",
                                  on_slow=self._hanging):
                    identity = _identity(self.root)
            finally:
                self._hang = None
            moved = identity != self._root_identity
            if moved and self._mode_from_mount and identity is not None:
                self._choose_mode_again()
            if identity is not None:
                self._root_identity = identity
            rewatching = self._rewatch.is_set()  # (a look follows a watch set up again)
            if not self.polling and (rewatching or identity is None
                                     or identity != self._watched):
                self._restart_observer()
            now = clock()
            if (woken or moved or self.polling or rewatching or self._rewatch.is_set()
                    or now >= safety_due):
                self._check()
                safety_due = now + self.safety_interval
            last = clock()
            # Polling reads the head every poll interval; with inotify only events wake a
            # look, and the root is stat-ed every poll interval (a volume mounted over it
            # sends no event), with a full look every safety interval.
            interval = self.poll_interval if (self.polling or self._rewatch.is_set()) else (
                max(MIN_CHECK_INTERVAL, min(self.poll_interval, safety_due - last)))
            self._wake.wait(interval)
            # Bounded rate: events arriving meanwhile coalesce into the next look.
            remaining = last + MIN_CHECK_INTERVAL - clock()
            if remaining > 0:
                self._stop.wait(remaining)

    def _check(self, notify: bool = True) -> None:
        """One look: read the head's bytes; parse them only when they changed."""
        self._log_pending()
        self.reads += 1
        try:
            with said_if_slow(f"reading {os.path.join(self.root, MANIFEST_FILE)}",
                              on_slow=self._hanging):
                raw = self._probe()
        except Exception as exc:  # noqa: BLE001 - reported once, retried at the next look
            self._read_failed(("probe", type(exc).__name__, str(exc)), exc)
            return
        finally:
            self._hang = None
        if self._stop.is_set() or (raw is not None and raw == self._seen):
            return  # (stopping: a read whose re-reads were cut short is not judged)
        if raw is None and self._head is not None:  # (it had a version: said, not ignored)
            if self._seen is not None or not self._read_failing:
                self._seen = None
                self._read_failed(("gone",), DBSyncError(
                    f"{self.root} no longer holds a published version (its {MANIFEST_FILE} is "
                    "gone: the store was removed or unmounted, or a new run is starting there; "
                    f"the last version seen was {self._head.version})"))
            return
        head: RunVersion | None = None
        if raw is not None:
            self.parses += 1
            try:
                head = self._read_head(raw)
            except Exception as exc:  # noqa: BLE001 - bad content: look again once it changes
                self._seen = raw
                self._read_failed(raw, exc)
                return
        self._seen = raw
        if self._read_failing:
            self._read_failing = False
            self.last_error = None
            self._logged_key, self._pending, self._skipped = None, None, 0
            log.info("dbsync watcher: the manifest in %s reads well again", self.root)
        if head is not None:
            self._consider(head, notify)

    def _hanging(self, message: str) -> None:
        """The look under way has not returned for long (called by ``slowcalls``)."""
        self._hang = message

    def _consider(self, head: RunVersion, notify: bool) -> None:
        last = self._head
        if last is not None and head.run_id != last.run_id:
            log.info("dbsync watcher: a new training run (%s, was %s) publishes in %s; "
                     "following it from its version %s", head.run_id, last.run_id, self.root,
                     head.version)
        elif last is not None and head.version <= last.version:
            if head.version < last.version:
                self._rewound = (
                    f"{self.root} went back from version {last.version} to {head.version} "
                    "in the same run (an older copy of the store restored?); its newer "
                    "versions are followed as usual (a new run needs a new run id)")
                log.warning("dbsync watcher: %s", self._rewound)
            return
        self._rewound = None
        self._head = head  # before the callback: it may reset last_version to retry
        if not notify:
            return
        try:
            self.callback(head.version)
        except DBSyncError as exc:  # refused, damaged, stalled: said plainly, no traceback
            self.last_error = exc
            log.warning("dbsync watcher: callback failed for version %s: %s", head.version,
                        exc)
        except BaseException as exc:  # anything else may be a bug in the callback: where it
            # failed. (SystemExit or asyncio's CancelledError too: raised in this thread they
            # would end it unheard, and no later version would ever be delivered.)
            self.last_error = exc
            log.exception("dbsync watcher: callback failed for version %s", head.version)
        else:
            if not self._read_failing:
                self.last_error = None

    def _read_failed(self, key: object, exc: BaseException) -> None:
        """Keep ``last_error`` current; log once per distinct problem, at a bounded rate."""
        self.last_error = exc
        self._read_failing = True
        if key != self._logged_key:
            if self._pending is not None and self._pending[0] != key:
                self._skipped += 1
            self._pending = (key, exc)
            self._log_pending()

    def _log_pending(self) -> None:
        """Log the newest unlogged problem unless one was logged less than
        ``ERROR_LOG_INTERVAL`` ago (then a later look logs it, naming how many it skipped)."""
        if self._pending is None:
            return
        now = time.monotonic()
        if now - self._logged_at < ERROR_LOG_INTERVAL:
            return
        (key, exc), self._pending = self._pending, None
        more = f" ({self._skipped} other problem(s) since the last message)" if (
            self._skipped) else ""
        self._logged_key, self._logged_at, self._skipped = key, now, 0
        log.warning("dbsync watcher: cannot read the manifest in %s: %s%s; still watching, "
                    "this is reported again only if it changes", self.root, exc, more)

    # ---- inotify ------------------------------------------------------------------------
    def _start_observer(self) -> None:
        wake, rewatch = self._wake, self._rewatch

        def on_event(name: str | None) -> None:
            if name is None:  # the directory went away: watch the one there now
                self._unwatched_because = "the directory was replaced"
                rewatch.set()
                self._events += 1
                wake.set()
            elif name == MANIFEST_FILE or name == LOST:  # (LOST: events were lost: look)
                self._events += 1
                wake.set()

        parent, link = os.path.split(self.root)

        def on_link_event(name: str | None) -> None:  # ROOT is a symlink: re-pointed?
            if name == LOST:
                self._events += 1
                wake.set()
            elif name is None or name == link:
                self._unwatched_because = "the symlink was re-pointed"
                rewatch.set()
                self._events += 1
                wake.set()

        try:
            st = os.stat(self.root)
            watch = DirectoryWatch(self.root, on_event).start()
        except OSError as exc:  # no inotify here, none left, or the root is gone
            if not self._rewatch.is_set() or not self._unwatched_because.startswith("no "):
                _warn_no_watch(self.root, exc, self.poll_interval)
            self._unwatched_because = f"no inotify watch could be set before: {exc}"
            self._rewatch.set()
            return
        self._observer, self._watched = watch, (st.st_dev, st.st_ino)
        self._rewatch.clear()
        # A ROOT that is a symlink (a "current" link re-pointed from one store to the next)
        # is watched where it lies too: re-pointing it makes no event in the old target.
        if os.path.islink(self.root):
            try:
                # (only names appearing: writes of other files there cost nothing)
                self._link_observer = DirectoryWatch(parent, on_link_event, APPEARS).start()
            except OSError as exc:
                log.info("dbsync watcher: the symlink %s is not watched (%s); a new target is "
                         "noticed within %g s", self.root, exc, self.safety_interval)

    def _stop_observer(self) -> None:
        for observer in (self._observer, self._link_observer):
            if observer is not None:
                observer.stop()
        self._observer = self._link_observer = None

    def _restart_observer(self) -> None:
        """The watched directory was deleted or replaced: watch the one now at ``root``."""
        self._stop_observer()
        if os.path.isdir(self.root):
            self._start_observer()
            if not self._rewatch.is_set():
                log.info("dbsync watcher: watching %s with inotify again (%s)", self.root,
                         self._unwatched_because)
                self._unwatched_because = "the directory was replaced"

    def _choose_mode_again(self) -> None:
        """Another filesystem appeared at ROOT (a network or FUSE volume mounted over it, or
        unmounted): poll where it delivers no events for changes made elsewhere, watch with
        inotify where it does."""
        polling = needs_polling(self.root)
        if polling == self.polling:
            return
        self.polling = polling
        if polling:
            self._stop_observer()
            log.info("dbsync watcher: %s is now on a %s mount (no inotify events for changes "
                     "made elsewhere); polling every %g s", self.root, mount_type(self.root),
                     self.poll_interval)
        else:
            self._unwatched_because = f"it is now on a {mount_type(self.root)} mount"
            self._rewatch.set()


#: how long ``Watcher.stop`` waits for its thread (blocked only by a hung mount)
STOP_JOIN_S = 5.0


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path`` (None if it cannot be looked at)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _warn_no_watch(root: str, exc: OSError, poll_interval: float) -> None:
    """Warn that ``root`` gets no inotify watch: once per root and reason per
    ``NO_WATCH_WARN_INTERVAL`` in this process (later ones at DEBUG)."""
    key, now = (root, exc.errno), time.monotonic()
    with _no_watch_lock:
        last = _no_watch_warned.get(key)
        loud = last is None or now - last >= NO_WATCH_WARN_INTERVAL
        if loud:
            _no_watch_warned[key] = now
    log.log(logging.WARNING if loud else logging.DEBUG,
            "dbsync watcher: no inotify watch on %s (%s); polling every %g s until one can be "
            "set", root, exc, poll_interval)
