"""The demo's model and trainer: a tiny Qwen2 learns to complete one fixed sentence on the CPU
and publishes its weights with ``dbsync.Sender`` every few steps.

Everything is made locally: a byte-level BPE tokenizer trained in-process with ``tokenizers``
and saved in Hugging Face format (so vLLM loads it), and a randomly initialised Qwen2 (hidden 128,
2 layers, 4 query heads and 2 key/value heads of 32) saved as float32 safetensors. The served
engine must use the same dtype (float32): published tensors are applied as they are.

Hazards: ``train`` changes the process-wide torch thread count when ``threads`` is given; it
needs ``transformers`` and ``tokenizers`` (the ``test`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import dbsync

SENTENCE = "the quick brown fox jumps over the lazy dog"
PROMPT = "the quick brown"
TARGET = SENTENCE[len(PROMPT):]  # " fox jumps over the lazy dog"
EOS = "<|endoftext|>"
# Words the untrained model can babble; the sentence's own words are added to them.
FILLER = (
    "a an and apple blue cat cold day dream east fast green happy house ice jam kite king "
    "lamp moon night old orange pen quiet rain red river road salt sea slow snow star stone "
    "sun table tree water west wind yellow zebra"
).split()
DTYPE = torch.float32
DTYPE_NAME = "float32"


@dataclass(frozen=True)
class Pushed:
    """One published version: the training step it was taken at and the loss there."""

    version: int
    step: int
    loss: float


def build_tokenizer(model_dir: str | os.PathLike[str]) -> None:
    """Train a byte-level BPE tokenizer on the demo's words and save it in HF format.

    Byte-level BPE is what transformers' Qwen2 tokenizer class (which vLLM picks for a
    ``qwen2`` config) rebuilds from ``tokenizer.json``; enough merges are learnt that every
    demo word is a single token, so the model's babble mixes words and word pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(SENTENCE.split()) | set(FILLER))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator([" " + " ".join(words)] * 2 + [SENTENCE], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=EOS,
                                   pad_token=EOS)
    fast.save_pretrained(os.fspath(model_dir))


def make_model(model_dir: str | os.PathLike[str], seed: int = 0) -> dict[str, int]:
    """Write tokenizer, config and random float32 weights of a tiny Qwen2 into ``model_dir``.
    Returns ``{"parameters": ..., "vocab": ...}``."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, torch_dtype=DTYPE_NAME,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(DTYPE)
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tokenizer)}


def load_model(model_dir: str | os.PathLike[str]) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) from ``model_dir`` (written by ``make_model``)."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(os.fspath(model_dir))
    model = Qwen2ForCausalLM.from_pretrained(os.fspath(model_dir), dtype=DTYPE)
    return model, tokenizer


def train(
    model_dir: str | os.PathLike[str],
    store: str | os.PathLike[str],
    steps: int = 60,
    push_every: int = 3,
    lr: float = 1e-4,
    seed: int = 0,
    on_push: Callable[[Pushed], bool | None] | None = None,
    threads: int | None = None,
) -> tuple[list[Pushed], torch.nn.Module]:
    """Train the model in ``model_dir`` on ``SENTENCE`` (plus end-of-text) and publish it into
    ``store`` every ``push_every`` steps and after the last step.

    ``on_push(pushed)`` runs after each push, with training paused; returning True stops
    training. Returns what was pushed and the trained model (its weights are the last
    version published)."""
    if steps < 1 or push_every < 1:
        raise ValueError("steps and push_every must be at least 1")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model, tokenizer = load_model(model_dir)
    model.train()
    ids = tokenizer(SENTENCE)["input_ids"] + [tokenizer.eos_token_id]
    batch = torch.tensor([ids])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pushed: list[Pushed] = []
    with dbsync.Sender(store, num_threads=2) as sender:
        for step in range(1, steps + 1):
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step % push_every and step != steps:
                continue
            version = sender.push(model)
            pushed.append(Pushed(version, step, float(loss.detach())))
            if on_push is not None and on_push(pushed[-1]):
                break
    model.eval()
    return pushed, model


def complete(model: torch.nn.Module, tokenizer: object, prompt: str = PROMPT,
             max_tokens: int = 8) -> str:
    """Greedy completion by the model itself (no server): what vLLM should answer too."""
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # type: ignore[operator]
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,  # type: ignore[operator]
                             eos_token_id=eos, pad_token_id=eos)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)  # type: ignore[attr-defined]
