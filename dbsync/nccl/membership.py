"""The sender's side of membership: the rendezvous key-value store it hosts, the join and leave
requests receivers post there, and epochs (one process group per set of members).

A change in membership starts a new epoch: the member list is published (in the store and in
``ROOT/broadcast.json``), every member says it is ready, and a fresh group is created (rank 0 =
the sender). Members that do not get ready within ``join_timeout`` are dropped and the epoch is
formed again without them. After a failed broadcast the epoch is closed: every member sees an
epoch without itself and asks to join again.

Members are woken, not polled: right after a push is announced (``ring``) and when an epoch
ends, the sender sets each member's doorbell key (``rendezvous.bell_key``). Join requests are
watched the same way (a ``KeyWatch`` on a second connection), so a push reads them only after
one arrived.

Hazards, stated plainly:
- The key-value store listens on ``port`` on every interface of this host, unauthenticated:
  trusted networks only.
- Forming an epoch blocks for up to ``join_timeout`` per attempt (three attempts at most).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..store import Store
from . import rendezvous as rv
from .errors import BroadcastError
from .group import Group
from .keywatch import KeyWatch

log = logging.getLogger(__name__)

STORE_TIMEOUT_SECONDS = 30.0
#: first and longest pause in forming groups after one could not form (see ``_back_off``)
FORMATION_BACKOFF_S = 30.0
FORMATION_BACKOFF_MAX_S = 600.0


def wait_for_keys(store: Any, keys: Sequence[str], timeout: float) -> list[str]:
    """Poll ``store`` until every key exists or ``timeout`` passes; return the missing ones."""
    start = time.monotonic()
    keys = list(keys)
    while True:
        if not keys or store.check(keys):
            return []
        waited = time.monotonic() - start
        if waited >= timeout:
            return [k for k in keys if not store.check([k])]
        # one check is a round trip (~25 us on a LAN): poll tightly for the first 20 ms
        time.sleep(0 if waited < 0.02 else 0.002)


class _ClosedStore:
    """Stands in for a closed sender's rendezvous store: any use says it is closed."""

    def __getattr__(self, name: str) -> Any:
        raise BroadcastError("this broadcast sender was closed: its rendezvous store is gone")


class Membership:
    """Hosts the rendezvous store and keeps the current epoch's group."""

    def __init__(self, store: Store, *, address: str, port: int, backend: str,
                 device: torch.device, bucket_bytes: int, timeout: float, join_timeout: float):
        self.fs_store = store
        self.address = address
        self.backend = backend
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.sender_id = uuid.uuid4().hex
        self.epoch = 0
        self.seq = 0
        self.members: tuple[str, ...] = ()
        #: (epoch, seq, members) of the pushes announced and not yet forgotten
        self._announced: deque[tuple[int, int, tuple[str, ...]]] = deque()
        self.group: Group | None = None
        self.last_setup_seconds: float | None = None
        self._wanted: dict[str, float] = {}  # reader id -> when it asked
        #: why this push has no group: it could not form, or pushes back off forming one
        #: (None: nothing failed since the last try); until when pushes do not try again (a
        #: receiver that can never join must not cost every push)
        self.formation_error: str | None = None
        self._formation_failures = 0
        self._formation_backoff = 0.0
        self._formation_retry_at = 0.0
        self._joins_seen = 0
        # (connecting to itself may take seconds on a loaded host: not the step timeout)
        store_timeout = datetime.timedelta(seconds=max(timeout, STORE_TIMEOUT_SECONDS))
        self.kv = dist.TCPStore(
            "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=store_timeout)
        self.port = int(self.kv.port)
        self._publish_epoch()
        kv, port = self.kv, self.port  # (the watch holds these, not this object)
        self._joins = KeyWatch(
            lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=store_timeout),
            lambda key: kv.set(key, json.dumps({"reader_id": "", "action": "close"})),
            name="dbsync-joins")
        self._joins.watch(rv.join_key, 1)

    def _publish_epoch(self, closed: bool = False) -> None:
        record: dict[str, Any] = {
            "epoch": self.epoch, "members": list(self.members), "sender_id": self.sender_id,
            # how long a member may wait for the others while the group forms
            "setup_timeout": self.join_timeout + self.timeout}
        if closed:
            record["closed"] = True
        self.kv.set(rv.K_EPOCH, json.dumps(record))
        if not closed:
            rv.write_record(self.fs_store, rv.RendezvousRecord(
                sender_id=self.sender_id, address=self.address, port=self.port,
                backend=self.backend, epoch=self.epoch, members=self.members,
                bucket_bytes=self.bucket_bytes, timeout=self.timeout,
                host=socket.gethostname(), pid=os.getpid()))

    def poll_joins(self) -> bool:
        """Read new join/leave records; True if any arrived (membership must be re-formed)."""
        changed = False
        count = int(self.kv.add(rv.K_JOINS, 0))
        while self._joins_seen < count:
            key = rv.join_key(self._joins_seen + 1)
            if not self.kv.check([key]):
                break  # counted but not written yet: read it next time
            self._joins_seen += 1
            try:
                record = json.loads(self.kv.get(key))
                reader_id, action = str(record["reader_id"]), record["action"]
            except (ValueError, KeyError, TypeError):
                continue  # malformed: ignore (it cannot name a member)
            if action == "join":
                self._wanted[reader_id] = time.monotonic()
            elif action == "leave":
                self._wanted.pop(reader_id, None)
            else:
                continue  # "close" (the sender ended its own watch) or unknown
            changed = True
        return changed

    def wanted(self) -> list[str]:
        return sorted(self._wanted)

    def refresh(self) -> float | None:
        """Form a new epoch if membership changed (or none is formed while receivers wait).
        Returns the setup seconds when an epoch formed, else None."""
        changed = False
        if not self._joins.working or self._joins.rung.is_set():
            self._joins.clear()  # before reading: a request from now on sets it again
            changed = self.poll_joins()
        if time.monotonic() < self._formation_retry_at:
            return None  # (backing off: this push goes through the filesystem alone)
        self.formation_error = None
        if changed or (self.group is None and self._wanted) or (
                self.group is not None and set(self._wanted) != set(self.members)):
            return self.form_epoch()
        return None

    def forget_old(self, keep: int = 2) -> None:
        """Delete the keys of every announced push but the last ``keep`` (header,
        acknowledgements, doorbells, abort, confirmation), whatever their epoch, so the store
        does not grow push after push."""
        while len(self._announced) > keep:
            epoch, seq, members = self._announced.popleft()
            keys = [rv.push_key(epoch, seq), rv.go_key(epoch, seq),
                    rv.published_key(epoch, seq)]
            for member in members:
                keys += [rv.ack_key(epoch, seq, member), rv.bell_key(epoch, seq, member)]
            for key in keys:
                self.kv.delete_key(key)

    def announce(self, seq: int, header: bytes) -> None:
        """Publish push ``seq``'s header and wake every member waiting for it: one message
        to the store, which sets the header before the doorbells."""
        keys = [rv.push_key(self.epoch, seq)]
        keys += [rv.bell_key(self.epoch, seq, member) for member in self.members]
        self._announced.append((self.epoch, seq, self.members))
        self.kv.multi_set(keys, [header] + ["push"] * len(self.members))  # type: ignore[list-item]

    def _next_epoch(self, members: Sequence[str], closed: bool = False) -> None:
        """Publish the next epoch with ``members`` (or the sender's end), then wake the ended
        epoch's members where they wait (for its next push), so they read it now."""
        ended, seq, waiting = self.epoch, self.seq, self.members
        self.epoch, self.seq, self.members = ended + 1, 0, tuple(members)
        self._publish_epoch(closed=closed)
        if waiting:
            try:
                self.kv.multi_set([rv.bell_key(ended, seq + 1, m) for m in waiting],
                                  ["epoch"] * len(waiting))
            except Exception:  # noqa: BLE001 - members re-read the epoch on their own, later
                pass

    def form_epoch(self) -> float | None:
        """Start a new epoch with every receiver that asked to join. Drops those that do not
        get ready within ``join_timeout`` and retries without them. Returns setup seconds."""
        t0 = time.perf_counter()
        for _attempt in range(3):
            self._close_group()
            self._next_epoch(sorted(self._wanted))
            if not self.members:
                return None
            ready = [rv.ready_key(self.epoch, m) for m in self.members]
            missing = wait_for_keys(self.kv, ready, self.join_timeout)
            if missing:
                for key in missing:
                    self._wanted.pop(key.rsplit("/", 1)[1], None)
                continue
            try:
                self.group = Group.create(
                    self.kv, rv.pg_prefix(self.epoch), 0, len(self.members) + 1, self.backend,
                    self.device, self.timeout, self.address, setup_timeout=self.join_timeout)
            except BroadcastError as exc:
                self._wanted.clear()  # who failed is unknown: everyone alive re-joins
                self._back_off(exc)
                break
            self.last_setup_seconds = time.perf_counter() - t0
            self.formation_error, self._formation_failures = None, 0
            self._formation_backoff = self._formation_retry_at = 0.0
            return self.last_setup_seconds
        self.close_epoch()
        return None

    def _back_off(self, exc: BroadcastError) -> None:
        """After groups that could not form twice in a row (a member that announces an
        address this host cannot reach, a firewall; once may be a member restarting), pushes
        go through the filesystem alone for a while (``FORMATION_BACKOFF_S``, doubling up to
        ``FORMATION_BACKOFF_MAX_S``) instead of each waiting ``join_timeout`` for it."""
        self._formation_failures += 1
        if self._formation_failures >= 2:
            self._formation_backoff = min(max(2 * self._formation_backoff,
                                              FORMATION_BACKOFF_S), FORMATION_BACKOFF_MAX_S)
            self._formation_retry_at = time.monotonic() + self._formation_backoff
        self.formation_error = (
            f"the broadcast group with {', '.join(self.members)} could not form ({exc}); "
            + (f"pushes use the filesystem alone for {self._formation_backoff:.0f} s"
               if self._formation_failures >= 2 else "the next push tries again")
            + ". Check that each receiver's address= (DBSYNC_BROADCAST_ADDRESS) is reachable "
            "from here")
        log.warning("dbsync: %s", self.formation_error)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def missing_acks(self, seq: int) -> list[str]:
        """Members that did not acknowledge push ``seq`` of this epoch."""
        try:
            return [m for m in self.members
                    if not self.kv.check([rv.ack_key(self.epoch, seq, m)])]
        except Exception:  # noqa: BLE001 - only used to word an error
            return []

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def close_epoch(self) -> None:
        """Give up the current group: members see a new epoch without them and re-join."""
        self._close_group()
        self._wanted.clear()
        self._next_epoch(())

    def close(self) -> None:
        """Close the group, tell members the sender is gone, withdraw ``broadcast.json``."""
        self._close_group()
        self._joins.close()
        try:
            self._next_epoch((), closed=True)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        rv.remove_record(self.fs_store, self.sender_id)
        # The store's server (its listening port) ends once nothing holds the store: not
        # when this object is freed, which a finished push's callbacks may delay for as long
        # as the Sender lives (a BroadcastSender made again on its port met EADDRINUSE).
        self.kv = _ClosedStore()
