"""Reader leases, seen from both sides.

A receiver that reads a slot first writes a lease (``state="reading"``, the slot, the
version) and refreshes it every ``lease_timeout / 4`` seconds by bumping ``beat``. The writer
never writes into a slot that a live lease names.

A lease is dead when its reader is gone: on the writer's host that is a missing pid; anywhere,
it is a ``beat`` that has not changed for ``lease_timeout`` seconds *as measured on the
writer's own monotonic clock* (so clock skew between hosts cannot shorten or stretch it).

Hazard: a reader stalled for longer than the timeout (a debugger, a swapped-out process) loses
its lease and the writer may reuse its slot. The reader detects this afterwards through the
slot stamp and raises ``LeaseExpiredError``; it cannot undo what it already applied.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from .store import Store

DEFAULT_LEASE_TIMEOUT = 30.0
READING = "reading"
IDLE = "idle"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LeaseMonitor:
    """The writer's view of reader leases: which live readers hold a slot."""

    def __init__(self, store: Store, timeout: float = DEFAULT_LEASE_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.timeout = timeout
        self.clock = clock
        self.host = socket.gethostname()
        # reader_id -> (beat last seen, when we first saw that beat)
        self._seen: dict[str, tuple[Any, float]] = {}

    def holders(self, slot: str) -> list[str]:
        """Reader ids whose live lease names ``slot`` right now."""
        now = self.clock()
        holding = []
        leases = self.store.read_leases()
        for reader_id, lease in leases.items():
            if lease.get("state") != READING or lease.get("slot") != slot:
                self._seen.pop(reader_id, None)
                continue
            if lease.get("host") == self.host and isinstance(lease.get("pid"), int) and not (
                pid_alive(lease["pid"])
            ):
                continue
            beat = (lease.get("beat"), lease.get("version"))
            first = self._seen.get(reader_id)
            if first is None or first[0] != beat:
                self._seen[reader_id] = (beat, now)
                holding.append(reader_id)
            elif now - first[1] < self.timeout:
                holding.append(reader_id)
        for gone in set(self._seen) - set(leases):
            del self._seen[gone]
        return holding

    def wait_until_free(self, slot: str, sleep: Callable[[float], None] = time.sleep,
                        interval: float = 0.02) -> float:
        """Block until no live reader holds ``slot``. Returns the seconds waited. Never waits
        longer than about ``timeout`` for a reader that stopped beating."""
        start = self.clock()
        while self.holders(slot):
            sleep(interval)
            interval = min(interval * 1.5, 0.25)
        return self.clock() - start
