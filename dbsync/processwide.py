"""A process-wide setting changed while at least one block of dbsync work runs (see
``gcpause`` and ``gilswitch``): nested and concurrent blocks share one change, and the last to
leave restores what the first found.

Hazard: the setting is process-wide. A thread that changes it itself during a block may have
its change undone when the block ends. A child forked during a block runs only the forking
thread, so the other threads' blocks never end there: the child gets the setting back at once,
and blocks entered before the fork that do end in the child change nothing there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class CountedSetting:
    """``change()`` (returns what to restore) when the first block enters, ``restore(saved)``
    when the last one leaves."""

    def __init__(self, change: Callable[[], Any], restore: Callable[[Any], None]):
        self._change = change
        self._restore = restore
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: Any = None
        #: bumped in a forked child: blocks entered before the fork do not count there
        self._generation = 0
        # (the lock is held across the fork, so the child never sees a half-made change)
        os.register_at_fork(before=self._lock_for_fork, after_in_parent=self._unlock_after_fork,
                            after_in_child=self._after_fork_in_child)

    @contextmanager
    def held(self) -> Iterator[None]:
        generation = None
        try:
            with self._lock:
                if self._depth == 0:
                    self._saved = self._change()
                self._depth += 1
                generation = self._generation
            yield
        finally:
            if generation is not None:
                with self._lock:
                    if generation == self._generation:
                        self._depth -= 1
                        if self._depth == 0:
                            self._restore(self._saved)

    def _lock_for_fork(self) -> None:
        self._lock.acquire()

    def _unlock_after_fork(self) -> None:
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if self._depth:
            self._restore(self._saved)
        self._depth = 0
        self._generation += 1
