"""Raw file work: parallel buffered writes into preallocated shard files, fsync, checksums,
atomic replaces, and the two ways of reading a shard (a shared read-only mapping, or a
private copy).

Hazards, stated plainly:
- Writes go through ``pwrite``/``pwritev`` (large buffered writes), never through mmap page
  faults: on NFS a faulting mmap write turns into one 4 KiB RPC per page.
- Shards are reused in place when their size is unchanged. That is only safe because the store
  never writes into a slot that the head points to or that a live reader leases.
- A mapping of a shard that a writer later shrinks faults (SIGBUS) past the new end of file.
  Leased readers map (the writer cannot touch a leased slot); readers without a lease read a
  private copy with ``preadv`` instead.
- Every error raised in a worker thread is re-raised in the caller; none is swallowed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import xxhash

from . import unmapping
from .errors import ResourceLimitError
from .format import ALIGN, aligned  # noqa: F401  (re-exported: one alignment rule)

_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100
_PYBUF_WRITE = 0x200

CHUNK_BYTES = 16 * 2**20
#: shard files a writer or reader keeps open at once (the common soft limit is 1,024 files;
#: a 1 TB version has 2,000 shards)
SHARDS_OPEN_AT_ONCE = 64
#: Small tensors are written together, up to this many bytes or iovecs per ``pwritev``.
GROUP_BYTES = 4 * 2**20
GROUP_IOVECS = 500
_ZEROS = memoryview(bytes(ALIGN))
_GAPS = [_ZEROS[:n] for n in range(ALIGN)]
_IOV_MAX = 1024


def tensor_bytes(tensor: Any, writable: bool = False) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy). Works for 0-d, empty, bf16, fp8.

    Hazard: the view does not keep the tensor alive; the caller must hold the tensor for as
    long as it uses the view (a few calls instead of four torch ops per tensor: this runs once
    per tensor of every push)."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return _memory_view(tensor.data_ptr(), nbytes, _PYBUF_WRITE if writable else _PYBUF_READ)


def views_at(starts: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """Read-only byte views of ``sizes[i]`` bytes at address ``starts[i]`` (no copy), for
    tens of thousands of tensors at a fraction of ``tensor_bytes``'s cost: each is a slice of
    one view over the address range they span.

    Hazard: the caller vouches that each range is memory it may read (a contiguous CPU
    tensor's bytes). The one view also spans memory that is not theirs (possibly unmapped); it
    never leaves this function, and only the slices are returned. Like ``tensor_bytes``, the
    views do not keep the tensors alive."""
    used = [(p, n) for p, n in zip(starts, sizes, strict=True) if n]
    if not used:
        return [memoryview(b"") for _ in sizes]
    low = min(p for p, _ in used)
    high = max(p + n for p, n in used)
    arena = _memory_view(low, high - low, _PYBUF_READ)
    empty = memoryview(b"")
    return [arena[p - low:p - low + n] if n else empty
            for p, n in zip(starts, sizes, strict=True)]


def checksum(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def read_exact(fd: int, size: int, offset: int) -> bytes:
    """Read exactly ``size`` bytes at ``offset`` (a file that shrank meanwhile is an OSError)."""
    parts = []
    while size:
        chunk = os.pread(fd, min(size, CHUNK_BYTES), offset)
        if not chunk:
            raise OSError(f"file ended {size} bytes early (it shrank while being read)")
        parts.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def read_to_end(fd: int, bound: int) -> bytes:
    """Every byte of ``fd`` from its start until end of file, or the first ``bound`` bytes of a
    longer one. The file's ``st_size`` is not trusted: through a mount that caches attributes
    (FUSE: ``attr_timeout``) a file just replaced can show the size of the file it replaced."""
    parts = []
    offset = 0
    while offset < bound:
        chunk = os.pread(fd, min(bound - offset, CHUNK_BYTES), offset)
        if not chunk:
            break
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


#: a directory with both bits (e.g. mode 2775) is group-shared by convention: what dbsync
#: creates in it is group-writable too, so another member of the group can continue the store
GROUP_SHARED = stat.S_ISGID | stat.S_IWGRP


def group_shared(dir_mode: int) -> bool:
    """Whether a directory of mode ``dir_mode`` is group-shared (setgid and group-writable)."""
    return dir_mode & GROUP_SHARED == GROUP_SHARED


def file_mode_in(dir_fd: int) -> int:
    """The mode of a file dbsync creates in directory ``dir_fd``: 0644 (readable by every
    account, never the caller's umask), 0664 in a group-shared directory."""
    return 0o664 if group_shared(os.fstat(dir_fd).st_mode) else 0o644


def directory_path(dir_fd: int) -> str:
    """The path of an open directory, for messages (``/proc/self/fd``; "?" if unknown)."""
    try:
        return os.readlink(f"/proc/self/fd/{dir_fd}")
    except OSError:
        return "?"


def write_atomic_at(dir_fd: int, name: str, data: bytes, durable: bool = True,
                    sync_dir: bool = True) -> None:
    """Replace ``name`` inside ``dir_fd`` with ``data`` atomically: a per-process temp file in
    the same directory, fsync (when durable), ``os.replace``, fsync the directory (unless
    ``sync_dir=False``: the caller then fsyncs it once after several replaces). The temp file
    is removed on any failure. An ``OSError`` names the file's full path."""
    try:
        _write_atomic_at(dir_fd, name, data, durable, sync_dir)
    except OSError as exc:
        if exc.filename is None or not os.path.isabs(str(exc.filename)):
            path = os.path.join(directory_path(dir_fd), name)
            raise type(exc)(exc.errno, exc.strerror, path) from None
        raise


def _write_atomic_at(dir_fd: int, name: str, data: bytes, durable: bool,
                     sync_dir: bool) -> None:
    tmp = f".tmp-{name}-{os.getpid()}-{os.urandom(4).hex()}"
    created = False
    mode = file_mode_in(dir_fd)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode, dir_fd=dir_fd)
        created = True
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        created = False
        if durable and sync_dir:
            os.fsync(dir_fd)
    finally:
        if created:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


def write_atomic(path: str, data: bytes, durable: bool = True, sync_dir: bool = True) -> None:
    """``write_atomic_at`` for a path (its directory is opened as given)."""
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic_at(dfd, os.path.basename(path), data, durable, sync_dir)
    finally:
        os.close(dfd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preallocate(fd: int, size: int, current: int) -> None:
    """Resize a file to ``size`` and reserve its blocks, unless it already has that size (a
    file reused in place keeps its blocks, much faster than truncate + rewrite)."""
    if current == size:
        return
    os.ftruncate(fd, size)
    if size:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (28, 122):  # ENOSPC, EDQUOT: a real answer
                raise
            # not supported here (some FUSE/NFS): a sparse file is still correct


_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _sync_file_range.restype = ctypes.c_int
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range to disk now (Linux ``sync_file_range``,
    asynchronous), so the fsync at the end of a push waits for less. Failures are ignored
    here: the fsync reports any error that matters."""
    if _sync_file_range is not None and nbytes:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


# ---- writing a version -------------------------------------------------------------------------
class Placed(NamedTuple):
    """Every tensor's bytes and where they go, as columns (index i is tensor i), and the
    writes they are grouped into (``Placed.of`` builds it)."""

    views: Sequence[memoryview]
    shards: Sequence[int]
    offsets: Sequence[int]
    #: (first, stop) index ranges, one write each (see ``group_writes``)
    tasks: Sequence[tuple[int, int]]

    @classmethod
    def of(cls, views: Sequence[memoryview], shards: Sequence[int], offsets: Sequence[int]
           ) -> Placed:
        return cls(views, shards, offsets, group_writes(views, shards))


def write_shards(
    fds: Sequence[int],
    placed: Placed,
    pool: ThreadPoolExecutor,
    durable: bool,
    progress: Callable[[int], None] | None = None,
    while_syncing: Callable[[list[str]], None] | None = None,
    gate: Callable[[], object] | None = None,
) -> list[str]:
    """Write every tensor into its shard in parallel, checksum each write's range (its
    tensors and the zero padding between them, see ``group_writes``) from the source bytes,
    and fsync each shard right after its last write (so fsyncs overlap other shards' writes).
    Returns the checksums of ``placed.tasks`` in order. Raises the first worker error after
    all workers have stopped; shards may then be partly written (the caller must not publish).

    ``while_syncing(checksums)`` runs once every write is done, while the fsyncs still run
    (work that needs the checksums, such as building the index, then costs no extra time).
    ``gate()`` is called before every write of up to ``CHUNK_BYTES``; it may block to let
    more urgent work (the trainer's next snapshot) have the CPU and memory bandwidth."""
    tasks = placed.tasks
    shards = placed.shards
    remaining = [0] * len(fds)
    for first, _ in tasks:
        remaining[shards[first]] += 1
    lock = threading.Lock()
    syncs: list[Future[None]] = []
    sums: list[str] = [""] * len(tasks)
    # A submit that fails ("can't start new thread") has already queued its task, with no
    # future to cancel: once ``stopped`` is set no task starts writing, and those writing
    # are waited for (``running``), so none writes into descriptors the caller then closes.
    running = threading.Condition()
    active = [0]
    stopped = [False]

    def run(number: int, task: tuple[int, int]) -> None:
        with running:
            if stopped[0]:
                return
            active[0] += 1
        try:
            write(number, task)
        finally:
            with running:
                active[0] -= 1
                running.notify_all()

    def write(number: int, task: tuple[int, int]) -> None:
        sums[number] = _write_task(fds, placed, task, progress, gate)
        if durable:
            shard = shards[task[0]]
            start = placed.offsets[task[0]]
            start_writeback(fds[shard], start,
                            placed.offsets[task[1] - 1] + len(placed.views[task[1] - 1]) - start)
            with lock:
                remaining[shard] -= 1
                last = remaining[shard] == 0
            if last:
                syncs.append(pool.submit(os.fsync, fds[shard]))

    futures: list[Future[None]] = []
    try:
        try:
            for number, task in enumerate(tasks):
                futures.append(pool.submit(run, number, task))
        except BaseException:  # (no thread to start one: see ``running``)
            with running:
                stopped[0] = True
            settle(futures)
            with running:
                running.wait_for(lambda: active[0] == 0)
            raise
        wait_all(futures)
        if while_syncing is not None:
            while_syncing(sums)
    finally:
        for f in list(syncs):  # never leave an fsync running on an fd the caller will close
            f.exception()
    if durable:
        synced = {shards[first] for first, _ in tasks}
        for shard in set(range(len(fds))) - synced:  # shards with no bytes (empty tensors)
            syncs.append(pool.submit(os.fsync, fds[shard]))
        wait_all(syncs)
    return sums


def group_writes(views: Sequence[memoryview], shards: Sequence[int]
                 ) -> list[tuple[int, int]]:
    """Tasks as (first, stop) index ranges: a big tensor alone; small neighbours in one shard
    together (up to ``GROUP_BYTES`` and ``GROUP_IOVECS``). Each task's bytes, padding
    included, are one checked range of the index (``range_columns``)."""
    tasks: list[tuple[int, int]] = []
    first = size = 0
    for i, view in enumerate(views):
        n = len(view)
        if n >= GROUP_BYTES:
            if first < i:
                tasks.append((first, i))
            tasks.append((i, i + 1))
            first, size = i + 1, 0
            continue
        if first < i and (shards[first] != shards[i] or size + n > GROUP_BYTES
                          or i - first >= GROUP_IOVECS):
            tasks.append((first, i))
            first, size = i, 0
        size += n
    if first < len(views):
        tasks.append((first, len(views)))
    return tasks


def range_columns(placed: Placed, first_shard: int = 0) -> tuple[list[int], list[list[int]]]:
    """The checked range of every tensor (its task's number) and the ranges' shard, offset
    and nbytes columns, for the tasks of ``placed`` (whose shards count from
    ``first_shard``)."""
    of_tensor = [0] * len(placed.views)
    shards: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    for number, (first, stop) in enumerate(placed.tasks):
        of_tensor[first:stop] = [number] * (stop - first)
        start = placed.offsets[first]
        shards.append(placed.shards[first] + first_shard)
        offsets.append(start)
        sizes.append(placed.offsets[stop - 1] + len(placed.views[stop - 1]) - start)
    return of_tensor, [shards, offsets, sizes]


def _write_task(fds: Sequence[int], placed: Placed, task: tuple[int, int],
                progress: Callable[[int], None] | None, gate: Callable[[], object] | None
                ) -> str:
    """Write one task's tensors and return the xxh3 of its range (padding included)."""
    if gate is not None:
        gate()
    first, stop = task
    views, offsets = placed.views, placed.offsets
    fd = fds[placed.shards[first]]
    data = views[first]
    if stop == first + 1 and len(data) >= GROUP_BYTES:
        for start in range(0, len(data), CHUNK_BYTES):
            if gate is not None and start:
                gate()
            piece = data[start:start + CHUNK_BYTES]
            _pwrite_all(fd, [piece], offsets[first] + start)
            if progress is not None:
                progress(len(piece))
        return checksum(data)
    iov: list[memoryview] = []
    gaps = _GAPS
    end = offsets[first]
    for i in range(first, stop):
        data, offset = views[i], offsets[i]
        if offset != end:
            iov.append(gaps[offset - end])  # alignment padding, < ALIGN bytes
        iov.append(data)
        end = offset + len(data)
    hasher = xxhash.xxh3_64()
    update = hasher.update
    for data in iov:  # (one update per piece: a streamed xxh3 equals one over the range)
        update(data)
    _pwrite_all(fd, iov, offsets[first])
    if progress is not None:
        progress(end - offsets[first])
    return hasher.hexdigest()


def _pwrite_all(fd: int, iov: list[memoryview], offset: int) -> None:
    done = 0
    while done < len(iov):
        written = os.pwritev(fd, iov[done:done + _IOV_MAX], offset)
        if not written and any(len(v) for v in iov[done:done + _IOV_MAX]):
            raise OSError(errno.EIO, "the filesystem accepted no bytes of a write")
        offset += written
        while done < len(iov) and written >= len(iov[done]):
            written -= len(iov[done])
            done += 1
        if written:
            iov[done] = iov[done][written:]


def settle(futures: Sequence[Future]) -> None:
    """Cancel what has not started and wait for the rest, raising nothing (for a caller that
    is already raising)."""
    for f in futures:
        f.cancel()
    wait_futures(futures)


def wait_all(futures: Sequence[Future]) -> None:
    """Wait for every future, then raise the first error (never leave a thread running
    against a file we are about to close, never drop an error). Once one has failed, or when
    interrupted while waiting (Ctrl-C), the futures that have not started are cancelled (a
    full disk or a stopped push writes no more) and the running ones waited for."""
    try:
        wait_futures(futures, return_when=FIRST_EXCEPTION)
    except BaseException:
        settle(futures)
        raise
    errors = [f.exception() for f in futures if f.done() and not f.cancelled()]
    failed = next((exc for exc in errors if exc is not None), None)
    if failed is not None:
        settle(futures)
        raise failed
    if any(f.cancelled() for f in futures):  # (by someone else: that work was not done)
        raise CancelledError("a task was cancelled before it ran")


# ---- reading a version ---------------------------------------------------------------------------
class ShardSizeError(OSError):
    """A shard file whose size is not the manifest's: damage, or a size this mount shows
    from its attribute cache (a caching FUSE mount, NFS without close-to-open) while the
    writer already resized the file; the caller looks again before it says which."""


def _read_whole(fd: int, into: memoryview, offset: int) -> bool:
    """Fill ``into`` from ``fd`` at ``offset``, ``CHUNK_BYTES`` per read; False if the file
    ends first."""
    for start in range(0, len(into), CHUNK_BYTES):
        piece = into[start:start + CHUNK_BYTES]
        if os.preadv(fd, [piece], offset + start) != len(piece):
            return False
    return True


class ShardView:
    """The bytes of one shard, read-only to its users: either a private copy-on-write mapping
    of the file (``private_copy=False``: no copy; valid only while the slot is leased) or a
    private copy read with ``preadv`` (never faults, whatever a writer does to the file).

    The fd is closed on construction: a mapping keeps the file's pages, not a descriptor, so
    the open-file count does not grow with the number of shards held."""

    def __init__(self, fd: int, nbytes: int, private_copy: bool, needed: int | None = None):
        """``nbytes``: the file's size (checked); ``needed``: how many of its first bytes a
        private copy holds, or a mapping maps (default all: the rest, covered by no checked
        range, is never read)."""
        self.nbytes = nbytes
        self.private_copy = private_copy
        copied = nbytes if needed is None else min(max(needed, 0), nbytes)
        self._bytes: Any = None
        try:
            st = os.fstat(fd)
            size = st.st_size
            #: the file this view was read from: a later reopen must find the same file
            self.file_id = (st.st_dev, st.st_ino)
            if size != nbytes:
                raise ShardSizeError(f"has {size} bytes, expected {nbytes}")
            self._buf: Any = b""
            if copied and private_copy:
                try:
                    self._buf = bytearray(copied)
                except MemoryError:  # (this process's limit: no damage, said as such)
                    raise ResourceLimitError(
                        f"a private copy of {copied} bytes does not fit in this process's "
                        "memory (`ulimit -v`, or the host's); nothing is known to be damaged. "
                        "Readers without a lease copy each shard: give this receiver write "
                        "access to the store's readers/ so it can lease and map instead, or "
                        "raise the limit", errno.ENOMEM) from None
                if not _read_whole(fd, memoryview(self._buf), 0):
                    raise OSError("shrank while being read")
            elif copied and not private_copy:  # (only what checked ranges cover: a
                # hostile index's 1 TB sparse shard maps as much as its tensors use)
                self._buf = mmap.mmap(fd, copied, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)

    def read_again(self, fd: int, offset: int, nbytes: int) -> bool:
        """Read bytes [offset, offset + nbytes) of a private copy again from ``fd`` (the
        same file, after a caching mount's stale pages of them were dropped); False if the
        file ends before them. A mapping needs nothing: it reads the file's pages itself."""
        if not self.private_copy:
            return True
        return _read_whole(fd, memoryview(self._buf)[offset:offset + nbytes], offset)

    def view(self) -> memoryview:
        """The whole shard as bytes (valid while this view is open)."""
        return memoryview(self._buf)

    def address(self) -> int:
        """The address of the shard's first byte in memory (valid while this view is open)."""
        return self._whole().data_ptr() if len(self._buf) else 0

    def _whole(self) -> Any:
        if self._bytes is None:  # one tensor over the whole shard; each tensor is a slice
            import torch

            with warnings.catch_warnings():  # read-only buffers: the copy-on-write mapping
                warnings.simplefilter("ignore", UserWarning)  # or the private copy is ours
                self._bytes = torch.frombuffer(self._buf, dtype=torch.uint8)
        return self._bytes

    def tensor(self, dtype: Any, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
        import torch

        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self._whole()[offset:offset + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        """Drop this view's references. The mapping is never unmapped here: tensors handed
        out may still point into it (a consumer that defers copies, like vLLM's layerwise
        reload of a padded embedding, reads them later), and torch does not pin the buffer;
        it is unmapped when the last tensor built on it is freed. This view's own reference
        is dropped in another thread (``unmapping``): unmapping takes milliseconds."""
        buf, self._buf = self._buf, b""
        self._bytes = None
        if len(buf):
            unmapping.drop_later(buf)
