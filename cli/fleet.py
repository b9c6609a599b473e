"""The fleet view of ``dbsync status``: why a receiver is in the state the library gives it.

States come from ``dbsync.status.state_of`` (live: reading a version now; idle: registered,
not reading; refused: its last refusal or failed apply is of a version newer than the one it
serves; dead: its process is gone, where its pid can be checked, or its lease was not
refreshed for twice its own lease timeout, by wall clock). This module only adds a line of
explanation per refused or dead receiver, for people.
"""

from __future__ import annotations

from typing import Any

from dbsync.format import FORMAT_VERSION
from dbsync.leases import DEFAULT_LEASE_TIMEOUT, lease_timeout_of
from dbsync.status import DEAD, REFUSED, STALE


def reason_of(record: dict[str, Any]) -> str | None:
    """Why ``record`` (one of ``dbsync.status.receivers``) is refused, stale or dead, or cannot read
    this store's format at all; else None."""
    reads = record.get("reads_format")
    if isinstance(reads, int) and reads != FORMAT_VERSION:
        return (f"it reads store format {reads}, this store is in format {FORMAT_VERSION}: "
                "upgrade dbsync on its host")
    if record.get("state") == REFUSED and isinstance(record.get("refused"), dict):
        refused = record["refused"]
        return f"version {refused.get('version')}: {refused.get('reason') or 'no reason given'}"
    timeout = lease_timeout_of(record, DEFAULT_LEASE_TIMEOUT)
    age = record.get("seconds_since_seen")
    if record.get("state") == STALE and isinstance(age, int | float):
        return (f"lease not renewed for {age:.0f} s, longer than its {timeout:g} s lease "
                "timeout: a writer waits at most one more lease timeout for it, then may reuse "
                "the slot it reads (a stopped, hung or starved process?)")
    if record.get("state") != DEAD:
        return None
    if isinstance(age, int | float) and age > 2 * timeout:
        return f"lease not refreshed for {age:.0f} s (twice its {timeout:g} s lease timeout)"
    return f"process {record.get('pid')} on {record.get('host')} is gone"


def with_reasons(receivers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``receivers`` with a ``reason`` field added to each record."""
    return [{**record, "reason": reason_of(record)} for record in receivers]
