"""What a receiver's own GPU work costs a running broadcast, measured alone (no dbsync code path
around it): one root streams buckets to N-1 receivers; each receiver, per bucket, waits for it
(the host polls, as dbsync does), then does one kind of work on it, then posts the receive of
bucket k + depth into that buffer. Compared with the same stream doing no work, same run.

    python bench/probe_receiver_work.py [--gpus N] [--gb 4] [--iters 6] [--out results.json]

Work kinds: ``sum`` (the bucket checksum, result read on the host), ``copy`` (the bucket's bytes
copied out into separate destination tensors, 16 per bucket), ``both`` (sum, then copy). Each
with torch's own kernels (``torch``) or the paced Triton kernels on P CTAs (``P``). ``fused``:
verification and copy-out in one pass on P CTAs reading each byte once, no host sync (what
``BroadcastReceiver.receive(module or dict)`` does on CUDA: ``paced.VerifyCopy``). Also the
same with the group's NCCL communicator given more CTAs (``--ctas``), where PyTorch exposes it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAYLOAD = 256 * 2**20  # bucket payload; the sealed wire adds its row sums
PIECES = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(pg: Any, rank: int, buckets: int, bufs: list[torch.Tensor],
                dests: list[list[torch.Tensor]], kind: str, how: str, depth: int,
                bad: torch.Tensor, plans: dict[int, Any]) -> float:
    import torch.distributed as dist
    from torch._C._distributed_c10d import BroadcastOptions

    from dbsync.nccl import checksum, paced

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    def post(b: int) -> Any:
        return pg.broadcast([bufs[b % depth]], opts)

    dist.barrier()
    torch.cuda.synchronize()
    t = time.perf_counter()
    if rank == 0:
        works = [post(b) for b in range(buckets)]
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        return time.perf_counter() - t
    works = [post(b) for b in range(min(depth, buckets))]
    piece = PAYLOAD // PIECES
    for b in range(buckets):
        w = works[b % depth]
        while not w.is_completed():
            time.sleep(0)
        buf = bufs[b % depth]
        if kind == "fused":  # verified and copied out in one paced pass, no host sync
            pieces = [(dst.view(torch.uint8), i * piece) for i, dst in enumerate(dests[b])]
            plan = plans.get(b)  # the same buffers and destinations every run
            if plan is None:
                plan = plans[b] = paced.VerifyCopy(pieces, PAYLOAD, buf.device)
            plan.run(checksum.words_view(buf, PAYLOAD), checksum.trailer_view(buf, PAYLOAD),
                     bad[b:b + 1], int(how))
        if kind in ("sum", "both"):
            if how == "torch":
                ok = checksum.check(buf, PAYLOAD)
            else:
                rows = paced.row_sums(checksum.words_view(buf, PAYLOAD), int(how))
                ok = bool(torch.equal(rows, checksum.trailer_view(buf, PAYLOAD)))
            assert ok
        if kind in ("copy", "both"):
            pairs = [(dst, buf[i * piece:(i + 1) * piece].view(torch.bfloat16))
                     for i, dst in enumerate(dests[b])]
            if how == "torch":
                for dst, src in pairs:
                    dst.copy_(src)
            else:
                plan = plans.get(b)
                if plan is None:
                    plan = plans[b] = paced.CopyTable(pairs)
                plan.run(int(how))
        if b + depth < buckets:
            works[b % depth] = post(b + depth)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def worker(rank: int, world: int, args: argparse.Namespace, port: int, results: Any) -> None:
    sys.path.insert(0, REPO)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank))
        groups: dict[str, Any] = {"default": dist.group.WORLD}
        for ctas in args.ctas:
            from torch._C._distributed_c10d import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            if not hasattr(opts, "config"):
                break
            opts.config.min_ctas = ctas
            opts.config.max_ctas = ctas
            groups[f"ctas{ctas}"] = dist.new_group(backend="nccl", pg_options=opts)
        from dbsync.nccl import checksum

        buckets = max(1, int(args.gb * 1e9) // PAYLOAD)
        depth = 3
        bufs = [torch.empty(checksum.buffer_bytes(PAYLOAD), dtype=torch.uint8, device="cuda")
                for _ in range(depth)]
        if rank == 0:
            for b in bufs:
                b.random_(0, 256)
                checksum.seal(b, PAYLOAD)
        piece = PAYLOAD // PIECES // 2
        dests = [[torch.empty(piece, dtype=torch.bfloat16, device="cuda")
                  for _ in range(PIECES)] for _ in range(buckets)] if rank else []
        bad = torch.zeros(buckets, dtype=torch.int32, device="cuda")
        # correctness of the paced kernels against torch, on this GPU
        if rank == 1:
            from dbsync.nccl import paced

            x = torch.randint(-2**62, 2**62, (4096, 512), dtype=torch.int64, device="cuda")
            ok_sum = torch.equal(paced.row_sums(x, 16), x.sum(dim=1))
            srcs = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in (4, 4096, 77777)]
            outs = [torch.zeros_like(s) for s in srcs]
            paced.CopyTable(list(zip(outs, srcs, strict=True))).run(16)
            ok_copy = all(torch.equal(a, b) for a, b in zip(outs, srcs, strict=True))
            # fused verify + copy: pieces crossing rows, a tiny one, 64-byte gaps; then a
            # flipped byte: only the rows that verified are written
            payload = 5 * checksum.ROW_BYTES + 1000
            wire = torch.randint(0, 256, (checksum.buffer_bytes(payload),), dtype=torch.uint8,
                                 device="cuda")
            checksum.seal(wire, payload)
            sizes, offsets, at = (64, 5000, 128, 6096, 8200), [], 0
            for n in sizes:
                offsets.append(at)
                at += n + 64
            outs8 = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
            pieces = list(zip(outs8, offsets, strict=True))
            plan = paced.VerifyCopy(pieces, payload, wire.device)
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            plan.run(checksum.words_view(wire, payload), checksum.trailer_view(wire, payload),
                     flag, 4)
            ok_fused = int(flag) == 0 and all(torch.equal(o, wire[a:a + o.numel()])
                                              for o, a in pieces)
            for o in outs8:
                o.zero_()
            wire[checksum.ROW_BYTES + 7] ^= 4  # row 1
            plan.run(checksum.words_view(wire, payload), checksum.trailer_view(wire, payload),
                     flag, 4)
            row1 = range(checksum.ROW_BYTES, 2 * checksum.ROW_BYTES)
            ok_damaged = int(flag) == 1 and all(
                bool((o[[i for i in range(o.numel()) if a + i in row1]] == 0).all())
                and torch.equal(o[[i for i in range(o.numel()) if a + i not in row1]],
                                wire[[a + i for i in range(o.numel()) if a + i not in row1]])
                for o, a in pieces)
            results.put(json.dumps({"rank": 1, "check": {"row_sums_exact": ok_sum,
                                                         "copy_exact": ok_copy,
                                                         "fused_exact": ok_fused,
                                                         "fused_damaged_row_kept_out":
                                                             ok_damaged,
                                                         "paced": paced.available(
                                                             torch.device("cuda"))}}))
        variants = [("none", "-")]
        for kind in ("sum", "copy", "both"):
            variants += [(kind, "torch")] + [(kind, str(p)) for p in args.programs]
        variants += [("fused", str(p)) for p in args.programs]
        out: dict[str, Any] = {}
        for gname, pg in groups.items():
            for kind, how in variants:
                if gname != "default" and how not in ("-", "torch"):
                    continue
                plans: dict[int, Any] = {}  # built by the warm-up run, reused by the rest
                run_variant(pg, rank, buckets, bufs, dests, kind, how, depth, bad, plans)
                times = [run_variant(pg, rank, buckets, bufs, dests, kind, how, depth, bad,
                                     plans) for _ in range(args.iters)]
                out[f"{gname}/{kind}/{how}"] = times
        results.put(json.dumps({"rank": rank, "times": out, "bytes": buckets * PAYLOAD,
                                "bad_rows": int(bad.sum())}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(json.dumps({"rank": rank, "exception": repr(exc),
                                "traceback": traceback.format_exc()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 16, 32, 48, 64])
    ap.add_argument("--ctas", type=int, nargs="*", default=[32])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    world = args.gpus or torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, args, port, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    check: dict[str, Any] = {}
    while len(got) < world:
        msg = json.loads(results.get(timeout=900))
        if "exception" in msg:
            print(msg["traceback"], flush=True)
            for p in procs:
                p.kill()
            return 1
        if "check" in msg:
            check = msg["check"]
            print("check", check, flush=True)
            continue
        got[msg["rank"]] = msg
    for p in procs:
        p.join(60)
    print("bad rows seen by receivers (0 expected):",
          {r: got[r]["bad_rows"] for r in range(1, world)}, flush=True)
    nbytes = got[0]["bytes"]
    table: dict[str, Any] = {}
    base = None
    for key in got[0]["times"]:
        per_iter = [max(got[r]["times"][key][i] for r in range(world))
                    for i in range(args.iters)]
        gbps = nbytes / statistics.median(per_iter) / 1e9
        if key == "default/none/-":
            base = gbps
        table[key] = {"GBps": gbps, "seconds": per_iter}
    for key, row in table.items():
        row["ratio_to_no_work"] = row["GBps"] / base if base else None
        print(f"{key:24s} {row['GBps']:7.1f} GB/s  {row['ratio_to_no_work']:.3f}", flush=True)
    result = {"device": torch.cuda.get_device_name(0), "gpus": world,
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "bytes": nbytes, "bucket_bytes": PAYLOAD, "check": check, "variants": table}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
