"""Where a verified load of 256 MiB as 20,000 tensors loses against 256 tensors: the same
loads with parts of the kept plan's destination check moved or taken out. Timing only: the
variants other than ``full`` skip or move a safety check and must never ship.

    python bench/probe_check_split.py                   # JSON=path ROUNDS=3 N=12 DIR=/tmp

Variants (alternated per round): ``full`` (as shipped: addresses and torch's tensor-match
check beside the hashing); ``noaddr`` (the tensor-match check only: the addresses not looked
at); ``addr_serial`` (the addresses looked at after the hashing, before the copy starts);
``addr_piped`` (the addresses looked at while the copy's reads run). Each row: best and median
load time in ms, and the phases of the best load (ms from the call)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from typing import Any

import torch

import dbsync
from dbsync import snapshot as rx_module
from dbsync import tensorstate

THREADS = 8
MIB = 256
PHASES: dict[str, float] = {}
KEPT: list[Any] = [None]
_MATCHES = tensorstate.States.matches
_COPY = rx_module.Snapshot._copy
_BUMP = rx_module._bump_versions


def weights(total: int, count: int) -> dict[str, torch.Tensor]:
    numel = max(1, total // 2 // count)
    g = torch.Generator().manual_seed(0)
    flat = torch.randint(-(2**15), 2**15 - 1, (numel * count,), dtype=torch.int16,
                         generator=g).view(torch.bfloat16)
    return {f"model.layers.{i // 64}.experts.{i % 64}.w": flat[i * numel:(i + 1) * numel].clone()
            for i in range(count)}


def guards_only(self: Any, tensors: Any) -> bool:
    if len(tensors) != len(self.columns[0]):
        return False
    chunk = tensorstate.CHUNK
    return all(match.check(*tensors[k * chunk:(k + 1) * chunk])
               for k, match in enumerate(self._match))


def check_addresses(plan: Any) -> None:
    data_ptr, kept, chunk = torch.Tensor.data_ptr, KEPT[0], tensorstate.CHUNK
    targets = plan.raw_destinations
    for lo in range(0, len(targets), chunk):
        if list(map(data_ptr, targets[lo:lo + chunk])) != kept[lo:lo + chunk]:
            raise AssertionError("a destination moved")


def copy_serial(self: Any, plan: Any, *args: Any, **kwargs: Any) -> None:
    check_addresses(plan)
    _COPY(self, plan, *args, **kwargs)


def copy_piped(self: Any, plan: Any, *args: Any, **kwargs: Any) -> None:
    def bump(tensors: Any, drop: bool) -> None:  # (runs once the first reads are queued)
        check_addresses(plan)
        _BUMP(tensors, drop)

    rx_module._bump_versions = bump
    try:
        _COPY(self, plan, *args, **kwargs)
    finally:
        rx_module._bump_versions = _BUMP


MODES = {"full": (_MATCHES, _COPY), "noaddr": (guards_only, _COPY),
         "addr_serial": (guards_only, copy_serial), "addr_piped": (guards_only, copy_piped)}


def timed(name: str, method: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        PHASES[name + "_in"] = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            PHASES[name + "_out"] = time.perf_counter()
    return wrapper


def main() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    snapshot = rx_module.Snapshot
    snapshot._plan_copy = timed("plan", snapshot._plan_copy)
    base = tempfile.mkdtemp(dir=os.environ.get("DIR", "/tmp"))
    stores = {}
    for count in (256, 20000):
        root = os.path.join(base, f"c{count}")
        state = weights(MIB << 20, count)
        with dbsync.Sender(root, num_threads=THREADS) as sender:
            sender.push(state)
            sender.push(state)
        stores[count] = (root, {k: torch.empty_like(v) for k, v in state.items()})
    rows = []
    n = int(os.environ.get("N", "12"))
    for rnd in range(int(os.environ.get("ROUNDS", "3"))):
        for mode, (matches, copy) in MODES.items():
            row: dict[str, Any] = {"round": rnd, "mode": mode}
            for count, (root, dest) in stores.items():
                with dbsync.Receiver(root) as receiver:
                    tensorstate.States.matches, snapshot._copy = _MATCHES, _COPY
                    receiver.load(dest, threads=THREADS)  # (plans the copy)
                    KEPT[0] = list(map(torch.Tensor.data_ptr, dest.values()))
                    tensorstate.States.matches, snapshot._copy = matches, timed("copy", copy)
                    times, phases = [], []
                    for _ in range(n):
                        PHASES.clear()
                        t = time.perf_counter()
                        receiver.load(dest, threads=THREADS)
                        times.append(time.perf_counter() - t)
                        phases.append({k: (v - t) * 1e3 for k, v in PHASES.items()})
                    tensorstate.States.matches, snapshot._copy = _MATCHES, _COPY
                best = min(range(n), key=times.__getitem__)
                row[str(count)] = {"best_ms": times[best] * 1e3,
                                   "median_ms": statistics.median(times) * 1e3,
                                   "best_phases": phases[best]}
            row["ratio_best"] = row["20000"]["best_ms"] / row["256"]["best_ms"]
            row["ratio_median"] = row["20000"]["median_ms"] / row["256"]["median_ms"]
            rows.append(row)
            print(f"r{rnd} {mode:12s} 256: {row['256']['best_ms']:.1f}/"
                  f"{row['256']['median_ms']:.1f} ms  20,000: {row['20000']['best_ms']:.1f}/"
                  f"{row['20000']['median_ms']:.1f} ms  ratio {row['ratio_best']:.2f}/"
                  f"{row['ratio_median']:.2f}", flush=True)
    with open(os.environ.get("JSON", "/tmp/probe_check_split.json"), "w") as f:
        json.dump({"machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
