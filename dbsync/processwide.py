"""A process-wide setting changed while at least one block of dbsync work runs (see
``gcpause`` and ``gilswitch``): nested and concurrent blocks share one change, and the last to
leave restores what the first found.

Hazard: the setting is process-wide. A thread that changes it itself during a block may have
its change undone when the block ends. A child forked during a block runs only the forking
thread, so the other threads' blocks never end there: the child gets the setting back at once.
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
        os.register_at_fork(after_in_child=self._after_fork_in_child)

    @contextmanager
    def held(self) -> Iterator[None]:
        entered = False
        try:
            with self._lock:
                if self._depth == 0:
                    self._saved = self._change()
                self._depth += 1
                entered = True
            yield
        finally:
            if entered:
                with self._lock:
                    self._depth = max(0, self._depth - 1)
                    if self._depth == 0:
                        self._restore(self._saved)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # (another thread may have held it at the fork)
        if self._depth:
            self._restore(self._saved)
        self._depth = 0
