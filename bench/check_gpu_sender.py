"""GPU check of the Sender's snapshot path: CUDA tensors are copied to a pinned host buffer
(reused between pushes), a non-blocking push may be followed at once by changes to the
weights, and what is published is bit-exact. Also times the snapshot (D2H) against a raw
pinned copy of the same bytes in the same run.

    python bench/check_gpu_sender.py [--gib 2] [--dir /dev/shm/dbsync-gpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch

import dbsync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--dir", default="/dev/shm/dbsync-gpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    n_tensors = 64
    per = int(args.gib * 2**30) // (2 * n_tensors)
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {f"layers.{i}.w": torch.randn(per, device="cuda", generator=g).bfloat16()
               for i in range(n_tensors)}
    total = sum(t.numel() * 2 for t in weights.values())
    expected = {k: v.cpu() for k, v in weights.items()}
    originals = {k: v.clone() for k, v in weights.items()}

    # raw limit: one pinned D2H copy of the same bytes
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    raw = []
    for _ in range(3):
        t = time.perf_counter()
        off = 0
        for v in weights.values():
            nb = v.numel() * 2
            pinned[off : off + nb].view(torch.bfloat16).copy_(v, non_blocking=True)
            off += nb
        torch.cuda.synchronize()
        raw.append(time.perf_counter() - t)

    shutil.rmtree(args.dir, ignore_errors=True)
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "bytes": total}
    with dbsync.Sender(args.dir, num_threads=8, durable=False) as sender:
        sender.push(weights)  # warm: allocates the pinned staging buffer
        snaps = []
        for _ in range(3):
            t = time.perf_counter()
            future = sender.push(weights, blocking=False)  # returns after the snapshot
            snaps.append(time.perf_counter() - t)
            for v in weights.values():  # the trainer moves on at once
                v.fill_(7)
            version = future.result()
            for k, v in weights.items():
                v.copy_(originals[k])
        results["version"] = version
        staged = [b._buf for b in sender._buffers if b._buf is not None]
        results["staging_buffers"] = len(staged)
        results["staging_pinned"] = bool(staged) and all(b.is_pinned() for b in staged)
    got: dict[str, torch.Tensor] = {}
    dbsync.Receiver(args.dir).load(lambda pairs: got.update({k: t.clone() for k, t in pairs}))
    results["bit_exact_despite_changes_after_return"] = all(
        torch.equal(got[k], expected[k]) for k in expected)
    results["raw_pinned_d2h_GBps"] = total / min(raw) / 1e9
    results["snapshot_GBps"] = total / min(snaps) / 1e9
    results["ratio_snapshot_vs_raw"] = min(raw) / min(snaps)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
