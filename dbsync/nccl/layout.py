"""The byte layout of one broadcast version: a header (JSON, sent through the rendezvous store)
and a byte stream cut into fixed-size buckets.

The stream holds every tensor's raw bytes in manifest order, each starting at a multiple of
``ALIGN`` bytes (so a tensor lying wholly inside a bucket is handed out as a zero-copy view of
the bucket buffer, whatever its dtype). A tensor may span buckets; the receiver assembles it.
When the header names a checksum algorithm, each bucket travels sealed: its payload padded to
whole checksum rows, then the checksum (see ``checksum.py``).

Hazard: the header arrives over the network and is untrusted: ``Header.loads`` validates every
field (names, dtypes, shapes, sizes, checksum algorithm) before any buffer is sized from it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..fileio import ALIGN, aligned
from ..format import dtype_from_name, dtype_name, nbytes_of
from ..tensorstate import States
from . import checksum as _checksum
from .errors import BroadcastError

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # in the stream

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class Header:
    """Everything a receiver needs to size its buffers and name what it receives."""

    version: int
    epoch: int
    seq: int
    bucket_bytes: int
    entries: tuple[Entry, ...]
    #: the bucket checksum algorithm (``checksum.ALGORITHM``), or None: buckets unsealed
    checksum: str | None = None

    @property
    def total_bytes(self) -> int:
        """Length of the stream (aligned), i.e. the bytes the broadcast carries."""
        if not self.entries:
            return 0
        last = self.entries[-1]
        return last.offset + last.nbytes

    @property
    def has_checksums(self) -> bool:
        return self.checksum is not None

    def buckets(self) -> list[tuple[int, int]]:
        total = self.total_bytes
        return [(lo, min(lo + self.bucket_bytes, total))
                for lo in range(0, total, self.bucket_bytes)]

    def dumps(self, layout: bytes | None = None) -> bytes:
        """``{"version", "epoch", "seq"}`` JSON, a newline, then the layout JSON (tensors and
        bucket size), which stays byte-identical from push to push of the same model (pass it
        as ``layout`` when already known)."""
        meta = json.dumps({"version": self.version, "epoch": self.epoch, "seq": self.seq})
        return meta.encode() + b"\n" + (self.layout_bytes if layout is None else layout)

    def for_push(self, version: int, epoch: int, seq: int) -> Header:
        """This layout as the header of another push (the layout bytes are not rebuilt)."""
        header = dataclasses.replace(self, version=version, epoch=epoch, seq=seq)
        if "layout_bytes" in self.__dict__:
            header.__dict__["layout_bytes"] = self.__dict__["layout_bytes"]
        return header

    @functools.cached_property
    def layout_bytes(self) -> bytes:
        return json.dumps({
            "bucket_bytes": self.bucket_bytes, "checksum": self.checksum,
            "tensors": [[e.name, e.dtype, list(e.shape)] for e in self.entries],
        }, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, raw: bytes, cache: dict[str, Any] | None = None) -> Header:
        """Parse and validate a header. ``cache`` (any dict kept between calls) skips parsing
        a layout identical to the previous one."""
        meta_raw, _, layout_raw = raw.partition(b"\n")
        try:
            meta = json.loads(meta_raw.decode("utf-8"))
            version, epoch, seq = int(meta["version"]), int(meta["epoch"]), int(meta["seq"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise BroadcastError(f"received a malformed broadcast header ({exc}); the sender "
                                 "runs an incompatible dbsync: upgrade both sides") from None
        if cache is not None and cache.get("raw") == layout_raw:
            base = cache["header"]
        else:
            base = cls._loads_layout(layout_raw)
            if cache is not None:
                cache.update(raw=layout_raw, header=base)
        return base.for_push(version, epoch, seq)

    @classmethod
    def _loads_layout(cls, raw: bytes) -> Header:
        try:
            data = json.loads(raw.decode("utf-8"))
            bucket_bytes = int(data["bucket_bytes"])
            tensors = data["tensors"]
            algorithm = data["checksum"]
            if not isinstance(tensors, list) or bucket_bytes <= 0 or bucket_bytes % ALIGN:
                raise ValueError("bad tensors list or bucket size")
            if algorithm not in (None, _checksum.ALGORITHM):
                raise ValueError(f"unknown bucket checksum {algorithm!r}")
            specs = []
            for item in tensors:
                name, dt, shape = item
                if not isinstance(name, str) or not name:
                    raise ValueError(f"bad tensor name {name!r}")
                if not isinstance(shape, list) or not all(
                        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                    raise ValueError(f"bad shape for {name!r}")
                specs.append((name, dtype_from_name(dt), tuple(shape)))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise BroadcastError(f"received a malformed broadcast header ({exc}); the sender "
                                 "runs an incompatible dbsync: upgrade both sides") from None
        except Exception as exc:  # dtype_from_name raises FormatError
            raise BroadcastError(f"received an unusable broadcast header ({exc})") from None
        return cls.build(0, 0, 0, bucket_bytes, specs, algorithm)

    @classmethod
    def build(cls, version: int, epoch: int, seq: int, bucket_bytes: int,
              specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
              checksum: str | None = None) -> Header:
        """``checksum``: the bucket checksum algorithm, or None for unsealed buckets."""
        entries = []
        offset = 0
        for name, dtype, shape in specs:
            nbytes = nbytes_of(dtype, shape)
            entries.append(Entry(name, dtype_name(dtype), shape, nbytes, offset))
            offset = aligned(offset + nbytes)
        return cls(version, epoch, seq, bucket_bytes, tuple(entries), checksum)


@dataclass
class _KeptHeader:
    settings: tuple[Any, ...]
    names: list[str]
    states: States | None
    header: Header
    #: the states were taken again after the quick check missed and the layout held
    renewed: bool = False


class HeaderCache:
    """The last push's header layout, reused while it stays the same: the same names, bucket
    size, checksum algorithm and target dtype, and tensors of the same dtypes and shapes.

    Push after push a trainer hands over the same tensors (updated in place). That is checked
    first, with torch's tensor-match check plus the addresses (``tensorstate``: ~30 us for 300
    tensors); tensors that are new objects each push fall back to comparing dtypes and shapes
    (~200 us for 300 tensors on a host that idled between pushes). The check runs before a
    push is announced, so it is on every push's critical path."""

    def __init__(self) -> None:
        self.kept: _KeptHeader | None = None

    def header(self, pairs: Sequence[tuple[str, torch.Tensor]], settings: tuple[Any, ...],
               build: Any) -> Header:
        """The kept header if it fits ``pairs`` under ``settings`` (bucket size, algorithm,
        target dtype), else ``build()`` (kept from now on)."""
        names = [n for n, _ in pairs]
        tensors = [t for _, t in pairs]
        kept = self.kept
        if (kept is not None and kept.states is not None and kept.settings == settings
                and kept.names == names):
            if kept.states.matches(tensors):
                kept.renewed = False
                return kept.header
            if kept.states.same_layout(tensors):
                # Other tensors of the same layout: their states are taken once (a caller
                # that moved to new tensors for good gets the quick check back; one that
                # hands over new tensors every push does not pay for states every push).
                if not kept.renewed:
                    kept.states = States.of(tensors) or kept.states
                    kept.renewed = True
                return kept.header
        header = build()
        self.kept = _KeptHeader(settings, names, States.of(tensors), header)
        return header


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes on its own device (a copy only if non-contiguous).
    Works for 0-d, empty, bool, bf16, fp8 and complex tensors."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def bucket_plan(header: Header) -> list[list[tuple[int, int, int]]]:
    """For each bucket, the (entry index, start, end) byte ranges, relative to each tensor,
    that lie in it. One pass over the entries."""
    plan: list[list[tuple[int, int, int]]] = [[] for _ in header.buckets()]
    size = header.bucket_bytes
    for i, e in enumerate(header.entries):
        pos, end = e.offset, e.offset + e.nbytes
        while pos < end:
            b = pos // size
            stop = min(end, (b + 1) * size)
            plan[b].append((i, pos - e.offset, stop - e.offset))
            pos = stop
    return plan
