"""A receiver's side of membership: the connection to the sender named by
``ROOT/broadcast.json``, join and leave requests, following the sender's epochs (creating the
group when this receiver is a member), and spotting announced pushes.

A member learns of a push from its doorbell (``rendezvous.bell_key``, watched by a
``KeyWatch`` on a second connection): the sender rings each member's bell right after it
announces a push, and when its epoch changes. So an idle member wakes only to re-check its
epoch every ``MEMBER_EPOCH_CHECK_SECONDS``, and sees a push one network hop after it is
announced (polling every 0.25 ms cost a core's worth of round trips and ~0.5 ms of latency on
an idle host). Without a working doorbell it polls every ``poll_interval``.

Every failure here ends in "not a member" (the caller reads from the filesystem) and is
reported through ``on_error``; a sender that is unreachable is retried after
``RETRY_SECONDS``, doubling up to ``MAX_RETRY_SECONDS`` while it stays unreachable; a sender
that closed is not retried.

Nothing here blocks a ``receive`` on an unresponsive sender: the connection is made in a
thread of its own (torch's store client retries a refused or silent address for 9-13 s)
while the caller goes on reading the filesystem, and the periodic epoch read gives up after
``STORE_CALL_SECONDS`` (a stopped trainer's store accepts connections but never answers).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import first_line
from ..store import Store
from . import rendezvous as rv
from .errors import BroadcastError, RendezvousError
from .group import Group
from .keywatch import KeyWatch
from .layout import Header

RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 300.0
#: the longest a member waits for its periodic epoch read (a healthy store answers in a ms)
STORE_CALL_SECONDS = 5.0
FS_CHECK_SECONDS = 0.05
MEMBER_FS_CHECK_SECONDS = 1.0
MEMBER_EPOCH_CHECK_SECONDS = 0.5  # a member is also rung when the epoch changes
POLLING_EPOCH_CHECK_SECONDS = 0.005  # ... unless its doorbell does not work
_ABSENT = "\x00"  # compare_set's answer for a key that does not exist
_ABSENT_BYTES = _ABSENT.encode()


@dataclass
class _Connection:
    record: rv.RendezvousRecord
    store: Any
    local_address: str


class _OtherSender(RendezvousError):
    """The rendezvous store reached is not the one of the sender ``broadcast.json`` names."""


def _check_sender(epoch_record: Any, expected: str, address: str, port: int) -> None:
    """Raise ``_OtherSender`` unless the epoch record read from the rendezvous store at
    ``address:port`` is the sender ``expected``'s. A sender killed leaves its
    ``broadcast.json``; another sender (of another store, or a later one of this store that
    has not written its own file yet) may listen on that port since: joining it would apply
    that sender's weights as this store's versions."""
    found = epoch_record.get("sender_id") if isinstance(epoch_record, dict) else None
    if found != expected:
        raise _OtherSender(
            f"the broadcast rendezvous at {address}:{port} belongs to another sender ({found}, "
            f"not {expected} that broadcast.json names: that sender has gone, and its port "
            "was taken since)")


class _Background:
    """One blocking call run in a daemon thread of its own: ``done`` is set when it returned
    (``value``) or raised (``error``). A call that never returns (a store client waiting on
    a stopped server) keeps only its own thread; nobody waits for it.

    Hazard: a thread coming back from torch's C++ store client while the interpreter
    finalizes aborts the process (``terminate called``, see ``keywatch``); at exit, calls
    still running are waited for, ``EXIT_WAIT_SECONDS`` at most (torch's client ignores its
    timeout against a server that accepts but never answers: a call to a stopped trainer
    returns only when it resumes or dies, and if that happens just as this process
    finalizes, the abort can still happen)."""

    def __init__(self, call: Callable[[], Any], name: str):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self._call = call
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self.value = self._call()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever looks
            self.error = exc
        finally:
            self._call = None  # type: ignore[assignment]
            self.done.set()
            with _RUNNING_LOCK:
                _RUNNING.discard(self)

    def result(self, timeout: float, what: str) -> Any:
        """The call's value, waiting at most ``timeout`` seconds (then ``TimeoutError``)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"{what}: no answer within {timeout:g} s (the trainer's process "
                               "stopped or its host unreachable?)")
        if self.error is not None:
            raise self.error
        return self.value


_RUNNING: set[_Background] = set()
_RUNNING_LOCK = threading.Lock()
#: the longest the process's exit waits for store calls still running (see ``_Background``)
EXIT_WAIT_SECONDS = 8.0
#: the timeout of a member's connection attempt (torch's client retries within it)
CONNECT_SECONDS = 2.0


@atexit.register
def _wait_for_running_calls() -> None:
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for call in running:
        call.done.wait(max(0.0, deadline - time.monotonic()))


class MemberLink:
    """One receiver's link to the broadcast sender of the store ``fs_store``."""

    def __init__(self, fs_store: Store, reader_id: str, device: torch.device, timeout: float,
                 address: str | None, on_error: Callable[[str], None]):
        self.fs_store = fs_store
        self.reader_id = reader_id
        self.device = device
        self.timeout = timeout
        self.address = address
        self.on_error = on_error
        self.epoch: int | None = None
        self.seq = 0
        self.group: Group | None = None
        self.conn: _Connection | None = None
        self.header_cache: dict[str, Any] = {}
        self._retry_after: dict[str, float] = {}
        self._failures: dict[str, int] = {}  # sender id -> failed connects in a row
        self._connecting: tuple[rv.RendezvousRecord, _Background] | None = None
        self._file_checked = 0.0
        self._epoch_checked = 0.0
        self._recheck = False  # the bell rang without a push: re-read the epoch now
        self._rings_seen = 0  # the doorbell's ``rings`` when last looked at
        self._bell_retry = 0.0  # when a failed doorbell may be opened again
        # the connection's doorbell (None while not connected), in a box that a finalizer
        # holds: closed also when this link is dropped without disconnect()
        self._bell_box: list[KeyWatch | None] = [None]
        weakref.finalize(self, _close_bell, self._bell_box)

    def backend_ok(self, record: rv.RendezvousRecord) -> bool:
        """Whether this receiver's device can join the backend ``record`` offers."""
        want = "nccl" if self.device.type == "cuda" else "gloo"
        if record.backend != want:
            self.on_error(f"the sender broadcasts with {record.backend} but this receiver "
                          f"is on {self.device}; reading from the filesystem (pass a device "
                          "that matches, e.g. device='cuda:0' for nccl)")
            return False
        return True

    def connect(self) -> None:
        """Connect to the sender ``ROOT/broadcast.json`` names (and ask to join), unless
        already connected to it or told to wait before retrying it."""
        try:
            record = rv.read_record(self.fs_store)
        except RendezvousError as exc:
            self.on_error(str(exc))
            record = None
        if record is None:
            self.disconnect()
            return
        if self.conn is not None and self.conn.record.sender_id == record.sender_id:
            return
        self.disconnect()
        if self._retry_after.get(record.sender_id, 0.0) > time.monotonic():
            return
        if not self.backend_ok(record):
            self._retry_after[record.sender_id] = float("inf")
            return
        pending = self._connecting
        if pending is None or pending[0].sender_id != record.sender_id:
            address, port, expected = record.address, record.port, record.sender_id
            seconds = min(self.timeout, CONNECT_SECONDS)

            def open_store() -> Any:
                store = dist.TCPStore(address, port, is_master=False,
                                      timeout=datetime.timedelta(seconds=seconds))
                _check_sender(json.loads(store.get(rv.K_EPOCH)), expected, address, port)
                return store

            self._connecting = (record, _Background(open_store,
                                                    name=f"dbsync-connect-{self.reader_id}"))
            return  # (looked at again on the next call: the filesystem serves meanwhile)
        if not pending[1].done.is_set():
            return
        self._connecting = None
        try:
            store = pending[1].result(0, "connecting")
        except _OtherSender as exc:
            self._retry_after[record.sender_id] = float("inf")  # (that sender is gone)
            self.on_error(f"{exc}; reading from the filesystem")
            return
        except Exception as exc:  # noqa: BLE001 - unreachable: use the filesystem
            wait = self._retry_later(record.sender_id)
            self.on_error(f"cannot reach the broadcast sender at {record.address}:"
                          f"{record.port} ({first_line(exc)}); reading from the filesystem "
                          f"(trying again in {wait:.0f} s)")
            return
        self._failures.pop(record.sender_id, None)
        local = self.address or rv.local_address_towards(record.address)
        self.conn = _Connection(record, store, local)
        self._new_doorbell(record, store)
        self.epoch = None
        self.send("join")

    def _retry_later(self, sender_id: str) -> float:
        """Wait before trying ``sender_id`` again: ``RETRY_SECONDS``, doubling per failure in
        a row up to ``MAX_RETRY_SECONDS``. Returns the wait."""
        failures = self._failures[sender_id] = self._failures.get(sender_id, 0) + 1
        wait = min(RETRY_SECONDS * 2 ** (failures - 1), MAX_RETRY_SECONDS)
        self._retry_after[sender_id] = time.monotonic() + wait
        return wait

    def send(self, action: str) -> None:
        assert self.conn is not None
        store = self.conn.store
        n = int(store.add(rv.K_JOINS, 1))
        store.set(rv.join_key(n), json.dumps({
            "reader_id": self.reader_id, "action": action, "pid": os.getpid(),
            "host": os.uname().nodename, "device": str(self.device)}))

    def disconnect(self) -> None:
        self.close_group()
        _close_bell(self._bell_box)
        self.conn = None
        self.epoch = None

    def _abandon(self) -> None:
        """Drop the connection to a sender whose store does not answer, asking it nothing."""
        if self.group is not None:
            self.group.close()
            self.group = None
        bell, self._bell_box[0] = self._bell_box[0], None
        if bell is not None:
            bell.abandon()
        self.conn = None
        self.epoch = None

    def close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.bell is not None:
            self.bell.watch(None)

    def leave_group(self, why: str) -> None:
        """Drop out of the current group after a failure and ask to join the next epoch."""
        self.on_error(why)
        self.close_group()
        if self.conn is not None:
            try:
                self.send("join")
            except Exception:  # noqa: BLE001 - sender gone: the next connect sorts it out
                self.disconnect()

    def maintain(self) -> None:
        """Re-read the rendezvous file now and then, and follow the sender's epoch: create the
        group when this receiver is a member of a new one, ask to join when it is not."""
        now = time.monotonic()
        every = FS_CHECK_SECONDS if self.conn is None else MEMBER_FS_CHECK_SECONDS
        if now - self._file_checked >= every:
            self._file_checked = now
            self.connect()
        if self.conn is None:
            return
        bell = self.bell
        every = MEMBER_EPOCH_CHECK_SECONDS if bell is not None and bell.working else (
            POLLING_EPOCH_CHECK_SECONDS)
        if self.group is not None and not self._recheck and now - self._epoch_checked < every:
            return  # a member is rung for pushes and epoch changes: the epoch is re-read rarely
        self._epoch_checked, self._recheck = now, False
        conn = self.conn
        try:
            reading = _Background(lambda: conn.store.get(rv.K_EPOCH),
                                  name=f"dbsync-epoch-{self.reader_id}")
            record = json.loads(reading.result(min(self.timeout, STORE_CALL_SECONDS),
                                               "reading the sender's epoch"))
            epoch, members = int(record["epoch"]), [str(m) for m in record["members"]]
        except Exception as exc:  # noqa: BLE001 - the sender died or closed
            self._retry_later(conn.record.sender_id)
            if isinstance(exc, TimeoutError):
                self._abandon()  # (its store does not answer: asking it anything would block)
            else:
                self.disconnect()
            self.on_error(f"lost the broadcast sender ({exc}); reading from the filesystem")
            return
        if record.get("closed"):
            self._retry_after[conn.record.sender_id] = float("inf")
            self.disconnect()
            return
        try:
            _check_sender(record, conn.record.sender_id, conn.record.address, conn.record.port)
        except _OtherSender as exc:  # (the sender died; another took its port since)
            self._retry_after[conn.record.sender_id] = float("inf")
            self._abandon()
            self.on_error(f"{exc}; reading from the filesystem")
            return
        if bell is not None and not bell.working and now >= self._bell_retry:
            # the store still answers: open a new doorbell (polled meanwhile)
            self._bell_retry = now + RETRY_SECONDS
            self._new_doorbell(conn.record, conn.store)
            if self.group is not None and self.epoch == epoch:
                self._watch_bell(epoch, self.seq + 1)
        if epoch == self.epoch:
            return
        first_look = self.epoch is None
        self.close_group()
        self.epoch, self.seq = epoch, 0
        if self.reader_id in members:
            conn.store.set(rv.ready_key(epoch, self.reader_id), "1")
            try:
                setup = float(record.get("setup_timeout", self.timeout))
                self.group = Group.create(
                    conn.store, rv.pg_prefix(epoch), members.index(self.reader_id) + 1,
                    len(members) + 1, conn.record.backend, self.device, self.timeout,
                    conn.local_address, setup_timeout=max(setup, self.timeout))
            except BroadcastError as exc:
                self.leave_group(f"could not join epoch {epoch}: {exc}")
                return
            self._watch_bell(epoch, 1)
        elif not first_look:
            self.send("join")  # a new epoch formed without us: ask for the next one

    def poll_push(self) -> Header | None:
        """The header of the next push of this epoch, if the sender announced it."""
        if self.group is None or self.conn is None or self.epoch is None:
            return None
        key = rv.push_key(self.epoch, self.seq + 1)
        bell = self.bell
        rang = False
        if bell is not None:
            bell.clear()  # before reading: a ring from now on wakes the next wait
            rings = bell.rings
            rang, self._rings_seen = rings != self._rings_seen, rings
            if not rang and bell.working:
                # (the sender rings right after announcing: no ring, no push. Nothing is
                # asked of the store, so an idle member never waits on a stopped trainer)
                self._recheck = False
                return None
        store = self.conn.store
        try:
            # one round trip: the header if announced, else _ABSENT (nothing is written; a
            # header is JSON and never equals _ABSENT)
            raw = store.compare_set(key, _ABSENT, _ABSENT)
            if raw == _ABSENT_BYTES:
                self._recheck = rang  # rung for an epoch change
                return None
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, TimeoutError):
                self._abandon()  # (its store does not answer: asking it anything would block)
            else:
                self.disconnect()
            self.on_error(f"lost the broadcast sender ({exc}); reading from the filesystem")
            return None
        return Header.loads(raw, self.header_cache)

    @property
    def bell(self) -> KeyWatch | None:
        """The doorbell of the current connection (None while not connected)."""
        return self._bell_box[0]

    def _new_doorbell(self, record: rv.RendezvousRecord, store: Any) -> None:
        _close_bell(self._bell_box)
        self._bell_box[0] = _doorbell(record, store, 5.0, self.reader_id)
        self._rings_seen = 0

    def _watch_bell(self, epoch: int, first: int) -> None:
        if self.bell is not None:
            reader_id = self.reader_id
            self.bell.watch(lambda n: rv.bell_key(epoch, n, reader_id), first)

    def wait_for_push(self, timeout: float, poll_interval: float) -> None:
        """Sleep until the doorbell rings or ``timeout`` seconds pass (``poll_interval``
        instead while this link has no working doorbell). Returns at once when the bell rang
        without a push, so that ``maintain`` re-reads the epoch first."""
        bell = self.bell
        if self._recheck and bell is not None and bell.working:
            return
        if bell is None or not bell.working:
            time.sleep(min(timeout, poll_interval))
            return
        bell.wait(timeout)

    def published(self, epoch: int, seq: int, version: int, timeout: float) -> str:
        """The manifest digest the sender confirmed for push (``epoch``, ``seq``) of
        ``version``, waiting up to ``timeout`` seconds. Raises ``BroadcastError``."""
        conn = self.conn
        if conn is None:
            raise BroadcastError(f"lost the broadcast sender before it confirmed version "
                                 f"{version}")
        key = rv.published_key(epoch, seq)
        deadline = time.monotonic() + timeout
        pause = 0.001
        try:
            while not conn.store.check([key]):
                if time.monotonic() >= deadline:
                    raise BroadcastError(
                        f"the sender did not confirm publishing version {version} within "
                        f"{timeout:.0f} s")
                time.sleep(pause)
                pause = min(pause * 1.5, 0.01)
            record = json.loads(conn.store.get(key))
        except BroadcastError:
            raise
        except Exception as exc:  # noqa: BLE001 - the sender went away
            raise BroadcastError(f"lost the broadcast sender before it confirmed version "
                                 f"{version} ({exc})") from None
        if record.get("version") != version or "manifest" not in record:
            raise BroadcastError(f"the sender could not publish version {version}: "
                                 f"{record.get('error', 'no manifest digest')}")
        return str(record["manifest"])


def _doorbell(record: rv.RendezvousRecord, store: Any, timeout: float, reader_id: str
              ) -> KeyWatch:
    """A member's doorbell: a ``KeyWatch`` on a second connection to the sender's store
    (its callables hold plain values and the store, never the link: a receiver dropped
    without ``close`` can still be collected)."""
    address, port = record.address, record.port
    return KeyWatch(
        lambda: dist.TCPStore(address, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout)),
        lambda key: store.set(key, "moved"), name=f"dbsync-bell-{reader_id}")


def _close_bell(box: list[KeyWatch | None]) -> None:
    bell, box[0] = box[0], None
    if bell is not None:
        bell.close()
