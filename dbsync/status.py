"""What a store holds and who reads it: the data behind ``dbsync status`` and
``Sender.wait_for_receivers``."""

from __future__ import annotations

import time
from typing import Any

from .store import Store


def receivers(store: Store) -> list[dict[str, Any]]:
    """One record per registered receiver, with its lag (versions behind the current one)."""
    manifest = store.read_manifest()
    current = None if manifest is None else manifest.version
    out = []
    now = time.time()
    for reader_id, lease in sorted(store.read_leases().items()):
        loaded = lease.get("loaded_version")
        out.append({
            "id": reader_id,
            "host": lease.get("host"),
            "pid": lease.get("pid"),
            "state": lease.get("state"),
            "version": loaded,
            "lag": None if current is None or not isinstance(loaded, int) else current - loaded,
            "last_seen": lease.get("updated_at"),
            "seconds_since_seen": (now - lease["updated_at"])
            if isinstance(lease.get("updated_at"), int | float) else None,
        })
    return out


def receivers_at(store: Store, version: int) -> list[str]:
    """Ids of receivers that report ``version`` or newer loaded (reads only the leases)."""
    return sorted(reader_id for reader_id, lease in store.read_leases().items()
                  if isinstance(lease.get("loaded_version"), int)
                  and lease["loaded_version"] >= version)


def wait_for_receivers(store: Store, version: int, count: int, timeout: float | None = None,
                       interval: float = 0.1) -> bool:
    """Wait until at least ``count`` receivers report ``version`` (or newer) loaded. Returns
    False on timeout. Needs no writer lock: any process may wait."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(receivers_at(store, version)) < count:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def store_status(store: Store) -> dict[str, Any]:
    manifest = store.read_manifest()
    if manifest is None:
        return {"root": store.root, "version": None, "receivers": receivers(store)}
    return {
        "root": store.root,
        "version": manifest.version,
        "slot": manifest.slot,
        "tensors": len(manifest.tensors),
        "bytes": manifest.total_bytes,
        "published_at": manifest.created_at,
        "durable": manifest.durable,
        "writer": manifest.writer,
        "receivers": receivers(store),
    }
