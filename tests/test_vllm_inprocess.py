"""In-process API on an offline ``vllm.LLM``: attach a store, apply on demand, refuse unfit
versions; completions equal a fresh engine's."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from dbsync import IncompatibleWeightsError, Sender
from tests.vllm_helpers import child_output_to, engine_kwargs, greedy, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from dbsync.vllm.plugin import FAULTS_ENV  # noqa: E402

# Set before this module's engine spawns its workers (they read it at each update).
FAULTS = Path(tempfile.gettempdir()) / f"dbsync-apply-faults-{os.getpid()}"
os.environ[FAULTS_ENV] = str(FAULTS)


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the engine's core and worker processes write their log."""
    return tmp_path_factory.mktemp("engine-log") / "engine.log"


@pytest.fixture(scope="module")
def llm(engine_log: Path) -> Any:
    from vllm import LLM

    from dbsync import vllm as dbsync_vllm

    reference("B")  # overlaps this engine's start-up
    with child_output_to(engine_log):
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


def test_superseded_apply_logs_info_and_keeps_weights(llm: Any, tmp_path: Path,
                                                      engine_log: Path) -> None:
    """The store moving on while a version is applied is a normal race: the worker applies
    nothing, the engine keeps serving what it had, and neither vLLM process logs an ERROR
    traceback for it (one INFO line each)."""
    from dbsync.vllm.plugin import SUPERSEDED

    store = tmp_path / "store"
    with Sender(store) as sender:
        version = sender.push(str(tiny_model("B")))
    before = greedy(llm)
    start = engine_log.stat().st_size
    llm.start_weight_update()
    with pytest.raises(Exception, match="superseded") as info:
        llm.update_weights({"update_info": {"root": str(store), "version": version + 1}})
    assert "nothing applied" in str(info.value)
    assert greedy(llm) == before  # nothing applied; the session ended with the failure
    with open(engine_log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    race = [line for line in text.splitlines() if SUPERSEDED in line]
    assert len(race) == 2 and all(" INFO " in line for line in race), race  # worker, core
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


def test_failed_apply_rolls_back_to_the_previous_version(llm: Any, tmp_path: Path) -> None:
    """A version that fails midway inside the engine's workers (after 3 tensors, every try):
    the engine is back on the version it served before, token for token, within seconds."""
    from dbsync import vllm as dbsync_vllm
    from dbsync.vllm.controller import RolledBackError

    store = tmp_path / "store"
    with Sender(store) as sender, dbsync_vllm.attach(llm, store) as att:
        good = sender.push(str(tiny_model("B")))
        assert att.apply_latest() == good
        served = greedy(llm)
        bad = sender.push(str(tiny_model("A")))
        FAULTS.write_text(f"{bad} 3\n")
        try:
            start = time.monotonic()
            with pytest.raises(RolledBackError, match=f"rolled back to version {good}"):
                att.apply_latest()
            elapsed = time.monotonic() - start
        finally:
            FAULTS.unlink()
        assert greedy(llm) == served == reference("B").result()
        status = att.status()
        assert status["healthy"] and status["version"] == good
        assert llm.get_weight_version() == str(good)
        assert elapsed < 30
        newer = sender.push(str(tiny_model("A")))  # the next version applies normally
        assert att.apply_latest() == newer and greedy(llm) != served
