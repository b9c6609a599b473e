"""Sender: publish complete versions of a set of weights into a store.

push = collect and validate -> snapshot (when needed) -> wait until the free slot has no live
reader -> stamp the slot "writing" -> parallel buffered writes into preallocated files ->
fsync -> tensordict meta + slot stamp -> the flip (atomic manifest replace).

Guarantees (docs/FORMAT.md, each with a test): a push that fails or is killed at any point
leaves the previous version current and intact; the slot the manifest points to is never
written; versions increase by one per push, continuing after a writer restart.

Hazards: one push runs at a time; a second ``push`` waits for the one before it. With
``durable=False`` (meant for same-host ``/dev/shm``), a power loss may leave the current
version pointing at incomplete data.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from . import fileio, sources
from .errors import DBSyncError
from .format import FILE_SUFFIX, SLOTS, Manifest, TensorEntry, dtype_name, file_stems_for
from .leases import DEFAULT_LEASE_TIMEOUT, LeaseMonitor
from .status import wait_for_receivers
from .store import WRITING, Store

Progress = Callable[[int, int], None]


class _HostBuffer:
    """A reusable host staging buffer (pinned when CUDA is available) that snapshots tensors
    so the caller may modify its weights as soon as ``push`` returns."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def snapshot(self, pairs: sources.Pairs, dtype: torch.dtype | None) -> sources.Pairs:
        """Copy into the buffer, converting floating tensors to ``dtype`` during the copy (no
        converted second copy of the model on the GPU)."""
        dtypes = [sources.target_dtype(t, dtype) for _, t in pairs]
        sizes = [t.numel() * d.itemsize for (_, t), d in zip(pairs, dtypes, strict=True)]
        total = sum(fileio.aligned(n) for n in sizes)
        if self._buf is None or self._buf.numel() < total:
            pin = torch.cuda.is_available()
            self._buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        out: sources.Pairs = []
        offset = 0
        for (name, t), size, dt in zip(pairs, sizes, dtypes, strict=True):
            dst = self._buf[offset : offset + size].view(dt).view(t.shape) if size else (
                torch.empty(t.shape, dtype=dt))
            if size:
                dst.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            out.append((name, dst))
            offset += fileio.aligned(size)
        if any(t.device.type == "cuda" for _, t in pairs):
            torch.cuda.synchronize()
        return out


class Sender:
    """Publishes versions into ``root``. One Sender per store (it takes the writer lock).

    ``num_threads``: parallel writers. ``dtype``: convert floating tensors (e.g.
    ``torch.bfloat16``). ``strategy``: how an ``nn.Module`` becomes names ("state_dict" or
    "tensordict"). ``durable``: fsync data and directories before the flip (default; turn off
    only for ``/dev/shm``). ``lease_timeout``: how long a reader that stopped heart-beating may
    keep a slot."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        num_threads: int = 8,
        dtype: torch.dtype | None = None,
        strategy: str = "state_dict",
        durable: bool = True,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
    ):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise DBSyncError(f"dtype= must be a floating torch dtype, not {dtype!r}")
        if strategy not in sources.STRATEGIES:
            raise DBSyncError(f"strategy must be one of {sources.STRATEGIES}, not {strategy!r}")
        if num_threads < 1:
            raise DBSyncError("num_threads must be at least 1")
        self.store = Store(root, create=True)
        self.dtype = dtype
        self.strategy = strategy
        self.durable = durable
        self._lock_fd: int | None = self.store.lock_writer()
        self.store.remove_temp_files()
        self._leases = LeaseMonitor(self.store, lease_timeout)
        self._io = ThreadPoolExecutor(num_threads, thread_name_prefix="dbsync-write")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="dbsync-publish")
        self._staging = _HostBuffer()
        self._pending: Future[int] | None = None
        self._push_lock = threading.Lock()
        self.last_push_seconds: dict[str, float] = {}

    @property
    def root(self) -> str:
        return self.store.root

    def latest_version(self) -> int | None:
        manifest = self.store.read_manifest()
        return None if manifest is None else manifest.version

    def push(self, weights: Any, blocking: bool = True,
             progress: Progress | None = None) -> Any:
        """Publish ``weights`` as the next version.

        ``blocking=True`` returns the new version once it is published (durable and flipped).
        ``blocking=False`` returns a ``Future[int]`` as soon as the weights are snapshotted to
        host memory; the caller may then modify them. Errors in the background surface from
        ``future.result()``. ``progress(bytes_done, bytes_total)`` is called from writer
        threads."""
        if self._lock_fd is None:
            raise DBSyncError("this Sender is closed; create a new one")
        with self._push_lock:
            pairs = sources.collect(weights, self.strategy)  # dtype is applied below
            if self._pending is not None:
                # The staging buffer may still be in use by the previous push: wait for it.
                # Its error (if any) belongs to its own future, not to this push.
                try:
                    self._pending.result()
                except BaseException:  # noqa: BLE001
                    pass
            needs_copy = not blocking or any(t.device.type != "cpu" for _, t in pairs)
            if needs_copy:
                pairs = self._staging.snapshot(pairs, self.dtype)
            else:
                pairs = [(n, t.detach().to(sources.target_dtype(t, self.dtype)).contiguous())
                         for n, t in pairs]
            future = self._publisher.submit(self._publish, pairs, progress)
            self._pending = future
        return future.result() if blocking else future

    def _publish(self, pairs: sources.Pairs, progress: Progress | None) -> int:
        t0 = time.perf_counter()
        current = self.store.read_manifest()
        version = 1 if current is None else current.version + 1
        slot = SLOTS[0] if current is None else SLOTS[1 - SLOTS.index(current.slot)]
        waited = self._leases.wait_until_free(slot)
        t1 = time.perf_counter()

        names = [n for n, _ in pairs]
        files = [stem + FILE_SUFFIX for stem in file_stems_for(names)]
        # From here on the slot is not a complete version: say so before touching its data.
        # (Not fsynced: after a power loss the manifest still names the other slot, and this
        # stamp only matters to live readers, which see it through the page cache or, on
        # NFS, at their next open.)
        self.store.write_stamp(slot, WRITING, durable=False)
        writes = [fileio.FileWrite(self.store.tensor_path(slot, f), fileio.tensor_bytes(t))
                  for f, (_, t) in zip(files, pairs, strict=True)]
        on_bytes = None
        if progress is not None:
            total, done, lock = sum(len(w.data) for w in writes), [0], threading.Lock()

            def on_bytes(n: int) -> None:
                with lock:
                    done[0] += n
                    progress(done[0], total)

        checksums = fileio.write_files(writes, self._io, self.durable, on_bytes)
        t2 = time.perf_counter()
        entries = tuple(
            TensorEntry(name, f, dtype_name(t.dtype), tuple(t.shape),
                        t.numel() * t.element_size(), c)
            for (name, t), f, c in zip(pairs, files, checksums, strict=True)
        )
        manifest = Manifest(
            version=version, slot=slot, tensors=entries, created_at=time.time(),
            durable=self.durable, writer={"host": socket.gethostname(), "pid": os.getpid()},
        )
        self.store.remove_unlisted_files(slot, set(files))
        self.store.write_tensordict_meta(manifest, durable=self.durable, sync_dir=False)
        self.store.write_stamp(slot, version, durable=self.durable, sync_dir=False)
        if self.durable:
            self.store.sync_slot(slot)  # one directory fsync for the unlinks and both replaces
        self.store.publish_manifest(manifest, durable=self.durable)
        t3 = time.perf_counter()
        self.last_push_seconds = {"wait_for_readers": waited,
                                  "write": t2 - t1, "flip": t3 - t2, "total": t3 - t0}
        return version

    def wait_for_receivers(self, version: int, count: int, timeout: float | None = None
                           ) -> bool:
        """Wait until at least ``count`` receivers report ``version`` (or newer) loaded;
        False on timeout."""
        return wait_for_receivers(self.store, version, count, timeout)

    def close(self) -> None:
        """Finish the pending push (its errors stay in its future), release the writer lock."""
        if self._lock_fd is None:
            return
        self._publisher.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.store.unlock_writer(self._lock_fd)
        self._lock_fd = None

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
