"""Turn anything a user hands to ``push`` into an ordered list of (name, tensor).

Accepted: ``nn.Module``, ``Mapping[str, Tensor]``, a ``TensorDict`` (nested keys joined with
'.'), or a path: a ``.safetensors`` file, a directory of them (an HF checkpoint, sharded with
``model.safetensors.index.json`` or not), a torch ``.pt``/``.bin`` state dict (loaded with
``weights_only=True``: no code runs), or a tensordict memmap directory (``meta.json``).

Everything is validated before any byte is written, and one error lists every bad entry.
Order is preserved (a module's state_dict order is layer order, which vLLM's layerwise reload
needs); checkpoint directories are read in the index's order of shards and keys.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from .errors import InvalidWeightsError
from .format import is_supported_dtype

Pairs = list[tuple[str, torch.Tensor]]

STRATEGIES = ("state_dict", "tensordict")


def collect(weights: Any, strategy: str = "state_dict", dtype: torch.dtype | None = None) -> Pairs:
    if strategy not in STRATEGIES:
        raise InvalidWeightsError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidWeightsError(f"dtype= must be a floating torch dtype, not {dtype!r}")
    pairs = _pairs_of(weights, strategy)
    _validate(pairs)
    return pairs if dtype is None else [(n, t.to(target_dtype(t, dtype))) for n, t in pairs]


def target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is published in: ``dtype`` for floating tensors, else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _pairs_of(weights: Any, strategy: str) -> list[tuple[Any, Any]]:
    if isinstance(weights, str | os.PathLike):
        return load_path(os.fspath(weights))
    if isinstance(weights, torch.nn.Module):
        if strategy == "tensordict":
            from tensordict import TensorDict

            return _tensordict_pairs(TensorDict.from_module(weights))
        return list(weights.state_dict().items())
    tensordict = sys.modules.get("tensordict")  # no TensorDict exists unless it was imported
    if tensordict is not None and isinstance(weights, tensordict.TensorDictBase):
        return _tensordict_pairs(weights)
    if isinstance(weights, Mapping):
        return list(weights.items())
    raise InvalidWeightsError(
        f"cannot publish a {type(weights).__name__}: pass an nn.Module, a mapping of names to "
        "tensors, a TensorDict, or a path to a .safetensors file or checkpoint directory"
    )


def _tensordict_pairs(td: Any) -> list[tuple[Any, Any]]:
    pairs = []
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        name = ".".join(key) if isinstance(key, tuple) else key
        pairs.append((name, value))
    return pairs


def _is_leaf(cls: type) -> bool:
    from tensordict import TensorDictBase

    return not issubclass(cls, TensorDictBase)


def _validate(pairs: list[tuple[Any, Any]]) -> None:
    problems: list[str] = []
    seen: set[str] = set()
    for name, value in pairs:
        label = repr(name)
        if not isinstance(name, str) or not name:
            problems.append(f"{label}: names must be non-empty strings")
        elif "\x00" in name:
            problems.append(f"{label}: names may not contain NUL")
        elif name in seen:
            problems.append(f"{label}: appears twice")
        if isinstance(name, str):
            seen.add(name)
        if not isinstance(value, torch.Tensor):
            problems.append(f"{label}: is a {type(value).__name__}, not a tensor (drop it or "
                            "convert it to a tensor)")
        elif value.is_sparse or value.layout != torch.strided:
            problems.append(f"{label}: sparse/non-strided tensors are not supported (densify it)")
        elif not is_supported_dtype(value.dtype):
            problems.append(f"{label}: dtype {value.dtype} is not supported")
        elif value.device.type == "meta":
            problems.append(f"{label}: is on the meta device and has no data")
    if problems:
        raise InvalidWeightsError(
            f"{len(problems)} entr{'y' if len(problems) == 1 else 'ies'} cannot be published; "
            "nothing was written:\n  " + "\n  ".join(problems)
        )


# ---- paths ---------------------------------------------------------------------------------
def load_path(path: str) -> Pairs:
    if not os.path.exists(path):
        raise InvalidWeightsError(f"{path} does not exist; check the path")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "meta.json")):
            return _load_tensordict_dir(path)
        return _load_safetensors_dir(path)
    if path.endswith(".safetensors"):
        return _load_safetensors_file(path)
    if path.endswith((".pt", ".pth", ".bin")):
        return _load_torch_file(path)
    raise InvalidWeightsError(
        f"{path}: unknown kind of file; expected .safetensors, .pt/.pth/.bin, or a directory"
    )


def _load_safetensors_file(path: str) -> Pairs:
    """Tensors in the order their bytes lie in the file (the order they were saved in, which
    groups a checkpoint by layer); ``safe_open().keys()`` would give alphabetical order."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return [(key, f.get_tensor(key)) for key in f.offset_keys()]
    except Exception as exc:  # safetensors raises its own error types and OSError
        raise InvalidWeightsError(
            f"{path} is not a readable safetensors file ({exc}); re-export it"
        ) from None


def _load_safetensors_dir(path: str) -> Pairs:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidWeightsError(f"{index_path} is not a valid index ({exc})") from None
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise InvalidWeightsError(
                f"{index_path} names shard(s) that are missing: {', '.join(missing)}; "
                "copy the complete checkpoint"
            )
        by_shard = {s: dict(_load_safetensors_file(os.path.join(path, s))) for s in shards}
        absent = [k for k, s in weight_map.items() if k not in by_shard[s]]
        if absent:
            raise InvalidWeightsError(
                f"{index_path} lists tensors its shards do not hold: {', '.join(absent[:20])}"
            )
        return [(k, by_shard[s][k]) for k, s in weight_map.items()]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise InvalidWeightsError(
            f"{path} holds no .safetensors files, no model.safetensors.index.json and no "
            "tensordict meta.json; point at a checkpoint directory or a weights file"
        )
    pairs: Pairs = []
    for name in files:
        pairs.extend(_load_safetensors_file(os.path.join(path, name)))
    return pairs


def _load_torch_file(path: str) -> Pairs:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise InvalidWeightsError(
            f"{path} could not be loaded as a plain state dict with weights_only=True ({exc}); "
            "save it with torch.save(model.state_dict(), path) or convert it to safetensors"
        ) from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise InvalidWeightsError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return list(obj.items())


def _load_tensordict_dir(path: str) -> Pairs:
    """Read a tensordict memmap directory through its meta.json, checking every file exists
    and has the right size (tensordict's own loader silently skips missing files)."""
    from tensordict import TensorDict

    problems = []
    for dirpath, _dirs, files in os.walk(path):
        if "meta.json" not in files:
            continue
        try:
            with open(os.path.join(dirpath, "meta.json"), encoding="utf-8") as f:
                meta = json.load(f)
        except ValueError as exc:
            raise InvalidWeightsError(f"{dirpath}/meta.json is not valid JSON ({exc})") from None
        # tensordict writes each leaf as a top-level entry carrying a "dtype"
        leaves = [k for k, v in meta.items() if isinstance(v, dict) and "dtype" in v]
        for key in leaves:
            if not os.path.isfile(os.path.join(dirpath, f"{key}.memmap")):
                problems.append(os.path.join(dirpath, f"{key}.memmap"))
    if problems:
        raise InvalidWeightsError(
            "tensordict directory is incomplete; missing: " + ", ".join(problems)
        )
    try:
        td = TensorDict.load_memmap(path)
    except Exception as exc:
        raise InvalidWeightsError(f"{path} is not a loadable tensordict memmap ({exc})") from None
    return _tensordict_pairs(td)
