"""What the kernel says of a process of this PID namespace (``/proc/<pid>/stat``), for the
writer's lease checks and its messages about a lock's holder. Imports nothing of dbsync."""

from __future__ import annotations

import functools
import os
import socket
from typing import Any


def process_state(pid: int | str) -> bytes | None:
    """The one-letter state of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie ...),
    or None where it cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) S ...": the state follows the last ")" (a command name may hold one)
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] or None


def process_start(pid: int | str) -> int | None:
    """When process ``pid`` started, in clock ticks since the boot (``/proc/PID/stat`` field
    22), or None where it cannot be read: with the pid, it tells a process from a later one
    given the same pid (a restarted container whose PID namespace reuses the dead one's
    numbers)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def host_identity() -> dict[str, Any]:
    """Who this process is, as far as pid checks go: hostname, boot id, PID namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = None
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "boot_id": boot_id, "pidns": pidns}


@functools.cache
def own_start() -> int | None:
    """When this process started (``process_start``), for its leases and lock records."""
    return process_start("self")
