"""Thread pools kept from one call to the next.

A load that starts its own pool starts its threads while the first reads are already running:
on a busy 2-core host each start waits milliseconds for a core (20 ms per load of 20,000
tensors measured on a 2-core VM). Kept pools start their threads once. Idle workers block on
their queue and cost nothing.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

#: sizes kept at once (callers ask for one or two sizes: the load's and verify's)
KEEP_SIZES = 2


class WorkerPools:
    """One kept ``ThreadPoolExecutor`` per size asked for; beyond ``KEEP_SIZES`` the least
    recently used is dropped (a caller still using it keeps it; its threads end once it is
    garbage-collected). Thread-safe.

    Hazard: do not wait, inside a task, for another task of the same pool: a full pool would
    wait forever. After ``close()`` each call gets a new pool, kept by no one. A forked child
    gets new pools (the parent's came without their threads)."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._pid = os.getpid()
        self._closed = False

    def get(self, threads: int) -> ThreadPoolExecutor:
        threads = max(1, int(threads))
        if self._pid != os.getpid():
            # forked: the pools came without their threads (a task would never run), and the
            # lock may have been held by a thread the child does not have
            self._lock, self._pools, self._pid = threading.Lock(), {}, os.getpid()
        with self._lock:
            pool = self._pools.pop(threads, None)
            if pool is None:
                pool = ThreadPoolExecutor(threads, thread_name_prefix=f"{self._name}-{threads}")
            if not self._closed:
                self._pools[threads] = pool  # (most recently used last)
            while len(self._pools) > KEEP_SIZES:
                del self._pools[next(iter(self._pools))]
            return pool

    def close(self) -> None:
        """Drop every kept pool and keep none from now on: tasks already submitted still
        run, and each pool's threads end once nothing holds it."""
        with self._lock:
            self._pools, self._closed = {}, True
