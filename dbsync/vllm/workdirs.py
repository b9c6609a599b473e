"""Private working directories of a serving process (the controller's apply reports, LoRA
adapter versions written out for vLLM, under ``/dev/shm`` where it exists, vLLM's engine
sockets), which a process that was killed cannot remove: the next one of the host removes them.

Each directory holds an owner file its process keeps ``flock``-ed for as long as it lives
(the kernel drops the lock when the process dies, however it dies, in whatever PID namespace).
Before making its own, a process removes every directory of the same prefix whose owner file
it can lock. The owner file names the machine's boot (``/proc/sys/kernel/random/boot_id``):
only directories of this very boot of this host are judged, so a temporary directory on a
shared filesystem (``TMPDIR`` on Lustre or NFS, where locks may be local to each host) never
loses another host's live directory. A directory without an owner file (made by an older
dbsync, or being made right now) is left alone. The owner file is locked under a temporary
name and then renamed into place, so a sweeper never finds an owner file that is not locked
yet. Where ``flock`` is not available, the directory is made without an owner (never swept).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)

OWNER = ".dbsync-owner"
#: the prefix of the directories that hold vLLM's engine sockets (``private_engine_sockets``)
SOCKETS_PREFIX = "dbsync-sockets-"
#: the longest path a Unix socket may have (``sun_path`` less its NUL), and the longest name
#: vLLM gives one (a UUID)
_SOCKET_PATH_MAX = 107
_SOCKET_NAME_MAX = 36
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
        os.write(fd, _boot_id().encode())
        os.rename(pending, os.path.join(path, OWNER))
    except OSError as exc:  # (no flock here: a directory that is never swept)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(pending)
        log.debug("dbsync: %s has no owner file (%s); it is not swept if left behind", path,
                  exc)
        return path
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


@contextlib.contextmanager
def private_engine_sockets() -> Iterator[str | None]:
    """Within this block, vLLM's engine sockets (ZeroMQ ``ipc://`` files named by
    ``VLLM_RPC_BASE_PATH``, default: the temp directory) go to a private directory of this
    process, removed at the end (yields it). vLLM leaves its socket files behind at every stop,
    clean or not (7 per start of a small engine): a server its supervisor restarts would fill
    the temp directory with them. The processes the engine starts inherit the setting.

    Left as it is (yields None) where ``VLLM_RPC_BASE_PATH`` is set, or where the temp
    directory's path is so long that a socket path one directory deeper would not fit."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        yield None
        return
    base = tempfile.gettempdir()
    if len(base) + len(SOCKETS_PREFIX) + 8 + 2 + _SOCKET_NAME_MAX > _SOCKET_PATH_MAX:
        yield None
        return
    path = make(SOCKETS_PREFIX, base)
    os.environ["VLLM_RPC_BASE_PATH"] = path
    try:
        yield path
    finally:
        if os.environ.get("VLLM_RPC_BASE_PATH") == path:
            del os.environ["VLLM_RPC_BASE_PATH"]
        remove(path)


def sweep(prefix: str, base: str) -> list[str]:
    """Remove the directories ``base/prefix*`` whose owner is dead; returns them."""
    if not _boot_id():  # (this host cannot tell its boots or itself from others)
        return []
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
                if os.pread(fd, 64, 0).decode(errors="replace") != _boot_id():
                    continue  # another host's, or an earlier boot's: not judged here
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its process lives (or no flock here)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("dbsync: removed %d working director%s left by stopped processes: %s",
                 len(removed), "y" if len(removed) == 1 else "ies", ", ".join(removed))
    return removed


@functools.cache
def _boot_id() -> str:
    """This boot of this host ("" where the kernel does not say: then nothing is swept)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""
