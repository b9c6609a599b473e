"""Push and load throughput of the store, against the raw filesystem limit measured in the
same run, and against torchrl's path (tensordict memmap write, load_memmap + copy).

    python bench/bench_store.py [--sizes 1,4] [--threads 8] [--dir DIR] [--json OUT]

Every number is GB/s (1e9 bytes/s) of model bytes. "raw" rows are the limit on this machine
and directory: the same bytes, the same files, the same thread count, plain os.pwrite into
preallocated files (+fsync for durable), and os.preadv into a preallocated destination.
Hazard: run on an otherwise idle machine; the page cache is warm for reads (as on a receiver
that just verified a version), and the working set must fit in RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

import dbsync
from dbsync.fileio import tensor_bytes


def model_like_state_dict(target_bytes: int, hidden: int = 2048) -> dict[str, torch.Tensor]:
    """bf16 tensors shaped like a decoder: embeddings, per-layer attention/MLP/norms."""
    inter = int(hidden * 2.6875)
    vocab = 32000
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.empty(vocab, hidden)}
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(1, (target_bytes - 2 * 2 * vocab * hidden) // per_layer)
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = torch.empty(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = torch.empty(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = torch.empty(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = torch.empty(hidden, inter)
        sd[p + "input_layernorm.weight"] = torch.empty(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.empty(hidden)
    sd["model.norm.weight"] = torch.empty(hidden)
    sd["lm_head.weight"] = torch.empty(vocab, hidden)
    g = torch.Generator().manual_seed(0)
    return {k: v.uniform_(-1, 1, generator=g).to(torch.bfloat16) for k, v in sd.items()}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def best_of(n: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def raw_write(directory: str, sd: dict[str, torch.Tensor], threads: int, durable: bool) -> float:
    """Plain pwrite of the same bytes into preallocated files (the in-place write limit)."""
    os.makedirs(directory, exist_ok=True)
    paths = {k: os.path.join(directory, f"{i}.bin") for i, k in enumerate(sd)}
    views = {k: tensor_bytes(t) for k, t in sd.items()}
    for k, p in paths.items():  # preallocate once, like steady-state slots
        with open(p, "wb") as f:
            f.truncate(len(views[k]))

    def one(k: str) -> None:
        fd = os.open(paths[k], os.O_WRONLY)
        try:
            view, off = views[k], 0
            while off < len(view):
                off += os.pwrite(fd, view[off : off + 64 * 2**20], off)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        return best_of(3, lambda: list(pool.map(one, sd)))


def raw_read(directory: str, sd: dict[str, torch.Tensor], threads: int) -> float:
    """preadv of the same files into a preallocated destination (read + copy limit)."""
    dest = {k: torch.empty_like(t) for k, t in sd.items()}
    views = {k: tensor_bytes(t, writable=True) for k, t in dest.items()}

    def one(item: tuple[int, str]) -> None:
        i, k = item
        fd = os.open(os.path.join(directory, f"{i}.bin"), os.O_RDONLY)
        try:
            off, view = 0, views[k]
            while off < len(view):
                off += os.preadv(fd, [view[off : off + 64 * 2**20]], off)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        return best_of(3, lambda: list(pool.map(one, enumerate(sd))))


def dbsync_push(root: str, sd: dict[str, torch.Tensor], threads: int, durable: bool
                ) -> tuple[float, float]:
    shutil.rmtree(root, ignore_errors=True)
    with dbsync.Sender(root, num_threads=threads, durable=durable) as sender:
        t = time.perf_counter()
        sender.push(sd)
        first = time.perf_counter() - t
        sender.push(sd)  # both slots exist from here on: steady state
        steady = best_of(3, lambda: sender.push(sd))
    return first, steady


def dbsync_load(root: str, sd: dict[str, torch.Tensor], verify: bool) -> float:
    dest = {k: torch.empty_like(t) for k, t in sd.items()}

    def apply(pairs) -> None:
        for name, tensor in pairs:
            dest[name].copy_(tensor)

    with dbsync.Receiver(root) as receiver:
        seconds = best_of(3, lambda: receiver.load(apply, verify=verify))
    assert all(torch.equal(dest[k], sd[k]) for k in list(sd)[:3])
    return seconds


def torchrl_path(directory: str, sd: dict[str, torch.Tensor], threads: int, durable: bool
                 ) -> tuple[float, float]:
    """torchrl's double-buffer path: TensorDict(sd).memmap(dir), then load_memmap + copy.
    With ``durable`` every file is fsynced afterwards (tensordict itself never fsyncs)."""
    from tensordict import TensorDict

    def write() -> None:
        shutil.rmtree(directory, ignore_errors=True)
        td = TensorDict(sd, batch_size=[])
        td.memmap(directory, num_threads=threads)
        if durable:
            for name in os.listdir(directory):
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    dest = {k: torch.empty_like(t) for k, t in sd.items()}

    def read() -> None:
        td = TensorDict.load_memmap(directory)
        for k in sd:
            dest[k].copy_(td[k])

    return best_of(2, write), best_of(3, read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4", help="GiB, comma separated")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--dir", default=os.path.join(os.getcwd(), ".bench-store"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    machine = (f"{socket.gethostname()}: {os.cpu_count()} cores, {platform.machine()}, "
               f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM")
    print(f"machine: {machine}; dir: {args.dir}; threads: {args.threads}")
    results = []
    for gib in (float(s) for s in args.sizes.split(",")):
        sd = model_like_state_dict(int(gib * 2**30))
        size = nbytes(sd)
        gb = size / 1e9
        row: dict[str, float | str] = {"size_gib": round(size / 2**30, 2), "tensors": len(sd)}
        raw_dir, root, trl = (os.path.join(args.dir, x) for x in ("raw", "store", "torchrl"))
        row["raw_write_durable"] = gb / raw_write(raw_dir, sd, args.threads, durable=True)
        row["raw_write"] = gb / raw_write(raw_dir, sd, args.threads, durable=False)
        row["raw_read_copy"] = gb / raw_read(raw_dir, sd, args.threads)
        shutil.rmtree(raw_dir)
        first, steady = dbsync_push(root, sd, args.threads, durable=True)
        row["push_durable_first"], row["push_durable_steady"] = gb / first, gb / steady
        first, steady = dbsync_push(root, sd, args.threads, durable=False)
        row["push_nondurable_steady"] = gb / steady
        row["load_verified"] = gb / dbsync_load(root, sd, verify=True)
        row["load_unverified"] = gb / dbsync_load(root, sd, verify=False)
        shutil.rmtree(root)
        w, r = torchrl_path(trl, sd, args.threads, durable=True)
        row["torchrl_write_fsynced"], row["torchrl_load_copy"] = gb / w, gb / r
        w, _ = torchrl_path(trl, sd, args.threads, durable=False)
        row["torchrl_write"] = gb / w
        shutil.rmtree(trl)
        row["ratio_push_vs_raw_durable"] = row["push_durable_steady"] / row["raw_write_durable"]
        row["ratio_load_verified_vs_raw"] = row["load_verified"] / row["raw_read_copy"]
        row["ratio_load_unverified_vs_raw"] = row["load_unverified"] / row["raw_read_copy"]
        row["ratio_push_vs_torchrl_fsynced"] = (row["push_durable_steady"]
                                                / row["torchrl_write_fsynced"])
        results.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                         indent=1), flush=True)
        del sd
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "threads": args.threads, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
