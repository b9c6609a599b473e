"""Tell systemd how a ``Type=notify`` service is doing (the ``sd_notify`` protocol): one
datagram to the socket ``$NOTIFY_SOCKET`` names, e.g. ``READY=1`` once ``serve-vllm`` serves.
Does nothing where that variable is unset (not under systemd, or another ``Type=``)."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send ``fields`` ("READY=1", "STATUS=...", "STOPPING=1") to systemd; True if sent.
    A failure is logged at WARNING and never raised: the unit's own start timeout then says
    the rest."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path  # (@: the abstract namespace)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except OSError as exc:
        log.warning("dbsync: could not tell systemd %s through NOTIFY_SOCKET=%s (%s)",
                    fields[0], path, exc)
        return False
    return True
