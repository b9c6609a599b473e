"""A mixture-of-experts model served by `serve-vllm` on the CPU build takes each pushed version
whole, its experts included: the CPU kernel keeps them padded and prepacked in a layout of its
own, which vLLM's weight update left in checkpoint layout (the engine then served neither
version, reporting the new one)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dbsync
from tests.vllm_helpers import PROMPTS, Server, complete, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_moe_model_serves_each_pushed_version_experts_included(tmp_path: Path) -> None:
    expected_b = reference("MoE-B")  # a fresh engine of B, started now beside the server
    model_a, model_b = tiny_model("MoE-A"), tiny_model("MoE-B")
    store = tmp_path / "store"
    with dbsync.Sender(store) as sender, \
            Server(store, model_a, tmp_path / "server.log") as server:
        server.wait_ready()

        def answers() -> list[str]:
            return [complete(server.base, server.model, prompt) for prompt in PROMPTS]

        served_a = answers()
        fresh_b = expected_b.result()
        assert served_a != fresh_b  # (the two checkpoints answer differently)

        version = sender.push(model_b)  # an HF checkpoint directory, one tensor per expert
        server.wait_version(version)
        assert answers() == fresh_b

        version = sender.push(model_a)
        status = server.wait_version(version)
        assert answers() == served_a
        assert status["healthy"] and status["refused_versions"] == []
        assert "MoE layer(s) prepare their experts" in server.tail(200_000)
