"""What HTTP clients of ``serve-vllm`` see while versions are swapped in under load, per pause
mode, against the same clients with no pushes in the same run.

    python bench/bench_clients.py [--modes keep wait abort] [--seconds 40] [--period 0.5]
                                  [--clients 8] [--json OUT.json]

Per mode: one ``serve-vllm`` (tiny Qwen2, CPU) from checkpoint A. The greedy text of every
prompt (completions and chat) is taken from A and from B (B pushed once), then the baseline:
the clients alone for ``--seconds / 4``. Then ``--clients`` threads send requests back to back
(24 tokens, completions or chat, streamed or not, at random) while the trainer pushes B and A
in turn every ``--period`` seconds. Recorded: HTTP errors, streams ending without a finish,
finish reasons, responses spanning two versions, responses labelled with one version whose
text is not that version's greedy text, latency, and whether the server caught up with the
last push. The outcome that matters is the text: a response labelled version V must be what
V's weights say.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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
from dbsync.testing import Server, make_tiny_qwen2, wait_until  # noqa: E402

PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w7", "w100 w200 w300 w5 w6 w8"]
MAX_TOKENS = 24


def request(base: str, model: str, prompt: str, stream: bool, chat: bool) -> dict[str, Any]:
    """One greedy request: its text, finish reason, version labels and latency, or ``error``."""
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw, headers = resp.read(), resp.headers
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    seconds = time.monotonic() - started
    if not stream:
        choice = json.loads(raw)["choices"][0]
        versions = headers.get("x-dbsync-versions")
        return {"text": choice["message"]["content"] if chat else choice["text"],
                "finish": choice["finish_reason"], "seconds": seconds,
                "versions": versions.split(",") if versions else []}
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return {"error": "stream ended without [DONE]"}
    text, finish, versions = "", None, []
    for event in map(json.loads, events[:-1]):
        versions = [str(v) for v in event.get("dbsync_versions", versions)]
        for choice in event["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            finish = choice["finish_reason"] or finish
    if finish is None:
        return {"error": "stream ended without a finish_reason"}
    return {"text": text, "finish": finish, "seconds": seconds, "versions": versions}


def run_clients(base: str, model: str, clients: int, seconds: float,
                during: Any = None) -> list[dict[str, Any]]:
    """``clients`` threads sending requests back to back for ``seconds`` (``during`` runs in
    the calling thread meanwhile, given the stop event)."""
    stop, results, lock = threading.Event(), [], threading.Lock()

    def client(seed: int) -> None:
        rnd = random.Random(seed)
        while not stop.is_set():
            prompt, stream, chat = rnd.choice(PROMPTS), rnd.random() < 0.5, rnd.random() < 0.5
            result = request(base, model, prompt, stream, chat)
            with lock:
                results.append({**result, "prompt": prompt, "chat": chat, "stream": stream})

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    if during is not None:
        during(stop, seconds)
    else:
        stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    return results


def bench_mode(work: Path, mode: str, a: Path, b: Path, args: argparse.Namespace
               ) -> dict[str, Any]:
    store = work / f"store-{mode}"
    with dbsync.Sender(store) as sender, Server(store, a, work / f"server-{mode}.log",
                                                 options=("--pause-mode", mode)) as server:
        sender.push(str(a))
        server.wait_ready(600)
        server.wait_version(1)
        greedy = {}  # (weights, prompt, chat) -> text
        for name, source in (("A", None), ("B", b)):
            if source is not None:
                server.wait_version(sender.push(str(source)))
            for prompt in PROMPTS:
                for chat in (False, True):
                    greedy[name, prompt, chat] = request(server.base, server.model, prompt,
                                                         False, chat)["text"]
        baseline = run_clients(server.base, server.model, args.clients, args.seconds / 4)
        weights = {1: "A", 2: "B"}

        def trainer(stop: threading.Event, seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                name = "B" if sender.next_version % 2 == 0 else "A"
                weights[sender.push(str(b if name == "B" else a))] = name
                stop.wait(min(args.period, max(0.0, deadline - time.monotonic())))

        loaded = run_clients(server.base, server.model, args.clients, args.seconds, trainer)
        last = sender.latest_version()
        caught_up = bool(wait_until(lambda: server.status()["version"] == last, 60, 0.1,
                                    f"version {last}"))
        status = server.status()
    answered = [r for r in loaded if "error" not in r]
    wrong = [r for r in answered if len(r["versions"]) == 1 and r["finish"] != "abort"
             and r["text"] != greedy[weights[int(r["versions"][0])], r["prompt"], r["chat"]]]
    finishes: dict[str, int] = {}
    for r in answered:
        finishes[r["finish"]] = finishes.get(r["finish"], 0) + 1

    def latency(results: list[dict[str, Any]]) -> dict[str, float]:
        times = sorted(r["seconds"] for r in results if "seconds" in r)
        return {"p50_s": statistics.median(times), "p99_s": times[int(len(times) * 0.99)]}

    return {
        "mode": mode, "requests": len(loaded), "versions_pushed_under_load": len(weights) - 2,
        "errors": [r["error"] for r in loaded if "error" in r],
        "spanning_two_versions": sum(len(r["versions"]) > 1 for r in answered),
        "finishes": finishes,
        "aborted_before_first_token": sum(not r["versions"] for r in answered),
        "wrong_text_for_its_version": len(wrong),
        "latency": latency(answered), "baseline_latency": latency(baseline),
        "baseline_requests": len(baseline), "caught_up": caught_up,
        "swaps": status["swaps"], "refused": status["refused_versions"],
        "last_error": status["last_error"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["keep", "wait", "abort"])
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--period", type=float, default=0.5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dbsync-bench-clients-"))
    a, b = make_tiny_qwen2(work / "A", seed=1), make_tiny_qwen2(work / "B", seed=2)
    result = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} cores, CPU only",
        "configuration": {"seconds": args.seconds, "period_s": args.period,
                          "clients": args.clients, "max_tokens": MAX_TOKENS},
        "modes": [bench_mode(work, mode, a, b, args) for mode in args.modes],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
