"""What a served model accepts: names, shapes and dtypes in checkpoint (Hugging Face) format,
read from the safetensors headers of the model directory vLLM was started from (no tensor data
is read).

A published version fits when it has exactly these names and shapes; floating tensors may come
in any float dtype (the controller lets the weight loaders cast them to the served ``--dtype``),
other tensors keep the checkpoint's dtype. A tied ``lm_head.weight`` (``tie_word_embeddings``)
may be published or left out.

Which files: those named by ``model.safetensors.index.json`` when the directory has one (as
vLLM loads them: a stray ``consolidated.safetensors`` next to the shards is ignored), else every
``*.safetensors`` file.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from ..errors import DBSyncError

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20
INDEX_FILE = "model.safetensors.index.json"

Expected = dict[str, tuple[tuple[int, ...], torch.dtype]]


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files vLLM loads from ``model_dir``: those the index names, when there
    is an index, else every ``*.safetensors`` file."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DBSyncError(f"{index_path} is not a valid safetensors index ({exc}); fix or "
                              "remove it") from None
        missing = [f for f in files if not os.path.exists(os.path.join(model_dir, f))]
        if missing:
            raise DBSyncError(f"{index_path} names files that are not in {model_dir}: "
                              f"{', '.join(missing)}")
        return files
    return sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def read_safetensors_header(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise DBSyncError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise DBSyncError(f"{path}: safetensors header of {size} bytes is not plausible")
        header = json.loads(f.read(size))
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise DBSyncError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        out[name] = (tuple(info["shape"]), dtype)
    return out


def expected_from_checkpoint(model_dir: str, served_dtype: torch.dtype | None
                             ) -> tuple[Expected, list[str]]:
    """(expected name -> (shape, dtype), names allowed to be missing) for the model in
    ``model_dir`` served in ``served_dtype`` (None: keep the checkpoint's dtypes)."""
    files = checkpoint_files(model_dir)
    if not files:
        raise DBSyncError(
            f"{model_dir} holds no .safetensors files; dbsync reads their headers to check "
            "that published versions fit the served model (convert the checkpoint with "
            "save_pretrained(safe_serialization=True))"
        )
    expected: Expected = {}
    for name in files:
        expected.update(read_safetensors_header(os.path.join(model_dir, name)))
    if served_dtype is not None:
        expected = {n: (shape, served_dtype if dt.is_floating_point else dt)
                    for n, (shape, dt) in expected.items()}
    allow_missing: list[str] = []
    config_path = os.path.join(model_dir, "config.json")
    config = {}
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    tied = config.get("tie_word_embeddings", False)
    embed = next((n for n in expected if n.endswith("model.embed_tokens.weight")), None)
    if tied and embed is not None:
        head = embed[: -len("model.embed_tokens.weight")] + "lm_head.weight"
        expected.setdefault(head, expected[embed])
        allow_missing.append(head)
    return expected, allow_missing
