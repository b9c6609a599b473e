"""Swap benchmark: push -> served latency and the generation pause per swap, against vLLM's own
raw reload of the same weights, measured in the same run on the same machine.

    python bench/bench_swap.py [--hidden 1024 --layers 8 --intermediate 2816 --vocab 32000]
                               [--swaps 5 --warmup 2] [--json OUT.json]

1. serve-vllm (a child process, vLLM's AsyncLLM) from checkpoint A on an empty store. Per
   round, each step with its own streaming request in flight: the raw baseline first, vLLM's own
   ``reload_weights`` of the checkpoint directory (page cache warm) on the same serving engine
   through ``/collective_rpc`` (dev mode is turned on for this benchmark only, to reach that
   baseline; ``serve-vllm`` itself never enables it); then a push of the same weights, recording
   the time from ``push`` returning to the version being served (the server's ``loaded_at``)
   and the controller's ``pause_s`` (pause -> start -> update -> finish -> prefix-cache reset
   -> resume), ``apply_s`` (start -> finish) and ``read_verify_s`` (before the pause). Each
   streaming request records the longest gap between its tokens (what a user sees) and must
   receive all of them.
2. an offline ``vllm.LLM`` from A, no other load: raw ``reload_weights`` interleaved with
   dbsync applies (``attach(...).apply_latest()``) of the same weights.

Target: median pause <= 1.2 x median raw reload. On tiny models fixed costs dominate (the
pause, reset and resume round trips).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dbsync  # noqa: E402
from dbsync.testing import (  # noqa: E402 - needs the repo on sys.path
    Server,
    engine_kwargs,
    http_json,
    make_tiny_qwen2,
)


class StreamProbe:
    """One streaming completion in a thread: its chunk times show what a user sees."""

    def __init__(self, base: str, model: str, max_tokens: int = 60):
        self.times: list[float] = []
        self.error: BaseException | None = None
        body = {"model": model, "prompt": "w1 w2 w3", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(f"{base}/v1/completions", body),
                                        daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for line in resp:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        self.times.append(time.perf_counter())
        except BaseException as exc:
            self.error = exc

    def wait_started(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)

    def result(self) -> tuple[int, float, float]:
        """(chunks received, longest gap, median gap)."""
        self._thread.join(600)
        if self.error is not None:
            raise RuntimeError(f"streaming request failed: {self.error}")
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return len(self.times), max(gaps), statistics.median(gaps)


def wait_served(server: Server, version: int, interval: float = 0.02) -> dict[str, Any]:
    while True:
        status = server.status()
        if status["version"] == version:
            return status
        if status["last_error_version"] == version:
            raise RuntimeError(status["last_error"])
        time.sleep(interval)


def bench_server(work: Path, a: Path, b: Path, swaps: int, warmup: int) -> dict[str, Any]:
    """Per round, each with its own streaming request in flight: vLLM's raw reload on the
    serving engine, then a push of the same weights. The status is polled every 20 ms only
    (polling harder steals CPU from the apply on a small machine); push -> served is taken
    from the server's ``loaded_at`` wall clock (same host)."""
    store = work / "store"
    rows = []
    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # bench only: /collective_rpc for the raw baseline
    with dbsync.Sender(store) as sender, Server(store, a, work / "server.log", env=dev) as server:
        server.wait_ready(600)
        for i in range(warmup + swaps):
            src = b if i % 2 == 0 else a
            probe = StreamProbe(server.base, server.model)
            probe.wait_started()
            t0 = time.perf_counter()
            http_json(f"{server.base}/collective_rpc", {
                "method": "reload_weights",
                "kwargs": {"weights_path": str(src), "is_checkpoint_format": True}}, timeout=600)
            t_raw = time.perf_counter() - t0
            raw_chunks, raw_gap, _ = probe.result()

            probe = StreamProbe(server.base, server.model)
            probe.wait_started()
            version = sender.push(str(src))
            returned = time.time()
            status = wait_served(server, version)
            chunks, gap, steady = probe.result()
            t = status["timings"]
            if i >= warmup:
                rows.append({"version": version, "raw_reload_s": t_raw,
                             "push_to_served_s": status["loaded_at"] - returned,
                             "pause_s": t["pause_s"], "apply_s": t["apply_s"],
                             "read_verify_s": t["read_verify_s"],
                             "push_s": sender.last_push_seconds.get("total"),
                             "client_gap_swap_s": gap, "client_gap_raw_s": raw_gap,
                             "client_median_gap_s": steady,
                             "client_chunks": [chunks, raw_chunks]})
    return {"swaps": rows}


def bench_offline(work: Path, a: Path, b: Path, swaps: int, warmup: int) -> dict[str, Any]:
    """One offline engine, no other load: vLLM's raw reload of a checkpoint directory
    (``reload_weights``, files in the page cache) interleaved with dbsync applies of the same
    weights through ``attach(...).apply_latest()``."""
    from vllm import LLM

    from dbsync import vllm as dbsync_vllm

    store = work / "store-offline"
    llm = LLM(model=str(a), **engine_kwargs(**dbsync_vllm.engine_args()))
    raw: list[float] = []
    applies: list[float] = []
    try:
        with dbsync.Sender(store) as sender, dbsync_vllm.attach(llm, store, watch=False) as att:
            for i in range(warmup + swaps):
                src = b if i % 2 == 0 else a
                t0 = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(src),
                                                             "is_checkpoint_format": True})
                t_raw = time.perf_counter() - t0
                sender.push(str(src))
                att.apply_latest()
                if i >= warmup:
                    raw.append(t_raw)
                    applies.append(att.status()["timings"]["apply_s"])
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"raw_reload_s": raw, "dbsync_apply_s": applies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--swaps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2,
                        help="first swaps not counted (one per slot: first use of its files)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="dbsync-bench-swap-"))
    shape = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate,
                 vocab=args.vocab)
    a = make_tiny_qwen2(work / "A", seed=1, **shape)
    b = make_tiny_qwen2(work / "B", seed=2, **shape)
    nbytes = sum(f.stat().st_size for f in b.glob("*.safetensors"))

    server = bench_server(work, a, b, args.swaps, args.warmup)
    offline = bench_offline(work, a, b, args.swaps, args.warmup)
    raw = [r["raw_reload_s"] for r in server["swaps"]]

    pauses = [r["pause_s"] for r in server["swaps"]]
    latency = [r["push_to_served_s"] for r in server["swaps"]]
    result = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores, CPU only",
        "model": {**shape, "bytes": nbytes},
        "server": server,
        "offline": offline,
        "median_pause_s": statistics.median(pauses),
        "median_apply_s": statistics.median(r["apply_s"] for r in server["swaps"]),
        "median_raw_reload_s": statistics.median(raw),
        "median_offline_raw_reload_s": statistics.median(offline["raw_reload_s"]),
        "median_offline_apply_s": statistics.median(offline["dbsync_apply_s"]),
        "median_push_to_served_s": statistics.median(latency),
        "pause_over_raw": statistics.median(pauses) / statistics.median(raw),
    }
    print(f"model: {shape} ({nbytes / 2**20:.0f} MiB float32), machine: {result['machine']}")
    print(f"{'version':>8} {'push->served':>13} {'pause':>9} {'apply':>9} {'verify':>9} "
          f"{'raw reload':>11}")
    for r in server["swaps"]:
        print(f"{r['version']:>8} {r['push_to_served_s'] * 1e3:>10.1f} ms "
              f"{r['pause_s'] * 1e3:>6.1f} ms {r['apply_s'] * 1e3:>6.1f} ms "
              f"{r['read_verify_s'] * 1e3:>6.1f} ms {r['raw_reload_s'] * 1e3:>8.1f} ms")
    print("offline engine, raw reload_weights (same weights, page cache): "
          + ", ".join(f"{t * 1e3:.1f}" for t in offline["raw_reload_s"]) + " ms")
    print("offline engine, dbsync apply (start+update+finish):           "
          + ", ".join(f"{t * 1e3:.1f}" for t in offline["dbsync_apply_s"]) + " ms")
    print(f"server: median pause {result['median_pause_s'] * 1e3:.1f} ms / median raw reload "
          f"{result['median_raw_reload_s'] * 1e3:.1f} ms = {result['pause_over_raw']:.2f}x "
          f"(target <= 1.2x); median push->served {result['median_push_to_served_s'] * 1e3:.1f} ms")
    off_ratio = result["median_offline_apply_s"] / result["median_offline_raw_reload_s"]
    print(f"offline: median apply {result['median_offline_apply_s'] * 1e3:.1f} ms / median raw "
          f"{result['median_offline_raw_reload_s'] * 1e3:.1f} ms = {off_ratio:.2f}x")
    swap_gaps = [r["client_gap_swap_s"] for r in server["swaps"]]
    raw_gaps = [r["client_gap_raw_s"] for r in server["swaps"]]
    print(f"streaming client, longest token gap: median over swaps "
          f"{statistics.median(swap_gaps) * 1e3:.1f} ms, over raw reloads "
          f"{statistics.median(raw_gaps) * 1e3:.1f} ms (median gap between tokens "
          f"{statistics.median(r['client_median_gap_s'] for r in server['swaps']) * 1e3:.1f} ms"
          f"; every request got all its tokens: "
          f"{all(c == [60, 60] for c in (r['client_chunks'] for r in server['swaps']))})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
