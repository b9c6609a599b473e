"""Private working directories of a serving process (the controller's apply reports, LoRA
adapter versions written out for vLLM, under ``/dev/shm`` where it exists), which a process
that was killed cannot remove: the next one of the host removes them.

Each directory holds an owner file its process keeps ``flock``-ed for as long as it lives
(the kernel drops the lock when the process dies, however it dies, in whatever PID namespace).
Before making its own, a process removes every directory of the same prefix whose owner file
it can lock. A directory without an owner file (made by an older dbsync, or being made right
now) is left alone. The owner file is locked under a temporary name and then renamed into
place, so a sweeper never finds an owner file that is not locked yet.

Hazard: a directory on a filesystem where ``flock`` is not shared between the processes that
see it (some network filesystems) could be judged abandoned; these directories live in the
host's own temporary directories only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

OWNER = ".dbsync-owner"
_held: dict[str, int] = {}  # directory -> fd of its locked owner file


def make(prefix: str, base: str | None = None) -> str:
    """A new private directory ``base/prefix*`` (default base: the temp directory), owned by
    this process; leftovers of dead processes with the same prefix are removed first."""
    base = base or tempfile.gettempdir()
    sweep(prefix, base)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    pending = os.path.join(path, OWNER + ".tmp")
    fd = os.open(pending, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(pending, os.path.join(path, OWNER))
    except BaseException:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    _held[path] = fd
    return path


def remove(path: str) -> None:
    """Remove a directory made by ``make`` (and release its owner file). Idempotent."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep(prefix: str, base: str) -> list[str]:
    """Remove the directories ``base/prefix*`` whose owner is dead; returns them."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(base, name)
        if path in _held:
            continue
        try:
            fd = os.open(os.path.join(path, OWNER), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # no owner file (an older dbsync's, or being made), or not ours
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its process lives
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("dbsync: removed %d working director%s left by stopped processes: %s",
                 len(removed), "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed
