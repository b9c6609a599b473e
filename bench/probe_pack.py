"""The sender's packing of one bucket, alone on one GPU: torch's copies then the row-sum seal
(what ``OutgoingStream`` does without the fused pass) against the fused pack-and-seal pass
(``paced.PackSeal``) at several CTA counts and shapes, on the benchmark's model layout (300
bf16 tensors). Device time (CUDA events, median of ``--reps``), host time to enqueue, and
the sealed bucket compared byte for byte with torch's (both packed into a zeroed buffer).

    python bench/probe_pack.py [--gb 2] [--bucket-mib 256] [--reps 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))


def timed(fn: Any, reps: int) -> tuple[float, float]:
    """(median device ms, median host enqueue us) of ``fn``."""
    dev, host = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e6)
        b.record()
        b.synchronize()
        dev.append(a.elapsed_time(b))
    return statistics.median(dev[1:]), statistics.median(host[1:])


def probe_bucket(b: int, header: Any, pairs: Any, plans: dict[str, Any],
                 streams: dict[str, Any], reps: int) -> dict[str, Any]:
    from dbsync.nccl import checksum, paced

    dev = torch.device("cuda", 0)
    lo, hi = plans["torch"].buckets[b]
    sealed = {}
    for name, st in streams.items():
        buf = st._buffers[b % st.depth]
        buf.zero_()
        st._pack(b, header, pairs, plans[name], st._buffers, {})
        torch.cuda.synchronize()
        sealed[name] = buf[:checksum.wire_bytes(hi - lo, True)].clone()
    row: dict[str, Any] = {"bucket": b, "bytes": hi - lo,
                           "fused_equals_torch": torch.equal(sealed["torch"], sealed["fused"])}
    del sealed
    for name, st in streams.items():
        ms, us = timed(lambda st=st, name=name: st._pack(
            b, header, pairs, plans[name], st._buffers, {}), reps)
        row[name] = {"ms": ms, "host_us": us, "GBps": (hi - lo) / ms / 1e6}
    src = torch.empty(hi - lo, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms, _ = timed(lambda: dst.copy_(src), reps)
    row["copy_"] = {"ms": ms, "GBps": (hi - lo) / ms / 1e6}
    fused = streams["fused"]
    fb = fused._fused_bucket(b, header, pairs, plans["fused"])
    assert fb is not None
    buf = fused._buffers[b % fused.depth]
    sms = paced._sm_count(0)
    defaults = paced._PACK_ROWS_PER_STEP, paced._PACK_WARPS
    for step in (4, 8, 16):
        for warps in (4, 8):
            for per_sm in (1, 2, 4):
                paced._PACK_ROWS_PER_STEP, paced._PACK_WARPS = step, warps
                ms, us = timed(lambda per_sm=per_sm: fb[0].run(buf, sms * per_sm), reps)
                row[f"fused_s{step}_w{warps}_p{per_sm}"] = {
                    "ms": ms, "host_us": us, "GBps": (hi - lo) / ms / 1e6}
    paced._PACK_ROWS_PER_STEP, paced._PACK_WARPS = defaults
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from bench_broadcast_fanout import model_shapes

    from dbsync.nccl import checksum
    from dbsync.nccl.layout import Header
    from dbsync.nccl.outgoing import OutgoingStream

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    pairs = [(n, torch.randn(s, generator=gen, device=dev).to(torch.bfloat16))
             for n, s in model_shapes(args.gb, 300)]
    bucket = args.bucket_mib * 2**20
    header = Header.build(1, 1, 1, bucket, [(n, t.dtype, tuple(t.shape)) for n, t in pairs],
                          checksum.ALGORITHM)
    plain = OutgoingStream(dev, bucket, True, fused=False)
    fused = OutgoingStream(dev, bucket, True, fused=True)
    plans = {"torch": plain.prepare(header), "fused": fused.prepare(header, pairs)}
    streams = {"torch": plain, "fused": fused}
    nb = len(plans["torch"].buckets)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "gb": args.gb,
                           "bucket_mib": args.bucket_mib, "buckets": nb, "results": []}
    for b in sorted({0, nb // 2, nb - 1}):
        row = probe_bucket(b, header, pairs, plans, streams, args.reps)
        out["results"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["fused_equals_torch"] for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
