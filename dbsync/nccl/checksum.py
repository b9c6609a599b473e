"""Bucket checksums for the broadcast path, computed with torch operations (or the paced
kernels of ``paced``) on the tensor's own device, GPU or CPU: the same function, the same
result.

A bucket's payload is padded to whole rows of ``ROW_BYTES`` and read as little-endian int64
words; its checksum is the sum of each row's words, modulo 2**64 (one int64 per row, 0.2% of
the payload), sent after the payload:

    wire = payload | zero padding to whole rows | row sums (int64 per row) | padding to 64 B

Integer sums modulo 2**64 do not depend on the order of additions, so the sender's and the
receivers' values agree bit for bit whatever reduction order their kernels use. One pass over
the bytes computes them, near memory bandwidth.

Because every row carries its own sum, a receiver can verify and copy out a row in the same
pass, reading the bytes once, and write only the rows that verified (``paced.VerifyCopy``).

Strength, stated plainly: this is a transfer check, not a cryptographic hash. Any corruption
confined to one 8-byte word of a row (every single flipped byte or bit) changes that row's sum;
a row moved to another position changes both rows' sums unless they were equal. It misses
changes whose word differences cancel modulo 2**64 inside a row (e.g. two words of one row
swapped). The end-to-end check of a version stays the manifest's xxh3 checksums (one per
checked range of its shards), which the filesystem path verifies.
"""

from __future__ import annotations

import torch

from . import paced

#: checksummed rows; every checksummed region is a whole number of rows
ROW_BYTES = paced.ROW_WORDS * 8
#: the name announced in the header; a receiver refuses a broadcast whose algorithm it lacks
ALGORITHM = "rowsum64-v2"
_TRAILER_ALIGN = 64


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole rows (the checksummed length of a bucket)."""
    return -(-nbytes // ROW_BYTES) * ROW_BYTES


def rows(payload_bytes: int) -> int:
    """Checksum rows of a bucket of ``payload_bytes``."""
    return padded(payload_bytes) // ROW_BYTES


def trailer_bytes(payload_bytes: int) -> int:
    """Bytes of the row sums that follow a bucket's padded payload (64-byte aligned)."""
    return -(-max(rows(payload_bytes), 1) * 8 // _TRAILER_ALIGN) * _TRAILER_ALIGN


def wire_bytes(payload_bytes: int, checksums: bool) -> int:
    """Bytes one bucket of ``payload_bytes`` occupies on the wire."""
    if not checksums:
        return payload_bytes
    return padded(payload_bytes) + trailer_bytes(payload_bytes)


def buffer_bytes(bucket_bytes: int) -> int:
    """Size of a bucket buffer able to hold any bucket, sealed or not."""
    return wire_bytes(bucket_bytes, True)


def words_view(buffer: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """The padded payload of a bucket buffer as ``int64[rows, ROW_BYTES // 8]``."""
    return buffer[:padded(payload_bytes)].view(torch.int64).view(-1, ROW_BYTES // 8)


def trailer_view(buffer: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """The ``int64[rows]`` row sums that follow a payload of ``payload_bytes`` in a bucket
    buffer."""
    body = padded(payload_bytes)
    return buffer[body: body + 8 * rows(payload_bytes)].view(torch.int64)


def region_sums(region: torch.Tensor, pace: bool = False) -> torch.Tensor:
    """The row sums (``int64[rows]``) of a flat uint8 tensor whose length is a multiple of
    ``ROW_BYTES``, on its device, without a host sync. ``pace``: read the region on a few SMs
    (``paced``), for a receiver whose broadcast is still streaming; the result is the same."""
    if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() % ROW_BYTES:
        raise ValueError(f"region_sums needs a flat uint8 tensor of whole {ROW_BYTES}-byte rows")
    words = region.view(torch.int64).view(-1, ROW_BYTES // 8)
    return paced.row_sums(words) if pace else words.sum(dim=1)


def seal(buffer: torch.Tensor, payload_bytes: int) -> int:
    """Zero the padding after a payload of ``payload_bytes``, write the row sums after it, and
    return the number of bytes to send (payload, padding and row sums)."""
    body = padded(payload_bytes)
    if body > payload_bytes:
        buffer[payload_bytes:body].zero_()
    torch.sum(words_view(buffer, payload_bytes), dim=1, out=trailer_view(buffer, payload_bytes))
    return wire_bytes(payload_bytes, True)


def check(buffer: torch.Tensor, payload_bytes: int, pace: bool = False) -> bool:
    """True when the received bucket's payload matches the row sums the sender sealed into
    it. One host sync."""
    body = padded(payload_bytes)
    return bool(torch.equal(region_sums(buffer[:body], pace=pace),
                            trailer_view(buffer, payload_bytes)))
