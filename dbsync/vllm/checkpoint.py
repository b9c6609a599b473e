"""What a served model accepts: names, shapes and dtypes in checkpoint (Hugging Face) format,
read from the safetensors headers of the model directory vLLM was started from (no tensor data
is read).

A published version fits when it has exactly these names and shapes, and floating tensors come
in the dtype the engine serves (``--dtype``); other tensors keep the checkpoint's dtype. A tied
``lm_head.weight`` (``tie_word_embeddings``) may be published or left out.
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

Expected = dict[str, tuple[tuple[int, ...], torch.dtype]]


def resolve_model_dir(model: str) -> str:
    """A local directory for ``model``: the path itself, or the Hugging Face cache's snapshot
    for a hub id (never downloads)."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as exc:
        raise DBSyncError(
            f"cannot find the checkpoint of model {model!r} on this host ({exc}); dbsync needs "
            "its safetensors files to check that published versions fit: pass a local "
            "directory as the model"
        ) from None


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
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
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
