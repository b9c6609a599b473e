"""Raw file work: parallel buffered writes into preallocated files, fsync, checksums, and
read-only mappings for loading.

Hazards, stated plainly:
- Writes go through ``os.pwrite`` (large buffered writes), never through mmap page faults:
  on NFS a faulting mmap write turns into one 4 KiB RPC per page.
- Files are reused in place when their size is unchanged. That is only safe because the store
  never writes into a slot that the manifest points to or that a live reader leases.
- Every error raised in a worker thread is re-raised in the caller; none is swallowed.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

CHUNK_BYTES = 64 * 2**20
#: Tensors packed into one host or bucket buffer start at multiples of this (any dtype's view).
ALIGN = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy). Works for 0-d, empty, bf16, fp8."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def checksum(data: memoryview | bytes | mmap.mmap) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, durable: bool = True, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same directory, flush,
    fsync, ``os.replace``, fsync the directory (unless ``sync_dir=False``: the caller then
    fsyncs it once after several replaces). The temp file is removed on any failure."""
    directory = os.path.dirname(path) or "."
    unique = f"{os.getpid()}-{os.urandom(4).hex()}"
    tmp = os.path.join(directory, f".tmp-{os.path.basename(path)}-{unique}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = ""
        if durable and sync_dir:
            fsync_dir(directory)
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


@dataclass
class FileWrite:
    path: str
    data: memoryview


def _open_preallocated(path: str, size: int) -> int:
    """Open ``path`` for writing without truncating; resize and preallocate only if the size
    changed (reusing the file keeps its blocks, which is much faster than truncate+rewrite)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:  # not supported here (some FUSE/NFS): sparse file is still correct
                    pass
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def write_files(
    writes: Sequence[FileWrite],
    pool: ThreadPoolExecutor,
    durable: bool,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write every file in parallel, checksum each, fsync each when ``durable`` (right after
    its own last write, so fsyncs overlap other files' writes). Returns the checksums in
    order. Raises the first worker error after all workers have stopped; files may then be
    partly written (the caller must not publish)."""
    fds: list[int] = []
    try:
        for w in writes:
            fds.append(_open_preallocated(w.path, len(w.data)))
        # Largest files first, so the tail of the schedule is made of small ones.
        order = sorted(range(len(writes)), key=lambda i: -len(writes[i].data))
        futures: dict[int, Future[str]] = {
            i: pool.submit(_write_file, fds[i], writes[i].data, durable, progress) for i in order
        }
        _wait_all(list(futures.values()))
        return [futures[i].result() for i in range(len(writes))]
    finally:
        for fd in fds:
            os.close(fd)


def _write_file(fd: int, data: memoryview, durable: bool,
                progress: Callable[[int], None] | None) -> str:
    """pwrite, then checksum the source while the kernel writes back, then fsync."""
    for offset in range(0, len(data), CHUNK_BYTES):
        piece = data[offset : offset + CHUNK_BYTES]
        _pwrite_all(fd, piece, offset)
        if progress is not None:
            progress(len(piece))
    digest = checksum(data)
    if durable:
        os.fsync(fd)
    return digest


def _wait_all(futures: Sequence[Future]) -> None:
    """Wait for every future, then raise the first error (never leave a thread running
    against a file we are about to close, never drop an error)."""
    first: BaseException | None = None
    for f in futures:
        exc = f.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None:
        raise first


class MappedFile:
    """A read-only view of one tensor file, opened afresh (NFS close-to-open: a new open per
    version revalidates the file; never reuse an old mapping of a rewritten file).

    The mapping is private copy-on-write, so a consumer writing into a yielded tensor never
    touches the file. Tensors built on it stay valid only while the slot is leased."""

    def __init__(self, path: str, nbytes: int):
        self.path = path
        self.nbytes = nbytes
        self._mm: mmap.mmap | None = None
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != nbytes:
                raise OSError(f"{path} has {size} bytes, expected {nbytes}")
            if nbytes:
                self._mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)

    def checksum(self) -> str:
        return checksum(self._mm if self._mm is not None else b"")

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if self._mm is None:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)
