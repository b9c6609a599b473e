"""Hand Python's GIL over more often while one thread works through tens of thousands of
tensors and others hash or copy.

A verified load checks its destinations on the calling thread (calls that hold the GIL) while
worker threads hash the version (xxh3 releases the GIL, but each worker takes it back between
two checked ranges). A thread waiting for the GIL gets it only after the switch interval, 5 ms
by default: the hashing workers then wait in turn behind the check. Measured on a 32-core host,
256 MiB as 20,000 tensors: hashing done 19-20 ms into the load with the default interval, 16 ms
(together with the check) at 0.1 ms.

The copy that follows bumps the destinations' autograd versions on the calling thread while
worker threads read (each needs the GIL between two reads). A thread starts waiting with the
interval in force when it starts: the interval must be short before the first read is queued,
or the readers wait out the whole bump (~3.5 ms at 20,000 tensors, cold caches).

Hazards: a thread already waiting keeps the interval it started with. The interval is
process-wide (see ``processwide``): other Python threads switch more often during the block (a
few tens of milliseconds per load).
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager

from .processwide import CountedSetting

#: seconds between GIL hand-overs inside ``fast_switching``
FAST_INTERVAL = 0.0001


def _shorten() -> None:
    sys.setswitchinterval(min(sys.getswitchinterval(), FAST_INTERVAL))


_FAST = CountedSetting(sys.getswitchinterval, _shorten, sys.setswitchinterval)


def fast_switching() -> AbstractContextManager[None]:
    """Shorten the GIL switch interval for the block (nested and concurrent blocks share one;
    the last to leave restores the interval found by the first; a child forked during a block
    gets the interval back at once)."""
    return _FAST.held()
