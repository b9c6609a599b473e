"""The on-disk format (docs/FORMAT.md is the spec; keep the two in step).

Pure data, no I/O and no torch import: the head record (``dbsync.json``), the per-version
index (``slots/X/index.json``), their JSON form with validation, and the shard layout.

Hazard: every byte read from a store is untrusted. ``Head.loads`` and ``Index.loads`` validate
all of it (types, sizes, shapes that torch can hold, offsets inside their shard, file names that
cannot leave the slot) and raise ONE ``FormatError`` listing every problem, before any caller
builds a path or a tensor from it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from . import gcpause
from .errors import FormatError, UnsupportedFormatError, resource_limit

FORMAT_NAME = "dbsync"
INDEX_FORMAT_NAME = "dbsync-index"
FORMAT_VERSION = 3
CHECKSUM_ALGORITHM = "xxh3_64"
#: the last part of the name of a module's extra state in its state_dict
#: (``nn.Module.get_extra_state``): not weights unless it is a tensor
EXTRA_STATE = "_extra_state"


def castable(published: Any, target: Any) -> bool:
    """Whether a load may copy tensors of torch dtype ``published`` into ``target``: the same
    dtype, or floating dtypes of 16 bits or more both (a float8 value means nothing without
    its scale: a cast to or from one would load other numbers than were trained)."""
    return published == target or (
        published.is_floating_point and target.is_floating_point
        and published.itemsize >= 2 and target.itemsize >= 2)


def is_extra_state(name: str) -> bool:
    return name == EXTRA_STATE or name.endswith("." + EXTRA_STATE)

SLOTS = ("a", "b")
KINDS = ("weights", "adapter")

MANIFEST_FILE = "dbsync.json"
INDEX_FILE = "index.json"
SLOTS_DIR = "slots"
READERS_DIR = "readers"
WRITER_LOCK_FILE = "writer.lock"
SLOT_STAMP_FILE = "dbsync-slot.json"
#: in a slot, once its version was published (the flip done): {"version": N, "run_id": R}
PUBLISHED_FILE = "dbsync-published.json"

#: Upper bounds on what a reader will read of a store's JSON files (a manifest pointing at
#: /dev/zero, or a huge file, must not exhaust memory).
MAX_HEAD_BYTES = 1 << 20
MAX_INDEX_BYTES = 512 << 20
MAX_STAMP_BYTES = 4096
MAX_LEASE_BYTES = 64 << 10
#: a broadcast sender's rendezvous record (``broadcast.json``): a few hundred bytes
MAX_RENDEZVOUS_BYTES = 64 * 1024
#: Tensors are packed into shards of about this size (a larger tensor gets a shard of its own).
SHARD_BYTES = 512 << 20
#: Every tensor starts at a multiple of this inside its shard (any dtype's view is aligned).
ALIGN = 64
_MAX_INT = 2**62  # any size or offset beyond this is garbage (and beyond what torch can hold)
#: the highest version a head may name (readers refuse a head beyond it as garbage)
MAX_VERSION = _MAX_INT
_MAX_DIMS = 64
#: the most dimensions a published tensor may have, and the largest size of one (readers
#: refuse an index past them)
MAX_DIMS, MAX_DIM_SIZE = _MAX_DIMS, _MAX_INT

DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}

_SHARD_FILE = re.compile(r"shard-[0-9]{5}\.bin")
_SAFE_READER_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,100}")
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def is_run_id(value: object) -> bool:
    """Whether ``value`` is a run id as a writer makes them (32 lowercase hex digits)."""
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None
_HEX64 = re.compile(r"[0-9a-f]{16}")


def shard_file(index: int) -> str:
    return f"shard-{index:05d}.bin"


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def is_reader_id(name: Any) -> bool:
    """Whether ``name`` is a reader id a receiver may have (see ``check_reader_id``)."""
    return isinstance(name, str) and _SAFE_READER_ID.fullmatch(name) is not None


def check_reader_id(reader_id: str, error: type[Exception] = FormatError) -> str:
    """``reader_id`` if a receiver may have it; else raises ``error`` (``FormatError`` for a
    name read from a store, an argument error for one a caller gave)."""
    if not isinstance(reader_id, str) or not _SAFE_READER_ID.fullmatch(reader_id):
        raise error(
            f"reader id {reader_id!r} is not allowed: use letters, digits, '_', '.', '-' "
            "(at most 101 characters, not starting with '.' or '-')"
        )
    return reader_id


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a tensor name (None if it can)."""
    if type(name) is str and name and name.isascii() and "\x00" not in name:
        return None  # the common case, cheaply
    if not isinstance(name, str) or not name:
        return "names must be non-empty strings"
    if "\x00" in name:
        return "names may not contain NUL"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "name is not valid Unicode (it holds a lone surrogate); fix the name"
    return None


#: the most characters of a name an error listing shows
NAME_SHOWN = 300


def describe_name(name: Any) -> str:
    """A printable form of any name, whatever its encoding (for error listings): the name
    itself when it is printable, else its escaped ``ascii()`` form; cut short past
    ``NAME_SHOWN`` characters, saying how long it was (a listing of a store's names must not
    carry megabytes into logs and status fields)."""
    if isinstance(name, str) and name.isprintable() and name_problem(name) is None:
        text = name
    else:
        text = ascii(name) if isinstance(name, str) else repr(name)
    if len(text) <= NAME_SHOWN:
        return text
    return f"{text[:NAME_SHOWN * 3 // 4]}... ({len(text)} characters)"


def loads_json(raw: bytes, source: str) -> Any:
    """Parse untrusted JSON: every failure (bad UTF-8, syntax, nesting too deep, integers too
    long) becomes one ``FormatError``."""
    try:
        return json.loads(raw.decode("utf-8"))
    except MemoryError as exc:  # not the file's fault: this process's memory limit
        raise resource_limit(exc, f"reading {source} ({len(raw)} bytes)") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(
            f"{source} is not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); dbsync "
            "replaces it atomically, so something other than dbsync wrote it or the disk is "
            "damaged: publish again from the trainer"
        ) from None


def _is_int(value: Any, low: int = 0, high: int = _MAX_INT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_header(data: Any, name: str, source: str) -> None:
    if not isinstance(data, dict):
        raise FormatError(f"{source}: expected a JSON object; publish again from the trainer")
    if data.get("format") != name:
        raise FormatError(f"{source}: not a dbsync file (format={str(data.get('format'))[:40]!r}, "
                          f"not {name!r}): a file of something else stands where dbsync keeps "
                          "its own; point dbsync at a store's directory, or publish again from "
                          "the trainer")
    found = data.get("format_version")
    if not _is_int(found, 1, 1 << 30):
        raise FormatError(f"{source}: its format_version {str(found)[:20]!r} is no format "
                          "version (the file is damaged); publish again from the trainer")
    if found != FORMAT_VERSION:
        raise UnsupportedFormatError(source, found)


class TensorEntry(NamedTuple):
    """One tensor of a version: where its bytes lie and which checked range holds them. A
    named tuple: an index of 90,000 tensors is built and read in a fraction of a second."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: int
    offset: int
    #: index of the ``CheckedRange`` holding this tensor's bytes (-1: a tensor of no bytes
    #: may belong to none)
    range: int

    @property
    def torch_dtype(self) -> Any:
        return torch_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class CheckedRange(NamedTuple):
    """A run of bytes of one shard and its xxh3_64: one big tensor, or neighbouring small
    tensors together with the zero padding between them. Hashing a few large ranges instead of
    every small tensor lets a reader verify a version in a few calls that run in parallel
    threads, whatever its tensor count."""

    shard: int
    offset: int
    nbytes: int
    checksum: str


@dataclass(frozen=True)
class Head:
    """``dbsync.json``: which version is current, in which slot, of which run. Small, so that
    ``latest_version()`` and watchers never parse the tensor list."""

    run_id: str
    version: int
    slot: str
    index_checksum: str
    index_nbytes: int
    created_at: float
    kind: str = "weights"
    durable: bool = True
    tensor_count: int = 0
    total_bytes: int = 0
    writer: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": self.run_id,
            "version": self.version, "slot": self.slot, "kind": self.kind,
            "created_at": self.created_at, "durable": self.durable, "writer": self.writer,
            "index": {"file": INDEX_FILE, "nbytes": self.index_nbytes,
                      "checksum": self.index_checksum},
            "tensor_count": self.tensor_count, "total_bytes": self.total_bytes,
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode("utf-8")

    @classmethod
    def loads(cls, raw: bytes, source: str = MANIFEST_FILE) -> Head:
        data = loads_json(raw, source)
        _check_header(data, FORMAT_NAME, source)
        problems: list[str] = []
        run_id, version, slot = data.get("run_id"), data.get("version"), data.get("slot")
        kind, created = data.get("kind", "weights"), data.get("created_at")
        index = data.get("index")
        if not is_run_id(run_id):
            problems.append("run_id must be 32 hex digits")
        if not _is_int(version, 1, MAX_VERSION):
            problems.append(f"version must be an integer in [1, {MAX_VERSION}]")
        if slot not in SLOTS:
            problems.append(f"slot must be one of {SLOTS}")
        if kind not in KINDS:
            problems.append(f"kind must be one of {KINDS}")
        if not (isinstance(created, int | float) and not isinstance(created, bool)
                and math.isfinite(created)):
            problems.append("created_at must be a finite number")
        if not (isinstance(index, dict) and index.get("file") == INDEX_FILE
                and _is_int(index.get("nbytes"), 1, MAX_INDEX_BYTES)
                and isinstance(index.get("checksum"), str)
                and _HEX64.fullmatch(index["checksum"])):
            problems.append(f"index must be {{file: {INDEX_FILE!r}, nbytes, checksum}}")
        for key in ("tensor_count", "total_bytes"):
            if not _is_int(data.get(key, 0)):
                problems.append(f"{key} must be a non-negative integer")
        if problems:
            raise FormatError(f"{source} is invalid: " + "; ".join(problems)
                              + " (the file is damaged); publish again from the trainer")
        writer = data.get("writer")
        return cls(
            run_id=run_id, version=version, slot=slot, kind=kind,
            index_checksum=index["checksum"], index_nbytes=index["nbytes"],
            created_at=float(created), durable=data.get("durable", True) is True,
            tensor_count=data.get("tensor_count", 0), total_bytes=data.get("total_bytes", 0),
            writer=writer if isinstance(writer, dict) else {},
        )


@dataclass(frozen=True)
class Manifest:
    """One complete version: its head plus its index (the ordered tensors and shards)."""

    head: Head
    tensors: tuple[TensorEntry, ...]
    shards: tuple[int, ...]
    ranges: tuple[CheckedRange, ...]
    adapter: dict[str, Any] | None = None

    @property
    def version(self) -> int:
        return self.head.version

    @property
    def slot(self) -> str:
        return self.head.slot

    @property
    def run_id(self) -> str:
        return self.head.run_id

    @property
    def kind(self) -> str:
        return self.head.kind

    @property
    def created_at(self) -> float:
        return self.head.created_at

    @property
    def durable(self) -> bool:
        return self.head.durable

    @property
    def writer(self) -> dict[str, Any]:
        return self.head.writer

    @property
    def total_bytes(self) -> int:
        return _total_bytes(self.tensors)

    def tensors_in(self, ranges: set[int]) -> list[TensorEntry]:
        """The tensors with bytes that lie in any of ``ranges`` (indexes into ``self.ranges``)."""
        return [t for t in self.tensors if t.range in ranges and t.nbytes]

    def entry(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True)
class Index:
    """``slots/X/index.json``: the tensors of one version, in apply order, and its shards."""

    run_id: str
    version: int
    tensors: tuple[TensorEntry, ...]
    shards: tuple[int, ...]  # size in bytes of shard i
    ranges: tuple[CheckedRange, ...]
    adapter: dict[str, Any] | None = None

    @classmethod
    def loads(cls, raw: bytes, source: str = INDEX_FILE) -> Index:
        with gcpause.paused():  # tens of thousands of entries at once (see gcpause)
            return cls._loads(raw, source)

    @classmethod
    def _loads(cls, raw: bytes, source: str) -> Index:
        tail = None  # the tensors section's bytes, to keep once the index passed
        kept = _KeptTensors.matching(raw)
        data = None if kept is None else _parse_before_tensors(raw[:-len(kept.tail)])
        if data is None:
            kept = None
            split = _split_tensors_last(raw)
            data, tail = split if split is not None else (loads_json(raw, source), None)
        _check_header(data, INDEX_FORMAT_NAME, source)
        problems: list[str] = []
        if data.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
            problems.append(f"checksum_algorithm must be {CHECKSUM_ALGORITHM!r}")
        run_id, version = data.get("run_id"), data.get("version")
        if not is_run_id(run_id):
            problems.append("run_id must be 32 hex digits")
        if not _is_int(version, 1, MAX_VERSION):
            problems.append(f"version must be an integer in [1, {MAX_VERSION}]")
        shards: list[int] = []
        raw_shards = data.get("shards")
        if not isinstance(raw_shards, list):
            problems.append("shards must be a list")
            raw_shards = []
        for i, s in enumerate(raw_shards):
            if not (isinstance(s, dict) and s.get("file") == shard_file(i)
                    and _is_int(s.get("nbytes"))):
                problems.append(f"shards[{i}] must be {{file: {shard_file(i)!r}, nbytes}}")
                continue
            shards.append(s["nbytes"])
        before = len(problems)
        ranges = _parse_ranges(data.get("ranges"), shards, problems)
        entries = None
        if kept is not None:
            if len(problems) == before:
                entries = kept.entries_for(shards, ranges)
            if entries is None:  # the same tensors section against other shards or ranges
                data["tensors"] = loads_json(raw, source).get("tensors")  # (rare: read it all)
        if entries is None:
            # (after a bad range the others' positions shift: tensors are then not held to them)
            entries = tuple(_parse_tensors(data.get("tensors"), shards,
                                           ranges if len(problems) == before else None,
                                           problems))
        adapter = data.get("adapter")
        if adapter is not None and not isinstance(adapter, dict):
            problems.append("adapter must be an object or null")
        if problems:
            more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
            raise FormatError(f"{source} is invalid: " + "; ".join(problems[:20]) + more
                              + "; publish again from the trainer")
        if tail is not None:
            _KeptTensors.keep(tail, shards, ranges, entries)
        return cls(run_id, version, entries, tuple(shards), tuple(ranges), adapter)


#: Writers put the tensors section last; its bytes start with this (compact separators).
_TENSORS_KEY = b',"tensors":'
_JSON_ERRORS = (UnicodeDecodeError, ValueError, RecursionError, MemoryError)


def _parse_before_tensors(prefix: bytes) -> dict[str, Any] | None:
    """The index whose bytes are ``prefix`` then ``,"tensors":`` and one JSON value then
    ``}``, with ``0`` in place of that value; None if ``prefix`` does not parse so.

    Why that is the index, whatever ``prefix`` holds: ``prefix + ',"tensors":0}'`` is valid
    JSON only if ``"tensors"`` is then a member of the outermost object (inside a string, a
    nested object or an array, the final ``}`` cannot close the document), and a valid value
    in that place parses the same whatever it is; the last member of a name wins in both.
    (Nesting within a few levels of Python's recursion limit is the exception: whether the
    whole file parses then depends on the caller's stack depth, on either path.)"""
    try:
        data = json.loads((prefix + _TENSORS_KEY + b"0}").decode("utf-8"))
    except _JSON_ERRORS:
        return None
    if not (type(data) is dict and type(data.get("tensors")) is int):
        return None
    return data


def _split_tensors_last(raw: bytes) -> tuple[dict[str, Any], bytes] | None:
    """(the parsed index, its tail: the bytes from ``,"tensors":`` on) if the index ends with
    its tensors section, as writers write it; else None (then parse it whole)."""
    at = raw.rfind(_TENSORS_KEY)
    if at < 0 or not raw.endswith(b"}"):
        return None
    data = _parse_before_tensors(raw[:at])
    if data is None:
        return None
    try:  # parsed as {"tensors": value}: at the nesting depth the whole file has it
        section = json.loads((b"{" + raw[at + 1:]).decode("utf-8"))
    except _JSON_ERRORS:
        return None
    if len(section) != 1:  # (more members after the tensors: parse the file whole)
        return None
    data["tensors"] = section["tensors"]
    return data, raw[at:]


class _KeptTensors(NamedTuple):
    """The tensors section (``tail``) of the last index read that ended with it and passed
    every check, with the entries it gave against those shards and checked ranges. The next
    version of the same model writes the same section byte for byte: it is then read by
    comparing bytes, parsing only what comes before (header, shards, ranges)."""

    tail: bytes
    shards: list[int]
    bounds: list[tuple[int, int, int]]
    entries: tuple[TensorEntry, ...]

    @staticmethod
    def matching(raw: bytes) -> _KeptTensors | None:
        kept = _LAST_TENSORS[0]
        if kept is None or len(raw) <= len(kept.tail) or not raw.endswith(kept.tail):
            return None
        return kept

    @staticmethod
    def keep(tail: bytes, shards: list[int], ranges: list[CheckedRange],
             entries: tuple[TensorEntry, ...]) -> None:
        _LAST_TENSORS[0] = _KeptTensors(tail, shards, _bounds(ranges), entries)

    def entries_for(self, shards: list[int], ranges: list[CheckedRange]
                    ) -> tuple[TensorEntry, ...] | None:
        """The kept entries if they were checked against these shards and range bounds."""
        if shards == self.shards and _bounds(ranges) == self.bounds:
            return self.entries
        return None


_LAST_TENSORS: list[_KeptTensors | None] = [None]
#: (entries, their total bytes) of the last ``_total_bytes`` call
_LAST_TOTAL: list[tuple[tuple[TensorEntry, ...], int]] = [((), 0)]


def _total_bytes(entries: tuple[TensorEntry, ...]) -> int:
    """The bytes of ``entries``, added up once per tuple: a manifest is built per open, but
    its entries are the one tuple of the parsed index, kept version after version while the
    tensors stay the same (``_KeptTensors``). Adding up 20,000 entries whose memory a load
    has just pushed out of the caches takes ~1.2 ms (a 2-core VM)."""
    last, total = _LAST_TOTAL[0]
    if last is not entries:
        total = sum(t.nbytes for t in entries)
        _LAST_TOTAL[0] = (entries, total)
    return total


def _bounds(ranges: Sequence[CheckedRange]) -> list[tuple[int, int, int]]:
    return [(r.shard, r.offset, r.offset + r.nbytes) for r in ranges]


_COLUMNS = ("name", "dtype", "shape", "shard", "offset", "range")
_RANGE_COLUMNS = ("shard", "offset", "nbytes", "checksum")


def dump_index(run_id: str, version: int, columns: dict[str, list[Any]],
               ranges: dict[str, list[Any]], shards: Sequence[int],
               adapter: dict[str, Any] | None) -> bytes:
    """The bytes of ``index.json`` from its tensor columns (one list per field of
    ``TensorEntry`` but ``nbytes``, in apply order) and its range columns (one list per field
    of ``CheckedRange``): writers build columns directly, with no per-tensor object."""
    return json.dumps({
        "format": INDEX_FORMAT_NAME, "format_version": FORMAT_VERSION,
        "run_id": run_id, "version": version,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "shards": [{"file": shard_file(i), "nbytes": n} for i, n in enumerate(shards)],
        "ranges": {c: ranges[c] for c in _RANGE_COLUMNS},
        "adapter": adapter,
        "tensors": {c: columns[c] for c in _COLUMNS},  # last: see _KeptTensors
    }, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _parse_ranges(raw: Any, shards: list[int], problems: list[str]) -> list[CheckedRange]:
    """Validate the checked ranges: each inside its shard, in shard and offset order, none
    overlapping another (so a verify hashes each stored byte at most once, whatever an index
    claims), each checksum 16 lower-case hex digits."""
    if not (isinstance(raw, dict) and all(isinstance(raw.get(c), list) for c in _RANGE_COLUMNS)):
        problems.append(f"ranges must be an object of lists {list(_RANGE_COLUMNS)}")
        return []
    shard_ids, offsets, sizes, sums = (raw[c] for c in _RANGE_COLUMNS)
    if not len(shard_ids) == len(offsets) == len(sizes) == len(sums):
        problems.append("ranges: every column must have one value per range")
        return []
    memo = _LAST_RANGES[0]
    if memo is not None and memo[0] == (shard_ids, offsets, sizes, shards) and set(
            map(type, itertools.chain(shard_ids, offsets, sizes))) <= {int} and _checksums_ok(
            sums):
        new = tuple.__new__  # the next version of the same layout: only its checksums are new
        return [new(CheckedRange, row + (c,)) for row, c in zip(memo[1], sums, strict=True)]
    out: list[CheckedRange] = []
    hexdigits = _HEX64.fullmatch
    end_shard, end = -1, 0
    before = len(problems)
    for i, (shard, offset, nbytes, digest) in enumerate(zip(shard_ids, offsets, sizes, sums,
                                                                      strict=True)):
        if not (_is_int(shard) and shard < len(shards) and _is_int(offset)
                and _is_int(nbytes) and offset + nbytes <= shards[shard]):
            problems.append(f"ranges[{i}] must lie inside a listed shard (shard "
                            f"{str(shard)[:30]}, offset {str(offset)[:30]}, nbytes "
                            f"{str(nbytes)[:30]})")
            continue
        if shard < end_shard or (shard == end_shard and offset < end):
            problems.append(f"ranges[{i}] overlaps or precedes the range before it (ranges go "
                            "in shard and offset order, never overlapping)")
            continue
        if type(digest) is not str or not hexdigits(digest):
            problems.append(f"ranges[{i}].checksum must be 16 hex digits")
            continue
        end_shard, end = shard, offset + nbytes
        out.append(CheckedRange(shard, offset, nbytes, digest))
    if len(problems) == before:
        _LAST_RANGES[0] = ((shard_ids, offsets, sizes, shards), [r[:3] for r in out])
    return out


#: The position columns and shard sizes of the last ranges that passed ``_parse_ranges``.
_LAST_RANGES: list[Any] = [None]




def _parse_tensors(raw: Any, shards: list[int], ranges: list[CheckedRange] | None,
                   problems: list[str]) -> Sequence[TensorEntry]:
    """Validate the index's tensor columns and build the entries. A whole-column fast path
    (a few C-level passes) accepts a well-formed index; anything else goes through the
    per-tensor checks that name every problem. Every tensor with bytes must lie inside the
    checked range it names."""
    if not (isinstance(raw, dict) and all(isinstance(raw.get(c), list) for c in _COLUMNS)):
        problems.append(f"tensors must be an object of lists {list(_COLUMNS)}")
        return []
    columns = tuple(raw[c] for c in _COLUMNS)
    names = columns[0]
    count = len(names)
    if any(len(col) != count for col in columns[1:]):
        problems.append("tensors: every column must have one value per tensor")
        return []
    if ranges is None:  # the ranges were refused: report the tensors' own problems only
        return _parse_slow(*columns, shards, None, problems)
    bounds = _bounds(ranges)
    # (the next version of the same model does not come here: see _KeptTensors)
    fast = _parse_fast(*columns, shards, bounds)
    if fast is not None:
        return fast
    return _parse_slow(*columns, shards, bounds, problems)


def _plain_types(names: list, dtypes: list, shapes: list, shard_ids: list, offsets: list,
                 range_ids: list) -> bool:
    """Every value of the exact JSON type a valid index has (``==`` alone would take
    ``true`` for 1 and ``4.0`` for 4)."""
    if not (set(map(type, shapes)) <= {list} and set(map(type, names)) <= {str}
            and set(map(type, dtypes)) <= {str}):
        return False
    return set(map(type, itertools.chain(shard_ids, offsets, range_ids,
                                         itertools.chain.from_iterable(shapes)))) <= {int}


def _checksums_ok(sums: list) -> bool:
    """Every checksum a 16-digit lower-case hex string (C-level passes)."""
    try:
        hexes = "".join(sums)  # TypeError unless every one is a str
        return (not sums or set(map(len, sums)) == {16}) and (
            not hexes or (hexes.isalnum() and hexes == hexes.lower()
                          and bool(bytes.fromhex(hexes))))
    except (TypeError, ValueError):
        return False


def _parse_fast(names: list, dtypes: list, shapes: list, shard_ids: list, offsets: list,
                range_ids: list, shards: list[int], bounds: list[tuple[int, int, int]]
                ) -> list[TensorEntry] | None:
    """The entries if every column is well formed, else None (nothing is reported here).
    Whole-column checks run at C speed (``join``, ``set(map(type, ...))``, ``min``/``max``):
    an index of 20,000 tensors is read in a few tens of milliseconds."""
    count = len(names)
    if not count:
        return []
    if not _plain_types(names, dtypes, shapes, shard_ids, offsets, range_ids):
        return None
    joined = "".join(names)
    flat = list(itertools.chain.from_iterable(shapes))
    if not (joined.isascii() and "\x00" not in joined and "" not in names
            and len(set(names)) == count and max(map(len, shapes)) <= _MAX_DIMS
            and (not flat or (min(flat) >= 0 and max(flat) <= _MAX_INT))
            and min(offsets) >= 0 and min(shard_ids) >= 0 and max(shard_ids) < len(shards)
            and min(range_ids) >= -1 and max(range_ids) < len(bounds)):
        return None
    sizes = DTYPE_SIZES
    align = ALIGN - 1
    entries = []
    append = entries.append
    for name, dt, shape, shard, offset, rid in zip(names, dtypes, shapes, shard_ids, offsets,
                                                   range_ids, strict=True):
        itemsize = sizes.get(dt) if type(dt) is str else None
        if itemsize is None:
            return None
        nbytes = math.prod(shape) * itemsize
        if offset & align or nbytes > _MAX_INT or offset + nbytes > shards[shard]:
            return None
        if nbytes:
            if rid < 0:
                return None
            r_shard, r_start, r_end = bounds[rid]
            if r_shard != shard or offset < r_start or offset + nbytes > r_end:
                return None
        elif _strides_overflow(shape):
            return None
        append(TensorEntry(name, dt, tuple(shape), nbytes, shard, offset, rid))
    return entries


def _strides_overflow(shape: list[int]) -> bool:
    """Whether torch cannot even make an empty tensor of ``shape``: its contiguous strides are
    products of the dims (a 0 counted as 1), so ``[0, 2**62, 4]`` holds no element yet raises
    "Stride calculation overflowed" when a reader builds it, after other tensors were applied."""
    return math.prod(d or 1 for d in shape) > _MAX_INT


def _parse_slow(names: list, dtypes: list, shapes: list, shard_ids: list, offsets: list,
                range_ids: list, shards: list[int], bounds: list[tuple[int, int, int]] | None,
                problems: list[str]) -> list[TensorEntry]:
    count = len(names)
    sizes = DTYPE_SIZES
    nshards = len(shards)
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    for i in range(count):
        name, dt, shape, shard, offset, rid = (names[i], dtypes[i], shapes[i], shard_ids[i],
                                               offsets[i], range_ids[i])
        if type(name) is not str or not name or "\x00" in name or (
                not name.isascii() and name_problem(name)):
            problems.append(f"tensors[{i}].name: {name_problem(name) or 'invalid'}")
            continue
        itemsize = sizes.get(dt) if type(dt) is str else None
        if itemsize is None:
            problems.append(f"tensors[{i}].dtype {str(dt)[:40]!r} is unknown")
            continue
        if type(shape) is not list or len(shape) > _MAX_DIMS:
            problems.append(f"tensors[{i}].shape must be a list of at most {_MAX_DIMS} ints")
            continue
        numel = 1
        for d in shape:
            if type(d) is not int or d < 0 or d > _MAX_INT:
                numel = -1
                break
            numel = min(numel * d, _MAX_INT + 1)
        if numel < 0:
            problems.append(f"tensors[{i}].shape must hold integers in [0, 2**62]")
            continue
        nbytes = numel * itemsize
        if numel > _MAX_INT or nbytes > _MAX_INT or (not nbytes and _strides_overflow(shape)):
            problems.append(f"tensors[{i}]: shape {str(shape)[:80]} is too large for any "
                            "tensor")
            continue
        if type(offset) is not int or offset < 0 or offset % ALIGN:
            problems.append(f"tensors[{i}].offset must be a non-negative multiple of {ALIGN}")
            continue
        if type(shard) is not int or not 0 <= shard < nshards:
            problems.append(f"tensors[{i}].shard {str(shard)[:30]} is not a listed shard")
            continue
        if offset + nbytes > shards[shard]:
            problems.append(f"tensors[{i}]: bytes [{offset}, {offset + nbytes}) lie outside "
                            f"shard {shard} ({shards[shard]} bytes)")
            continue
        if bounds is not None and (type(rid) is not int or not -1 <= rid < len(bounds)):
            problems.append(f"tensors[{i}].range {str(rid)[:30]} is not a listed range")
            continue
        if bounds is not None and nbytes and (
                rid < 0 or bounds[rid][0] != shard or offset < bounds[rid][1]
                or offset + nbytes > bounds[rid][2]):
            problems.append(f"tensors[{i}]: bytes [{offset}, {offset + nbytes}) of shard "
                            f"{shard} lie outside the checked range it names ({rid})")
            continue
        if name in seen:
            problems.append(f"tensors[{i}]: name {describe_name(name)} appears twice")
            continue
        seen.add(name)
        entries.append(TensorEntry(name, dt, tuple(shape), nbytes, shard, offset, rid))
    return entries


def plan_shards(sizes: list[int], shard_bytes: int = SHARD_BYTES) -> tuple[list[tuple[int, int]],
                                                                          list[int]]:
    """Place tensors of ``sizes`` bytes, in order, into shards: returns (shard, offset) per
    tensor and the size of every shard. Each tensor starts ``ALIGN``-aligned; a shard closes
    once it would grow past ``shard_bytes`` (a larger tensor gets a shard of its own). The same
    sizes always give the same layout, so a slot's files are reused in place push after push."""
    places: list[tuple[int, int]] = []
    shards: list[int] = []
    shard, end = -1, 0
    for size in sizes:
        offset = -(-end // ALIGN) * ALIGN  # aligned(end), inlined: this runs per tensor
        if shard < 0 or (end and offset + size > shard_bytes):
            if shard >= 0:
                shards.append(end)
            shard, offset = shard + 1, 0
        places.append((shard, offset))
        end = offset + size
    if shard >= 0:
        shards.append(end)
    return places, shards


# ---- torch dtypes (imported lazily: reading a head needs no torch) ---------------------------
def torch_dtype(name: str) -> Any:
    cached = _TORCH_DTYPES.get(name)
    if cached is not None:
        return cached
    import torch

    if name not in DTYPE_SIZES:
        _unknown(name)
    try:
        _TORCH_DTYPES[name] = getattr(torch, name)
        return _TORCH_DTYPES[name]
    except AttributeError:
        raise FormatError(f"dtype {name!r} is not available in this torch build") from None


_TORCH_DTYPES: dict[str, Any] = {}


def _unknown(name: str) -> Any:
    raise FormatError(f"unknown dtype {name!r}; this dbsync knows {', '.join(DTYPE_SIZES)}")


def dtype_name(dtype: Any) -> str:
    cached = _NAMES.get(dtype)
    if cached is not None:
        return cached
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise FormatError(
            f"dtype {dtype} cannot be published; supported: {', '.join(sorted(DTYPE_SIZES))}"
        )
    _NAMES[dtype] = name
    return name


_NAMES: dict[Any, str] = {}


def is_supported_dtype(dtype: Any) -> bool:
    known = _SUPPORTED.get(dtype)
    if known is None:
        known = _SUPPORTED[dtype] = str(dtype).removeprefix("torch.") in DTYPE_SIZES
    return known


_SUPPORTED: dict[Any, bool] = {}


def dtype_from_name(name: str) -> Any:
    """The torch dtype of a manifest dtype name (FormatError if unknown)."""
    if not isinstance(name, str) or name not in DTYPE_SIZES:
        _unknown(str(name)[:40])
    return torch_dtype(name)


def nbytes_of(dtype: Any, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


#: wrapper module class name -> the attribute holding the module it wraps
_WRAPPERS = {"OptimizedModule": "_orig_mod", "DistributedDataParallel": "module",
             "DataParallel": "module"}


def unwrap_compiled(module: Any) -> Any:
    """The module inside the wrappers around ``module``: ``torch.compile``'s (its state_dict
    names every tensor ``_orig_mod.<name>``), DDP's and ``DataParallel``'s (``module.<name>``),
    any number of them. Published under the wrappers' names, the tensors would fit only a
    model wrapped the same way. Anything else as it is."""
    for _ in range(16):
        attr = _WRAPPERS.get(type(module).__name__)
        inner = getattr(module, attr, None) if attr is not None else None
        if inner is None:
            break
        module = inner
    return module


def plain_state_dict(module: Any, keep_vars: bool = False) -> dict[str, Any]:
    """``module.state_dict(keep_vars=...)`` under the names of the uncompiled model: a
    submodule replaced by ``torch.compile(submodule)`` names its tensors
    ``<path>._orig_mod.<name>``, which are given as ``<path>.<name>``."""
    state = module.state_dict(keep_vars=keep_vars)
    compiled = [name + "." for name, m in module.named_modules()
                if name and type(m).__name__ == "OptimizedModule"]
    if not compiled:
        return state
    compiled.sort(key=len, reverse=True)  # (the innermost first: nested compiled modules)
    renamed = {}
    for key, value in state.items():
        for prefix in compiled:
            if key.startswith(prefix + "_orig_mod."):
                key = prefix + key[len(prefix) + len("_orig_mod."):]
        renamed[key] = value
    return renamed


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a ``tensordict.TensorDictBase``, without importing tensordict (no
    TensorDict exists unless it was imported) and without reading the package's attributes:
    while another thread imports it, ``tensordict`` is in ``sys.modules`` half-initialized,
    without ``TensorDictBase`` yet."""
    return is_tensordict_class(type(value))


def is_tensordict_class(cls: type) -> bool:
    """Whether ``cls`` is ``tensordict.TensorDictBase`` or a subclass (see ``is_tensordict``)."""
    return any(base.__name__ == "TensorDictBase" and base.__module__.startswith("tensordict")
               for base in cls.__mro__)
