"""LoRA benchmark: push-to-served latency of a rank-16 adapter against the full-weight swap of
the same model, in the same run on the same machine, with the raw copy of the same bytes.

    python bench/bench_lora.py [--hidden 896 --layers 24 --intermediate 4864 --vocab 151936]
                               [--rank 16 --rounds 5] [--dtype bfloat16] [--json OUT.json]

Defaults are the shape of a 0.5B-class Qwen2 (Qwen2.5-0.5B: hidden 896, 24 layers, MLP 4864,
14 heads of 64, 2 KV heads, vocabulary 151,936, tied embeddings), random weights, served in
bfloat16. The adapter targets every linear layer (q, k, v, o, gate, up, down), float32 as a
trainer keeps it.

Each phase runs in its own child process with one offline ``vllm.LLM`` (one engine at a time:
the machine may be small), the store in ``/dev/shm`` (``durable=False``, same host):

- lora: ``LLM(enable_lora=True, max_lora_rank=R, max_loras=2)`` and
  ``dbsync.vllm.attach(llm, ROOT, lora="bench")``. Per round: ``Sender.push(adapter tensors,
  adapter_config=...)``, then ``latest()`` (open, verify, check, materialise, ``add_lora``),
  then a 1-token request on the returned ``LoRARequest``.
- full: ``LLM(**dbsync.vllm.engine_args())`` and ``dbsync.vllm.attach(llm, ROOT)``. Per round:
  ``Sender.push(state_dict)``, then ``apply_latest()``, then a 1-token request.

Reported per phase (medians over ``--rounds`` after one warm-up round): ``push_s``,
``apply_s``, ``push_to_served_s`` (push start -> the engine serves the version),
``first_request_s`` (the 1-token request after it), ``bytes`` and ``raw_copy_s`` (one
``memcpy`` of the version's bytes, the raw limit of moving them once), with the ratio of
``push_to_served_s`` to it; and the ratio full / lora.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MARK = "bench-lora-result: "
KV_CACHE_BYTES = 128 * 2**20
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_dims(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
               ) -> dict[str, tuple[int, int]]:
    """Leaf module -> (out, in) of one Qwen2 decoder layer."""
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
            "down_proj": (hidden, intermediate)}


def make_checkpoint(path: Path, opts: argparse.Namespace) -> None:
    """A random Qwen2 checkpoint of the requested shape (safetensors + config.json), written
    tensor by tensor (no model object: fast, little memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    dtype = getattr(torch, opts.dtype)
    heads = opts.hidden // opts.head_dim
    config = Qwen2Config(
        vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
        num_hidden_layers=opts.layers, num_attention_heads=heads,
        num_key_value_heads=opts.kv_heads, head_dim=opts.head_dim,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=0, torch_dtype=opts.dtype)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": rand(opts.vocab, opts.hidden),
                               "model.norm.weight": torch.ones(opts.hidden, dtype=dtype)}
    dims = layer_dims(opts.hidden, opts.intermediate, heads, opts.kv_heads, opts.head_dim)
    for i in range(opts.layers):
        pre = f"model.layers.{i}"
        tensors[f"{pre}.input_layernorm.weight"] = torch.ones(opts.hidden, dtype=dtype)
        tensors[f"{pre}.post_attention_layernorm.weight"] = torch.ones(opts.hidden, dtype=dtype)
        for leaf, (out_f, in_f) in dims.items():
            group = "self_attn" if leaf.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            tensors[f"{pre}.{group}.{leaf}.weight"] = rand(out_f, in_f)
            if leaf in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{pre}.{group}.{leaf}.bias"] = rand(out_f)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def adapter(opts: argparse.Namespace, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Random rank-R LoRA tensors for every linear layer (PEFT names) and their config."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    heads = opts.hidden // opts.head_dim
    dims = layer_dims(opts.hidden, opts.intermediate, heads, opts.kv_heads, opts.head_dim)
    tensors = {}
    for i in range(opts.layers):
        for leaf, (out_f, in_f) in dims.items():
            group = "self_attn" if leaf in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{group}.{leaf}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(opts.rank, in_f, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, opts.rank, generator=gen) * 0.01
    config = {"peft_type": "LORA", "r": opts.rank, "lora_alpha": 2 * opts.rank,
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
              "target_modules": list(LINEAR)}
    return tensors, config


def raw_copy_s(nbytes: int, repeats: int = 10) -> float:
    """Best of ``repeats`` single memcpy's of ``nbytes`` (both buffers touched first)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def run_phase(phase: str, model_dir: str, opts: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    import dbsync
    from dbsync.vllm import attach, engine_args

    root = tempfile.mkdtemp(prefix=f"dbsync-bench-lora-{phase}-",
                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    common = dict(model=model_dir, dtype=opts.dtype, enforce_eager=True,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=256, max_num_seqs=4,
                  skip_tokenizer_init=True, seed=0)
    t0 = time.perf_counter()
    if phase == "lora":
        llm = LLM(**common, enable_lora=True, max_lora_rank=max(16, opts.rank), max_loras=2)
    else:
        llm = LLM(**common, **engine_args())
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    rows: list[dict[str, float]] = []
    nbytes = 0
    try:
        with dbsync.Sender(root, durable=False) as sender:
            if phase == "full":
                from safetensors.torch import load_file

                weights = load_file(os.path.join(model_dir, "model.safetensors"))
                sender.push(weights)  # version 1 exists before attaching
                att: Any = attach(llm, root, watch=False, transport="filesystem")
            else:
                att = None
            for rnd in range(opts.rounds + 1):
                if phase == "lora":
                    tensors, config = adapter(opts, seed=rnd)
                    t0 = time.perf_counter()
                    sender.push(tensors, adapter_config=config)
                    t1 = time.perf_counter()
                    if att is None:
                        att = attach(llm, root, lora="bench")
                    request = att.latest()
                    t2 = time.perf_counter()
                    llm.generate([prompt], params, lora_request=request, use_tqdm=False)
                else:
                    t0 = time.perf_counter()
                    sender.push(weights)
                    t1 = time.perf_counter()
                    att.apply_latest()
                    t2 = time.perf_counter()
                    llm.generate([prompt], params, use_tqdm=False)
                t3 = time.perf_counter()
                if rnd:  # round 0 warms up
                    rows.append({"push_s": t1 - t0, "apply_s": t2 - t1,
                                 "push_to_served_s": t2 - t0, "first_request_s": t3 - t2})
                    if phase == "lora":
                        rows[-1].update(att.timings)
            nbytes = sender.store.require_manifest().total_bytes
            if att is not None:
                att.detach()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    raw = raw_copy_s(nbytes)
    return {"phase": phase, "engine_start_s": start_s, "bytes": nbytes, "rounds": rows,
            **{f"median_{k}": v for k, v in medians.items()}, "raw_copy_s": raw,
            "push_to_served_over_raw_copy": medians["push_to_served_s"] / raw}


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    import torch
    import vllm

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--phase", choices=("lora", "full"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    opts = parse()
    if opts.phase is not None:
        result = run_phase(opts.phase, opts.model_dir, opts)
        print(MARK + json.dumps(result), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="dbsync-bench-lora-"))
    try:
        model_dir = work / "model"
        t0 = time.perf_counter()
        make_checkpoint(model_dir, opts)
        print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        phases = {}
        for phase in ("lora", "full"):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase,
                   "--model-dir", str(model_dir)]
            cmd = [c for c in cmd if c is not None]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                  check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"phase {phase} failed (exit {proc.returncode})")
            phases[phase] = json.loads(lines[-1][len(MARK):])
            print(f"{phase}: median push-to-served "
                  f"{1e3 * phases[phase]['median_push_to_served_s']:.1f} ms "
                  f"({phases[phase]['bytes'] / 2**20:.1f} MiB)", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shape = {k: getattr(opts, k) for k in ("hidden", "layers", "intermediate", "vocab",
                                           "head_dim", "kv_heads", "rank", "dtype")}
    result = {
        "benchmark": "bench_lora", "machine": machine(), "shape": shape,
        "store": "/dev/shm, durable=False", "rounds": opts.rounds, **phases,
        "full_over_lora_push_to_served": (phases["full"]["median_push_to_served_s"]
                                          / phases["lora"]["median_push_to_served_s"]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if opts.json:
        Path(opts.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
