"""One epoch's process group: created directly from a key-value store (never through
``torch.distributed.init_process_group``, so a trainer's own default group is untouched), used
only for rank-0-rooted broadcasts, each waited on by the host with a timeout.

Hazards, stated plainly:
- Every wait is bounded by ``timeout`` (``setup_timeout`` while the group forms). After a
  timeout or error the group is unusable: it is closed (communicator aborted) and a new epoch
  must form.
- Waits poll the work's completion on the host; no CUDA stream is ever made to wait on a
  broadcast. A stuck NCCL kernel therefore cannot stall the caller's own stream; it only
  occupies NCCL's stream until ``close()`` aborts the communicator. (A device-wide
  ``torch.cuda.synchronize()`` still waits for it: the abort is what ends it.)
- NCCL: by default PyTorch's NCCL watchdog tears down the whole *process* when a collective
  times out. We create our communicators with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` and
  ``TORCH_NCCL_BLOCKING_WAIT=0`` (set only while constructing, then restored) so a dead
  receiver costs the trainer a timeout, not its life, and every host wait is our own.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore

from ..errors import first_line
from .errors import BroadcastError, BroadcastTimeoutError

_ENV_LOCK = threading.Lock()
SPIN_SECONDS = 0.002  # poll without sleeping this long, then sleep briefly between polls
CANCEL_CHECK_SECONDS = 0.005


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
        self._opts: tuple[float, BroadcastOptions] | None = None  # built once per timeout

    @classmethod
    def create(cls, store: Any, epoch_prefix: str, rank: int, size: int, backend: str,
               device: torch.device, timeout: float, address: str,
               setup_timeout: float | None = None) -> Group:
        """Create the group and run one tiny broadcast, so that the first real broadcast pays
        no connection setup. Blocks until every rank did the same, at most
        ``setup_timeout`` (default ``timeout``)."""
        setup = timeout if setup_timeout is None else setup_timeout
        delta = datetime.timedelta(seconds=setup)
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
        group = cls(pg, backend, rank, size, device, setup)
        try:
            probe = torch.zeros(1, dtype=torch.uint8, device=device)
            group.wait(group.broadcast(probe), "the group's first broadcast")
        except BaseException:
            group.close()
            raise
        group.timeout = timeout
        return group

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 into ``tensor`` (sent from it on rank 0)."""
        if self.closed:
            raise BroadcastError("this broadcast group is closed; a new epoch must form")
        if self._opts is None or self._opts[0] != self.timeout:
            opts = BroadcastOptions()
            opts.rootRank = 0
            opts.rootTensor = 0
            opts.timeout = datetime.timedelta(seconds=self.timeout)
            self._opts = (self.timeout, opts)
        opts = self._opts[1]
        try:
            return self.pg.broadcast([tensor], opts)
        except Exception as exc:
            self.close()
            raise _wrap(exc, "could not start a broadcast") from exc

    def wait(self, work: Any, what: str = "a broadcast", timeout: float | None = None,
             cancelled: Callable[[], str | None] | None = None) -> None:
        """Block the host until ``work`` completed, at most ``timeout`` (default the group's)
        seconds. ``cancelled()``, polled every ``CANCEL_CHECK_SECONDS`` once that long has
        passed (a key-value store round trip each), may return a reason to give up. Any
        failure closes the group and raises ``BroadcastError``."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        next_check = start + CANCEL_CHECK_SECONDS
        try:
            while not work.is_completed():
                now = time.monotonic()
                if now - start > limit:
                    raise BroadcastTimeoutError(
                        f"{what} did not complete within {limit:.1f} s (a peer died or stopped "
                        "receiving; raise timeout= if the link is just slow)")
                if cancelled is not None and now >= next_check:
                    next_check = now + CANCEL_CHECK_SECONDS
                    reason = cancelled()
                    if reason is not None:
                        raise BroadcastError(f"{what}: {reason}")
                # (a yield at first; then sleeps of about 1% of the time waited so far, at most
                # 2 ms: a push stalled on a dead peer waits out its timeout nearly idle, and a
                # late completion is noticed at most ~1% later)
                waited = now - start
                time.sleep(0 if waited < SPIN_SECONDS else min(max(waited * 0.01, 0.0001),
                                                               0.002))
            work.wait()  # completed: raises the collective's own error, if any
        except BroadcastError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise _wrap(exc, f"{what} failed after {time.monotonic() - start:.1f} s") from exc
        except BaseException:  # Ctrl-C mid-collective: no peer may go on with this stream
            self.close()
            raise

    def close(self) -> None:
        """Abort the communicator (unblocks peers still waiting on it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        pg, self.pg = self.pg, None
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
    # NCCL's kernels get the SMs first: a copy or checksum kernel launched at the same moment
    # (packing the next bucket) must not delay the start of the next broadcast
    opts.is_high_priority_stream = True
    # Set only while constructing (read then): no watchdog teardown of the process, and no
    # blocking waits (every host wait here is our own, bounded and cancellable)
    forced = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "0"}
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in forced}
        os.environ.update(forced)
        try:
            with torch.cuda.device(device):
                pg = ProcessGroupNCCL(store, rank, size, opts)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return pg


def _wrap(exc: BaseException, what: str) -> BroadcastError:
    text = first_line(exc)
    timed_out = "timed out" in text.lower() or "timeout" in text.lower() or isinstance(
        exc, dist.DistStoreError | TimeoutError)
    cls = BroadcastTimeoutError if timed_out else BroadcastError
    hint = ("raise timeout= if the link is slow" if timed_out
            else "a peer probably died; a new epoch forms on the next push")
    return cls(f"{what}: {text} ({hint}; the filesystem still has every version)")
