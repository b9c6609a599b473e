"""A byte progress bar on stderr that appears only for pushes that take more than a moment.

``Sender.push`` calls the callback from its writer threads; the bar serializes with a lock.
Hazard: it writes carriage-return updates to stderr; when stderr is not a terminal it prints
nothing but the final line, so logs do not fill with partial bars.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from .fmt import human_bytes

_WIDTH = 30


class ProgressBar:
    """``bar(done, total)`` updates; ``bar.finish()`` ends the line if one was drawn.

    ``delay``: seconds before the bar first appears (quick pushes show nothing)."""

    def __init__(self, delay: float = 0.5, stream: TextIO | None = None,
                 min_interval: float = 0.1):
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        self.min_interval = min_interval
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._last: tuple[int, int] = (0, 0)
        self._lock = threading.Lock()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self._last = (done, total)
            now = time.monotonic()
            if not self._tty or now - self._start < self.delay:
                return
            if now - self._last_draw < self.min_interval and done < total:
                return
            self._last_draw = now
            self._draw(done, total, end="")

    def _draw(self, done: int, total: int, end: str) -> None:
        frac = 1.0 if total <= 0 else min(done / total, 1.0)
        filled = int(frac * _WIDTH)
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = human_bytes(int(done / elapsed)) + "/s"
        line = (f"\r[{'#' * filled}{'.' * (_WIDTH - filled)}] {frac * 100:5.1f}%  "
                f"{human_bytes(done)} / {human_bytes(total)}  {rate}")
        self.stream.write(line + end)
        self.stream.flush()
        self._drawn = True

    def finish(self, done: bool = True, waited: float = 0.0) -> None:
        """End the bar's line (on a terminal) or print one summary line (elsewhere), but only
        if the push took longer than ``delay``. ``done`` False: the push failed or was
        stopped; the line ends, and no summary claims what was not written. ``waited``:
        seconds of the push spent waiting for receivers (said apart from the writing)."""
        with self._lock:
            took = time.monotonic() - self._start
            written, total = self._last
            if self._drawn:
                self._draw(written, total, end="\n")
            elif done and took >= self.delay and total:
                wait = (f" ({waited:.1f} s of it waiting for receivers)"
                        if waited >= 0.1 else "")
                self.stream.write(f"wrote {human_bytes(total)} in {took:.1f} s{wait}\n")
                self.stream.flush()
