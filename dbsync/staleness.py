"""Bounded staleness (``Sender(max_lag=K)``): before a push, wait while a live receiver
that reports its loads is more than K versions behind the current version.

Not waited for (each said once at WARNING): a receiver of another store format, which cannot
read this one, and one that refused the newest version, which loads the next one that fits.

Hazards: a receiver of the pushing process that the pushing thread itself loads (a reference
model of the training loop) can never catch up while that thread waits here:
``StalenessError`` at once. Without ``timeout`` a receiver that stays behind (alive but stuck)
holds the trainer up for as long as it lives, said at WARNING after
``SLOW_HOLDER_WARN_S`` seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from .errors import StalenessError
from .format import FORMAT_VERSION
from .leases import SLOW_HOLDER_WARN_S, LeaseMonitor, loaded_by_thread, of_this_process
from .status import loaded_versions, printable, refusal_of

log = logging.getLogger(__name__)


def wait_for_lag(leases: LeaseMonitor, version: int, max_lag: int | float | None,
                 timeout: float | None, abort: threading.Event, waiter: int | None,
                 stopped: type[BaseException]) -> float:
    """Return the seconds waited until no live receiver is more than ``max_lag`` versions
    behind ``version`` (0 at once for ``max_lag`` None or before the first version).

    ``waiter``: the pushing thread's id for a blocking push (None for a background one).
    Raises ``StalenessError`` after ``timeout`` seconds (None: no limit), or at once for a
    receiver only ``waiter`` could catch up; ``stopped(...)`` once ``abort`` is set. Polls
    the leases at 50 per second at first, then every 0.25 s."""
    if max_lag is None or version == 0:
        return 0.0
    start = time.monotonic()
    interval = 0.02
    told = False
    excused: set[str] = set()
    while True:
        live, _ = leases.scan()
        loaded = loaded_versions(live)
        behind = {r: version - v for r, v in loaded.items()
                  if version - v > max_lag}
        # Not waited for: a receiver of another store format (it cannot read this one),
        # and one that refused the newest version (it cannot catch up until a newer one,
        # this one maybe a fix, is published). Each said once.
        for r in list(behind):
            lease = live.get(r) or {}
            reads, refused = lease.get("reads_format"), refusal_of(lease)
            if isinstance(reads, int) and reads != FORMAT_VERSION:
                why = (f"which reads store format {reads} (this store is format "
                       f"{FORMAT_VERSION}): upgrade dbsync on its host")
            elif refused is not None and refused.version >= version > loaded[r]:
                why = (f"which refused version {refused.version} "
                       f"({printable(refused.reason[:300])}); it loads the next version "
                       "that fits")
            else:
                continue
            del behind[r]
            if r not in excused:
                excused.add(r)
                log.warning("max_lag=%d: not waiting for receiver %s, %s", max_lag,
                            printable(r), why)
        if not behind:
            return time.monotonic() - start
        # A receiver of this process (a reference model the training loop loads) that the
        # pushing thread itself loads cannot catch up while that thread waits here.
        here = sorted(r for r in behind if of_this_process(live.get(r) or {}))
        for r in here:
            if waiter is not None and loaded_by_thread(leases.store, r, waiter):
                raise StalenessError(
                    f"max_lag={max_lag}: receiver {printable(r)} of this process is "
                    f"{behind[r]} versions behind version {version} and was last "
                    "loaded by this thread, which this push blocks: it cannot catch up. Load "
                    "it before pushing, or create it with `report_loaded=False` (a reference "
                    "model the trainer loads itself is not an engine to wait for); nothing "
                    "was published")
        waited = time.monotonic() - start
        if here and not told and waited > 1.0:
            log.warning("the push waits for receiver(s) %s of this process (pid %d) to "
                        "catch up (max_lag=%d): a reference model loaded by the trainer? "
                        "Create it with `report_loaded=False` to keep it out of max_lag",
                        ", ".join(map(printable, here)), os.getpid(), max_lag)
            told = True
        if timeout is not None and waited >= timeout:
            listing = ", ".join(f"{r} ({n} behind)" for r, n in sorted(behind.items()))
            raise StalenessError(
                f"max_lag={max_lag}: after {waited:.1f} s, receiver(s) {listing} are "
                f"still more than {max_lag} version(s) behind version {version};"
                f" nothing was published. See `dbsync status {leases.store.root}`"
            )
        if not told and waited > SLOW_HOLDER_WARN_S:
            log.warning("the push has waited %.0f s for receiver(s) %s to catch up "
                        "(max_lag=%d); see `dbsync status %s`", waited,
                        ", ".join(sorted(behind)), max_lag, leases.store.root)
            told = True
        if abort.wait(interval):
            raise stopped("push interrupted while waiting for receivers to catch up; "
                           "nothing was published")
        interval = min(interval * 1.5, 0.25)
