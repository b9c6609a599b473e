"""BroadcastSender: push each version to the receivers of the current epoch over a collective
(NCCL on GPUs, gloo on CPUs), and still publish it to the filesystem through a ``Sender``.

push = take join/leave requests (``membership``: a change starts a new epoch) -> announce the
version's header (prepared ahead: reused while names, dtypes and shapes stay the same) ->
stream the bytes in manifest order in sealed buckets (``outgoing``: packing, dtype conversion
and checksums per bucket, on the device) -> publish the same version through the ``Sender``
(in the background with ``blocking=False``) -> confirm it to the members (the digest of the
manifest the version was published under).

The stream starts as soon as the header is announced: members acknowledge in parallel, and the
acknowledgements are read only to name the members that held a push up.

Guarantees: the manifest stays the single source of truth. Whatever happens to the broadcast
(a receiver dies or stalls, a timeout, a broken link), ``push`` still publishes the version to
the filesystem, and no step waits longer than ``timeout`` (``join_timeout`` for forming an
epoch). After a failed broadcast the epoch is closed; surviving receivers re-join and the next
push forms a new epoch.

Hazards, stated plainly:
- Every member must be inside ``BroadcastReceiver.receive`` when a push comes; one that is
  busy elsewhere costs this push up to ``timeout`` and is dropped from the group (it reads that
  version from the filesystem and re-joins).
- The broadcast reads the caller's tensors directly: do not modify them until ``push`` returns
  (with ``blocking=False``, until it returns the future: the filesystem copy is snapshotted).
  A modification from another thread or stream during a push goes undetected: members would
  hold other bytes than the manifest.
- The key-value store listens on ``port`` on every interface of this host, unauthenticated:
  trusted networks only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any

import torch

from .. import sources
from ..errors import DBSyncError, InvalidArgumentError, check_seconds
from ..sender import Sender
from . import checksum
from . import rendezvous as rv
from .errors import BroadcastError, BroadcastTimeoutError
from .group import resolve_backend
from .layout import ALIGN, DEFAULT_BUCKET_BYTES, Header, HeaderCache
from .membership import Membership, wait_for_keys
from .outgoing import OutgoingStream

log = logging.getLogger(__name__)

#: the open BroadcastSender of each Sender (one broadcast per store)
_BROADCASTERS: weakref.WeakKeyDictionary[Sender, weakref.ref[BroadcastSender]] = (
    weakref.WeakKeyDictionary())

DEFAULT_TIMEOUT = 30.0

__all__ = ["DEFAULT_TIMEOUT", "BroadcastSender", "wait_for_keys"]


class BroadcastSender:
    """Pairs a ``dbsync.Sender`` with a broadcast group. ``sender`` may be a ``Sender`` (kept
    open on ``close``) or a store root (a ``Sender`` is created and closed with this object).

    ``device``: where the bucket buffers live (default: the current CUDA device if any, else
    CPU); ``backend``: "auto" (NCCL for CUDA, gloo for CPU), "nccl" or "gloo". ``address``:
    how receivers reach this host (default ``DBSYNC_BROADCAST_ADDRESS`` or the hostname's
    address). ``port``: of the rendezvous store (0 picks a free one). ``timeout``: the bound on
    every collective and handshake; ``join_timeout`` (default ``timeout``) bounds forming an
    epoch. ``checksums``: seal every bucket with a checksum computed on ``device`` so that
    receivers verify each bucket on theirs before handing out its tensors (default on; off
    only to trust the transport: verifying receivers then read the filesystem)."""

    def __init__(
        self,
        sender: Sender | str | os.PathLike[str],
        *,
        address: str | None = None,
        port: int = 0,
        backend: str = "auto",
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        join_timeout: float | None = None,
        checksums: bool | None = True,
    ):
        if not (isinstance(bucket_bytes, int) and bucket_bytes > 0 and not bucket_bytes % ALIGN):
            raise InvalidArgumentError(f"bucket_bytes must be a positive multiple of {ALIGN}, "
                                       f"not {bucket_bytes!r}")
        if not check_seconds(timeout, "timeout"):
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, not "
                                       f"{timeout!r}")
        if join_timeout is not None and not check_seconds(join_timeout, "join_timeout"):
            raise InvalidArgumentError(f"join_timeout must be a positive number of seconds, or "
                                       f"None for timeout; not {join_timeout!r}")
        try:
            port = operator.index(port)
        except TypeError:
            port = -1
        if not 0 <= port < 65536:
            raise InvalidArgumentError("port must be 0 (any free port) or a TCP port below 65536")
        self._closed = False
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.address = address or rv.default_address()
        self.bucket_bytes = bucket_bytes
        self.timeout = float(timeout)
        self.join_timeout = float(join_timeout if join_timeout is not None else timeout)
        self.last_push_stats: dict[str, Any] = {}
        self._owns_sender = not isinstance(sender, Sender)
        if not self._owns_sender:
            other = _BROADCASTERS.get(sender)
            if other is not None and other() is not None and not other()._closed:
                raise DBSyncError(
                    f"a BroadcastSender of this Sender is open already (port {other().port}): "
                    "a store has one broadcast (a second one would replace its broadcast.json "
                    "and take its receivers); close that one first, or push through it")
        self.sender = Sender(sender) if self._owns_sender else sender  # type: ignore[arg-type]
        try:  # (a failure here must not keep the store's writer lock of a Sender made here)
            self.membership = Membership(
                self.sender.store, address=self.address, port=port, backend=self.backend,
                device=self.device, bucket_bytes=bucket_bytes, timeout=self.timeout,
                join_timeout=self.join_timeout)
            self.outgoing = OutgoingStream(self.device, bucket_bytes, checksums is not False)
        except BaseException as exc:
            if self._owns_sender:
                self.sender.close()
            if isinstance(exc, RuntimeError | OSError) and not isinstance(exc, DBSyncError):
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise BroadcastError(
                    f"could not start the broadcast rendezvous on port {port} ({first_line[:300]}"
                    "); pass port=0 for a free port, or free that one") from exc
            raise
        self.port = self.membership.port
        self.sender_id = self.membership.sender_id
        _BROADCASTERS[self.sender] = weakref.ref(self)
        self._headers = HeaderCache()
        self._pending: Future[int] | None = None
        self._lock = threading.Lock()

    # ---- membership --------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.membership.epoch

    @property
    def members(self) -> tuple[str, ...]:
        return self.membership.members

    @property
    def last_setup_seconds(self) -> float | None:
        return self.membership.last_setup_seconds

    @property
    def checksums(self) -> bool:
        return self.outgoing.checksums

    @checksums.setter
    def checksums(self, value: bool) -> None:
        self.outgoing.checksums = bool(value)

    def pending_joins(self) -> list[str]:
        """Reader ids that asked to join (members of the next epoch), after reading requests."""
        with self._lock:
            self.membership.poll_joins()
            return self.membership.wanted()

    def wait_for_joins(self, count: int, timeout: float | None = None) -> bool:
        """Wait until at least ``count`` receivers asked to join. Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.pending_joins()) < count:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def prepare(self, weights: Any = None) -> float | None:
        """Pay the fixed costs ahead of the next push: form an epoch with the receivers that
        asked to join, and (given ``weights``) build the header and bucket plan of their
        layout and allocate the bucket buffers. Returns the setup seconds of a new epoch, or
        None if none formed."""
        with self._lock:
            if weights is not None:
                pairs = sources.collect(weights, self.sender.strategy)
                self.outgoing.prepare(self._header(0, 0, 0, pairs), pairs)
            return self.membership.refresh()

    # ---- push --------------------------------------------------------------------------
    def push(self, weights: Any, blocking: bool = True) -> Any:
        """Broadcast ``weights`` to the members as the next version, then publish it through
        the Sender. ``blocking=True`` returns the version once it is on the filesystem;
        ``blocking=False`` returns a ``Future[int]`` once the broadcast is done and the
        weights are snapshotted. Broadcast problems never raise: see ``last_push_stats``."""
        with self._lock:
            if self._closed:
                raise DBSyncError("this BroadcastSender is closed; create a new one (or push "
                                  "through its Sender, without the broadcast)")
            self._finish_pending()
            pairs = sources.collect(weights, self.sender.strategy)  # dtype: per bucket
            # (what the Sender would refuse before writing, refused before members take it)
            self.sender.check_ready("weights")
            version = self.sender.next_version
            stats: dict[str, Any] = {"version": version, "broadcast": False, "members": 0,
                                     "setup_seconds": 0.0, "error": None}
            t0 = time.perf_counter()
            sent: tuple[int, int] | None = None
            try:
                stats["setup_seconds"] = self.membership.refresh() or 0.0
                if self.membership.group is None:  # (why not, when a group failed to form)
                    stats["error"] = self.membership.formation_error
                else:
                    stats["members"] = len(self.members)
                    sent = self._broadcast(version, pairs, stats)
                    stats["broadcast"] = True
            except BroadcastError as exc:
                stats["error"] = str(exc)
                log.warning("dbsync: broadcasting version %d failed after %.1f s (%s); its "
                            "receivers read it from the filesystem", version,
                            time.perf_counter() - t0, exc)
                self.membership.close_epoch()
            except BaseException:  # Ctrl-C mid-stream: nothing is published; members must
                # drop what they received, never complete it with the next push's buckets
                with contextlib.suppress(Exception):
                    self.membership.close_epoch()
                raise
            stats["epoch"] = self.epoch
            stats["broadcast_seconds"] = time.perf_counter() - t0
            self.last_push_stats = stats
            try:
                fs_future = self.sender.push(dict(pairs), blocking=False)
            except BaseException as exc:  # (refused before it was queued: say so to the
                # members that took the broadcast, at once, not at their timeout)
                self._confirm(sent, {"version": version, "error": f"{type(exc).__name__}: "
                                                                  f"{exc}"})
                raise
            result: Future[int] = Future()
            fs_future.add_done_callback(
                lambda f: self._after_publish(f, result, version, sent, stats))
            self._pending = result
        return result.result() if blocking else result

    def _broadcast(self, version: int, pairs: sources.Pairs, stats: dict[str, Any]
                   ) -> tuple[int, int]:
        membership = self.membership
        group = membership.group
        assert group is not None
        epoch, seq = membership.epoch, membership.next_seq()
        t_start = time.perf_counter()
        header = self._header(version, epoch, seq, pairs)
        membership.announce(seq, header.dumps(header.layout_bytes))
        t_announced = time.perf_counter()
        try:
            self.outgoing.send(group, header, pairs)
        except BaseException as exc:
            try:
                membership.kv.set(rv.go_key(epoch, seq), "abort")
            except Exception:  # noqa: BLE001 - members time out on their own
                pass
            if not isinstance(exc, BroadcastError):
                raise  # (Ctrl-C: the push closes the epoch)
            missing = membership.missing_acks(seq)
            if missing and isinstance(exc, BroadcastTimeoutError):
                raise BroadcastTimeoutError(
                    f"receiver(s) {', '.join(missing)} did not acknowledge version {version} "
                    f"within {self.timeout:.1f} s (dead, or not inside receive()); they read "
                    "it from the filesystem and the group re-forms on the next push") from exc
            raise
        t_end = time.perf_counter()
        stats.update(prepare_seconds=t_announced - t_start, stream_seconds=t_end - t_announced,
                     bytes=header.total_bytes, buckets=len(header.buckets()),
                     checksums=header.has_checksums)
        return epoch, seq

    def _header(self, version: int, epoch: int, seq: int, pairs: sources.Pairs) -> Header:
        """The header of this push: the layout (names, published dtypes, shapes, bucket size,
        checksum algorithm) is reused while it stays the same, as it does push after push."""
        dtype = self.sender.dtype
        algorithm = checksum.ALGORITHM if self.outgoing.checksums else None

        def build() -> Header:
            specs = [(n, sources.target_dtype(t, dtype), tuple(t.shape)) for n, t in pairs]
            header = Header.build(version, epoch, seq, self.bucket_bytes, specs, algorithm)
            header.layout_bytes  # noqa: B018 - built once here, reused by every later push
            return header

        settings = (algorithm, dtype, self.bucket_bytes)
        return self._headers.header(pairs, settings, build).for_push(version, epoch, seq)

    def _after_publish(self, fs_future: Future[int], result: Future[int], version: int,
                       sent: tuple[int, int] | None, stats: dict[str, Any]) -> None:
        confirmation: dict[str, Any] = {"version": version}
        try:
            published = fs_future.result()
            if published != version:
                raise DBSyncError(
                    f"the filesystem got version {published} but the broadcast announced "
                    f"{version}: another writer publishes into {self.sender.root}? Run one "
                    "Sender per store")
            if sent is not None:
                manifest = self.sender.store.read_manifest()
                if manifest is None or manifest.version != version:
                    raise DBSyncError(f"version {version} is not the store's current version "
                                      "right after it was published; run one Sender per store")
                confirmation["manifest"] = rv.manifest_digest(manifest)
            stats["total_seconds"] = self.sender.last_push_seconds.get("total")
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            confirmation["error"] = f"{type(exc).__name__}: {exc}"
            self._confirm(sent, confirmation)
            result.set_exception(exc)
            return
        self._confirm(sent, confirmation)
        result.set_result(published)

    def _confirm(self, sent: tuple[int, int] | None, confirmation: dict[str, Any]) -> None:
        """Tell the members under which manifest the broadcast version was published (or why
        not); set before the push completes, so before any later push is announced."""
        if sent is None:
            return
        try:
            self.membership.kv.set(rv.published_key(*sent), json.dumps(confirmation))
        except Exception:  # noqa: BLE001 - members then refuse to stage it: filesystem path
            pass
        # Keys of the push before last are not read any more (a member confirms the push it
        # took right after taking it): without this, every push's header would stay in the
        # store for as long as the sender lives.
        try:
            self.membership.forget_old()
        except Exception as exc:  # noqa: BLE001 - the store closed meanwhile
            log.debug("could not delete the keys of old pushes: %s", exc)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException:  # noqa: BLE001 - belongs to its own future
                pass
            self._pending = None

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Finish the pending push, close the group, withdraw ``broadcast.json`` and stop the
        rendezvous store. Receivers notice and read from the filesystem."""
        with self._lock:
            self._closed = True
            self._finish_pending()
            self.membership.close()
            if (mine := _BROADCASTERS.get(self.sender)) is not None and mine() is self:
                del _BROADCASTERS[self.sender]
            if self._owns_sender:
                self.sender.close()

    def __enter__(self) -> BroadcastSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
