"""Receiver: load exactly one complete, verified version from a store.

``load(target)``: lease the current version's slot -> map its shards -> check every checksum
-> only then hand the tensors over (``load_weights(pairs)``, or a parallel copy into a plain
``nn.Module`` / dict of tensors) -> check the slot was not reused meanwhile -> record the
loaded version (its acknowledgement).

Read-only views (``mount -o ro``, Kubernetes ``ReadOnlyMany``, a directory this user cannot
write) need no lease: the receiver reads a private copy of every shard with ``preadv`` and
verifies the copy (checksums and the slot stamp) before anything is handed over, so a writer
reusing the slot meanwhile costs a retry, never a torn apply. The same happens whenever a lease
cannot be written (a full disk): loads go on, leaseless, and say so in the log.

Hazards, stated plainly:
- Tensors handed to ``load_weights`` are views of the slot's shards (a mapping when leased, a
  private copy otherwise). They are valid only until ``load`` returns: copy what you keep.
- Verification reads every byte once before the apply (a damaged version never reaches
  ``load_weights``); the apply then reads from the page cache. ``verify=False`` skips it and
  relies on the slot stamp and sizes alone.
- Leaseless loads hold one private host copy of the version while they run.
- A receiver keeps one heartbeat thread (a small file write every ``lease_timeout / 4``) so the
  writer and ``dbsync status`` can tell it is alive; ``close()`` (or garbage collection) stops
  it and removes the lease.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from . import fileio, gcpause, gilswitch, scatter
from .copyplan import (
    MISSING,
    PlanCache,
    fit_problems,
    problem_listing,
    tie_key,
    tied_to_published,
)
from .errors import (
    DamagedVersionError,
    DBSyncError,
    FormatError,
    IncompatibleWeightsError,
    LeaseExpiredError,
    StoreRewoundError,
)
from .fileio import ShardView, checksum, settle, wait_all
from .format import Head, Manifest, check_reader_id, describe_name, shard_file
from .leases import (
    DEFAULT_LEASE_TIMEOUT,
    IDLE,
    READING,
    ReaderIdInUse,
    check_lease_timeout,
    claim_reader_id,
    default_reader_id,
    host_identity,
    release_reader_id,
)
from .store import Store
from .workers import WorkerPools

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .watch import Watcher

log = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, Any]]], Any]
#: the suffix of a module's extra state in its state_dict (``nn.Module.get_extra_state``)
_EXTRA_STATE = "_extra_state"
#: bytes per verification / copy task
_TASK_BYTES = 16 << 20
_LEASELESS_RETRIES = 5
#: tensors per autograd version bump call
_BUMP_CHUNK = 512
_EMPTY_CHECKSUM = checksum(b"")


class _LeaseNotRenewed(LeaseExpiredError):
    """The lease was not renewed in time, though the slot still holds the version: a load
    reads it again (the read renews the lease first)."""


class _SlotReused(LeaseExpiredError):
    """A leaseless read saw the slot change before anything was applied: read again."""


class _LeaseKeeper:
    """Writes and refreshes one reader's lease from a heartbeat thread. Holds no reference to
    its Receiver, so a Receiver dropped without ``close()`` is collected and stops it."""

    def __init__(self, store: Store, reader_id: str, timeout: float, report_loaded: bool):
        self.store = store
        self.reader_id = reader_id
        self.timeout = timeout
        self.report_loaded = report_loaded
        self.held: dict[int, tuple[str, int]] = {}
        self.loaded: dict[str, Any] = {}
        self.refused: dict[str, Any] | None = None
        self.lock = threading.Lock()
        self.beat = 0
        self.last_ok: float | None = None
        self.error: OSError | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._ended = False
        self._wake = threading.Event()  # wakes the heartbeat early (a release, the end)
        self._released: collections.deque[int] = collections.deque()  # see release_later
        self._pid = os.getpid()
        #: this process's claim on the reader id (``leases.claim_reader_id``), if it made one
        self.claim: tuple[Any, str] | None = None

    def record(self) -> dict[str, Any]:
        held = sorted(self.held.values())
        slot, version = held[-1] if held else (None, None)
        return {
            "reader_id": self.reader_id, **host_identity(), "pid": os.getpid(),
            "lease_timeout": self.timeout,
            "state": READING if held else IDLE, "slot": slot, "version": version,
            "held": [list(h) for h in held],
            "loaded_version": self.loaded.get("version") if self.report_loaded else None,
            "loaded_run_id": self.loaded.get("run_id") if self.report_loaded else None,
            "loaded_at": self.loaded.get("at") if self.report_loaded else None,
            "refused": self.refused,
            "beat": self.beat, "updated_at": time.time(),
        }

    def write(self) -> bool:
        """Write the lease now; False (logged once per kind of error) if it cannot be."""
        if os.getpid() != self._pid:
            return False  # a forked child: the lease is its parent's
        with self.lock:
            if self._ended:  # (a closed receiver's lease stays removed)
                return False
            self.beat += 1
            started = time.monotonic()
            try:
                self.store.write_lease(self.reader_id, self.record())
            except (OSError, FormatError) as exc:
                err = exc if isinstance(exc, OSError) else OSError(errno.EIO, str(exc))
                if self.error is None or self.error.errno != err.errno:
                    level = logging.INFO if err.errno in (errno.EROFS, errno.EACCES,
                                                          errno.EPERM) else logging.WARNING
                    log.log(level, "reader %s cannot write its lease in %s (%s): loads go on "
                            "without a lease (private verified copies); the writer and `dbsync "
                            "status` do not see this reader meanwhile", self.reader_id,
                            self.store.root, err.strerror or err)
                self.error = err
                return False
            if self.error is not None:
                log.info("reader %s writes its lease in %s again", self.reader_id,
                         self.store.root)
                self.error = None
            self.last_ok = started
            return True

    def trusted(self) -> bool:
        """Whether the writer must still consider this lease live (renewed recently enough)."""
        return self.last_ok is not None and time.monotonic() - self.last_ok < 0.9 * self.timeout

    def hold(self, token: int, slot: str, version: int) -> bool:
        """Add a hold and write the lease; False (no hold) once the keeper is closing."""
        with self.lock:
            if self._closing:
                return False
            self.held[token] = (slot, version)
        return self.write()

    def release(self, token: int) -> None:
        if os.getpid() != self._pid:
            return  # a forked child: the holds and the lease are its parent's
        with self.lock:
            if self.held.pop(token, None) is None:
                return
            last = self._closing and not self.held
        if last:  # the receiver was closed while this hold lasted: end now
            self._end()
        else:
            self.write()

    def release_later(self, token: int) -> None:
        """``release`` from the heartbeat thread, soon: for a snapshot's finalizer, which
        garbage collection may run in any thread, this one included, even inside ``write``
        (holding ``lock``)."""
        self._released.append(token)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dbsync-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.timeout / 4)
            self._wake.clear()
            while self._released and not self._ended:
                self.release(self._released.popleft())
            if self._ended:
                return
            self.write()

    def close(self) -> None:
        """Stop the heartbeat and remove the lease, or, while snapshots still hold slots,
        once the last of them is released (their slots stay protected until then)."""
        with self.lock:
            self._closing = True
            if self.held:
                return
        self._end()

    def _end(self) -> None:
        with self.lock:
            if self._ended:
                return
            self._ended = True
        self._wake.set()
        if self._thread is None:
            return  # never wrote a lease (read-only): the file, if any, is another reader's
        if self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self.store.remove_lease(self.reader_id)
        except (OSError, FormatError):
            pass
        release_reader_id(self.claim)


class Snapshot:
    """One opened version: leased (shards mapped) or leaseless (private verified copies).
    Use as a context manager; the hold on the slot ends on exit (or, for a snapshot dropped
    without ``close()``, once it is garbage-collected: its views are then unprotected)."""

    def __init__(self, receiver: Receiver, manifest: Manifest, token: int, leased: bool):
        self.receiver = receiver
        self.manifest = manifest
        self.leased = leased
        self._token = token
        # (a snapshot dropped without close() releases its hold too: its views are then
        # unprotected, as documented, but the writer is not blocked forever)
        self._dropped = weakref.finalize(self, receiver._keeper.release_later, token)
        self._shards: dict[int, ShardView] = {}
        self._missing: dict[str, str] = {}
        self._closed = False
        self._verified = False
        store = receiver.store
        bad_shards: dict[int, str] = {}
        for i, size in enumerate(manifest.shards):
            try:
                self._shards[i] = ShardView(store.open_shard(manifest.slot, i), size,
                                            private_copy=not leased)
            except FileNotFoundError:
                bad_shards[i] = "its shard file is missing"
            except PermissionError as exc:  # not damage: this user may not read it
                self.close()
                raise DBSyncError(
                    f"{os.path.join(store.slot_dir(manifest.slot), shard_file(i))}: "
                    f"{exc.strerror or exc} for this process (uid {os.getuid()}); nothing is "
                    "known to be damaged: read the store as a user who may read its files"
                ) from None
            except (OSError, FormatError) as exc:
                bad_shards[i] = f"shard {i}: {exc}"
        if bad_shards:
            for entry in manifest.tensors:
                if entry.nbytes and entry.shard in bad_shards:
                    self._missing[entry.name] = bad_shards[entry.shard]
        if bad_shards and not self._missing:  # shards no tensor uses: still damage
            self._missing.update({f"<shard {i}>": why for i, why in bad_shards.items()})

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    def verify(self, threads: int = 4, by_reading: bool = False) -> None:
        """Check every checksum; raise one ``DamagedVersionError`` naming every bad tensor.
        Reads each byte once (which also warms the page cache for the apply).

        Hazard: by default a leased snapshot hashes its shards' mappings, and a shard file
        truncated meanwhile (only a process breaking the protocol can: a writer never touches
        a leased slot) kills this process with SIGBUS. ``by_reading=True`` hashes what
        ``preadv`` returns instead (a little slower: one more copy); a shard that shrank is
        then reported as damaged (``dbsync verify`` reads this way)."""
        self._start_verify(threads, by_reading)()

    def _start_verify(self, threads: int, by_reading: bool = False) -> Callable[[], None]:
        """Start ``verify`` (hashing in the receiver's worker threads) and return the call
        that waits for it and raises as ``verify`` does; it must be called."""
        if self._closed:
            raise DBSyncError(f"version {self.version}'s snapshot is closed; open it again")
        ranges = self.manifest.ranges
        present = self._shards
        todo = [i for i, r in enumerate(ranges) if r.shard in present]
        if by_reading and self.leased:
            bad = self._hash_by_reading(todo, threads)
            return lambda: self._judge(bad)
        hashed = self._hash_views(todo, threads)
        return lambda: self._judge(hashed())

    def _judge(self, bad: dict[int, str]) -> None:
        """Raise one ``DamagedVersionError`` for the bad ranges ``bad`` and missing shards."""
        ranges = self.manifest.ranges
        present = self._shards
        for i, r in enumerate(ranges):
            if r.shard not in present and (not r.nbytes and r.checksum != _EMPTY_CHECKSUM):
                bad[i] = f"checksum {_EMPTY_CHECKSUM} != {r.checksum}"
        damaged = dict(self._missing)
        if bad:
            hit = self.manifest.tensors_in(set(bad))
            for entry in hit:
                damaged.setdefault(entry.name, bad[entry.range])
            # damage no tensor lies in is still damage
            for i in sorted(set(bad) - {e.range for e in hit}):
                r = ranges[i]
                damaged[f"<bytes [{r.offset}, {r.offset + r.nbytes}) of shard {r.shard}>"] = \
                    bad[i]
        if damaged or self.leased:
            # (a private copy whose every checksum matched is the version, whatever the slot
            # holds now; damage in one may be a writer's reuse of the slot: said as such)
            self.check_unchanged()
        if damaged:
            names = ", ".join(describe_name(n) for n in list(damaged)[:10])
            more = " ..." if len(damaged) > 10 else ""
            shards = "; ".join(sorted(set(self._missing.values())))[:500]
            where = (f" in {len(bad)} checked range(s); a range is checked as a whole, so "
                     "every tensor in it is named" if bad else "")
            raise DamagedVersionError(
                f"version {self.version} in {self.receiver.store.slot_dir(self.manifest.slot)} "
                f"is damaged ({len(damaged)} tensor(s){where}: {names}{more})"
                + (f" [{shards}]" if shards else "") + "; nothing was applied. "
                "Run `dbsync verify ROOT` and publish again from the trainer",
                damaged,
            )
        self._verified = True

    def _hash_views(self, todo: list[int], threads: int) -> Callable[[], dict[int, str]]:
        """Start hashing; the returned call waits and gives {range: why} of every checked
        range in ``todo`` whose bytes in the shards' views do not hash to its checksum.
        Ranges are a few MiB (xxh3 releases the GIL), so the threads hash in parallel whatever
        the tensor count."""
        ranges = self.manifest.ranges
        views = {i: shard.view() for i, shard in self._shards.items()}

        def run(bounds: tuple[int, int]) -> list[tuple[int, str]]:
            bad = []
            for i in todo[bounds[0]:bounds[1]]:
                r = ranges[i]
                got = checksum(views[r.shard][r.offset:r.offset + r.nbytes])
                if got != r.checksum:
                    bad.append((i, _mismatch(got, r)))
            return bad

        pool = self.receiver.workers.get(threads)
        futures = [pool.submit(run, bounds)
                   for bounds in _task_bounds([ranges[i].nbytes for i in todo])]

        def result() -> dict[int, str]:
            wait_all(futures)
            return dict(itertools.chain.from_iterable(f.result() for f in futures))

        return result

    def _hash_by_reading(self, todo: list[int], threads: int) -> dict[int, str]:
        """{range: why} of every bad checked range in ``todo``, hashing ``preadv`` reads of
        the shard files (reopened, each checked to be the file mapped), a bounded number of
        shards open at a time."""
        ranges = self.manifest.ranges
        by_shard: dict[int, list[int]] = {}
        for i in todo:
            by_shard.setdefault(ranges[i].shard, []).append(i)
        shards = sorted(by_shard)
        bad: dict[int, str] = {}

        def run(fd: int, group: Sequence[int]) -> list[tuple[int, str]]:
            found = []
            buf = bytearray(min(fileio.CHUNK_BYTES, max(ranges[i].nbytes for i in group) or 1))
            view = memoryview(buf)
            for i in group:
                r = ranges[i]
                hasher = xxhash.xxh3_64()
                done = 0
                while done < r.nbytes:
                    piece = view[:min(len(buf), r.nbytes - done)]
                    got = os.preadv(fd, [piece], r.offset + done)
                    if got <= 0:
                        break
                    hasher.update(piece[:got])
                    done += got
                if done < r.nbytes:
                    found.append((i, "its shard file is shorter than the manifest says "
                                     "(truncated while it was held?)"))
                elif (got_sum := hasher.hexdigest()) != r.checksum:
                    found.append((i, _mismatch(got_sum, r)))
            return found

        pool = self.receiver.workers.get(threads)
        for first in range(0, len(shards), fileio.SHARDS_OPEN_AT_ONCE):
            batch = shards[first:first + fileio.SHARDS_OPEN_AT_ONCE]
            try:
                fds = self._reopen(batch)
            except FileNotFoundError:  # removed while held: damage, named by tensor
                bad.update((i, "its shard file was removed while the version was held")
                           for shard in batch for i in by_shard[shard])
                continue
            futures: list[Any] = []
            try:
                for shard in batch:
                    group = by_shard[shard]
                    for a, b in _task_bounds([ranges[i].nbytes for i in group]):
                        futures.append(pool.submit(run, fds[shard], group[a:b]))
                wait_all(futures)
                for future in futures:
                    bad.update(future.result())
            except BaseException:
                settle(futures)  # (before the files close: no task may read a closed fd)
                raise
            finally:
                for fd in fds.values():
                    os.close(fd)
        return bad

    def check_compatible(self, expected: Mapping[str, tuple[tuple[int, ...], Any]],
                         allow_missing: Iterable[str] = (), cast_floats: bool = False) -> None:
        """Raise ``IncompatibleWeightsError`` unless names, shapes and dtypes match
        ``expected`` (name -> (shape, dtype)). Names in ``allow_missing`` may be absent. With
        ``cast_floats``, a floating dtype fits any floating dtype (cast on apply)."""
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
            elif entry.torch_dtype != dtype and not (
                    cast_floats and entry.torch_dtype.is_floating_point
                    and dtype.is_floating_point):
                problems[entry.name] = f"dtype {entry.dtype} != expected {dtype}"
        published = {e.name for e in self.manifest.tensors}
        for name in expected:
            if name not in published and name not in optional:
                problems[name] = MISSING
        if problems:
            raise IncompatibleWeightsError(
                f"version {self.version} does not fit the model {problem_listing(problems)}. "
                "Publish weights of the served architecture", problems)

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, tensor) in manifest order; views valid only while the snapshot is open.
        Every checksum is checked first (once per snapshot) when the receiver verifies
        (``Receiver(verify=True)``, the default) and always for a private copy: a damaged
        version raises ``DamagedVersionError`` before the first tensor is handed out."""
        self._check_open()
        if not self._verified and self.receiver.verify:
            self.verify()
        return self._views()

    def _views(self) -> Iterator[tuple[str, Any]]:
        """``tensors()`` without the receiver's verify setting (a caller that decided)."""
        self._check_open()
        if self._missing:
            raise DamagedVersionError(
                f"version {self.version} is missing shards: "
                + ", ".join(sorted(set(self._missing.values()))), self._missing)
        if not self.leased and not self._verified:
            self.verify()  # a private copy is trusted only once its checksums match
        return ((entry.name, self._tensor(entry)) for entry in self.manifest.tensors)

    def _check_open(self) -> None:
        if self._closed:
            raise DBSyncError(f"version {self.version}'s snapshot is closed; open it again")

    def _tensor(self, entry: Any) -> Any:
        return self._shards[entry.shard].tensor(entry.torch_dtype, entry.shape, entry.offset,
                                                entry.nbytes)

    def tensordict(self) -> TensorDict:
        """The version as a flat ``TensorDict`` of views, keyed by tensor name (names are not
        split at '.'). Valid only while the snapshot is open, like ``tensors()``."""
        from tensordict import TensorDict

        return TensorDict(dict(self.tensors()), batch_size=[])

    def copy_into(self, target: Any, threads: int = 8, strict: bool = True,
                  verify: bool | None = None) -> int:
        """Copy this version into the existing tensors of ``target`` (an ``nn.Module``'s
        parameters and buffers by ``state_dict`` name, a dict of tensors, or a TensorDict by
        its keys joined with '.'), in parallel
        threads; names and shapes are checked before the first byte is copied. Floating dtypes
        are cast. Returns the bytes copied. ``verify`` (default: the receiver's setting):
        check every checksum first (as ``verify()``, in other threads while the copy is
        planned); damage is reported before a mismatch of names or shapes, and nothing is
        copied after either.

        Tensors of the same dtype land by scatter reads from the shard files (leased) or
        memory copies from the verified private copy (leaseless); the rest through torch.
        Either way each destination's autograd version is bumped, as by an in-place copy.

        Hazard: the raw copies write to the destinations' memory as it was when the copy was
        planned. Do not replace, resize or move the destination tensors (``p.data = ...``,
        ``.to()``, ``load_state_dict(assign=True)``) from another thread while it runs."""
        import torch

        self._check_open()
        if verify is None:
            verify = self.receiver.verify
        holds = _owns_its_tensors(target)  # (the copy's references may go before it ends)
        tensordict = sys.modules.get("tensordict")  # (no TensorDict unless it was imported)
        if isinstance(target, torch.nn.Module):
            dest = target.state_dict(keep_vars=True)
            for name in [k for k in dest if k == _EXTRA_STATE or k.endswith("." + _EXTRA_STATE)]:
                if not isinstance(dest[name], torch.Tensor):
                    del dest[name]  # a module's extra state (get_extra_state): not weights
        elif tensordict is not None and isinstance(target, tensordict.TensorDictBase):
            dest = dict(target.flatten_keys(".").items())  # (its own leaves, names as pushed)
        else:
            dest = target if type(target) is dict else dict(target)
        if (verify or not self.leased) and not self._verified:
            # Hashing releases the GIL; planning (a look at every destination) holds it, a
            # chunk of tensors per call: the hashing threads get it between chunks.
            with gilswitch.fast_switching():
                verified = self._start_verify(threads)
                try:
                    plan = self._plan_copy(dest, strict)
                except BaseException:
                    verified()  # damage first: it says more than a mismatch
                    raise
                finally:
                    _drop_own(dest, drop=holds and dest is not target)
            verified()
        else:
            try:
                plan = self._plan_copy(dest, strict)
            finally:
                _drop_own(dest, drop=holds and dest is not target)
        if self._missing:
            raise DamagedVersionError(f"version {self.version} is missing shards",
                                      self._missing)
        if plan.shared:
            self._check_shared(plan.shared)

        def by_torch(task: list[tuple[Any, Any]]) -> None:
            with torch.no_grad():  # one batched copy per task: little per-tensor overhead
                # (torch's batched copy refuses conjugate and negative views: those alone)
                views = [(d, e) for d, e in task if d.is_conj() or d.is_neg()]
                batched = [(d, e) for d, e in task if not (d.is_conj() or d.is_neg())]
                if batched:
                    torch._foreach_copy_([dst.detach() for dst, _ in batched],
                                         [self._tensor(entry) for _, entry in batched])
                for dst, entry in views:
                    dst.detach().copy_(self._tensor(entry))

        shards = sorted(plan.raw)
        if self.leased and len(shards) > fileio.SHARDS_OPEN_AT_ONCE:
            self._reopen(shards, keep_open=False)  # every file checked before any byte lands
        self._copy(plan, shards, by_torch, threads, drop=holds)
        return self.manifest.total_bytes

    def _copy(self, plan: Any, shards: list[int], by_torch: Callable[[Any], None],
              threads: int, drop: bool) -> None:
        """Run the copy plan in the receiver's worker threads and bump the destinations'
        autograd versions meanwhile (``drop``: dropping the plan's references to them as it
        goes, see ``_bump_versions``); return once every copy has ended."""
        pool = self.receiver.workers.get(threads)
        # The switch interval is short from before the first task is queued until the bump
        # ends: a copy thread woken meanwhile waits that long for the GIL, which the bump
        # holds. (Back to normal while the copy runs on.)
        futures: list[Any] = []
        with contextlib.ExitStack() as switching:  # (closed once the bump is done)
            switching.enter_context(gilswitch.fast_switching())
            try:  # (never leave a copy running past this call; the first error is the one raised)
                futures += [pool.submit(by_torch, plan.by_torch[a:b]) for a, b in
                            _task_bounds([e.nbytes for _, e in plan.by_torch])]
                for first in range(0, len(shards), fileio.SHARDS_OPEN_AT_ONCE):
                    batch = shards[first:first + fileio.SHARDS_OPEN_AT_ONCE]
                    fds = self._reopen(batch) if self.leased else {}
                    try:
                        self._queue_reads(plan, batch, fds, pool, futures)
                        if not first:  # bumped while the first bytes land, and before a failed
                            # read could leave it unbumped
                            _bump_versions(plan.raw_destinations, drop)
                            switching.close()
                        wait_all(futures)
                    except BaseException:
                        settle(futures)  # (before the files close: no read on a closed fd)
                        raise
                    finally:
                        for fd in fds.values():
                            os.close(fd)
                wait_all(futures)
            except BaseException:
                settle(futures)
                raise

    def _queue_reads(self, plan: Any, batch: list[int], fds: dict[int, int], pool: Any,
                     futures: list[Any]) -> None:
        """Submit the plan's reads of the shards ``batch`` (from ``fds`` when leased, else
        from the private copies), appending each future as it is queued."""
        for shard in batch:
            for read in plan.raw[shard]:
                if self.leased:
                    futures.append(pool.submit(scatter.read_into, fds[shard], read))
                else:
                    futures.append(pool.submit(scatter.copy_from,
                                               self._shards[shard].address(), read))

    def _plan_copy(self, dest: dict[str, Any], strict: bool) -> Any:
        cache, entries = self.receiver.copy_plans, self.manifest.tensors
        tied = self.receiver._tied_names
        if tied and all(n in dest and twin in dest and tie_key(dest[n]) == tie_key(dest[twin])
                        for n, twin in tied.items()):  # (the last load's tied names)
            plan = cache.plan(entries, {k: v for k, v in dest.items() if k not in tied},
                              strict)
            if plan is not None:
                return plan
        self.receiver._tied_names = {}
        plan = cache.plan(entries, dest, strict)
        if plan is None:  # something does not fit: say everything that does not
            problems = self._copy_problems(dest, strict)
            tied = tied_to_published(problems, dest, [e.name for e in entries])
            if tied:  # names the version lacks only because they are tied to one it has
                self.receiver._tied_names = tied
                untied = {k: v for k, v in dest.items() if k not in tied}
                plan = cache.plan(entries, untied, strict)
                if plan is not None:
                    return plan
            if not problems:  # pragma: no cover
                raise AssertionError("the copy plan and the listing of problems disagree")
            raise IncompatibleWeightsError(
                f"version {self.version} does not fit the target {problem_listing(problems)}; "
                "nothing was copied. Load into tensors of the published names, shapes and "
                "dtypes (floating dtypes are cast)", problems)
        return plan

    def _check_shared(self, shared: list[tuple[Any, Any]]) -> None:
        """Refuse a version whose tensors differ where the target has one tensor for both
        (tied weights): the last copy would silently overwrite the first."""
        import torch

        ranges = self.manifest.ranges
        differ: list[tuple[Any, Any]] = []
        for a, b in shared:
            ra, rb = ranges[a.range], ranges[b.range]
            if a.dtype != b.dtype:
                same = False
            elif (ra.offset, ra.nbytes, rb.offset, rb.nbytes) == (a.offset, a.nbytes, b.offset,
                                                                  b.nbytes):
                same = ra.checksum == rb.checksum  # each alone in its checked range
            else:
                same = torch.equal(self._tensor(a).reshape(-1).view(torch.uint8),
                                   self._tensor(b).reshape(-1).view(torch.uint8))
            if not same:
                differ.append((a, b))
        if differ:
            raise IncompatibleWeightsError(
                f"version {self.version} does not fit the target: "
                + "; ".join(f"{describe_name(a.name)} and {describe_name(b.name)}"
                            for a, b in differ[:12])
                + " are one tensor in the target (tied weights) but differ in the version; "
                "nothing was copied. Publish them equal (tied in the trainer too) or load into "
                "a target where they are separate tensors",
                {a.name: f"tied to {b.name} in the target, different in the version"
                 for a, b in differ})

    def _copy_problems(self, dest: dict[str, Any], strict: bool) -> dict[str, str]:
        """Every reason why ``dest`` cannot take this version (name -> why)."""
        return fit_problems([(e.name, e.shape, e.torch_dtype) for e in self.manifest.tensors],
                            dest, strict)

    def _reopen(self, shards: list[int], keep_open: bool = True) -> dict[int, int]:
        """Open these shards again (for scatter reads); each must be the file verified.
        With ``keep_open=False``, only check them (one open file at a time)."""
        fds: dict[int, int] = {}
        try:
            for shard in shards:
                fd = fds[shard] = self.receiver.store.open_shard(self.manifest.slot, shard)
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != self._shards[shard].file_id:
                    raise LeaseExpiredError(
                        f"shard {shard} of slot {self.manifest.slot} was replaced while "
                        f"version {self.version} was held (this reader's lease expired?); "
                        "the load stopped there, and what it applied cannot be trusted: "
                        "load again")
                if not keep_open:
                    os.close(fds.pop(shard))
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    def check_unchanged(self) -> None:
        """Raise ``LeaseExpiredError`` if the writer may have started reusing this slot. (A
        leaseless snapshot's private copy, once every checksum of it matched, is the version
        whatever the slot holds now: nothing to check.)"""
        if not self.leased and self._verified:
            return
        stamp = self.receiver.store.read_stamp(self.manifest.slot)
        if stamp != (self.version, self.run_id):
            cls = _SlotReused if not self.leased else LeaseExpiredError
            raise cls(
                f"slot {self.manifest.slot} no longer holds version {self.version} (its stamp "
                f"says {stamp[0]!r}): "
                + ("a writer reused it while this reader held no lease" if not self.leased else
                   "a writer reused it after this reader's lease expired (stalled longer than "
                   "the lease timeout), or the stamp file was damaged")
                + ". What was read cannot be trusted: load again"
            )
        keeper = self.receiver._keeper
        if self.leased and not keeper.trusted():
            why = (f"renewing it failed: {keeper.error}" if keeper.error is not None else
                   "this process, or its lease thread, was stalled (stopped, or starved of "
                   "CPU)")
            raise _LeaseNotRenewed(
                f"reader {self.receiver.reader_id} did not renew its lease in "
                f"{self.receiver.store.root} within 0.9 x its lease timeout "
                f"({keeper.timeout:g} s; {why}); the writer may reuse slot "
                f"{self.manifest.slot}, so what was read cannot be trusted: load again"
            )

    def close(self) -> None:
        """End the hold on the slot. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()
        self._dropped.detach()
        self.receiver._keeper.release(self._token)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OVERLAY_CHECKED: set[str] = set()  # roots this process looked at (receivers come per swap)


def _warn_if_under_an_overlay(root: str) -> None:
    """Warn once per root and process if ``root`` is reached through an overlay whose lower
    layer (where it is visible here) holds the store."""
    from .watch import store_in_overlay_lower

    if root in _OVERLAY_CHECKED:
        return
    _OVERLAY_CHECKED.add(root)
    lower = store_in_overlay_lower(root)
    if lower is not None:
        log.warning(
            "%s is reached through an overlay filesystem whose lower layer %s holds the store: "
            "what a trainer writes there is not reliably seen through the overlay (the kernel "
            "leaves changes to a lower layer undefined; versions may be missed or refused as "
            "damaged), and this reader's lease lands in the overlay's upper layer, where the "
            "trainer never sees it. Mount the store directory itself (a bind mount or a "
            "volume)", root, lower)


def _drop_own(dest: dict[str, Any], drop: bool) -> None:
    """Empty ``dest`` if ``drop`` (it was built for this copy from a module, whose parameters
    and buffers own their memory): now, just after planning looked at every tensor in it,
    rather than on return, after the copy has pushed them out of the caches (see
    ``_bump_versions``). Other targets' flattened tensors are kept: a mapping may hand out
    tensors nothing else holds (a lazily stacked TensorDict), and the copy writes into them."""
    if drop:
        dest.clear()


def _owns_its_tensors(target: Any) -> bool:
    """Whether ``target`` holds every tensor the copy writes (a plain dict, a module), so the
    copy's own references may go before it ends."""
    import torch

    return type(target) is dict or isinstance(target, torch.nn.Module)


def _bump_versions(tensors: list[Any], drop: bool) -> None:
    """Bump the autograd version of ``tensors``, as an in-place copy does, ``_BUMP_CHUNK`` at
    a time: each call holds the GIL (~0.15 us per tensor when the caches are cold), and the
    copy threads need it between two reads.

    ``drop`` (only where the target holds every tensor itself): empty ``tensors`` as it goes,
    a chunk's references right after its bump, while its tensors are in the caches. Dropped
    after the copy instead, when the bytes copied have pushed them out, they cost one more
    cache miss per tensor on the caller's time."""
    import torch

    bump = torch.autograd.graph.increment_version
    for lo in range(0, len(tensors), _BUMP_CHUNK):
        chunk = tensors[lo:lo + _BUMP_CHUNK]
        bump(chunk)
        if drop:
            tensors[lo:lo + len(chunk)] = itertools.repeat(None, len(chunk))
        del chunk
    if drop:
        tensors.clear()


def _mismatch(got: str, r: Any) -> str:
    return (f"checksum {got} != {r.checksum} (its checked range: bytes [{r.offset}, "
            f"{r.offset + r.nbytes}) of shard {r.shard})")


def _task_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, stop) index ranges of about ``_TASK_BYTES`` each (a big item alone)."""
    out: list[tuple[int, int]] = []
    start = total = 0
    for i, n in enumerate(sizes):
        if total and total + n > _TASK_BYTES:
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


class Receiver:
    """Reads versions from ``root``, which must exist (a typo is an error, not a new empty
    store to wait on forever). Registers itself (a lease file) on construction, so the writer
    and ``dbsync status`` see it; ``close()`` removes it. On a read-only view it works without
    a lease (see the module docstring); ``read_only=True`` forces that mode."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        reader_id: str | None = None,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        verify: bool = True,
        poll_interval: float | None = None,
        report_loaded: bool = True,
        read_only: bool | None = None,
    ):
        self.store = Store(root, create=False)
        self.reader_id = check_reader_id(
            reader_id or default_reader_id()
        )
        self.lease_timeout = check_lease_timeout(lease_timeout)
        self.verify = verify
        self.poll_interval = poll_interval
        #: False for helper readers (e.g. a worker staging broadcasts) whose loads must not be
        #: counted as an engine serving the version (``dbsync status``, wait_for_receivers).
        self.report_loaded = report_loaded
        self.loaded_version: int | None = None
        self.loaded_run_id: str | None = None
        self.loaded_at: float | None = None
        self._heads: dict[int, Head] = {}
        #: the last plan of ``load(module or dict)``, reused load after load of one model
        self.copy_plans = PlanCache()
        #: names of the last target that the version lacks because each is tied to a
        #: published one ({name: published twin}; checked again at every load)
        self._tied_names: dict[str, str] = {}
        self._tokens = itertools.count(1)
        self._keeper = _LeaseKeeper(self.store, self.reader_id, self.lease_timeout,
                                    report_loaded)
        _warn_if_under_an_overlay(self.store.root)
        self.read_only = self._decide_read_only(read_only)
        if not self.read_only:
            try:
                self._keeper.claim = claim_reader_id(self.store, self.reader_id)
            except ReaderIdInUse as exc:
                raise DBSyncError(
                    f"reader id {self.reader_id!r} is in use in {self.store.root}: {exc}. Two "
                    "receivers sharing an id overwrite each other's lease, and the writer may "
                    "then reuse a slot one of them still reads: give each receiver its own "
                    "reader_id (or leave it unset for a unique one)") from None
            try:
                self._keeper.write()
                self._keeper.start()
            except BaseException:
                release_reader_id(self._keeper.claim)
                raise
        #: worker threads kept from one load to the next (see ``workers``)
        self.workers = WorkerPools("dbsync-read")
        self._closed = threading.Event()
        self._closing = threading.Lock()
        self._waits: set[threading.Event] = set()  # events of the wait() calls under way
        self._watchers: weakref.WeakSet[Any] = weakref.WeakSet()  # started by watch()
        self._finalizer = weakref.finalize(self, _close_parts, self._keeper, self.workers)

    def _decide_read_only(self, forced: bool | None) -> bool:
        if forced is not None:
            return forced
        if not os.path.isdir(self.store.readers_dir):
            try:  # a store created before its first push by an older writer, or by hand
                self.store.create_readers_dir()
            except (OSError, FormatError):
                pass
        if self.store.writable():
            return False
        log.info("%s is read-only for this process: reader %s loads without a lease "
                 "(private verified copies) and cannot acknowledge loads", self.store.root,
                 self.reader_id)
        return True

    # ---- public -------------------------------------------------------------------------
    def store_problem(self) -> str | None:
        """Why this receiver cannot follow its store, as its last lease write found (every
        ``lease_timeout / 4`` seconds), or None. Touches no file: safe to call from an event
        loop while the store hangs. A read-only view (no lease by design) is no problem."""
        error = self._keeper.error
        if error is None or error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        if error.errno == errno.ENOENT:
            return (f"{self.store.root} is missing, or has no readers/ directory (removed or "
                    "unmounted?)")
        return (f"cannot write this reader's lease in {self.store.root} "
                f"({error.strerror or error}): the trainer does not see it")

    def latest_version(self) -> int | None:
        """The current version per the head, without loading anything (reads a small file)."""
        head = self.store.read_head()
        return None if head is None else head.version

    def manifest(self) -> Manifest:
        return self.store.require_manifest()

    def open(self, version: int | None = None, head: Head | None = None) -> Snapshot:
        """Hold and open the current version, or ``version`` if this receiver opened it before,
        or the version ``head`` names (a head record kept by another process, e.g. a rollback
        target), provided its slot still holds it. Use ``with receiver.open() as snap:``.

        Raises ``StoreRewoundError`` if the head went backwards within one run (a restored
        older copy); a new run id is followed (logged) instead."""
        self._check_open()
        if head is not None:
            version = head.version
            self._heads[head.version] = head
        for _ in range(100):
            head = self._target_head(version)
            token = next(self._tokens)
            leased = not self.read_only and self._keeper.hold(token, head.slot, head.version)
            try:
                if version is None and leased:
                    # If the head still names our version after our lease is visible, the
                    # writer cannot start on this slot without first seeing the lease.
                    again = self.store.read_head()
                    if again is None or (again.run_id, again.version) != (head.run_id,
                                                                          head.version):
                        self._keeper.release(token)
                        continue
                manifest = self.store.manifest_in_slot(head.slot, head)
                if manifest is None:
                    self._keeper.release(token)
                    if version is not None:
                        raise self._gone(version)
                    continue
                snap = Snapshot(self, manifest, token, leased)
            except BaseException:
                self._keeper.release(token)
                raise
            try:
                snap.check_unchanged()
            except _SlotReused:
                snap.close()
                if version is not None:
                    raise self._gone(version) from None
                continue
            except BaseException:
                snap.close()
                raise
            self._heads[head.version] = head
            return snap
        raise DBSyncError("the head changed 100 times while opening; is a writer publishing "
                          "in a tight loop?")

    def _gone(self, version: int) -> DBSyncError:
        return DBSyncError(f"version {version} is no longer held in {self.store.root} (the "
                           "writer reused its slot); open the current version instead")

    def _target_head(self, version: int | None) -> Head:
        if version is not None:
            head = self._heads.get(version)
            current = self.store.read_head()
            if current is not None and current.version == version:
                head = current
            if head is None:
                if current is None or version > current.version:
                    latest = "none yet" if current is None else f"the latest is {current.version}"
                    raise DBSyncError(f"version {version} is not published in "
                                      f"{self.store.root} ({latest}); open the current version "
                                      "(open() without a version)")
                raise self._gone(version)
            return head
        head = self.store.read_head()
        if head is None:
            raise self.store.nothing_published()
        if head.run_id == self.loaded_run_id and self.loaded_version is not None and (
                head.version < self.loaded_version):
            raise StoreRewoundError(
                f"{self.store.root} went back from version {self.loaded_version} to "
                f"{head.version} within run {head.run_id}: its head was restored from an older "
                "copy. Nothing was loaded. Publish a new version from the trainer (or start a "
                "new run in a fresh directory)"
            )
        if self.loaded_run_id is not None and head.run_id != self.loaded_run_id:
            log.info("%s holds a new run (%s, version %d; was %s, version %s): following it",
                     self.store.root, head.run_id, head.version, self.loaded_run_id,
                     self.loaded_version)
        return head

    def load(self, target: LoadWeights | Any, verify: bool | None = None,
             threads: int = 8) -> int:
        """Apply the latest complete version, after verifying it, and return that version.

        ``target``: a ``load_weights`` callable (called once with an iterable of (name,
        tensor) in manifest order), or a plain ``nn.Module`` / dict of tensors / TensorDict
        (copied into in place, in ``threads`` parallel threads, names and shapes checked
        first; see ``Snapshot.copy_into``)."""
        self._check_open()
        verify = self.verify if verify is None else verify
        if callable(target) and not _is_tensor_container(target):
            return self._load(target, verify, threads)  # the callback's objects: not ours
        with gcpause.paused():
            return self._load(target, verify, threads)

    def _load(self, target: LoadWeights | Any, verify: bool, threads: int) -> int:
        for attempt in range(_LEASELESS_RETRIES):
            with self.open() as snap:
                container = not callable(target) or _is_tensor_container(target)
                try:
                    if container:
                        snap.copy_into(target, threads=threads, verify=verify)
                    else:
                        if verify or not snap.leased:
                            snap.verify()
                        target(snap._views())
                    if snap.leased:  # (a private copy was verified before the apply: it stays
                        snap.check_unchanged()  # good; a leased slot must still hold it)
                except _SlotReused:
                    if attempt + 1 < _LEASELESS_RETRIES:
                        log.info("version %d was replaced while %s read it without a lease; "
                                 "reading again", snap.version, self.reader_id)
                        continue
                    raise
                except _LeaseNotRenewed as exc:
                    if attempt + 1 < _LEASELESS_RETRIES:
                        log.info("%s; reading version %d again", exc, snap.version)
                        continue
                    raise
                except (IncompatibleWeightsError, DamagedVersionError) as exc:
                    self._refused(snap.version, exc)
                    raise
                self.mark_loaded(snap.version, snap.run_id)
                return snap.version
        raise AssertionError("unreachable")

    def mark_loaded(self, version: int, run_id: str | None = None) -> None:
        """Record that ``version`` is now applied (shown by ``dbsync status``, counted by
        ``Sender.wait_for_receivers``). Clears an earlier refusal of an older version."""
        head = self._heads.get(version)
        self.loaded_version = version
        self.loaded_run_id = run_id or (head.run_id if head is not None else None)
        self.loaded_at = time.time()
        self._keeper.loaded = {"version": version, "run_id": self.loaded_run_id,
                               "at": self.loaded_at}
        if self._keeper.refused and self._keeper.refused.get("version", 0) <= version:
            self._keeper.refused = None
        if not self.read_only:
            self._keeper.write()

    def _refused(self, version: int, exc: DBSyncError) -> None:
        """A load refused ``version`` (damaged, or unfit for the target): tell the trainer,
        unless this reader does not report (a helper reader); never hides ``exc``."""
        if not self.report_loaded:
            return
        try:
            self.report_refusal(version, f"{type(exc).__name__}: {exc}")
        except OSError as report_error:
            log.info("could not record the refusal of version %d in %s: %s", version,
                     self.store.root, report_error)

    def report_refusal(self, version: int, reason: str) -> None:
        """Record that ``version`` was refused or failed to apply, so the trainer sees it
        (``dbsync push --wait-for`` and ``wait_for_receivers`` fail fast naming this reader)."""
        self._keeper.refused = {"version": version, "reason": str(reason)[:2000],
                                "at": time.time()}
        if not self.read_only:
            self._keeper.write()

    def wait(self, newer_than: int | None = None, timeout: float | None = None) -> int | None:
        """Block until a version newer than ``newer_than`` (default: the loaded one) is
        published, or a new run starts; return its version, or None on timeout. Uses the
        store's watcher (inotify or polling, chosen from the mount type)."""
        from .watch import Watcher

        self._check_open()
        floor = self.loaded_version if newer_than is None else newer_than
        floor = 0 if floor is None else floor
        run = self.loaded_run_id
        if newer_than is not None and newer_than in self._heads:  # a version it opened
            run = self._heads[newer_than].run_id
        if run is None:
            head = self._read_head_quietly()
            run = None if head is None else head.run_id
        event = threading.Event()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waits.add(event)
        try:
            with Watcher(self.store.root, lambda _v: event.set(),
                         poll_interval=self.poll_interval, skip_current=True):
                return self._wait_for(event, floor, run, deadline)
        finally:
            self._waits.discard(event)

    def _wait_for(self, event: threading.Event, floor: int, run: str | None,
                  deadline: float | None) -> int | None:
        while True:
            if self._closed.is_set():
                raise DBSyncError(f"this Receiver of {self.store.root} was closed while "
                                  "waiting for a new version")
            head = self._read_head_quietly()
            if head is not None and (head.version > floor or (
                    run is not None and head.run_id != run)):
                return head.version
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            # the watcher wakes us; the bound is only a safety net (no spinning)
            event.wait(5.0 if remaining is None else min(remaining, 5.0))
            event.clear()

    def _read_head_quietly(self) -> Head | None:
        try:
            return self.store.read_head()
        except (DBSyncError, OSError) as exc:
            log.debug("cannot read the head of %s: %s", self.store.root, exc)
            return None

    def watch(self, callback: Callable[[int], Any], **kwargs: Any) -> Watcher:
        """Start a background watcher calling ``callback(version)`` on each new version
        (including the current one at start). Returns the started ``Watcher``; stop() it
        (``close()`` stops it too)."""
        from .watch import Watcher

        kwargs.setdefault("poll_interval", self.poll_interval)
        watcher = Watcher(self.store.root, callback, **kwargs)
        with self._closing:  # (callbacks run in the watcher's thread: no deadlock)
            self._check_open()
            self._watchers.add(watcher)
            watcher.start()
        return watcher

    def close(self) -> None:
        """End this receiver: ``wait()`` calls under way raise, watchers started by
        ``watch()`` stop, and later calls of ``open``, ``load``, ``wait`` and ``watch`` raise.
        The heartbeat stops and the lease is removed once snapshots still open are closed (a
        slot they read stays protected until then). Safe to call more than once."""
        with self._closing:  # (watch() adds under it: no watcher starts unseen)
            self._closed.set()
            watchers, self._watchers = list(self._watchers), weakref.WeakSet()
        for event in list(self._waits):
            event.set()
        for watcher in watchers:  # (only the first close joins them: two callbacks that
            watcher.stop()  # close at once must not wait for each other)
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise DBSyncError(f"this Receiver of {self.store.root} is closed; create a new one")

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_parts(keeper: _LeaseKeeper, workers: WorkerPools) -> None:
    keeper.close()
    workers.close()




def _is_tensor_container(target: Any) -> bool:
    import torch

    return isinstance(target, torch.nn.Module | Mapping)

