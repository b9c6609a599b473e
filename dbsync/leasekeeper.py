"""LeaseKeeper: one reader's lease file, written on construction and refreshed from a heartbeat
thread (a small file write every ``timeout / 4``), so the writer and ``dbsync status`` can tell
the reader is alive and which slots it holds.

Hazards, stated plainly:
- The keeper holds no reference to its Receiver: a Receiver dropped without ``close()`` is
  collected and stops it. Its holds then end, and the views of a snapshot still in use are
  unprotected.
- A lease that cannot be written (a read-only view, a full disk) is not an error: loads go on
  without one (private verified copies), and the failure is logged once per kind of error.
- A forked child never writes or releases its parent's lease.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from typing import Any

from .errors import FormatError, resource_limit
from .format import FORMAT_VERSION
from .leases import (
    IDLE,
    READING,
    forget_hold,
    note_hold,
    release_reader_id,
)
from .processes import host_identity, own_start
from .slowcalls import said_if_slow
from .store import Store

log = logging.getLogger(__name__)

__all__ = ["LeaseKeeper"]

#: a lease write failing with these is this process's limit (open files, memory), not the store
_PROCESS_LIMITS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class LeaseKeeper:
    """Writes and refreshes one reader's lease from a heartbeat thread. Holds no reference to
    its Receiver, so a Receiver dropped without ``close()`` is collected and stops it."""

    def __init__(self, store: Store, reader_id: str, timeout: float, report_loaded: bool):
        self.store = store
        self.reader_id = reader_id
        self.timeout = timeout
        self.report_loaded = report_loaded
        #: token -> (slot, version, run id) of each hold
        self.held: dict[int, tuple[str, int, str | None]] = {}
        self.loaded: dict[str, Any] = {}
        self.refused: dict[str, Any] | None = None
        self.lock = threading.Lock()
        self.beat = 0
        self.last_ok: float | None = None
        #: the last renewal that came after the lease had lapsed (0.9 x its timeout without
        #: one: this process or its lease thread stalled), and how long it had gone unrenewed
        self.last_lapse: tuple[float, float] | None = None
        self._held_since: dict[int, float] = {}  # token -> when its hold began (monotonic)
        #: why this keeper stopped writing its lease for good (another process writes it)
        self.conflict: str | None = None
        self.error: OSError | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._ended = False
        self._wake = threading.Event()  # wakes the heartbeat early (a release, the end)
        self._released: collections.deque[int] = collections.deque()  # see release_later
        self._pid = os.getpid()
        #: this process's claim on the reader id (``leases.claim_reader_id``), if it made one
        self.claim: tuple[Any, str] | None = None

    def record(self) -> dict[str, Any]:
        held = sorted(self.held.values(), key=lambda h: (h[0], h[1]))
        slot, version = held[-1][:2] if held else (None, None)
        return {
            "reader_id": self.reader_id, **host_identity(), "pid": os.getpid(),
            "pid_start": own_start(),
            "reads_format": FORMAT_VERSION,
            "lease_timeout": self.timeout,
            "state": READING if held else IDLE, "slot": slot, "version": version,
            "held": [list(h) for h in held],
            "loaded_version": self.loaded.get("version") if self.report_loaded else None,
            "loaded_run_id": self.loaded.get("run_id") if self.report_loaded else None,
            "loaded_at": self.loaded.get("at") if self.report_loaded else None,
            "refused": self.refused,
            "beat": self.beat, "updated_at": time.time(),
        }

    def write(self) -> bool:
        """Write the lease now; False (logged once per kind of error) if it cannot be."""
        if os.getpid() != self._pid:
            return False  # a forked child: the lease is its parent's
        with self.lock:
            if self._ended:  # (a closed receiver's lease stays removed)
                return False
            if self.conflict is not None:
                return False  # (another process writes this reader id's lease: never again)
            self.beat += 1
            started = time.monotonic()
            try:
                with said_if_slow(f"writing the lease {self.store.lease_path(self.reader_id)}"):
                    if self.last_ok is not None and self._taken_by_another():
                        return False
                    self.store.write_lease(self.reader_id, self.record())
            except (OSError, FormatError) as exc:
                err = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
                if err.errno in _PROCESS_LIMITS:  # (the process's limit, not the store's)
                    if self.error is None or self.error.errno != err.errno:
                        log.warning("reader %s cannot write its lease in %s: %s",
                                    self.reader_id, self.store.root,
                                    resource_limit(err, "writing the lease"))
                    self.error = err
                    return False
                if self.error is None or self.error.errno != err.errno:
                    # A read-only mount is a read-only view by design (said at INFO, unless a
                    # snapshot loses its protection); no permission is more often a mistake.
                    denied = err.errno in (errno.EACCES, errno.EPERM)
                    level = (logging.INFO if err.errno == errno.EROFS and not self.held
                             else logging.WARNING)
                    log.log(level, "reader %s cannot write its lease in %s (%s%s): loads go on "
                            "without a lease (private verified copies); the writer, `dbsync "
                            "status`, wait_for_receivers and max_lag do not see this reader "
                            "meanwhile, and a snapshot it has open is no longer protected once "
                            "its lease times out (its views may change; closing it raises "
                            "LeaseExpiredError)",
                            self.reader_id, self.store.root, err.strerror or err,
                            "; " + self.store.why_lease_unwritable(self.reader_id)
                            if denied else "")
                self.error = err
                return False
            if self.error is not None:
                log.info("reader %s writes its lease in %s again", self.reader_id,
                         self.store.root)
                self.error = None
            if self.last_ok is not None and started - self.last_ok >= 0.9 * self.timeout:
                self.last_lapse = (started, started - self.last_ok)
            self.last_ok = started
            return True

    def _taken_by_another(self) -> bool:
        """Whether the lease file now is another live process's (the same reader id given to
        two processes, or a store removed and made anew at the path, where another process
        claimed the id while this one's lease was gone). Then this keeper stops writing it,
        for good: writing on would replace that process's holds with this one's, and the
        writer could reuse a slot it reads. Said in a WARNING and ``conflict``."""
        record = self.store.read_lease(self.reader_id)
        if record is None:
            return False  # (absent: removed by a writer that judged this reader dead)
        me = {**host_identity(), "pid": os.getpid(), "pid_start": own_start()}
        theirs = {key: record.get(key) for key in me}
        if theirs == me:
            return False
        if record.get("pid_start") is None:
            theirs["pid_start"] = me["pid_start"]  # (a lease of an older dbsync)
            if theirs == me:
                return False
        self.conflict = (
            f"reader id {self.reader_id} is in use by another process too (host "
            f"{record.get('host')}, pid {record.get('pid')}), whose lease replaced this one's "
            f"in {self.store.readers_dir}: this reader no longer writes its lease, so the "
            "writer does not see it, and a snapshot it holds is not protected. Give each "
            "process its own reader id (or stop the other one), then restart this one")
        self.error = OSError(errno.EEXIST, self.conflict)
        log.warning("%s", self.conflict)
        return True

    def trusted(self) -> bool:
        """Whether the writer must still consider this lease live (renewed recently enough)."""
        return (self.conflict is None and self.last_ok is not None
                and time.monotonic() - self.last_ok < 0.9 * self.timeout)

    def lapse_during(self, token: int) -> float | None:
        """How long the lease went unrenewed (past 0.9 x its timeout) while hold ``token``
        lasted, now or at some point since it began (renewed again since: the writer may
        have taken it for dead meanwhile); None if it never lapsed."""
        now = time.monotonic()
        if self.last_ok is None:
            return None
        if now - self.last_ok >= 0.9 * self.timeout:
            return now - self.last_ok
        lapse, since = self.last_lapse, self._held_since.get(token)
        if lapse is not None and since is not None and lapse[0] > since:
            return lapse[1]
        return None

    def hold(self, token: int, slot: str, version: int, run_id: str | None = None) -> bool:
        """Add a hold (of ``version`` of run ``run_id`` in ``slot``) and write the lease;
        False (no hold) once the keeper is closing."""
        with self.lock:
            if self._closing:
                return False
            self.held[token] = (slot, version, run_id)
            note_hold(self.claim, token, slot)
        if self.write():
            with self.lock:
                self._held_since[token] = time.monotonic()
            return True
        error = self.error
        if error is not None and error.errno in _PROCESS_LIMITS:
            # Not a store that cannot be written: reading on without a lease would make a
            # private copy of the version, in a process already short of memory or files.
            with self.lock:
                self.held.pop(token, None)
                forget_hold(self.claim, token)
            raise resource_limit(error, f"holding version {version} (writing reader "
                                        f"{self.reader_id}'s lease)") from None
        return False

    def release(self, token: int) -> None:
        if os.getpid() != self._pid:
            return  # a forked child: the holds and the lease are its parent's
        with self.lock:
            forget_hold(self.claim, token)
            self._held_since.pop(token, None)
            if self.held.pop(token, None) is None:
                return
            last = self._closing and not self.held
        if last:  # the receiver was closed while this hold lasted: end now
            self._end()
        else:
            self.write()

    def release_later(self, token: int) -> None:
        """``release`` from the heartbeat thread, soon: for a snapshot's finalizer, which
        garbage collection may run in any thread, this one included, even inside ``write``
        (holding ``lock``)."""
        self._released.append(token)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dbsync-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.timeout / 4)
            self._wake.clear()
            while self._released and not self._ended:
                self.release(self._released.popleft())
            if self._ended:
                return
            self.write()

    def close(self) -> None:
        """Stop the heartbeat and remove the lease, or, while snapshots still hold slots,
        once the last of them is released (their slots stay protected until then)."""
        with self.lock:
            self._closing = True
            if self.held:
                return
        self._end()

    def _end(self) -> None:
        with self.lock:
            if self._ended:
                return
            self._ended = True
        self._wake.set()
        if self._thread is None:
            return  # never wrote a lease (read-only): the file, if any, is another reader's
        if os.getpid() != self._pid:
            return  # a forked child closing its copy: the lease and the claim are its parent's
        if self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self.store.remove_lease(self.reader_id)
        except (OSError, FormatError):
            pass
        release_reader_id(self.claim)
