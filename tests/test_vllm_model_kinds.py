"""Kinds of model whose layers keep a copy of their weights in a layout of their own on vLLM's
CPU build, which vLLM's weight update left stale (the engine then served neither version while
reporting the new one): each pushed version is served whole, as a fresh engine of the same
checkpoint serves it. A mixture-of-experts model (the experts are padded and prepacked for the
grouped GEMM), and a model whose LM head is tied to the token embedding (the head keeps a
prepacked copy of the shared weight, which checkpoints store once, under the embedding's
name). One server per test."""

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

        # a trainer's module: transformers keeps each layer's experts fused in memory
        # (mlp.experts.gate_up_proj), published under the checkpoint's names
        from transformers import AutoModelForCausalLM

        trained_a = AutoModelForCausalLM.from_pretrained(model_a)
        assert any(name.endswith("experts.gate_up_proj") for name in trained_a.state_dict())
        version = sender.push(trained_a)
        status = server.wait_version(version)
        assert answers() == served_a
        assert status["healthy"] and status["refused_versions"] == []
        assert "MoE layer(s) prepare their experts" in server.tail(200_000)


def test_a_tied_lm_head_serves_each_pushed_version(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    expected_b = reference("tied-B")
    model_a, model_b = tiny_model("tied-A"), tiny_model("tied-B")
    store = tmp_path / "store"
    with dbsync.Sender(store) as sender, \
            Server(store, model_a, tmp_path / "server.log") as server:
        server.wait_ready()

        def answers() -> list[str]:
            return [complete(server.base, server.model, prompt) for prompt in PROMPTS]

        served_a = answers()
        fresh_b = expected_b.result()
        assert served_a != fresh_b

        # a checkpoint directory stores the shared weight once: the head receives nothing
        server.wait_version(sender.push(model_b))
        assert answers() == fresh_b
        # a trainer's module names it twice (its state_dict has lm_head.weight too)
        trained_a = AutoModelForCausalLM.from_pretrained(model_a)
        assert "lm_head.weight" in trained_a.state_dict()
        server.wait_version(sender.push(trained_a))
        assert answers() == served_a
        server.wait_version(sender.push(model_b))
        status = server.wait_version(sender.push(model_a))
        assert answers() == served_a
        assert status["healthy"] and status["refused_versions"] == []
        log = server.tail(500_000)
        assert "share a weight with another" in log
        assert "Failed to load weights" not in log
