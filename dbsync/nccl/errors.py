"""Errors of the broadcast fast path. Each derives from ``dbsync.DBSyncError`` and says what to
do. None of them means data was lost: the filesystem always holds every published version."""

from __future__ import annotations

from ..errors import DBSyncError


class BroadcastError(DBSyncError):
    """The broadcast of one version failed (a peer died, the group broke, the bytes did not
    match the checksums). Receivers fall back to the filesystem on their own; the sender has
    already published the version there. Seen by callers only when the fallback failed too."""


class BroadcastTimeoutError(BroadcastError):
    """A collective or a rendezvous step did not finish within the configured ``timeout``.
    The group is dropped and a new epoch forms on a later push. If this repeats on a healthy
    cluster, raise ``timeout`` (large models on slow links need more than a few seconds)."""


class RendezvousError(BroadcastError):
    """``ROOT/broadcast.json`` or a record in the rendezvous store is missing or malformed.
    Restart the BroadcastSender (it rewrites the file), or delete the file to turn the fast
    path off: receivers then read from the filesystem alone."""
