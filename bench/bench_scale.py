"""Cost that must not grow with the model's tensor count, the trainer's push rate, or the
receiver's kind of model; each against a limit measured in the same run.

    python bench/bench_scale.py [--mib 256] [--counts 256,4000,20000] [--dir DIR] [--json OUT]

Before/after on the same machine: ``PYTHONPATH=DIR python bench/bench_scale.py ...`` imports
``dbsync`` from DIR (a copy of an older revision); ``config.code`` says which ran.

Sections (all in one process whose soft open-file limit is lowered to 1,024, the common
default):
- tensor count: the same bytes as N bf16 tensors: durable push (steady state: both slots
  already hold files), verified load into existing tensors (of a version loaded before, and
  of a new version, whose index the receiver reads first), ``latest_version()``; ratios
  against the N=256 row, plus the raw in-place durable write of the same bytes as a reference;
- async push: back-to-back ``push(blocking=False)`` calls while the previous version is still
  being written, against a plain copy of the same bytes into a preallocated host buffer (the
  snapshot the trainer cannot avoid);
- load into a plain module: ``Receiver.load(module)`` unverified against raw parallel
  ``preadv`` of the same bytes into the same parameters; verified against one parallel
  checksum pass plus one parallel copy pass over the same mapping (the verify-before-apply
  limit).
Hazard: run on an otherwise idle machine; the page cache is warm for reads.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import resource
import shutil
import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash
from bench_store import best_of  # bench/ is on sys.path when run as a script

import dbsync
from dbsync.fileio import tensor_bytes

THREADS = 8
#: timed loads per row (steady state: after one untimed load that plans the copy); single
#: loads of 20,000 tensors vary by several milliseconds on a busy host, so the best of a few
LOADS = 7


def weights(total: int, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    numel = max(1, total // 2 // count)
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(-(2**15), 2**15 - 1, (numel * count,), dtype=torch.int16,
                         generator=g).view(torch.bfloat16)
    return {f"model.layers.{i // 64}.experts.{i % 64}.w": flat[i * numel:(i + 1) * numel]
            for i in range(count)}


def raw_durable_write(path: str, data: memoryview) -> float:
    """Parallel pwrite of the same bytes into one preallocated file, then fsync."""
    with open(path, "wb") as f:
        f.truncate(len(data))
    chunk = 16 << 20
    fd = os.open(path, os.O_WRONLY)
    try:
        def one(off: int) -> None:
            view = data[off:off + chunk]
            while view:
                n = os.pwrite(fd, view, off)
                view, off = view[n:], off + n

        def run() -> None:
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(one, range(0, len(data), chunk)))
            os.fsync(fd)

        run()
        return best_of(3, run)
    finally:
        os.close(fd)


def tensor_count_section(base: str, total: int, counts: list[int]) -> dict:
    rows = {}
    for count in counts:
        root = os.path.join(base, f"count{count}")
        sd = weights(total, count)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        with dbsync.Sender(root, num_threads=THREADS) as sender:
            sender.push(sd)
            sender.push(sd)  # both slots hold files: steady state from here on
            push = best_of(3, lambda sender=sender, sd=sd: sender.push(sd))
            with dbsync.Receiver(root) as rx:  # each load a new version: its index is read
                rx.load(dest, threads=THREADS)  # (the copy is planned once, not timed)
                fresh = []
                for _ in range(LOADS):
                    sender.push(sd)
                    t = time.perf_counter()
                    rx.load(dest, threads=THREADS)
                    fresh.append(time.perf_counter() - t)
        with dbsync.Receiver(root) as rx:
            rx.load(dest, threads=THREADS)  # (the copy is planned once, not timed)
            load = best_of(LOADS, lambda rx=rx, dest=dest: rx.load(dest, threads=THREADS))
            assert all(torch.equal(dest[k].view(torch.int16), sd[k].view(torch.int16))
                       for k in list(sd)[:: max(1, count // 16)])
            lat = []
            for _ in range(300):
                t = time.perf_counter()
                rx.latest_version()
                lat.append(time.perf_counter() - t)
        rows[count] = {"push_s": push, "verified_load_s": load,
                       "verified_load_new_version_s": min(fresh),
                       "latest_version_ms": statistics.median(lat) * 1e3}
        shutil.rmtree(root)
    flat = torch.cat([t.reshape(-1) for t in weights(total, counts[0]).values()])
    raw = raw_durable_write(os.path.join(base, "raw.bin"), tensor_bytes(flat))
    first = rows[counts[0]]
    for row in rows.values():
        row["push_vs_first"] = row["push_s"] / first["push_s"]
        row["load_vs_first"] = row["verified_load_s"] / first["verified_load_s"]
        row["load_new_version_vs_first"] = (row["verified_load_new_version_s"]
                                            / first["verified_load_new_version_s"])
        row["push_raw_ratio"] = raw / row["push_s"]
    return {"bytes": int(flat.numel() * 2), "raw_durable_write_s": raw,
            "rows": {str(k): v for k, v in rows.items()}}


def async_section(base: str, total: int, count: int) -> dict:
    sd = weights(total, count)
    buf = torch.empty(total // 2 * 2 + 64 * count, dtype=torch.uint8)

    def plain_copy() -> None:
        off = 0
        for t in sd.values():
            n = t.numel() * 2
            buf[off:off + n].view(torch.bfloat16).copy_(t)
            off += -(-n // 64) * 64

    plain_copy()
    snapshot = best_of(5, plain_copy)
    root = os.path.join(base, "async")
    returns, overlapped = [], 0
    with dbsync.Sender(root, num_threads=THREADS) as sender:
        for f in [sender.push(sd, blocking=False) for _ in range(2)]:  # warm both buffers
            f.result()
        busy_copies = []
        for _ in range(5):
            # the same plain copy while a push writes (2 cores: the writer competes for them)
            first = sender.push(sd, blocking=False)
            t = time.perf_counter()
            plain_copy()
            busy_copies.append(time.perf_counter() - t)
            first.result()
            # push, then push again at once: the second call finds the first still writing
            first = sender.push(sd, blocking=False)
            t = time.perf_counter()
            second = sender.push(sd, blocking=False)
            returns.append(time.perf_counter() - t)
            overlapped += not first.done()
            first.result()
            second.result()
    shutil.rmtree(root)
    median = statistics.median(returns)
    busy = statistics.median(busy_copies)
    return {"bytes": total, "tensors": count, "plain_snapshot_copy_s": snapshot,
            "plain_snapshot_copy_while_a_push_writes_s": busy,
            "push_nonblocking_return_s_median": median,
            "push_nonblocking_return_s_max": max(returns), "ratio": median / snapshot,
            "ratio_to_copy_while_a_push_writes": median / busy,
            "returned_while_previous_still_writing": f"{overlapped}/{len(returns)}"}


def module_section(base: str, total: int, count: int) -> dict:
    sd = weights(total, count)
    root = os.path.join(base, "module")
    module = torch.nn.Module()
    for i, t in enumerate(sd.values()):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty_like(t),
                                                              requires_grad=False))
    params = dict(module.named_parameters())
    with dbsync.Sender(root, num_threads=THREADS) as sender:  # under the module's names
        sender.push({f"p{i}": t for i, t in enumerate(sd.values())})
    rx = dbsync.Receiver(root)
    manifest = rx.manifest()
    slot_dir = os.path.join(root, "slots", manifest.slot)
    shard_fds = {i: os.open(os.path.join(slot_dir, f"shard-{i:05d}.bin"), os.O_RDONLY)
                 for i in range(len(manifest.shards))}
    entries = list(manifest.tensors)
    groups = [entries[i::THREADS] for i in range(THREADS)]

    def raw_preadv() -> None:
        def one(group: list) -> None:
            for e in group:
                os.preadv(shard_fds[e.shard], [tensor_bytes(params[e.name].data, writable=True)],
                          e.offset)

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, groups))

    maps = {i: mmap.mmap(fd, manifest.shards[i], access=mmap.ACCESS_READ)
            for i, fd in shard_fds.items()}

    def checksum_pass() -> None:
        def one(group: list) -> None:
            for e in group:
                xxhash.xxh3_64_hexdigest(memoryview(maps[e.shard])[e.offset:e.offset + e.nbytes])

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, groups))

    def copy_pass() -> None:
        def one(group: list) -> None:
            for e in group:
                src = torch.frombuffer(maps[e.shard], dtype=torch.uint8, count=e.nbytes,
                                       offset=e.offset)
                params[e.name].data.view(torch.uint8).reshape(-1).copy_(src)

        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, groups))

    raw_preadv()
    raw = best_of(LOADS, raw_preadv)
    checksum_pass()
    limit_verified = best_of(LOADS, checksum_pass) + best_of(LOADS, copy_pass)
    rx.load(module, verify=False, threads=THREADS)  # (the copy is planned once, not timed)
    unverified = best_of(LOADS, lambda: rx.load(module, verify=False, threads=THREADS))
    verified = best_of(LOADS, lambda: rx.load(module, verify=True, threads=THREADS))
    assert all(torch.equal(params[f"p{i}"].view(torch.int16), t.view(torch.int16))
               for i, t in enumerate(sd.values()))
    for m in maps.values():
        m.close()
    for fd in shard_fds.values():
        os.close(fd)
    rx.close()
    shutil.rmtree(root)
    return {"bytes": total, "tensors": count, "raw_parallel_preadv_s": raw,
            "load_unverified_s": unverified, "unverified_ratio_to_raw": raw / unverified,
            "checksum_plus_copy_s": limit_verified, "load_verified_s": verified,
            "verified_over_limit": verified / limit_verified}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--counts", default="256,4000,20000")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    base = tempfile.mkdtemp(prefix="dbsync-bench-", dir=args.dir)
    total = args.mib << 20
    counts = [int(c) for c in args.counts.split(",")]
    try:
        result = {
            "machine": {"host": socket.gethostname(), "cpus": os.cpu_count(),
                        "platform": platform.platform(), "torch": torch.__version__},
            "config": {"mib": args.mib, "threads": THREADS, "timed_loads": LOADS,
                       "nofile_soft": 1024, "dir": base, "code": os.path.dirname(os.path.dirname(
                           os.path.abspath(dbsync.__file__)))},
            "tensor_count": tensor_count_section(base, total, counts),
            "async_push": async_section(base, total, counts[0]),
            # (at the largest count too: the snapshot's per-tensor Python work shows there)
            "async_push_many": async_section(base, total, counts[-1]),
            "load_module": module_section(base, total, counts[0]),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
