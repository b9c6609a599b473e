"""Hand Python's GIL over more often while one thread checks tens of thousands of tensors and
others hash.

A verified load checks its destinations on the calling thread (calls that hold the GIL) while
worker threads hash the version (xxh3 releases the GIL, but each worker takes it back between
two checked ranges). A thread waiting for the GIL gets it only after the switch interval, 5 ms
by default: the hashing workers then wait in turn behind the check. Measured on a 32-core host,
256 MiB as 20,000 tensors: hashing done 19-20 ms into the load with the default interval, 16 ms
(together with the check) at 0.1 ms.

Hazard: the interval is process-wide. Other Python threads switch more often during the block
(a few milliseconds per load); a thread that sets the interval itself during the block may
have its setting undone when the block ends.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: seconds between GIL hand-overs inside ``fast_switching``
FAST_INTERVAL = 0.0001

_lock = threading.Lock()
_depth = 0
_was = 0.005


@contextmanager
def fast_switching() -> Iterator[None]:
    """Shorten the GIL switch interval for the block (nested and concurrent blocks share one;
    the last to leave restores the interval found by the first)."""
    global _depth, _was
    entered = False
    try:
        with _lock:
            if _depth == 0:
                _was = sys.getswitchinterval()
                sys.setswitchinterval(min(_was, FAST_INTERVAL))
            _depth += 1
            entered = True
        yield
    finally:
        if entered:
            with _lock:
                _depth = max(0, _depth - 1)
                if _depth == 0:
                    sys.setswitchinterval(_was)
