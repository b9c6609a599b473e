"""Say when a call on the store's filesystem has not returned for long: a hung mount (a FUSE
daemon stopped, a hard-mounted NFS server that went away) blocks the calling thread inside the
kernel, where nothing can interrupt it, and a watcher blocked there would otherwise go quiet
while its versions go stale.

``said_if_slow(what)`` around such a call: past ``SLOW_CALL_WARN_S`` seconds one thread of the
process logs a WARNING naming the call and how long it has waited, calls ``on_slow`` (a watcher
puts the problem in its status), and says so again when the call returns.

Hazards, stated plainly: the call itself is never cut short (a blocked read cannot be); one
daemon thread per process sleeps on a condition while no call is slow, waking only at the
deadline of the oldest call under way: watched calls cost a lock and a dict entry each.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

#: seconds after which a call on the store's filesystem is said to hang
SLOW_CALL_WARN_S = 10.0


class _Call:
    __slots__ = ("what", "started", "after", "on_slow", "warned")

    def __init__(self, what: str, after: float, on_slow: Callable[[str], None] | None):
        self.what, self.after, self.on_slow = what, after, on_slow
        self.started = time.monotonic()
        self.warned = False


class _Watchdog:
    """The calls under way, and the one thread that looks at the oldest's deadline."""

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.Lock())
        self.calls: dict[int, _Call] = {}
        self.tokens = itertools.count()
        self.thread: threading.Thread | None = None

    def add(self, call: _Call) -> int:
        with self.lock:
            token = next(self.tokens)
            self.calls[token] = call
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="dbsync-slowcalls",
                                               daemon=True)
                try:
                    self.thread.start()
                except RuntimeError:  # (at the thread limit: the call goes unwatched)
                    self.thread = None
            self.lock.notify()
            return token

    def remove(self, token: int) -> None:
        with self.lock:
            call = self.calls.pop(token, None)
        if call is not None and call.warned:
            log.warning("dbsync: %s returned after %.1f s", call.what,
                        time.monotonic() - call.started)

    def _run(self) -> None:
        while True:
            due: list[_Call] = []
            with self.lock:
                now = time.monotonic()
                pending = [c for c in self.calls.values() if not c.warned]
                for call in pending:
                    if now - call.started >= call.after:
                        call.warned = True
                        due.append(call)
                waits = [c.started + c.after - now for c in pending if not c.warned]
                if not due:
                    self.lock.wait(min(waits) if waits else None)
                    continue
            for call in due:
                message = (f"{call.what} has not returned for {call.after:g} s: the store's "
                           "mount does not answer (a stopped FUSE daemon, an NFS server "
                           "away?); waiting for it")
                log.warning("dbsync: %s", message)
                if call.on_slow is not None:
                    try:
                        call.on_slow(message)
                    except Exception:  # noqa: BLE001 - a status hook must not stop the watch
                        log.exception("dbsync: reporting a slow call failed")


_WATCHDOG: list[_Watchdog] = [_Watchdog()]


def _after_fork() -> None:
    _WATCHDOG[0] = _Watchdog()  # (the parent's thread and lock are not the child's)


os.register_at_fork(after_in_child=_after_fork)


@contextlib.contextmanager
def said_if_slow(what: str, after: float | None = None,
                 on_slow: Callable[[str], None] | None = None) -> Iterator[None]:
    """Within this block, a WARNING once it has run ``after`` seconds (default
    ``SLOW_CALL_WARN_S``) and ``on_slow(message)``, and another when it ends. ``what``: the
    call, e.g. "reading /store/dbsync.json"."""
    watchdog = _WATCHDOG[0]
    token = watchdog.add(_Call(what, SLOW_CALL_WARN_S if after is None else after, on_slow))
    try:
        yield
    finally:
        watchdog.remove(token)
