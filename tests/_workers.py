"""Helper processes for the multi-process tests (writer, readers). Not a test module.

Every version v writes tensors whose every element tells v (float32: v, bf16: v % 256), so a
reader can tell from the bytes alone whether what it applied came from one version."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import dbsync


def weights_for(version: int, n: int = 6, size: int = 4096) -> dict[str, torch.Tensor]:
    """Tensors whose every element tells the version: float32 ones hold ``version``, bf16
    ones ``version % 256`` (bf16 holds integers exactly only up to 256; 257 would be stored
    as 256 and a mix of two versions would pass for one)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        if i % 2:
            out[f"layers.{i}.weight"] = torch.full((size,), float(version % 256),
                                                   dtype=torch.bfloat16)
        else:
            out[f"layers.{i}.weight"] = torch.full((size,), float(version), dtype=torch.float32)
    return out


def expected_values(version: int) -> list[float]:
    """The distinct values a whole load of ``weights_for(version)`` applies."""
    return sorted({float(version), float(version % 256)})


def writer(root: str, count: str, pause: str = "0", n: str = "6", size: str = "4096") -> None:
    """Push ``count`` versions (content = the version number), forever if count is 0."""
    with dbsync.Sender(root, num_threads=4, lease_timeout=5.0) as sender:
        i = 0
        while int(count) == 0 or i < int(count):
            nxt = (sender.latest_version() or 0) + 1
            got = sender.push(weights_for(nxt, int(n), int(size)))
            assert got == nxt, (got, nxt)
            print(got, flush=True)
            i += 1
            time.sleep(float(pause))


def reader(root: str, loads: str, delay: str, out: str) -> None:
    """Load ``loads`` times, sleeping ``delay`` inside load_weights (a slow reader); record,
    per load, the version and the set of distinct values seen across all tensors."""
    results = []
    while not os.path.isdir(root):  # the writer creates the store
        time.sleep(0.01)
    receiver = dbsync.Receiver(root, lease_timeout=5.0)
    while receiver.latest_version() is None:
        time.sleep(0.01)
    for _ in range(int(loads)):
        seen: set[float] = set()

        def apply(pairs, seen=seen):
            for _name, tensor in pairs:
                time.sleep(float(delay))
                seen.update(float(x) for x in tensor.float().unique())

        version = receiver.load(apply)
        results.append({"version": version, "values": sorted(seen)})
    with open(out, "w") as f:
        json.dump(results, f)


def hold(root: str, ready: str) -> None:
    """Open (lease) the current version, signal readiness, then hold it until killed."""
    receiver = dbsync.Receiver(root, lease_timeout=float(os.environ.get("LEASE", "2")))
    snap = receiver.open()
    with open(ready, "w") as f:
        f.write(str(snap.version))
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    {"writer": writer, "reader": reader, "hold": hold}[sys.argv[1]](*sys.argv[2:])
