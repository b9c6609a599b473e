"""Drop a shard's mapping or private copy in a thread of its own, off the caller's time.

Unmapping a shard returns each of its pages: measured on a lent 16-core host (ext4, kernel
6.18), 256 MiB whose page cache was filled by reads took 2-4 ms to unmap, against 0.1-0.9 ms
when the local writer's large writes filled it (the pages come in bigger pieces). Receivers on
shared filesystems read every shard, so the cost grows with the model, and it fell on every
load as the snapshot closed. A private copy (a reader without a lease) is freed the same way.

Hazards, stated plainly:
- The memory stays mapped (or allocated) until the thread gets to it, a few milliseconds after
  ``drop_later``: a process loading in a tight loop holds up to one more version's mappings
  meanwhile. ``dropped`` waits until everything handed over before it is gone.
- The thread is a daemon that sleeps on a queue: it costs nothing while idle. A forked child
  starts its own on first use; what its parent had queued but not yet dropped at the fork
  stays in the child's memory (copy-on-write pages of the parent's) until the child exits.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

_LOCK = threading.Lock()
_QUEUE: list[Any] = [None, 0]  # [the queue, the pid that started its thread]


def drop_later(buffer: Any) -> None:
    """Hand over a reference to ``buffer`` (an ``mmap`` or a ``bytearray``), to be dropped in
    the dropping thread. The caller must hold no other reference it means to drop itself: the
    point is that the last one goes away there. (Where no thread can be started, at a
    process's thread limit, it is dropped when the caller lets go of it, as before.)"""
    items = _queue()
    if items is not None:
        items.put(buffer)


def dropped(timeout: float | None = None) -> bool:
    """Wait until everything handed to ``drop_later`` before this call has been dropped;
    False if ``timeout`` seconds passed first."""
    items = _queue()
    if items is None:
        return True  # (no dropping thread: nothing was handed over)
    done = threading.Event()
    items.put(done)
    return done.wait(timeout)


def _queue() -> queue.SimpleQueue | None:
    """The dropping thread's queue, starting the thread on first use; None when no thread can
    be started (the process's thread limit)."""
    with _LOCK:
        if _QUEUE[0] is None or _QUEUE[1] != os.getpid():
            items: queue.SimpleQueue = queue.SimpleQueue()
            try:
                threading.Thread(target=_drop_forever, args=(items,), name="dbsync-unmap",
                                 daemon=True).start()
            except RuntimeError:  # can't start new thread: the caller drops it itself
                return None
            _QUEUE[:] = [items, os.getpid()]
        return _QUEUE[0]


def _reset_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # (a fork while another thread held it would leave it held)
    _QUEUE[:] = [None, 0]


os.register_at_fork(after_in_child=_reset_in_child)


def _drop_forever(items: queue.SimpleQueue) -> None:
    while True:
        item = items.get()
        if isinstance(item, threading.Event):
            item.set()
        del item  # (the last reference: unmapped or freed here)
