"""Tensor parallelism (2 CPU workers): each worker reads its own shards from the same slot;
the engine serves exactly the pushed weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from dbsync import Sender
from dbsync.store import Store
from tests.vllm_helpers import Trainer, engine_kwargs, greedy, reference, tiny_model

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


def test_tensor_parallel_broadcast_stages_only_what_each_rank_reads(llm_tp2: Any,
                                                                   tmp_path: Path) -> None:
    """Two workers take versions over the broadcast (gloo). The first apply records what each
    worker's loaders read; from then on each worker stages only that, well under the whole
    version, and the engine still serves exactly the pushed weights."""
    from dbsync import vllm as dbsync_vllm

    reference_a = reference("A")
    store = tmp_path / "store"
    store.mkdir()
    with dbsync_vllm.attach(llm_tp2, store, watch=False, transport="auto") as att:
        trainer = Trainer(store)
        try:
            assert trainer.ask(op="wait_joins", count=2, timeout=60)["joined"]
            staged = []
            for name in ("B", "A", "B"):
                pushed = trainer.ask(op="push", dir=str(tiny_model(name)))
                assert pushed["stats"]["broadcast"] and pushed["stats"]["members"] == 2
                assert att.apply_latest() == pushed["version"]
                timings = att.status()["timings"]
                assert timings["source"] == "broadcast"
                staged.append(timings["staged_bytes"])
                want = (reference_a if name == "A" else reference("B")).result()
                assert greedy(llm_tp2) == want
            assert trainer.ask(op="close")["closed"]
        finally:
            trainer.stop()
    total = Store(store).read_manifest().total_bytes
    # The first version is staged whole on both ranks (nothing recorded yet) ...
    assert staged[0] == {"0": total, "1": total}
    # ... the next ones only as each rank's reads: its share of the sharded weights plus
    # the replicated ones (norms), under WINDOW_SHARE of the version.
    for held in staged[1:]:
        assert set(held) == {"0", "1"}
        assert all(0 < n <= 0.75 * total for n in held.values()), (held, total)
    assert staged[1] == staged[2]
