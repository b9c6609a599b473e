"""A reader that goes away (``dbsync watch ROOT | head -1``) ends the command quietly.

Python ignores SIGPIPE, so a write to a pipe whose reader has exited raises
``BrokenPipeError``. The command then stops at once with status 141 (128 + SIGPIPE, what a
shell reports for tools killed by the signal), prints nothing (there is no one to read it),
and points the standard streams at ``/dev/null`` so the interpreter's final flush cannot print
"Exception ignored ... BrokenPipeError" on the way out.
"""

from __future__ import annotations

import errno
import os
import select
import sys

CLOSED_PIPE_EXIT = 141


def is_closed_pipe(exc: BaseException) -> bool:
    """True when ``exc`` is a write to one of our standard streams whose reader is gone
    (not an EPIPE from some other pipe or socket the command used)."""
    if not (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        return False
    return any(_reader_gone(fd) for fd in (1, 2))


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has exited (one ``poll`` call, no wait): a
    command that prints only now and then (``watch``) looks between two prints."""
    return _reader_gone(1)


def _reader_gone(fd: int) -> bool:
    try:
        poller = select.poll()
        poller.register(fd, 0)  # no events asked: only POLLERR / POLLHUP / POLLNVAL come back
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def silence() -> None:
    """Send what is still buffered for stdout/stderr to /dev/null."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(null, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    os.close(null)
