"""The swap controller's sequencing and failure handling, on a real store, driving a scripted
engine (``ScriptedOps`` records each control call and can fail on cue). Fast: no vLLM engine
is started; the integration tests in test_vllm_server.py drive the real one."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dbsync
from dbsync import DamagedVersionError, IncompatibleWeightsError, Sender
from dbsync.store import Store

pytest.importorskip("vllm")

from dbsync.vllm.controller import SwapController, SwapError  # noqa: E402
from dbsync.vllm.plugin import NOTHING_APPLIED, PARTIALLY_APPLIED  # noqa: E402
from tests.vllm_helpers import flip_a_byte  # noqa: E402

pytestmark = pytest.mark.vllm


def weights(seed: int, hidden: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, hidden, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(2 * hidden, hidden, generator=g),
        "model.norm.weight": torch.randn(hidden, generator=g),
    }


EXPECTED = {n: (tuple(t.shape), t.dtype) for n, t in weights(0).items()}


class ScriptedOps:
    """Records control calls; ``failures`` is a list of messages ``update`` raises, in turn."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.failures: list[str] = []
        self.paused = False
        self.served: str | None = None

    def pause(self, mode: str = "keep", drain_timeout: float = 0.0) -> str:
        self.calls.append("pause" if mode == "keep" else f"pause:{mode}")
        self.paused = True
        return mode

    def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    def start(self) -> None:
        self.calls.append("start")

    def update(self, update_info: dict[str, Any]) -> None:
        self.calls.append(f"update:{update_info['version']}")
        if self.failures:
            raise RuntimeError(self.failures.pop(0))

    def finish(self, weight_version: str) -> None:
        self.calls.append(f"finish:{weight_version}")
        self.served = weight_version

    def drop_stale_caches(self) -> None:
        self.calls.append("reset")


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    root = tmp_path / "store"
    ops = ScriptedOps()
    with Sender(root) as sender:
        controller = SwapController(root, ops, EXPECTED)
        yield sender, controller, ops
        controller.stop()


def test_apply_sequence(setup: Any) -> None:
    sender, controller, ops = setup
    assert controller.apply_latest() is None and ops.calls == []  # nothing published
    v = sender.push(weights(1))
    assert controller.apply_latest() == v
    assert ops.calls == ["pause", "start", f"update:{v}", f"finish:{v}", "reset", "resume"]
    status = controller.status()
    assert status["version"] == v and status["healthy"] and status["last_error"] is None
    assert status["timings"]["version"] == v and status["timings"]["pause_s"] > 0
    ops.calls.clear()
    assert controller.apply_latest() == v and ops.calls == []  # already served


def test_damaged_version_refused_before_pausing(setup: Any) -> None:
    sender, controller, ops = setup
    good = sender.push(weights(1))
    controller.apply_latest()
    bad = sender.push(weights(2))
    flip_a_byte(sender.root, 1)
    damaged = Store(sender.root).require_manifest().tensors[1].name
    ops.calls.clear()
    with pytest.raises(DamagedVersionError):
        controller.apply_latest()
    assert ops.calls == []
    status = controller.status()
    assert status["version"] == good and status["healthy"]
    assert status["last_error_version"] == bad and damaged in status["last_error"]


def test_incompatible_version_refused_before_pausing(setup: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    sender, controller, ops = setup
    good = sender.push(weights(1))
    controller.apply_latest()
    wrong = weights(2, hidden=4)
    wrong["extra.weight"] = torch.zeros(2)
    wrong["model.embed_tokens.weight"] = weights(2)["model.embed_tokens.weight"].to(torch.int32)
    del wrong["model.norm.weight"]
    bad = sender.push(wrong)
    ops.calls.clear()
    with caplog.at_level(logging.ERROR, logger="dbsync.vllm.controller"):
        for _ in range(2):
            with pytest.raises(IncompatibleWeightsError) as info:
                controller.apply_latest()
    assert ops.calls == []
    problems = info.value.problems
    assert problems["extra.weight"] == "not a parameter of the served model"
    assert problems["model.norm.weight"] == "missing from the published version"
    assert "shape [8, 4] != expected [16, 8]" in problems["model.layers.0.mlp.up_proj.weight"]
    assert "dtype int32 != expected torch.float32" in problems["model.embed_tokens.weight"]
    status = controller.status()
    assert status["version"] == good and status["refused_versions"] == [bad]
    assert sum(f"version {bad} refused" in r.message for r in caplog.records) == 1


def test_failure_before_any_tensor_keeps_previous_version(setup: Any) -> None:
    sender, controller, ops = setup
    good = sender.push(weights(1))
    controller.apply_latest()
    v = sender.push(weights(2))
    ops.calls.clear()
    ops.failures = [f"{NOTHING_APPLIED} store moved on"]
    with pytest.raises(SwapError) as info:
        controller.apply_latest()
    assert info.value.partial is False
    assert ops.calls == ["pause", "start", f"update:{v}", "resume"]
    status = controller.status()
    assert status["version"] == good and status["healthy"] and not status["paused"]
    assert "nothing applied" in status["last_error"]
    assert controller.apply_latest() == v  # a later try applies it


def test_partial_failure_rolls_forward_while_paused(setup: Any) -> None:
    sender, controller, ops = setup
    controller_v = sender.push(weights(1))
    controller.apply_latest()
    v = sender.push(weights(2))
    ops.calls.clear()
    ops.failures = [f"{PARTIALLY_APPLIED} worker died midway"]
    assert controller.apply_latest() == v
    assert ops.calls == ["pause", "start", f"update:{v}",  # failed midway: stay paused
                         "start", f"update:{v}", f"finish:{v}", "reset", "resume"]
    assert controller.status()["healthy"] and controller.status()["version"] == v
    assert controller_v == v - 1


def test_watcher_retries_a_version_whose_apply_failed(tmp_path: Path) -> None:
    """With no newer push to wake it, the watcher must still try again after a transient
    failure, instead of serving the old version as if healthy until the next push."""
    import time

    ops = ScriptedOps()
    with Sender(tmp_path / "store") as sender:
        controller = SwapController(tmp_path / "store", ops, EXPECTED, poll_interval=0.05)
        try:
            sender.push(weights(1))
            ops.failures = [f"{NOTHING_APPLIED} transient"]
            controller.start_watching()
            deadline = time.monotonic() + 15
            while controller.status()["version"] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert controller.status()["version"] == 1
            assert ops.calls.count("update:1") == 2  # failed once, then applied
        finally:
            controller.stop()


def test_unhealthy_until_a_complete_version_applies(setup: Any) -> None:
    sender, controller, ops = setup
    sender.push(weights(1))
    controller.apply_latest()
    v = sender.push(weights(2))
    ops.failures = [f"{PARTIALLY_APPLIED} x"] * 3
    with pytest.raises(SwapError) as info:
        controller.apply_latest()
    assert info.value.partial
    status = controller.status()
    assert not status["healthy"] and status["paused"] and ops.paused
    assert "paused and unhealthy" in status["last_error"]
    from prometheus_client import REGISTRY  # (the series Prometheus scrapes say so too)

    assert REGISTRY.get_sample_value("dbsync_healthy") == 0
    assert REGISTRY.get_sample_value("dbsync_paused") == 1
    # two tries of v, then a rollback to version 1 that failed too: never resumed on a mix
    assert ops.calls[-6:] == ["start", f"update:{v}", "start", f"update:{v}", "start",
                              "update:1"] and "resume" not in ops.calls[-6:]
    v2 = sender.push(weights(3))
    assert controller.apply_latest() == v2
    assert controller.status()["healthy"] and not ops.paused and ops.served == str(v2)
    assert REGISTRY.get_sample_value("dbsync_healthy") == 1
    assert REGISTRY.get_sample_value("dbsync_paused") == 0


def test_a_try_the_next_one_mends_is_no_refusal_and_repeats_log_once(
        setup: Any, caplog: Any) -> None:
    """A version that fails midway once and applies on the next try is never shown to the
    trainer as refused (the lease holds no refusal while the second try runs: only the
    outcome is reported). A version that keeps failing alike, retried again and again, is
    logged at ERROR once; its repeats go to DEBUG (the status and counters show each)."""
    sender, controller, ops = setup
    sender.push(weights(1))
    controller.apply_latest()
    reader = controller.receiver.reader_id
    mended = sender.push(weights(2))
    refusals_seen: list[Any] = []
    update = ops.update

    def update_and_look(info: dict[str, Any]) -> None:
        refusals_seen.append(Store(sender.root).read_leases()[reader].get("refused"))
        update(info)

    ops.update = update_and_look  # type: ignore[method-assign]
    ops.failures = [f"{PARTIALLY_APPLIED} worker died midway"]
    assert controller.apply_latest() == mended
    assert refusals_seen == [None, None], "a try the next one mended was reported as refused"
    sender.wait_for_receivers(mended, 1, timeout=5)

    failing = sender.push(weights(3))
    with caplog.at_level(logging.DEBUG, logger="dbsync"):
        for _ in range(3):
            ops.failures = [f"{PARTIALLY_APPLIED} the same fault"] * 3
            with pytest.raises(SwapError):
                controller.apply_latest()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR
              and f"version {failing}" in r.getMessage() and "failed midway" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert controller.status()["last_error"] and not controller.status()["healthy"]
    with pytest.raises(dbsync.ReceiverRefusedError, match=reader):
        sender.wait_for_receivers(failing, 1, timeout=5)  # the outcome is reported


def test_a_server_stopped_during_an_apply_reports_no_refusal(setup: Any) -> None:
    """A server stopping (a rolling restart) abandons the apply under way: that is no
    refusal of the version, and a trainer waiting for the fleet must not be failed by it."""
    import threading

    sender, controller, ops = setup
    sender.push(weights(1))
    controller.apply_latest()
    entered, abandoned = threading.Event(), threading.Event()
    update = ops.update

    def held_update(info: dict[str, Any]) -> None:
        if info["version"] == 2:
            entered.set()
            abandoned.wait(30)
            raise RuntimeError("engine call abandoned: the server is shutting down")
        update(info)

    ops.update = held_update  # type: ignore[method-assign]
    ops.close = abandoned.set  # type: ignore[attr-defined]  (what stop_applying() calls)
    sender.push(weights(2))
    errors: list[BaseException] = []

    def apply() -> None:
        try:
            controller.apply_latest()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    applying = threading.Thread(target=apply)
    applying.start()
    assert entered.wait(30)
    controller.stop_applying()
    applying.join(30)
    lease = Store(sender.root).read_leases()[controller.receiver.reader_id]
    assert lease.get("refused") is None, lease["refused"]


def test_failed_apply_rolls_back_to_the_held_previous_version(setup: Any) -> None:
    """A version that fails midway twice: the version served before is applied again from its
    slot (held by the controller's lease meanwhile), generation resumes on it, and the trainer
    sees the failure as a refusal naming this engine."""
    from dbsync import ReceiverRefusedError
    from dbsync.vllm.controller import RolledBackError

    sender, controller, ops = setup
    good = sender.push(weights(1))
    controller.apply_latest()
    held = Store(sender.root).read_leases()[controller.receiver.reader_id]["held"]
    assert held == [["a", good, sender.run_id]]  # the served version's slot stays leased
    bad = sender.push(weights(2))
    ops.calls.clear()
    ops.failures = [f"{PARTIALLY_APPLIED} x"] * 2
    with pytest.raises(RolledBackError):
        controller.apply_latest()
    assert ops.calls == ["pause", "start", f"update:{bad}", "start", f"update:{bad}",
                         "start", f"update:{good}", f"finish:{good}", "reset", "resume"]
    status = controller.status()
    assert status["healthy"] and not status["paused"] and status["version"] == good
    assert ops.served == str(good) and "rolled back to version 1" in status["last_error"]
    with pytest.raises(ReceiverRefusedError, match=controller.receiver.reader_id):
        sender.wait_for_receivers(bad, 1, timeout=5)
    ops.calls.clear()
    assert controller.apply_latest() == good and ops.calls == []  # not retried in a loop
    newer = sender.push(weights(3))  # the slot of version 1 was released: the push goes on
    assert controller.apply_latest() == newer and ops.served == str(newer)


def test_a_rollback_never_serves_a_held_version_damaged_meanwhile(setup: Any) -> None:
    """The served version's slot, held for a rollback, is damaged while served (bit rot, a
    stray writer); a new version then fails midway twice. The rollback checks the held version
    again and refuses it: the engine stays paused and unhealthy (never resumed on garbled
    weights labelled as that version) until a complete version applies."""
    sender, controller, ops = setup
    good = sender.push(weights(1))
    controller.apply_latest()
    flip_a_byte(sender.root, 2)  # the held slot, while version 1 is served
    bad = sender.push(weights(2))
    ops.calls.clear()
    ops.failures = [f"{PARTIALLY_APPLIED} x"] * 2
    with pytest.raises(SwapError):
        controller.apply_latest()
    assert f"update:{good}" not in ops.calls and "resume" not in ops.calls
    status = controller.status()
    assert not status["healthy"] and status["paused"]
    assert "paused and unhealthy" in status["last_error"]
    newer = sender.push(weights(3))
    assert controller.apply_latest() == newer and ops.served == str(newer)
    assert controller.status()["healthy"] and bad != newer


def test_refusal_reaches_the_trainer_at_once(setup: Any) -> None:
    import time

    from dbsync import ReceiverRefusedError

    sender, controller, ops = setup
    sender.push(weights(1))
    controller.apply_latest()
    bad = sender.push({**weights(2), "model.norm.weight": torch.ones(3)})
    with pytest.raises(IncompatibleWeightsError):
        controller.apply_latest()
    start = time.monotonic()
    with pytest.raises(ReceiverRefusedError, match="model.norm.weight"):
        sender.wait_for_receivers(bad, 1, timeout=30)
    assert time.monotonic() - start < 2.0


def test_expected_from_checkpoint_reads_headers(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    from dbsync.vllm.checkpoint import expected_from_checkpoint

    save_file({"model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
               "model.layers.0.idx": torch.zeros(3, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    expected, allow_missing = expected_from_checkpoint(str(tmp_path), torch.float32)
    assert expected == {"model.embed_tokens.weight": ((16, 8), torch.float32),
                        "model.layers.0.idx": ((3,), torch.int64),
                        "lm_head.weight": ((16, 8), torch.float32)}
    assert allow_missing == ["lm_head.weight"]
    kept, _ = expected_from_checkpoint(str(tmp_path), None)
    assert kept["model.embed_tokens.weight"] == ((16, 8), torch.bfloat16)


def test_register_is_idempotent() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from dbsync.vllm.plugin import BACKEND, DBSyncWeightTransferEngine, register

    register()
    register()
    assert WeightTransferEngineFactory._registry[BACKEND]() is DBSyncWeightTransferEngine


def test_server_gate_answers_503_while_unhealthy(setup: Any) -> None:
    """vLLM's own app (built as serve-vllm builds it, no engine needed for this): while the
    controller is unhealthy, inference routes and /health answer 503; /dbsync/status answers."""
    from fastapi.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dbsync.vllm.server import install_routes

    sender, controller, ops = setup
    sender.push(weights(1))
    ops.failures = [f"{PARTIALLY_APPLIED} x"] * 3
    with pytest.raises(SwapError):
        controller.apply_latest()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "unused"])
    app = build_app(args, ("generate",), None)
    install_routes(app, controller)
    client = TestClient(app)
    status = client.get("/dbsync/status")
    assert status.status_code == 200 and status.json()["healthy"] is False
    for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("get", "/health")):
        response = getattr(client, method)(path)
        assert response.status_code == 503, path
        assert "unhealthy until a complete version is applied" in response.text


def test_float_dtypes_are_cast_only_names_and_shapes_must_match(setup: Any) -> None:
    """A version in another floating dtype fits (the weight loaders cast it); the pause mode
    reaches the engine."""
    sender, controller, ops = setup
    controller.pause_mode = "wait"
    v = sender.push({n: t.bfloat16() for n, t in weights(1).items()})
    assert controller.apply_latest() == v
    assert ops.calls[0] == "pause:wait" and ops.served == str(v)
    assert controller.status()["timings"]["pause_mode"] == "wait"


def test_superseded_apply_logs_info_not_error(setup: Any,
                                              caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import REGISTRY  # (where the controller's default series live)

    from dbsync.vllm.plugin import SUPERSEDED

    sender, controller, ops = setup

    def counted(outcome: str) -> float:
        return REGISTRY.get_sample_value("dbsync_swaps_total", {"outcome": outcome}) or 0.0

    before = {o: counted(o) for o in ("failed", "superseded", "applied")}
    v1 = sender.push(weights(1))
    ops.failures = [f"{NOTHING_APPLIED} {SUPERSEDED} the store now holds version {v1 + 1}"]
    with caplog.at_level(logging.INFO, logger="dbsync"):
        assert controller.apply_latest() == v1  # tried again at once, applied
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("superseded" in r.getMessage() for r in caplog.records)
    # a normal race is no failure to alert on
    assert {o: counted(o) - n for o, n in before.items()} == {"failed": 0.0, "superseded": 1.0,
                                                              "applied": 1.0}


def test_vllm_rpc_error_for_a_race_becomes_one_info_line() -> None:
    """vLLM logs a failed worker call as an ERROR traceback (~100 lines); for a superseded
    apply the registered filter turns it into one INFO line, for an apply failure seen before
    into one WARNING line (other errors stay as they are)."""
    from dbsync.vllm.plugin import SUPERSEDED, register

    register()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("vllm.v1.executor.multiproc_executor")
    handler = Keep()
    logger.addHandler(handler)
    try:
        for text in (f"{NOTHING_APPLIED} version 3 ({SUPERSEDED} now holds 4)", "disk on fire",
                     f"{PARTIALLY_APPLIED} version 5 (3 tensor(s) loaded): worker died",
                     f"{PARTIALLY_APPLIED} version 5 (4 tensor(s) loaded): worker died"):
            try:
                raise RuntimeError(text)
            except RuntimeError:
                logger.exception("WorkerProc hit an exception.")
    finally:
        logger.removeHandler(handler)
    race, other, first, again = records
    assert race.levelno == logging.INFO and race.exc_info is None
    assert "now holds 4" in race.getMessage()
    assert other.levelno == logging.ERROR and other.exc_info is not None
    # a failure the controller retries: its traceback once, then one line per repeat
    assert first.levelno == logging.ERROR and first.exc_info is not None
    assert again.levelno == logging.WARNING and again.exc_info is None
    assert "worker died (again" in again.getMessage()


def test_transient_read_error_is_retried_until_served(tmp_path: Path) -> None:
    """An OSError (ESTALE) while opening a new version does not mark it seen: the controller
    retries with backoff, shows the error meanwhile, and serves the newest version once the
    store reads again."""
    import errno
    import threading

    ops = ScriptedOps()
    failing = threading.Event()
    failing.set()
    failures: list[float] = []
    three = threading.Event()
    with Sender(tmp_path / "store") as sender:
        controller = SwapController(tmp_path / "store", ops, EXPECTED, poll_interval=0.05)
        real_open = controller.receiver.open

        def flaky_open(*args: Any, **kwargs: Any) -> Any:
            if failing.is_set():
                import time

                failures.append(time.monotonic())
                if len(failures) >= 3:
                    three.set()
                raise OSError(errno.ESTALE, os_strerror(errno.ESTALE))
            return real_open(*args, **kwargs)

        controller.receiver.open = flaky_open
        try:
            v1 = sender.push(weights(1))
            controller.start_watching()
            assert three.wait(30)
            status = controller.status()
            assert status["version"] is None and status["retrying"]
            assert "Stale file handle" in status["last_error"]
            v2 = sender.push(weights(2))  # superseded while failing
            failing.clear()
            wait_for(lambda: controller.status()["version"] == v2, 30)
            status = controller.status()
            assert not status["retrying"] and status["last_error"] is None
            assert f"update:{v1}" not in ops.calls and ops.served == str(v2)
            gaps = [b - a for a, b in zip(failures, failures[1:], strict=False)]
            assert min(gaps) >= 0.15  # bounded rate: backoff from 0.2 s
        finally:
            controller.stop()


def os_strerror(code: int) -> str:

    return os.strerror(code)


def wait_for(predicate: Any, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_expected_names_come_from_the_index(tmp_path: Path) -> None:
    """A stray consolidated.safetensors (Mistral-style repos) next to indexed shards is not
    part of the model vLLM loads, so its names are not expected."""
    import json

    from safetensors.torch import save_file

    from dbsync.vllm.checkpoint import expected_from_checkpoint

    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.norm.weight": torch.zeros(8)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"tok_embeddings.weight": torch.zeros(16, 8)},
              str(tmp_path / "consolidated.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    expected, _ = expected_from_checkpoint(str(tmp_path), torch.bfloat16)
    assert set(expected) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_mistyped_model_path_is_refused_at_once(tmp_path: Path, monkeypatch: Any) -> None:
    from huggingface_hub import constants

    from dbsync import DBSyncError
    from dbsync.serveargs import check_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))

    for bad in (str(tmp_path / "modle"), "./modle", "~/no-such-model-dir"):
        with pytest.raises(DBSyncError, match="no such directory"):
            check_model(bad)
    with pytest.raises(DBSyncError, match="no config.json"):
        check_model(str(tmp_path))
    # a relative path or a hub id that is not in the local cache: not tried on the hub
    # (minutes of retries), since dbsync needs the checkpoint's files here anyway
    for missing in ("models/base", "Qwen/Qwen2-0.5B"):
        with pytest.raises(DBSyncError, match=f"no Hugging Face model .*hf download {missing}"):
            check_model(missing)


def test_a_hub_id_in_the_local_cache_is_a_model(tmp_path: Path, monkeypatch: Any) -> None:
    from huggingface_hub import constants

    from dbsync.serveargs import check_model, resolve_model_dir

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    check_model("org/tiny")
    assert resolve_model_dir("org/tiny") == str(snapshot)


@contextlib.contextmanager
def serving_version_5_of_a_run(root: Path) -> Iterator[tuple[SwapController, Any]]:
    """A watching controller (with its own metrics registry) serving version 5 of a run at
    ``root``, stopped when the block ends."""
    from prometheus_client import CollectorRegistry

    from dbsync.vllm.metrics import SwapMetrics

    registry = CollectorRegistry()
    with Sender(root) as sender:
        for seed in range(5):
            sender.push(weights(seed))
    controller = SwapController(root, ScriptedOps(), EXPECTED,
                                metrics=SwapMetrics(registry=registry), poll_interval=0.05)
    try:
        controller.start_watching()
        wait_for(lambda: controller.status()["version"] == 5, 30)
        yield controller, registry
    finally:
        controller.stop()


def test_a_new_training_run_replaces_the_published_version_and_its_lag(tmp_path: Path) -> None:
    """A new run at the same path numbers from 1 again: the status and the lag metrics must
    follow it, not keep the old run's high-water mark (a lag alert that never clears)."""
    import shutil

    root = tmp_path / "store"
    with serving_version_5_of_a_run(root) as (controller, registry):
        assert controller.status()["published_version"] == 5
        shutil.rmtree(root)  # the trainer starts a new run at ROOT
        with Sender(root) as sender:
            sender.push(weights(10))
            sender.push(weights(11))
        wait_for(lambda: controller.status()["version"] == 2
                 and controller.status()["published_version"] == 2, 30)
        assert registry.get_sample_value("dbsync_published_version") == 2
        assert registry.get_sample_value("dbsync_version_lag") == 0
        controller.apply_latest()  # (through a snapshot of the new run: the same numbers)
        assert controller.status()["published_version"] == 2


def test_a_new_run_whose_versions_are_refused_shows_a_lag(tmp_path: Path) -> None:
    """The server serves the old run's version 5; the new run at the same path publishes
    versions 1 and 2 that do not fit. The lag read 0 (2 - 5, floored), hiding a server that
    serves nothing of the current run from every lag alert; it is the new run's 2."""
    import shutil

    root = tmp_path / "store"
    with serving_version_5_of_a_run(root) as (controller, registry):
        shutil.rmtree(root)  # a new run, whose model the server does not fit
        bad = {**weights(1), "model.norm.weight": torch.ones(3)}
        with Sender(root) as sender:
            sender.push(bad)
            sender.push(bad)
        # (version 1 is refused too where the watcher saw it before version 2 came)
        wait_for(lambda: 2 in controller.status()["refused_versions"], 30)
        assert set(controller.status()["refused_versions"]) <= {1, 2}
        assert controller.status()["version"] == 5
        assert registry.get_sample_value("dbsync_published_version") == 2
        assert registry.get_sample_value("dbsync_version_lag") == 2


def test_a_missing_store_shows_in_the_status_and_metrics(tmp_path: Path) -> None:
    """An unmounted or removed store must reach monitoring, not only a log line; the served
    version stays served, and the problem clears when the store is back."""
    from prometheus_client import CollectorRegistry

    from dbsync.vllm.metrics import SwapMetrics

    root = tmp_path / "store"
    registry = CollectorRegistry()
    with Sender(root) as sender:
        sender.push(weights(1))
    controller = SwapController(root, ScriptedOps(), EXPECTED,
                                metrics=SwapMetrics(registry=registry))
    try:
        assert controller.apply_latest() == 1
        assert controller.status()["store_problem"] is None
        assert registry.get_sample_value("dbsync_store_ok") == 1
        os.rename(root, tmp_path / "elsewhere")  # (as an unmount looks from here)
        # found by the receiver's next lease write (every lease_timeout / 4 = 7.5 s): the
        # status itself touches no file (it runs on the server's event loop)
        wait_for(lambda: controller.status()["store_problem"] is not None, 30)
        status = controller.status()
        assert "is missing" in status["store_problem"] and status["version"] == 1
        assert "still serving version 1" in status["store_problem"]
        assert registry.get_sample_value("dbsync_store_ok") == 0
        os.rename(tmp_path / "elsewhere", root)
        wait_for(lambda: controller.status()["store_problem"] is None, 30)
        assert registry.get_sample_value("dbsync_store_ok") == 1
    finally:
        controller.stop()


def test_a_garbled_manifest_shows_in_the_status_and_metrics(tmp_path: Path) -> None:
    """A store whose manifest cannot be read (garbled here; another format, a half-copied
    restore) keeps a server from following it: that reaches the status and
    ``dbsync_store_ok``, not only one log line, and clears once the manifest reads again.
    The status names the run of the version served."""
    from prometheus_client import CollectorRegistry

    from dbsync.format import MANIFEST_FILE
    from dbsync.vllm.metrics import SwapMetrics

    root = tmp_path / "store"
    registry = CollectorRegistry()
    with Sender(root) as sender:
        sender.push(weights(1))
        run_id = sender.run_id
    controller = SwapController(root, ScriptedOps(), EXPECTED,
                                metrics=SwapMetrics(registry=registry), poll_interval=0.05)
    try:
        assert controller.apply_latest() == 1
        controller.start_watching()
        assert controller.status()["run_id"] == run_id
        head = root / MANIFEST_FILE
        good = head.read_bytes()

        def replace_head(content: bytes) -> None:  # (as a copy tool does: write, rename)
            (root / "head.tmp").write_bytes(content)
            os.replace(root / "head.tmp", head)

        replace_head(b'{"version": ')
        wait_for(lambda: controller.status()["store_problem"] is not None, 30)
        problem = controller.status()["store_problem"]
        # (found by the watcher's look, or by the apply its first look started, which then
        # retries the read)
        assert "dbsync.json is not valid JSON" in problem, problem
        assert "still serving version 1" in problem
        assert registry.get_sample_value("dbsync_store_ok") == 0
        replace_head(good)
        wait_for(lambda: controller.status()["store_problem"] is None, 30)
        assert registry.get_sample_value("dbsync_store_ok") == 1
    finally:
        controller.stop()


def test_a_refusal_in_a_new_run_is_counted_and_said_though_the_old_run_refused_its_number(
        tmp_path: Path, caplog: Any) -> None:
    """Refusals name versions of their own run: a new run's version 2 refused after the old
    run's version 2 was refused is logged and counted again, and the status lists only the
    new run's refusals."""
    import shutil

    from prometheus_client import CollectorRegistry

    from dbsync.vllm.metrics import SwapMetrics

    root = tmp_path / "store"
    registry = CollectorRegistry()
    bad = {**weights(1), "model.norm.weight": torch.ones(3)}  # another shape: refused
    with Sender(root) as sender:
        sender.push(weights(0))
    controller = SwapController(root, ScriptedOps(), EXPECTED,
                                metrics=SwapMetrics(registry=registry))
    try:
        for run in range(2):
            if run:
                shutil.rmtree(root)  # the trainer starts a new run at ROOT
            with Sender(root) as sender:
                if run:
                    sender.push(weights(run))
                assert controller.apply_latest() == 1
                sender.push(bad)
                with caplog.at_level(logging.ERROR, logger="dbsync"), \
                        pytest.raises(IncompatibleWeightsError):
                    controller.apply_latest()
            assert controller.status()["refused_versions"] == [2]
            assert registry.get_sample_value("dbsync_swaps_total",
                                             {"outcome": "refused"}) == run + 1
        said = [r for r in caplog.records if "version 2 refused" in r.getMessage()]
        assert len(said) == 2
    finally:
        controller.stop()


def test_closing_the_engine_ops_abandons_a_call_waiting_on_the_engines_loop() -> None:
    """A server shutting down closes its engine ops: a swap's call waiting on the engine's
    loop (a drain that never ends, or a loop busy stopping) raises at once instead of holding
    the controller's stop for the call's 10-minute timeout, and no call starts afterwards."""
    import asyncio
    import threading

    from dbsync.vllm.engine import AsyncEngineOps, EngineClosed

    class Engine:
        started = threading.Event()

        async def resume_generation(self) -> None:
            Engine.started.set()
            await asyncio.Event().wait()  # never ends

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    ops = AsyncEngineOps(Engine(), loop)
    outcome: list[BaseException] = []

    def swap() -> None:
        try:
            ops.resume()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    caller = threading.Thread(target=swap)
    caller.start()
    try:
        assert Engine.started.wait(30)
        ops.close()
        caller.join(timeout=30)
        assert not caller.is_alive()
        assert isinstance(outcome[0], EngineClosed) and "abandoned" in str(outcome[0])
        with pytest.raises(EngineClosed, match="no more engine calls"):
            ops.resume()
        # the abandoned coroutine was cancelled on the loop: nothing of it keeps running
        pending = asyncio.run_coroutine_threadsafe(_tasks_left(), loop).result(30)
        assert pending == 0
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=30)
        loop.close()


async def _tasks_left() -> int:
    import asyncio

    await asyncio.sleep(0)  # (let the cancellation land)
    return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])


def test_a_stop_signal_stops_swaps_before_the_server_drains(tmp_path: Path) -> None:
    """SIGTERM reaching serve-vllm's loop stops the controller from applying (and abandons
    an engine call under way) before vLLM's own handler starts draining the server: a push
    that comes while the server drains starts no swap."""
    import asyncio
    import os
    import signal

    from dbsync.vllm import http

    root = tmp_path / "store"
    with Sender(root) as sender:
        sender.push(weights(1))
    ops = ScriptedOps()
    controller = SwapController(root, ops, EXPECTED)
    order: list[str] = []
    was = list(http._ON_STOP_SIGNAL)

    async def main() -> None:
        stopped = asyncio.Event()

        def vllm_handler() -> None:  # what vLLM's own handler does first: stop serving
            order.append(f"vllm, stopping={controller._stopping.is_set()}")
            stopped.set()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, vllm_handler)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stopped.wait(), 30)

    try:
        http.on_stop_signal(controller.stop_applying)
        http.run_until_stopped(main())
        assert order == ["vllm, stopping=True"]
        with Sender(root) as sender:
            sender.push(weights(2))
        controller._follow()  # what the watcher does on the new version: nothing now
        assert ops.calls == []
    finally:
        http._ON_STOP_SIGNAL[:] = was
        controller.stop()


def test_working_directories_of_killed_servers_are_removed_by_the_next_one(
        tmp_path: Path) -> None:
    """A serve-vllm killed with SIGKILL cannot remove its working directories (apply
    reports; LoRA adapter versions in /dev/shm, RAM): they piled up, one per killed server.
    The next server removes those of dead processes, never a live one's."""
    import signal
    import subprocess
    import sys

    from dbsync.vllm import workdirs

    script = ("import sys, time; from dbsync.vllm import workdirs; "
              "print(workdirs.make('dbsync-lora-', sys.argv[1]), flush=True); time.sleep(600)")
    killed = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    try:
        dead_dir = killed.stdout.readline().strip()
        live_dir = alive.stdout.readline().strip()
        (Path(dead_dir) / "v3-adapter").mkdir()
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        older = tmp_path / "dbsync-lora-older"  # (an older dbsync's: no owner file)
        older.mkdir()
        mine = workdirs.make("dbsync-lora-", str(tmp_path))
        assert not os.path.exists(dead_dir)
        assert os.path.isdir(live_dir) and older.is_dir() and os.path.isdir(mine)
        workdirs.remove(mine)
        assert not os.path.exists(mine)
    finally:
        alive.kill()
        alive.wait(30)
        killed.kill()


def test_the_source_of_an_apply_is_what_this_version_s_worker_reports_say() -> None:
    """With a broadcast transport each worker reports where it took the version from; the
    controller's source is theirs: one source, "mixed" when they differ, None when none
    reported this version (a report of another version, or a garbled one, is no report)."""
    from dbsync.vllm.worker_transport import WorkerTransport

    calls: list[dict[str, Any]] = []

    class Workers:
        def init(self, info: dict[str, Any]) -> None:
            calls.append(info)

    transport = WorkerTransport("/srv/store", Workers(), "auto")
    transport.start()
    transport.start()  # (once)
    assert calls == [{"root": "/srv/store", "transport": "auto"}]

    def report(directory: str, rank: int, version: int, source: str) -> None:
        Path(directory, f"{rank}.json").write_text(json.dumps(
            {"version": version, "source": source, "rank": rank, "staged_bytes": 100 * rank}))

    first = transport.fresh_report_dir()
    assert first is not None
    report(first, 0, 7, "broadcast")
    report(first, 1, 7, "broadcast")
    report(first, 2, 6, "filesystem")  # (an earlier version's)
    Path(first, "3.json").write_text("{garbled")
    assert transport.sources(7) == ("broadcast", {"0": 0, "1": 100})
    second = transport.fresh_report_dir()  # the next apply starts with no reports
    assert second == first and transport.sources(8) == (None, None)
    report(second, 0, 8, "broadcast")
    report(second, 1, 8, "filesystem")
    assert transport.sources(8)[0] == "mixed"
    transport.stop()
    assert calls[-1] == {"root": None, "transport": "filesystem"}
    transport.close()
    assert not os.path.exists(first)
    plain = WorkerTransport("/srv/store", object(), "filesystem")
    plain.start()  # (nothing to start: no init needed)
    assert plain.fresh_report_dir() is None and plain.sources(3) == ("filesystem", None)
