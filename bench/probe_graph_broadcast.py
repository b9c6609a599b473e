"""ProcessGroupNCCL broadcasts replayed from CUDA graphs, two ranks on two GPUs, torch only:

- ``run``: host time of one 256 MiB broadcast call on a host that idled 0.5 s, called eagerly
  and replayed from a graph captured once; each entry [microseconds until the call returned,
  until a synchronize after it returned] (OUT_DIR/graph_bcast_rank{0,1}.json);
- ``capture_local``: whether capturing is local to the capturing rank (rank 0 captures while
  rank 1 makes no NCCL call), then replays and eager calls in every combination across the
  ranks, checking the bytes, 64 MiB (OUT_DIR/asym_rank{0,1}.json).

    python bench/probe_graph_broadcast.py OUT_DIR

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
LOCAL_NBYTES = 64 << 20


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
    finish(store, rank, f"{out}/graph_bcast_rank{rank}.json", result)


def finish(store: dist.TCPStore, rank: int, path: str, result: dict) -> None:
    """Write this rank's result, then wait for the other rank's (the store outlives both)."""
    with open(path, "w") as f:
        json.dump(result, f)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])


def capture_local(rank: int, world: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("g", store), rank, world)
    buf = torch.zeros(LOCAL_NBYTES, dtype=torch.uint8, device="cuda")
    pg.broadcast([buf]).wait()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    result: dict = {}

    def capture_alone() -> torch.cuda.CUDAGraph:
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
        graph = capture_alone()
        result["capture_alone_s"] = time.perf_counter() - t
        store.set("captured", "1")
    else:
        store.wait(["captured"])  # rank 0 captured while this rank made no NCCL call
        graph = capture_alone()
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
    finish(store, rank, f"{out}/asym_rank{rank}.json", result)


if __name__ == "__main__":
    mp.spawn(run, args=(2, 29533, sys.argv[1]), nprocs=2)
    mp.spawn(capture_local, args=(2, 29541, sys.argv[1]), nprocs=2)
