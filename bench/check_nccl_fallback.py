"""On 2 GPUs: a receiver killed in the middle of an NCCL broadcast costs the sender at most the
timeout, the version is still published on the filesystem, and a surviving receiver (here: a
fresh one) joins the next epoch and takes the next version over NCCL.

    python bench/check_nccl_fallback.py [--timeout 5] [--out result.json]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def receiver(root: str, die: bool, timeout: float, q: Any, newer_than: int | None = None
             ) -> None:
    from dbsync.nccl import BroadcastReceiver

    faulthandler.dump_traceback_later(150, exit=True)
    torch.cuda.set_device(1)
    rx = BroadcastReceiver(root, device="cuda:1", timeout=timeout, address="127.0.0.1")
    q.put("ready")
    seen: list[float] = []

    def load_weights(pairs: Any) -> None:
        for _name, t in pairs:
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
            seen.append(float(t.float().sum()))

    version = rx.receive(load_weights, newer_than=newer_than, timeout=120)
    q.put(json.dumps({"version": version, "source": rx.last_source, "error": rx.last_error,
                      "checksum_of_sums": sum(seen)}))
    rx.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.timeout + 60, exit=True)  # say where it hung
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from dbsync import Receiver, Sender
    from dbsync.nccl import BroadcastSender

    torch.cuda.set_device(0)
    root = tempfile.mkdtemp(prefix="dbsync-nccl-check-")
    weights = {f"w{i}": torch.randn(1024, 1024, device="cuda:0") for i in range(64)}  # 256 MiB
    sender = Sender(root, durable=False)
    bs = BroadcastSender(sender, address="127.0.0.1", device="cuda:0", timeout=args.timeout,
                         join_timeout=60.0, bucket_bytes=8 * 2**20)
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {}
    q = ctx.Queue()
    victim = ctx.Process(target=receiver, args=(root, True, args.timeout, q))
    victim.start()
    assert q.get(timeout=120) == "ready"
    assert bs.wait_for_joins(1, 120)
    out["setup_seconds"] = bs.prepare()
    t0 = time.monotonic()
    out["version_1"] = bs.push(weights)
    out["push_1_seconds"] = time.monotonic() - t0
    out["push_1_stats"] = bs.last_push_stats
    victim.join(30)
    out["victim_exitcode"] = victim.exitcode
    out["published_on_fs"] = Receiver(root).latest_version()

    fresh = ctx.Process(target=receiver, args=(root, False, args.timeout, q))
    fresh.start()
    assert q.get(timeout=120) == "ready"
    first = json.loads(q.get(timeout=120))  # served v1 from the filesystem, then joins
    out["fresh_first"] = first
    fresh2 = ctx.Process(target=receiver, args=(root, False, args.timeout, q, 1))
    fresh.join(30)
    fresh2.start()
    assert q.get(timeout=120) == "ready"
    assert bs.wait_for_joins(1, 120)
    weights2 = {k: v + 1 for k, v in weights.items()}
    t0 = time.monotonic()
    out["version_2"] = bs.push(weights2)
    out["push_2_seconds"] = time.monotonic() - t0
    out["push_2_stats"] = bs.last_push_stats
    out["fresh2"] = json.loads(q.get(timeout=120))
    out["expected_sum_v2"] = sum(float(t.float().sum()) for t in weights2.values())
    fresh2.join(30)
    bs.close()
    sender.close()
    ok = (out["victim_exitcode"] == -9 and out["published_on_fs"] == 1
          and out["push_1_seconds"] < args.timeout + 10 and out["fresh2"]["source"] == "broadcast"
          and out["version_2"] == 2)
    out["ok"] = ok
    print(json.dumps(out, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
