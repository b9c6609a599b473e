"""Ctrl-C during ``dbsync push``: stop before the flip, or say what was published.

While a ``SigintFlag`` is active, the first SIGINT only sets a flag (the push checks it at
every progress step and stops before publishing); the second raises ``KeyboardInterrupt`` as
usual. Only the main thread can install signal handlers; elsewhere the flag is inert and
Ctrl-C behaves as Python's default.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import click


class PushInterrupted(Exception):
    """Raised from the push's progress callback once Ctrl-C was pressed."""


class SigintFlag:
    """Context manager: the first Ctrl-C sets ``is_set()`` and prints ``notice`` on stderr."""

    def __init__(self, notice: str):
        self.notice = notice
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise ``PushInterrupted`` if Ctrl-C was pressed."""
        if self._event.is_set():
            raise PushInterrupted()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._event.is_set():
            raise KeyboardInterrupt
        self._event.set()
        click.echo(self.notice, err=True)

    def __enter__(self) -> SigintFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
