"""Host time of one ProcessGroupNCCL broadcast call on a host that idled 0.5 s: called eagerly,
and replayed from a CUDA graph captured once. Two ranks on two GPUs, 256 MiB, torch only.

    python bench/probe_graph_broadcast.py OUT_DIR      # writes OUT_DIR/graph_bcast_rank{0,1}.json

Each entry: [microseconds until the call returned, until a synchronize after it returned].
Result and what came of it: docs/BROADCAST.md ("Broadcasts replayed from CUDA graphs")."""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NBYTES = 256 << 20


def capture(buf: torch.Tensor, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # (warm the stream first)
            dist.broadcast(buf, 0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    return graph


def run(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    buf = torch.full((NBYTES,), 7 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
    dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    result: dict = {"eager": [], "replay": [], "ok": True, "capture_error": None}
    try:
        graph = capture(buf, torch.cuda.Stream())
    except Exception as exc:  # noqa: BLE001 - reported
        result["capture_error"] = repr(exc)[:300]
        graph = None
    for it in range(12):
        for mode in ("eager", "replay"):
            if mode == "replay" and graph is None:
                continue
            store.set(f"go{it}{mode}{rank}", "1")
            store.wait([f"go{it}{mode}{1 - rank}"])
            time.sleep(0.5)  # the host idles, as between two pushes
            value = it + 10 + (mode == "replay")
            buf.fill_(value if rank == 0 else 0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mode == "eager":
                dist.broadcast(buf, 0, async_op=True)
            else:
                graph.replay()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            result["ok"] &= bool((buf[:: 1 << 20] == value).all())
            result[mode].append([(t1 - t0) * 1e6, (t2 - t0) * 1e6])
    with open(f"{out}/graph_bcast_rank{rank}.json", "w") as f:
        json.dump(result, f)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])


if __name__ == "__main__":
    mp.spawn(run, args=(2, 29533, sys.argv[1]), nprocs=2)
