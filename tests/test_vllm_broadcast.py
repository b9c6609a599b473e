"""The broadcast transport on the real CPU vLLM engine: a trainer process broadcasts over gloo
(``BroadcastSender(Sender(root), device="cpu")``), the engine's worker stages what it receives,
and ``apply_latest()`` serves it; completions equal a fresh engine's, token for token (the
engine starts from B, so its own first completions are that reference). The swap
semantics are the filesystem path's (refusal included), and with the sender gone the
filesystem delivers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dbsync import IncompatibleWeightsError, Sender
from dbsync.store import Store
from tests.vllm_helpers import Trainer, engine_kwargs, greedy, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

@pytest.fixture(scope="module")
def llm() -> Any:
    """An engine started from B: its completions before any swap are a fresh engine's from B
    (no separate reference engine needed)."""
    from vllm import LLM

    from dbsync import vllm as dbsync_vllm

    engine = LLM(model=str(tiny_model("B")), **engine_kwargs(**dbsync_vllm.engine_args()))
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_broadcast_over_gloo_then_filesystem(llm: Any, tmp_path: Path) -> None:
    from dbsync import vllm as dbsync_vllm

    store = tmp_path / "store"
    store.mkdir()  # readers never create a store; the trainer's Sender fills it
    fresh_b = greedy(llm)
    with dbsync_vllm.attach(llm, store, watch=False, transport="auto") as att:
        # 64 KiB buckets: the tiny model's bigger tensors span them, so the worker stages
        # through its bucket buffers into a copy of its own (whole_holds_less)
        trainer = Trainer(store, bucket_bytes=64 << 10)
        try:
            # "auto" found ROOT/broadcast.json offering gloo, and this CPU worker asked to join.
            assert trainer.ask(op="wait_joins", count=1, timeout=30)["joined"]

            pushed = trainer.ask(op="push", dir=str(tiny_model("A")))
            stats = pushed["stats"]
            assert stats["broadcast"] and stats["members"] == 1 and stats["error"] is None
            assert att.apply_latest() == pushed["version"]
            status = att.status()
            assert status["source"] == "broadcast" and status["transport"] == "auto"
            assert status["timings"]["source"] == "broadcast"
            assert llm.get_weight_version() == str(pushed["version"])
            assert status["timings"]["staged_bytes"] == {
                "0": Store(store).read_manifest().total_bytes}
            via_broadcast_a = greedy(llm)
            assert via_broadcast_a != fresh_b

            # Refusal is the filesystem path's: an unfit version is refused before pausing,
            # although the worker staged it.
            bad = trainer.ask(op="push", dir=str(tiny_model("C")))
            assert bad["stats"]["broadcast"]
            with pytest.raises(IncompatibleWeightsError, match="mlp.down_proj.weight"):
                att.apply_latest()
            assert att.status()["version"] == pushed["version"]
            assert greedy(llm) == via_broadcast_a

            # B over the same group: token for token what a fresh engine from B generates.
            again = trainer.ask(op="push", dir=str(tiny_model("B")))
            assert again["stats"]["broadcast"] and again["stats"]["members"] == 1
            assert att.apply_latest() == again["version"]
            assert att.status()["source"] == "broadcast"
            assert llm.get_weight_version() == str(again["version"])
            assert greedy(llm) == fresh_b
            assert trainer.ask(op="close")["closed"]
        finally:
            trainer.stop()

        # The sender is gone: the next version comes from the filesystem, and A read from the
        # filesystem generates what A received over the broadcast did.
        with Sender(store) as sender:
            version = sender.push(str(tiny_model("A")))
        assert att.apply_latest() == version
        assert att.status()["source"] == "filesystem"
        assert llm.get_weight_version() == str(version)
        assert greedy(llm) == via_broadcast_a
