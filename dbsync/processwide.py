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
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


class _Block:
    """One block of a ``CountedSetting`` (a class, not a generator: an interrupt that lands
    inside a generator-based context manager's entry leaves the generator suspended, and its
    ``finally`` waits for the garbage collector, which the setting may have disabled)."""

    __slots__ = ("_setting", "_generation")

    def __init__(self, setting: CountedSetting):
        self._setting = setting
        self._generation: int | None = None

    def __enter__(self) -> None:
        try:
            self._setting._enter(self)
        except BaseException:  # (an interrupt on the way in: the block never starts)
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        self._setting._leave(self)

    def __del__(self) -> None:
        # An interrupt can land as ``__exit__`` or ``_leave`` is entered, before the block
        # was counted out: it is then counted out when the ``with`` statement drops it
        # (reference counting, at once), or, where this runs while the setting's lock is
        # taken, by the next block to enter or leave.
        if getattr(self, "_generation", None) is not None:
            self._setting._leave_soon(self)


class CountedSetting:
    """``apply()`` when the first block enters, ``restore(saved)`` when the last one leaves,
    where ``saved = save()`` was read just before ``apply``. Interrupt-safe: an exception
    (Ctrl-C) anywhere in ``held`` never leaves the setting applied with no block left to
    restore it."""

    def __init__(self, save: Callable[[], Any], apply: Callable[[], None],
                 restore: Callable[[Any], None]):
        self._save = save
        self._apply = apply
        self._restore = restore
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: Any = None  # (None: nothing to restore)
        #: blocks finalized while the lock was taken, to be counted out by the next block
        self._unfinished: list[_Block] = []
        #: bumped in a forked child: blocks entered before the fork do not count there
        self._generation = 0
        # (the lock is held across the fork, so the child never sees a half-made change)
        os.register_at_fork(before=self._lock_for_fork, after_in_parent=self._unlock_after_fork,
                            after_in_child=self._after_fork_in_child)

    def held(self) -> AbstractContextManager[None]:
        """A block during which the setting is applied (``with setting.held(): ...``)."""
        return _Block(self)

    def _enter(self, block: _Block) -> None:
        """Count ``block`` in (applying the setting for the first block); ``block`` records
        its generation in the same step, so its ``__exit__`` undoes exactly what was done."""
        with self._lock:
            self._finish_unfinished()
            self._depth += 1
            block._generation = self._generation  # (no call between: no interrupt either)
            if self._depth == 1:
                # (``_saved`` still set: the last restore was cut short by an interrupt,
                # and it holds what to restore; reading the setting now would read ours)
                if self._saved is None:
                    self._saved = self._save()
                self._apply()

    def _leave(self, block: _Block) -> None:
        with self._lock:
            self._finish_unfinished()
            self._count_out(block)

    def _count_out(self, block: _Block) -> None:  # (under the lock)
        generation = block._generation
        if generation is None:
            return  # (never counted in, or counted out already)
        block._generation = None  # (no call from here to the count: no interrupt either)
        if generation == self._generation:
            self._depth -= 1
            if self._depth == 0:
                try:
                    self._put_back()
                except BaseException:  # (cut short as it was entered: once more)
                    self._put_back()
                    raise

    def _leave_soon(self, block: _Block) -> None:
        """``_leave`` from a finalizer, which may run anywhere, this setting's own locked
        code included: now if the lock is free, else by the next block to enter or leave."""
        if self._lock.acquire(blocking=False):
            try:
                self._count_out(block)
            finally:
                self._lock.release()
        else:
            self._unfinished.append(block)  # (kept alive here until counted out)

    def _finish_unfinished(self) -> None:  # (under the lock)
        while self._unfinished:
            self._count_out(self._unfinished.pop())

    def _put_back(self) -> None:
        saved = self._saved
        if saved is None:
            return
        try:
            self._restore(saved)
        except BaseException:  # an interrupt may land before the restore took effect: again
            self._restore(saved)  # (restoring is idempotent; if this one is cut short too,
            self._saved = None  # ``_saved`` stays set and the next block restores it)
            raise
        self._saved = None

    def _lock_for_fork(self) -> None:
        self._lock.acquire()

    def _unlock_after_fork(self) -> None:
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        if self._depth or self._saved is not None:  # (or a restore cut short)
            self._put_back()
        self._depth = 0
        self._unfinished = []
        self._generation += 1
