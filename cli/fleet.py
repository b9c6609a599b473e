"""The fleet view of ``dbsync status``: one row per receiver with its state.

States (for display only; the writer decides liveness on its own monotonic clock, see
``dbsync.leases``):

- ``dead``: its process is gone (a receiver on this host whose pid no longer exists), or its
  lease was not updated for longer than the lease's own ``lease_timeout`` (30 s when the
  record has none), judged by this host's wall clock;
- ``refused``: alive, and its last refusal (the lease's ``refused`` record) is of a version
  newer than the one it serves; ``reason`` says why;
- ``live``: alive and serving (or reading) a version;
- ``idle``: alive, registered, nothing loaded yet.

Hazard: wall clocks of different hosts may disagree; a receiver whose clock runs behind
this host's by more than its lease timeout shows as dead. A receiver on this host is judged
by its pid first, so local receivers whose lease is not refreshed while idle stay alive.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

DEFAULT_LEASE_TIMEOUT = 30.0
STATES = ("live", "idle", "refused", "dead")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def classify(lease: dict[str, Any], now: float | None = None,
             local_host: str | None = None) -> tuple[str, str | None]:
    """(state, reason) of one lease record, as described in the module docstring."""
    now = time.time() if now is None else now
    local_host = socket.gethostname() if local_host is None else local_host
    timeout = _number(lease.get("lease_timeout"))
    timeout = DEFAULT_LEASE_TIMEOUT if timeout is None or timeout <= 0 else timeout
    pid = lease.get("pid")
    local = lease.get("host") == local_host and isinstance(pid, int) and pid > 0
    updated = _number(lease.get("updated_at"))
    if local and not _pid_alive(pid):
        return "dead", f"process {pid} on this host is gone"
    if not local:
        if updated is None:
            return "dead", "its lease records no update time"
        if now - updated > timeout:
            return "dead", (f"lease not updated for {now - updated:.0f} s "
                            f"(its timeout is {timeout:g} s)")
    loaded = lease.get("loaded_version")
    loaded = loaded if isinstance(loaded, int) and not isinstance(loaded, bool) else None
    refused = lease.get("refused")
    if isinstance(refused, dict):
        version = refused.get("version")
        if isinstance(version, int) and (loaded is None or version > loaded):
            reason = refused.get("reason")
            return "refused", f"version {version}: {reason if reason else 'no reason given'}"
    if loaded is None and lease.get("state") != "reading":
        return "idle", None
    return "live", None


def fleet(receivers: list[dict[str, Any]], leases: dict[str, dict[str, Any]],
          now: float | None = None) -> list[dict[str, Any]]:
    """``receivers`` (from ``dbsync.status``) with ``state``/``reason`` classified from the
    raw ``leases`` and the lease's own ``lease_timeout``/``refused`` fields added; the lease's
    own state ("reading"/"idle") moves to ``lease_state``."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    out = []
    for record in receivers:
        lease = dict(leases.get(record["id"], {}))
        for key in ("host", "pid"):
            lease.setdefault(key, record.get(key))
        lease.setdefault("updated_at", record.get("last_seen"))
        lease.setdefault("loaded_version", record.get("version"))
        lease.setdefault("state", record.get("state"))
        state, reason = classify(lease, now, host)
        refused = lease.get("refused")
        out.append({
            **record,
            "lease_state": lease.get("state"),
            "state": state,
            "reason": reason,
            "lease_timeout": _number(lease.get("lease_timeout")),
            "refused": refused if isinstance(refused, dict) else None,
        })
    return out
