"""Is capturing a ProcessGroupNCCL broadcast into a CUDA graph local to the capturing rank?
Rank 0 captures while rank 1 makes no NCCL call; then the two ranks replay or call eagerly in
every combination, checking the bytes (64 MiB, two GPUs, torch only).

    python bench/probe_graph_capture_local.py OUT_DIR   # writes OUT_DIR/asym_rank{0,1}.json"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NBYTES = 64 << 20


def run(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("g", store), rank, world)
    buf = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    pg.broadcast([buf]).wait()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    result: dict = {}

    def capture() -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                pg.broadcast([buf]).wait()
            finally:
                graph.capture_end()
        return graph

    if rank == 0:
        t = time.perf_counter()
        graph = capture()
        result["capture_alone_s"] = time.perf_counter() - t
        store.set("captured", "1")
    else:
        store.wait(["captured"])  # rank 0 captured while this rank made no NCCL call
        graph = capture()
    ok = []
    for it, modes in enumerate([("replay", "eager"), ("eager", "replay"), ("replay", "replay"),
                                ("eager", "eager")]):
        buf.fill_(it + 1 if rank == 0 else 0)
        torch.cuda.synchronize()
        store.set(f"s{it}{rank}", "1")
        store.wait([f"s{it}{1 - rank}"])
        if modes[rank] == "replay":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.replay()
            torch.cuda.current_stream().wait_stream(stream)
        else:
            pg.broadcast([buf]).wait()
        torch.cuda.synchronize()
        ok.append(bool((buf[:: 1 << 16] == it + 1).all()))
    result["ok"] = ok
    with open(f"{out}/asym_rank{rank}.json", "w") as f:
        json.dump(result, f)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])


if __name__ == "__main__":
    mp.spawn(run, args=(2, 29541, sys.argv[1]), nprocs=2)
