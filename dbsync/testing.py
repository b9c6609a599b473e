"""Tiny vLLM rigs for tests and benchmarks of code that uses dbsync: random Qwen2 checkpoints
(dense, with a tied LM head, or mixture-of-experts) small enough for a CPU host, and
``serve-vllm`` run in a child process.

    from dbsync.testing import Server, make_tiny_qwen2

    model = make_tiny_qwen2(work / "A", seed=1)          # 128 hidden, 2 layers, float32
    with Server(store, model, work / "server.log") as server:
        server.wait_ready()
        server.wait_version(sender.push(weights))

Hazards: each engine costs ~2 GB of RAM and 10-60 s to start on a 2-core host, and caps its KV
cache at ``KV_CACHE_BYTES``; the checkpoints' weights are random (large, so that greedy outputs
of two seeds differ clearly), their tokenizer knows the words ``w0`` .. ``w399`` only. Needs
``transformers`` and ``tokenizers`` to build a checkpoint and vLLM to serve one.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from .demo import free_port, http_json

__all__ = ["CHAT_TEMPLATE", "DTYPE", "EOS", "KV_CACHE_BYTES", "VOCAB_WORDS", "Server",
           "build_tokenizer", "child_env", "engine_kwargs", "free_port", "http_json",
           "make_tiny_qwen2", "make_tiny_qwen2_moe", "scrape_metrics", "wait_until"]

#: the directory above the package: a source checkout's root (the child processes' cwd; its
#: ``cli`` package is the command line there, ``dbsync_cli`` where dbsync is installed)
REPO = Path(__file__).resolve().parents[1]

#: each engine caps its KV cache at this
KV_CACHE_BYTES = 128 * 2**20
DTYPE = "float32"
#: the tokenizer's words: every one is a single token
VOCAB_WORDS = [f"w{i}" for i in range(400)]
EOS = "<|endoftext|>"
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
                    sharded: bool = False, tied: bool = False) -> Path:
    """Save a random tiny Qwen2 (float32, safetensors) with a tokenizer into ``path``.

    Different seeds give different weights of the same shapes; a different ``hidden`` or
    ``intermediate`` gives a checkpoint that does not fit a served model of the default shape.
    The model has no tied embeddings, so every parameter is in the checkpoint, unless ``tied``
    (the LM head shares the token embedding's weight, stored once, as in Qwen2-0.5B). ``sharded``
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
        head_dim=32, max_position_embeddings=512, tie_word_embeddings=tied,
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


def make_tiny_qwen2_moe(path: str | os.PathLike[str], seed: int, experts: int = 8,
                        expert_intermediate: int = 40, layers: int = 2) -> Path:
    """Save a random tiny Qwen2-MoE (float32, safetensors, one tensor per expert and
    projection) with a tokenizer into ``path``: every layer sparse (``experts`` experts, two
    per token, plus a shared expert). The default ``expert_intermediate`` is not a multiple of
    the CPU kernel's alignment, so the CPU build pads the experts as well as prepacking them."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = Qwen2MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=expert_intermediate, shared_expert_intermediate_size=128,
        num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=0, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` sized for this machine."""
    kwargs: dict[str, Any] = dict(
        dtype=DTYPE, enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=256, max_num_seqs=8, seed=0,
    )
    kwargs.update(extra)
    return kwargs


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
    options, else vLLM options, and ``options`` are dbsync options (``--pause-mode wait``).
    ``sigint_ignored``: started with SIGINT ignored, as a shell script's background job is."""

    def __init__(self, root: Path, model_dir: Path, log_path: Path, *extra: str,
                 env: dict[str, str] | None = None, plain: bool = False,
                 options: tuple[str, ...] = (), sigint_ignored: bool = False):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.log_path = log_path
        if plain:
            cli = "cli.main" if (REPO / "cli" / "main.py").exists() else "dbsync_cli.main"
            cmd = [sys.executable, "-m", cli, "serve-vllm", str(root),
                   "--model", str(model_dir), "--port", str(self.port), *options, *extra]
        else:
            cmd = [sys.executable, "-m", "dbsync.vllm.server", str(root),
                   "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                   "--poll-interval", "0.2", *options, "--", "--dtype", DTYPE, "--enforce-eager",
                   "--max-model-len", "256", "--max-num-seqs", "8",
                   "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *extra]
        if sigint_ignored:  # (the same process: ``exec`` keeps the ignored signal)
            cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
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

