"""Plan the copy of a version into existing tensors (a plain ``nn.Module``'s parameters and
buffers, or a dict of tensors): which tensors take the raw bytes as they are, as ready-made
``preadv`` calls (see ``scatter``), and which need torch (a dtype cast, a non-contiguous
destination).

The plan is built in one pass of a few attribute reads per tensor, so it stays cheap at
tens of thousands of tensors; anything that does not fit (a missing name, another shape, a
dtype that cannot be cast) makes it return None, and the caller then builds the full error
listing every problem."""

from __future__ import annotations

import array
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .format import TensorEntry, castable, describe_name, torch_dtype
from .memspans import Span, partial_overlaps, read_only, span_of
from .scatter import MAX_GAP, MAX_IOVECS, SCRATCH_ADDRESS, Read
from .tensorstate import ADDRESS, CONTIGUOUS, DTYPE, SHAPE, States

#: bytes per read (one thread's task)
READ_BYTES = 16 << 20


class CopyPlan(NamedTuple):
    #: shard -> reads that put its bytes straight into their destinations
    raw: dict[int, list[Read]]
    #: the destinations the reads write (their autograd version must be bumped afterwards)
    raw_destinations: list[Any]
    #: (destination, entry) pairs copied by torch (cast, a non-contiguous destination, a
    #: tensor subclass)
    by_torch: list[tuple[Any, TensorEntry]]
    #: pairs of entries whose destination is one tensor (tied weights): the caller must make
    #: sure they are equal, or the last would silently win
    shared: Sequence[tuple[TensorEntry, TensorEntry]] = ()


def plan_copy(entries: Sequence[TensorEntry], dest: Mapping[str, Any], strict: bool
              ) -> CopyPlan | None:
    """The plan, or None if a name, shape or dtype does not fit (``strict``: every tensor of
    ``dest`` must be in the version).

    Hazard: reads hold raw addresses; the destinations must stay alive and in place while the
    plan is used."""
    import torch

    plain = (torch.Tensor, torch.nn.Parameter)
    raw: dict[int, list[Read]] = {}
    raw_destinations: list[Any] = []
    by_torch: list[tuple[Any, TensorEntry]] = []
    dtypes: dict[str, Any] = {}
    get = dest.get
    reads: list[Read] = []
    shard = -1
    iov = array.array("Q")
    end = run_bytes = 0
    spans: list[Span] = []
    host_spans: list[Span] = []  # (of CPU tensors: their memory must be writable)
    for entry in entries:
        tensor = get(entry.name)
        if (not isinstance(tensor, torch.Tensor) or lazy(tensor)
                or tensor.shape != entry.shape or tensor.is_meta or _distributed(tensor)):
            return None
        want = dtypes.get(entry.dtype)
        if want is None:
            want = dtypes[entry.dtype] = torch_dtype(entry.dtype)
        # Raw bytes only into plain tensors that own plain memory: a subclass (a wrapper
        # such as DTensor or a quantized tensor) may have no storage at all (data_ptr 0).
        if not (type(tensor) in plain and tensor.dtype is want and tensor.is_cpu
                and tensor.is_contiguous() and not tensor.is_neg()
                and not (want.is_complex and tensor.is_conj())):
            if castable(want, tensor.dtype) and not overlaps_itself(tensor):
                by_torch.append((tensor, entry))
                if (span := span_of(entry.name, tensor)) is not None:
                    spans.append(span)
                    if tensor.is_cpu:
                        host_spans.append(span)
                continue
            return None
        nbytes = entry.nbytes
        if not nbytes:
            continue
        address = tensor.data_ptr()
        if not address:  # no memory of its own after all: let torch copy it
            by_torch.append((tensor, entry))
            continue
        raw_destinations.append(tensor)
        spans.append(Span(address, address + nbytes, entry.name, None, tensor))
        host_spans.append(spans[-1])
        offset = entry.offset
        fresh = entry.shard != shard
        if fresh:
            shard = entry.shard
            reads = raw.setdefault(shard, [])
        gap = offset - end
        if (fresh or gap < 0 or gap > MAX_GAP or run_bytes >= READ_BYTES
                or len(iov) >= 2 * MAX_IOVECS - 4):
            iov = array.array("Q")
            reads.append(Read(offset, iov))
            gap = run_bytes = 0
        if gap:
            iov.append(SCRATCH_ADDRESS)
            iov.append(gap)
        iov.append(address)
        iov.append(nbytes)
        end = offset + nbytes
        run_bytes += nbytes + gap
    if strict and len(dest) != len(entries):
        return None
    if partial_overlaps(spans) or read_only(host_spans):
        return None
    return CopyPlan(raw, raw_destinations, by_torch)


#: why a target tensor the version lacks cannot be loaded (``fit_problems``)
MISSING = "missing from the published version"


def fit_problems(published: Sequence[tuple[str, Any, Any]], dest: Mapping[str, Any],
                 strict: bool) -> dict[str, str]:
    """Every reason why ``dest`` (name -> tensor) cannot take the tensors ``published`` ((name,
    shape, torch dtype) of each) in place, name -> why: a name it lacks, a tensor nothing can
    be copied into, another shape, a dtype no cast reaches (floating dtypes of 16 bits or
    more cast to each other: ``format.castable``), memory shared in part with another
    destination or read-only; with ``strict``, also a tensor of ``dest`` the version lacks
    (``MISSING``; see ``tied_to_published``)."""

    problems: dict[str, str] = {}
    for name, shape, dtype in published:
        tensor = dest.get(name)
        if name not in dest:
            problems[name] = "not in the target"
        elif (why := unfit_destination(tensor)) is not None:
            problems[name] = why
        elif tuple(shape) != tuple(tensor.shape):
            problems[name] = f"shape {list(shape)} != the target's {list(tensor.shape)}"
        elif not castable(dtype, tensor.dtype):
            eight = (" (no cast to or from float8: its values mean nothing without their "
                     "scales)" if dtype.is_floating_point and tensor.dtype.is_floating_point
                     else "")
            problems[name] = (f"dtype {str(dtype).removeprefix('torch.')} != the target's "
                              f"{str(tensor.dtype).removeprefix('torch.')}{eight}")
    if strict:
        names = {name for name, _, _ in published}
        problems.update((name, MISSING) for name in dest if name not in names)
    spans = [span for name, _, _ in published if name not in problems
             and (span := span_of(name, dest[name])) is not None]
    for name, why in partial_overlaps(spans).items():
        problems.setdefault(name, why + " (views of one buffer): nothing can copy both; give "
                            "each tensor memory of its own")
    for name, why in read_only([s for s in spans if dest[s.name].is_cpu]).items():
        problems.setdefault(name, why)
    return problems


def problem_listing(problems: Mapping[str, str]) -> str:
    """'(N problem(s)): name: why; ...' (the first 12)."""
    shown = "; ".join(f"{describe_name(k)}: {v}" for k, v in list(problems.items())[:12])
    more = f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""
    return f"({len(problems)} problem(s)): {shown}{more}{_prefix_hint(problems)}"


def _prefix_hint(problems: Mapping[str, str]) -> str:
    """A hint when the names differ only by one prefix on one side (``module.`` of a model
    wrapped in DDP when it was published, ``model.`` of another class)."""
    published = [k for k, why in problems.items() if why == "not in the target"]
    target = {k for k, why in problems.items() if why == MISSING}
    for longer, shorter, side in ((published, target, "published"),
                                  (sorted(target), set(published), "target's")):
        if not longer or len(longer) != len(shorter):
            continue
        first = longer[0]
        for candidate in [first[:len(first) - len(n)] for n in shorter if first.endswith(n)]:
            if candidate and all(n.startswith(candidate) and n[len(candidate):] in shorter
                                 for n in longer):
                return (f". The {side} names carry an extra prefix {candidate!r} (a wrapper "
                        "such as DDP's `module.`?): strip it, or publish and load the "
                        "unwrapped model")
    return ""


def tied_to_published(problems: Mapping[str, str], dest: Mapping[str, Any],
                      published: Sequence[str]) -> dict[str, str]:
    """{name: published twin} if every one of ``problems`` (from ``fit_problems``) is a name
    the version lacks whose tensor in ``dest`` is the tensor of a ``published`` name (tied
    weights, which checkpoints often store once); else {}."""
    if not problems or any(why != MISSING for why in problems.values()):
        return {}
    twins = {tie_key(dest[name]): name for name in published if name in dest}
    found = {name: twins.get(tie_key(dest[name]), "") for name in problems}
    return found if all(found.values()) else {}


def overlaps_itself(tensor: Any) -> bool:
    """Whether elements of ``tensor`` share memory (an ``expand``ed tensor): no copy can
    write it."""
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape,
                                                               strict=True))


def unfit_destination(tensor: Any) -> str | None:
    """Why nothing can be copied into ``tensor`` whatever its shape and dtype (None: it can)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return f"not a tensor in the target (a {type(tensor).__name__})"
    if lazy(tensor):
        return ("an uninitialized parameter of a lazy module (nn.LazyLinear...): it has no "
                "shape or memory yet (run one forward pass first)")
    if tensor.is_meta:
        return ("on the meta device: it has no memory to load into (materialize the model "
                "first, e.g. module.to_empty(device='cpu'))")
    if overlaps_itself(tensor):
        return ("its elements share memory (an expanded tensor): no copy can write it; give "
                "it memory of its own (.clone())")
    if _distributed(tensor):
        return (f"a {type(tensor).__name__} (a distributed tensor): dbsync copies whole "
                "tensors; load into plain tensors (e.g. a full state dict) and distribute "
                "them, or into each rank's local shard")
    return None


def lazy(tensor: Any) -> bool:
    """Whether ``tensor`` is a lazy module's uninitialized parameter (even its shape raises)."""
    import torch

    return isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)


def _distributed(tensor: Any) -> bool:
    """Whether ``tensor`` is a distributed tensor (a ``DTensor``), whose ``copy_`` from a
    plain tensor fails."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


_LAYOUT = operator.itemgetter(0, 1, 2, 3, 4, 5)  # a TensorEntry without its range


class _Kept(NamedTuple):
    entries: Sequence[TensorEntry]
    layout: list[tuple[Any, ...]]
    strict: bool
    size: int
    names: list[str]
    states: States
    raw: dict[int, list[Read]]
    #: positions in ``names`` of the raw destinations (None: all of them, in order) and of
    #: the tensors torch copies
    raw_at: list[int] | None
    by_torch_at: list[int]
    shared: list[tuple[TensorEntry, TensorEntry]]
    #: the destination's keys in its own order, and the pick of its values in ``names``
    #: order (None: the same order)
    dest_keys: list[str]
    pick: Callable[[list[Any]], Any] | None


class PlanCache:
    """The last copy plan, reused while the version's layout (names, dtypes, shapes, places;
    not the checksums) and the destinations (type, address, dtype, shape, contiguity) stay the
    same, as they do load after load of the same model: at 20,000 tensors the check costs a
    fraction of planning again. Holds no reference to the destination tensors (positions only,
    the reads hold addresses): dropping a model frees it."""

    def __init__(self) -> None:
        self._kept: _Kept | None = None

    def plan(self, entries: Sequence[TensorEntry], dest: Mapping[str, Any], strict: bool
             ) -> CopyPlan | None:
        """``plan_copy(entries, dest, strict)``, reused when nothing it depends on changed."""
        kept = self._kept
        layout = kept.layout if kept is not None and kept.entries is entries else (
            list(map(_LAYOUT, entries)))  # the same version again: the same entries
        if (kept is not None and kept.strict == strict and kept.size == len(dest)
                and kept.layout == layout):
            targets = _targets(kept, dest)
            # (None for a name gone or a value whose attributes do not read, never equal to
            # a kept state list; ``None in targets`` would compare every tensor with None)
            if kept.states.matches(targets):
                raw_destinations = (targets if kept.raw_at is None
                                    else [targets[i] for i in kept.raw_at])
                return CopyPlan(kept.raw, raw_destinations,
                                [(targets[i], entries[i]) for i in kept.by_torch_at],
                                [(entries[i], entries[j]) for i, j in kept.shared])
        self._kept = None
        plan = plan_copy(entries, dest, strict)
        if plan is None:
            return None
        names = [e.name for e in entries]
        targets = list(map(dest.get, names))
        where = {id(t): i for i, t in enumerate(targets)}
        by_torch_at = [where[id(t)] for t, _ in plan.by_torch]
        kept_states = States.of(targets)  # None (not kept) for tensors with no plain memory
        shared = _shared(targets, kept_states)
        plan = plan._replace(shared=[(entries[i], entries[j]) for i, j in shared])
        if kept_states is not None and all(
                entries[i] is e for i, (_, e) in zip(by_torch_at, plan.by_torch, strict=True)):
            raw_at: list[int] | None = [where[id(t)] for t in plan.raw_destinations]
            if raw_at == list(range(len(targets))):
                raw_at = None  # (every tensor: the common case, no list to build per load)
            dest_keys = list(dest)
            self._kept = _Kept(entries, layout, strict, len(dest), names, kept_states,
                               plan.raw, raw_at, by_torch_at, shared, dest_keys,
                               _picker(dest_keys, names))
        return plan


def _targets(kept: _Kept, dest: Mapping[str, Any]) -> list[Any]:
    """``dest``'s tensors in the kept plan's order (None for a name it lacks). When its keys
    are the kept ones in the same order (the same dict, or one built the same way), its
    values are taken as they lie, with no lookup per name: a lookup touches the name's string
    and the dict's entry, ~1 ms at 20,000 tensors when a load has pushed them out of the
    caches. (The keys of the same dict compare by identity: no string is read.)"""
    keys = list(dest)
    if keys == kept.dest_keys:
        values = list(dest.values())
        return values if kept.pick is None else kept.pick(values)
    return list(map(dest.get, kept.names))


def _picker(dest_keys: list[str], names: list[str]) -> Callable[[list[Any]], Any] | None:
    """The call that picks, from values in ``dest_keys`` order, those of ``names`` in order
    (None: the orders are the same); every name must be in ``dest_keys``."""
    if dest_keys == names:
        return None
    position = {k: i for i, k in enumerate(dest_keys)}
    get = operator.itemgetter(*[position[n] for n in names])
    if len(names) == 1:
        return lambda values: [get(values)]
    return lambda values: list(get(values))


def tie_key(tensor: Any) -> Any:
    """What makes two destinations one tensor (tied weights): the same memory seen as the same
    dtype, shape and contiguity (``state_dict()`` without ``keep_vars`` gives a new tensor
    object per name, tied or not), or the same object for one without memory of its own."""
    try:
        address = tensor.data_ptr()
        return ((address, tensor.dtype, tuple(tensor.shape), tensor.stride()) if address
                else id(tensor))
    except (AttributeError, RuntimeError):  # (not a tensor, or no storage)
        return id(tensor)


def _shared(targets: list[Any], states: States | None) -> list[tuple[int, int]]:
    """(first, other) positions of targets that are one tensor (``tie_key``, here from the
    columns already read: no second look at every tensor)."""
    if states is None:
        keys: list[Any] = list(map(id, targets))
    else:
        columns = states.columns
        # (a contiguous tensor's strides follow from its shape; only others are read)
        keys = [(a, d, s, True if c else targets[i].stride()) if a else i
                for i, (a, d, s, c) in enumerate(zip(
                    columns[ADDRESS], columns[DTYPE], columns[SHAPE], columns[CONTIGUOUS],
                    strict=True))]
    first: dict[Any, int] = {}
    pairs = []
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        if j != i:
            pairs.append((j, i))
    return pairs
