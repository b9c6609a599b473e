"""Where a kept copy plan's destination check spends its time at 20,000 tensors (256 MiB of
bf16): each part alone, with the tensors' memory in the caches ("warm") or pushed out by a
256 MiB copy first ("cold", as after a load), and beside 8 threads hashing 256 MiB.

    python bench/probe_destination_check.py [--json OUT]

Parts: the name lookups (``dest.get``), the addresses (``Tensor.data_ptr``: three dependent
loads per tensor, Python object -> tensor -> storage), torch's tensor-match check (a chunk of
tensors per call), and the whole ``States.matches`` as a load runs it. Medians and minimums of
9 runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from dbsync.tensorstate import CHUNK, States

COUNT = 20000
TOTAL = 256 << 20
HASH_THREADS = 8
HASH_PIECE = 4 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    numel = TOTAL // 2 // COUNT
    dest = {f"model.layers.{i // 64}.experts.{i % 64}.w": torch.empty(numel, dtype=torch.bfloat16)
            for i in range(COUNT)}
    names = list(dest)
    targets = list(map(dest.get, names))
    states = States.of(targets)
    assert states is not None and states._match is not None, "torch's check is not usable"
    big, big2 = torch.empty(TOTAL, dtype=torch.uint8), torch.empty(TOTAL, dtype=torch.uint8)
    hashed = memoryview(bytearray(TOTAL))
    pool = ThreadPoolExecutor(HASH_THREADS)
    address = torch.Tensor.data_ptr

    def evict() -> None:
        big2.copy_(big)

    def start_hashing() -> list[Future]:
        def run(lo: int, hi: int) -> None:
            for off in range(lo, hi, HASH_PIECE):
                xxhash.xxh3_64_hexdigest(hashed[off:off + HASH_PIECE])
        step = TOTAL // HASH_THREADS
        return [pool.submit(run, k * step, (k + 1) * step) for k in range(HASH_THREADS)]

    def guards() -> None:
        for k, match in enumerate(states._match):
            match.check(*targets[k * CHUNK:(k + 1) * CHUNK])

    def hash_all() -> None:
        for f in start_hashing():
            f.result()

    def matches_and_hashing() -> None:
        futures = start_hashing()
        states.matches(list(map(dest.get, names)))
        for f in futures:
            f.result()

    results: dict[str, dict[str, float]] = {}

    def measure(name: str, fn: Callable[[], object], cold: bool, hashing: bool = False) -> None:
        times = []
        for _ in range(9):
            if cold:
                evict()
            futures = start_hashing() if hashing else []
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            for f in futures:
                f.result()
        results[name] = {"min_ms": min(times), "median_ms": statistics.median(times)}
        print(f"{name:40s} min {min(times):6.2f}  median {statistics.median(times):6.2f} ms",
              flush=True)

    measure("hashing alone", hash_all, True)
    for cold in (False, True):
        tag = "cold" if cold else "warm"
        measure(f"name lookups, {tag}", lambda: list(map(dest.get, names)), cold)
        measure(f"addresses, {tag}", lambda: list(map(address, targets)), cold)
        measure(f"tensor-match check, {tag}", guards, cold)
        measure(f"States.matches, {tag}", lambda: states.matches(list(map(dest.get, names))),
                cold)
    measure("States.matches, cold, beside hashing",
            lambda: states.matches(list(map(dest.get, names))), True, hashing=True)
    measure("hashing and States.matches, both done", matches_and_hashing, True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                   "torch": torch.__version__},
                       "config": {"tensors": COUNT, "bytes": TOTAL, "chunk": CHUNK,
                                  "hash_threads": HASH_THREADS},
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
