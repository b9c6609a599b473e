"""Ctrl-C during ``dbsync push``: stop before the flip, or say what was published.

While a ``SigintFlag`` is active, Ctrl-C prints ``notice`` (if any) once, sets a flag and raises
``KeyboardInterrupt`` as usual. The flag lets the push's writer threads stop at their next
progress step (``check``), so an interrupted push stops writing at once; the
``KeyboardInterrupt`` reaches ``Sender.push``, which then never flips (it raises
``PushInterrupted`` saying whether the flip had already happened). Only the main thread can
install signal handlers; elsewhere the flag stays unset and Ctrl-C behaves as Python's default.

The flag also tells an interruption apart from the error it can turn into: a
``KeyboardInterrupt`` raised inside a callback that C code calls (torch building a tensor
while a file is read) comes out as that code's own error (a ``TypeError`` about a shape).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import click


class StopRequested(Exception):
    """Raised from the push's progress callback once Ctrl-C was pressed."""


class SigintFlag:
    """Context manager; see the module docstring."""

    def __init__(self, notice: str | None):
        self.notice = notice
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise ``StopRequested`` if Ctrl-C was pressed."""
        if self._event.is_set():
            raise StopRequested("interrupted (Ctrl-C)")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._event.is_set():
            self._event.set()
            if self.notice:
                click.echo(self.notice, err=True)
        raise KeyboardInterrupt

    def __enter__(self) -> SigintFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
