"""Shared helpers for the vLLM integration tests.

The rig itself (tiny Qwen2 checkpoints with a word-level tokenizer trained in-process, the
``serve-vllm`` child process) is ``dbsync.testing``, shared with the benchmarks and re-exported
here; this module adds the session's checkpoints, reference completions of fresh engines and
the trainer processes of the broadcast tests.

Hazards: every engine costs ~2 GB of RAM and 10-20 s to start on a 2-core machine, so tests share
engines through module-scoped fixtures; each engine caps its KV cache at 128 MiB.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dbsync.testing import (  # noqa: F401 - the tests' shared rig, re-exported
    CHAT_TEMPLATE,
    DTYPE,
    EOS,
    KV_CACHE_BYTES,
    VOCAB_WORDS,
    Server,
    build_tokenizer,
    child_env,
    engine_kwargs,
    free_port,
    http_json,
    make_tiny_qwen2,
    make_tiny_qwen2_moe,
    scrape_metrics,
    wait_until,
)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w7", "w100 w200 w300 w5 w6 w8"]
MAX_TOKENS = 12


@functools.cache
def models_dir() -> Path:
    """One directory per test session holding the tiny checkpoints (removed at exit)."""
    path = Path(tempfile.mkdtemp(prefix="dbsync-vllm-models-"))
    atexit.register(shutil.rmtree, path, True)
    return path


_model_lock = threading.Lock()


def tiny_model(name: str) -> Path:
    """The session's shared checkpoints: "A" and "B" (same shapes, different weights), "C"
    (a wider MLP: does not fit a model served from A or B), "A-sharded" (A's weights in
    shards with an index and a stray safetensors file), "MoE-A" and "MoE-B" (tiny
    Qwen2-MoE checkpoints of the same shapes), and "tied-A" and "tied-B" (an LM head tied to
    the token embedding)."""
    specs: dict[str, dict[str, Any]] = {
        "A": dict(seed=1), "B": dict(seed=2), "C": dict(seed=3, intermediate=384),
        "A-sharded": dict(seed=1, sharded=True), "MoE-A": dict(seed=1), "MoE-B": dict(seed=2),
        "tied-A": dict(seed=1, tied=True), "tied-B": dict(seed=2, tied=True)}
    with _model_lock:
        path = models_dir() / name
        if not (path / "config.json").exists():
            make = make_tiny_qwen2_moe if name.startswith("MoE-") else make_tiny_qwen2
            make(path, **specs[name])
        return path


_REF_MARK = "dbsync-reference: "


class ReferenceJob:
    """Greedy completions of a fresh engine started from a checkpoint, computed in a child
    process started at once (so it overlaps other engines' start-up); ``result()`` waits."""

    def __init__(self, model_dir: Path, prompts: list[str] = PROMPTS, dtype: str = DTYPE):
        code = ("from tests.vllm_helpers import reference_main\n"
                "if __name__ == '__main__':\n    reference_main()\n")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, os.fspath(model_dir), json.dumps(prompts), dtype],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env())
        self._result: list[str] | None = None

    def result(self, timeout: float = 300) -> list[str]:
        if self._result is None:
            out, err = self._proc.communicate(timeout=timeout)
            if self._proc.returncode != 0:
                raise RuntimeError(f"reference engine failed:\n{err[-4000:]}")
            lines = [x for x in out.splitlines() if x.startswith(_REF_MARK)]
            if not lines:
                raise RuntimeError(f"reference engine printed no result:\n{out[-2000:]}")
            self._result = json.loads(lines[-1][len(_REF_MARK):])
        return self._result


@functools.cache
def reference(name: str, dtype: str = DTYPE) -> ReferenceJob:
    """The session's reference job for checkpoint ``name`` served in ``dtype`` (started on
    first use)."""
    return ReferenceJob(tiny_model(name), dtype=dtype)


def greedy(llm: Any, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[str]:
    """Greedy completions of ``prompts`` by an offline ``vllm.LLM``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def reference_main() -> None:
    from vllm import LLM

    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    dtype = sys.argv[3] if len(sys.argv) > 3 else DTYPE
    llm = LLM(model=model_dir, **engine_kwargs(dtype=dtype))
    print(_REF_MARK + json.dumps(greedy(llm, prompts)), flush=True)


def complete(base: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    out = http_json(f"{base}/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True,
    })
    return out["choices"][0]["text"]


@contextlib.contextmanager
def child_output_to(path: Path) -> Iterator[None]:
    """Processes started inside this block write their stdout and stderr into ``path``
    (file descriptors 1 and 2 are redirected meanwhile, then restored): an engine's worker
    and core processes, whose log lines a test wants to read."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as f:
        try:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@contextlib.contextmanager
def running_server(root: Path, model_dir: Path, log_path: Path,
                   *extra: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    server = Server(root, model_dir, log_path, *extra, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def flip_a_byte(root: str | Path, index: int = 0) -> None:
    """Damage the current version: flip the first byte of tensor ``index`` in its shard."""
    from dbsync.store import Store

    store = Store(root)
    manifest = store.require_manifest()
    entry = manifest.tensors[index]
    shard = os.path.join(store.slot_dir(manifest.slot), f"shard-{entry.shard:05d}.bin")
    with open(shard, "r+b") as f:
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([byte[0] ^ 0xFF]))


#: The trainer: a BroadcastSender driven by JSON lines on stdin, answering JSON lines.
TRAINER = r"""
import json, sys
from dbsync import Sender
from dbsync.nccl import BroadcastSender

options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
sender = BroadcastSender(Sender(sys.argv[1]), device="cpu", address="127.0.0.1", timeout=20.0,
                         **options)
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
    """A trainer process: a real ``BroadcastSender`` (gloo) on the store at ``root``, made
    with ``sender_options`` (e.g. ``bucket_bytes``)."""

    def __init__(self, root: Path, **sender_options: Any):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(root), json.dumps(sender_options)], cwd=REPO,
            env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
