"""Notice new versions: inotify (watchdog's observer) where events arrive, polling where they
cannot, chosen from the mount type.

NFS, Lustre, CIFS and FUSE clients get no inotify events for changes made by other hosts (or,
for FUSE, by the backing store), so on those mounts the watcher polls. Polling *opens and
reads* the manifest each interval rather than ``stat``-ing it: on NFS ``stat`` answers from the
attribute cache (up to ``acregmax``, 60 s by default), while an open revalidates
(close-to-open consistency).

Callbacks run on one dispatcher thread, one at a time, in version order, never for the same
version twice. A callback that raises is logged and kept in ``last_error``; the watcher goes on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .format import MANIFEST_FILE
from .store import Store

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL = 1.0
SAFETY_POLL_INTERVAL = 5.0
_REMOTE_TYPES = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "9p",
    "beegfs", "afs", "fuse", "fuseblk", "virtiofs", "panfs", "orangefs", "weka", "wekafs",
}


def mount_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """Filesystem type of the mount holding ``path`` ("unknown" if it cannot be told)."""
    target = os.path.realpath(path)
    best, best_type = "", "unknown"
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return best_type
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(
            best
        ):
            best, best_type = point, right.split()[0]
    return best_type


def needs_polling(path: str) -> bool:
    kind = mount_type(path)
    return kind in _REMOTE_TYPES or kind.startswith(("fuse.", "nfs"))


class Watcher:
    """Calls ``callback(version)`` for each new version published in ``root`` (and for the
    current one when started, unless ``skip_current``).

    ``use_polling``: None = decide from the mount type. ``poll_interval``: seconds between
    polls (default 1.0). ``read_version``: injectable for tests (default: read the manifest)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        callback: Callable[[int], Any],
        poll_interval: float | None = None,
        use_polling: bool | None = None,
        skip_current: bool = False,
        read_version: Callable[[], int | None] | None = None,
    ):
        self.root = os.path.abspath(os.fspath(root))
        self.callback = callback
        self.poll_interval = DEFAULT_POLL_INTERVAL if poll_interval is None else poll_interval
        self.polling = needs_polling(self.root) if use_polling is None else use_polling
        self.skip_current = skip_current
        store = Store(self.root, create=False)
        self._read_version = read_version or (lambda: _version_of(store))
        self.last_version: int | None = None
        self.last_error: BaseException | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._observer: Any = None

    @property
    def mode(self) -> str:
        return "polling" if self.polling else "inotify"

    def start(self) -> Watcher:
        if self.skip_current:
            self.last_version = self._safe_read()
        if not self.polling:
            self._start_observer()
        self._thread = threading.Thread(target=self._run, name="dbsync-watch", daemon=True)
        self._thread.start()
        return self

    def _start_observer(self) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        wake = self._wake

        class _OnManifest(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                paths = (getattr(event, "src_path", ""), getattr(event, "dest_path", ""))
                if any(os.path.basename(os.fsdecode(p)) == MANIFEST_FILE for p in paths if p):
                    wake.set()

        self._observer = Observer()
        self._observer.schedule(_OnManifest(), self.root, recursive=False)
        self._observer.start()

    def _safe_read(self) -> int | None:
        try:
            return self._read_version()
        except Exception as exc:  # a damaged manifest must not kill the watcher
            self.last_error = exc
            log.warning("dbsync watcher: cannot read the manifest in %s: %s", self.root, exc)
            return None

    def _run(self) -> None:
        interval = self.poll_interval if self.polling else max(SAFETY_POLL_INTERVAL,
                                                               self.poll_interval)
        while not self._stop.is_set():
            version = self._safe_read()
            if version is not None and (self.last_version is None or version > self.last_version):
                self.last_version = version
                try:
                    self.callback(version)
                except Exception as exc:
                    self.last_error = exc
                    log.exception("dbsync watcher: callback failed for version %s", version)
            self._wake.wait(interval)
            self._wake.clear()

    def stop(self) -> None:
        """Stop at once (the sleep is interruptible) and join the threads."""
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
            self._observer = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _version_of(store: Store) -> int | None:
    manifest = store.read_manifest()
    return None if manifest is None else manifest.version
