"""Shared helpers for the vLLM integration tests and the swap benchmark.

Builds tiny Qwen2 checkpoints (random weights, a word-level tokenizer trained in-process), starts
vLLM engines and OpenAI servers on this machine's CPU, and compares greedy completions.

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
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
KV_CACHE_BYTES = 128 * 2**20
DTYPE = "float32"
VOCAB_WORDS = [f"w{i}" for i in range(400)]
EOS = "<|endoftext|>"
PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40", "w7", "w100 w200 w300 w5 w6 w8"]
MAX_TOKENS = 12
#: a minimal chat template (the messages' contents, concatenated) so chat routes work
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_tokenizer(path: Path) -> None:
    """Train a small byte-level BPE tokenizer (the kind Qwen2's tokenizer class expects) and
    save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(VOCAB_WORDS)] * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=EOS,
                                   pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_tiny_qwen2(path: str | os.PathLike[str], seed: int, hidden: int = 128,
                    layers: int = 2, intermediate: int = 256, vocab: int = 512,
                    sharded: bool = False) -> Path:
    """Save a random tiny Qwen2 (float32, safetensors) with a tokenizer into ``path``.

    Different seeds give different weights of the same shapes; a different ``hidden`` or
    ``intermediate`` gives a checkpoint that does not fit a served model of the default shape.
    The model has no tied embeddings, so every parameter is in the checkpoint. ``sharded``
    saves it in several files with a ``model.safetensors.index.json`` and adds a stray
    safetensors file the index does not name, with other names (like the
    ``consolidated.safetensors`` of Mistral-style repos); vLLM loads only what the index names.
    (A file named ``consolidated*.safetensors`` itself would switch vLLM to the Mistral loader,
    which a Qwen2 model does not support.)"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # large weights: greedy outputs differ clearly between seeds
    if sharded:
        from safetensors.torch import save_file

        model.save_pretrained(path, safe_serialization=True, max_shard_size="300KB")
        assert (path / "model.safetensors.index.json").exists()
        save_file({"tok_embeddings.weight": torch.zeros(vocab, hidden)},
                  str(path / "original.safetensors"))
    else:
        model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


@functools.cache
def models_dir() -> Path:
    """One directory per test session holding the tiny checkpoints (removed at exit)."""
    path = Path(tempfile.mkdtemp(prefix="dbsync-vllm-models-"))
    atexit.register(shutil.rmtree, path, True)
    return path


_model_lock = threading.Lock()


def tiny_model(name: str) -> Path:
    """The session's shared checkpoints: "A" and "B" (same shapes, different weights), "C"
    (a wider MLP: does not fit a model served from A or B) and "A-sharded" (A's weights in
    shards with an index and a stray safetensors file)."""
    specs: dict[str, dict[str, Any]] = {
        "A": dict(seed=1), "B": dict(seed=2), "C": dict(seed=3, intermediate=384),
        "A-sharded": dict(seed=1, sharded=True)}
    with _model_lock:
        path = models_dir() / name
        if not (path / "config.json").exists():
            make_tiny_qwen2(path, **specs[name])
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


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` sized for this machine."""
    kwargs: dict[str, Any] = dict(
        dtype=DTYPE, enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=256, max_num_seqs=8, seed=0,
    )
    kwargs.update(extra)
    return kwargs


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


def child_env(plain: bool = False, **extra: str) -> dict[str, str]:
    """The environment of child processes; ``plain``: without the KV-cache cap the tests set
    (what a user's shell has)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if plain:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def complete(base: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    out = http_json(f"{base}/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True,
    })
    return out["choices"][0]["text"]


def wait_until(predicate: Any, timeout: float, interval: float = 0.2, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            last = predicate()
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Server:
    """``python -m dbsync.vllm.server ROOT --model DIR`` in a child process, sized for this
    machine. ``plain``: ``dbsync serve-vllm ROOT --model DIR [dbsync options]`` as a user types
    it (no vLLM options, no KV-cache cap in the environment); ``extra`` are then dbsync
    options, else vLLM options."""

    def __init__(self, root: Path, model_dir: Path, log_path: Path, *extra: str,
                 env: dict[str, str] | None = None, plain: bool = False):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.log_path = log_path
        if plain:
            cmd = [sys.executable, "-m", "cli.main", "serve-vllm", str(root),
                   "--model", str(model_dir), "--port", str(self.port), *extra]
        else:
            cmd = [sys.executable, "-m", "dbsync.vllm.server", str(root),
                   "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                   "--poll-interval", "0.2", "--", "--dtype", DTYPE, "--enforce-eager",
                   "--max-model-len", "256", "--max-num-seqs", "8",
                   "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *extra]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=child_env(plain=plain, **(env or {})))

    def status(self) -> dict[str, Any]:
        return http_json(f"{self.base}/dbsync/status", timeout=10)

    def wait_ready(self, timeout: float = 240) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            return http_json(f"{self.base}/dbsync/status", timeout=5) is not None

        try:
            wait_until(ready, timeout, 0.5, "the server to answer")
        except TimeoutError:
            raise TimeoutError(f"server not ready:\n{self.tail()}") from None

    def wait_version(self, version: int, timeout: float = 60) -> dict[str, Any]:
        return wait_until(lambda: (s := self.status())["version"] == version and s, timeout,
                          0.1, f"version {version} to be served")

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def scrape_metrics(base: str, prefix: str = "dbsync_") -> dict[str, float]:
    """``/metrics`` samples whose name starts with ``prefix``: ``'name{labels}' -> value``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@contextlib.contextmanager
def running_server(root: Path, model_dir: Path, log_path: Path,
                   *extra: str) -> Iterator[Server]:
    server = Server(root, model_dir, log_path, *extra)
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
