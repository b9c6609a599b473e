"""Ctrl-C (or SIGTERM) during ``dbsync push``: stop before the flip, or say what was published.

SIGTERM (what ``timeout``, systemd and Kubernetes send) is handled as Ctrl-C is, and told
apart in what is printed ("terminated") and the exit status (143 instead of 130).

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


#: exit status after Ctrl-C and after SIGTERM (128 + the signal's number)
INTERRUPTED_EXIT = 128 + signal.SIGINT
TERMINATED_EXIT = 128 + signal.SIGTERM
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SigintFlag:
    """Context manager; see the module docstring."""

    def __init__(self, notice: str | None):
        self.notice = notice
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self._installed = False
        #: the signal that set the flag (None: not set)
        self.signum: int | None = None

    @property
    def exit_code(self) -> int:
        return TERMINATED_EXIT if self.signum == signal.SIGTERM else INTERRUPTED_EXIT

    def reworded(self, message: str) -> str:
        """``message`` (which says "interrupted") as it reads after a SIGTERM."""
        if self.signum != signal.SIGTERM:
            return message
        return message.replace("interrupted", "terminated (SIGTERM)", 1).replace(
            " (Ctrl-C again to stop waiting)", "")

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise ``StopRequested`` if Ctrl-C was pressed."""
        if self._event.is_set():
            raise StopRequested("interrupted (Ctrl-C)")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._event.is_set():
            self.signum = signum
            self._event.set()
            if self.notice:
                click.echo(self.reworded(self.notice), err=True)
        raise KeyboardInterrupt

    def __enter__(self) -> SigintFlag:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            self._installed = False
