"""Kinds of model whose layers keep a copy of their weights in a layout of their own on vLLM's
CPU build, which vLLM's weight update left stale (the engine then served neither version while
reporting the new one): each pushed version is served whole, as a fresh engine of the same
checkpoint serves it. A mixture-of-experts model (the experts are padded and prepacked for the
grouped GEMM), and a model whose LM head is tied to the token embedding (the head keeps a
prepacked copy of the shared weight, which checkpoints store once, under the embedding's
name). One server per test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import dbsync
from tests.vllm_helpers import PROMPTS, Server, complete, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@dataclass
class Served:
    """A server of checkpoint ``<kind>-A`` with a Sender on its store, what it answered before
    any push, and what a fresh engine of ``<kind>-B`` answers."""

    sender: dbsync.Sender
    server: Server
    model_a: Path
    model_b: Path
    served_a: list[str]
    fresh_b: list[str]

    def answers(self) -> list[str]:
        return [complete(self.server.base, self.server.model, prompt) for prompt in PROMPTS]

    def push(self, weights: Any) -> dict[str, Any]:
        """Push ``weights`` and return the server's status once it serves that version."""
        return self.server.wait_version(self.sender.push(weights))


@contextlib.contextmanager
def served(kind: str, tmp_path: Path) -> Iterator[Served]:
    expected_b = reference(f"{kind}-B")  # a fresh engine of B, started now beside the server
    model_a, model_b = tiny_model(f"{kind}-A"), tiny_model(f"{kind}-B")
    store = tmp_path / "store"
    with dbsync.Sender(store) as sender, \
            Server(store, model_a, tmp_path / "server.log") as server:
        server.wait_ready()
        answers = [complete(server.base, server.model, prompt) for prompt in PROMPTS]
        it = Served(sender, server, model_a, model_b, answers, expected_b.result())
        assert it.served_a != it.fresh_b  # (the two checkpoints answer differently)
        yield it


def test_an_moe_model_serves_each_pushed_version_experts_included(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    with served("MoE", tmp_path) as it:
        it.push(it.model_b)  # an HF checkpoint directory, one tensor per expert
        assert it.answers() == it.fresh_b

        # a trainer's module: transformers keeps each layer's experts fused in memory
        # (mlp.experts.gate_up_proj), published under the checkpoint's names
        trained_a = AutoModelForCausalLM.from_pretrained(it.model_a)
        assert any(name.endswith("experts.gate_up_proj") for name in trained_a.state_dict())
        status = it.push(trained_a)
        assert it.answers() == it.served_a
        assert status["healthy"] and status["refused_versions"] == []
        assert "MoE layer(s) prepare their experts" in it.server.tail(200_000)


def test_a_tied_lm_head_serves_each_pushed_version(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    with served("tied", tmp_path) as it:
        # a checkpoint directory stores the shared weight once: the head receives nothing
        it.push(it.model_b)
        assert it.answers() == it.fresh_b
        # a trainer's module names it twice (its state_dict has lm_head.weight too)
        trained_a = AutoModelForCausalLM.from_pretrained(it.model_a)
        assert "lm_head.weight" in trained_a.state_dict()
        it.push(trained_a)
        assert it.answers() == it.served_a
        it.push(it.model_b)
        status = it.push(it.model_a)
        assert it.answers() == it.served_a
        assert status["healthy"] and status["refused_versions"] == []
        log = it.server.tail(500_000)
        assert "share a weight with another" in log
        assert "Failed to load weights" not in log
