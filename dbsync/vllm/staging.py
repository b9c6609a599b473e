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

What is staged: until this worker's first apply, each version is staged whole, received
either straight into one fresh allocation of the whole version (no bucket buffers, no second
copy; but each tensor that spans two buckets is assembled into an allocation of its own) or,
when those assembled tensors would hold more than the bucket buffers, through the buffers into
a copy of its own (``whole_holds_less`` decides per push). That apply records
which bytes of each tensor this worker's weight loaders read (``reads.ReadRecorder``); under
tensor parallelism that is this rank's share of most tensors. From then on, when those byte
windows are at most ``WINDOW_SHARE`` of the version, each version is received through rotating
bucket buffers, every bucket verified on the device, and only the windows are kept; the apply
hands the loaders full-shape tensors holding the windows, one tensor at a time, under a guard
that stops it before any operation reads an unstaged byte (``reads.ReadGuard``). Versions of
a layout whose reads were not recorded yet are staged whole (windows covering everything) and
their apply records.

Hazards, stated plainly:
- Staged memory on the receiving device: before windows, the FULL version (one extra copy of
  the model; two while a newer version arrives during an apply), released once applied or
  replaced; with windows, one allocation of this worker's windows, kept and reused version
  after version (two or three while versions arrive during applies; at most two spares are
  kept), plus the receiver's bucket buffers (``depth`` x bucket size, 768 MiB at the
  defaults), and during an apply full-shape tensors (vLLM's layerwise reload keeps a layer's
  tensors until the layer is complete, attention layers and layers with padding until the
  end of the apply: for an MoE layer, every expert at full size). On GPUs that memory must be free
  besides vLLM's own (lower ``gpu_memory_utilization``). A refused or never-applied version
  stays staged until the next one replaces it.
- Windows rely on the loaders reading through torch operations on the applying thread (see
  ``reads``); ``DBSYNC_STAGE_WINDOWS=0`` stages whole versions always. A guard trip fails that
  apply (the controller retries it from the filesystem) and turns windows off for the life of
  the worker.
- While staging, this worker is a group member: its thread must keep receiving, and it does,
  but a worker process that stalls (e.g. swapped out) longer than the step timeout is dropped
  from the group; it then reads that version from the filesystem and re-joins.
- An apply whose version is still arriving over the broadcast (bytes received, staging copy
  or the sender's confirmation not there yet) waits for it inside the pause, at most
  ``plugin.STAGE_WAIT_SECONDS``, then reads the filesystem.
- The staging receiver's reader lease never reports a version as loaded (only the controller
  does, once per engine), so ``Sender.wait_for_receivers`` still counts engines, not workers;
  ``dbsync status`` lists it as an idle reader ``<host>-<pid>-<random>-vllm-staging``.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DBSyncError
from ..leases import default_reader_id
from ..store import Store
from .reads import ByteWindows, Layout, ReadRecorder
from .transport import check_transport, choose_transport, local_device

if TYPE_CHECKING:
    from ..nccl.layout import Header

log = logging.getLogger(__name__)

#: how often "auto" looks for ROOT/broadcast.json, and the staging thread's receive slice
_CHECK_SECONDS = 1.0
#: a member's poll of the sender's key-value store (the receiver's default, 0.25 ms, would
#: keep a core busy next to the engine)
_MEMBER_POLL_SECONDS = 0.002

#: windows are staged only when they keep at most this share of the version's bytes
WINDOW_SHARE = 0.75
#: set to "0" to stage whole versions always
WINDOWS_ENV = "DBSYNC_STAGE_WINDOWS"

Pairs = list[tuple[str, torch.Tensor]]


def windows_enabled() -> bool:
    return os.environ.get(WINDOWS_ENV, "1") != "0"


def whole_holds_less(header: Header, depth: int) -> bool:
    """Whether receiving this push into one allocation of the whole version holds fewer bytes
    than receiving it through ``depth`` bucket buffers into a copy of its own: the whole-version
    allocation duplicates every tensor that spans two buckets (assembled apart from the
    checksum rows between them); the other way needs the bucket buffers besides."""
    from ..nccl import checksum

    ends = [hi for _, hi in header.buckets()][:-1]
    spanning = sum(e.nbytes for e in header.entries
                   if bisect.bisect_right(ends, e.offset)
                   != bisect.bisect_left(ends, e.offset + e.nbytes))
    size = min(header.bucket_bytes, max(header.total_bytes, 1))
    return spanning <= depth * checksum.buffer_bytes(size)


class WindowedCopy:
    """One version staged as byte windows: one allocation on the receiving device holding,
    per tensor, the bytes of it this worker reads (``dest``: the receiver's destinations)."""

    def __init__(self, windows: ByteWindows, device: torch.device | str):
        from ..nccl.stream import ByteWindow

        self.windows = windows
        places, total = {}, 0
        for name, _, _ in windows.layout:
            lo, hi = windows.ranges[name]
            places[name] = (total, lo, hi)
            total += -(-(hi - lo) // 64) * 64
        self.flat = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        self.dest = {name: ByteWindow(lo, hi, self.flat[at:at + hi - lo])
                     for name, (at, lo, hi) in places.items()}
        #: the receiver's per-bucket copy plans into this allocation: kept with it, so a
        #: reused copy lands version after version without planning again (on GPUs a plan
        #: costs host-device round trips per bucket that would stall the stream)
        self.plans: dict[int, Any] = {}

    @property
    def nbytes(self) -> int:
        return self.windows.kept_bytes

    def tensors(self, reads: ReadRecorder | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor at full shape, holding its window (the rest is not initialized: apply
        them under a ``ReadGuard`` of these windows, unless they hold everything), made one at
        a time as the loader asks, each tracked by ``reads`` if given."""
        device = self.flat.device
        for name, dtype, shape in self.windows.layout:
            full = torch.empty(shape, dtype=dtype, device=device)
            window = self.dest[name]
            if window.hi > window.lo:
                full.reshape(-1).view(torch.uint8)[window.lo:window.hi].copy_(window.into)
            yield name, full if reads is None else reads.track(name, full)


@dataclass
class Staged:
    """One version received over the broadcast, verified bucket by bucket: its tensors
    (manifest order; whole, or this worker's windows of them) and the digest of the manifest
    the sender published it under."""

    version: int
    manifest_digest: str
    pairs: Pairs | None = None
    windowed: WindowedCopy | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held on the receiving device for this version."""
        if self.windowed is not None:
            return self.windowed.nbytes
        assert self.pairs is not None
        return sum(t.numel() * t.element_size() for _, t in self.pairs)


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
        reader_id = reader_id or default_reader_id("vllm-staging")
        self._windows: ByteWindows | None = None  # read by _whole_for at each push
        self._rx = BroadcastReceiver(root, reader_id=reader_id, device=self.device,
                                     verify=True, timeout=step_timeout,
                                     fallback_timeout=2 * step_timeout,
                                     poll_interval=_MEMBER_POLL_SECONDS,
                                     # never counted as an engine that loaded a version; no
                                     # hashing of filesystem deliveries (refused at their first
                                     # tensor anyway)
                                     report_loaded=False, fs_verify=False,
                                     # per push: straight into the staged copy, or the
                                     # windows (``_whole_for``)
                                     whole_version=self._whole_for)
        self._cond = threading.Condition()
        self._staged: Staged | None = None
        self._receiving: int | None = None
        self._incoming: tuple[int, Pairs | WindowedCopy] | None = None
        #: the staged version an apply took, until it releases it
        self._taken: Staged | None = None
        #: windowed copies that no staged version or apply holds, reused by the next versions
        self._spare: list[WindowedCopy] = []
        self._floor = self._rx.fs.latest_version() or 0
        self._stop = threading.Event()
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="dbsync-staging", daemon=True)
        self._thread.start()

    @property
    def receiver(self):  # noqa: ANN201 - the BroadcastReceiver (tests set its hooks)
        return self._rx

    @property
    def windows(self) -> ByteWindows | None:
        """The byte windows staged of each version (None: whole versions)."""
        return self._windows

    @windows.setter
    def windows(self, windows: ByteWindows | None) -> None:
        # Takes effect from the next push header (``_whole_for``); ``_stage`` keeps everything
        # of a layout the windows do not describe.
        with self._cond:
            if windows != self._windows:
                self._spare = []  # sized for the old windows: free their memory
            self._windows = windows

    def _whole_for(self, header: Header) -> bool:
        """How to receive this push: into one fresh allocation of the whole version (True), or
        through the bucket buffers into a windowed copy (False): windows when this worker has
        them, else whichever holds less (``whole_holds_less``)."""
        return self._windows is None and whole_holds_less(header, self._rx.depth)

    def _stage(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        from ..nccl.stream import IncomingVersion

        if not isinstance(pairs, IncomingVersion) or not pairs.verify:
            raise _NotBroadcast
        header = pairs.header
        with self._cond:
            self._receiving = header.version
        if pairs.whole_version:
            # views of this version's own receive allocation: kept as they are
            kept: Pairs = [(name, tensor.detach()) for name, tensor in pairs]
            self._incoming = (header.version, kept)
            return
        layout: Layout = tuple((e.name, e.torch_dtype, tuple(e.shape)) for e in header.entries)
        windows = self.windows
        if windows is None or windows.layout != layout:  # another layout: keep all of it
            windows = ByteWindows(layout, {e.name: (0, e.nbytes) for e in header.entries})
        copy = self._copy_for(windows)
        self._incoming = (header.version, copy)
        pairs.copy_into(copy.dest, copy.plans)

    def _copy_for(self, windows: ByteWindows) -> WindowedCopy:
        """A spare copy of these windows (its plans kept), else a new one."""
        with self._cond:
            while self._spare:
                copy = self._spare.pop()
                if copy.windows is windows or copy.windows == windows:
                    return copy
        return WindowedCopy(windows, self._rx.device)

    def _retire(self, staged: Staged | WindowedCopy | None) -> None:
        """Keep the windowed copy of a version nothing holds any more for reuse (at most two
        spares; caller holds ``_cond``)."""
        copy = staged.windowed if isinstance(staged, Staged) else staged
        if (copy is None or (self._staged is not None and self._staged.windowed is copy)
                or (self._taken is not None and self._taken.windowed is copy)):
            return
        self._spare = [copy, *self._spare[:1]]

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
                    kept = incoming[1]
                    staged = (Staged(version, digest, windowed=kept)
                              if isinstance(kept, WindowedCopy)
                              else Staged(version, digest, pairs=kept))
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
                if staged is None and self._incoming is not None:  # not staged: reusable
                    kept = self._incoming[1]
                    self._retire(kept if isinstance(kept, WindowedCopy) else None)
                self._incoming, self._receiving = None, None
                if staged is not None:
                    old, self._staged = self._staged, staged
                    self._retire(old)
                    self._floor = max(self._floor, staged.version)
                    log.info("dbsync: worker pid %d staged version %d from the broadcast "
                             "(%d bytes held%s)", os.getpid(), staged.version, staged.nbytes,
                             "" if staged.windowed is None else ": this worker's reads")
                self._cond.notify_all()

    def take(self, version: int, wait: float = 0.0) -> Staged | None:
        """The staged copy if it is exactly ``version``, else None. When that version is
        being received right now, waits for it up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        with self._cond:
            while self._receiving == version and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            staged = self._staged
            if staged is None or staged.version != version:
                return None
            self._taken = staged  # not reused until released
            return staged

    def release(self, version: int) -> None:
        """Drop the staged copy of ``version`` (applied, or not to be applied). A windowed
        copy is kept for reuse by a later version (with its copy plans)."""
        with self._cond:
            for attr in ("_staged", "_taken"):
                staged = getattr(self, attr)
                if staged is not None and staged.version == version:
                    setattr(self, attr, None)
                    self._retire(staged)

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
        #: what this worker's last recorded apply read, and the windows staged from it
        self._recorded: ByteWindows | None = None
        self._windows: ByteWindows | None = None
        self._windows_off = not windows_enabled()
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
                self._receiver.windows = self._windows
                log.info("dbsync: worker pid %d joins the broadcast of %s (%s)", os.getpid(),
                         self.root, self.device)

    def _watch(self) -> None:
        said = None  # the last failure logged: each is said once, not once a second
        while not self._stop.wait(_CHECK_SECONDS):
            try:
                offered = choose_transport(self.root, "auto", self.device)
            except (DBSyncError, OSError) as exc:  # the store missing or unreachable (the
                # server's status says so): the filesystem path goes on and says the rest
                if str(exc) != said:
                    said = str(exc)
                    log.info("dbsync: worker pid %d cannot look for a broadcast of %s (%s); "
                             "looking again every %g s", os.getpid(), self.root, exc,
                             _CHECK_SECONDS)
                continue
            if offered != "broadcast":
                said = None
                continue
            try:
                self._start_receiver()
                return
            except Exception as exc:  # noqa: BLE001 - keep watching; the filesystem path remains
                if repr(exc) != said:
                    said = repr(exc)
                    log.exception("dbsync: could not start the broadcast receiver")

    def needs_recording(self, layout: Layout) -> bool:
        """Whether an apply of a version of ``layout`` should record what this worker reads
        (windows are on and none were recorded for that layout)."""
        recorded = self._recorded
        return not self._windows_off and (recorded is None or recorded.layout != layout)

    def record(self, windows: ByteWindows) -> None:
        """What an apply read: stage only that from now on, if it is at most
        ``WINDOW_SHARE`` of the version."""
        if self._windows_off:
            return
        self._recorded = windows
        full, kept = windows.full_bytes, windows.kept_bytes
        use = windows if kept <= WINDOW_SHARE * full else None
        self._set_windows(use)
        log.info("dbsync: worker pid %d reads %d of %d bytes of each version: %s", os.getpid(),
                 kept, full, "staging only those" if use is not None else "staging it whole")

    def windows_failed(self, why: str) -> None:
        """An apply from windows read outside them: stage whole versions from now on."""
        self._windows_off = True
        self._recorded = None
        self._set_windows(None)
        log.warning("dbsync: worker pid %d stages whole versions from now on (%s)",
                    os.getpid(), why)

    def _set_windows(self, windows: ByteWindows | None) -> None:
        with self._lock:
            self._windows = windows
            if self._receiver is not None:
                self._receiver.windows = windows

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
