"""A vision-language engine across a swap, in a process of its own (run by
``test_vllm_multimodal.py`` with ``torchvision_standin`` on ``PYTHONPATH``):

    python tests/multimodal_worker.py WORKDIR

Builds two random tiny PaliGemma checkpoints (SigLIP encoder, Gemma decoder), A and B. A fresh
engine of B answers two prompts, each with an image. An engine of A, attached to a store,
answers the same; then B is pushed and applied, and it answers again. Prints one JSON line:
``fresh_b``, ``served_a``, ``after_push_b``."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dbsync  # noqa: E402
from dbsync import vllm as dbsync_vllm  # noqa: E402
from dbsync.testing import build_tokenizer, engine_kwargs  # noqa: E402

PROMPT = "w1 w2 w3 w4"
IMAGE_SIZE, PATCH = 32, 8


def make_tiny_paligemma(path: Path, seed: int) -> Path:
    """A random tiny PaliGemma (float32) with a processor, as vLLM 0.32 loads it: 16 image
    tokens per 32x32 image. The vision tower is saved under the names vLLM 0.32 maps
    (``vision_tower.vision_model.*``; transformers 5 drops ``vision_model``)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"],
                                  "bos_token": tokenizer.eos_token})
    tokenizer.add_tokens(["\n"])  # (vLLM's PaliGemma prompt ends each image with it)
    text = tf.GemmaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, max_position_embeddings=512, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, image_size=IMAGE_SIZE,
                                   patch_size=PATCH, vision_use_head=False)
    config = tf.PaliGemmaConfig(vision_config=vision, text_config=text,
                                image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                projection_dim=128, hidden_size=128, vocab_size=2048)
    torch.manual_seed(seed)
    model = tf.PaliGemmaForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    weights = path / "model.safetensors"
    renamed = {(name.replace("vision_tower.", "vision_tower.vision_model.", 1)
                if name.startswith("vision_tower.") else name): tensor
               for name, tensor in load_file(str(weights)).items()}
    save_file(renamed, str(weights), metadata={"format": "pt"})
    images = tf.SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images.image_seq_length = (IMAGE_SIZE // PATCH) ** 2
    tf.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)
    return path


def answers(llm: Any, images: list[Any]) -> list[str]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in images]
    return [o.outputs[0].text for o in llm.generate(requests, params, use_tqdm=False)]


def main(work: Path) -> None:
    from PIL import Image
    from vllm import LLM

    model_a = make_tiny_paligemma(work / "A", seed=1)
    model_b = make_tiny_paligemma(work / "B", seed=2)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))
              for _ in range(2)]
    fresh = LLM(model=str(model_b), **engine_kwargs())
    fresh_b = answers(fresh, images)
    fresh.llm_engine.engine_core.shutdown()
    del fresh
    gc.collect()
    llm = LLM(model=str(model_a), **engine_kwargs(**dbsync_vllm.engine_args()))
    served_a = answers(llm, images)  # (the engine keeps their encoder outputs)
    with dbsync.Sender(work / "store") as sender, \
            dbsync_vllm.attach(llm, work / "store", watch=False) as attached:
        sender.push(str(model_b))
        attached.apply_latest()
        after_push_b = answers(llm, images)
    llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"fresh_b": fresh_b, "served_a": served_a,
                      "after_push_b": after_push_b}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
