"""BroadcastSender: push each version to the receivers of the current epoch over a collective
(NCCL on GPUs, gloo on CPUs), and still publish it to the filesystem through a ``Sender``.

push = take join/leave requests (a change starts a new epoch: members create a fresh process
group) -> announce the version's header -> wait until every member acknowledges -> stream the
bytes in manifest order, packed into ``bucket_bytes`` buckets, two buffers so packing bucket
k+1 overlaps sending bucket k -> publish the same version through the ``Sender`` (in the
background when ``blocking=False``).

Guarantees: the manifest stays the single source of truth. Whatever happens to the broadcast
(a receiver dies, a timeout, a broken link), ``push`` still publishes the version to the
filesystem, and no step waits longer than ``timeout`` (``join_timeout`` for forming an epoch).
After a failed broadcast the epoch is closed; surviving receivers re-join and the next push
forms a new epoch.

Hazards, stated plainly:
- Every member must be inside ``BroadcastReceiver.receive`` when a push comes; one that is
  busy elsewhere does not acknowledge, costs this push up to ``timeout`` and is dropped from the
  group (it reads that version from the filesystem and re-joins).
- The broadcast reads the caller's tensors directly: do not modify them until ``push`` returns
  (with ``blocking=False``, until it returns the future: the filesystem copy is snapshotted).
- The key-value store listens on ``port`` on every interface of this host, unauthenticated:
  trusted networks only.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from .. import fileio, sources
from ..errors import DBSyncError
from ..sender import Sender
from . import rendezvous as rv
from .errors import BroadcastError, BroadcastTimeoutError
from .group import Group, resolve_backend
from .layout import ALIGN, DEFAULT_BUCKET_BYTES, Header, bucket_plan, flat_bytes

DEFAULT_TIMEOUT = 30.0


def wait_for_keys(store: Any, keys: Sequence[str], timeout: float) -> list[str]:
    """Poll ``store`` until every key exists or ``timeout`` passes; return the missing ones."""
    start = time.monotonic()
    keys = list(keys)
    while True:
        if not keys or store.check(keys):
            return []
        waited = time.monotonic() - start
        if waited >= timeout:
            return [k for k in keys if not store.check([k])]
        # one check is a round trip (~25 us on a LAN): poll tightly for the first 20 ms
        time.sleep(0 if waited < 0.02 else 0.002)


class BroadcastSender:
    """Pairs a ``dbsync.Sender`` with a broadcast group. ``sender`` may be a ``Sender`` (kept
    open on ``close``) or a store root (a ``Sender`` is created and closed with this object).

    ``device``: where the bucket buffers live (default: the current CUDA device if any, else
    CPU); ``backend``: "auto" (NCCL for CUDA, gloo for CPU), "nccl" or "gloo". ``address``:
    how receivers reach this host (default ``DBSYNC_BROADCAST_ADDRESS`` or the hostname's
    address). ``port``: of the rendezvous store (0 picks a free one). ``timeout``: the bound on
    every collective and handshake; ``join_timeout`` (default ``timeout``) bounds forming an
    epoch. ``checksums``: send xxh3 checksums in the header so receivers verify before applying
    (default: on for CPU weights, off for CUDA weights, whose receivers then verify against the
    manifest after applying)."""

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
        checksums: bool | None = None,
        hash_threads: int = 4,
    ):
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise DBSyncError(f"bucket_bytes must be a positive multiple of {ALIGN}")
        if timeout <= 0:
            raise DBSyncError("timeout must be positive (seconds)")
        self._owns_sender = not isinstance(sender, Sender)
        self.sender = Sender(sender) if self._owns_sender else sender  # type: ignore[arg-type]
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.address = address or rv.default_address()
        self.bucket_bytes = bucket_bytes
        self.timeout = float(timeout)
        self.join_timeout = float(join_timeout if join_timeout is not None else timeout)
        self.checksums = checksums
        self.sender_id = uuid.uuid4().hex
        self.epoch = 0
        self.members: tuple[str, ...] = ()
        self.last_push_stats: dict[str, Any] = {}
        self.last_setup_seconds: float | None = None
        self._wanted: dict[str, float] = {}  # reader id -> when it asked
        self._joins_seen = 0
        self._group: Group | None = None
        self._seq = 0
        self._buffers: list[torch.Tensor] = []
        self._plan_cache: tuple[Any, Any] | None = None
        self._header_cache: tuple[Any, Header, bytes] | None = None
        self._pending: Future[int] | None = None
        self._lock = threading.Lock()
        self._hash_pool = ThreadPoolExecutor(hash_threads, thread_name_prefix="dbsync-bhash")
        self._tcp = dist.TCPStore(
            "0.0.0.0", port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self.port = int(self._tcp.port)
        self._publish_epoch()

    # ---- membership --------------------------------------------------------------------
    def _publish_epoch(self) -> None:
        record = {"epoch": self.epoch, "members": list(self.members), "sender_id": self.sender_id,
                  # how long a member may wait for the others while the group forms
                  "setup_timeout": self.join_timeout + self.timeout}
        self._tcp.set(rv.K_EPOCH, json.dumps(record))
        rv.write_record(self.sender.store, rv.RendezvousRecord(
            sender_id=self.sender_id, address=self.address, port=self.port, backend=self.backend,
            epoch=self.epoch, members=self.members, bucket_bytes=self.bucket_bytes,
            timeout=self.timeout, host=socket.gethostname(), pid=os.getpid()))

    def _poll_joins(self) -> bool:
        """Read new join/leave records; True if any arrived (membership must be re-formed)."""
        changed = False
        count = int(self._tcp.add(rv.K_JOINS, 0))
        while self._joins_seen < count:
            key = rv.join_key(self._joins_seen + 1)
            if not self._tcp.check([key]):
                break  # counted but not written yet: read it next time
            self._joins_seen += 1
            try:
                record = json.loads(self._tcp.get(key))
                reader_id, action = str(record["reader_id"]), record["action"]
            except (ValueError, KeyError, TypeError):
                continue  # malformed: ignore (it cannot name a member)
            if action == "join":
                self._wanted[reader_id] = time.monotonic()
            else:
                self._wanted.pop(reader_id, None)
            changed = True
        return changed

    def pending_joins(self) -> list[str]:
        """Reader ids that asked to join (members of the next epoch), after reading requests."""
        with self._lock:
            self._poll_joins()
            return sorted(self._wanted)

    def wait_for_joins(self, count: int, timeout: float | None = None) -> bool:
        """Wait until at least ``count`` receivers asked to join. Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.pending_joins()) < count:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def prepare(self) -> float | None:
        """Form an epoch with the receivers that asked to join, now rather than at the next
        push (pays the setup ahead). Returns the setup seconds, or None if nothing formed."""
        with self._lock:
            if self._poll_joins() or (self._group is None and self._wanted):
                return self._form_epoch()
            return None

    def _form_epoch(self) -> float | None:
        """Start a new epoch with every receiver that asked to join. Drops those that do not
        get ready within ``join_timeout`` and retries without them. Returns setup seconds."""
        t0 = time.perf_counter()
        for _attempt in range(3):
            self._close_group()
            self.epoch += 1
            self._seq = 0
            self.members = tuple(sorted(self._wanted))
            self._publish_epoch()
            if not self.members:
                return None
            ready = [rv.ready_key(self.epoch, m) for m in self.members]
            missing = wait_for_keys(self._tcp, ready, self.join_timeout)
            if missing:
                for key in missing:
                    self._wanted.pop(key.rsplit("/", 1)[1], None)
                continue
            try:
                self._group = Group.create(
                    self._tcp, rv.pg_prefix(self.epoch), 0, len(self.members) + 1, self.backend,
                    self.device, self.timeout, self.address, setup_timeout=self.join_timeout)
            except BroadcastError:
                self._wanted.clear()  # who failed is unknown: everyone alive re-joins
                continue
            self.last_setup_seconds = time.perf_counter() - t0
            return self.last_setup_seconds
        self._close_epoch()
        return None

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _close_epoch(self) -> None:
        """Give up the current group: members see a new epoch without them and re-join."""
        self._close_group()
        self._wanted.clear()
        self.epoch += 1
        self._seq = 0
        self.members = ()
        self._publish_epoch()

    # ---- push --------------------------------------------------------------------------
    def push(self, weights: Any, blocking: bool = True) -> Any:
        """Broadcast ``weights`` to the members as the next version, then publish it through
        the Sender. ``blocking=True`` returns the version once it is on the filesystem;
        ``blocking=False`` returns a ``Future[int]`` once the broadcast is done and the
        weights are snapshotted. Broadcast problems never raise: see ``last_push_stats``."""
        with self._lock:
            self._finish_pending()
            pairs = sources.collect(weights, self.sender.strategy, self.sender.dtype)
            version = (self.sender.latest_version() or 0) + 1
            stats: dict[str, Any] = {"version": version, "broadcast": False, "members": 0,
                                     "setup_seconds": 0.0, "error": None}
            t0 = time.perf_counter()
            header: Header | None = None
            try:
                if self._poll_joins() or (self._group is None and self._wanted):
                    stats["setup_seconds"] = self._form_epoch() or 0.0
                if self._group is not None:
                    stats["members"] = len(self.members)
                    header = self._broadcast(version, pairs, stats)
                    stats["broadcast"] = True
            except BroadcastError as exc:
                stats["error"] = str(exc)
                self._close_epoch()
            stats["epoch"] = self.epoch
            stats["broadcast_seconds"] = time.perf_counter() - t0
            self.last_push_stats = stats
            fs_future = self.sender.push(dict(pairs), blocking=False)
            result: Future[int] = Future()
            fs_future.add_done_callback(
                lambda f: self._after_publish(f, result, version, header, stats))
            self._pending = result
        return result.result() if blocking else result

    def _after_publish(self, fs_future: Future[int], result: Future[int], version: int,
                       header: Header | None, stats: dict[str, Any]) -> None:
        try:
            published = fs_future.result()
            if published != version:
                raise DBSyncError(
                    f"the filesystem got version {published} but the broadcast announced "
                    f"{version}: another writer publishes into {self.sender.root}? Run one "
                    "Sender per store")
            if header is not None and header.has_checksums:
                manifest = self.sender.store.read_manifest()
                if manifest is not None and manifest.version == version:
                    sent = [e.checksum for e in header.entries]
                    if sent != [t.checksum for t in manifest.tensors]:
                        raise DBSyncError(
                            f"version {version}: the weights changed while being pushed (the "
                            "broadcast and the filesystem copy differ); receivers that took "
                            "the broadcast hold other bytes than the manifest. Do not modify "
                            "weights until push returns, and push again")
            stats["total_seconds"] = self.sender.last_push_seconds.get("total")
            result.set_result(published)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            result.set_exception(exc)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except BaseException:  # noqa: BLE001 - belongs to its own future
                pass
            self._pending = None

    def _checksums(self, pairs: sources.Pairs) -> list[str | None]:
        enabled = self.checksums
        if enabled is None:
            enabled = all(t.device.type == "cpu" for _, t in pairs)
        if not enabled:
            return [None] * len(pairs)

        def one(t: torch.Tensor) -> str:
            host = t.detach().to("cpu").contiguous()
            return fileio.checksum(fileio.tensor_bytes(host))

        return list(self._hash_pool.map(one, [t for _, t in pairs]))

    def _broadcast(self, version: int, pairs: sources.Pairs, stats: dict[str, Any]) -> Header:
        assert self._group is not None
        self._seq += 1
        epoch, seq = self.epoch, self._seq
        t_start = time.perf_counter()
        header, layout = self._header(version, epoch, seq, pairs)
        self._tcp.set(rv.push_key(epoch, seq), header.dumps(layout))
        times: dict[str, float] = {"announced": time.perf_counter()}
        stats["prepare_seconds"] = times["announced"] - t_start

        def handshake() -> None:
            missing = wait_for_keys(
                self._tcp, [rv.ack_key(epoch, seq, m) for m in self.members], self.timeout)
            if missing:
                self._tcp.set(rv.go_key(epoch, seq), "abort")
                names = [k.rsplit("/", 1)[1] for k in missing]
                raise BroadcastTimeoutError(
                    f"receiver(s) {', '.join(names)} did not acknowledge version {version} "
                    f"within {self.timeout:.1f} s (dead, or not inside receive()); they read it "
                    "from the filesystem and the group re-forms on the next push")
            self._tcp.set(rv.go_key(epoch, seq), "go")
            times["go"] = time.perf_counter()

        self._stream(header, layout, pairs, handshake, stats)
        t_end = time.perf_counter()
        stats.update(ack_seconds=times["go"] - times["announced"],
                     stream_seconds=t_end - times["go"], bytes=header.total_bytes,
                     buckets=len(header.buckets()), checksums=header.has_checksums)
        return header

    def _bucket_buffers(self, size: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() < size:
            self._buffers, self._plan_cache = [], None  # free the old pair first
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(2)]
        return self._buffers

    def _header(self, version: int, epoch: int, seq: int, pairs: sources.Pairs
                ) -> tuple[Header, bytes]:
        """The header of this push and its layout bytes; reused from the previous push when
        names, dtypes and shapes are unchanged and no checksums are sent (the usual case)."""
        sums = self._checksums(pairs)
        signature = tuple((n, t.dtype, t.shape) for n, t in pairs)
        cached = self._header_cache
        if sums[0:1] != [None] or cached is None or cached[0] != signature:
            header = Header.build(version, epoch, seq, self.bucket_bytes,
                                  [(n, t.dtype, tuple(t.shape), c)
                                   for (n, t), c in zip(pairs, sums, strict=True)])
            cached = self._header_cache = (signature, header, header.layout_bytes)
        header = dataclasses.replace(cached[1], version=version, epoch=epoch, seq=seq)
        return header, cached[2]

    def _pack_plan(self, header: Header, layout: bytes, buffers: list[torch.Tensor]) -> tuple[
            list[tuple[int, int]], list[tuple[list[int], list[torch.Tensor]]],
            list[list[tuple[int, int, int, int]]]]:
        """Per bucket: the tensors that lie wholly in it with their typed views of the bucket
        buffer, and the byte ranges of tensors split across buckets. Cached per layout (the
        same model pushes the same layout every time)."""
        key = layout
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        buckets = header.buckets()
        plan = bucket_plan(header)
        whole: list[tuple[list[int], list[torch.Tensor]]] = []
        parts: list[list[tuple[int, int, int, int]]] = []
        for b, (lo, _hi) in enumerate(buckets):
            buf = buffers[b % 2]
            indices, views, split = [], [], []
            for i, start, end in plan[b]:
                entry = header.entries[i]
                dst = entry.offset + start - lo
                if start == 0 and end == entry.nbytes:
                    indices.append(i)
                    views.append(buf[dst:dst + end].view(entry.torch_dtype).view(entry.shape))
                else:
                    split.append((i, start, end, dst))
            whole.append((indices, views))
            parts.append(split)
        self._plan_cache = (key, (buckets, whole, parts))
        return buckets, whole, parts

    @torch.no_grad()
    def _stream(self, header: Header, layout: bytes, pairs: sources.Pairs,
                handshake: Callable[[], None], timing: dict[str, Any]) -> None:
        """Pack the first bucket, run ``handshake`` (acks, then go), then send every bucket,
        packing bucket k+2 into a buffer as soon as bucket k has left it."""
        group = self._group
        assert group is not None
        buffers = self._bucket_buffers(min(self.bucket_bytes, header.total_bytes))
        buckets, whole, parts = self._pack_plan(header, layout, buffers)
        flats: dict[int, torch.Tensor] = {}

        def pack(b: int) -> None:
            # Whole tensors: one fused copy into cached typed views of the bucket (no
            # per-tensor Python work on the hot path); split tensors: byte-range copies.
            indices, views = whole[b]
            if indices:
                srcs = [pairs[i][1] for i in indices]
                try:
                    torch._foreach_copy_(views, srcs, non_blocking=True)
                except (RuntimeError, TypeError):
                    for view, src in zip(views, srcs, strict=True):
                        view.copy_(src, non_blocking=True)
            buf = buffers[b % 2]
            for i, start, end, dst in parts[b]:
                flat = flats.get(i)
                if flat is None:
                    flat = flats[i] = flat_bytes(pairs[i][1])
                buf[dst:dst + end - start].copy_(flat[start:end], non_blocking=True)
                if end == header.entries[i].nbytes:
                    del flats[i]

        t0 = time.perf_counter()
        if buckets:
            pack(0)  # overlaps the receivers' part of the handshake
        t1 = time.perf_counter()
        handshake()
        timing.update(prepack_seconds=t1 - t0, ack_wait_seconds=time.perf_counter() - t1)
        works: list[Any] = [None, None]
        for b, (lo, hi) in enumerate(buckets):
            k = b % 2
            if works[k] is not None:
                group.wait(works[k], f"bucket {b - 2} of version {header.version}")
                works[k] = None
            if b > 0:
                pack(b)
            works[k] = group.broadcast(buffers[k][: hi - lo])
        for work in works:
            if work is not None:
                group.wait(work, f"the last buckets of version {header.version}")

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Finish the pending push, close the group, withdraw ``broadcast.json`` and stop the
        rendezvous store. Receivers notice and read from the filesystem."""
        with self._lock:
            self._finish_pending()
            self._close_group()
            try:
                self.members = ()
                self.epoch += 1
                self._tcp.set(rv.K_EPOCH, json.dumps(
                    {"epoch": self.epoch, "members": [], "sender_id": self.sender_id,
                     "closed": True}))
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            rv.remove_record(self.sender.store, self.sender_id)
            self._hash_pool.shutdown(wait=True)
            if self._owns_sender:
                self.sender.close()
            self._tcp = None  # type: ignore[assignment]

    def __enter__(self) -> BroadcastSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
