"""KeyWatch: learn without polling that the next key of a numbered sequence exists in the
rendezvous key-value store (a ``torch.distributed.TCPStore``).

A thread of its own, on a connection of its own, blocks in the store's ``wait`` for key
``key_for(n)``; the store's server answers the moment someone sets it, so the waiting side
learns of it within one network hop and costs nothing while nothing happens. Each time the key
appears, ``rung`` is set and the thread goes on to wait for ``key_for(n + 1)``. Used for a
member's push doorbell (``rendezvous.bell_key``) and for the sender's join requests.

Why a thread: a store ``wait`` that times out logs two warnings from C++, so waits are long
(``WAIT_SECONDS``) and are ended by *releasing* the key instead: ``release(key)`` (the owner's
callable, on its own connection) sets the key being waited for. Only use sequences where that is
harmless (keys nobody else waits for, or keys of a sequence that is over).

Hazards, stated plainly:
- ``rung`` tells that something happened, not what: read the store after it is set, and clear
  it *before* reading (``clear``), so a key set meanwhile sets it again; ``rings`` counts the
  keys that appeared, read it after clearing.
- When the connection breaks (the store's host went away), the thread ends, ``failed`` says
  why and ``rung`` is set, so a caller waiting on it wakes; callers then poll on their own.
- ``close`` releases the wait it ends and waits for the thread to end (``JOIN_SECONDS`` at
  most): a thread still inside the store's C++ ``wait`` when the interpreter finalizes aborts
  the whole process (``terminate called without an active exception``, exit status 134) as it
  comes back into Python. A thread blocked on a host that vanished without closing its sockets
  cannot be released: it stays parked (a daemon, no CPU) until the connection times out.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import first_line

log = logging.getLogger(__name__)

#: how long one store wait may last before it is renewed (a renewal logs two C++ warnings)
WAIT_SECONDS = 3600.0
#: how long ``close`` waits for the released thread to end
JOIN_SECONDS = 10.0


def _release_nothing(key: str) -> None:
    """A closed watch's ``release``: there is no wait left to end."""


class KeyWatch:
    """Watches ``key_for(n)``, ``key_for(n + 1)``, ... of a store, from a thread of its own.

    ``connect()`` opens the watcher's own store connection (called in the thread; a failure
    ends the watch and is reported in ``failed``). ``release(key)`` sets ``key`` on the
    owner's connection, to end a wait on it. Nothing is watched until ``watch`` names a
    sequence."""

    def __init__(self, connect: Callable[[], Any], release: Callable[[str], None], name: str):
        self._connect = connect
        self._release = release
        self.rung = threading.Event()
        #: keys that appeared so far (counted before ``rung`` is set: a caller that clears
        #: ``rung`` and then reads ``rings`` misses none)
        self.rings = 0
        #: why the watch stopped working (None while it works)
        self.failed: str | None = None
        self._cond = threading.Condition()
        self._key_for: Callable[[int], str] | None = None
        self._n = 0
        self._generation = 0  # bumped by every watch(): a wait for an older target is stale
        self._waiting: str | None = None  # the key the thread waits for now
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def working(self) -> bool:
        return self.failed is None and not self._closed and self._thread.is_alive()

    def watch(self, key_for: Callable[[int], str] | None, first: int = 1) -> None:
        """Watch ``key_for(first)`` and its successors from now on (None: watch nothing),
        releasing the key waited for until now."""
        with self._cond:
            self._key_for, self._n = key_for, first
            self._generation += 1
            old = self._waiting
            self._cond.notify_all()
        if old is not None and (key_for is None or old != key_for(first)):
            self._release_quietly(old)

    def clear(self) -> None:
        self.rung.clear()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a key to appear (or for the watch to fail)."""
        return self.rung.wait(timeout)

    def abandon(self) -> None:
        """Stop watching without a word to the store (whose server does not answer: a release
        would block too); the thread stays parked in its wait until that connection ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop watching: release the current wait, then wait for the thread to end (at most
        ``JOIN_SECONDS``; not when the release failed: nothing will end that wait). Call it
        before the process exits (see the module's hazards). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            old = self._waiting
            self._cond.notify_all()
        released = old is None or self._release_quietly(old)
        if released and threading.current_thread() is not self._thread:
            self._thread.join(JOIN_SECONDS)
        # (the owner's store, which these may hold, is freed with its owner: a master store
        # kept alive here would keep its port listening)
        self._release = _release_nothing

    def _release_quietly(self, key: str) -> bool:
        try:
            self._release(key)
        except Exception as exc:  # noqa: BLE001 - store gone: the wait ends with an error
            log.debug("could not release the wait for %s: %s", key, exc)
            return False
        return True

    def _run(self) -> None:
        try:
            client = self._connect()
        except Exception as exc:  # noqa: BLE001 - reported; the owner polls instead
            self._fail(f"could not open a second connection to the store "
                       f"({first_line(exc)})", logging.WARNING)
            return
        limit = datetime.timedelta(seconds=WAIT_SECONDS)
        while True:
            with self._cond:
                while not self._closed and self._key_for is None:
                    self._cond.wait()
                if self._closed:
                    self._waiting = None
                    return
                assert self._key_for is not None
                key, generation = self._key_for(self._n), self._generation
                self._waiting = key
            try:
                client.wait([key], limit)
            except Exception as exc:  # noqa: BLE001
                if "timeout" in str(exc).lower():
                    continue  # nothing for an hour: wait again
                with self._cond:
                    closed = self._closed
                if closed:
                    return
                self._fail(f"lost the store connection ({first_line(exc)})")
                return
            with self._cond:
                self._waiting = None
                if self._closed:
                    return
                if generation != self._generation:
                    continue  # released by watch(): wait for the new target
                self._n += 1
                self.rings += 1
            self.rung.set()

    def _fail(self, why: str, level: int = logging.INFO) -> None:
        # INFO for a store that went away (its owner finds out on its own connection),
        # WARNING for one that is there but refused a second connection
        self.failed = why
        log.log(level, "%s: %s; polling instead", self._thread.name, why)
        self.rung.set()
