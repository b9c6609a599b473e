"""A minimal inotify watch of one directory (Linux), for the watcher.

Why not watchdog's observer: it holds every IN_MOVED_FROM event for up to 0.5 s in an
uninterruptible sleep while it waits for the matching IN_MOVED_TO, so a flip (a rename) was
now and then seen 0.5 s late and ``stop()`` could block as long. This watch asks the kernel
only for what changes a file (moved to, created, closed after a write, modified) and for the
directory itself going away; it never asks for opens, reads or closes without a write, so
readers of the directory (the watcher included) never wake it.

One thread per watch blocks in ``poll`` on the inotify fd and a wake-up pipe: idle, it costs
nothing; ``stop()`` returns at once (the thread closes the instance on its way out).
``on_event(name)`` is called from that thread with the file name (``str``), or with None when
the directory itself was deleted or moved, or when the kernel's event queue overflowed (look
at everything again).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
from collections.abc import Callable

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

CHANGES = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
SELF_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_Q_OVERFLOW
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        _libc = lib
    return _libc


def _check(result: int, what: str, path: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", path)
    return result


class DirectoryWatch:
    """Events of the files directly in ``path`` (see the module docstring). Raises OSError
    from ``start()`` when no watch can be set (not Linux, no inotify instances or watches
    left: ``fs.inotify.max_user_instances`` / ``max_user_watches``)."""

    def __init__(self, path: str, on_event: Callable[[str | None], None]):
        self.path = path
        self.on_event = on_event
        self._fd = -1
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> DirectoryWatch:
        try:
            lib = _lib()
        except (OSError, AttributeError) as exc:  # not Linux: no inotify in this libc
            raise OSError(errno.ENOSYS, f"inotify is not available here ({exc})") from None
        self._fd = _check(lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1",
                          self.path)
        try:
            _check(lib.inotify_add_watch(self._fd, os.fsencode(self.path),
                                         CHANGES | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR),
                   "inotify_add_watch", self.path)
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._run, name="dbsync-inotify", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Tell the thread to stop, and return at once: the thread closes the inotify
        instance itself on its way out (closing one waits for the kernel's grace period,
        10-20 ms, which callers waiting for a version should not pay). ``on_event`` may still
        be called once if the thread was handling events at this moment."""
        with self._lock:
            if not self._closed and self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass
        self._thread = None

    def _close(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                self._closed = True
                self._close()

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r in ready:
                return
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                continue
            except OSError:
                self.on_event(None)
                return
            for name in _names(data):
                self.on_event(name)


def _names(data: bytes) -> list[str | None]:
    """The names in a buffer of inotify events (None for events of the directory itself)."""
    out: list[str | None] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        _, mask, _, length = _HEADER.unpack_from(data, offset)
        raw = data[offset + _HEADER.size: offset + _HEADER.size + length]
        offset += _HEADER.size + length
        if mask & SELF_GONE:
            out.append(None)
        elif mask & CHANGES:
            out.append(os.fsdecode(raw.rstrip(b"\0")))
    return out
