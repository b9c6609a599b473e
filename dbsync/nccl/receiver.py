"""BroadcastReceiver: take versions from the sender's broadcast group when it is reachable, and
from the filesystem otherwise, through one call: ``receive(load_weights)``.

receive = follow the sender (``member.MemberLink``: connect to the rendezvous named by
``ROOT/broadcast.json``, ask to join, follow its epochs) -> wait for a push header or a newer
manifest -> post the first bucket receives, acknowledge, take the bucket stream
(``stream.IncomingVersion``: each bucket verified on this device before its tensors are handed
out), calling ``load_weights`` once with (name, tensor) pairs in manifest order -> record the
loaded version in the reader lease (so ``Sender.wait_for_receivers`` and ``dbsync status``
count it).

On a broadcast failure (timeout, dead peer, sender gone) it leaves the group, asks to re-join
for the next epoch, and loads the same version (or newer) from the filesystem, which is always
the source of truth. A damaged bucket costs only that version: the stream is drained, the
group stays, the version is read from the filesystem.

Hazards, stated plainly:
- ``load_weights`` may see part of a version over the broadcast before a failure; the fallback
  then calls it again with the complete version from the filesystem. The final state is always
  one complete, verified version, but ``load_weights`` must accept being called again.
- Tensors handed to ``load_weights`` are views of reused buffers: copy what you keep (with
  ``whole_version=True`` they are views of that version's own allocation instead).
- With ``verify=True`` (the default) every bucket is checked on this receiver's device before
  its tensors are handed out; a push the sender did not seal (``checksums=False``) is then not
  taken from the broadcast: it is drained and the version is read from the filesystem.
- While a member, this receiver must be inside ``receive`` when the sender pushes, or that push
  drops it from the group (it reads the version from the filesystem and re-joins).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..errors import DBSyncError
from ..format import castable, plain_state_dict, unwrap_compiled
from ..hfcheckpoint import destinations
from ..leases import DEFAULT_LEASE_TIMEOUT
from ..receiver import Receiver
from . import checksum, paced
from . import rendezvous as rv
from .errors import BroadcastError, BroadcastTimeoutError
from .layout import Header, bucket_plan
from .member import MEMBER_EPOCH_CHECK_SECONDS, MEMBER_FS_CHECK_SECONDS, MemberLink
from .stream import BeforeVerify, DamagedBucketError, IncomingVersion

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]

class BroadcastReceiver:
    """Receives versions of the store at ``root``.

    ``device``: where buckets land ("cpu" for gloo, "cuda:N" for NCCL; must match the sender's
    backend, otherwise this receiver uses the filesystem alone). ``verify``: check checksums
    (before applying when the sender sent them, else against the manifest after). ``timeout``:
    bound of every collective and handshake step. ``fallback_timeout``: how long to wait for an
    announced version to appear on the filesystem. ``address``: this host's address for the
    group (default: the one that routes to the sender). ``depth``: bucket buffers (default 3 on
    GPUs, 2 on CPU; each the sender's bucket size). ``whole_version``: receive each version
    into its own fresh allocation of the whole version instead (every bucket posted at once);
    the tensors handed out then stay valid after ``receive`` returns, for as long as they are
    referenced (a staged copy without a second copy); a callable taking the push ``Header``
    decides per push (``IncomingVersion.whole_version`` says how each one came).
    ``poll_interval``: how often a member polls for pushes when its doorbell does not work
    (normally it sleeps until the sender rings it)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        reader_id: str | None = None,
        device: torch.device | str = "cpu",
        verify: bool = True,
        timeout: float = 30.0,
        fallback_timeout: float = 600.0,
        poll_interval: float = 0.00025,
        address: str | None = None,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        report_loaded: bool = True,
        fs_verify: bool | None = None,
        depth: int | None = None,
        whole_version: bool | Callable[[Header], bool] = False,
    ):
        # report_loaded=False: loads are not reported in the lease (helper readers).
        # fs_verify: checksum verification of filesystem loads (default: ``verify``).
        bad = [f"{name} must be positive (seconds), not {value!r}" for name, value in (
            ("timeout", timeout), ("fallback_timeout", fallback_timeout),
            ("poll_interval", poll_interval)) if not value > 0]
        if depth is not None and depth < 1:
            bad.append(f"depth must be at least 1 (buckets in flight), not {depth!r}")
        if bad:  # (before anything is opened or registered)
            raise DBSyncError("; ".join(bad))
        self.fs = Receiver(root, reader_id=reader_id, lease_timeout=lease_timeout,
                           verify=verify if fs_verify is None else fs_verify,
                           report_loaded=report_loaded)
        try:  # (a failure below closes self.fs: its lease and reader id are not kept)
            self.reader_id = self.fs.reader_id
            self.device = torch.device(device)
            self.verify = verify
            self.timeout = float(timeout)
            self.fallback_timeout = float(fallback_timeout)
            self.poll_interval = poll_interval
            self.address = address
            self.depth = max(2, depth if depth is not None else
                             (3 if self.device.type == "cuda" else 2))
            self.whole_version = whole_version
            #: test hook: run on each received bucket before its checksum is checked
            self.before_verify: BeforeVerify | None = None
            #: "broadcast" or "filesystem": how the last returned version arrived
            self.last_source: str | None = None
            #: the tensors may hold parts of a broadcast that was cut short (``_load_fs``)
            self._mixed = False
            #: why the last broadcast was not used (None when it was)
            self.last_error: str | None = None
            self.last_stats: dict[str, Any] = {}
            self.link = MemberLink(self.fs.store, self.reader_id, self.device, self.timeout,
                                   address, on_error=self._note_error)
            self._views: dict[tuple[Any, ...], torch.Tensor] = {}
            self._plans: dict[int, Any] = {}  # per-bucket copy plans of receive(module or dict)
            #: (epoch, seq, version) of the last push applied from the broadcast
            #: (sender id, epoch, seq, version) of the last push applied from the broadcast
            self._applied_push: tuple[str, int, int, int] | None = None
            self._buffers: list[torch.Tensor] = []
            self._lock = threading.Lock()
            self._closed = threading.Event()
            if self.device.type == "cuda" and verify:
                # Compile and check the paced kernels now (seconds, once per device and
                # process), not inside the first push, where the sender's per-bucket timeout runs.
                paced.available(self.device)
        except BaseException:
            self.fs.close()
            raise

    @property
    def loaded_version(self) -> int | None:
        return self.fs.loaded_version

    @property
    def is_member(self) -> bool:
        """True while this receiver belongs to the sender's current broadcast group."""
        return self.link.group is not None

    @property
    def epoch(self) -> int | None:
        """The sender's epoch this receiver follows (None when not connected)."""
        return self.link.epoch

    def _note_error(self, why: str) -> None:
        self.last_error = why

    # ---- receiving ---------------------------------------------------------------------
    def receive(self, load_weights: LoadWeights | Any, newer_than: int | None = None,
                timeout: float | None = None) -> int | None:
        """Apply the next version newer than ``newer_than`` (default: the loaded one), from the
        broadcast if this receiver is in the group, else from the filesystem. Returns that
        version, or None if none came within ``timeout`` seconds (None: wait as long as it
        takes). Never hangs on a broken group: every step is bounded by ``self.timeout``.

        ``load_weights``: a callable, called once with (name, tensor) pairs; or a plain
        ``nn.Module`` / dict of tensors, whose existing tensors receive the bytes in place
        (every name and shape must match; floating dtypes of 16 bits or more are cast). The
        second is the fast path on GPUs: each bucket is verified and copied in on part of the
        GPU while the stream goes on (``paced``); no byte is written before its checksum row
        verified.

        Hazard: after a damaged bucket the tensors hold parts of two versions until the
        version is re-applied from the filesystem, which this call does before it returns; if
        that fails too (it raises: the sender died before publishing it), they stay mixed:
        call ``receive`` again, which first applies the newest published version from the
        filesystem (whatever its number) and returns it."""
        with self._lock:
            self._check_open()
            if self._mixed and newer_than is None:  # (a broadcast cut short left parts of it)
                latest = self.fs.latest_version()
                if latest is not None:
                    return self._load_fs(load_weights, latest, after_partial=True)
            floor = self.loaded_version if newer_than is None else newer_than
            floor = 0 if floor is None else floor
            deadline = None if timeout is None else time.monotonic() + timeout
            newer_seen_at: float | None = None
            pause = self.poll_interval
            fs_checked = 0.0
            while True:
                try:
                    self.link.maintain()
                    header = self.link.poll_push()
                except BroadcastError as exc:
                    self.link.leave_group(str(exc))
                    header = None
                if header is not None:
                    version = self._take(header, load_weights, floor)
                    if version is not None:
                        return version
                    continue
                self._check_open()  # (close() from another thread: at most a pause away)
                now = time.monotonic()
                # A member waits for its doorbell; the manifest (a file that may be large and
                # on NFS) it reads only now and then: for a member it is only the guard against
                # a version published without a broadcast.
                latest = None
                if self.link.group is None or now - fs_checked >= MEMBER_FS_CHECK_SECONDS:
                    latest, fs_checked = self.fs.latest_version(), now
                if latest is not None and latest > floor:
                    if self.link.group is None:
                        return self._load_fs(load_weights, latest)
                    if newer_seen_at is None:
                        newer_seen_at = now
                    elif now - newer_seen_at > self.timeout:
                        self.link.leave_group(f"version {latest} was published without a "
                                          "broadcast to this member")
                        return self._load_fs(load_weights, latest)
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                if self.link.group is None:
                    self._closed.wait(pause)
                    pause = min(max(pause, 0.005) * 1.5, 0.05)
                else:  # until the doorbell rings (a push or an epoch change)
                    rest = MEMBER_EPOCH_CHECK_SECONDS
                    if deadline is not None:
                        rest = min(rest, max(deadline - time.monotonic(), 0.0))
                    self.link.wait_for_push(rest, self.poll_interval)
                    pause = self.poll_interval

    def _take(self, header: Header, load_weights: LoadWeights, floor: int) -> int | None:
        """Take one announced push. Returns the version applied, or None when it was not newer
        than ``floor`` (its bytes are drained: every member must take part)."""
        link = self.link
        assert link.conn is not None and link.group is not None and link.epoch is not None
        store, epoch, seq = link.conn.store, link.epoch, header.seq
        push_id = (link.conn.record.sender_id, epoch, seq)
        self.link.seq = seq
        t0 = time.perf_counter()
        # A second push announcing the version applied last (another sender, epoch or seq)
        # means the first one was never published (its publish failed, or its trainer was
        # killed and restarted, counting from 1 again) and other bytes carry that number:
        # take them, or this receiver keeps bytes no manifest describes.
        last = self._applied_push
        wanted = header.version > floor or (
            last is not None and last[3] == header.version and last[:3] != push_id)

        def fall_back() -> int | None:
            # A push this receiver only had to drain is not loaded from the filesystem either.
            # (what was taken may have reached the tensors: they are whole again only once a
            # published version is applied)
            return (self._load_fs(load_weights, header.version, after_partial=True) if wanted
                    else None)


        def cancelled() -> str | None:
            """Polled while a bucket is late: did the sender abort this push?"""
            key = rv.go_key(epoch, seq)
            if store.check([key]) and store.get(key) != b"go":
                return (f"the sender aborted the broadcast of version {header.version} ("
                        "after a member did not acknowledge or a collective failed)")
            return None

        cache = self.link.header_cache
        if "plan" not in cache or cache.get("plan_for") is not cache.get("raw"):  # new layout
            cache.update(plan=bucket_plan(header), plan_for=cache.get("raw"))
        whole = (self.whole_version(header) if callable(self.whole_version)
                 else self.whole_version)  # decided once per push
        incoming = IncomingVersion(
            self.link.group, header, self._receive_buffers(header, whole), verify=self.verify,
            views=None if whole else self._views, cancelled=cancelled,
            plan=cache["plan"], before_verify=self.before_verify, whole_version=whole)
        try:
            if header.epoch != epoch:
                raise BroadcastError(f"push header names epoch {header.epoch}, not {epoch}")
            incoming.start()  # the sender streams at once: post the first receives first
            store.set(rv.ack_key(epoch, seq, self.reader_id), "1")  # names who held it up
        except BroadcastError as exc:
            self.link.leave_group(str(exc))
            return fall_back()
        except Exception as exc:  # noqa: BLE001 - the store connection broke
            self.link.close_group()  # receives may be posted: the group is unusable
            self.link.disconnect()
            self.last_error = f"lost the broadcast sender ({exc})"
            return fall_back()
        # Checked while the first buckets arrive (a few hundred microseconds for hundreds of
        # tensors): a verifying receiver takes only sealed pushes (an unsealed one is
        # drained), and only into tensors the version fits.
        usable = wanted and (header.has_checksums or not self.verify)
        dest: dict[str, torch.Tensor] | bool | None = None
        try:
            dest = _destinations(load_weights, header) if usable else None
            if dest is False:  # names, shapes or dtypes do not fit: the filesystem load says
                usable = False
            if usable and isinstance(dest, dict):
                incoming.copy_into(dest, self._plans)
                torch.autograd.graph.increment_version(list(dest.values()))
            elif usable:
                load_weights(incoming)
            incoming.drain()  # whatever load_weights left unread (or all of it)
        except DamagedBucketError as exc:
            # the stream was drained: the group is intact, only this version is unusable
            self.last_error = str(exc)
            return fall_back()
        except BroadcastError as exc:
            self.link.leave_group(str(exc))
            return fall_back()
        except BaseException:
            self.link.leave_group("load_weights raised during a broadcast")
            raise
        self.last_stats = {"version": header.version, "bytes": header.total_bytes,
                           "seconds": time.perf_counter() - t0,
                           "buckets": len(header.buckets()),
                           "verified_buckets": incoming.verified_buckets}
        if not wanted:
            return None
        if incoming.damaged is not None:  # load_weights swallowed the error
            self.last_error = incoming.damaged
            return self._load_fs(load_weights, header.version, after_partial=True)
        if not usable:
            self.last_error = (
                f"version {header.version} does not fit the tensors given (names, shapes or "
                "dtypes); loading it from the filesystem to say how" if dest is False else
                f"version {header.version} was broadcast without checksums and this receiver "
                "verifies; read from the filesystem")
            return self._load_fs(load_weights, header.version)
        self.fs.mark_loaded(header.version)
        self._applied_push = (*push_id, header.version)
        self.last_source, self.last_error = "broadcast", None
        return header.version

    def _receive_buffers(self, header: Header, whole: bool) -> list[torch.Tensor]:
        if not whole:
            return self._bucket_buffers(header)
        # One fresh allocation per version, one region per bucket: nothing is reused, so
        # what is handed out stays valid; the bucket buffers are not needed meanwhile.
        self._buffers, self._views, self._plans = [], {}, {}
        wire = [checksum.wire_bytes(hi - lo, header.has_checksums)
                for lo, hi in header.buckets()]
        flat = torch.empty(max(sum(wire), 1), dtype=torch.uint8, device=self.device)
        regions, at = [], 0
        for n in wire:
            regions.append(flat[at:at + n])
            at += n
        return regions or [flat]

    def _bucket_buffers(self, header: Header) -> list[torch.Tensor]:
        size = checksum.buffer_bytes(min(header.bucket_bytes, max(header.total_bytes, 1)))
        if (len(self._buffers) != self.depth or self._buffers[0].numel() < size
                or self._buffers[0].device != self.device):
            self._buffers, self._views, self._plans = [], {}, {}
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device)
                             for _ in range(self.depth)]
        return self._buffers

    def published(self, timeout: float) -> str:
        """The digest of the manifest under which the sender published the version this
        receiver took last from the broadcast (see ``rendezvous.manifest_digest``); waits for
        the sender's confirmation up to ``timeout`` seconds. Raises ``BroadcastError`` when
        none was taken, the publish failed, or no confirmation came."""
        with self._lock:
            if self._applied_push is None:
                raise BroadcastError("no broadcast version to confirm")
            sender, epoch, seq, version = self._applied_push
            conn = self.link.conn
            if conn is None or conn.record.sender_id != sender:
                raise BroadcastError(f"the sender that broadcast version {version} is gone (a "
                                     "restarted trainer?): read it from the filesystem")
            return self.link.published(epoch, seq, version, timeout)

    def _wait_published(self, version: int) -> None:
        """Wait until ``version`` is on the filesystem. Raises after ``fallback_timeout`` (the
        sender died before publishing?) and when this receiver is closed meanwhile. (Not cut
        short by ``receive``'s timeout: tensors given to it may hold part of this version
        already, and only its complete bytes make them one version again.)"""
        deadline = time.monotonic() + self.fallback_timeout
        pause = 0.005
        while True:
            latest = self.fs.latest_version()
            if latest is not None and latest >= version:
                return
            if time.monotonic() >= deadline:
                raise BroadcastTimeoutError(
                    f"version {version} was announced but is not on the filesystem after "
                    f"{self.fallback_timeout:.0f} s (the sender died before publishing?); "
                    "call receive again to load the newest published version")
            self._closed.wait(pause)
            self._check_open()
            pause = min(pause * 1.5, 0.1)

    def _load_fs(self, load_weights: LoadWeights, version: int,
                 after_partial: bool = False) -> int:
        """Load the newest published version (at least ``version``) from the filesystem.
        ``after_partial``: part of a broadcast may have reached the tensors; until a load
        succeeds, the next ``receive`` re-applies the newest published version first."""
        if after_partial:
            self._mixed = True
        self._wait_published(version)
        loaded = self.fs.load(load_weights)
        self._mixed = False
        self.last_source = "filesystem"
        return loaded

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise DBSyncError("this BroadcastReceiver is closed (a receive under way when it "
                              "was closed ends here); create a new one")

    def close(self) -> None:
        """Leave the group (the sender forms a new epoch without us) and drop the lease. A
        ``receive`` under way in another thread raises within half a second; later calls
        raise too."""
        self._closed.set()
        with self._lock:
            if self.link.conn is not None:
                try:
                    self.link.send("leave")
                except Exception:  # noqa: BLE001 - sender gone
                    pass
            self.link.disconnect()
            self.fs.close()

    def __enter__(self) -> BroadcastReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _destinations(target: Any, header: Header) -> dict[str, torch.Tensor] | bool | None:
    """For a plain ``nn.Module`` or a dict of tensors: name -> tensor, or False when the
    version does not fit it (a name missing on either side, another shape, a dtype that is
    not a floating cast). None for a ``load_weights`` callable."""
    if isinstance(target, torch.nn.Module):
        inner = unwrap_compiled(target)
        dest = destinations(inner, plain_state_dict(inner, keep_vars=True),
                            (entry.name for entry in header.entries))
    elif isinstance(target, Mapping):
        dest = dict(target)
    else:
        return None
    if len(dest) != len(header.entries):
        return False
    for entry in header.entries:
        tensor = dest.get(entry.name)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != entry.shape:
            return False
        want = entry.torch_dtype
        if not castable(want, tensor.dtype):
            return False
    return dest


_RECEIVERS: dict[tuple[str, str], BroadcastReceiver] = {}
_RECEIVERS_LOCK = threading.Lock()


def receive_weights(
    root: str | os.PathLike[str],
    load_weights: LoadWeights,
    *,
    device: torch.device | str | None = None,
    newer_than: int | None = None,
    timeout: float | None = None,
    reader_id: str | None = None,
    **options: Any,
) -> int | None:
    """Receive the next version of ``root`` into ``load_weights`` inside this process (e.g. a
    vLLM worker): over the broadcast group when the sender's group is reachable and matches
    ``device`` (NCCL on CUDA, gloo on CPU), else from the filesystem.

    One ``BroadcastReceiver`` per (root, device) is kept for the life of the process, so the
    group membership persists between calls. Returns the version applied, or None when nothing
    newer than ``newer_than`` (default: the last one applied here) came within ``timeout``.
    ``options`` configure that receiver when it is created (first call only): ``verify``,
    ``fallback_timeout``, ``address``, ``lease_timeout``, and ``step_timeout`` (the
    receiver's ``timeout``: the bound on each collective and handshake step).

    Hazard: between calls the receiver stays a group member; a push that arrives while no call
    is waiting costs the sender up to the step timeout and drops this worker from the group
    until its next call (it then reads that version from the filesystem)."""
    if device is None:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    key = (os.path.abspath(os.fspath(root)), str(torch.device(device)))
    with _RECEIVERS_LOCK:
        receiver = _RECEIVERS.get(key)
        if receiver is None:
            if "step_timeout" in options:
                options["timeout"] = options.pop("step_timeout")
            receiver = BroadcastReceiver(root, reader_id=reader_id, device=device, **options)
            _RECEIVERS[key] = receiver
    return receiver.receive(load_weights, newer_than=newer_than, timeout=timeout)


def close_receivers() -> None:
    """Close every receiver ``receive_weights`` opened in this process."""
    with _RECEIVERS_LOCK:
        for receiver in _RECEIVERS.values():
            receiver.close()
        _RECEIVERS.clear()
