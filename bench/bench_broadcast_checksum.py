"""Throughput of the broadcast bucket checksum (``dbsync.nccl.checksum``: the sender's seal) and
of the receiver's fused verify + copy-out (``dbsync.nccl.paced.VerifyCopy``) on one GPU, against
a device-to-device copy of the same bytes, measured in the same run; and correctness checks:
the GPU (torch and paced) and CPU results agree bit for bit, one flipped byte anywhere changes
the checksum, and the fused copy is exact.

    python bench/bench_broadcast_checksum.py [--mib 256 2048 8192] [--out results.json]

GB/s counts the payload bytes (10^9 bytes/s): the checksum reads each byte once; the copy reads
and writes it (its bytes read plus written are reported too). Median of CUDA-event-timed runs
after warm-up, rotating between two buffers so no run is served from L2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dbsync.nccl import checksum, paced  # noqa: E402


def timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn(i)`` over ``reps`` event-timed runs after 3 warm-ups."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def correctness() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (64 * checksum.ROW_BYTES,), dtype=torch.uint8, generator=gen)
    cpu = checksum.region_sums(host)
    gpu = checksum.region_sums(host.cuda()).cpu()
    gpu_paced = checksum.region_sums(host.cuda(), pace=True).cpu()
    flips_caught = 0
    trials = 200
    positions = torch.randint(0, host.numel(), (trials,), generator=gen).tolist()
    dev = host.cuda()
    base = checksum.region_sums(dev)
    for p in positions:
        saved = dev[p].item()
        dev[p] = saved ^ (1 << (p % 8))
        flips_caught += int(not torch.equal(checksum.region_sums(dev), base))
        dev[p] = saved
    return {"cpu_equals_gpu": bool(torch.equal(cpu, gpu) and torch.equal(cpu, gpu_paced)),
            "single_bit_flips": trials, "single_bit_flips_caught": flips_caught}


def measure(mib: int, reps: int) -> dict[str, Any]:
    """Sealing (torch row sums), and the receiver's fused verify + copy-out (``paced``, at
    full speed: on every SM twice over) against a plain device-to-device copy."""
    n = mib * 2**20
    wire = checksum.buffer_bytes(n)
    srcs = [torch.randint(0, 256, (wire,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    for src in srcs:
        checksum.seal(src, n)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    plan = paced.VerifyCopy([(dst, 0)], n, dst.device)
    full = paced.programs_for(dst.device, 2.0)
    t_sum = timed(lambda i: checksum.seal(srcs[i % 2], n), reps)
    t_fused = timed(lambda i: plan.run(checksum.words_view(srcs[i % 2], n),
                                       checksum.trailer_view(srcs[i % 2], n), bad, full), reps)
    t_copy = timed(lambda i: dst.copy_(srcs[i % 2][:n]), reps)
    exact = bool(torch.equal(dst, srcs[1][:n])) and int(bad) == 0
    plan.run(checksum.words_view(srcs[0], n), checksum.trailer_view(srcs[0], n), bad, full)
    exact = exact and bool(torch.equal(dst, srcs[0][:n])) and int(bad) == 0
    return {"mib": mib, "checksum_ms": t_sum * 1e3, "verify_copy_ms": t_fused * 1e3,
            "copy_ms": t_copy * 1e3, "checksum_GBps": n / t_sum / 1e9,
            "verify_copy_payload_GBps": n / t_fused / 1e9, "copy_payload_GBps": n / t_copy / 1e9,
            "copy_read_plus_write_GBps": 2 * n / t_copy / 1e9,
            "checksum_time_over_copy_time": t_sum / t_copy,
            "verify_copy_time_over_copy_time": t_fused / t_copy, "verify_copy_exact": exact}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--paced-step", type=int, default=0, help="tuning: rows per CTA step")
    ap.add_argument("--paced-warps", type=int, default=0, help="tuning: warps per CTA")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    paced._ROWS_PER_STEP = args.paced_step or paced._ROWS_PER_STEP
    paced._WARPS = args.paced_warps or paced._WARPS
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "algorithm": checksum.ALGORITHM, "correctness": correctness(),
                              "paced_step": paced._ROWS_PER_STEP, "paced_warps": paced._WARPS,
                              "sizes": []}
    for mib in args.mib:
        row = measure(mib, args.reps)
        result["sizes"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    print(json.dumps(result["correctness"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    c = result["correctness"]
    exact = all(row["verify_copy_exact"] for row in result["sizes"])
    return 0 if (c["cpu_equals_gpu"] and exact
                 and c["single_bit_flips_caught"] == c["single_bit_flips"]) else 1


if __name__ == "__main__":
    sys.exit(main())
