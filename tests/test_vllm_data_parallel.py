"""serve-vllm with vLLM's data parallelism (``-- --data-parallel-size 2``): one API server
balancing two engines, each with a worker of its own that reads the store. Every swap reaches
both engines in one pause: after each push, requests sent at once (which the server spreads
over its engines) all answer as a fresh engine of the pushed checkpoint, from both engines."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dbsync
from tests.vllm_helpers import PROMPTS, Server, complete, reference, scrape_metrics, tiny_model

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
        for checkpoint, expected in ((model_b, fresh_b.result()), (model_a, served_a)):
            version = sender.push(checkpoint)
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
