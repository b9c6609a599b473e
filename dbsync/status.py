"""What a store holds and who reads it: the data behind ``dbsync status`` and
``Sender.wait_for_receivers``. Imports no torch.

Receivers on a read-only view of the store cannot write leases: they are invisible here, and
``wait_for_receivers`` cannot count them (it says so when it times out).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, NamedTuple

from .errors import DBSyncError, ReceiverRefusedError, check_int, check_seconds
from .format import SLOTS, SLOTS_DIR, WRITER_LOCK_FILE
from .leases import (
    DEFAULT_LEASE_TIMEOUT,
    READING,
    held_slots,
    lease_pid_alive,
    lease_problem,
    lease_timeout_of,
    same_pid_namespace,
)
from .store import WRITING, Store, parse_lock_record

#: the most bytes of the writer lock's record read (a few dozen in practice)
MAX_LOCK_RECORD_BYTES = 4096
_NUMBER = re.compile(r"[0-9]{1,20}")

LIVE, IDLE, DEAD, REFUSED = "live", "idle", "dead", "refused"
#: not renewed for longer than its lease timeout (but not yet twice it): a writer waits at most
#: one more lease timeout for it, then may reuse a slot it reads (a stopped, hung or starved
#: process?)
STALE = "stale"


def printable(text: str, keep: str = "") -> str:
    """``text`` with characters a terminal would act on (escape sequences, carriage returns,
    newlines) shown escaped, but those in ``keep``. A store's host names, reader ids and
    refusal reasons are anyone's text: shown raw, they could drive a terminal or forge
    lines of their own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def loaded_versions(leases: dict[str, dict[str, Any]], run_id: str | None = None
                    ) -> dict[str, int]:
    """reader id -> loaded version, for leases that report loads; with ``run_id``, only
    loads of that training run (a version number of an earlier run at the same path says
    nothing of this run's: its numbers start again at 1). A lease naming no run counts."""
    return {r: lease["loaded_version"] for r, lease in leases.items()
            if isinstance(lease.get("loaded_version"), int)
            and not isinstance(lease.get("loaded_version"), bool)
            and (run_id is None or lease.get("loaded_run_id") in (None, run_id))}


def _current_run(store: Store) -> str | None:
    head = _head_or_none(store)
    return None if head is None else head.run_id


class Refusal(NamedTuple):
    """A receiver's latest refusal or failed apply, as its lease records it."""

    version: int
    reason: str
    #: the refused version's run (None: unknown, or written by a release before 0.3.1)
    run_id: str | None

    def of_run(self, run: str | None) -> bool:
        """Whether it may be a refusal of ``run`` (either unknown counts as yes)."""
        return run is None or self.run_id is None or self.run_id == run


def refusal_of(lease: dict[str, Any]) -> Refusal | None:
    """The receiver's latest refusal or failed apply, if any."""
    refused = lease.get("refused")
    if not isinstance(refused, dict) or not isinstance(refused.get("version"), int):
        return None
    run = refused.get("run_id")
    return Refusal(refused["version"], str(refused.get("reason", ""))[:2000],
                   run if isinstance(run, str) else None)


def refusal_stands(lease: dict[str, Any], current_run: str | None = None) -> bool:
    """Whether the receiver's refusal is not covered by what it loaded since: a version of
    the refusal's run at least as new (a load of another run before a refusal does not
    cover it: versions of two runs are not compared). A refusal of another run than the
    store's current one (``current_run``, where known) does not stand either."""
    refused = refusal_of(lease)
    if refused is None or not refused.of_run(current_run):
        return False
    loaded = lease.get("loaded_version")
    return not (refused.of_run(lease.get("loaded_run_id")) and isinstance(loaded, int)
                and loaded >= refused.version)


def state_of(lease: dict[str, Any], now: float | None = None,
             current_run: str | None = None) -> str:
    """live (holding a slot), idle, refused, stale (not renewed for its lease timeout: a
    writer waits at most one more lease timeout for it), or dead: its process is gone
    (checked only where
    its pid means something here: same host, boot and PID namespace), or it was not
    refreshed for twice its own lease timeout (judged by ``updated_at``, which ``receivers``
    takes from the store's clock where it can, so only for display; the writer never uses
    this)."""
    now = time.time() if now is None else now
    pid = lease.get("pid")
    if same_pid_namespace(lease) and isinstance(pid, int) and not isinstance(pid, bool) and (
            pid > 0 and not lease_pid_alive(lease)):
        return DEAD
    updated = lease.get("updated_at")
    timeout = lease_timeout_of(lease, DEFAULT_LEASE_TIMEOUT)
    if isinstance(updated, int | float) and now - updated > 2 * timeout:
        return DEAD
    if isinstance(updated, int | float) and now - updated > timeout:
        return STALE
    if refusal_stands(lease, current_run):
        return REFUSED
    return LIVE if held_slots(lease) or lease.get("state") == READING else IDLE


def receivers(store: Store, malformed: dict[str, str] | None = None
              ) -> list[dict[str, Any]]:
    """One record per registered receiver: host, loaded version, lag, last seen, state.
    Reader files that are not leases (``leases.lease_problem``) are left out; ``malformed``,
    if given, gets reader id -> why."""
    head = _head_or_none(store)
    current = None if head is None else head.version
    current_run = None if head is None else head.run_id
    out = []
    now = time.time()
    ages = _ages_by_store_clock(store)
    for reader_id, lease in sorted(store.read_leases().items()):
        problem = lease_problem(lease)
        if problem is not None:
            if malformed is not None:
                malformed[reader_id] = problem
            continue
        loaded = lease.get("loaded_version")
        loaded_run = lease.get("loaded_run_id")
        refused = refusal_of(lease)
        updated = lease.get("updated_at")
        age = ages.get(f"{reader_id}.json")
        if age is not None:  # (its host's clock may differ from this one's: not trusted)
            updated = now - age
            lease = dict(lease, updated_at=updated)
        out.append({
            "id": reader_id,
            "host": lease.get("host"),
            "pid": lease.get("pid"),
            "state": state_of(lease, now, current_run),
            "version": loaded,
            "run_id": lease.get("loaded_run_id"),
            # (versions of two runs are not compared: no lag for a version of another run)
            "lag": None if current is None or not isinstance(loaded, int) or (
                loaded_run is not None and current_run is not None
                and loaded_run != current_run) else current - loaded,
            "last_seen": updated,
            "seconds_since_seen": (now - updated) if isinstance(updated, int | float) else None,
            "refused": None if refused is None else refused._asdict(),
            #: [slot, version] of every version it holds open now (a writer does not
            #: overwrite a slot a live receiver holds)
            "holding": _holding(lease),
            "lease_timeout": lease.get("lease_timeout"),
            "reads_format": lease.get("reads_format"),  # (None: a release before 0.3)
        })
    return out


def _holding(lease: dict[str, Any]) -> list[list[Any]]:
    """[slot, version] of each hold a lease records (a version None where it names none)."""
    held = lease.get("held")
    out = []
    for h in held if isinstance(held, list) else []:
        if isinstance(h, list) and h and isinstance(h[0], str) and h[0] in SLOTS:
            version = h[1] if len(h) > 1 and isinstance(h[1], int) else None
            out.append([h[0], version])
    if not out and lease.get("state") == READING and lease.get("slot") in SLOTS:
        version = lease.get("version")
        out.append([lease["slot"], version if isinstance(version, int) else None])
    return sorted(out, key=lambda h: (h[0], h[1] or 0))


def _ages_by_store_clock(store: Store) -> dict[str, float]:
    """Seconds since each reader file was written, by the store's own clock (its files'
    mtimes against a probe's: on NFS the server stamps both, so a reader host whose clock
    lags is not shown "dead"). Where this process cannot write a probe (a read-only view),
    the mtimes are taken against this host's clock: right on the store's own host, and off
    only by this host's skew to the store's, the same for every reader (the leases' own
    ``updated_at`` would add each reader host's skew: a live reader whose clock lags 40 s
    was shown dead)."""
    storage_now = store.storage_time()
    if storage_now is None:
        storage_now = time.time()
    return {name: max(0.0, storage_now - mtime)
            for name, mtime in store.reader_file_times().items()}


def _head_or_none(store: Store) -> Any:
    try:
        return store.read_head()
    except DBSyncError:
        return None


def receivers_at(store: Store, version: int) -> list[str]:
    """Ids of receivers that report ``version`` or newer loaded (reads only the leases)."""
    return sorted(r for r, v in loaded_versions(_leases(store), _current_run(store)).items()
                  if v >= version)


def _leases(store: Store) -> dict[str, dict[str, Any]]:
    """The reader files that are leases (``leases.lease_problem``): what status lists and
    what waiting for receivers counts."""
    return {r: lease for r, lease in store.read_leases().items() if lease_problem(lease) is None}


def wait_for_receivers(store: Store, version: int, count: int, timeout: float | None = None,
                       interval: float = 0.1) -> bool:
    """Wait until at least ``count`` receivers report ``version`` (or newer) loaded. Returns
    False on timeout. Raises ``ReceiverRefusedError`` as soon as a receiver reports that it
    refused or failed to apply ``version`` (or newer), naming it and the reason. Needs no
    writer lock: any process may wait."""
    timeout = check_seconds(timeout, "timeout", none="wait as long as it takes")
    check_int(version, "version", 1)
    check_int(count, "count", 0)
    deadline = None if timeout is None else time.monotonic() + timeout
    run = _current_run(store)  # (loads of an earlier run at this path do not count)
    while True:
        leases = _leases(store)
        loaded = loaded_versions(leases, run)
        if sum(1 for v in loaded.values() if v >= version) >= count:
            return True
        refusals = {}
        for r, lease in leases.items():
            refused = refusal_of(lease)
            # (a refusal of a newer version by a receiver that did load this one is not a
            # failure of this one: a pipelined trainer waits for v while v+1 is refused; nor
            # is a refusal of an earlier run's version)
            if (refused is not None and refused.version >= version and refused.of_run(run)
                    and loaded.get(r, 0) < min(refused.version, version)):
                refusals[r] = f"version {refused.version}: {refused.reason}"
        if refusals:
            listing = "; ".join(f"{printable(r)} refused {printable(why)}"
                                for r, why in sorted(refusals.items()))
            raise ReceiverRefusedError(
                f"{len(refusals)} receiver(s) did not apply version {version}: {listing}",
                refusals,
            )
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def next_slot(store: Store, current: str) -> dict[str, Any] | None:
    """The slot the current version is not in, while it is marked as being written: who
    writes it (the writer lock's record: ``writer``) and, where that process can be checked
    from here (same host, boot and PID namespace), whether it still runs (``writer_alive``;
    None where it cannot be told). None when that slot holds a version or nothing. A push
    killed before its flip leaves this (nothing is lost: the next push reuses the slot).
    Hazard: read while a writer flips, the answer may already be out of date."""
    other = next(s for s in SLOTS if s != current)
    try:
        if store.read_stamp(other)[0] != WRITING:
            return None
        raw = store.read_small((WRITER_LOCK_FILE,), MAX_LOCK_RECORD_BYTES)
    except (DBSyncError, OSError):  # (a stamp or lock file that is no such record: nothing
        return None  # to say here; the current version's checks are what status reports)
    lock = parse_lock_record((raw or b"").decode("utf-8", "replace"))
    if lock is None:
        return {"slot": other, "writer": None, "writer_alive": None}

    def number(text: str | None) -> int | None:
        return int(text) if text is not None and _NUMBER.fullmatch(text) else None

    record = {"host": lock["host"], "pid": int(lock["pid"]), "boot_id": lock.get("boot"),
              "pidns": number(lock.get("pidns")), "pid_start": number(lock.get("start"))}
    alive = lease_pid_alive(record) if same_pid_namespace(record) else None
    return {"slot": other, "writer": f"{lock['host']} pid {lock['pid']}", "writer_alive": alive}


def store_status(store: Store) -> dict[str, Any]:
    head = store.read_head()
    writable = store.writable()
    malformed: dict[str, str] = {}
    base = {"root": store.root, "receivers": receivers(store, malformed),
            "malformed_reader_files": malformed, "leases_writable": writable}
    if not writable:
        read_only = store.mounted_read_only()
        base["note"] = ("this view of the store is read-only: receivers reading through "
                        "read-only views cannot register and are not listed" if read_only else
                        f"readers/ is not writable by this user (uid {os.geteuid()}): receivers "
                        "running as this user read without a lease and are not listed")
    if head is None:
        if not os.path.isdir(os.path.join(store.root, SLOTS_DIR)):
            empty = (f"{store.root} holds no store files: nothing was ever published here. "
                     "If the store lives on another volume, check that it is mounted (a "
                     "Sender would start a new store in this directory)")
            base["note"] = f"{base['note']}. {empty}" if "note" in base else empty
        return {**base, "version": None}
    other = next(s for s in SLOTS if s != head.slot)
    return {
        **base,
        "next_slot": next_slot(store, head.slot),
        # (the next push writes the other slot: a live or stale receiver holding it there
        # makes that push wait, for a stale one at most its lease timeout)
        "next_push_waits_for": [r["id"] for r in base["receivers"] if r["state"] != DEAD
                                and any(h[0] == other for h in r["holding"])],
        "version": head.version,
        "run_id": head.run_id,
        "kind": head.kind,
        "slot": head.slot,
        "tensors": head.tensor_count,
        "bytes": head.total_bytes,
        "published_at": head.created_at,
        "durable": head.durable,
        "writer": head.writer,
    }
