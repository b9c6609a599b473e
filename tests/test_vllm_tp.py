"""Tensor parallelism (2 CPU workers): each worker reads its own shards from the same slot;
the engine serves exactly the pushed weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dbsync import Sender
from dbsync.store import Store
from tests.vllm_helpers import engine_kwargs, greedy, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")]


@pytest.fixture(scope="module")
def llm_tp2() -> Any:
    from vllm import LLM

    from dbsync import vllm as dbsync_vllm

    reference("B")
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker
    try:
        engine = LLM(model=str(tiny_model("A")), tensor_parallel_size=2,
                     **engine_kwargs(**dbsync_vllm.engine_args()))
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_tensor_parallel_apply_matches_fresh_engine(llm_tp2: Any, tmp_path: Path) -> None:
    from dbsync import vllm as dbsync_vllm

    store = tmp_path / "store"
    with Sender(store) as sender, dbsync_vllm.attach(llm_tp2, store, watch=False) as att:
        assert att.controller.workers == 2
        version = sender.push(str(tiny_model("B")))
        assert att.apply_latest() == version
        assert greedy(llm_tp2) == reference("B").result()
        # Only the controller stays registered: each worker's reader registration lasts
        # one update, so wait_for_receivers counts this engine once.
        leases = Store(store).read_leases()
        assert [lease["loaded_version"] for lease in leases.values()] == [version]
