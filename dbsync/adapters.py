"""What a PEFT LoRA adapter must be whatever model it is served on: a rank ``r`` (and
``rank_pattern`` ranks) that are integers >= 1, tensors named
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` in pairs, floating, 2-D, whose
ranks agree with each other and with the configuration. A push of an adapter checks this
before any I/O (one error listing every problem); serving checks it again, with what depends
on the served model (``dbsync.vllm.lora.check_adapter``). Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidWeightsError

#: the name of a PEFT LoRA weight (``base_model.model.<module>.lora_A.weight``)
PEFT_LORA_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")


def looks_like_an_adapter(names: Sequence[str]) -> bool:
    """Whether every one of ``names`` is a PEFT LoRA weight's (tensors of an adapter, pushed
    without the configuration that makes them one)."""
    return bool(names) and all(PEFT_LORA_KEY.match(n) for n in names)


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


#: the most unbounded repeats (``*``, ``+``, ``{n,}``) a ``rank_pattern`` key may hold
_MAX_REPEATS = 4
_REPEATED_GROUP = re.compile(r"\)[*+?{]")
_UNBOUNDED_REPEAT = re.compile(r"[*+]|\{\d*,\}")


def costly_pattern(key: Any) -> bool:
    """Whether the ``rank_pattern`` key ``key``, read as a regular expression, may take
    exponential (a repeated group, ``(a|a)+``) or high polynomial (many ``.*``) time to match:
    such a key is refused, never matched. Plain names and the usual patterns pass."""
    return isinstance(key, str) and (
        len(key) > 1000 or _REPEATED_GROUP.search(key) is not None
        or len(_UNBOUNDED_REPEAT.findall(key)) > _MAX_REPEATS)


def rank_of(module: str, rank: int | None, pattern: Mapping[str, int]) -> int | None:
    r"""The rank PEFT gives ``module``: that of the first ``rank_pattern`` key naming it (the
    module itself, or a suffix of dotted parts, as PEFT's and vLLM's ``(.*\.)?(key)$`` match
    them: a key ``q_proj|v_proj`` names both), else ``r``."""
    for key, value in pattern.items():
        try:
            named = module == key or re.match(rf"(.*\.)?({key})$", module) is not None
        except re.error:  # (PEFT reads keys as patterns: a broken one names nothing)
            named = False
        if named:
            return value
    return rank


@dataclass
class AdapterShape:
    """An adapter as read from its configuration and tensors' (name, shape, dtype)."""

    #: ``r`` (None where it is not a rank) and the ``rank_pattern`` ranks
    rank: int | None
    pattern: dict[str, int]
    #: module -> {"lora_A": shape, "lora_B": shape}, of the tensors named as PEFT names them
    parts: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    #: what (a config field, a tensor or a module) -> why, of what does not hold whatever
    #: the model
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def highest_rank(self) -> int | None:
        ranks = [r for r in (self.rank, *self.pattern.values()) if r is not None]
        return max(ranks, default=None)


def read_adapter(config: Mapping[str, Any],
                 tensors: Sequence[tuple[str, tuple[int, ...], Any]]) -> AdapterShape:
    """The adapter's ranks and LoRA pairs, and its problems that hold whatever the model
    (``dtype`` objects need only ``is_floating_point``)."""
    problems: dict[str, str] = {}
    rank = config.get("r")
    if not _is_rank(rank):
        problems["r"] = f"adapter_config.json needs an integer rank r >= 1, not {rank!r}"
        rank = None
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(_is_rank(r) for r in pattern.values()):
        problems["rank_pattern"] = ("adapter_config.json's rank_pattern must map module names "
                                    f"to integer ranks >= 1, not {str(pattern)[:200]}")
        pattern = {}
    costly = [key for key in pattern if costly_pattern(key)]
    if costly:
        problems["rank_pattern"] = (
            "adapter_config.json's rank_pattern key(s) "
            f"{', '.join(repr(k[:100]) for k in costly[:5])} repeat a group or hold more than "
            f"{_MAX_REPEATS} repeats, which can take exponential time to match (a config "
            "read from a store must not hang its readers): name the modules plainly "
            "(\"model.layers.0.self_attn.q_proj\", or a suffix such as \"q_proj\")")
        pattern = {}
    shape = AdapterShape(rank, dict(pattern), problems=problems)
    for name, dims, dtype in tensors:
        match = PEFT_LORA_KEY.match(name)
        if match is None:
            problems[name] = ("not a PEFT LoRA weight (expected base_model.model.<module>."
                              "lora_A.weight / lora_B.weight)")
            continue
        if not getattr(dtype, "is_floating_point", False):
            problems[name] = f"dtype {dtype} is not a floating dtype"
        shape.parts.setdefault(match["module"], {})[match["part"]] = tuple(dims)
    if not tensors:
        problems["tensors"] = "the adapter holds no tensors"
    for module, got in shape.parts.items():
        a, b = got.get("lora_A"), got.get("lora_B")
        if a is None or b is None:
            problems[module] = f"has {'lora_A' if a else 'lora_B'} without its pair"
            continue
        r = a[0] if len(a) == 2 else None
        wanted = rank_of(module, rank, shape.pattern)
        if len(a) != 2 or len(b) != 2:
            problems[module] = (f"lora_A {list(a)} and lora_B {list(b)} must both be "
                                "matrices")
        elif wanted is not None and r != wanted:
            problems[module] = (f"lora_A rank {r} != the config's r {wanted}" if wanted == rank
                                else f"lora_A rank {r} != its rank_pattern rank {wanted}")
        elif b[1] != r:
            problems[module] = (f"lora_B {list(b)} has rank {b[1]}, its lora_A {list(a)} rank "
                                f"{r}: the pair does not fit together")
    return shape


def refuse_unservable(config: Mapping[str, Any],
                      tensors: Sequence[tuple[str, tuple[int, ...], Any]]) -> None:
    """``InvalidWeightsError`` listing every problem of an adapter that no model could serve
    (a rank that is no integer, names PEFT does not give, a lone lora_A, ranks that
    disagree): a push calls it before anything is written."""
    problems = read_adapter(config, tensors).problems
    if problems:
        listing = "; ".join(f"{what}: {why}" for what, why in list(problems.items())[:12])
        more = f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""
        raise InvalidWeightsError(
            f"this LoRA adapter cannot be served on any model ({len(problems)} problem(s)): "
            f"{listing}{more}; nothing was published. Save it again with PEFT's "
            "save_pretrained")
