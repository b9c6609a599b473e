"""Broadcast transport inside a vLLM worker (worker side): take versions from the sender's
broadcast group into a staged copy in the background, so the swap applies from memory.

The swap semantics stay those of the filesystem path: the controller still waits for the
manifest flip (the single source of truth), checks fit and verifies before pausing, and pauses
only for the apply. Inside the pause the worker applies the staged copy only if it is exactly
the requested version and the sender confirmed publishing it under the manifest the store holds
now (same digest of version, names, dtypes, shapes and xxh3 checksums); otherwise it reads the
filesystem, exactly as with ``transport="filesystem"``. The background thread never touches
the model: ``load_weights`` runs only inside ``update_weights``, between vLLM's layerwise-reload
start and finish.

Checksums: every bucket is verified on the worker's device as it lands (the sender seals each
bucket with a checksum computed on its device), before its tensors are staged: no host copy,
no host hashing. A push the sender did not seal is not staged (the apply reads the filesystem).
How the bucket checksums relate to the manifest's: see docs/BROADCAST.md.

Hazards, stated plainly:
- Each version is received straight into one fresh allocation on the receiving device (the
  staged copy itself: no bucket buffers, no second copy, nothing copied out while the stream
  runs): the FULL model (not this rank's shard), so a worker briefly holds one extra copy of
  the model (two while a newer version arrives during an apply). On GPUs that memory must be
  free besides vLLM's own (lower ``gpu_memory_utilization``). The copy is released once it is
  applied (or replaced by the next version; a refused or never-applied version stays staged
  until then).
- While staging, this worker is a group member: its thread must keep receiving, and it does,
  but a worker process that stalls (e.g. swapped out) longer than the step timeout is dropped
  from the group; it then reads that version from the filesystem and re-joins.
- An apply whose version is still arriving over the broadcast (bytes received, staging copy
  or the sender's confirmation not there yet) waits for it inside the pause, at most
  ``plugin.STAGE_WAIT_SECONDS``, then reads the filesystem.
- The staging receiver's reader lease never reports a version as loaded (only the controller
  does, once per engine), so ``Sender.wait_for_receivers`` still counts engines, not workers;
  ``dbsync status`` lists it as an idle reader ``<host>-<pid>-vllm-staging``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import DBSyncError
from ..store import Store
from .transport import check_transport, choose_transport, local_device

log = logging.getLogger(__name__)

#: how often "auto" looks for ROOT/broadcast.json, and the staging thread's receive slice
_CHECK_SECONDS = 1.0
#: a member's poll of the sender's key-value store (the receiver's default, 0.25 ms, would
#: keep a core busy next to the engine)
_MEMBER_POLL_SECONDS = 0.002

Pairs = list[tuple[str, torch.Tensor]]


@dataclass
class Staged:
    """One version received over the broadcast, verified bucket by bucket: its tensors
    (manifest order) and the digest of the manifest the sender published it under."""

    version: int
    pairs: Pairs
    manifest_digest: str

    def matches(self, root: str) -> str | None:
        """None if the manifest at ``root`` is the one this version was published under,
        else why not."""
        from ..nccl.rendezvous import manifest_digest

        manifest = Store(root, create=False).read_manifest()
        if manifest is None or manifest.version != self.version:
            current = None if manifest is None else manifest.version
            return f"the manifest names version {current}, not {self.version}"
        if manifest_digest(manifest) != self.manifest_digest:
            return ("the manifest is not the one the broadcast sender published this version "
                    "under (another sender published it?)")
        return None


class _NotBroadcast(Exception):
    """Raised into the receiver when it offers a version from the filesystem: the staging
    thread stages broadcasts only (the apply reads the filesystem itself when needed)."""


class StagingReceiver:
    """Background broadcast receiver that keeps the newest received, verified version staged.

    ``take(version)`` hands it out; nothing else reads it. Never raises from its thread: every
    failure is logged, recorded in ``last_error``, and leaves the filesystem path in place."""

    def __init__(self, root: str, reader_id: str | None = None, device: str | None = None,
                 step_timeout: float = 30.0):
        from ..nccl import BroadcastReceiver

        self.root = root
        self.device = device or local_device()
        self.step_timeout = step_timeout
        reader_id = reader_id or f"{socket.gethostname()}-{os.getpid()}-vllm-staging"
        self._rx = BroadcastReceiver(root, reader_id=reader_id, device=self.device,
                                     verify=True, timeout=step_timeout,
                                     fallback_timeout=2 * step_timeout,
                                     poll_interval=_MEMBER_POLL_SECONDS,
                                     # never counted as an engine that loaded a version; no
                                     # hashing of filesystem deliveries (refused at their first
                                     # tensor anyway)
                                     report_loaded=False, fs_verify=False,
                                     # received straight into the staged copy: no bucket
                                     # buffers, no second copy on the device
                                     whole_version=True)
        self._cond = threading.Condition()
        self._staged: Staged | None = None
        self._receiving: int | None = None
        self._incoming: tuple[int, Pairs] | None = None
        self._floor = self._rx.fs.latest_version() or 0
        self._stop = threading.Event()
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="dbsync-staging", daemon=True)
        self._thread.start()

    @property
    def receiver(self):  # noqa: ANN201 - the BroadcastReceiver (tests set its hooks)
        return self._rx

    def _stage(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        from ..nccl.stream import IncomingVersion

        if not isinstance(pairs, IncomingVersion) or not pairs.verify:
            raise _NotBroadcast
        with self._cond:
            self._receiving = pairs.header.version
        # views of this version's own receive allocation (``whole_version``): kept as they are
        kept: Pairs = [(name, tensor.detach()) for name, tensor in pairs]
        self._incoming = (pairs.header.version, kept)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._incoming = None
            staged = None
            try:
                version = self._rx.receive(self._stage, newer_than=self._floor,
                                           timeout=_CHECK_SECONDS)
                incoming = self._incoming
                if (version is not None and incoming is not None and incoming[0] == version
                        and self._rx.last_source == "broadcast"):
                    # the sender confirms the version once it is on the filesystem
                    digest = self._rx.published(timeout=2 * self.step_timeout)
                    staged = Staged(version, incoming[1], digest)
            except _NotBroadcast:
                # A version reached this receiver through the filesystem only: leave it to the
                # apply, and wait for the next one.
                self._floor = max(self._floor, self._rx.fs.latest_version() or 0)
            except Exception as exc:  # never let the thread die: the filesystem path remains
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("dbsync: broadcast staging failed (%s); applies read the "
                            "filesystem meanwhile", self.last_error)
                if not isinstance(exc, DBSyncError):
                    self._stop.wait(_CHECK_SECONDS)
            with self._cond:
                self._incoming, self._receiving = None, None
                if staged is not None:
                    self._staged = staged
                    self._floor = max(self._floor, staged.version)
                    log.info("dbsync: worker pid %d staged version %d from the broadcast",
                             os.getpid(), staged.version)
                self._cond.notify_all()

    def take(self, version: int, wait: float = 0.0) -> Staged | None:
        """The staged copy if it is exactly ``version``, else None. When that version is
        being received right now, waits for it up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        with self._cond:
            while self._receiving == version and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            staged = self._staged
        return staged if staged is not None and staged.version == version else None

    def release(self, version: int) -> None:
        """Drop the staged copy of ``version`` (applied: the memory is not needed any more)."""
        with self._cond:
            if self._staged is not None and self._staged.version == version:
                self._staged = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_CHECK_SECONDS * 5)
        self._rx.close()


class Stager:
    """A worker's transport: ``transport`` is "broadcast" (stage from the start) or "auto"
    (start staging once ``ROOT/broadcast.json`` offers a backend this worker can join; until
    then one ``stat`` per second, nothing else)."""

    def __init__(self, root: str, transport: str, device: str | None = None,
                 step_timeout: float = 30.0):
        if check_transport(transport) == "filesystem":
            raise DBSyncError("a Stager is for the broadcast transports ('auto', 'broadcast')")
        self.root = root
        self.transport = transport
        self.device = device or local_device()
        self.step_timeout = step_timeout
        self._lock = threading.Lock()
        self._receiver: StagingReceiver | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if transport == "broadcast":
            self._start_receiver()
        else:
            self._thread = threading.Thread(target=self._watch, name="dbsync-transport",
                                            daemon=True)
            self._thread.start()

    @property
    def receiver(self) -> StagingReceiver | None:
        return self._receiver

    def _start_receiver(self) -> None:
        with self._lock:
            if self._receiver is None and not self._stop.is_set():
                self._receiver = StagingReceiver(self.root, device=self.device,
                                                 step_timeout=self.step_timeout)
                log.info("dbsync: worker pid %d joins the broadcast of %s (%s)", os.getpid(),
                         self.root, self.device)

    def _watch(self) -> None:
        while not self._stop.wait(_CHECK_SECONDS):
            try:
                if choose_transport(self.root, "auto", self.device) == "broadcast":
                    self._start_receiver()
                    return
            except Exception:  # noqa: BLE001 - keep watching; the filesystem path remains
                log.exception("dbsync: could not start the broadcast receiver")

    def take(self, version: int, wait: float) -> Staged | None:
        receiver = self._receiver
        return None if receiver is None else receiver.take(version, wait)

    def release(self, version: int) -> None:
        if self._receiver is not None:
            self._receiver.release(version)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_CHECK_SECONDS * 3)
        with self._lock:
            if self._receiver is not None:
                self._receiver.close()
                self._receiver = None
