"""Pause Python's cyclic garbage collector while dbsync handles tens of thousands of tensors.

A push or load of an MoE checkpoint creates a few objects per tensor (byte views, index
columns, copy plans) that live only for that call. While they live, the allocations trigger
collections that traverse every object of the process (torch alone keeps hundreds of
thousands): measured on a 2-core VM, 256 MiB as 20,000 tensors, a push took 0.34 s with the
collector running and 0.25 s with it paused. Reference counting still frees everything; only
the cycle detector waits until the call returns.

Hazard: the pause is process-wide. Code in other threads that allocates many cyclic objects
meanwhile collects them only after the pause; a thread that calls ``gc.enable()`` or
``gc.disable()`` during a pause may have its setting undone when the pause ends.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager

from .processwide import CountedSetting


def _restore(was_enabled: bool) -> None:
    if was_enabled:
        gc.enable()


_PAUSE = CountedSetting(gc.isenabled, gc.disable, _restore)


def paused() -> AbstractContextManager[None]:
    """Disable the collector for the block (nested and concurrent pauses share one; a child
    forked during a pause gets its collector back at once)."""
    return _PAUSE.held()
