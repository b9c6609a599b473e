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
import logging
import math
import os
import stat
from collections.abc import Mapping
from typing import Any

import torch

from . import fileio
from .errors import InvalidWeightsError, first_line, short_repr
from .format import (
    DTYPE_SIZES,
    MANIFEST_FILE,
    MAX_DIM_SIZE,
    MAX_DIMS,
    READERS_DIR,
    is_extra_state,
    is_supported_dtype,
    is_tensordict,
    is_tensordict_class,
    name_problem,
    plain_state_dict,
    unwrap_compiled,
)
from .hfcheckpoint import checkpoint_views

log = logging.getLogger(__name__)

Pairs = list[tuple[str, torch.Tensor]]

STRATEGIES = ("state_dict", "tensordict")
#: file names taken for torch state dicts (``torch.load(weights_only=True)``)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def collect(weights: Any, strategy: str = "state_dict", dtype: torch.dtype | None = None) -> Pairs:
    if strategy not in STRATEGIES:
        raise InvalidWeightsError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    check_target_dtype(dtype, InvalidWeightsError)
    pairs = pairs_of(weights, strategy)
    validate(pairs)
    return pairs if dtype is None else materialize_all(pairs, dtype)


def check_target_dtype(dtype: Any, error: type[Exception]) -> None:
    """Raise ``error`` unless ``dtype`` is None or a dtype floating tensors may be published
    in: floating, 16 bits or more (float8 values mean nothing without their scales)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and converted(dtype)):
        raise error(f"dtype= must be a floating torch dtype of 16 bits or more (bfloat16, "
                    f"float16, float32, float64), not {dtype!r}")


def copy_all(targets: list[torch.Tensor], origins: list[torch.Tensor],
             non_blocking: bool = False) -> None:
    """Copy each of ``origins`` into its target (converting dtypes) in one torch call: the GIL
    is released once, not once per tensor (each return would wait for it while another
    thread runs Python), and no autograd history is recorded. Where torch's list copy
    refuses the lists (older torch, devices it does not pair), one copy per tensor."""
    with torch.no_grad():
        try:
            torch._foreach_copy_(targets, origins, non_blocking=non_blocking)
        except (RuntimeError, TypeError):  # (copying again what it did copy is harmless)
            for target, origin in zip(targets, origins, strict=True):
                target.copy_(origin, non_blocking=non_blocking)


def converted(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` are published in a Sender's ``dtype=``: floating dtypes
    but float8, whose values mean something only with their scales (quantized weights keep
    their dtype, as integers do)."""
    return dtype.is_floating_point and dtype.itemsize > 1


def target_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is published in: ``dtype`` for floating tensors (float8 aside,
    see ``converted``), else its own."""
    return dtype if dtype is not None and converted(tensor.dtype) else tensor.dtype


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """The dotted names of ``module``'s non-persistent buffers (left out of its state_dict)."""
    names: set[str] = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{name}" if prefix else name)
    return names


def pairs_of(weights: Any, strategy: str) -> list[tuple[Any, Any]]:
    """(name, value) pairs of ``weights``, not yet validated (``validate``)."""
    if isinstance(weights, str | os.PathLike):
        return load_path(os.fspath(weights))
    if isinstance(weights, torch.nn.Module):
        weights = unwrap_compiled(weights)  # (its own names, not "_orig_mod.<name>")
        if strategy == "tensordict":
            from tensordict import TensorDict

            # (without non-persistent buffers: not in the module's state_dict, so a receiver
            # loading into the same kind of module has nowhere to put them)
            transient = non_persistent_buffers(weights)
            return [(name, t) for name, t in _tensordict_pairs(TensorDict.from_module(weights))
                    if name not in transient]
        # (a submodule's ``get_extra_state`` that is no tensor is not weights: a receiver's
        # load into a module leaves it alone too)
        state = plain_state_dict(weights)  # (a transformers model: under its checkpoint's
        state = checkpoint_views(weights, state) or state  # names, fused MoE experts split)
        return [(name, value) for name, value in state.items()
                if isinstance(value, torch.Tensor) or not is_extra_state(name)]
    if is_tensordict(weights):
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
    return not is_tensordict_class(cls)


def materialize(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain contiguous tensor of ``dtype`` with the values ``tensor`` shows: conjugate and
    negative views are resolved (the same values on both push paths)."""
    if (tensor.dtype == dtype and tensor.is_contiguous() and not tensor.is_conj()
            and not tensor.is_neg()):
        return tensor.detach() if tensor.requires_grad else tensor
    return tensor.detach().resolve_conj().resolve_neg().to(dtype).contiguous()


def materialize_all(pairs: Pairs, dtype: torch.dtype | None) -> Pairs:
    """``materialize`` for every pair, publishing floating tensors in ``dtype`` (None: their
    own). Pairs that need nothing (the common case) are kept as they are, checked inline:
    this runs per tensor of every push."""
    out: Pairs = []
    append = out.append
    for pair in pairs:
        t = pair[1]
        if ((dtype is None or t.dtype == dtype or not converted(t.dtype))
                and t.is_contiguous() and not t.is_neg() and not t.is_conj()
                and not t.requires_grad):
            append(pair)
        else:
            append((pair[0], materialize(t, target_dtype(t, dtype))))
    return out


#: entries a refusal names (a listing of 100,000 bad entries would be megabytes of text)
SHOWN_PROBLEMS = 50


def validate(pairs: list[tuple[Any, Any]]) -> None:
    """Raise one ``InvalidWeightsError`` naming every entry that cannot be published."""
    if not pairs:
        raise InvalidWeightsError(
            "nothing to publish: the weights hold no tensors (an empty state dict?); nothing "
            "was written or sent")
    if _all_fine(pairs):
        return
    problems: list[str] = []
    seen: set[str] = set()
    strided = torch.strided
    for name, value in pairs:
        why = name_problem(name) or ("appears twice" if name in seen else None)
        if isinstance(name, str):
            seen.add(name)
        if not isinstance(value, torch.Tensor):
            why = why or (f"is {_a(type(value).__name__)}, not a tensor (drop it or convert it "
                          "to a tensor" + (": a training checkpoint? publish its model's "
                                           "state_dict alone" if isinstance(value, Mapping)
                                           else "") + ")")
        elif isinstance(value, torch.nn.parameter.UninitializedTensorMixin):
            why = why or ("is an uninitialized parameter of a lazy module (nn.LazyLinear...): "
                          "run one forward pass first, so that it has a shape and values")
        elif value.is_nested:
            why = why or ("a nested tensor cannot be published (publish its components as "
                          "tensors of their own)")
        elif value.layout != strided or value.is_sparse:
            why = why or "sparse/non-strided tensors are not supported (densify it)"
        elif not is_supported_dtype(value.dtype):
            why = why or f"dtype {value.dtype} is not supported"
        elif value.device.type == "meta":
            why = why or "is on the meta device and has no data"
        elif value.dim() > MAX_DIMS or any(d > MAX_DIM_SIZE for d in value.shape):
            why = why or (f"has shape {short_repr(list(value.shape))}: a published tensor has "
                          f"at most {MAX_DIMS} dimensions of at most 2**62 each (reshape it)")
        elif value.numel() and not value.data_ptr():
            why = why or (f"is {_a(type(value).__name__)} with no memory of its own (a wrapper "
                          "subclass such as DTensor): convert it to a plain tensor first, "
                          "e.g. .full_tensor()")
        if why:
            problems.append(f"{short_repr(name)}: {why}")
    if problems:
        more = len(problems) - SHOWN_PROBLEMS
        raise InvalidWeightsError(
            f"{len(problems)} entr{'y' if len(problems) == 1 else 'ies'} cannot be published; "
            "nothing was written:\n  " + "\n  ".join(problems[:SHOWN_PROBLEMS])
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _all_fine(pairs: list[tuple[Any, Any]]) -> bool:
    """True if every entry is publishable, checked in a few whole-list passes (tens of
    thousands of tensors in milliseconds); False sends ``validate`` through the per-entry
    checks that name every problem."""
    names = [n for n, _ in pairs]
    if not (all(type(n) is str for n in names) and "" not in names
            and len(set(names)) == len(names)):
        return False
    joined = "".join(names)
    if not joined.isascii() or "\x00" in joined:
        return False
    strided, plain = torch.strided, (torch.Tensor, torch.nn.Parameter)
    supported = _SUPPORTED_DTYPES
    for _, value in pairs:  # (subclasses take the per-entry checks)
        if not (type(value) in plain and value.layout is strided
                and value.dtype in supported and not value.is_meta and not value.is_nested
                and value.dim() <= MAX_DIMS and (value.numel() or not value.dim())):
            # (an empty tensor takes the per-entry checks: only it can have a dimension past
            # 2**62)
            return False
    return True


_SUPPORTED_DTYPES = frozenset(getattr(torch, name) for name in DTYPE_SIZES
                              if isinstance(getattr(torch, name, None), torch.dtype))


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_config_of(weights: Any) -> dict[str, Any] | None:
    """The PEFT configuration if ``weights`` is a PEFT adapter directory (``adapter_config.json``
    next to ``adapter_model.safetensors``), else None."""
    if not isinstance(weights, str | os.PathLike):
        return None
    path = os.fspath(weights)
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not (os.path.isdir(path) and os.path.isfile(config_path)):
        return None
    try:
        with open(config_path, "rb") as f:
            config = json.loads(f.read(1 << 20).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidWeightsError(f"{config_path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidWeightsError(f"{config_path} must hold a JSON object")
    try:  # (Python's JSON reads NaN and Infinity; no JSON record may hold them)
        json.dumps(config, allow_nan=False)
    except ValueError:
        bad = sorted(k for k, v in config.items()
                     if isinstance(v, float) and not math.isfinite(v))
        raise InvalidWeightsError(
            f"{config_path} holds NaN or Infinity ({', '.join(map(repr, bad)) or 'nested'}), "
            "which no adapter configuration can mean: save the adapter again") from None
    if not os.path.isfile(os.path.join(path, ADAPTER_WEIGHTS)):
        raise InvalidWeightsError(f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}; "
                                  "save the adapter with PEFT's save_pretrained")
    return config


def plain_adapter_config(config: Any) -> dict[str, Any]:
    """``config`` (an adapter configuration given to ``push``) as plain JSON: sets (what
    PEFT's ``LoraConfig.to_dict()`` gives for ``target_modules``) become sorted lists, tuples
    lists; raises ``InvalidWeightsError`` before any I/O for anything else JSON cannot hold."""
    def plain(value: Any) -> Any:
        if isinstance(value, set | frozenset):
            return sorted((plain(v) for v in value), key=repr)
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    if not isinstance(config, dict):
        raise InvalidWeightsError(f"adapter_config must be a dict (PEFT's config.to_dict()), "
                                  f"not a {type(config).__name__}")
    config = plain(config)
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidWeightsError(f"adapter_config cannot be written as JSON ({exc}); give "
                                  "plain values (PEFT's config.to_dict())") from None
    return config


# ---- paths ---------------------------------------------------------------------------------
def load_path(path: str) -> Pairs:
    if not path:
        raise InvalidWeightsError("the source path is empty (an unset variable?); give a "
                                  "checkpoint file or directory")
    if not os.path.exists(path):
        raise InvalidWeightsError(f"{path} does not exist; check the path")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "meta.json")):
            return _load_tensordict_dir(path)
        return _load_safetensors_dir(path)
    if path.endswith(".safetensors"):
        return _load_safetensors_file(path)
    if path.endswith(TORCH_SUFFIXES):
        return _load_torch_file(path)
    raise InvalidWeightsError(
        f"{path}: unknown kind of file; expected .safetensors, .pt/.pth/.bin, or a directory"
    )


def _require_regular(path: str) -> None:
    """Refuse a source file that is not a regular file (a FIFO would block the read forever,
    a device would never end). Symlinks are followed: checkpoint caches link to blobs."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InvalidWeightsError(f"{path} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise InvalidWeightsError(f"{path} is not a regular file (a FIFO, device or "
                                  "directory); point at the weights file itself")


def _load_safetensors_file(path: str) -> Pairs:
    """Tensors in the order their bytes lie in the file (the order they were saved in, which
    groups a checkpoint by layer); ``safe_open().keys()`` would give alphabetical order."""
    from safetensors import safe_open

    _require_regular(path)
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
        _require_regular(index_path)
        try:
            with open(index_path, "rb") as f:
                raw = f.read(_MAX_META_BYTES + 1)
            if len(raw) > _MAX_META_BYTES:
                raise ValueError(f"larger than {_MAX_META_BYTES >> 20} MiB")
            weight_map: dict[str, str] = json.loads(raw.decode("utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise InvalidWeightsError(f"{index_path} is not a valid index "
                                      f"({type(exc).__name__}: {exc})") from None
        problem = _weight_map_problem(weight_map)
        if problem is not None:
            raise InvalidWeightsError(f"{index_path} is not a valid index: {problem}; fix it "
                                      "or copy the checkpoint again")
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
        unlisted = sorted(f"{k} ({s})" for s, held in by_shard.items() for k in held
                          if weight_map.get(k) != s)
        if unlisted:
            log.warning("%s does not list %d tensor(s) its shards hold, which are not "
                        "published: %s%s (if they belong to the model, fix the index)",
                        index_path, len(unlisted), ", ".join(unlisted[:10]),
                        " ..." if len(unlisted) > 10 else "")
        return [(k, by_shard[s][k]) for k, s in weight_map.items()]
    listing = os.listdir(path)
    files = sorted(f for f in listing if f.endswith(".safetensors"))
    if not files:
        torch_files = sorted(f for f in listing if f.endswith(TORCH_SUFFIXES))
        if ADAPTER_CONFIG in listing:  # (adapter_model.bin: saved with safe_serialization=False)
            raise InvalidWeightsError(
                f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}"
                + (f" ({', '.join(torch_files)}: a torch file, which dbsync does not read "
                   "for adapters)" if torch_files else "")
                + "; save the adapter with PEFT's save_pretrained (safe_serialization=True, "
                "its default) and push that directory")
        if len(torch_files) == 1:  # (one file is the whole model; shards are parts of it)
            hint = (f" It holds {torch_files[0]}: push that file itself (dbsync push "
                    f"{os.path.join(path, torch_files[0])} ROOT), or convert the checkpoint "
                    "to safetensors")
        elif torch_files:
            hint = (f" It holds {len(torch_files)} torch files ({', '.join(torch_files[:3])}"
                    "...), shards of one model: convert the checkpoint to safetensors")
        elif MANIFEST_FILE in listing and READERS_DIR in listing:
            hint = (" It is a dbsync store: is ROOT given as SRC? (dbsync push SRC ROOT: the "
                    "weights first, then the store)")
        else:
            hint = ""
        raise InvalidWeightsError(
            f"{path} holds no .safetensors files, no model.safetensors.index.json and no "
            f"tensordict meta.json; point at a checkpoint directory or a weights file.{hint}"
        )
    pairs: Pairs = []
    found_in: dict[str, str] = {}
    twice: list[str] = []
    for name in files:
        for key, tensor in _load_safetensors_file(os.path.join(path, name)):
            first = found_in.setdefault(key, name)
            if first != name:
                twice.append(f"{key!r} ({first} and {name})")
            pairs.append((key, tensor))
    if twice:
        raise InvalidWeightsError(
            f"{path} holds {len(twice)} tensor name(s) in more than one .safetensors file: "
            f"{', '.join(twice[:10])}{' ...' if len(twice) > 10 else ''}; a directory without "
            "model.safetensors.index.json is read as one model made of all its files: remove "
            "the files that do not belong to it, or push the one file")
    return pairs


def _a(noun: str) -> str:
    """``noun`` with its indefinite article ("an int", "a list")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _weight_map_problem(weight_map: Any) -> str | None:
    """What makes an index's ``weight_map`` unusable (None: nothing): it must map tensor
    names to shard file names of the same directory."""
    if not isinstance(weight_map, dict):
        return f"weight_map is {_a(type(weight_map).__name__)}, not an object"
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            return f"tensor {str(name)[:100]!r} maps to {str(shard)[:100]!r}, not a file name"
        if os.path.basename(shard) != shard or shard in (".", ".."):
            return (f"tensor {str(name)[:100]!r} maps to {shard[:100]!r}, not a file of the "
                    "checkpoint's own directory")
    return None


def _is_zip_file(path: str) -> bool:
    """Whether ``path`` starts as a zip archive does (torch's own test for its format)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _load_torch_file(path: str) -> Pairs:
    _require_regular(path)
    try:
        # (a file of torch's legacy format, saved with _use_new_zipfile_serialization=False,
        # cannot be mapped: it is read)
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=_is_zip_file(path))
    except Exception as exc:
        # torch's own message runs to a dozen lines of advice on unpickling code, which
        # dbsync never does: keep its first sentence
        first = first_line(exc).split(". ")[0].rstrip(". ")[:300]
        raise InvalidWeightsError(
            f"{path} could not be loaded as a plain state dict with weights_only=True "
            f"({first}); it may hold a pickled module or other objects: save it with "
            "torch.save(model.state_dict(), path) or convert it to safetensors"
        ) from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise InvalidWeightsError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return list(obj.items())


def _load_tensordict_dir(path: str) -> Pairs:
    """Read a tensordict memmap directory through its ``meta.json`` files without tensordict's
    loader: nothing is ever unpickled (a non-tensor entry is refused, naming it), every file
    must exist and hold exactly the bytes its metadata promises, and tensors are mapped
    copy-on-write (the source is never modified)."""
    problems: list[str] = []
    pairs: Pairs = []
    _read_tensordict_level(path, "", pairs, problems, depth=0)
    if problems:
        raise InvalidWeightsError(
            f"{path} cannot be published as a tensordict memmap directory; nothing was "
            "written:\n  " + "\n  ".join(problems)
        )
    return pairs


def _read_tensordict_level(directory: str, prefix: str, pairs: Pairs, problems: list[str],
                           depth: int) -> None:
    meta_path = os.path.join(directory, "meta.json")
    if depth > 32:
        problems.append(f"{directory}: nested more than 32 levels deep")
        return
    try:
        # O_NONBLOCK: a FIFO in place of meta.json is refused, never waited on
        fd = os.open(meta_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_META_BYTES:
                problems.append(f"{meta_path} is not a regular file of at most "
                                f"{_MAX_META_BYTES >> 20} MiB; save the tensordict again")
                return
            raw = fileio.read_exact(fd, st.st_size, 0)
        finally:
            os.close(fd)
        meta = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        problems.append(f"{meta_path} is not readable JSON ({type(exc).__name__}: {exc})")
        return
    if not isinstance(meta, dict):
        problems.append(f"{meta_path} is not a JSON object")
        return
    if meta.get("_is_non_tensor") or "NonTensor" in str(meta.get("_type", "")):
        problems.append(f"{prefix.rstrip('.') or directory}: a non-tensor entry (tensordict "
                        "stores it with pickle, and dbsync never unpickles); drop it from "
                        "the tensordict before saving")
        return
    leaves = meta.get("leaves")
    entries = leaves if isinstance(leaves, dict) and not _td_entry(leaves) else meta
    described = set()
    for key, value in entries.items():
        if not isinstance(value, dict) or (key in _TD_META_KEYS and not _td_entry(value)):
            continue  # (tensordict's own metadata; a tensor or sub-tensordict of that name
            # is an entry like any other)
        described.add(key)
        name = prefix + key
        if not key or key in (".", "..") or "/" in key or "\0" in key:
            problems.append(f"{short_repr(name)}: the key is not a plain file name (empty, "
                            "'.', '..', or holding '/' or NUL) and would name a file outside "
                            f"{directory}; tensordict never saves such a key: the meta.json "
                            "was edited or damaged")
            continue
        if "dtype" in value:
            pairs_or_problem = _tensordict_leaf(directory, key, name, value)
            if isinstance(pairs_or_problem, str):
                problems.append(pairs_or_problem)
            else:
                pairs.append(pairs_or_problem)
        elif value.get("type") == "TensorDict" or "TensorDict" in str(value.get("_type", "")):
            sub = os.path.join(directory, key)
            if not os.path.isfile(os.path.join(sub, "meta.json")):
                problems.append(f"{name}: nested tensordict {sub} has no meta.json")
                continue
            _read_tensordict_level(sub, name + ".", pairs, problems, depth + 1)
        else:
            problems.append(f"{name}: a {value.get('type') or value.get('_type') or 'non-tensor'}"
                            " entry (stored with pickle or not a tensor); dbsync never "
                            "unpickles: drop it from the tensordict before saving")
    problems.extend(_undescribed(directory, prefix, described))


def _undescribed(directory: str, prefix: str, described: set[str]) -> list[str]:
    """Entries saved in ``directory`` that its ``meta.json`` does not describe: tensordict
    writes its own metadata (``shape``, ``device``, ...) over an entry of the same name, whose
    data it saved all the same. Published without them, the version would lack tensors."""
    found = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for entry in names:
        key = entry.removesuffix(".memmap")
        saved = (key != entry and not entry.endswith(".shape.memmap")  # (a tensor's data)
                 or os.path.isfile(os.path.join(directory, entry, "meta.json")))  # (a level)
        if not saved:
            continue
        if key not in described:
            found.append(f"{prefix}{key}: saved in {directory} but not described by its "
                         "meta.json (tensordict writes its own metadata over an entry of that "
                         f"name: {', '.join(sorted(_TD_OWN_KEYS))}); rename the entry and "
                         "save again")
    return found


#: the keys tensordict writes into every level's meta.json itself
_TD_OWN_KEYS = ("shape", "device", "_type", "_format_version", "_class")


def _td_entry(value: dict[str, Any]) -> bool:
    """Whether a ``meta.json`` value describes an entry (a tensor: its ``dtype`` is a
    string; a nested tensordict: it has a ``type``), not tensordict's own metadata."""
    return isinstance(value.get("dtype"), str) or "type" in value


_MAX_META_BYTES = 64 << 20
_TD_META_KEYS = {"shape", "device", "_type", "_format_version", "_class", "names",
                 "batch_size", "_non_tensor", "leaves", "is_nested", "meta", "_metadata"}


def _tensordict_leaf(directory: str, key: str, name: str, value: dict[str, Any]
                     ) -> tuple[str, torch.Tensor] | str:
    dtype_text, shape = value.get("dtype"), value.get("shape")
    dtype = getattr(torch, str(dtype_text).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        return f"{name}: unknown dtype {str(dtype_text)[:40]!r}"
    if not (isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**62
                                            for d in shape)):
        return f"{name}: shape {str(shape)[:60]} is not a list of non-negative integers"
    if value.get("is_nested"):
        return f"{name}: nested (jagged) tensors cannot be published"
    file = os.path.join(directory, f"{key}.memmap")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    try:
        st = os.stat(file)
    except FileNotFoundError:
        return f"{name}: {file} is missing"
    except OSError as exc:  # (a name too long, a loop of links, no permission)
        return f"{name}: {file} cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return f"{name}: {file} is not a regular file (a FIFO, device or directory)"
    size = st.st_size
    if size != nbytes:
        return (f"{name}: {file} holds {size} bytes but its metadata says {nbytes} "
                f"({dtype_text} {shape}); the directory is truncated or damaged")
    if numel == 0:
        try:
            return name, torch.empty(shape, dtype=dtype)
        except (RuntimeError, ValueError) as exc:  # (strides past what torch can hold)
            return f"{name}: shape {str(shape)[:60]} cannot be held by torch ({first_line(exc)})"
    flat = torch.from_file(file, shared=False, size=nbytes, dtype=torch.uint8)
    return name, flat.view(dtype).reshape(shape)
