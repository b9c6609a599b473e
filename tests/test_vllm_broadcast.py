"""The broadcast transport on the real CPU vLLM engine: a trainer process broadcasts over gloo
(``BroadcastSender(Sender(root), device="cpu")``), the engine's worker stages what it receives,
and ``apply_latest()`` serves it; completions equal a fresh engine's, token for token (the
engine starts from B, so its own first completions are that reference). The swap
semantics are the filesystem path's (refusal included), and with the sender gone the
filesystem delivers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dbsync import IncompatibleWeightsError, Sender
from tests.vllm_helpers import REPO, child_env, engine_kwargs, greedy, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: The trainer: a BroadcastSender driven by JSON lines on stdin, answering JSON lines.
TRAINER = r"""
import json, sys
from dbsync import Sender
from dbsync.nccl import BroadcastSender

sender = BroadcastSender(Sender(sys.argv[1]), device="cpu", address="127.0.0.1", timeout=20.0)
print(json.dumps({"ready": sender.port}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "wait_joins":
        joined = sender.wait_for_joins(cmd["count"], timeout=cmd["timeout"])
        print(json.dumps({"joined": joined, "pending": sender.pending_joins()}), flush=True)
    elif cmd["op"] == "push":
        version = sender.push(cmd["dir"])
        print(json.dumps({"version": version, "stats": sender.last_push_stats}, default=str),
              flush=True)
    elif cmd["op"] == "close":
        sender.close()
        print(json.dumps({"closed": True}), flush=True)
        break
"""


class Trainer:
    """The trainer process (a real BroadcastSender on the store)."""

    def __init__(self, root: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(root)], cwd=REPO, env=child_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert "ready" in self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the trainer exited with {self.proc.wait(10)}")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


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
        trainer = Trainer(store)
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
