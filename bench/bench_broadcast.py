"""Benchmark the broadcast fast path on 2 GPUs against a raw torch.distributed.broadcast of the
same bytes, measured in the same run.

    python bench/bench_broadcast.py [--gib 2] [--tensors 300] [--bucket-mib 256] [--iters 5]
                                    [--out results.json]

Process 0 (cuda:0) holds model-like bf16 weights and pushes them through a BroadcastSender
(which also publishes each version to a store on /dev/shm, after the broadcast). Process 1
(cuda:1) is a torch-only receiver: its load_weights copies every tensor into preallocated
parameters and synchronizes. Then both processes run the raw baseline: torch.distributed
broadcasts of the same number of bytes in the same bucket size from two preallocated buffers
(no packing, no handshake), and one broadcast of a single buffer of all the bytes.

Reported: GB/s (10^9 bytes/s) of the fast path (sender side: header built -> last bucket
done, handshake included; receiver side: header seen -> last tensor copied and synchronized), of the
raw bucketed and single-buffer broadcasts, their ratio, and time-to-first-broadcast (forming
the epoch: process group, NCCL communicator, first broadcast). Correctness: the receiver checks
every received tensor bit-exactly (exact int64 fingerprints). If xxhash is importable, one more
push runs with checksums on both sides and is reported separately.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_shapes(gib: float, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """Per layer: qkv [3h, h], o [h, h], up [4h, h], down [h, 4h], two norms [h]."""
    layers = max(1, tensors // 6)
    h = int(math.sqrt(gib * 2**30 / (layers * 2 * 12)))
    h = max(128, h // 128 * 128)
    shapes = []
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)),
                   (p + "self_attn.qkv_proj.weight", (3 * h, h)),
                   (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.up_proj.weight", (4 * h, h)),
                   (p + "mlp.down_proj.weight", (h, 4 * h))]
    return shapes


def make_weights(shapes: list[tuple[str, tuple[int, ...]]], device: str,
                 seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=gen, device=device, dtype=torch.float32)
            .to(torch.bfloat16) for n, s in shapes}


def fingerprint(t: torch.Tensor) -> list[int]:
    """Exact int64 sums of the 16-bit words and of their squares (bit-level check, no hash)."""
    words = t.view(torch.int16).reshape(-1).to(torch.int64)
    return [int(words.sum()), int((words * words).sum())]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_xxhash() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


def raw_baseline(rank: int, port: int, total: int, bucket: int, iters: int) -> dict[str, Any]:
    import torch.distributed as dist

    t0 = time.perf_counter()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    first = torch.zeros(1, device="cuda")
    dist.broadcast(first, 0)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    bufs = [torch.empty(bucket, dtype=torch.uint8, device="cuda") for _ in range(2)]
    sizes = [min(bucket, total - lo) for lo in range(0, total, bucket)]
    whole = torch.empty(total, dtype=torch.uint8, device="cuda")

    def bucketed() -> None:
        for i, n in enumerate(sizes):
            dist.broadcast(bufs[i % 2][:n], 0)

    def single() -> None:
        dist.broadcast(whole, 0)

    out: dict[str, Any] = {"setup_seconds": setup}
    for name, fn in (("bucketed", bucketed), ("single", single)):
        times = []
        for i in range(iters + 1):
            dist.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t)
        out[name] = times
    dist.destroy_process_group()
    return out


def sender_main(args: argparse.Namespace, root: str, port: int, q: Any) -> None:
    from dbsync import Sender
    from dbsync.nccl import BroadcastSender

    torch.cuda.set_device(0)
    shapes = model_shapes(args.gib, args.tensors)
    weights = make_weights(shapes, "cuda:0", seed=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sender = Sender(root, durable=False)
    bs = BroadcastSender(sender, address="127.0.0.1", device="cuda:0", timeout=60.0,
                         bucket_bytes=args.bucket_mib * 2**20, checksums=False)
    construct = time.perf_counter() - t0
    q.put(json.dumps({"fingerprints": {n: fingerprint(t) for n, t in weights.items()}}))
    assert bs.wait_for_joins(1, 300), "the receiver never asked to join"
    setup = bs.prepare()
    pushes = []
    for _ in range(args.iters + 1):
        t = time.perf_counter()
        version = bs.push(weights)
        stats = dict(bs.last_push_stats)
        stats["push_seconds_with_fs"] = time.perf_counter() - t
        stats["version"] = version
        pushes.append(stats)
        time.sleep(0.2)
    verified = None
    if have_xxhash():
        bs.checksums = True
        version = bs.push(weights)
        verified = dict(bs.last_push_stats)
    total = pushes[-1].get("bytes", 0)
    bs.close()
    sender.close()
    raw = raw_baseline(0, port, total, args.bucket_mib * 2**20, args.iters)
    q.put(json.dumps({"rank": 0, "construct_seconds": construct, "setup_seconds": setup,
                      "pushes": pushes, "verified_push": verified, "raw": raw,
                      "bytes": total, "tensors": len(shapes)}))


def receiver_main(args: argparse.Namespace, root: str, port: int, q: Any,
                  expect: dict[str, list[int]]) -> None:
    from dbsync.nccl import BroadcastReceiver

    torch.cuda.set_device(1)
    shapes = model_shapes(args.gib, args.tensors)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda:1") for n, s in shapes}
    rx = BroadcastReceiver(root, device="cuda:1", verify=False, timeout=60.0,
                           address="127.0.0.1")

    def load_weights(pairs: Any) -> None:
        for name, t in pairs:
            params[name].copy_(t)
        torch.cuda.synchronize()

    takes = []
    exact = None
    rounds = args.iters + 1 + (1 if have_xxhash() else 0)
    for i in range(rounds):
        if i == args.iters + 1:
            rx.verify = True
        version = rx.receive(load_weights, timeout=600)
        takes.append({"version": version, "source": rx.last_source, "error": rx.last_error,
                      **rx.last_stats})
        if exact is None:
            exact = all(fingerprint(params[n]) == expect[n] for n, _ in shapes)
    rx.close()
    raw = raw_baseline(1, port, takes[0].get("bytes", 0), args.bucket_mib * 2**20, args.iters)
    q.put(json.dumps({"rank": 1, "takes": takes, "bit_exact": exact, "raw": raw}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("bench_broadcast needs 2 CUDA GPUs; found", torch.cuda.device_count())
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 3 * args.gib * 2**30 else None
    root = tempfile.mkdtemp(prefix="dbsync-bench-", dir=base)
    port = free_port()
    ctx = mp.get_context("spawn")
    q0, q1 = ctx.Queue(), ctx.Queue()
    p0 = ctx.Process(target=sender_main, args=(args, root, port, q0))
    p0.start()
    expect = json.loads(q0.get(timeout=600))["fingerprints"]
    p1 = ctx.Process(target=receiver_main, args=(args, root, port, q1, expect))
    p1.start()
    r0 = json.loads(q0.get(timeout=1800))
    r1 = json.loads(q1.get(timeout=600))
    p0.join()
    p1.join()
    shutil.rmtree(root, ignore_errors=True)

    nbytes = r0["bytes"]
    timed = r0["pushes"][1:]
    send_s = [p["prepare_seconds"] + p["ack_seconds"] + p["stream_seconds"] for p in timed]
    recv_s = [t["seconds"] for t in r1["takes"][1: args.iters + 1]]
    raw_b = [max(a, b) for a, b in zip(r0["raw"]["bucketed"], r1["raw"]["bucketed"], strict=True)]
    raw_s = [max(a, b) for a, b in zip(r0["raw"]["single"], r1["raw"]["single"], strict=True)]

    def gbps(seconds: list[float]) -> float:
        return nbytes / statistics.median(seconds) / 1e9

    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "xxhash": have_xxhash(), "bytes": nbytes, "tensors": r0["tensors"],
        "bucket_mib": args.bucket_mib, "iters": args.iters,
        "sources": [t["source"] for t in r1["takes"]], "bit_exact": r1["bit_exact"],
        "fast_path_sender_GBps": gbps(send_s), "fast_path_receiver_GBps": gbps(recv_s),
        "fast_path_stream_only_GBps": gbps([p["stream_seconds"] for p in timed]),
        "handshake_ms_median": 1e3 * statistics.median([p["ack_seconds"] for p in timed]),
        "prepare_ms_median": 1e3 * statistics.median([p["prepare_seconds"] for p in timed]),
        "prepack_ms_median": 1e3 * statistics.median([p["prepack_seconds"] for p in timed]),
        "ack_wait_ms_median": 1e3 * statistics.median([p["ack_wait_seconds"] for p in timed]),
        "raw_bucketed_GBps": gbps(raw_b), "raw_single_buffer_GBps": gbps(raw_s),
        "setup_seconds_first_epoch": r0["setup_seconds"],
        "first_push_broadcast_seconds": r0["pushes"][0]["broadcast_seconds"],
        "construct_seconds": r0["construct_seconds"],
        "raw_setup_seconds": r0["raw"]["setup_seconds"],
        "push_seconds_with_fs_median": statistics.median(
            [p["push_seconds_with_fs"] for p in timed]),
    }
    summary["ratio_sender_vs_raw_bucketed"] = (summary["fast_path_sender_GBps"]
                                               / summary["raw_bucketed_GBps"])
    summary["ratio_receiver_vs_raw_bucketed"] = (summary["fast_path_receiver_GBps"]
                                                 / summary["raw_bucketed_GBps"])
    if r0["verified_push"]:
        v = r0["verified_push"]
        take = r1["takes"][-1]
        summary["verified_push"] = {
            "sender_hash_and_send_seconds": v["broadcast_seconds"],
            "receiver_seconds": take["seconds"], "source": take["source"],
            "error": take["error"]}
    else:
        summary["verified_push"] = "skipped: xxhash is not importable on this host"
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "sender": r0, "receiver": r1}, f, indent=1)
    return 0 if r1["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
