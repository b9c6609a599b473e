"""Bucket checksums for the broadcast path, computed with torch operations on the tensor's own
device (GPU or CPU: the same function, the same result).

A bucket's payload is read as little-endian int64 words in rows of ``ROW_BYTES``; each row is
summed (one pass over the bytes, a plain reduction that runs near memory bandwidth), and the
checksum is two int64 values, all arithmetic modulo 2**64:

    s1 = sum of all words            s2 = sum over rows r of (r + 1) * (sum of row r)

Integer sums modulo 2**64 do not depend on the order of additions, so the sender's and the
receivers' values agree bit for bit whatever reduction order their kernels use.

Strength, stated plainly: this is a transfer check, not a cryptographic hash. Any corruption
confined to one 8-byte word (every single flipped byte or bit) changes ``s1``; a row moved or
swapped with another changes ``s2``. It misses changes whose word differences cancel modulo
2**64 inside every row (e.g. two words of one row swapped). The end-to-end check of a version
stays the manifest's per-tensor xxh3 checksums, which the filesystem path verifies.
"""

from __future__ import annotations

import torch

#: checksummed rows; every checksummed region is a whole number of rows
ROW_BYTES = 4096
#: bytes after a bucket's (padded) payload that carry its checksum: two int64, padded
TRAILER_BYTES = 64
#: the name announced in the header; a receiver refuses a broadcast whose algorithm it lacks
ALGORITHM = "rowsum64-v1"

_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole rows (the checksummed length of a bucket)."""
    return -(-nbytes // ROW_BYTES) * ROW_BYTES


def _weights(rows: int, device: torch.device) -> torch.Tensor:
    key = (device, rows)
    w = _WEIGHTS.get(key)
    if w is None:
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        w = _WEIGHTS[key] = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
    return w


def region_sums(region: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The checksum (``int64[2]``) of a flat uint8 tensor whose length is a multiple of
    ``ROW_BYTES``, on its device, without a host sync. ``out`` (``int64[2]`` on that device)
    receives it when given."""
    if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() % ROW_BYTES:
        raise ValueError(f"region_sums needs a flat uint8 tensor of whole {ROW_BYTES}-byte rows")
    if region.numel() == 0:
        sums = torch.zeros(2, dtype=torch.int64, device=region.device)
    else:
        rows = region.view(torch.int64).view(-1, ROW_BYTES // 8).sum(dim=1)
        weighted = (rows * _weights(rows.numel(), rows.device)).sum()
        sums = torch.stack((rows.sum(), weighted))
    if out is None:
        return sums
    out.copy_(sums)
    return out


def trailer_view(buffer: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """The ``int64[2]`` checksum slot that follows a payload of ``payload_bytes`` in a bucket
    buffer (``payload_bytes`` already padded to whole rows)."""
    return buffer[payload_bytes: payload_bytes + 16].view(torch.int64)


def seal(buffer: torch.Tensor, payload_bytes: int) -> int:
    """Write the checksum of ``buffer[:padded(payload_bytes)]`` after it; return the number of
    bytes to send (payload, padding and trailer)."""
    body = padded(payload_bytes)
    region_sums(buffer[:body], out=trailer_view(buffer, body))
    return body + TRAILER_BYTES


def wire_bytes(payload_bytes: int, checksums: bool) -> int:
    """Bytes one bucket of ``payload_bytes`` occupies on the wire."""
    return padded(payload_bytes) + TRAILER_BYTES if checksums else payload_bytes


def buffer_bytes(bucket_bytes: int) -> int:
    """Size of a bucket buffer able to hold any bucket, sealed or not."""
    return padded(bucket_bytes) + TRAILER_BYTES


def check(buffer: torch.Tensor, payload_bytes: int) -> bool:
    """True when the received bucket's payload matches the checksum the sender sealed into
    it. One host sync."""
    body = padded(payload_bytes)
    return bool(torch.equal(region_sums(buffer[:body]), trailer_view(buffer, body)))
