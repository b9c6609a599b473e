"""Receiver: load exactly one complete, verified version from a store.

``load(load_weights)``: lease the current version's slot -> check every file (present, right
size) and every checksum -> only then call ``load_weights`` once with the tensors in manifest
order -> check the slot was not reused meanwhile -> record the loaded version.

Hazards, stated plainly:
- Tensors handed to ``load_weights`` are views of memory-mapped slot files (no second copy of
  the model). They are valid only until ``load`` returns: copy what you keep.
- Verification reads every byte once before the apply (so a damaged version never reaches
  ``load_weights``); the apply then reads from the page cache. ``verify=False`` skips it and
  relies on the slot stamp and sizes alone.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .errors import (
    DamagedVersionError,
    DBSyncError,
    IncompatibleWeightsError,
    LeaseExpiredError,
)
from .fileio import MappedFile
from .format import Manifest, check_reader_id
from .leases import DEFAULT_LEASE_TIMEOUT, IDLE, READING
from .store import Store

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


class Snapshot:
    """One leased, opened version. Use as a context manager; the lease ends on exit."""

    def __init__(self, receiver: Receiver, manifest: Manifest):
        self.receiver = receiver
        self.manifest = manifest
        self._files: dict[str, MappedFile] = {}
        self._missing: dict[str, str] = {}
        self._closed = False
        store = receiver.store
        for entry in manifest.tensors:
            path = store.tensor_path(manifest.slot, entry.file)
            try:
                self._files[entry.name] = MappedFile(path, entry.nbytes)
            except FileNotFoundError:
                self._missing[entry.name] = f"file {path} is missing"
            except OSError as exc:
                self._missing[entry.name] = str(exc)

    @property
    def version(self) -> int:
        return self.manifest.version

    def verify(self, threads: int = 4) -> None:
        """Check every file and checksum; raise one ``DamagedVersionError`` naming every bad
        tensor. Reads each byte once (which also warms the page cache for the apply)."""
        damaged = dict(self._missing)
        entries = [e for e in self.manifest.tensors if e.name in self._files]
        with ThreadPoolExecutor(threads) as pool:
            sums = list(pool.map(lambda e: self._files[e.name].checksum(), entries))
        for entry, got in zip(entries, sums, strict=True):
            if got != entry.checksum:
                damaged[entry.name] = f"checksum {got} != {entry.checksum} ({entry.file})"
        self.check_unchanged()
        if damaged:
            names = ", ".join(list(damaged)[:10]) + (" ..." if len(damaged) > 10 else "")
            raise DamagedVersionError(
                f"version {self.version} in {self.receiver.store.slot_dir(self.manifest.slot)} "
                f"is damaged ({len(damaged)} tensor(s): {names}); nothing was applied. Run "
                "`dbsync verify ROOT` and publish again from the trainer",
                damaged,
            )

    def check_compatible(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                         allow_missing: Iterable[str] = ()) -> None:
        """Raise ``IncompatibleWeightsError`` unless names, shapes and dtypes match
        ``expected`` (name -> (shape, dtype)). Names in ``allow_missing`` may be absent."""
        problems: dict[str, str] = {}
        optional = set(allow_missing)
        for entry in self.manifest.tensors:
            want = expected.get(entry.name)
            if want is None:
                problems[entry.name] = "not a parameter of the served model"
                continue
            shape, dtype = tuple(want[0]), want[1]
            if tuple(entry.shape) != shape:
                problems[entry.name] = f"shape {list(entry.shape)} != expected {list(shape)}"
            elif entry.torch_dtype != dtype:
                problems[entry.name] = f"dtype {entry.dtype} != expected {dtype}"
        published = {e.name for e in self.manifest.tensors}
        for name in expected:
            if name not in published and name not in optional:
                problems[name] = "missing from the published version"
        if problems:
            listing = "; ".join(f"{k}: {v}" for k, v in list(problems.items())[:12])
            more = f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""
            raise IncompatibleWeightsError(
                f"version {self.version} does not fit the model ({len(problems)} problem(s)): "
                f"{listing}{more}. Publish weights of the served architecture",
                problems,
            )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in manifest order; views of the slot files, valid only while leased."""
        if self._missing:
            raise DamagedVersionError(
                f"version {self.version} is missing files: {', '.join(self._missing)}",
                self._missing,
            )
        for entry in self.manifest.tensors:
            yield entry.name, self._files[entry.name].tensor(entry.torch_dtype, entry.shape)

    def check_unchanged(self) -> None:
        """Raise ``LeaseExpiredError`` if the writer has started reusing this slot."""
        stamp = self.receiver.store.read_stamp(self.manifest.slot)
        if stamp != self.version:
            raise LeaseExpiredError(
                f"slot {self.manifest.slot} no longer holds version {self.version} (its stamp "
                f"says {stamp!r}): either a writer reused the slot after this reader's lease "
                "expired (stalled longer than the lease timeout), or the stamp file was "
                "damaged. What was read cannot be trusted: load again"
            )

    def close(self) -> None:
        """End the lease. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._files.clear()
        self.receiver._release()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Receiver:
    """Reads versions from ``root``. Registers itself (a lease file) on construction, so the
    writer and ``dbsync status`` see it; ``close()`` removes it."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        reader_id: str | None = None,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        verify: bool = True,
        poll_interval: float | None = None,
        report_loaded: bool = True,
    ):
        # Creates ROOT and readers/ if missing: a receiver may start before the first push.
        self.store = Store(root, create=True)
        self.reader_id = check_reader_id(
            reader_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self.lease_timeout = lease_timeout
        self.verify = verify
        self.poll_interval = poll_interval
        #: False for helper readers (e.g. a worker staging broadcasts) whose loads must not be
        #: counted as an engine serving the version (``dbsync status``, wait_for_receivers).
        self.report_loaded = report_loaded
        self.loaded_version: int | None = None
        self.loaded_at: float | None = None
        self._lock = threading.Lock()
        self._holding: tuple[str, int] | None = None
        self._beat = 0
        self._stop_beat = threading.Event()
        self._beater: threading.Thread | None = None
        self._open_lock = threading.Lock()
        self._write_lease()

    # ---- lease --------------------------------------------------------------------------
    def _write_lease(self) -> None:
        with self._lock:
            self._beat += 1
            slot, version = self._holding or (None, None)
            self.store.write_lease(self.reader_id, {
                "reader_id": self.reader_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "state": READING if self._holding else IDLE,
                "slot": slot,
                "version": version,
                "loaded_version": self.loaded_version if self.report_loaded else None,
                "loaded_at": self.loaded_at if self.report_loaded else None,
                "beat": self._beat,
                "updated_at": time.time(),
            })

    def _heartbeat(self) -> None:
        while not self._stop_beat.wait(self.lease_timeout / 4):
            self._write_lease()

    def _acquire(self, slot: str, version: int) -> None:
        self._holding = (slot, version)
        self._write_lease()
        self._stop_beat.clear()
        self._beater = threading.Thread(target=self._heartbeat, name="dbsync-lease", daemon=True)
        self._beater.start()

    def _stop_holding(self) -> None:
        """Stop the heartbeat and mark the lease idle (the slot is free for the writer)."""
        self._stop_beat.set()
        if self._beater is not None:
            self._beater.join()
            self._beater = None
        if self._holding is not None:
            self._holding = None
            self._write_lease()

    def _release(self) -> None:
        self._stop_holding()
        self._open_lock.release()

    # ---- public -------------------------------------------------------------------------
    def latest_version(self) -> int | None:
        """The current version per the manifest, without loading anything."""
        manifest = self.store.read_manifest()
        return None if manifest is None else manifest.version

    def manifest(self) -> Manifest:
        return self.store.require_manifest()

    def open(self) -> Snapshot:
        """Lease and open the current version. Use ``with receiver.open() as snap:``."""
        self._open_lock.acquire()
        try:
            for _ in range(100):
                manifest = self.store.require_manifest()
                self._acquire(manifest.slot, manifest.version)
                again = self.store.read_manifest()
                # If the manifest still names our version after our lease is visible, the
                # writer cannot start on this slot without first seeing the lease.
                if again is not None and again.version == manifest.version:
                    snap = Snapshot(self, manifest)
                    try:
                        snap.check_unchanged()
                    except BaseException:
                        snap._files.clear()
                        raise
                    return snap
                self._stop_holding()
            raise DBSyncError("the manifest changed 100 times while opening; writer too fast?")
        except BaseException:
            self._release()
            raise

    def load(self, load_weights: LoadWeights, verify: bool | None = None) -> int:
        """Call ``load_weights(iterable of (name, tensor))`` once, in manifest order, with the
        latest complete version, after verifying it. Returns that version."""
        with self.open() as snap:
            if self.verify if verify is None else verify:
                snap.verify()
            load_weights(snap.tensors())
            snap.check_unchanged()
            self.mark_loaded(snap.version)
            return snap.version

    def mark_loaded(self, version: int) -> None:
        """Record that ``version`` is now applied (shown by ``dbsync status``, counted by
        ``Sender.wait_for_receivers``)."""
        self.loaded_version = version
        self.loaded_at = time.time()
        self._write_lease()

    def wait(self, newer_than: int | None = None, timeout: float | None = None) -> int | None:
        """Block until a version newer than ``newer_than`` (default: the loaded one) is
        published; return it, or None on timeout. Uses the store's watcher (inotify or
        polling, chosen from the mount type)."""
        from .watch import Watcher

        floor = self.loaded_version if newer_than is None else newer_than
        floor = 0 if floor is None else floor
        event = threading.Event()
        found: list[int] = []

        def on_version(v: int) -> None:
            if v > floor:
                found.append(v)
                event.set()

        with Watcher(self.store.root, on_version, poll_interval=self.poll_interval) as _:
            current = self.latest_version()
            if current is not None and current > floor:
                return current
            if not event.wait(timeout):
                current = self.latest_version()
                return current if current is not None and current > floor else None
        return max(found)

    def watch(self, callback: Callable[[int], Any], **kwargs: Any) -> Any:
        """Start a background watcher calling ``callback(version)`` on each new version
        (including the current one at start). Returns the started ``Watcher``; stop() it."""
        from .watch import Watcher

        kwargs.setdefault("poll_interval", self.poll_interval)
        watcher = Watcher(self.store.root, callback, **kwargs)
        watcher.start()
        return watcher

    def close(self) -> None:
        self.store.remove_lease(self.reader_id)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
