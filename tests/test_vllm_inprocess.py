"""In-process API on an offline ``vllm.LLM``: attach a store, apply on demand, refuse unfit
versions; completions equal a fresh engine's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from dbsync import IncompatibleWeightsError, Sender
from tests.vllm_helpers import engine_kwargs, greedy, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def llm() -> Any:
    from vllm import LLM

    from dbsync import vllm as dbsync_vllm

    reference("B")  # overlaps this engine's start-up
    engine = LLM(model=str(tiny_model("A")), **engine_kwargs(**dbsync_vllm.engine_args()))
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_attach_and_apply_latest(llm: Any, tmp_path: Path) -> None:
    from dbsync import vllm as dbsync_vllm

    store = tmp_path / "store"
    before = greedy(llm)
    seen: list[int] = []
    with Sender(store) as sender, dbsync_vllm.attach(
            llm, store, poll_interval=0.1, on_version=seen.append) as att:
        assert att.version is None and not att.pending
        assert att.apply_latest() is None  # nothing published yet: keeps its own weights
        version = sender.push(str(tiny_model("B")))
        deadline = time.monotonic() + 30
        while not att.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert att.pending and seen == [version]
        assert att.apply_latest() == version
        assert not att.pending
        assert llm.get_weight_version() == str(version)
        after = greedy(llm)
        assert after == reference("B").result()
        assert after != before

        bad = sender.push(str(tiny_model("C")))
        with pytest.raises(IncompatibleWeightsError) as info:
            att.apply_latest()
        assert "mlp.down_proj.weight: shape [128, 384] != expected [128, 256]" in str(info.value)
        status = att.status()
        assert status["version"] == version and status["last_error_version"] == bad
        assert greedy(llm) == after
        assert llm.get_weight_version() == str(version)


def test_one_shot_apply_latest(llm: Any, tmp_path: Path) -> None:
    from dbsync import vllm as dbsync_vllm

    store = tmp_path / "store"
    with Sender(store) as sender:
        sender.push(str(tiny_model("C")))
        version = sender.push(str(tiny_model("A")))
    assert dbsync_vllm.apply_latest(llm, store) == version
    assert llm.get_weight_version() == str(version)
    a_weights = greedy(llm)
    with Sender(store) as sender:
        version = sender.push(str(tiny_model("B")))
    assert dbsync_vllm.apply_latest(llm, store) == version
    assert greedy(llm) == reference("B").result() != a_weights
