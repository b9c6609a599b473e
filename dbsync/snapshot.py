"""Snapshot: one opened version of a store, held (its slot leased, shards mapped) or leaseless
(a private copy of every shard, verified before use): its checksums checked, its tensors
handed out as views, or copied into existing tensors in parallel threads.

Hazards, stated plainly:
- Tensors handed out are views of the slot's shards (a mapping when leased, a private copy
  otherwise). They are valid only while the snapshot is open: copy what you keep.
- Verification reads every byte once before anything is handed out or copied (a damaged
  version never reaches the model); the copy then reads from the page cache.
- A leased snapshot reads its shards through mappings: a read error inside one (a shard file
  truncated by a process breaking the protocol, an I/O error of a soft-mounted NFS) kills the
  process with SIGBUS. ``verify(by_reading=True)`` hashes ``preadv`` reads instead.
- Leaseless snapshots hold one private host copy of the version while they are open.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from . import fileio, gilswitch, memlimit, scatter
from .copyplan import MISSING, fit_problems, problem_listing, tie_key, tied_to_published
from .errors import (
    DamagedVersionError,
    DBSyncError,
    FormatError,
    IncompatibleWeightsError,
    LeaseExpiredError,
    StoreUnreachableError,
    check_int,
    resource_limit,
)
from .fileio import ShardSizeError, ShardView, checksum, settle, wait_all
from .format import (
    SLOT_STAMP_FILE,
    Manifest,
    describe_name,
    is_extra_state,
    is_tensordict,
    plain_state_dict,
    shard_file,
    unwrap_compiled,
)
from .hfcheckpoint import destinations
from .store import mount_read_error, rereads

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .receiver import Receiver

__all__ = ["LeaseNotRenewed", "SlotReused", "Snapshot"]

log = logging.getLogger(__name__)

#: bytes per verification / copy task
_TASK_BYTES = 16 << 20
#: tensors per autograd version bump call
_BUMP_CHUNK = 512
_EMPTY_CHECKSUM = checksum(b"")


class LeaseNotRenewed(LeaseExpiredError):
    """The lease was not renewed in time, though the slot still holds the version: a load
    reads it again (the read renews the lease first)."""


class SlotReused(LeaseExpiredError):
    """The slot changed under a read that held no lease, or a lease the writer did not see
    (through a caching mount: see ``Snapshot.check_unchanged``): read again."""


class Snapshot:
    """One opened version: leased (shards mapped) or leaseless (private verified copies).
    Use as a context manager. The hold on the slot ends on exit (or, for a snapshot dropped
    without ``close()``, once it is garbage-collected: its views are then unprotected). A
    block that ends normally after tensors were handed out or copied (and not checked since
    with ``check_unchanged()``) checks them on exit: ``LeaseExpiredError`` if the slot may have
    been reused meanwhile (this process stalled past its lease timeout), since what was read
    can then not be trusted. Without ``with``, call ``check_unchanged()`` after the apply."""

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
        #: views handed out or bytes copied since the last ``check_unchanged`` that passed
        self._unchecked = False
        store = receiver.store
        bad_shards: dict[int, str] = {}
        needed = [0] * len(manifest.shards)  # per shard, the end of its last checked range
        for r in manifest.ranges:
            needed[r.shard] = max(needed[r.shard], r.offset + r.nbytes)
        if not leased:  # (a private copy of every shard: past a container's memory limit
            # the kernel kills the process, with no word to anyone)
            memlimit.check_room(
                sum(needed), f"reading version {manifest.version} of {store.root} without a "
                "lease (into a private copy)", "Nothing was applied: let it lease (where this "
                "user may write the store's readers/, a load needs no copy)")
        for i, size in enumerate(manifest.shards):
            try:
                self._shards[i] = self._shard_view(i, size, needed[i])
            except FileNotFoundError:
                bad_shards[i] = "its shard file is missing"
            except StoreUnreachableError:  # not damage: the store's mount went away
                self.close()
                raise
            except PermissionError as exc:  # not damage: this user may not read it
                self.close()
                raise StoreUnreachableError(
                    f"{os.path.join(store.slot_dir(manifest.slot), shard_file(i))}: "
                    f"{exc.strerror or exc} for this process (uid {os.getuid()}); nothing is "
                    "known to be damaged: read the store as a user who may read its files",
                    exc.errno) from None
            except OSError as exc:  # the mount or this process's limit is no damage either
                try:
                    failed = (self._read_failure(
                        exc, os.path.join(store.slot_dir(manifest.slot), shard_file(i)),
                        f"reading version {manifest.version}")
                        or resource_limit(exc, f"opening version {manifest.version}'s shard "
                                               f"{i}"))
                except LeaseExpiredError:  # (the writer reused the slot: read again)
                    self.close()
                    raise
                if failed is None:
                    bad_shards[i] = f"shard {i}: {exc}"
                    continue
                self.close()
                raise failed from exc
            except MemoryError as exc:  # not damage: this process's limit (ulimit -v)
                self.close()
                raise resource_limit(exc, f"opening version {manifest.version}'s shard "
                                          f"{i}") from exc
            except FormatError as exc:
                bad_shards[i] = f"shard {i}: {exc}"
        if bad_shards:
            for entry in manifest.tensors:
                if entry.nbytes and entry.shard in bad_shards:
                    self._missing[entry.name] = bad_shards[entry.shard]
        if bad_shards and not self._missing:  # shards no tensor uses: still damage
            self._missing.update({f"<shard {i}>": why for i, why in bad_shards.items()})

    def _read_failure(self, exc: OSError, path: str, doing: str
                      ) -> StoreUnreachableError | None:
        """``mount_read_error`` for a shard read that failed, once a slot the writer reused is
        ruled out: NFS answers ``ESTALE`` for a file the writer replaced since this reader
        opened it (a slot reused under a leaseless read, a shard resized for a version of
        other tensor sizes), which is no failure of the mount; ``check_unchanged`` then
        raises ``SlotReused`` (read again)."""
        if exc.errno == errno.ESTALE:
            self.check_unchanged()
        return mount_read_error(path, exc, doing)

    def _shard_view(self, shard: int, size: int, needed: int) -> ShardView:
        """Shard ``shard`` opened and checked to have ``size`` bytes. A size that does not
        match is looked at again after the pauses a caching mount needs (``store.rereads``:
        1.3 s in all): a FUSE mount shows a file's size from its attribute cache (1 s by
        default) after the writer resized it for this version, which is not damage. Raises
        the last ``ShardSizeError`` if the size never matched."""
        store = self.receiver.store
        mismatch: ShardSizeError | None = None
        for _ in rereads():
            try:
                return ShardView(store.open_shard(self.manifest.slot, shard), size,
                                 private_copy=not self.leased, needed=needed)
            except ShardSizeError as exc:
                mismatch = exc
        assert mismatch is not None
        raise mismatch

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    def verify(self, threads: int = 4, by_reading: bool | None = None) -> None:
        """Check every checksum; raise one ``DamagedVersionError`` naming every bad tensor.
        Reads each byte once (which also warms the page cache for the apply).

        Hazard: by default a leased snapshot hashes its shards' mappings, and a shard file
        truncated meanwhile (only a process breaking the protocol can: a writer never touches
        a leased slot) kills this process with SIGBUS. ``by_reading=True`` hashes what
        ``preadv`` returns instead (a little slower: one more copy); a shard that shrank is
        then reported as damaged (``dbsync verify`` reads this way), and a read the mount
        fails (a soft NFS mount's or a FUSE daemon's EIO, which in a mapping is SIGBUS too)
        raises ``StoreUnreachableError``. The default (None) reads so on network and FUSE
        mounts, where such errors happen (the apply then finds the bytes in the page
        cache), and hashes the mappings elsewhere."""
        check_int(threads, "threads", 1)
        self._start_verify(threads, by_reading)()

    def _start_verify(self, threads: int, by_reading: bool | None = None
                      ) -> Callable[[], None]:
        """Start ``verify`` (hashing in the receiver's worker threads) and return the call
        that waits for it and raises as ``verify`` does; it must be called."""
        if self._closed:
            raise DBSyncError(f"version {self.version}'s snapshot is closed; open it again")
        if by_reading is None:
            by_reading = self.receiver.on_network_mount
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
        if bad or self._missing:
            # (damage may be a writer's reuse of the slot, seen late through a caching mount:
            # said as such, never as damage)
            self._check_unchanged_patiently()
            if bad:
                bad = self._read_again_past_the_cache(bad)
        elif self.leased:  # (a private copy whose every checksum matched is the version,
            self.check_unchanged()  # whatever the slot holds now)
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
                f"Run `dbsync verify {self.receiver.store.root}` and publish again from the "
                "trainer",
                damaged,
            )
        self._verified = True

    def _read_again_past_the_cache(self, bad: dict[int, str]) -> dict[int, str]:
        """The ranges of ``bad`` that still do not match their checksums once this host's
        cached pages of them were dropped (``POSIX_FADV_DONTNEED``) and they were read again
        (a private copy refilled; a mapping reads the file's pages anew), with the slot's
        stamp then looked at once more. A caching mount (NFS, FUSE ``auto_cache``) keeps a
        file's pages while its attributes look unchanged: pages a reader read while the
        writer was still writing (a head its cache showed late) can outlive that write when
        it left no newer time than the one seen (the time is set before the bytes land, and
        to a clock tick), and every later load of that slot hashed them. Dropping clean
        pages that no process maps costs nothing elsewhere; pages this process already
        mapped stay, and stay damage. Hazard: real damage is read twice before it is said."""
        ranges = self.manifest.ranges
        again = sorted(i for i in bad if ranges[i].shard in self._shards and ranges[i].nbytes)
        if not again:
            return bad
        by_shard: dict[int, list[int]] = {}
        for i in again:
            by_shard.setdefault(ranges[i].shard, []).append(i)
        slot_dir = self.receiver.store.slot_dir(self.manifest.slot)
        cut_short: set[int] = set()
        shards = sorted(by_shard)
        try:
            for first in range(0, len(shards), fileio.SHARDS_OPEN_AT_ONCE):
                batch = shards[first:first + fileio.SHARDS_OPEN_AT_ONCE]
                fds = self._reopen(batch)
                try:
                    for shard in batch:
                        for i in by_shard[shard]:
                            r = ranges[i]
                            with contextlib.suppress(OSError):  # (a hint: best effort)
                                os.posix_fadvise(fds[shard], r.offset, r.nbytes,
                                                 os.POSIX_FADV_DONTNEED)
                            if not self._shards[shard].read_again(fds[shard], r.offset,
                                                                  r.nbytes):
                                cut_short.add(i)
                finally:
                    for fd in fds.values():
                        os.close(fd)
        except FileNotFoundError:  # removed while held: the damage stands as first seen
            return bad
        except OSError as exc:
            failed = self._read_failure(exc, slot_dir, f"verifying version {self.version}")
            if failed is None:
                raise
            raise failed from exc
        # (a mapping is hashed by reading: a shard cut short would kill this process there)
        still = (self._hash_by_reading(again, 4) if self.leased
                 else self._hash_views([i for i in again if i not in cut_short], 4)())
        still.update((i, bad[i]) for i in cut_short)
        if still:
            self.check_unchanged()  # (a leaseless reader's slot may have moved on meanwhile)
        else:
            log.info("version %d: %d checked range(s) read through %s's cache did not match "
                     "their checksums; read again past the cache, they do (pages a caching "
                     "mount kept from before the writer's last write)", self.version,
                     len(again), self.receiver.store.root)
        return {i: why for i, why in bad.items() if i not in again or i in still}

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
            except OSError as exc:
                failed = self._read_failure(exc, self.receiver.store.slot_dir(self.manifest.slot),
                                            f"verifying version {self.version}")
                if failed is None:
                    raise
                raise failed from exc
            futures: list[Any] = []
            try:
                for shard in batch:
                    group = by_shard[shard]
                    for a, b in _task_bounds([ranges[i].nbytes for i in group]):
                        futures.append(pool.submit(run, fds[shard], group[a:b]))
                wait_all(futures)
                for future in futures:
                    bad.update(future.result())
            except OSError as exc:
                settle(futures)  # (before the files close: no task may read a closed fd)
                failed = self._read_failure(exc, self.receiver.store.slot_dir(self.manifest.slot),
                                            f"verifying version {self.version}")
                if failed is None:
                    raise
                raise failed from exc
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
        self._unchecked = True
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
        of 16 bits or more are cast. Returns the bytes copied. ``verify`` (default: the
        receiver's setting): check every checksum first (as ``verify()``, in other threads
        while the copy is planned); damage is reported before a mismatch of names or shapes,
        and nothing is copied after either.

        Tensors of the same dtype land by scatter reads from the shard files (leased) or
        memory copies from the verified private copy (leaseless); the rest through torch.
        Either way each destination's autograd version is bumped, as by an in-place copy.

        A leased snapshot checks after the copy that its slot still holds the version
        (``check_unchanged``): ``LeaseExpiredError`` if this process stalled past its lease
        timeout and the writer may have reused the slot meanwhile.

        Hazard: the raw copies write to the destinations' memory as it was when the copy was
        planned. Do not replace, resize or move the destination tensors (``p.data = ...``,
        ``.to()``, ``load_state_dict(assign=True)``) from another thread while it runs."""
        import torch

        check_int(threads, "threads", 1)

        self._check_open()
        if verify is None:
            verify = self.receiver.verify
        holds = _owns_its_tensors(target)  # (the copy's references may go before it ends)
        if isinstance(target, torch.nn.Module):
            inner = unwrap_compiled(target)  # (a compiled module: its own names, unless the
            tensors = self.manifest.tensors  # version was published under the wrapper's)
            if inner is not target and tensors and tensors[0].name.startswith("_orig_mod."):
                inner = target
            dest = plain_state_dict(inner, keep_vars=True)
            for name in [k for k in dest if is_extra_state(k)]:
                if not isinstance(dest[name], torch.Tensor):
                    del dest[name]  # a module's extra state (get_extra_state): not weights
            dest = destinations(inner, dest, (entry.name for entry in self.manifest.tensors))
        elif is_tensordict(target):
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
        self._unchecked = True
        if self.leased and len(shards) > fileio.SHARDS_OPEN_AT_ONCE:
            self._reopen(shards, keep_open=False)  # every file checked before any byte lands
        self._copy(plan, shards, by_torch, threads, drop=holds)
        if self.leased:  # (a verified private copy stays good whatever the slot holds now)
            self.check_unchanged()
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
                "dtypes (floating dtypes of 16 bits or more are cast)", problems)
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

    def _check_unchanged_patiently(self) -> None:
        """``check_unchanged``, looked at again after the pauses a caching mount needs
        (``store.rereads``: 1.3 s in all) before bytes that do not match their checksums are
        called damage: through NFS or FUSE, the head and the slot's stamp can be read from a
        cache (1 s by default) while the shards already hold the writer's next version, which
        is not damage. Hazard: real damage is reported that much later."""
        for _ in rereads():
            self.check_unchanged()

    def _stamp_read_again(self) -> tuple[Any, Any]:
        """The slot's stamp, after a read that failed: looked at again over the pauses of
        ``rereads`` while this process is out of open files or memory (other threads free
        theirs), then a ``ResourceLimitError``: whether the slot still holds the version
        cannot be told, so what was read is not trusted; nor is it called a reused slot.
        A failing mount raises ``StoreUnreachableError``. Any other failure reads as an
        unreadable stamp ((None, None)), which the caller takes as a changed one."""
        store, slot = self.receiver.store, self.manifest.slot
        path = os.path.join(store.slot_dir(slot), SLOT_STAMP_FILE)
        doing = f"checking that slot {slot} still holds version {self.version}"
        failure: BaseException | None = None
        for _ in rereads():
            try:
                return store.read_stamp_or_raise(slot)
            except FormatError:
                return None, None
            except OSError as exc:
                failure = (resource_limit(exc, doing, "nothing is known to be damaged, but "
                                          "what was read cannot be trusted while this is not "
                                          "known (load again)")
                           or mount_read_error(path, exc, doing))
                if failure is None:
                    return None, None
        assert failure is not None
        raise failure

    def check_unchanged(self) -> None:
        """Raise ``LeaseExpiredError`` if the writer may have started reusing this slot. (A
        leaseless snapshot's private copy, once every checksum of it matched, is the version
        whatever the slot holds now: nothing to check.)"""
        if not self.leased and self._verified:
            self._unchecked = False
            return
        keeper = self.receiver._keeper
        stamp = self.receiver.store.read_stamp(self.manifest.slot)
        if stamp == (None, None):  # unreadable: a failure of this process is no reuse
            stamp = self._stamp_read_again()
        if stamp != (self.version, self.run_id):
            cls: type[LeaseExpiredError] = SlotReused
            lapse = keeper.lapse_during(self._token) if self.leased else None
            if not self.leased:
                how = "a writer reused it while this reader held no lease"
            elif lapse is None:  # (a lease renewed in time that did not keep the slot
                how = ("a writer reused it without seeing this reader's lease (a head this "
                       "mount showed from its cache after the writer moved on, or leases the "
                       "writer sees late: NFS or FUSE caches longer than 1 s, see "
                       "docs/DEPLOY.md)")  # was not seen by the writer)
            else:
                cls = LeaseExpiredError
                expired = (f"this process, or its lease thread, was stalled (stopped, or "
                           f"starved of CPU): {lapse:.1f} s without a renewal, past 0.9 x its "
                           f"lease timeout of {keeper.timeout:g} s" if keeper.error is None
                           else f"it could not be renewed: {keeper.error.strerror or keeper.error}")
                how = (f"a writer reused it after this reader's lease expired ({expired}), or "
                       "the stamp file was damaged")
            raise cls(f"slot {self.manifest.slot} no longer holds version {self.version} (its "
                      f"stamp says {stamp[0]!r}): {how}. What was read cannot be trusted: load "
                      "again")
        if self.leased and not keeper.trusted():
            why = (f"renewing it failed: {keeper.error}" if keeper.error is not None else
                   "this process, or its lease thread, was stalled (stopped, or starved of "
                   "CPU)")
            raise LeaseNotRenewed(
                f"reader {self.receiver.reader_id} did not renew its lease in "
                f"{self.receiver.store.root} within 0.9 x its lease timeout "
                f"({keeper.timeout:g} s; {why}); the writer may reuse slot "
                f"{self.manifest.slot}, so what was read cannot be trusted: load again"
            )
        self._unchecked = False

    def close(self) -> None:
        """End the hold on the slot. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            for shard in self._shards.values():
                shard.close()
        finally:  # (the hold ends whatever happened above)
            self._shards.clear()
            self._dropped.detach()
            self.receiver._keeper.release(self._token)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if exc_type is None and self._unchecked and not self._closed:
                self.check_unchanged()  # (what was handed out: see the class docstring)
        finally:
            self.close()


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
