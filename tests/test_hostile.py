"""Hostile and broken stores and inputs (docs/FORMAT.md section 9): nothing a store or a source
directory holds may run code, make a reader open a file outside the store, hang a reader or the
writer, exhaust memory, escape as a non-dbsync exception, or hand over part of a version.

Every tampering case checks: the error class, that the version loaded before keeps serving,
that nothing outside the store was opened (inotify on the outside files), and that every call
returned within a bound (each runs in a thread joined with a timeout)."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import stat
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import xxhash
from click.testing import CliRunner

import dbsync
from cli.main import cli
from dbsync.errors import DamagedVersionError, DBSyncError, FormatError, InvalidWeightsError
from dbsync.format import INDEX_FILE, MANIFEST_FILE, MAX_HEAD_BYTES, SLOT_STAMP_FILE, shard_file
from dbsync.store import Store

BOUND_S = 10.0  # no call in this file may take longer (a hang fails the test, never the suite)
V1 = {"a": torch.full((4,), 1.0), "b": torch.arange(6, dtype=torch.int32),
      "c": torch.full((2, 3), 1.0, dtype=torch.bfloat16)}
V2 = {"a": torch.full((4,), 2.0), "b": torch.arange(6, dtype=torch.int32) * 2,
      "c": torch.full((2, 3), 2.0, dtype=torch.bfloat16)}


# ---- helpers -------------------------------------------------------------------------------
def publish(root: str, weights: Any) -> int:
    with dbsync.Sender(root) as sender:
        return sender.push(weights)


def bounded(fn: Callable[[], Any], seconds: float = BOUND_S) -> tuple[Any, BaseException | None]:
    """(result, exception) of ``fn()`` run in a thread; fails the test if it does not return
    within ``seconds`` (the thread is a daemon: a hang cannot stop the test run)."""
    out: list[Any] = [None, None]

    def run() -> None:
        try:
            out[0] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out[1] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    return out[0], out[1]


def refused(fn: Callable[[], Any], cls: type[BaseException] = FormatError) -> BaseException:
    """The error ``fn`` raised (within the bound); it must be a ``cls``."""
    result, exc = bounded(fn)
    assert exc is not None, f"accepted a tampered store (returned {result!r})"
    assert isinstance(exc, cls), f"{type(exc).__name__}: {exc}"
    return exc


def run_cli(*args: str) -> Any:
    """``dbsync ARGS`` in-process, bounded; must fail with exit 1 and a plain message."""
    result, exc = bounded(lambda: CliRunner().invoke(cli, list(args)))
    assert exc is None, exc
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception))
    assert "Traceback" not in result.output and "bug in dbsync" not in result.output, (
        result.output)
    return result


def cli_refuses(root: str, *needles: str) -> None:
    for command in ("verify", "status"):
        result = run_cli(command, root)
        assert result.exit_code == 1, (command, result.output)
        assert "Error:" in result.output, (command, result.output)
        for needle in needles:
            assert needle in result.output, (command, needle, result.output)


class Serving:
    """A ``load_weights`` that keeps what it was handed (what an engine would serve) and
    counts every tensor it received."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.received = 0

    def __call__(self, pairs: Any) -> None:
        for name, tensor in pairs:
            self.received += 1
            self.weights[name] = tensor.clone()


def assert_serving(rx: dbsync.Receiver, serving: Serving, version: int,
                   weights: dict[str, torch.Tensor], received: int) -> None:
    """The receiver still has ``version`` applied, and nothing more was handed over."""
    assert rx.loaded_version == version
    assert serving.received == received, "tensors of a refused version reached load_weights"
    for name, tensor in weights.items():
        assert torch.equal(serving.weights[name], tensor), name


@contextmanager
def loaded_v1_then_v2(root: str) -> Iterator[tuple[dbsync.Receiver, Serving]]:
    """V1 published and loaded by a receiver, then V2 published (slot b), not loaded yet."""
    publish(root, V1)
    serving = Serving()
    rx = dbsync.Receiver(root, lease_timeout=2.0)
    try:
        assert rx.load(serving) == 1
        assert publish(root, V2) == 2
        yield rx, serving
    finally:
        rx.close()


def current_slot_dir(root: str) -> str:
    store = Store(root)
    return store.slot_dir(store.require_manifest().slot)


class OpenSpy:
    """inotify on outside files and directories: records every open and read of them (a
    symlink followed from the store would show up here)."""

    _IN_ACCESS, _IN_OPEN = 0x1, 0x20

    def __init__(self, *paths: str):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        for path in paths:
            wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path),
                                              self._IN_ACCESS | self._IN_OPEN)
            assert wd >= 0, os.strerror(ctypes.get_errno())

    def events(self) -> int:
        count = 0
        try:
            while True:
                buf = os.read(self.fd, 1 << 16)
                pos = 0
                while pos < len(buf):
                    _wd, mask, _cookie, size = struct.unpack_from("iIII", buf, pos)
                    count += bool(mask & (self._IN_ACCESS | self._IN_OPEN))
                    pos += 16 + size
        except BlockingIOError:
            return count

    def close(self) -> None:
        os.close(self.fd)


def outside_copy(src: str, dst: str) -> None:
    """Copy a file or directory (its bytes would pass every check) outside the store."""
    if os.path.isdir(src):
        os.mkdir(dst)
        for name in os.listdir(src):
            outside_copy(os.path.join(src, name), os.path.join(dst, name))
    else:
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())


def read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def forge(root: str, index: Callable[[dict], Any] | None = None,
          head: Callable[[dict], Any] | None = None) -> None:
    """Rewrite the current index and head the way a hostile writer would: consistently (the
    head's index length and checksum match the forged index). Each callable edits the JSON in
    place or returns raw bytes to write instead."""
    head_path = os.path.join(root, MANIFEST_FILE)
    head_json = read_json(head_path)
    index_path = os.path.join(Store(root).slot_dir(head_json["slot"]), INDEX_FILE)
    index_json = read_json(index_path)
    raw = index(index_json) if index is not None else None
    if not isinstance(raw, bytes):
        raw = json.dumps(index_json).encode()
    write_bytes(index_path, raw)
    head_json["index"].update(nbytes=len(raw), checksum=xxhash.xxh3_64_hexdigest(raw))
    raw_head = head(head_json) if head is not None else None
    if not isinstance(raw_head, bytes):
        raw_head = json.dumps(head_json).encode()
    write_bytes(head_path, raw_head)


@pytest.fixture
def fifos() -> Iterator[list[str]]:
    """FIFOs a test creates; on teardown each is opened for writing once, which releases any
    reader blocked on it (so a failing run does not leave a thread stuck forever)."""
    made: list[str] = []
    yield made
    for path in made:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody is blocked on it


# ---- 1. code execution -----------------------------------------------------------------------
class _Marker:
    """Unpickling this creates the marker file (what a crafted pickle could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_tensordict_pickle_is_never_loaded(root, tmp_path):
    from tensordict import NonTensorData, TensorDict

    publish(root, V1)
    before = open(os.path.join(root, MANIFEST_FILE), "rb").read()
    src, marker = str(tmp_path / "td"), str(tmp_path / "marker")
    TensorDict({"w": torch.ones(3), "layer": {"b": torch.zeros(2)},
                "note": NonTensorData(_Marker(str(tmp_path / "unused")))},
               batch_size=[]).memmap(src)
    pickled = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs
               if f.endswith((".pickle", ".pkl"))]
    assert pickled, "tensordict no longer pickles non-tensor entries: craft one by hand"
    for path in pickled:  # the crafted payload: loading it creates `marker`
        write_bytes(path, pickle.dumps(_Marker(marker)))

    result = run_cli("push", src, root)
    assert result.exit_code == 1, result.output
    assert "note" in result.output and "never unpickles" in result.output, result.output
    with dbsync.Sender(root) as sender:
        exc = refused(lambda: sender.push(src), InvalidWeightsError)
        assert "note" in str(exc) and "nothing was written" in str(exc)
        assert sender.latest_version() == 1
    assert not os.path.exists(marker), "a pickle from the source directory was loaded"
    assert open(os.path.join(root, MANIFEST_FILE), "rb").read() == before


# ---- 2. leaving the store --------------------------------------------------------------------
@pytest.mark.parametrize("target", ["slot", "shard", "index", "stamp", "head"])
def test_symlinks_are_never_followed(root, tmp_path, target):
    with loaded_v1_then_v2(root) as (rx, serving):
        slot_dir = current_slot_dir(root)
        inside = {"slot": slot_dir, "shard": os.path.join(slot_dir, shard_file(0)),
                  "index": os.path.join(slot_dir, INDEX_FILE),
                  "stamp": os.path.join(slot_dir, SLOT_STAMP_FILE),
                  "head": os.path.join(root, MANIFEST_FILE)}[target]
        outside = str(tmp_path / f"outside-{target}")
        outside_copy(inside, outside)  # the very bytes the store held: every checksum passes
        os.rename(inside, str(tmp_path / "moved-away"))
        os.symlink(outside, inside)
        spy = OpenSpy(outside)
        try:
            what = (FormatError, DamagedVersionError) if target == "shard" else FormatError
            exc = refused(lambda: rx.load(serving), what)
            assert "symlink" in str(exc) or "not a plain directory" in str(exc), exc
            if target in ("slot", "index", "head"):
                refused(lambda: rx.manifest())
            if target == "head":
                refused(rx.latest_version)
            else:
                assert bounded(rx.latest_version)[0] == 2  # the head alone is intact
            cli_refuses(root, "symlink")
            assert spy.events() == 0, f"the store's {target} symlink was followed"
        finally:
            spy.close()
        assert_serving(rx, serving, 1, V1, received=len(V1))


# ---- 3. hangs --------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["shard", "stamp", "index", "head"])
def test_fifos_never_block(root, fifos, target):
    with loaded_v1_then_v2(root) as (rx, serving):
        slot_dir = current_slot_dir(root)
        path = {"shard": os.path.join(slot_dir, shard_file(0)),
                "stamp": os.path.join(slot_dir, SLOT_STAMP_FILE),
                "index": os.path.join(slot_dir, INDEX_FILE),
                "head": os.path.join(root, MANIFEST_FILE)}[target]
        os.unlink(path)
        os.mkfifo(path)
        fifos.append(path)
        what = (FormatError, DamagedVersionError) if target == "shard" else FormatError
        exc = refused(lambda: rx.load(serving), what)
        assert "FIFO" in str(exc) + str(getattr(exc, "damaged", "")), exc
        if target == "head":
            refused(rx.latest_version)
        else:
            assert bounded(rx.latest_version)[0] == 2
        cli_refuses(root, "FIFO")
        assert_serving(rx, serving, 1, V1, received=len(V1))

        # The refused reader (still open, still heart-beating) holds no slot: the writer can
        # publish into both slots, the one with the FIFO included, within the bound.
        def push_twice() -> list[int]:
            with dbsync.Sender(root, lease_timeout=60.0) as sender:
                return [sender.push(V1), sender.push(V2)]

        versions, exc = bounded(push_twice)
        assert exc is None, exc
        assert rx.load(serving) == versions[-1]
        assert_serving(rx, serving, versions[-1], V2, received=2 * len(V1))


def test_hostile_lease_files_never_block_the_writer(root, tmp_path, fifos):
    """Anything in readers/ (a FIFO, a link to /dev/zero or to a lease outside, a huge file,
    garbage) is skipped by the writer and by `dbsync status`: pushes into both slots go on."""
    publish(root, V1)
    readers = os.path.join(root, "readers")
    os.mkfifo(os.path.join(readers, "fifo.json"))
    fifos.append(os.path.join(readers, "fifo.json"))
    os.symlink("/dev/zero", os.path.join(readers, "zero.json"))
    outside = str(tmp_path / "outside-lease.json")  # a live reader holding both slots
    write_bytes(outside, json.dumps({"reader_id": "outside", "held": [["a", 1], ["b", 2]],
                                     "pid": os.getpid(), "beat": 1}).encode())
    os.symlink(outside, os.path.join(readers, "outside.json"))
    with open(os.path.join(readers, "huge.json"), "wb") as f:
        f.truncate(1 << 30)
    write_bytes(os.path.join(readers, "garbage.json"), b"[" * 100_000)
    for name, record in (("no-host", {"held": [["a", 1], ["b", 2]]}),  # parses, but no
                         ("forever", {"reader_id": "forever", "host": "h", "pid": 1,  # reader's
                                      "held": [["a", 1], ["b", 2]], "lease_timeout": 1e308,
                                      "beat": 1, "updated_at": time.time()})):
        write_bytes(os.path.join(readers, f"{name}.json"), json.dumps(record).encode())
    spy = OpenSpy(outside)
    try:
        def push_twice() -> list[int]:
            with dbsync.Sender(root, lease_timeout=60.0) as sender:
                return [sender.push(V2), sender.push(V1)]

        versions, exc = bounded(push_twice)
        assert exc is None and versions == [2, 3], (versions, exc)
        result = run_cli("status", root)
        assert result.exit_code == 0 and "version    3" in result.output, result.output
        assert spy.events() == 0, "a lease symlink was followed"
    finally:
        spy.close()


# ---- oversized records -----------------------------------------------------------------------
def test_oversized_records_are_refused(root, tmp_path):
    with loaded_v1_then_v2(root) as (rx, serving):
        head = os.path.join(root, MANIFEST_FILE)
        good = open(head, "rb").read()

        os.unlink(head)
        os.symlink("/dev/zero", head)
        assert "symlink" in str(refused(rx.latest_version))
        assert "symlink" in str(refused(lambda: rx.load(serving)))
        cli_refuses(root, "symlink")

        # A regular head past the bound, yet valid JSON (so only the bound refuses it).
        os.unlink(head)
        write_bytes(head, good + b" " * MAX_HEAD_BYTES)
        tracemalloc.start()
        try:
            exc = refused(rx.latest_version)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert "more than" in str(exc), exc
        assert peak < MAX_HEAD_BYTES // 4, f"{peak} bytes allocated to refuse it"
        refused(lambda: rx.load(serving))
        cli_refuses(root)

        # An index far larger than the head says (sparse: it costs no disk) is not read.
        write_bytes(head, good)
        index = os.path.join(current_slot_dir(root), INDEX_FILE)
        os.truncate(index, 256 << 20)
        tracemalloc.start()
        try:
            refused(lambda: rx.load(serving))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"{peak} bytes allocated to refuse a 256 MiB index"
        assert_serving(rx, serving, 1, V1, received=len(V1))


# ---- 5. garbled manifests --------------------------------------------------------------------
_WRONG = [None, True, -1, 1.5, "x", [], {}, [1, 2], {"a": 1}, 2**70]
_HEAD_FIELDS = ["format", "format_version", "run_id", "version", "slot", "kind", "created_at",
                "index", "tensor_count", "total_bytes"]
_INDEX_FIELDS = ["format", "format_version", "run_id", "version", "checksum_algorithm",
                 "shards", "tensors", "ranges", "adapter"]
_TENSOR_FIELDS = ["name", "dtype", "shape", "shard", "offset", "range"]
_RANGE_FIELDS = ["shard", "offset", "nbytes", "checksum"]


def _set(path: list[Any], value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return edit


def _set_tensor(field: str, value: Any) -> Callable[[dict], None]:
    """Set a field of the index's first tensor (columns: one list per field; or one object
    per tensor, as in earlier revisions of format 2)."""
    def edit(index: dict) -> None:
        tensors = index["tensors"]
        if isinstance(tensors, dict):
            tensors[field][0] = value
        else:
            tensors[0][field] = value
    return edit


def _set_range(field: str, value: Any) -> Callable[[dict], None]:
    """Set a field of the index's first checked range."""
    def edit(index: dict) -> None:
        index["ranges"][field][0] = value
    return edit


def _append_tensor(index: dict, entry: dict[str, Any]) -> None:
    tensors = index["tensors"]
    if isinstance(tensors, list):
        tensors.append({"nbytes": 0, **entry})
        return
    for field, values in tensors.items():
        values.append(entry[field])


def _columnar(root: str) -> bool:
    head = read_json(os.path.join(root, MANIFEST_FILE))
    index = read_json(os.path.join(Store(root).slot_dir(head["slot"]), INDEX_FILE))
    return isinstance(index["tensors"], dict)


def _five_thousand_digits(index: dict) -> bytes:
    _set_tensor("shape", [123456789])(index)
    return json.dumps(index).replace("123456789", "1" * 5000).encode()


def _garbled_cases(columnar: bool = True) -> list[tuple[str, dict[str, Any]]]:
    deep = b"[" * 100_000 + b"]" * 100_000
    digits = b"1" * 5000
    cases: list[tuple[str, dict[str, Any]]] = [
        ("head deeply nested", {"head": lambda h: deep}),
        ("index deeply nested", {"index": lambda i: deep}),
        ("head 5000-digit version", {"head": lambda h: json.dumps(h).replace(
            f'"version": {h["version"]}', '"version": ' + digits.decode()).encode()}),
        ("index 5000-digit shape", {"index": _five_thousand_digits}),
        ("dtype is a list", {"index": _set_tensor("dtype", ["float32"])}),
        ("dtype is a dict", {"index": _set_tensor("dtype", {"float32": 1})}),
        ("name twice", {"index": _set_tensor("name", "b")}),
        ("head not UTF-8", {"head": lambda h: b"\xff\xfe" + json.dumps(h).encode()}),
        ("head NaN created_at", {"head": _set(["created_at"], float("nan"))}),
        ("head is a list", {"head": lambda h: b"[]"}),
        ("index is a string", {"index": lambda i: b'"dbsync-index"'}),
        ("shard offset outside", {"index": _set_tensor("offset", 1 << 40)}),
        ("shard missing from list", {"index": _set_tensor("shard", 7)}),
        ("tensors is a list of objects", {"index": _set(["tensors"], [{"name": "a"}])}),
        ("a tensor outside the range it names", {"index": _set_tensor("range", 1)}),
        ("ranges overlap", {"index": lambda i: [column.append(column[0])
                                                for column in i["ranges"].values()]}),
    ]
    for field in _HEAD_FIELDS:
        for n, value in enumerate(_WRONG):
            if field == "created_at" and type(value) in (int, float):
                continue  # any finite number is a valid (informational) time
            cases.append((f"head.{field}={n}", {"head": _set([field], value)}))
    for field in _INDEX_FIELDS:
        for n, value in enumerate(_WRONG):
            if field == "adapter" and (value is None or isinstance(value, dict)):
                continue  # null and any object are valid adapters
            if field == "tensors" and value == [] and not columnar:
                continue  # an empty version, in the one-object-per-tensor layout
            cases.append((f"index.{field}={n}", {"index": _set([field], value)}))
    if columnar:
        cases.append(("columns of different lengths",
                      {"index": lambda i: i["tensors"]["name"].pop()}))
    for field in _RANGE_FIELDS:
        for n, value in enumerate(_WRONG):
            cases.append((f"range.{field}={n}", {"index": _set_range(field, value)}))
    for field in _TENSOR_FIELDS + ([] if columnar else ["nbytes"]):
        wrong = _WRONG if field != "shape" else [
            v for v in _WRONG if v not in ([], [1, 2])] + [[-1], ["4"], [True], [4.0], [2**70]]
        for n, value in enumerate(wrong):
            if field == "name" and value == "x":
                continue  # a valid name: the writer is trusted with names and contents
            cases.append((f"tensor.{field}={n}", {"index": _set_tensor(field, value)}))
    return cases


def test_garbled_manifests_raise_format_errors(root):
    with loaded_v1_then_v2(root) as (rx, serving):
        slot_dir = current_slot_dir(root)
        head_path, index_path = os.path.join(root, MANIFEST_FILE), os.path.join(slot_dir,
                                                                                INDEX_FILE)
        good_head, good_index = open(head_path, "rb").read(), open(index_path, "rb").read()
        accepted = []
        for label, edits in _garbled_cases(_columnar(root)):
            write_bytes(head_path, good_head)
            write_bytes(index_path, good_index)
            forge(root, **edits)
            _, exc = bounded(lambda: rx.load(serving))
            if exc is None:
                accepted.append(label)
                continue
            assert isinstance(exc, FormatError), f"{label}: {type(exc).__name__}: {exc}"
            assert len(str(exc)) < 4000, f"{label}: an error message of {len(str(exc))} chars"
        assert not accepted, f"garbled manifests accepted: {accepted}"
        assert_serving(rx, serving, 1, V1, received=len(V1))

        # A few through the command line: one plain line, exit 1, never "a bug in dbsync".
        for _label, edits in _garbled_cases()[:4]:
            write_bytes(head_path, good_head)
            write_bytes(index_path, good_index)
            forge(root, **edits)
            cli_refuses(root, "not valid JSON")

        # A manifest that is a directory.
        os.unlink(head_path)
        os.mkdir(head_path)
        assert "directory" in str(refused(rx.latest_version))
        refused(lambda: rx.load(serving))
        cli_refuses(root, "directory")
        assert_serving(rx, serving, 1, V1, received=len(V1))


# ---- 6. impossible shapes --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**62, 4], [2**40, 2**40], [2**62, 2, 0, 3]],
                         ids=["0x2^64", "stride-overflow", "huge-numel", "zero-then-overflow"])
def test_impossible_shapes_refused_before_apply(root, shape):
    with loaded_v1_then_v2(root) as (rx, serving):
        def add_impossible(index: dict) -> None:
            # after three good tensors: a partial apply would hand those over first
            _append_tensor(index, {"name": "impossible", "dtype": "float32", "shape": shape,
                                   "shard": 0, "offset": 0, "range": -1})

        forge(root, index=add_impossible)
        refused(lambda: rx.load(serving))
        assert_serving(rx, serving, 1, V1, received=len(V1))
        with pytest.raises(FormatError):
            rx.manifest()
        cli_refuses(root)


# ---- 7. inputs -------------------------------------------------------------------------------
def test_truncated_tensordict_source_is_refused_naming_the_file(root, tmp_path):
    from tensordict import TensorDict

    publish(root, V1)
    src = str(tmp_path / "td")
    TensorDict({"w": torch.ones(1000), "layer": {"b": torch.ones(10)}}, batch_size=[]).memmap(src)
    memmap = os.path.join(src, "w.memmap")
    os.truncate(memmap, 100)
    with dbsync.Sender(root) as sender:
        exc = refused(lambda: sender.push(src), InvalidWeightsError)
        assert memmap in str(exc) and "truncated" in str(exc), exc
        assert sender.latest_version() == 1
    result = run_cli("push", src, root)
    assert result.exit_code == 1 and memmap in result.output, result.output
    with dbsync.Receiver(root) as rx:
        assert rx.latest_version() == 1


def test_an_adapter_no_model_could_serve_is_refused_at_push_naming_every_problem(tmp_path):
    """An adapter whose config says r=16 over rank-4 tensors, with a lone lora_A and a name
    PEFT never gives, was published (exit 0) and refused only by each serving engine. What
    holds whatever the model is checked at push time now, every problem in one refusal,
    before the store is touched."""
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 16, "target_modules": ["q_proj", "v_proj"]}')
    layer = "base_model.model.model.layers.0.self_attn"
    save_file({f"{layer}.q_proj.lora_A.weight": torch.zeros(4, 8),
               f"{layer}.q_proj.lora_B.weight": torch.zeros(8, 4),
               f"{layer}.v_proj.lora_A.weight": torch.zeros(16, 8),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 8)},
              str(adapter / "adapter_model.safetensors"))
    store = tmp_path / "store"
    result = run_cli("push", str(adapter), str(store))
    assert result.exit_code == 1, result.output
    for named in ("3 problem(s)", "model.layers.0.self_attn.q_proj: lora_A rank 4 != the "
                  "config's r 16", "model.layers.0.self_attn.v_proj: has lora_A without its "
                  "pair", "model.layers.0.mlp.up_proj.weight: not a PEFT LoRA weight"):
        assert named in result.output, (named, result.output)
    assert not store.exists()
    with dbsync.Sender(str(store)) as sender:
        with pytest.raises(dbsync.InvalidWeightsError, match="cannot be served on any model"):
            sender.push(str(adapter))
        assert sender.latest_version() is None
        # (the refused adapter left its kind behind: "holds adapter versions" for weights)
        assert sender.push({"w": torch.ones(3)}) == 1


def test_a_rank_pattern_that_would_match_for_ever_is_refused_at_once(tmp_path):
    """``rank_pattern`` keys are regular expressions to PEFT. A key such as ``(a|a)+b``
    against a module named ``layers.aaa...a`` took time doubling with each letter: a push
    hung before any I/O, and so would every server reading that config from the store. Such
    keys are refused now, with the plain names to use instead."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"],
         "rank_pattern": {"(a|a)+b": 4}}))
    module = "base_model.model.layers." + "a" * 40
    save_file({f"{module}.lora_A.weight": torch.zeros(4, 8),
               f"{module}.lora_B.weight": torch.zeros(8, 4)},
              str(adapter / "adapter_model.safetensors"))
    store = tmp_path / "store"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cli.main", "push", str(adapter), str(store)],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stdout + result.stderr
    assert "'(a|a)+b' repeat a group" in result.stderr, result.stderr
    assert not store.exists()


def test_tensordict_source_keys_never_name_files_outside_it(root, tmp_path):
    """A tensordict directory's meta.json is data: a key such as "../outside" or an absolute
    path published a file outside the directory under that name, a key holding NUL and a
    zero-element shape past torch's strides each gave "this is a bug in dbsync". Now every
    one is a problem named in the one refusal, and nothing is published."""
    import json

    from tensordict import TensorDict

    publish(root, V1)
    src = tmp_path / "td"
    TensorDict({"w": torch.ones(4)}, batch_size=[]).memmap(str(src))
    secret = tmp_path / "secret.memmap"
    secret.write_bytes(b"SECRET!!")
    (tmp_path / "outside.memmap").write_bytes(b"OUTSIDE!")
    (src / "huge.memmap").write_bytes(b"")
    meta = json.loads((src / "meta.json").read_text())
    leaves = meta["leaves"] if "leaves" in meta else meta
    entry = dict(leaves["w"], dtype="torch.uint8", shape=[8])
    leaves.update({"../outside": entry, str(tmp_path / "secret"): entry, "a\0b": entry,
                   "huge": dict(entry, shape=[0, 2**61, 2**61])})
    (src / "meta.json").write_text(json.dumps(meta))
    with dbsync.Sender(root) as sender:
        exc = refused(lambda: sender.push(str(src)), InvalidWeightsError)
        for named in ("'../outside'", repr(str(tmp_path / "secret")), "'a\\x00b'",
                      "huge: shape [0, 2305843009213693952, 2305843009213693952] cannot be "
                      "held by torch"):
            assert named in str(exc), (named, str(exc))
        assert "bug" not in str(exc)
        assert sender.latest_version() == 1
    result = run_cli("push", str(src), root)
    assert result.exit_code == 1 and "../outside" in result.output, result.output
    assert "bug" not in result.output


@pytest.mark.parametrize("fifo", ["meta.json", "w.memmap", "layer/meta.json"])
def test_tensordict_source_fifos_never_block(root, tmp_path, fifos, fifo):
    from tensordict import TensorDict

    publish(root, V1)
    src = str(tmp_path / "td")
    TensorDict({"w": torch.ones(10), "layer": {"b": torch.ones(10)}}, batch_size=[]).memmap(src)
    path = os.path.join(src, fifo)
    os.unlink(path)
    os.mkfifo(path)
    fifos.append(path)
    with dbsync.Sender(root) as sender:
        exc = refused(lambda: sender.push(src), InvalidWeightsError)
        assert path in str(exc) or os.path.dirname(path) in str(exc), exc
        assert sender.latest_version() == 1


@pytest.mark.parametrize("source", ["w.safetensors", "w.pt", "ckpt/model.safetensors.index.json",
                                    "ckpt/b.safetensors"])
def test_checkpoint_fifos_never_block(root, tmp_path, fifos, source):
    from safetensors.torch import save_file

    publish(root, V1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"a": torch.ones(2)}, str(ckpt / "a.safetensors"))
    path = str(tmp_path / source)
    os.mkfifo(path)
    fifos.append(path)
    pushed = path if not source.startswith("ckpt/") else str(ckpt)
    with dbsync.Sender(root) as sender:
        exc = refused(lambda: sender.push(pushed), InvalidWeightsError)
        assert path in str(exc) and "regular file" in str(exc), exc
        assert sender.latest_version() == 1


def test_every_bad_key_is_listed_whatever_its_encoding(root):
    publish(root, V1)
    bad = {"ok": torch.ones(1), "lone\udc80surrogate": torch.ones(1), "": torch.ones(1),
           "nul\x00": torch.ones(1), "lr": 0.1, "\udcff": "text"}
    with dbsync.Sender(root) as sender:
        exc = refused(lambda: sender.push(bad), InvalidWeightsError)
        message = str(exc)
        message.encode("utf-8")  # the error itself is printable anywhere
        assert "lone surrogate" in message, message
        lines = [line.strip() for line in message.splitlines()[1:]]
        for key in [k for k in bad if k != "ok"]:  # each listed once, quoted or plain
            assert sum(line.startswith((f"{ascii(key)}:", f"{key}:")) for line in lines) == 1, (
                ascii(key), message)
        assert len(lines) == 5 and "is a float" in message, message
        assert sender.latest_version() == 1


@pytest.mark.parametrize("blocking", [True, False])
def test_conj_and_neg_views_round_trip(root, blocking):
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)
    r = torch.arange(6.0).reshape(2, 3)
    weights = {"conj": z.conj(), "neg": torch._neg_view(r), "conj_neg": torch._neg_view(z.conj()),
               "conj_t": z.reshape(2, 2).conj().t()}
    assert weights["conj"].is_conj() and weights["neg"].is_neg()
    expected = {n: t.resolve_conj().resolve_neg().clone() for n, t in weights.items()}
    with dbsync.Sender(root) as sender:
        result = sender.push(weights, blocking=blocking)
        version = result if blocking else result.result(timeout=BOUND_S)
    assert version == 1
    got: dict[str, torch.Tensor] = {}
    with dbsync.Receiver(root) as rx:
        rx.load(lambda pairs: got.update((n, t.clone()) for n, t in pairs))
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
        assert not got[name].is_conj() and not got[name].is_neg(), name


def test_fp8_versions_open_as_a_tensordict(root):
    weights = {"layer.w": torch.randn(4, 8).to(torch.float8_e4m3fn),
               "layer.s": torch.randn(3).to(torch.float8_e5m2),
               "bias": torch.randn(5, dtype=torch.bfloat16)}
    publish(root, weights)
    with dbsync.Receiver(root) as rx, rx.open() as snap:
        snap.verify()
        td = snap.tensordict()
        assert set(td.keys()) == set(weights)
        for name, tensor in weights.items():
            assert td[name].dtype == tensor.dtype, name
            assert torch.equal(td[name].view(torch.uint8), tensor.view(torch.uint8)), name


# ---- 8. permissions --------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0, 0o077])
def test_store_modes_ignore_the_umask(root, umask):
    """Every directory 0755 and every file 0644, writer.lock included (it followed a 077
    umask: 0600)."""
    old = os.umask(umask)
    try:
        publish(root, V1)
        publish(root, V2)
        with dbsync.Receiver(root, reader_id="reader") as rx:
            rx.load(lambda pairs: None)
            modes = {}
            for directory, dirs, files in os.walk(root):
                for name in dirs + files:
                    path = os.path.join(directory, name)
                    modes[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    finally:
        os.umask(old)
    assert {"slots", "readers", "slots/a", "slots/b", MANIFEST_FILE, "writer.lock",
            "readers/reader.json", "slots/a/index.json"} <= set(modes), sorted(modes)
    wrong = {p: oct(m) for p, m in modes.items()
             if m != (0o755 if os.path.isdir(os.path.join(root, p)) else 0o644)}
    assert not wrong, wrong



_GOOD_COLUMNS = {"name": ["a", "b", "c"], "dtype": ["float32", "bfloat16", "int8"],
                 "shape": [[2, 3], [4], []], "shard": [0, 0, 1], "offset": [0, 64, 0],
                 "range": [0, 0, 1]}
_GOOD_RANGES = {"shard": [0, 1], "offset": [0, 0], "nbytes": [72, 1],
                "checksum": ["0123456789abcdef"] * 2}


@pytest.mark.parametrize("column, row, value", [
    ("range", 1, 1), ("range", 1, -1), ("range", 1, 2), ("range", 1, True), ("range", 0, "0"),
    ("shape", 0, [True, 3]), ("shape", 0, [-1, 3]), ("shape", 0, [2.0, 3]), ("shape", 0, "ab"),
    ("shape", 0, [2**40, 2**40]), ("offset", 1, -64), ("offset", 1, 65), ("offset", 0, False),
    ("offset", 1, 128), ("shard", 2, 2), ("shard", 2, -1), ("shard", 0, False),
    ("dtype", 0, ["x"]), ("dtype", 0, "float99"), ("name", 1, "a"), ("name", 1, ""),
    ("name", 1, "a\x00"), ("name", 1, 7),
])
def test_every_garbled_index_column_is_named_whatever_the_parse_path(column, row, value):
    """The index is read by a whole-column fast path; whatever it lets through must be
    exactly what the per-tensor checks accept. One bad cell: refused, and named."""
    from dbsync.format import Index, dump_index

    good = dump_index("0" * 32, 1, _GOOD_COLUMNS, _GOOD_RANGES, [128, 64], None)
    assert [e.name for e in Index.loads(good).tensors] == ["a", "b", "c"]
    columns = json.loads(json.dumps(_GOOD_COLUMNS))
    columns[column][row] = value
    with pytest.raises(FormatError, match=rf"index.json is invalid: tensors\[{row}\]"):
        Index.loads(dump_index("0" * 32, 1, columns, _GOOD_RANGES, [128, 64], None))


@pytest.mark.parametrize("column, row, value", [
    ("checksum", 1, "0123456789ABCDEF"), ("checksum", 1, "0123456789abcde"),
    ("checksum", 1, "0123456789abcdef0"), ("checksum", 1, "0123456789abcde "),
    ("checksum", 1, "0123456789abcdeg"), ("checksum", 1, 5), ("shard", 1, 2),
    ("shard", 1, -1), ("shard", 1, False), ("offset", 1, 64), ("nbytes", 0, 129),
    ("nbytes", 1, -1), ("offset", 1, 1.0),
])
def test_every_garbled_checked_range_is_named(column, row, value):
    """The checked ranges must lie inside their shards, in order, never overlapping, each with
    a well-formed checksum; one bad cell is refused and named (also on the short path taken
    for the next version of a layout already read)."""
    from dbsync.format import Index, dump_index

    good = dump_index("0" * 32, 1, _GOOD_COLUMNS, _GOOD_RANGES, [128, 64], None)
    assert len(Index.loads(good).ranges) == 2  # (now remembered for the short path)
    ranges = json.loads(json.dumps(_GOOD_RANGES))
    ranges[column][row] = value
    with pytest.raises(FormatError, match=rf"index.json is invalid: ranges\[{row}\]"):
        Index.loads(dump_index("0" * 32, 1, _GOOD_COLUMNS, ranges, [128, 64], None))


def _index_outcome(raw: bytes) -> Any:
    """What ``Index.loads`` makes of ``raw``: the index's fields, or the error's type and
    message."""
    from dbsync.format import Index

    try:
        index = Index.loads(raw)
    except dbsync.DBSyncError as exc:
        return type(exc).__name__, str(exc)
    return (index.run_id, index.version, index.tensors, index.shards, index.ranges,
            index.adapter)


def test_an_index_whose_tensors_section_was_read_before_is_judged_as_a_fresh_parse(
        monkeypatch):
    """The next version of a model repeats the last index's tensors section byte for byte,
    and is read by comparing those bytes and parsing only what comes before them. Whatever
    comes before (cut anywhere, bytes changed, an unclosed string, object or array, another
    "tensors" member, shards or ranges the kept tensors do not fit), the outcome equals that
    of a reader that never saw the earlier index, and that of parsing the whole file; so is
    any other tensors section after the same beginning."""
    import random

    from dbsync import format as fmt

    good = fmt.dump_index("0" * 32, 1, _GOOD_COLUMNS, _GOOD_RANGES, [128, 64], None)
    tail = good[good.rindex(b',"tensors":'):]
    assert good.endswith(b"}}") and tail.count(b'"name"') == 1  # (the tensors come last)
    prefix = good[:-len(tail)]
    rng = random.Random(7)

    def mutate(data: bytes) -> bytes:
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(mutated))
            choice = rng.random()
            if choice < 0.4:
                mutated[at] = rng.choice(b'{}[]",:0123456789\\ ax')
            elif choice < 0.7:
                del mutated[at]
            else:
                mutated.insert(at, rng.choice(b'{}[]",:0\\'))
        return bytes(mutated)

    # other tensors sections after the same beginning: never taken for the kept one
    tails = [tail[:-1] + extra for extra in (b',"x":1}', b',"x":}', b'}}', b' }', b'} ', b'')]
    tails += [tail.replace(b'"a"', b'"z"'), tail.replace(b'[2,3]', b'[2,4]'),
              tail.replace(b'"offset":[0,64,0]', b'"offset":[0,128,0]')]
    tails += [mutate(tail) for _ in range(60)]
    # a member after the tensors (a second adapter), an invalid UTF-8 surrogate in a name, an
    # extra member nested deeper than the parser allows and one nested less deep (either way
    # on every path; nesting right at the recursion limit depends on the stack: not tested)
    tails += [tail[:-1] + b',"adapter":{"r":1}}', tail.replace(b'"a"', b'"\xed\xa0\x80"'),
              tail[:-2] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}}",
              tail[:-2] + b',"x":' + b"[" * 200 + b"]" * 200 + b"}}"]
    variants = [prefix[:cut] for cut in range(len(prefix))]
    variants += [prefix + extra for extra in (
        b'"', b'{', b'[', b',"x":{', b',"x":[', b',"x":"', b'\\', b',"tensors":5',
        b',"x":{"y":1')]
    variants.append(prefix.replace(b'"adapter":null', b'"adapter":{"a":1}'))
    variants.append(prefix.replace(b'"adapter":null', b'"tensors":0,"adapter":null'))
    variants.append(prefix.replace(b'"nbytes":128', b'"nbytes":64'))  # tensor b leaves its shard
    variants.append(prefix.replace(b'"nbytes":[72,1]', b'"nbytes":[64,1]'))  # b leaves range 0
    variants.append(prefix.replace(b'"nbytes":[72,1]', b'"nbytes":[80,1]'))  # wider: still holds
    variants.append(prefix.replace(b'"version":1', b'"version":2'))  # the next version
    variants += [mutate(prefix) for _ in range(300)]

    def forget() -> None:
        for memo in (fmt._LAST_TENSORS, fmt._LAST_RANGES):
            memo[0] = None

    short_path_taken = 0
    for raw in [v + tail for v in variants] + [prefix + t for t in tails]:
        forget()
        fmt.Index.loads(good)  # the tensors section is now known
        kept = fmt._LAST_TENSORS[0]
        assert kept is not None and kept.tail == tail
        warm = _index_outcome(raw)
        short_path_taken += len(warm) == 6 and warm[2] is kept.entries
        forget()
        cold = _index_outcome(raw)
        with monkeypatch.context() as patch:
            patch.setattr(fmt, "_split_tensors_last", lambda raw: None)
            forget()
            whole = _index_outcome(raw)
        assert warm == cold == whole, raw
    assert short_path_taken >= 3  # the next version, a wider range, another adapter config


def test_range_problems_are_named_alone_and_no_tensor_may_name_an_unlisted_shard():
    """A refused range does not shift the others into follow-on complaints about good
    tensors; a tensor of no bytes in an index listing no shard is refused on every parse path
    (it would otherwise reach the reader as a shard that is not there)."""
    from dbsync.format import Index, dump_index

    ranges = json.loads(json.dumps(_GOOD_RANGES))
    ranges["checksum"][0] = "not hex"
    with pytest.raises(FormatError) as err:
        Index.loads(dump_index("0" * 32, 1, _GOOD_COLUMNS, ranges, [128, 64], None))
    assert "ranges[0].checksum" in str(err.value) and "tensors[" not in str(err.value)

    empty = {"name": ["e"], "dtype": ["float32"], "shape": [[0]], "shard": [0], "offset": [0],
             "range": [-1]}
    no_ranges = {"shard": [], "offset": [], "nbytes": [], "checksum": []}
    with pytest.raises(FormatError, match=r"tensors\[0\]\.shard 0 is not a listed shard"):
        Index.loads(dump_index("0" * 32, 1, empty, no_ranges, [], None))
    empty["name"] = ["\u00e9"]  # (a non-ASCII name takes the per-tensor path)
    with pytest.raises(FormatError, match=r"tensors\[0\]\.shard 0 is not a listed shard"):
        Index.loads(dump_index("0" * 32, 1, empty, no_ranges, [], None))


def test_hard_linked_shards_are_never_written_through(root):
    """A deduplicating tool (``hardlink``, ``rdfind -makehardlinks``, ``jdupes -L``) linked the
    two slots' identical shards into one file. The next push into slot a writes a new file:
    a reader holding version 2 in slot b keeps reading version 2's bytes, and the version
    after loads whole."""
    ones = {"w": torch.ones(1 << 18), "v": torch.ones(1 << 18)}
    with dbsync.Sender(root) as sender:
        sender.push(ones)
        sender.push(ones)
        a = os.path.join(root, "slots", "a", shard_file(0))
        b = os.path.join(root, "slots", "b", shard_file(0))
        os.unlink(b)
        os.link(a, b)  # the dedup pass
        with dbsync.Receiver(root) as receiver, receiver.open() as snap:
            assert snap.version == 2
            assert sender.push({k: torch.full_like(t, 7.0) for k, t in ones.items()}) == 3
            held = {name: t.clone() for name, t in snap.tensors()}
            snap.check_unchanged()
        assert all(torch.equal(t, ones[name]) for name, t in held.items())
        assert os.stat(b).st_nlink == 1 and os.stat(a).st_ino != os.stat(b).st_ino
        dest = {k: torch.zeros_like(t) for k, t in ones.items()}
        with dbsync.Receiver(root) as receiver:
            assert receiver.load(dest) == 3
        assert all(torch.equal(t, torch.full_like(t, 7.0)) for t in dest.values())


@pytest.mark.parametrize("where", ["lease", "stamp", "older-format head"])
def test_impossible_versions_in_damaged_files_never_number_a_push(root, where):
    """A lease reporting version 2**100 loaded, a stamp naming it (the head's slot rewritten
    since, as after a restore), or an older format's head naming version -5: the next push
    publishes a version every reader accepts, after the store's own, and says which file it
    ignored."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(4)})
        run = sender.run_id
    store = Store(root)
    if where == "lease":
        store.write_lease("damaged", {"reader_id": "damaged", "host": "elsewhere", "pid": 7,
                                      "held": [], "loaded_version": 2**100,
                                      "loaded_run_id": run, "beat": 1,
                                      "updated_at": time.time()})
    elif where == "stamp":
        store.write_stamp("a", 2**100, run, durable=False)
    else:
        head = json.loads(open(os.path.join(root, MANIFEST_FILE), "rb").read())
        head.update(format_version=2, version=-5)
        write_bytes(os.path.join(root, MANIFEST_FILE), json.dumps(head).encode())
    with dbsync.Sender(root) as sender:
        pushed = sender.push({"w": torch.full((4,), 2.0)})
    assert pushed == (1 if where == "older-format head" else 2)
    with dbsync.Receiver(root) as receiver:
        assert receiver.latest_version() == pushed
        dest = {"w": torch.zeros(4)}
        assert receiver.load(dest) == pushed and torch.equal(dest["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("read_only", [True, False], ids=["leaseless", "leased"])
@pytest.mark.parametrize("stamp", ["missing", "another version", "writing"])
def test_a_current_slot_stamped_otherwise_is_refused_at_once(root, stamp, read_only):
    """The head names slot a, whose stamp is gone or names something else, and the head does
    not move: a leaseless reader (a read-only view) refuses the version as damaged, naming the
    stamp, instead of copying the version again and again as if a writer were reusing the slot;
    a leased reader refuses it the same way (it said "lease expired ... load again", and
    serve-vllm retried it forever). Nothing is applied."""
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(4)})
        run = sender.run_id
    path = os.path.join(root, "slots", "a", SLOT_STAMP_FILE)
    if stamp == "missing":
        os.unlink(path)
    else:
        Store(root).write_stamp("a", 7 if stamp == "another version" else "writing", run,
                                durable=False)
    applied: list[Any] = []
    with dbsync.Receiver(root, read_only=read_only) as receiver:
        with pytest.raises(DamagedVersionError, match="stamp") as raised:
            receiver.load(applied.append)
    assert applied == [] and "<slot stamp>" in raised.value.damaged
    assert path in str(raised.value)


def test_a_listed_shard_no_checked_range_covers_is_never_copied(root):
    """A forged index lists one more shard, of 1 GiB (a sparse file: nothing on disk), that
    no tensor or checked range uses: a leaseless reader copies only what its checked ranges
    cover, not what the file claims."""
    publish(root, {"w": torch.ones(4)})

    def extra_shard(index: dict) -> None:
        index["shards"].append({"file": shard_file(1), "nbytes": 1 << 30})

    forge(root, index=extra_shard)
    with open(os.path.join(current_slot_dir(root), shard_file(1)), "wb") as f:
        f.truncate(1 << 30)
    got: dict[str, torch.Tensor] = {}
    with dbsync.Receiver(root, read_only=True) as receiver:
        tracemalloc.start()
        try:
            assert receiver.load(lambda pairs: got.update((k, v.clone()) for k, v in pairs)) == 1
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert torch.equal(got["w"], torch.ones(4))
    assert peak < 64 << 20, f"the load allocated {peak} bytes"


@pytest.mark.parametrize("target", [MANIFEST_FILE, "writer.lock", "index"])
def test_sockets_and_directories_in_place_of_records_are_named(root, target):
    """A Unix socket in place of the head, the current index or the writer lock, and a
    directory in place of the head or the lock: readers and the writer name the path and what
    stands there (as for symlinks and FIFOs), and a refused push writes nothing."""
    import socket

    publish(root, {"w": torch.ones(4)})
    path = (os.path.join(current_slot_dir(root), INDEX_FILE) if target == "index"
            else os.path.join(root, target))

    def files() -> dict[str, int]:
        return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns
                for d, _, names in os.walk(os.path.join(root, "slots")) for n in names}

    os.unlink(path)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(path)
        if target == "writer.lock":
            error = refused(lambda: dbsync.Sender(root).close())
        else:
            error = refused(lambda: dbsync.Receiver(root, read_only=True).load(lambda p: None))
        assert f"{path} is a socket or device, not a regular file" in str(error)
    finally:
        sock.close()
    if target == "index":
        return
    os.unlink(path)
    os.mkdir(path)
    before = files()
    error = refused(lambda: dbsync.Sender(root).close(), cls=DBSyncError)
    assert f"{path} is a directory" in str(error)
    assert files() == before


def test_an_enormous_tensor_name_is_shown_cut_short_in_a_refusal(tmp_path):
    """A store whose tensor name is 100,000 characters long, loaded into a model without it:
    the refusal names it cut short (saying how long it was), so logs, status fields and
    leases do not carry the whole name (*)."""
    root = str(tmp_path / "store")
    with dbsync.Sender(root) as sender:
        sender.push({"x" * 100_000: torch.ones(2)})
    with dbsync.Receiver(root) as rx, pytest.raises(dbsync.IncompatibleWeightsError) as err:
        rx.load(torch.nn.Linear(2, 2))
    text = str(err.value)
    assert len(text) < 2_000, len(text)
    assert "(100000 characters)" in text and "bias" in text and "weight" in text


def test_a_terabyte_sparse_shard_the_index_agrees_with_maps_only_what_its_tensors_use(root):
    """A store whose shard was grown to 1 TB (sparse, its bytes intact) with an index that
    agrees: a leased load maps only the bytes its checked ranges cover and loads the
    weights, instead of failing to map 1 TB and blaming this host's memory (*)."""
    weights = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, 5)}
    publish(root, weights)
    shard = os.path.join(current_slot_dir(root), "shard-00000.bin")
    os.truncate(shard, 1 << 40)

    def grow(index: dict) -> None:
        index["shards"][0]["nbytes"] = 1 << 40

    forge(root, index=grow)
    got: dict[str, torch.Tensor] = {}
    with dbsync.Receiver(root) as rx:
        assert rx.load(lambda pairs: got.update({n: t.clone() for n, t in pairs})) == 1
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def test_an_index_that_lost_tensors_the_head_counts_is_refused(root):
    """A forged index (its checksum in the head made to match) that leaves tensors out: the
    head still counts them, so readers and `dbsync verify` refuse the version as damaged
    instead of loading or passing a smaller one (*)."""
    publish(root, {"a": torch.ones(64), "b": torch.zeros(3, 5)})

    def drop_all(index: dict) -> None:
        tensors = index["tensors"]
        for values in tensors.values():
            del values[:]

    forge(root, index=drop_all)
    applied: list[Any] = []
    with dbsync.Receiver(root) as rx:
        error = refused(lambda: rx.load(lambda pairs: applied.extend(pairs)))
    assert "lists 0 tensor(s) of 0 bytes, but the head of version 1 says 2 of" in str(error)
    assert applied == []
    cli_refuses(root, "lists 0 tensor(s)", "publish again")


@pytest.mark.parametrize("field, value", [("slot", "c"), ("version", -1), ("run_id", "x"),
                                          ("kind", "nope"), ("format", "nope")])
def test_an_invalid_head_says_what_to_do(root, field, value):
    """Every refusal of a garbled head says what to do, as the index's do."""
    publish(root, {"a": torch.ones(4)})
    forge(root, head=_set([field], value))
    with dbsync.Receiver(root) as rx:
        error = refused(lambda: rx.load(lambda pairs: None))
    assert "publish again from the trainer" in str(error), error
