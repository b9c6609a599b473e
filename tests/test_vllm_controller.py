"""The swap controller's sequencing and failure handling, on a real store, driving a scripted
engine (``ScriptedOps`` records each control call and can fail on cue). Fast: no vLLM engine
is started; the integration tests in test_vllm_server.py drive the real one."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dbsync import DamagedVersionError, IncompatibleWeightsError, Sender
from dbsync.store import Store

pytest.importorskip("vllm")

from dbsync.vllm.controller import SwapController, SwapError  # noqa: E402
from dbsync.vllm.plugin import NOTHING_APPLIED, PARTIALLY_APPLIED  # noqa: E402

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

    def pause(self) -> None:
        self.calls.append("pause")
        self.paused = True

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

    def reset_prefix_cache(self) -> None:
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
    store = Store(sender.root)
    manifest = store.require_manifest()
    entry = manifest.tensors[1]
    shard = os.path.join(store.slot_dir(manifest.slot), f"shard-{entry.shard:05d}.bin")
    with open(shard, "r+b") as f:
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    ops.calls.clear()
    with pytest.raises(DamagedVersionError):
        controller.apply_latest()
    assert ops.calls == []
    status = controller.status()
    assert status["version"] == good and status["healthy"]
    assert status["last_error_version"] == bad and entry.name in status["last_error"]


def test_incompatible_version_refused_before_pausing(setup: Any,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    sender, controller, ops = setup
    good = sender.push(weights(1))
    controller.apply_latest()
    wrong = weights(2, hidden=4)
    wrong["extra.weight"] = torch.zeros(2)
    wrong["model.embed_tokens.weight"] = weights(2)["model.embed_tokens.weight"].bfloat16()
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
    assert "dtype bfloat16 != expected torch.float32" in problems["model.embed_tokens.weight"]
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
    assert ops.calls[-1] == f"update:{v}"  # never resumed on a mix
    v2 = sender.push(weights(3))
    assert controller.apply_latest() == v2
    assert controller.status()["healthy"] and not ops.paused and ops.served == str(v2)


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
