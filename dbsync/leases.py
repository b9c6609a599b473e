"""Reader leases, seen from both sides.

A receiver keeps one lease file, refreshed (``beat + 1``) every ``lease_timeout / 4`` seconds
for as long as it lives, listing the slots it holds (``held``). The writer never writes into a
slot that a live lease holds.

A lease is dead when its reader is gone:
- on the writer's host, in the writer's PID namespace, after the same boot: its ``pid`` no
  longer exists (checked at once). A reader with the writer's hostname in another PID namespace
  (docker ``--network host``, Kubernetes ``hostNetwork``) has a pid that means nothing here, so
  this shortcut is taken only when ``boot_id`` and ``pidns`` match the writer's;
- anywhere: its ``beat`` has not changed for the lease's own ``lease_timeout`` (each reader
  states its timeout; the writer honours it, bounded to ``MAX_LEASE_TIMEOUT``), measured on the
  writer's monotonic clock, so clock skew between hosts cannot shorten or stretch it.

A dead reader costs the writer one timeout, not one per push: a beat once found dead stays
dead until it changes. A lease dead for another timeout is removed (``DEAD_LEASE_GRACE``).
A starting writer also removes temp files not written for longer than that and a margin,
judged by the store's own clock, and lease files that old once their readers are known to be
gone (``prune_abandoned``: an old file time alone proves nothing where clients stamp files).
A hold blocks only while the slot still holds the version it names: once a writer has judged
the reader dead and rewritten the slot, the hold protects nothing, so a writer started later
(``dbsync push`` once per checkpoint: a new Sender per push, knowing nothing of what earlier
ones saw) does not wait for it again.

Hazard: a reader stalled for longer than its timeout (a debugger, a swapped-out process) loses
its lease and the writer may reuse its slot. The reader detects this afterwards through the
slot stamp (and a reader that cannot renew its lease stops trusting its slot) and raises
``LeaseExpiredError``; it cannot undo what it already applied.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import InvalidArgumentError, SelfHeldSlotError, SlotHeldError
from .format import MAX_LEASE_BYTES, READERS_DIR, SLOTS, FormatError, is_reader_id
from .processes import host_identity, process_start, process_state
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_LEASE_TIMEOUT = 30.0
MIN_LEASE_TIMEOUT = 0.5
MAX_LEASE_TIMEOUT = 3600.0
#: A lease found dead is removed once it has stayed dead for this many more timeouts.
DEAD_LEASE_GRACE = 1.0
#: a push waiting this long for live readers to release a slot says so at WARNING
SLOW_HOLDER_WARN_S = 10.0
#: ... and again every this many seconds while they hold it
SLOW_HOLDER_REPEAT_S = 60.0
READING = "reading"
IDLE = "idle"


def default_reader_id(role: str = "") -> str:
    """A reader id no other process uses: ``<host>-<pid>-<8 hex digits>`` (a new random part
    per call) or, for a ``role``, ``<host>-<pid>-<8 hex digits>-<role>`` (the random part drawn
    once per process: a role's id stays the same for the life of the process). The hostname
    has what ids may not hold replaced by '_' (``(none)``, ``build box``) and is cut to fit.
    The random part keeps apart containers that share a hostname and PIDs (host networking,
    each in its own PID namespace)."""
    if not role:
        token = uuid.uuid4().hex[:8]
    else:
        if _TOKEN[1] != os.getpid():
            _TOKEN[:] = [uuid.uuid4().hex[:8], os.getpid()]
        token = _TOKEN[0]
    tail = f"-{os.getpid()}-{token}" + (f"-{role}" if role else "")
    host = _UNSAFE_IN_ID.sub("_", socket.gethostname()).lstrip(".-") or "host"
    return host[:101 - len(tail)] + tail


_TOKEN: list = ["", 0]  # [this process's random part for roles, the pid it was drawn in]
_UNSAFE_IN_ID = re.compile(r"[^A-Za-z0-9_.\-]")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this PID namespace runs. A zombie (killed, not yet reaped
    by its parent: a reader a trainer started and has not waited for) does not: it holds
    nothing and reads nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return process_state(pid) not in (b"Z", b"X")  # (None, no /proc here: kill's answer)


def lease_pid_alive(lease: dict[str, Any]) -> bool:
    """Whether the process that wrote ``lease`` (its ``pid``, checkable here: see
    ``same_pid_namespace``) still runs: the pid is alive and, where the lease names when its
    process started (``pid_start``), it is that same process, not a later one given the same
    pid (a container restarted with the dead one's hostname and PID-namespace numbers)."""
    pid = lease.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not pid_alive(pid):
        return False
    started = lease.get("pid_start")
    if not isinstance(started, int) or isinstance(started, bool):
        return True  # (a lease of an older dbsync: the pid alone)
    return process_start(pid) in (None, started)


def held_slots(lease: dict[str, Any]) -> set[str]:
    """Slots a lease holds (``held`` list; older records: ``state``/``slot``)."""
    held = lease.get("held")
    if isinstance(held, list):
        return {h[0] for h in held if isinstance(h, list) and h and isinstance(h[0], str)}
    if lease.get("state") == READING and isinstance(lease.get("slot"), str):
        return {lease["slot"]}
    return set()


def held_versions(lease: dict[str, Any], slot: str) -> list[tuple[Any, Any]]:
    """(version, run id) of each hold a lease says it has in ``slot`` (None where a record
    names none: older records name no run)."""
    held = lease.get("held")
    if isinstance(held, list):
        return [(h[1] if len(h) > 1 else None, h[2] if len(h) > 2 else None) for h in held
                if isinstance(h, list) and h and h[0] == slot]
    if lease.get("state") == READING and lease.get("slot") == slot:
        return [(lease.get("version"), None)]
    return []


#: what ``Store.read_stamp`` gives ``holders`` for a slot without a stamp file (no stamp's
#: content can equal it)
NO_STAMP = (object(), None)


def blocks(lease: dict[str, Any], slot: str, stamp: tuple[Any, Any]) -> bool:
    """Whether a (live) lease keeps the writer out of ``slot``, whose stamp names ``stamp``
    (version, run id). A hold of another version (or run) than the slot holds is void: that
    version was already overwritten (after its reader was judged dead), or belongs to an
    earlier store at this path (a new run made it anew), and its reader, if alive, finds out
    from the stamp. A slot without a stamp (``NO_STAMP``) or stamped "writing" holds no version
    anyone could read; where the stamp is unreadable, every hold counts."""
    holds = held_versions(lease, slot)
    if not holds:
        return False
    stamp_version, stamp_run = stamp
    if stamp == NO_STAMP or stamp_version == "writing":
        return False
    if _is_version(stamp_version):
        return any(not _is_version(v) or (v == stamp_version and run in (None, stamp_run))
                   for v, run in holds)
    return True


def _is_version(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def lease_problem(lease: dict[str, Any]) -> str | None:
    """Why a reader file is not a lease any dbsync reader writes, or None. Such a file is not
    listed as a receiver (``dbsync status`` names it), and a writer honours no slot it names:
    every receiver writes these fields, so it is no live reader's, and a garbled file must
    not stall pushes for up to an hour."""
    def number(value: Any) -> bool:
        if isinstance(value, float):
            return math.isfinite(value)
        return isinstance(value, int) and not isinstance(value, bool)

    pid, timeout = lease.get("pid"), lease.get("lease_timeout")
    if not isinstance(lease.get("host"), str) or not lease["host"]:
        return "no host name"
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return f"pid {str(pid)[:20]!r} is not a process id"
    if timeout is not None and not (number(timeout)
                                    and MIN_LEASE_TIMEOUT <= timeout <= MAX_LEASE_TIMEOUT):
        return f"lease_timeout {str(timeout)[:20]!r} is not a number of seconds in " \
               f"[{MIN_LEASE_TIMEOUT}, {MAX_LEASE_TIMEOUT}]"
    if not number(lease.get("updated_at")):
        return "no time of its last renewal (updated_at)"
    return None


def lease_timeout_of(lease: dict[str, Any], default: float) -> float:
    value = lease.get("lease_timeout")
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        return default
    return min(max(float(value), MIN_LEASE_TIMEOUT), MAX_LEASE_TIMEOUT)


def same_pid_namespace(lease: dict[str, Any]) -> bool:
    """Whether the lease's pid can be checked here (same host, boot and PID namespace)."""
    me = host_identity()
    return (lease.get("host") == me["host"] and me["boot_id"] is not None
            and lease.get("boot_id") == me["boot_id"] and me["pidns"] is not None
            and lease.get("pidns") == me["pidns"])


#: Extra age before an abandoned reader file is removed by a starting writer: room for the
#: clocks of clients where a filesystem takes file times from them (Lustre), and for slow
#: heartbeats of a loaded host.
ABANDONED_MARGIN = 60.0
#: the largest note of an old-looking lease a writer reads
MAX_NOTE_BYTES = 4096


#: readers a writer's log line names (the rest are counted)
LISTED_READERS = 20


def _listed(names: list[str], sep: str = "; ") -> str:
    """``names`` joined by ``sep``, the first ``LISTED_READERS`` of them, then how many more
    (500 stale leases made one log line of 500 names)."""
    shown = sep.join(names[:LISTED_READERS])
    more = len(names) - LISTED_READERS
    return f"{shown} and {more} more" if more > 0 else shown


class WaitShare:
    """How much of a writer's recent time went to waiting for readers to release slots:
    ``add(waited, now)`` after each push's wait returns that share of the last ``window``
    seconds when it is at least ``share`` and no such warning was due in the last ``every``
    seconds, else None. (One slow reader sets the push rate of the whole trainer; each wait
    under ``SLOW_HOLDER_WARN_S`` is said only at INFO.)"""

    def __init__(self, window: float = 60.0, share: float = 0.5, every: float = 300.0):
        self.window, self.share, self.every = window, share, every
        self._waits: deque[tuple[float, float]] = deque()  # (ended at, seconds waited)
        self._started: float | None = None
        self._warned: float | None = None

    def add(self, waited: float, now: float) -> float | None:
        if self._started is None:
            self._started = now - waited
        if waited > 0:
            self._waits.append((now, waited))
        while self._waits and self._waits[0][0] < now - self.window:
            self._waits.popleft()
        span = min(self.window, now - self._started)
        if span < self.window / 2:
            return None  # (too little seen yet to speak of a share)
        part = sum(min(w, e - (now - span)) for e, w in self._waits) / span
        if part < self.share or (self._warned is not None and now - self._warned < self.every):
            return None
        self._warned = now
        return part


def prune_abandoned(store: Store, default_timeout: float) -> list[str]:
    """Remove lease files, and receivers' temp files, not written for longer than their
    lease timeout, the grace period and ``ABANDONED_MARGIN`` by the store's own clock (a
    probe file's mtime; never this host's clock), once their readers are known to be gone.
    Returns the names removed.

    Why: a writer removes a dead lease only after watching its beat stand still for two
    timeouts, and a writer started per push (``dbsync push`` once per checkpoint) never
    watches that long, so the files of readers that died on other hosts would pile up in
    ``readers/`` (each read at every push). A live reader rewrites its file every
    ``lease_timeout / 4``.

    An old file time alone does not prove a reader gone: where clients set file times
    (Lustre), a reader whose clock lags, or a clock stepped forward, makes a live lease look
    old, and removing it would let the next push overwrite the slot under that reader. So an
    old lease is removed only when its reader is gone for sure:
    - its pid is checkable here (same host, boot and PID namespace) and gone;
    - else the lease file must be exactly as a starting writer found it at least one lease
      timeout (and ``ABANDONED_MARGIN``) earlier (same beat, same file time), by a note that
      writer left (``readers/.stale-<id>``), the time passed read from that writer's
      monotonic clock: the second writer start on the same host (and boot) after a reader
      died removes its lease; writers that start on other hosts each time leave such leases
      to a long-lived writer's monitor (which judges beats on its own clock). A lease
      renewed since (another beat) is kept, with a WARNING about
      clocks, and its note goes once the lease's file time is recent again.
    Files that are no reader's lease (nothing honours them) go on age alone."""
    now = store.storage_time()
    if now is None:
        return []
    leases = store.read_leases()
    times = store.reader_file_times()
    removed = []
    for name, mtime in times.items():
        if name.startswith((_STALE_NOTE, _DEAD_NOTE)):
            prefix = _STALE_NOTE if name.startswith(_STALE_NOTE) else _DEAD_NOTE
            if f"{name[len(prefix):]}.json" not in times:  # its lease is gone
                store.remove_reader_file(name)
            continue
        reader_id: str | None = None
        if name.endswith(".json") and not name.startswith("."):
            reader_id = name[: -len(".json")]
            lease = leases.get(reader_id)
            timeout = lease_timeout_of(lease or {}, default_timeout)
            if not is_reader_id(reader_id) or (
                    lease is not None and lease_problem(lease) is not None):
                reader_id = None  # no reader's lease: nothing honours it (age alone)
        elif name.startswith((".tmp-", ".probe-")):
            lease, timeout = None, default_timeout
        else:
            continue
        age = now - mtime
        if age <= (1 + DEAD_LEASE_GRACE) * timeout + ABANDONED_MARGIN:
            if reader_id is not None and _STALE_NOTE + reader_id in times:
                store.remove_reader_file(_STALE_NOTE + reader_id)  # (renewed in time now)
            continue
        # (a lease that did not read, caught mid-rewrite or on a transient error, is noted
        # like any other: its file time changes if its reader lives)
        if reader_id is not None and not _reader_gone(store, reader_id, lease or {}, mtime,
                                                      now, timeout, times):
            continue
        log.info("removing %s from %s: not written for %.0f s (its reader is gone)",
                 name, store.readers_dir, age)
        store.remove_reader_file(name)
        if reader_id is not None:
            store.remove_reader_file(_STALE_NOTE + reader_id)
        removed.append(name)
    return removed


#: prefix of a starting writer's note of an old-looking lease (see ``prune_abandoned``): the
#: lease's beat and file time as that writer found them
_STALE_NOTE = ".stale-"
#: prefix of a writer's note of a lease it watched stand still for the lease's timeout: the
#: lease as it read it (see ``LeaseMonitor._dead_for``)
_DEAD_NOTE = ".dead-"


def _read_note(store: Store, name: str, limit: int) -> dict[str, Any] | None:
    """A writer's note in ``readers/`` as a JSON object, or None (absent, unreadable,
    garbled)."""
    try:
        raw = store.read_small((READERS_DIR, name), limit)
        noted = None if raw is None else json.loads(raw)
    except (OSError, ValueError, RecursionError, FormatError):
        return None
    return noted if isinstance(noted, dict) else None


def _reader_gone(store: Store, reader_id: str, lease: dict[str, Any], mtime: float,
                 now: float, timeout: float, times: dict[str, float]) -> bool:
    """For ``prune_abandoned``: whether the reader of an old-looking lease is gone for sure
    (see there); notes the lease for a later writer when that cannot be told yet. ``times``:
    the file times of ``readers/``.

    How long ago a note was left is read from this host's monotonic clock, recorded in the
    note, never from file times: where clients stamp files with their own clocks (Lustre), a
    note left by a writer whose clock lagged looked old at once, and the next writer removed
    a live reader's lease that had not beaten since (it renews every ``timeout / 4``). A
    note left on another host (or boot) says nothing of the time passed: it is noted again."""
    if lease and same_pid_namespace(lease) and not lease_pid_alive(lease):
        return True
    # (a live pid here may be another process's by now: the beat decides, as elsewhere)
    seen = {"beat": lease.get("beat"), "mtime": mtime}
    note = _STALE_NOTE + reader_id
    clock = _monotonic_clock_id()
    if note in times:
        noted = _read_note(store, note, MAX_NOTE_BYTES)  # (None: written again below)
        if isinstance(noted, dict) and {k: noted.get(k) for k in seen} == seen:
            noted_at = noted.get("noted_at")
            if (clock is not None and _same_clock(noted.get("clock"), clock)
                    and isinstance(noted_at, int | float) and not isinstance(noted_at, bool)):
                # (stood still since it was noted, by this host's clock: gone once a timeout
                # and the margin for a loaded host's heartbeats passed; else a later writer)
                return time.monotonic() - noted_at >= timeout + ABANDONED_MARGIN
        elif isinstance(noted, dict) and noted.get("beat") != seen["beat"]:
            log.warning("reader %s renews its lease in %s, but its file was last written %.0f "
                        "s ago by the store's clock: kept. Check the clocks of its host and of "
                        "the file server (NTP)", reader_id, store.readers_dir, now - mtime)
    if clock is None:
        return False  # (no clock to measure the time passed: such leases stay)
    try:
        store.write_reader_file(note, json.dumps(
            {**seen, "clock": clock, "noted_at": time.monotonic()}).encode())
    except OSError as exc:
        log.info("could not note reader %s's old-looking lease in %s (%s); it stays",
                 reader_id, store.readers_dir, exc)
    return False


def _same_clock(noted: Any, clock: list[Any]) -> bool:
    """Whether a note's clock is ``clock``: the same boot and time namespace. The host name
    is kept in notes for people to read, not compared: containers of one machine (a new pod
    per trainer start) have names of their own but one monotonic clock, and a note of the
    last one must count for the next."""
    return isinstance(noted, list) and len(noted) == len(clock) and noted[1:] == clock[1:]


def _monotonic_clock_id() -> list[Any] | None:
    """What ``time.monotonic()`` values are comparable across: this boot (a random id per
    boot of a machine) and time namespace, with the host name for the reader of a note
    (None where the boot cannot be told)."""
    me = host_identity()
    if me["boot_id"] is None:
        return None
    try:
        timens = os.stat("/proc/self/ns/time").st_ino
    except OSError:
        timens = None
    return [me["host"], me["boot_id"], timens]


class ReaderIdInUse(Exception):
    """Raised by ``claim_reader_id``; its message names the live reader."""


#: (store directory (device, inode), reader id) of the open receivers of this process that
#: write leases
_CLAIMED: set[tuple[Any, str]] = set()
_CLAIMED_LOCK = threading.Lock()


#: claim -> {hold token: (slot, the thread that took the hold)} of this process's receivers:
#: a writer of this process learns from it that a slot it waits for is held by its own thread
_HOLDS: dict[tuple[Any, str], dict[int, tuple[str, int]]] = {}


def _forget_claims_in_child() -> None:  # a forked child has none of its parent's receivers
    global _CLAIMED_LOCK
    _CLAIMED.clear()
    _HOLDS.clear()
    _LOADERS.clear()
    _CLAIMED_LOCK = threading.Lock()


def note_hold(claim: tuple[Any, str] | None, token: int, slot: str) -> None:
    """Record that the calling thread holds ``slot`` under ``claim`` (a receiver's claim on its
    reader id) with hold ``token``; ``forget_hold`` ends it."""
    if claim is not None:
        with _CLAIMED_LOCK:
            _HOLDS.setdefault(claim, {})[token] = (slot, threading.get_ident())


def forget_hold(claim: tuple[Any, str] | None, token: int) -> None:
    if claim is not None:
        with _CLAIMED_LOCK:
            holds = _HOLDS.get(claim)
            if holds is not None:
                holds.pop(token, None)
                if not holds:
                    del _HOLDS[claim]


def held_by_thread(store: Store, reader_id: str, slot: str, thread: int) -> bool:
    """Whether thread ``thread`` of this process holds ``slot`` of ``store`` as ``reader_id``."""
    key = _claim_key(store, reader_id)
    with _CLAIMED_LOCK:
        return any(h == (slot, thread) for h in _HOLDS.get(key, {}).values())


#: claim -> the thread that last recorded a load under it (``note_loader``)
_LOADERS: dict[tuple[Any, str], int] = {}


def note_loader(claim: tuple[Any, str] | None) -> None:
    """Record that the calling thread applied a version under ``claim``."""
    if claim is not None:
        with _CLAIMED_LOCK:
            _LOADERS[claim] = threading.get_ident()


def loaded_by_thread(store: Store, reader_id: str, thread: int) -> bool:
    """Whether thread ``thread`` of this process made the last load of ``reader_id``."""
    with _CLAIMED_LOCK:
        return _LOADERS.get(_claim_key(store, reader_id)) == thread


def of_this_process(lease: dict[str, Any]) -> bool:
    """Whether ``lease`` was written by this process (same host, boot, PID namespace, pid)."""
    return same_pid_namespace(lease) and lease.get("pid") == os.getpid()


os.register_at_fork(after_in_child=_forget_claims_in_child)


def check_lease_timeout(value: Any) -> float:
    """``value`` as a lease timeout in seconds; raises ``DBSyncError`` unless it is a number
    in [MIN_LEASE_TIMEOUT, MAX_LEASE_TIMEOUT]."""
    if not (isinstance(value, int | float) and not isinstance(value, bool)
            and MIN_LEASE_TIMEOUT <= value <= MAX_LEASE_TIMEOUT):
        raise InvalidArgumentError(f"lease_timeout must be between {MIN_LEASE_TIMEOUT:g} and "
                          f"{MAX_LEASE_TIMEOUT:g} seconds, not {value!r}")
    return float(value)


def claim_reader_id(store: Store, reader_id: str, sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> tuple[Any, str]:
    """Claim ``reader_id`` in ``store`` for a new receiver of this process; returns the claim
    (give it to ``release_reader_id`` when the receiver ends). Raises ``ReaderIdInUse`` if
    another live receiver uses that id: two receivers sharing an id overwrite each other's
    lease, so the writer may reuse a slot one of them still reads.

    Live means: an open receiver of this process; a live pid, for a lease written in this
    PID namespace; a beat that moves within the lease's own timeout, for a lease from another
    host or namespace (waited for: a reader restarted elsewhere under the same id starts after
    at most its predecessor's timeout, once that lease stood still)."""
    key = _claim_key(store, reader_id)
    with _CLAIMED_LOCK:
        if key in _CLAIMED:
            raise ReaderIdInUse(f"another open Receiver of this process (pid {os.getpid()}) "
                                "uses it")
        _CLAIMED.add(key)
    try:
        _wait_until_unused(store, reader_id, sleep, clock)
    except BaseException:
        release_reader_id(key)
        raise
    return key


def _claim_key(store: Store, reader_id: str) -> tuple[Any, str]:
    """What a receiver's claim on ``reader_id`` in ``store`` is recorded under."""
    return _directory_identity(store.root), reader_id


def _directory_identity(path: str) -> Any:
    """What makes two paths one directory: its device and inode (the same store reached
    through two bind mounts has two real paths), else its real path."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (st.st_dev, st.st_ino)


def release_reader_id(claim: tuple[Any, str] | None) -> None:
    """End a claim made by ``claim_reader_id`` (None: nothing to end)."""
    if claim is not None:
        with _CLAIMED_LOCK:
            _CLAIMED.discard(claim)
            _LOADERS.pop(claim, None)
            _HOLDS.pop(claim, None)


def _wait_until_unused(store: Store, reader_id: str, sleep: Callable[[float], None],
                       clock: Callable[[], float]) -> None:
    lease = store.read_lease(reader_id)
    if lease is None:
        return
    pid = lease.get("pid")
    if same_pid_namespace(lease):
        if isinstance(pid, int) and pid != os.getpid() and lease_pid_alive(lease):
            raise ReaderIdInUse(
                f"its lease was written by process {pid} on this host, which is alive (if that "
                f"is not a dbsync receiver, remove {store.lease_path(reader_id)})")
        return  # its process is gone (or was this one): the lease is stale
    timeout = lease_timeout_of(lease, DEFAULT_LEASE_TIMEOUT)
    beat, start = lease.get("beat"), clock()
    log.log(logging.WARNING if timeout > 10 else logging.INFO,
            "reader id %s has a lease in %s from host %s (pid %s); waiting up to %.0f s to see "
            "whether that reader still lives (a live one refuses this receiver)", reader_id,
            store.root, lease.get("host"), lease.get("pid"), timeout)
    while clock() - start < timeout:
        sleep(min(timeout / 8, 1.0))
        again = store.read_lease(reader_id)
        if again is None:
            return
        if again.get("beat") != beat:
            raise ReaderIdInUse(f"a reader on host {again.get('host')} (pid "
                                f"{again.get('pid')}) renews its lease")
    log.info("the lease of reader id %s in %s stood still for %.0f s: taking it over",
             reader_id, store.root, timeout)


def _holding_everything(reader_id: str) -> dict[str, Any]:
    """A stand-in for a lease that exists but was never read: it holds every slot (whatever
    version), renews nothing, names no process this host could look up, and has the longest
    lease timeout a reader may set (a writer waits that long, with a WARNING, unless the file
    reads well again or is removed)."""
    return {"reader_id": reader_id, "host": "(lease unreadable)", "pid": 1, "beat": None,
            "held": [[slot, None, None] for slot in SLOTS], "updated_at": 0.0,
            "lease_timeout": MAX_LEASE_TIMEOUT}  # (its own, perhaps long, is not known)


class LeaseMonitor:
    """The writer's view of reader leases: which live readers hold a slot."""

    def __init__(self, store: Store, timeout: float = DEFAULT_LEASE_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.timeout = timeout
        self.clock = clock
        # reader_id -> (beat last seen, when this writer first saw that beat)
        self._seen: dict[str, tuple[Any, float]] = {}
        #: reader files found not to be leases (logged once each)
        self._ignored: set[str] = set()
        #: dead readers whose lease this writer may not remove (warned once each)
        self._unremovable: set[str] = set()
        self._timeouts: dict[str, float] = {}  # reader_id -> its lease's own timeout
        self._live: dict[str, dict[str, Any]] = {}  # the live leases of the last holders()
        self._dead: set[str] = set()  # the dead readers of the last holders()
        #: reader id -> its lease as last read (stands in while its file cannot be read)
        self._last_read: dict[str, dict[str, Any]] = {}
        self._unreadable_told: set[str] = set()  # (logged once per spell)
        #: readers whose death this writer noted for later writers (``_DEAD_NOTE``)
        self._noted_dead: set[str] = set()

    def _dead_for(self, reader_id: str, lease: dict[str, Any], now: float,
                  read: bool = True) -> float | None:
        """Seconds past death (>= 0) if the lease is dead, else None. ``read``: ``lease`` is
        the file as read now (not a stand-in for a file that did not read: no note then).

        A lease is dead once its beat stood still for its timeout, watched by this writer;
        or at first sight, when an earlier writer watched it do so and left a note of the
        lease as it was (``readers/.dead-<id>``), and the lease is still exactly that (a live
        reader rewrites it, with a new ``updated_at``, every ``timeout / 4``). Writers started
        per push (``dbsync push --max-lag``) otherwise each waited a whole lease timeout
        for a reader that died on another host, push after push, until its lease was
        removed."""
        if same_pid_namespace(lease) and isinstance(lease.get("pid"), int) and (
                not lease_pid_alive(lease)):
            return float("inf")
        beat = (lease.get("beat"), lease.get("held"), lease.get("version"))
        first = self._seen.get(reader_id)
        timeout = lease_timeout_of(lease, self.timeout)
        self._timeouts[reader_id] = timeout
        if first is None and read and self._noted_dead_before(reader_id, lease):
            self._seen[reader_id] = (beat, now - timeout)
            self._noted_dead.add(reader_id)
            return 0.0
        if first is None or first[0] != beat:
            self._seen[reader_id] = (beat, now)
            self._noted_dead.discard(reader_id)
            return None
        overdue = now - first[1] - timeout
        if overdue < 0:
            return None
        if read and reader_id not in self._noted_dead:
            self._noted_dead.add(reader_id)
            try:
                self.store.write_reader_file(_DEAD_NOTE + reader_id,
                                             json.dumps(lease, sort_keys=True).encode())
            except OSError as exc:  # (only later writers lose: they watch it themselves)
                log.debug("could not note the death of reader %s: %s", reader_id, exc)
        return overdue

    def _noted_dead_before(self, reader_id: str, lease: dict[str, Any]) -> bool:
        """Whether an earlier writer noted this very lease dead (see ``_dead_for``)."""
        noted = _read_note(self.store, _DEAD_NOTE + reader_id, MAX_LEASE_BYTES)
        return noted is not None and noted == json.loads(json.dumps(lease))

    def _beat_of(self, reader_id: str) -> Any:
        """The reader's beat as last seen (what changes each time it renews its lease)."""
        seen = self._seen.get(reader_id)
        return None if seen is None else seen[0]

    def expires_in(self, reader_ids: list[str]) -> float | None:
        """Seconds until the first of these leases would be dead if its beat stays as last
        seen (None if unknown): a waiting writer looks again then, not a poll later."""
        now = self.clock()
        due = [self._seen[r][1] + self._timeouts[r] - now for r in reader_ids
               if r in self._seen and r in self._timeouts]
        return max(0.0, min(due)) if due else None

    def scan(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """(live reader id -> its lease record, dead reader ids). Removes leases that have
        been dead for longer than the grace period."""
        now = self.clock()
        unreadable: dict[str, str] = {}
        foreign: dict[str, str] = {}
        leases = self.store.read_leases(unreadable, foreign)
        self._last_read.update(leases)
        for reader_id, why in foreign.items():
            if reader_id not in self._ignored:
                self._ignored.add(reader_id)
                log.warning("ignoring %s/%s.json: not a reader's lease (%s); remove it",
                            self.store.readers_dir, reader_id, why)
        for reader_id, why in unreadable.items():
            # Not "gone": that reader may be alive and hold a slot. It counts as its lease
            # last read (dead once that stops changing for its timeout), or, never read, as
            # holding every slot until then; its file is never removed while unreadable.
            leases[reader_id] = self._last_read.get(reader_id) or _holding_everything(reader_id)
            if reader_id not in self._unreadable_told:
                self._unreadable_told.add(reader_id)
                log.warning("cannot read the lease of reader %s in %s (%s); counting it as "
                            "holding what it held when last read (every slot, for up to %.0f s, "
                            "if never read) until it reads well or its lease timeout passes; "
                            "remove the file if no such reader runs",
                            reader_id, self.store.readers_dir, why, MAX_LEASE_TIMEOUT)
        self._unreadable_told &= set(unreadable)
        live: dict[str, dict[str, Any]] = {}
        dead: list[str] = []
        for reader_id, lease in leases.items():
            problem = lease_problem(lease)
            if problem is not None:
                if reader_id not in self._ignored:
                    self._ignored.add(reader_id)
                    log.warning("ignoring %s/%s.json: not a reader's lease (%s); remove it",
                                self.store.readers_dir, reader_id, problem)
                continue
            overdue = self._dead_for(reader_id, lease, now, read=reader_id not in unreadable)
            if overdue is None:
                live[reader_id] = lease
                self._unremovable.discard(reader_id)  # (alive again: warned anew if it dies)
                continue
            dead.append(reader_id)
            if (overdue >= DEAD_LEASE_GRACE * lease_timeout_of(lease, self.timeout)
                    and reader_id not in self._unremovable and reader_id not in unreadable):
                log.info("removing the lease of dead reader %s (host %s, pid %s)", reader_id,
                         lease.get("host"), lease.get("pid"))
                try:
                    self.store.remove_lease(reader_id)
                except OSError as exc:  # a dead lease holds nothing: go on without removing it
                    self._unremovable.add(reader_id)
                    log.warning(
                        "could not remove %s/%s.json, the lease of dead reader %s (%s); it "
                        "holds nothing and is ignored, but stays listed until it is removed "
                        "(by its owner, or by a user who may write to %s)",
                        self.store.readers_dir, reader_id, reader_id,
                        exc.strerror or exc, self.store.readers_dir)
                    continue
                self._seen.pop(reader_id, None)
                with contextlib.suppress(OSError):
                    self.store.remove_reader_file(_DEAD_NOTE + reader_id)
        for gone in set(self._seen) - set(leases):
            del self._seen[gone]
        for gone in set(self._last_read) - set(leases):
            del self._last_read[gone]
        for gone in set(self._timeouts) - set(leases):
            del self._timeouts[gone]
        self._unremovable &= set(leases)
        return live, dead

    def _describe(self, reader_id: str) -> str:
        lease = self._live.get(reader_id, {})
        me = host_identity()
        elsewhere = ""  # (a pid of this host's name that means another process than here's)
        if lease.get("host") == me["host"] and not same_pid_namespace(lease):
            elsewhere = (" of another boot" if lease.get("boot_id") != me["boot_id"]
                         else " in another PID namespace")
        if of_this_process(lease):
            elsewhere = ": this process"
        return (f"{reader_id} (host {str(lease.get('host'))[:64]}, pid "
                f"{str(lease.get('pid'))[:16]}{elsewhere}, holding version "
                f"{str(lease.get('version'))[:16]})")

    def holders(self, slot: str) -> list[str]:
        """Reader ids whose live lease holds the version ``slot`` holds, right now."""
        live, dead = self.scan()
        self._live, self._dead = live, set(dead)
        if not any(slot in held_slots(lease) for lease in live.values()):
            return []
        stamp = self.store.read_stamp(slot, absent=NO_STAMP)
        return sorted(r for r, lease in live.items() if blocks(lease, slot, stamp))

    def wait_until_free(self, slot: str, sleep: Callable[[float], Any] | None = None,
                        interval: float = 0.02, stop: threading.Event | None = None,
                        waiter: int | None = None, timeout: float | None = None) -> float:
        """Block until no live reader holds ``slot``, or ``stop`` is set (the wait sleeps on
        it, so it ends at once). Returns the seconds waited. Waits at most about the longest
        lease timeout for a reader that stopped beating; for live readers that hold it, as
        long as they do, or ``timeout`` seconds (then ``SlotHeldError``, naming them; a reader
        counts as live once its lease moved during this wait, so the wait may run past
        ``timeout`` until a beat or the lease timeout is seen). Warns after
        ``SLOW_HOLDER_WARN_S`` and again every ``SLOW_HOLDER_REPEAT_S``.

        ``waiter``: the thread that waits for this (a blocking push's caller). Raises
        ``SelfHeldSlotError`` at once if that thread itself holds the slot through a receiver
        of this process (a push inside ``with receiver.open()``): it would wait for ever."""
        if sleep is None:
            sleep = time.sleep if stop is None else stop.wait
        start = self.clock()
        told = 0  # 1: said at INFO; 2: warned (a reader holds the slot for long)
        warned_at = 0.0
        first_beats: dict[str, Any] = {}  # each holder's beat when this wait first saw it
        held_by: list[str] = []
        while not (stop is not None and stop.is_set()) and (holding := self.holders(slot)):
            held_by = holding
            here = [r for r in holding if of_this_process(self._live.get(r, {}))]
            if waiter is not None:
                for reader_id in here:
                    if held_by_thread(self.store, reader_id, slot, waiter):
                        raise SelfHeldSlotError(
                            f"this thread holds version {self._live[reader_id].get('version')} "
                            f"of {self.store.root} open (receiver {reader_id}: a `with "
                            "receiver.open()` block or a Snapshot not closed yet), in the slot "
                            "this push must write: the push would wait for ever. Close the "
                            "snapshot before pushing (copy what you keep of it first, e.g. "
                            "`snap.tensordict().clone()`), or push from another thread; nothing "
                            "was published")
            waited = self.clock() - start
            if told < 2 and here and waited > 1.0:
                log.warning(
                    "the push waits for reader(s) %s of this process (pid %d) to release slot "
                    "%s of %s: a snapshot opened here (`with receiver.open()`, a Snapshot not "
                    "closed) holds it; the push goes on once it is closed", ", ".join(here),
                    os.getpid(), slot, self.store.root)
                told = 2
            elif told < 1 and waited > 1.0:
                log.info("waiting for reader(s) %s to release slot %s", _listed(holding, ", "),
                         slot)
                told = 1
            elif (told < 2 and waited > SLOW_HOLDER_WARN_S) or (
                    told == 2 and not here and waited - warned_at > SLOW_HOLDER_REPEAT_S):
                log.warning(
                    "the push has waited %.0f s for reader(s) %s to release slot %s of %s: a "
                    "writer never overwrites a version a live reader holds. It goes on once they "
                    "release it, or once they stop renewing their lease (dead after their lease "
                    "timeout); stop or close those readers to publish now (a Sender's "
                    "reader_timeout, `dbsync push --reader-timeout`, bounds the wait)",
                    waited, _listed([self._describe(r) for r in holding]), slot,
                    self.store.root)
                told, warned_at = 2, waited
            # (``timeout`` bounds the wait for readers seen alive: their lease moved during
            # it. One that stood still since is waited out to its lease timeout instead: a
            # stopped or crashed reader is then judged dead, and a later push must not refuse
            # for ever because each new writer starts that clock again.)
            for r in holding:
                first_beats.setdefault(r, self._beat_of(r))
            beating = [r for r in holding if self._beat_of(r) != first_beats[r]]
            if timeout is not None and waited >= timeout and beating:
                raise SlotHeldError(
                    f"reader(s) {_listed([self._describe(r) for r in beating])} held slot "
                    f"{slot} of {self.store.root} for {waited:.1f} s, renewing their lease, "
                    f"longer than the push's reader_timeout ({timeout:g} s); nothing was "
                    "published. A writer never overwrites a version a live reader holds: stop "
                    "or close those readers, or give them longer")
            due = self.expires_in(holding)
            if timeout is not None and waited < timeout:
                due = timeout - waited if due is None else min(due, timeout - waited)
            # a small margin past the expiry, so the look that follows finds it dead
            sleep(interval if due is None else min(interval, max(due, 0.0) + 0.005))
            interval = min(interval * 1.5, 0.25)
        dead = [r for r in held_by if r in self._dead]  # (not those that closed)
        # (a reader that stopped beating while it held the slot, waited out for its lease
        # timeout, is news: a stopped or hung engine; one whose process is gone is seen dead
        # at once, and is not)
        waited_out = bool(dead) and self.clock() - start > 0.25
        if (told or waited_out) and not (stop is not None and stop.is_set()):
            level = logging.WARNING if waited_out else logging.INFO
            log.log(level, "slot %s of %s is free after %.1f s: %s", slot, self.store.root,
                     self.clock() - start, "; ".join(
                         [f"{_listed(dead, ', ')} judged dead (its lease timeout passed, or its "
                          "process is gone): a snapshot it still reads is no longer "
                          "protected"] * bool(dead)
                         + [f"{_listed([r for r in held_by if r not in dead], ', ')} "
                            "released it"] * any(r not in dead for r in held_by)))
        return self.clock() - start
