"""A minimal inotify watch of directories (Linux), for the watcher.

Why not watchdog's observer: it holds every IN_MOVED_FROM event for up to 0.5 s in an
uninterruptible sleep while it waits for the matching IN_MOVED_TO, so a flip (a rename) was
now and then seen 0.5 s late and ``stop()`` could block as long. This watch asks the kernel
only for what changes a file (moved to, created, closed after a write, modified) and for the
directory itself going away; it never asks for opens, reads or closes without a write, so
readers of the directory (the watcher included) never wake it.

One inotify instance per process, however many watches (``_Instance``): the kernel allows
each user 128 instances by default (``fs.inotify.max_user_instances``) across every process
of the host, and a process with many watchers (one per ``Receiver.wait`` call in flight, a
server watching many stores) once took one each and ran out. Watches of one directory share
one kernel watch. The instance's thread blocks in ``poll`` on the inotify fd and a wake-up
pipe: idle, it costs nothing. When the last watch stops, the instance lingers ``LINGER``
seconds (a loop of ``Receiver.wait`` calls keeps one instance), then its thread closes it on
its way out (closing one waits for the kernel's grace period, 10-20 ms, which callers should
not pay); the next watch opens a new one. A forked child drops the inherited instance (reading it
would take the parent's events) and opens its own.

``on_event(name)`` is called from the instance's thread with the file name (``str``) of an
event in ``changes`` (default: moved to, created, closed after a write, modified), with None
when the directory itself was deleted or moved (watch it again), or with ``LOST`` (``""``)
when the kernel's event queue overflowed (events were lost: look at everything again; the
watch itself is intact). Callbacks must be quick (they share the thread); one that raises is
logged and the others still run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import itertools
import logging
import os
import select
import struct
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_MASK_ADD = 0x20000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

CHANGES = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
#: a name (re)appearing: what re-pointing a symlink does in its directory
APPEARS = IN_MOVED_TO | IN_CREATE
SELF_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
#: the name passed when events were lost (the kernel's queue overflowed)
LOST = ""
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
#: seconds an instance with no watch left stays open for the next one
LINGER = 2.0

_libc: ctypes.CDLL | None = None

Callback = Callable[[str | None], None]


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # The process's own symbols first: ``find_library`` runs ``ldconfig`` and needs temp
        # files, which fails in a process at its open-file limit.
        lib = ctypes.CDLL(None, use_errno=True)
        if not hasattr(lib, "inotify_init1"):
            lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = lib
    return _libc


def _check(result: int, what: str, path: str | None = None) -> int:
    if result < 0:
        code = ctypes.get_errno()
        advice = {
            errno.EMFILE: " (this user's inotify instances, fs.inotify.max_user_instances, or "
                          "this process's open files, ulimit -n, are used up)",
            errno.ENOSPC: " (no inotify watch left for this user: raise "
                          "fs.inotify.max_user_watches)",
        }.get(code, "")
        message = f"{what}: {os.strerror(code)}{advice}"
        raise OSError(code, message) if path is None else OSError(code, message, path)
    return result


class _Instance:
    """The process's inotify instance, its thread and the watches on it (one job: route each
    event to the callbacks of its directory). Created by the first watch, closed ``LINGER``
    seconds after the last one stopped; everything here is under ``_LOCK``."""

    def __init__(self) -> None:
        try:
            lib = _lib()
        except (OSError, AttributeError) as exc:  # not Linux: no inotify in this libc
            raise OSError(errno.ENOSYS, f"inotify is not available here ({exc})") from None
        self.lib = lib
        self.fd = _check(lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
        try:
            self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            os.close(self.fd)
            raise
        self.pid = os.getpid()
        self.closing = False  # (set once, by its thread: takes no more watches)
        #: wd -> token -> (callback, the changes it asked for)
        self.watches: dict[int, dict[int, tuple[Callback, int]]] = {}
        _open.add(self)
        self.thread = threading.Thread(target=self._run, name="dbsync-inotify", daemon=True)
        self.thread.start()

    def add(self, path: str, token: int, on_event: Callback, changes: int) -> int:
        # (IN_MASK_ADD: the kernel keeps one watch per directory; each watcher of it adds
        # the changes it wants, and is called only for those)
        mask = changes | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_MASK_ADD
        wd = _check(self.lib.inotify_add_watch(self.fd, os.fsencode(path), mask),
                    "inotify_add_watch", path)
        self.watches.setdefault(wd, {})[token] = (on_event, changes)
        return wd

    def remove(self, wd: int, token: int) -> None:
        callbacks = self.watches.get(wd)
        if callbacks is None or callbacks.pop(token, None) is None:
            return  # (its directory went away: the kernel removed the watch already)
        if not callbacks:
            del self.watches[wd]
            self.lib.inotify_rm_watch(self.fd, wd)  # (fails harmlessly if already gone)
        if not self.watches:  # the thread starts its linger
            try:
                os.write(self.wake_w, b"x")
            except OSError:
                pass

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - every watcher falls back to its periodic looks
            log.exception("dbsync inotify thread failed; watchers fall back to their "
                          "periodic looks")
            with _LOCK:
                callbacks = [c for w in self.watches.values() for c, _ in w.values()]
                self.watches.clear()
                self.closing = True
            for callback in callbacks:
                _call(callback, None)
        finally:
            global _instance
            with _LOCK:
                if _instance is self:
                    _instance = None
                _open.discard(self)
            # (outside the lock: closing an instance waits for the kernel's grace period,
            # which watches starting or stopping meanwhile must not wait for)
            for fd in (self.fd, self.wake_r, self.wake_w):
                os.close(fd)

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            with _LOCK:
                idle = not self.watches
            ready = {fd for fd, _ in poller.poll(int(LINGER * 1000) if idle else None)}
            if not ready:  # lingered with no watch
                with _LOCK:
                    if not self.watches:
                        self.closing = True
                        return
                continue
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
            if self.fd not in ready:
                continue
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                continue
            calls: list[tuple[Callback, str | None]] = []
            with _LOCK:
                for wd, mask, name in _events(data):
                    if mask & IN_Q_OVERFLOW:  # (wd -1): every watch looks again
                        calls += [(c, LOST) for w in self.watches.values()
                                  for c, _ in w.values()]
                        continue
                    callbacks = self.watches.get(wd)
                    if callbacks is None:
                        continue  # (a watch removed meanwhile)
                    if mask & SELF_GONE:
                        if mask & IN_IGNORED:  # the kernel dropped this watch
                            del self.watches[wd]
                        calls += [(c, None) for c, _ in callbacks.values()]
                    elif name:
                        calls += [(c, name) for c, wanted in callbacks.values()
                                  if mask & wanted]
            for callback, name in calls:
                _call(callback, name)


def _call(callback: Callback, name: str | None) -> None:
    try:
        callback(name)
    except Exception:  # noqa: BLE001 - one watcher's failure must not end the others' events
        log.exception("dbsync inotify callback failed")


_LOCK = threading.Lock()
_instance: _Instance | None = None
_open: set[_Instance] = set()  # instances whose fds are not closed yet (retiring included)
_tokens = itertools.count(1)


def _forget_after_fork() -> None:
    """In a forked child: the inherited instance's thread is gone and its events belong to
    the parent. Close this process's copies of its fds and start afresh."""
    global _LOCK, _instance
    _LOCK = threading.Lock()
    _instance = None
    for old in list(_open):
        for fd in (old.fd, old.wake_r, old.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        old.watches.clear()
        old.closing = True
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class DirectoryWatch:
    """Events of the files directly in ``path`` (see the module docstring). Raises OSError
    from ``start()`` when no watch can be set (not Linux, no inotify instance or watch left
    for this user: ``fs.inotify.max_user_instances`` / ``max_user_watches``; the message
    says which)."""

    def __init__(self, path: str, on_event: Callback, changes: int = CHANGES):
        self.path = path
        self.on_event = on_event
        self.changes = changes
        self._token = next(_tokens)
        self._placed: tuple[_Instance, int] | None = None

    def start(self) -> DirectoryWatch:
        global _instance
        with _LOCK:
            instance = _instance
            if instance is None or instance.closing:
                instance = _instance = _Instance()
            wd = instance.add(self.path, self._token, self.on_event, self.changes)
            self._placed = (instance, wd)
        return self

    def stop(self) -> None:
        """Stop the events and return at once (the instance, if this was its last watch, is
        closed by its thread after ``LINGER`` seconds). ``on_event`` may still be called once
        if the thread was handling events at this moment."""
        with _LOCK:
            placed, self._placed = self._placed, None
            if placed is not None and placed[0].pid == os.getpid():
                placed[0].remove(placed[1], self._token)


def _events(data: bytes) -> list[tuple[int, int, str]]:
    """(watch, mask, file name) of each event in a buffer of inotify events (the name is ""
    for events of the directory itself)."""
    out: list[tuple[int, int, str]] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, _, length = _HEADER.unpack_from(data, offset)
        raw = data[offset + _HEADER.size: offset + _HEADER.size + length]
        offset += _HEADER.size + length
        out.append((wd, mask, os.fsdecode(raw.rstrip(b"\0"))))
    return out
