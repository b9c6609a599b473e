"""Rendezvous through the shared directory itself: ``ROOT/broadcast.json`` says where and how to
join the sender's broadcast group, and a small TCP key-value store hosted by the sender carries
the join requests, the epoch's member list, per-push headers and acknowledgements.

    ROOT/broadcast.json    written atomically by the BroadcastSender (``write_atomic``):
                           sender id, address, port, backend, epoch, members, bucket size

Key-value store layout (all JSON text, never pickle):

    joins                  counter of join records
    join/<n>               {"reader_id", "action": "join" | "leave", "host", "pid"}
    epoch                  {"epoch", "members": [reader ids, rank = index + 1]}
    e<E>/ready/<id>        a member is about to create the process group of epoch E
    e<E>/pg/...            the process group's own rendezvous
    e<E>/push/<seq>        the header of one pushed version (see layout.py)
    e<E>/bell/<seq>/<id>   a member's doorbell: set by the sender right after announcing push
                           <seq> ("push"), or when epoch E ends ("epoch"), to wake the member
                           waiting on it; the member sets it itself ("moved") to end its wait
    e<E>/ack/<seq>/<id>    a member is ready to take push <seq>
    e<E>/go/<seq>          "abort": the sender gave up this push (read it from the filesystem)
    e<E>/published/<seq>   {"version", "manifest": digest} once the version is on the
                           filesystem (``manifest_digest``), or {"version", "error"}

Hazards: the file is advisory. The manifest (``dbsync.json``) alone says which version is
current; a stale ``broadcast.json`` (its sender died) only costs receivers a failed connect,
after which they read from the filesystem. Anyone who can write the store directory or reach
the port can join the group and receive the weights: run it on a trusted network only.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import fileio
from ..errors import FormatError
from ..format import MAX_RENDEZVOUS_BYTES
from ..store import Store
from .errors import RendezvousError

RENDEZVOUS_FILE = "broadcast.json"
RENDEZVOUS_FORMAT = "dbsync-broadcast"
RENDEZVOUS_VERSION = 2  # 2: members wait on doorbells instead of polling for pushes
BACKENDS = ("gloo", "nccl")

K_JOINS = "joins"
K_EPOCH = "epoch"


def join_key(n: int) -> str:
    return f"join/{n}"


def ready_key(epoch: int, reader_id: str) -> str:
    return f"e{epoch}/ready/{reader_id}"


def pg_prefix(epoch: int) -> str:
    return f"e{epoch}/pg/"


def push_key(epoch: int, seq: int) -> str:
    return f"e{epoch}/push/{seq}"


def bell_key(epoch: int, seq: int, reader_id: str) -> str:
    return f"e{epoch}/bell/{seq}/{reader_id}"


def ack_key(epoch: int, seq: int, reader_id: str) -> str:
    return f"e{epoch}/ack/{seq}/{reader_id}"


def go_key(epoch: int, seq: int) -> str:
    return f"e{epoch}/go/{seq}"


def published_key(epoch: int, seq: int) -> str:
    return f"e{epoch}/published/{seq}"


def manifest_digest(manifest: Any) -> str:
    """A digest of what a manifest promises: version, each tensor's name, dtype, shape, place
    and checked range, in order, and each range's place and xxh3 checksum. The sender confirms
    a broadcast version with the digest of the manifest it was published under; a member
    applies its broadcast copy only while the store's manifest has the same digest."""
    data = [manifest.version, [[t.name, t.dtype, list(t.shape), t.shard, t.offset, t.range]
                               for t in manifest.tensors], [list(r) for r in manifest.ranges]]
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class RendezvousRecord:
    """What ``ROOT/broadcast.json`` holds."""

    sender_id: str
    address: str
    port: int
    backend: str
    epoch: int
    members: tuple[str, ...]
    bucket_bytes: int
    timeout: float
    host: str = ""
    pid: int = 0
    updated_at: float = field(default_factory=time.time)

    @property
    def world_size(self) -> int:
        return len(self.members) + 1

    def dumps(self) -> bytes:
        data: dict[str, Any] = {"format": RENDEZVOUS_FORMAT, "format_version": RENDEZVOUS_VERSION}
        data.update(asdict(self))
        data["members"] = list(self.members)
        data["world_size"] = self.world_size
        return json.dumps(data, indent=1).encode()

    @classmethod
    def loads(cls, raw: bytes, source: str) -> RendezvousRecord:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise RendezvousError(f"{source} is not valid JSON ({exc}); restart the "
                                  "BroadcastSender or delete the file") from None
        if not isinstance(data, dict) or data.get("format") != RENDEZVOUS_FORMAT:
            raise RendezvousError(f"{source} is not a dbsync broadcast rendezvous file")
        found = data.get("format_version")
        if found != RENDEZVOUS_VERSION:
            older = isinstance(found, int) and not isinstance(found, bool) and (
                found < RENDEZVOUS_VERSION)
            raise RendezvousError(
                f"{source}: format_version {found!r} is not supported (this dbsync reads "
                f"{RENDEZVOUS_VERSION}); " + (
                    "the broadcast sender runs an older dbsync: upgrade it on the trainer's "
                    "host" if older else "upgrade dbsync on this host") +
                " (until then this receiver reads every version from the filesystem)")
        try:
            record = cls(
                sender_id=str(data["sender_id"]), address=str(data["address"]),
                port=int(data["port"]), backend=str(data["backend"]), epoch=int(data["epoch"]),
                members=tuple(str(m) for m in data["members"]),
                bucket_bytes=int(data["bucket_bytes"]), timeout=float(data["timeout"]),
                host=str(data.get("host", "")), pid=int(data.get("pid", 0)),
                updated_at=float(data.get("updated_at", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"{source} is missing or has a bad field ({exc!r}); restart "
                                  "the BroadcastSender") from None
        if record.backend not in BACKENDS or not 0 < record.port < 65536:
            raise RendezvousError(f"{source}: bad backend {record.backend!r} or port "
                                  f"{record.port}; restart the BroadcastSender")
        return record


def rendezvous_path(store: Store) -> str:
    return os.path.join(store.root, RENDEZVOUS_FILE)


def write_record(store: Store, record: RendezvousRecord) -> None:
    # Advisory and rewritten on every epoch: no fsync needed (a lost update only delays joins).
    fileio.write_atomic(rendezvous_path(store), record.dumps(), durable=False)


def read_record(store: Store) -> RendezvousRecord | None:
    """The current rendezvous record, or None when no BroadcastSender ever ran on this store.
    Anything else at that path (a FIFO, a directory, a link to a device, a huge or garbled
    file: the store is anyone's to write) is a ``RendezvousError``, read with the store's
    bounds and never blocking: its receivers then use the filesystem."""
    path = rendezvous_path(store)
    try:
        raw = store.read_small((RENDEZVOUS_FILE,), MAX_RENDEZVOUS_BYTES)
    except (FormatError, OSError) as exc:
        raise RendezvousError(f"{path} cannot be read as a rendezvous record ({exc}); restart "
                              "the BroadcastSender or delete the file") from None
    return None if raw is None else RendezvousRecord.loads(raw, path)


def remove_record(store: Store, sender_id: str) -> None:
    """Remove the file if it still names ``sender_id`` (a clean shutdown)."""
    try:
        record = read_record(store)
    except RendezvousError:
        return
    if record is not None and record.sender_id == sender_id:
        try:
            os.unlink(rendezvous_path(store))
        except FileNotFoundError:
            pass


def default_address() -> str:
    """This host's address as other hosts see it (``DBSYNC_BROADCAST_ADDRESS`` overrides)."""
    env = os.environ.get("DBSYNC_BROADCAST_ADDRESS")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def local_address_towards(peer: str) -> str:
    """The local address the kernel would use to reach ``peer`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
