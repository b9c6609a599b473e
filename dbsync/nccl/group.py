"""One epoch's process group: created directly from a key-value store (never through
``torch.distributed.init_process_group``, so a trainer's own default group is untouched), used
only for rank-0-rooted broadcasts, each waited on with a timeout.

Hazards, stated plainly:
- Every wait is bounded by ``timeout``. After a timeout or error the group is unusable; call
  ``close()`` (it aborts the communicator) and form a new epoch.
- NCCL: by default PyTorch's NCCL watchdog tears down the whole *process* when a collective
  times out. We create our communicators with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (set only
  while constructing, then restored) so a dead receiver costs the trainer a timeout, not its
  life; our own waits enforce the timeout and ``close()`` aborts the communicator.
- NCCL: waits are stream-ordered (the host does not block per bucket, so the next bucket is
  queued while the current one moves). A monitor thread enforces the timeout instead: when the
  oldest outstanding broadcast makes no progress for ``timeout`` seconds it aborts the
  communicator, which also unblocks any host code synchronizing on the stream. ``finish()``
  blocks the host until every outstanding broadcast is done (or raises).
- NCCL: after an abort, kernels queued on the group's stream are cancelled. Do not reuse buffers
  of a failed broadcast before ``close()`` returns.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore

from .errors import BroadcastError, BroadcastTimeoutError

_ENV_LOCK = threading.Lock()


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise BroadcastError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise BroadcastError("backend 'nccl' needs a CUDA device; pass device='cuda:N' or use "
                             "backend='gloo' for CPU tensors")
    if backend == "gloo" and device.type != "cpu":
        raise BroadcastError("backend 'gloo' here moves CPU tensors; pass device='cpu' (or use "
                             "backend='nccl' on GPUs)")
    return backend


class Group:
    """A broadcast group of ``size`` ranks; rank 0 is the sender."""

    def __init__(self, pg: Any, backend: str, rank: int, size: int, device: torch.device,
                 timeout: float):
        self.pg = pg
        self.backend = backend
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = timeout
        self.closed = False
        self.failure: str | None = None
        self._outstanding: deque[Any] = deque()
        self._progress_at = time.monotonic()
        self._cv = threading.Condition()
        self._monitor: threading.Thread | None = None
        if backend == "nccl":
            self._monitor = threading.Thread(target=self._watch, name="dbsync-bcast-monitor",
                                             daemon=True)
            self._monitor.start()

    @classmethod
    def create(cls, store: Any, epoch_prefix: str, rank: int, size: int, backend: str,
               device: torch.device, timeout: float, address: str) -> Group:
        """Create the group and run one tiny broadcast, so that the first real broadcast pays
        no connection setup. Blocks until every rank did the same, at most ``timeout``."""
        delta = datetime.timedelta(seconds=timeout)
        prefixed = PrefixStore(epoch_prefix, store)
        try:
            if backend == "gloo":
                from torch._C._distributed_c10d import ProcessGroupGloo

                opts = ProcessGroupGloo._Options()
                opts._timeout = delta
                opts._devices = [ProcessGroupGloo.create_device(hostname=address)]
                pg = ProcessGroupGloo(prefixed, rank, size, opts)
            else:
                pg = _create_nccl(prefixed, rank, size, device, delta)
        except Exception as exc:
            raise _wrap(exc, f"could not create the {backend} group of {size} ranks") from exc
        group = cls(pg, backend, rank, size, device, timeout)
        try:
            probe = torch.zeros(1, dtype=torch.uint8, device=device)
            group.wait(group.broadcast(probe), "the group's first broadcast")
            group.finish("the group's first broadcast")
        except BaseException:
            group.close()
            raise
        return group

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 into ``tensor`` (sent from it on rank 0)."""
        if self.closed:
            raise BroadcastError("this broadcast group is closed; a new epoch must form")
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout)
        try:
            work = self.pg.broadcast([tensor], opts)
        except Exception as exc:
            raise _wrap(exc, "could not start a broadcast") from exc
        if self._monitor is not None:
            with self._cv:
                if not self._outstanding:
                    self._progress_at = time.monotonic()
                self._outstanding.append(work)
                self._cv.notify()
        return work

    def wait(self, work: Any, what: str = "a broadcast") -> None:
        """Order later work after ``work``. gloo: blocks the host, at most ``timeout`` seconds.
        NCCL: makes the current CUDA stream wait (the host goes on; the monitor bounds it)."""
        if self._monitor is not None:
            self._raise_if_failed(what)
            try:
                work.wait()
            except Exception as exc:
                raise _wrap(exc, f"{what} failed") from exc
            return
        t0 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as exc:
            raise _wrap(exc, f"{what} failed after {time.monotonic() - t0:.1f} s") from exc

    def finish(self, what: str = "a broadcast") -> None:
        """Block the host until every outstanding broadcast completed (NCCL), or raise."""
        if self._monitor is None:
            return
        pause = 0.00005
        while True:
            self._raise_if_failed(what)
            with self._cv:
                while self._outstanding and self._outstanding[0].is_completed():
                    self._outstanding.popleft()
                    self._progress_at = time.monotonic()
                if not self._outstanding:
                    return
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _raise_if_failed(self, what: str) -> None:
        if self.failure is not None:
            raise BroadcastTimeoutError(f"{what}: {self.failure}")
        if self.closed:
            raise BroadcastError(f"{what}: the group was closed; a new epoch must form")

    def _watch(self) -> None:
        """Abort the communicator when the oldest outstanding broadcast stalls > timeout."""
        while not self.closed:
            with self._cv:
                while self._outstanding and self._outstanding[0].is_completed():
                    self._outstanding.popleft()
                    self._progress_at = time.monotonic()
                if not self._outstanding:
                    self._cv.wait(0.5)
                    continue
                stalled = time.monotonic() - self._progress_at
            if stalled > self.timeout:
                self.failure = (f"no progress for {stalled:.1f} s (timeout {self.timeout:.1f} s;"
                                " a peer died or stopped receiving); communicator aborted")
                self._abort()
                return
            time.sleep(0.002)

    def close(self) -> None:
        """Abort the communicator (unblocks peers still waiting on it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        with self._cv:
            self._cv.notify_all()
        self._abort()
        self.pg = None

    def _abort(self) -> None:
        pg = self.pg
        if pg is None:
            return
        for method in ("abort", "shutdown"):
            fn = getattr(pg, method, None)
            if fn is None:
                continue
            try:
                fn()
                break
            except Exception:  # noqa: BLE001 - best effort on a broken group
                continue


def _create_nccl(store: Any, rank: int, size: int, device: torch.device,
                 timeout: datetime.timedelta) -> Any:
    from torch._C._distributed_c10d import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    with _ENV_LOCK:
        saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        try:
            with torch.cuda.device(device):
                pg = ProcessGroupNCCL(store, rank, size, opts)
        finally:
            if saved is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    return pg


def _wrap(exc: BaseException, what: str) -> BroadcastError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower() or isinstance(
        exc, dist.DistStoreError | TimeoutError)
    cls = BroadcastTimeoutError if timed_out else BroadcastError
    hint = ("raise timeout= if the link is slow" if timed_out
            else "a peer probably died; a new epoch forms on the next push")
    return cls(f"{what}: {text} ({hint}; the filesystem still has every version)")
