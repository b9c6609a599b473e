"""The on-disk format (docs/FORMAT.md is the spec; keep the two in step).

This module is pure data: the manifest and tensor-entry dataclasses, their JSON form with
validation, and the mapping from tensor names to file names. It does no I/O.

Hazard: every field read from disk is untrusted. ``Manifest.from_json`` validates all of it,
including that file names are plain names that cannot leave the slot directory, before any
caller builds a path from them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .errors import FormatError

FORMAT_NAME = "dbsync"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "xxh3_64"
SLOTS = ("a", "b")

MANIFEST_FILE = "dbsync.json"
SLOTS_DIR = "slots"
READERS_DIR = "readers"
WRITER_LOCK_FILE = "writer.lock"
SLOT_STAMP_FILE = "dbsync-slot.json"
TENSORDICT_META_FILE = "meta.json"
FILE_SUFFIX = ".memmap"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# A tensor name is stored under its own file name only if it is plainly safe everywhere
# (no separators, no leading dot, no control or non-ASCII characters, not too long).
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,150}")
_ENCODED_PREFIX = "_x_"
# Top-level keys of tensordict's meta.json: a tensor file stem must never shadow them.
_RESERVED_STEMS = {"shape", "device", "_type", "_format_version", "_class", "names",
                   "batch_size", "_non_tensor", "leaves", "is_nested", "meta"}
_SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.memmap")
_SAFE_READER_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,100}")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise FormatError(
            f"dtype {dtype} cannot be published; supported: {', '.join(sorted(_DTYPES))}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise FormatError(
            f"unknown dtype {name!r} in manifest; this dbsync knows {', '.join(sorted(_DTYPES))}"
        ) from None


def is_supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_NAMES


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def file_stems_for(names: list[str]) -> list[str]:
    """Map tensor names to file stems, one each, safe on every filesystem.

    Plain names keep their own stem (so a slot opened with ``TensorDict.load_memmap`` shows
    familiar keys); anything else (``/``, unicode, a leading dot, very long, colliding with
    another name on a case-insensitive filesystem) becomes ``_x_<xxh3_128 of the name>``.
    The manifest records the mapping; readers never derive it.
    """
    stems: list[str] = []
    taken: set[str] = set()
    for name in names:
        stem = name
        if not _PLAIN_NAME.fullmatch(name) or name.startswith(_ENCODED_PREFIX) or (
            name in _RESERVED_STEMS) or (
            name.lower() in taken
        ):
            stem = _ENCODED_PREFIX + xxhash.xxh3_128_hexdigest(name.encode("utf-8"))
        if stem.lower() in taken:  # the same name twice (callers validate this first)
            raise FormatError(f"tensor name {name!r} appears twice; names must be unique")
        taken.add(stem.lower())
        stems.append(stem)
    return stems


def check_reader_id(reader_id: str) -> str:
    if not _SAFE_READER_ID.fullmatch(reader_id):
        raise FormatError(
            f"reader id {reader_id!r} is not allowed: use letters, digits, '_', '.', '-' "
            "(at most 101 characters, not starting with '.' or '-')"
        )
    return reader_id


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class Manifest:
    version: int
    slot: str
    tensors: tuple[TensorEntry, ...]
    created_at: float
    durable: bool = True
    writer: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def entry(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "version": self.version,
            "slot": self.slot,
            "created_at": self.created_at,
            "durable": self.durable,
            "writer": self.writer,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "total_bytes": self.total_bytes,
            "tensors": [t.to_json() for t in self.tensors],
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), ensure_ascii=False, indent=1).encode("utf-8")

    @classmethod
    def loads(cls, raw: bytes, source: str = "manifest") -> Manifest:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(
                f"{source} is not valid JSON ({exc}); it is replaced atomically, so this means "
                "it was written by something other than dbsync or the disk is damaged"
            ) from None
        return cls.from_json(data, source)

    @classmethod
    def from_json(cls, data: Any, source: str = "manifest") -> Manifest:
        problems: list[str] = []

        def need(cond: bool, what: str) -> bool:
            if not cond:
                problems.append(what)
            return cond

        if not isinstance(data, dict):
            raise FormatError(f"{source}: expected a JSON object")
        if data.get("format") != FORMAT_NAME:
            raise FormatError(f"{source}: not a dbsync manifest (format={data.get('format')!r})")
        fv = data.get("format_version")
        if fv != FORMAT_VERSION:
            raise FormatError(
                f"{source}: format_version {fv!r} is not supported by this dbsync (it reads "
                f"version {FORMAT_VERSION}); upgrade dbsync on this host"
            )
        if data.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
            problems.append(f"checksum_algorithm must be {CHECKSUM_ALGORITHM!r}")
        version = data.get("version")
        need(isinstance(version, int) and not isinstance(version, bool) and version >= 1,
             "version must be an integer >= 1")
        need(data.get("slot") in SLOTS, f"slot must be one of {SLOTS}")
        need(isinstance(data.get("created_at"), int | float), "created_at must be a number")
        raw_tensors = data.get("tensors")
        entries: list[TensorEntry] = []
        if need(isinstance(raw_tensors, list), "tensors must be a list"):
            names: set[str] = set()
            files: set[str] = set()
            for i, t in enumerate(raw_tensors):
                where = f"tensors[{i}]"
                if not isinstance(t, dict):
                    problems.append(f"{where} must be an object")
                    continue
                name, file, dt = t.get("name"), t.get("file"), t.get("dtype")
                shape, nbytes, checksum = t.get("shape"), t.get("nbytes"), t.get("checksum")
                ok = need(isinstance(name, str) and name != "", f"{where}.name must be a string")
                ok &= need(isinstance(file, str) and bool(_SAFE_FILE.fullmatch(file)),
                           f"{where}.file {file!r} is not a plain '<stem>.memmap' file name")
                ok &= need(dt in _DTYPES, f"{where}.dtype {dt!r} is unknown")
                ok &= need(isinstance(shape, list) and all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape),
                    f"{where}.shape must be a list of non-negative integers")
                ok &= need(isinstance(nbytes, int) and nbytes >= 0, f"{where}.nbytes invalid")
                ok &= need(isinstance(checksum, str) and re.fullmatch(r"[0-9a-f]{16}", checksum)
                           is not None, f"{where}.checksum must be 16 hex digits")
                if not ok:
                    continue
                if nbytes != nbytes_of(_DTYPES[dt], tuple(shape)):
                    problems.append(f"{where}.nbytes {nbytes} does not match dtype and shape")
                    continue
                if name in names or file.lower() in files:
                    problems.append(f"{where}: duplicate name or file ({name!r}, {file!r})")
                    continue
                names.add(name)
                files.add(file.lower())
                entries.append(TensorEntry(name, file, dt, tuple(shape), nbytes, checksum))
        if problems:
            raise FormatError(f"{source} is invalid: " + "; ".join(problems))
        writer = data.get("writer")
        return cls(
            version=version,
            slot=data["slot"],
            tensors=tuple(entries),
            created_at=float(data["created_at"]),
            durable=bool(data.get("durable", True)),
            writer=writer if isinstance(writer, dict) else {},
        )
