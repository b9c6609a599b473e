"""On 2 GPUs: the sender stalls in the middle of a push while the receiver takes it through
``receive(params)`` (the fused verify + copy passes, queued on the device before their buckets
land). The receiver must give up within its timeout, leave its own CUDA stream usable (a
synchronize returns at once), hold no byte of another bucket in any tensor before the
filesystem repairs them (passes queued for buckets that never landed write nothing), take the
version from the filesystem, exact, and take the next version over the broadcast again.

    python bench/check_fused_stall.py [--timeout 4] [--out result.json]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {f"w{i}": (2048, 2048) for i in range(32)}  # 256 MiB of float32


def weights_for(version: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(version)
    return {n: torch.randn(s, device=device, generator=g) for n, s in SHAPES.items()}


def receiver(root: str, timeout: float, q: Any) -> None:
    from dbsync.nccl import BroadcastReceiver

    faulthandler.dump_traceback_later(120, exit=True)
    torch.cuda.set_device(1)
    rx = BroadcastReceiver(root, device="cuda:1", timeout=timeout, address="127.0.0.1")
    params = {n: torch.zeros(s, device="cuda:1") for n, s in SHAPES.items()}
    provenance: list[dict[str, Any]] = []
    load_fs = rx._load_fs

    before: dict[str, torch.Tensor] = {}

    def checked_load_fs(load_weights: Any, version: int, **kwargs: Any) -> int:
        # Before the filesystem repairs them: every element of every tensor must hold this
        # version's value or what it held before this receive, never bytes of another bucket.
        new, old = weights_for(version, "cuda:1"), before
        foreign = sum(int((~((params[n] == new[n]) | (params[n] == old[n]))).sum())
                      for n in SHAPES)
        provenance.append({"version": version, "foreign_elements": foreign})
        return load_fs(load_weights, version, **kwargs)

    rx._load_fs = checked_load_fs  # type: ignore[method-assign]
    q.put("ready")
    for _ in range(3):
        before.update({n: p.clone() for n, p in params.items()})
        t0 = time.monotonic()
        version = rx.receive(params, timeout=60)
        took = time.monotonic() - t0
        t1 = time.monotonic()
        torch.cuda.current_stream().synchronize()  # hangs if the stream waits on a dead push
        sync = time.monotonic() - t1
        expected = weights_for(int(version or 0), "cuda:1")
        exact = all(torch.equal(params[n], expected[n]) for n in SHAPES)
        q.put(json.dumps({"version": version, "source": rx.last_source, "error": rx.last_error,
                          "seconds": took, "sync_seconds": sync, "exact": exact,
                          "before_filesystem": provenance[-1:]}))
    rx.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=4.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(180, exit=True)  # say where it hung
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from dbsync import Sender
    from dbsync.nccl import BroadcastSender, outgoing

    torch.cuda.set_device(0)
    root = tempfile.mkdtemp(prefix="dbsync-fused-stall-")
    sender = Sender(root, durable=False)
    bs = BroadcastSender(sender, address="127.0.0.1", device="cuda:0", timeout=args.timeout,
                         join_timeout=60.0, bucket_bytes=32 * 2**20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rx = ctx.Process(target=receiver, args=(root, args.timeout, q))
    rx.start()
    assert q.get(timeout=120) == "ready"
    assert bs.wait_for_joins(1, 120)
    bs.prepare()
    out: dict[str, Any] = {"timeout": args.timeout}

    out["v1"] = bs.push(weights_for(1, "cuda:0"))
    out["take_1"] = json.loads(q.get(timeout=120))

    pack = outgoing.OutgoingStream._pack

    def stalling_pack(self: Any, b: int, *rest: Any) -> Any:
        if b == 4:  # buckets 0-3 are out; the receiver's passes for 4.. wait on the device
            time.sleep(args.timeout + 2)
        return pack(self, b, *rest)

    outgoing.OutgoingStream._pack = stalling_pack  # type: ignore[method-assign]
    t0 = time.monotonic()
    out["v2"] = bs.push(weights_for(2, "cuda:0"))
    out["push_2_seconds"] = time.monotonic() - t0
    out["push_2_error"] = bs.last_push_stats.get("error")
    outgoing.OutgoingStream._pack = pack  # type: ignore[method-assign]
    out["take_2"] = json.loads(q.get(timeout=120))

    assert bs.wait_for_joins(1, 120)
    out["v3"] = bs.push(weights_for(3, "cuda:0"))
    out["take_3"] = json.loads(q.get(timeout=120))
    rx.join(60)
    bs.close()
    sender.close()
    t1, t2, t3 = out["take_1"], out["take_2"], out["take_3"]
    out["ok"] = (t1["source"] == "broadcast" and t1["exact"] and t2["version"] == 2
                 and t2["source"] == "filesystem" and t2["exact"]
                 and t2["before_filesystem"][0]["foreign_elements"] == 0
                 and t2["sync_seconds"] < 1.0 and t2["seconds"] < 3 * args.timeout + 5
                 and t3["source"] == "broadcast" and t3["exact"] and t3["version"] == 3)
    print(json.dumps(out, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
