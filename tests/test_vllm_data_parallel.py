"""serve-vllm with vLLM's data parallelism (``-- --data-parallel-size 2``): one API server
balancing two engines, each with a worker of its own that reads the store. Every swap reaches
both engines in one pause: after each push, requests sent at once (which the server spreads
over its engines) all answer as a fresh engine of the pushed checkpoint, from both engines;
and requests sent back to back across a swap each answer as the one version they name."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dbsync
from tests.vllm_helpers import (
    MAX_TOKENS,
    PROMPTS,
    Server,
    complete,
    reference,
    scrape_metrics,
    tiny_model,
    wait_until,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINES = 2
_SUCCESS = re.compile(r'^vllm:request_success_total\{.*engine="(\d+)"')


def _successes_by_engine(base: str) -> dict[str, float]:
    """Requests each engine finished so far, from vLLM's ``/metrics`` (one label per engine)."""
    counts: dict[str, float] = {}
    for key, value in scrape_metrics(base, prefix="vllm:request_success_total").items():
        if (match := _SUCCESS.match(key)) is not None:
            counts[match.group(1)] = counts.get(match.group(1), 0.0) + value
    return counts


def _labelled(base: str, model: str, prompt: str) -> tuple[str, str]:
    """A greedy completion of ``prompt``, and the versions that computed it."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0.0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        text = json.loads(response.read())["choices"][0]["text"]
        return text, response.headers["x-dbsync-versions"]


def test_every_engine_of_a_data_parallel_server_serves_each_pushed_version(
        tmp_path: Path) -> None:
    fresh_b = reference("B")
    model_a, model_b = tiny_model("A"), tiny_model("B")
    store = tmp_path / "store"
    with dbsync.Sender(store) as sender, \
            Server(store, model_a, tmp_path / "server.log",
                   "--data-parallel-size", str(ENGINES)) as server:
        server.wait_ready()
        served_a = [complete(server.base, server.model, prompt) for prompt in PROMPTS]
        assert served_a != fresh_b.result()
        texts: dict[str, list[str]] = {}
        for checkpoint, expected in ((model_b, fresh_b.result()), (model_a, served_a)):
            if texts:  # (the second swap: with requests in flight on both engines)
                version = _push_under_load(sender, server, checkpoint, expected, texts)
            else:
                version = sender.push(checkpoint)
            texts[str(version)] = expected
            status = server.wait_version(version)
            assert status["healthy"] and status["last_error"] is None
            before = _successes_by_engine(server.base)
            with ThreadPoolExecutor(16) as pool:  # (at once: the server spreads them)
                answers = list(pool.map(lambda p: complete(server.base, server.model, p),
                                        PROMPTS * 8))
            assert answers == expected * 8
            after = _successes_by_engine(server.base)
            served_by = {e for e, n in after.items() if n > before.get(e, 0.0)}
            assert served_by == {str(e) for e in range(ENGINES)}, (before, after)
            applied_by = set(re.findall(rf"worker pid (\d+) applied version {version} ",
                                        server.tail(400_000)))
            assert len(applied_by) == ENGINES, server.tail(4000)


def _push_under_load(sender: dbsync.Sender, server: Server, checkpoint: Path,
                     expected: list[str], texts: dict[str, list[str]]) -> int:
    """Push ``checkpoint`` (whose texts of ``PROMPTS`` are ``expected``) while 8 clients send
    requests back to back; every response that one version computed must be that version's
    text (``texts``: version -> its texts); responses held by the pause across the swap name
    both versions and are not compared."""
    stop = threading.Event()
    answered: list[tuple[int, str, str]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            while not stop.is_set():
                text, versions = _labelled(server.base, server.model, PROMPTS[i % len(PROMPTS)])
                answered.append((i % len(PROMPTS), text, versions))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(answered) >= 8 or errors, 60, 0.05, "the clients to run")
        version = sender.push(checkpoint)
        server.wait_version(version)
        after = len(answered)
        wait_until(lambda: len(answered) >= after + 8 or errors, 60, 0.05,
                   "answers after the swap")
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert not errors, errors
    texts = {**texts, str(version): expected}
    whole = [(p, text, v) for p, text, v in answered if "," not in v]
    assert {v for _, _, v in whole} == {str(version - 1), str(version)}, answered
    assert all(text == texts[v][p] for p, text, v in whole), whole
    return version
