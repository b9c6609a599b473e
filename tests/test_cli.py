"""The ``dbsync`` command line, driven with real files: what it publishes (the bytes, the
version), what it refuses (and that a refused push changes nothing), and its exit codes."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import dbsync
from cli.main import cli
from dbsync.format import MANIFEST_FILE
from dbsync.store import Store
from tests.fleet_mounts import needs_root, read_only_view

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- helpers -------------------------------------------------------------------------------
@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "store")


def run(*args: str):
    result = CliRunner().invoke(cli, list(args))
    # Failures must be plain messages: SystemExit, never an escaped exception.
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        result.exception)
    assert "Traceback" not in result.output
    return result


def published(root: str) -> dict[str, torch.Tensor]:
    """The current version's tensors, copied out through a Receiver (verified)."""
    out: dict[str, torch.Tensor] = {}
    with dbsync.Receiver(root) as rx:
        rx.load(lambda pairs: out.update((n, t.clone()) for n, t in pairs))
    return out


def current_version(root: str) -> int | None:
    manifest = Store(root).read_manifest()
    return None if manifest is None else manifest.version


def shard_path(root: str, name: str) -> tuple[str, int]:
    """(path of the shard file holding tensor ``name``, the tensor's offset in it)."""
    store = Store(root)
    manifest = store.require_manifest()
    entry = manifest.entry(name)
    return os.path.join(store.slot_dir(manifest.slot), f"shard-{entry.shard:05d}.bin"), \
        entry.offset


def manifest_bytes(root: str) -> bytes:
    with open(os.path.join(root, MANIFEST_FILE), "rb") as f:
        return f.read()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                ordered: bool = False) -> None:
    """Same names (in the same order if ``ordered``), dtypes and values."""
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.bias": torch.randn(8, generator=g),
        "lm_head.step": torch.arange(5, dtype=torch.int64),
    }


@pytest.fixture
def st_file(tmp_path, weights) -> str:
    path = str(tmp_path / "model.safetensors")
    save_file(weights, path)
    return path


@pytest.fixture
def store_v1(root, st_file) -> str:
    result = run("push", st_file, root)
    assert result.exit_code == 0, result.output
    return root


# ---- push: good sources --------------------------------------------------------------------
def test_push_safetensors_prints_versions_and_publishes_the_bytes(root, st_file, weights):
    first = run("push", st_file, root)
    assert first.exit_code == 0, first.output
    assert first.stdout.strip() == "1"
    assert "published version 1" in first.stderr
    assert_same(published(root), weights)
    second = run("push", st_file, root, "--threads", "2")
    assert second.exit_code == 0 and second.stdout.strip() == "2"
    assert current_version(root) == 2
    assert_same(published(root), weights)


def test_push_sharded_hf_directory_in_index_order(root, tmp_path, weights):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    names = list(weights)
    shards = {"model-00001-of-00002.safetensors": names[2:], "model-00002-of-00002.safetensors":
              names[:2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(ckpt / shard))
        weight_map.update((k, shard) for k in keys)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (ckpt / "config.json").write_text("{}")
    result = run("push", str(ckpt), root)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "1"
    assert_same(published(root), {k: weights[k] for k in weight_map}, ordered=True)


def test_push_torch_state_dict_with_dtype_conversion(root, tmp_path, weights):
    path = str(tmp_path / "model.pt")
    torch.save(weights, path)
    result = run("push", path, root, "--dtype", "fp16")
    assert result.exit_code == 0, result.output
    want = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()}
    assert_same(published(root), want)


def test_push_tensordict_memmap_directory(root, tmp_path):
    from tensordict import TensorDict

    td = TensorDict({"encoder": {"w": torch.randn(3, 4)}, "head": torch.ones(2)}, [])
    td.memmap(str(tmp_path / "td"))
    result = run("push", str(tmp_path / "td"), root, "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    got = published(root)
    assert sorted(got) == ["encoder.w", "head"]
    assert torch.equal(got["encoder.w"], td["encoder", "w"].to(torch.bfloat16))
    assert torch.equal(got["head"], torch.ones(2, dtype=torch.bfloat16))


def test_traversal_looking_names_stay_inside_the_slot(root, tmp_path):
    evil = {"../../../escaped": torch.full((4,), 7.0), "/etc/passwd": torch.full((2,), 3.0),
            "a/../../b": torch.arange(3), ".hidden": torch.zeros(1)}
    src = str(tmp_path / "evil.safetensors")
    save_file(evil, src)
    before = sorted(os.listdir(tmp_path))
    result = run("push", src, root)
    assert result.exit_code == 0, result.output
    # Nothing appeared next to the store or above it; every tensor file is in the slot dir.
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "store"])
    slot = Store(root).require_manifest().slot
    assert sorted(os.listdir(os.path.join(root, "slots", slot))) == [
        "dbsync-published.json", "dbsync-slot.json", "index.json", "shard-00000.bin"]
    got = published(root)
    assert sorted(got) == sorted(evil)
    for name, tensor in evil.items():
        assert torch.equal(got[name], tensor), name
    assert run("verify", root).exit_code == 0


# ---- push: bad sources ---------------------------------------------------------------------
def assert_untouched(root: str, before: bytes, weights: dict[str, torch.Tensor]) -> None:
    assert manifest_bytes(root) == before
    assert current_version(root) == 1
    assert_same(published(root), weights)


def test_push_corrupt_safetensors_fails_and_changes_nothing(store_v1, tmp_path, weights):
    before = manifest_bytes(store_v1)
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00" + b"{not json at all, just garbage}")
    result = run("push", str(bad), store_v1)
    assert result.exit_code == 1
    assert str(bad) in result.stderr and "safetensors" in result.stderr
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) <= 2
    assert_untouched(store_v1, before, weights)


def test_push_truncated_safetensors_fails(store_v1, st_file, tmp_path, weights):
    before = manifest_bytes(store_v1)
    data = open(st_file, "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 10])
    result = run("push", str(cut), store_v1)
    assert result.exit_code == 1
    assert str(cut) in result.stderr
    assert_untouched(store_v1, before, weights)


def test_push_missing_file_fails_without_creating_root(tmp_path):
    root = str(tmp_path / "new-store")
    missing = str(tmp_path / "nope.safetensors")
    result = run("push", missing, root)
    assert result.exit_code == 1
    assert missing in result.stderr and "does not exist" in result.stderr
    assert not os.path.exists(root)


def _bad_index(weight_map):
    def make(d, weights):
        save_file(weights, str(d / "model-1.safetensors"))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return make


def _peft_with_bad_config(d, weights):
    save_file({"base_model.model.l.lora_A.weight": torch.ones(2, 4)},
              str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text("{not json")


def _deeply_nested_index(d, weights):  # (was a RecursionError: "a bug in dbsync")
    save_file(weights, str(d / "model-1.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _one_name_in_two_files(d, weights):  # (said only "'a': appears twice")
    save_file(weights, str(d / "model.safetensors"))
    save_file(weights, str(d / "model-old.safetensors"))


def _only_a_bin(d, weights):
    torch.save(weights, str(d / "pytorch_model.bin"))


def _bin_shards(d, weights):
    for k in (1, 2):
        torch.save(weights, str(d / f"pytorch_model-0000{k}-of-00002.bin"))


def _a_store(d, weights):  # (`dbsync push ROOT SRC`: the arguments swapped)
    with dbsync.Sender(str(d)) as sender:
        sender.push(weights)


def _a_training_checkpoint(d, weights):  # (the file itself is pushed)
    torch.save({"model": weights, "step": 3}, str(d / "checkpoint.pt"))
    return d / "checkpoint.pt"


@pytest.mark.parametrize("make, said", [
    (_bad_index(["model-1.safetensors"]), "weight_map is a list, not an object"),
    (_bad_index({"a": ["model-1.safetensors"]}), "maps to \"['model-1.safetensors']\""),
    (_bad_index({"a": 5}), "maps to '5', not a file name"),
    (_bad_index({"a": "../model-1.safetensors"}), "not a file of the checkpoint's own"),
    (_peft_with_bad_config, "adapter_config.json is not readable JSON"),
    (_deeply_nested_index, "model.safetensors.index.json is not a valid index (RecursionError"),
    (_one_name_in_two_files, "(model-old.safetensors and model.safetensors)"),
    (_only_a_bin, "push that file itself (dbsync push "),
    (_bin_shards, "shards of one model: convert the checkpoint to safetensors"),
    (_a_store, "It is a dbsync store: is ROOT given as SRC?"),
    (_a_training_checkpoint, "a training checkpoint? publish its model's state_dict alone"),
])
def test_push_of_a_bad_directory_says_why_and_creates_no_root(tmp_path, weights, make, said):
    src = tmp_path / "src"
    src.mkdir()
    pushed = make(src, weights) or src
    root = str(tmp_path / "new-store")
    result = run("push", str(pushed), root)
    assert result.exit_code == 1
    assert said in result.stderr and "bug in dbsync" not in result.stderr, result.stderr
    assert not os.path.exists(root)  # checked before ROOT is touched


def test_push_of_a_legacy_format_torch_file(root, tmp_path, weights):
    """Saved with _use_new_zipfile_serialization=False (older trainers): it cannot be
    memory-mapped, and is read instead."""
    path = str(tmp_path / "legacy.pt")
    torch.save(weights, path, _use_new_zipfile_serialization=False)
    result = run("push", path, root)
    assert result.exit_code == 0, result.output
    assert_same(published(root), weights)


def test_push_non_tensor_entries_named_and_nothing_published(store_v1, tmp_path, weights):
    before = manifest_bytes(store_v1)
    path = str(tmp_path / "ckpt.pt")
    torch.save({"w": torch.ones(2), "step": 10, "optimizer": {"lr": 0.1}}, path)
    result = run("push", path, store_v1)
    assert result.exit_code == 1
    assert "'step'" in result.stderr and "'optimizer'" in result.stderr
    assert "nothing was written" in result.stderr
    assert_untouched(store_v1, before, weights)


class _RunsCode:
    """Pickles to a call of os.mkdir: loading it without weights_only would run it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_push_pickle_with_code_is_refused_and_code_never_runs(store_v1, tmp_path, weights):
    before = manifest_bytes(store_v1)
    marker = str(tmp_path / "code-ran")
    path = str(tmp_path / "evil.bin")
    torch.save({"w": torch.ones(2), "x": _RunsCode(marker)}, path)
    result = run("push", path, store_v1)
    assert result.exit_code == 1
    assert path in result.stderr and "weights_only" in result.stderr
    assert not os.path.exists(marker)
    assert_untouched(store_v1, before, weights)


def test_push_unknown_file_kind(store_v1, tmp_path, weights):
    path = tmp_path / "weights.npz"
    path.write_bytes(b"PK")
    result = run("push", str(path), store_v1)
    assert result.exit_code == 1
    assert "unknown kind of file" in result.stderr
    assert current_version(store_v1) == 1


def test_push_into_a_file_fails_plainly(tmp_path, st_file):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    result = run("push", st_file, str(target))
    assert result.exit_code == 2  # click refuses a file where a directory is expected
    assert target.read_text() == "x"


@needs_root
def test_push_into_a_read_only_mount_says_so_before_reading_src(store_v1, tmp_path):
    """ROOT (or where it would be created) on a read-only mount: refused at once, saying so
    and where to push from, before SRC is read (here SRC does not even exist: the answer is
    about ROOT)."""
    with read_only_view(os.path.dirname(store_v1), tmp_path / "ro") as view:
        for target in (os.path.join(view, os.path.basename(store_v1)),
                       os.path.join(view, "new", "store")):
            result = run("push", str(tmp_path / "never-read.safetensors"), target)
            assert result.exit_code == 1
            assert "is on a read-only mount" in result.stderr
            assert "push from the trainer's read-write mount" in result.stderr
            assert "Nothing was read or published" in result.stderr
    assert current_version(store_v1) == 1


def test_push_while_another_writer_holds_the_store(store_v1, st_file, weights):
    before = manifest_bytes(store_v1)
    with dbsync.Sender(store_v1):
        result = run("push", st_file, store_v1)
    assert result.exit_code == 1
    assert "another writer holds" in result.stderr and "writer.lock" in result.stderr
    assert_untouched(store_v1, before, weights)


@pytest.mark.parametrize("args", [
    ["push"],
    ["push", "only-src"],
    ["push", "a", "b", "--dtype", "int8"],
    ["push", "a", "b", "--threads", "0"],
    ["push", "a", "b", "--timeout", "3"],
    ["push", "a", "b", "--no-such-flag"],
    ["status"],
    ["verify", "r", "--version", "zero"],
    ["watch", "r", "--count", "0"],
    ["frobnicate"],
])
def test_usage_errors_exit_2(args):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.output or "No such command" in result.output


# ---- push --wait-for -----------------------------------------------------------------------
def test_wait_for_receivers(store_v1, st_file):
    stop = threading.Event()
    loaded: list[int] = []

    def follower() -> None:
        with dbsync.Receiver(store_v1, reader_id="follower") as rx:
            while not stop.is_set():
                if rx.latest_version() != rx.loaded_version:
                    loaded.append(rx.load(lambda pairs: [t.sum() for _, t in pairs]))
                time.sleep(0.05)

    thread = threading.Thread(target=follower)
    thread.start()
    try:
        ok = run("push", st_file, store_v1, "--wait-for", "1", "--timeout", "30")
        assert ok.exit_code == 0, ok.output
        assert ok.stdout.strip() == "2"
        assert "follower" in ok.stderr
        assert Store(store_v1).read_leases()["follower"]["loaded_version"] >= 2
        short = run("push", st_file, store_v1, "--wait-for", "2", "--timeout", "0.5")
        assert short.exit_code == 1
        assert short.stdout.strip() == "3"  # published; only the wait failed
        assert "only 1 of 2" in short.stderr
    finally:
        stop.set()
        thread.join()


# ---- status --------------------------------------------------------------------------------
def test_status_reports_version_and_receivers(store_v1, st_file):
    with dbsync.Receiver(store_v1, reader_id="engine-0") as rx:
        rx.load(lambda pairs: None)
        run("push", st_file, store_v1)
        result = run("status", store_v1, "--json")
        assert result.exit_code == 0, result.output
        info = json.loads(result.stdout)
        assert info["version"] == 2
        assert info["tensors"] == 4 and info["problems"] == {}
        assert info["bytes"] == Store(store_v1).require_manifest().total_bytes
        [receiver] = info["receivers"]
        assert (receiver["id"], receiver["version"], receiver["lag"]) == ("engine-0", 1, 1)
        human = run("status", store_v1)
        assert human.exit_code == 0
        assert "version    2 (slot b)" in human.stdout
        assert "engine-0" in human.stdout and "receivers  1" in human.stdout


def test_status_lists_the_live_receivers_and_counts_dead_ones_past_twenty(store_v1):
    """A store with hundreds or thousands of dead leases (readers of hosts gone for good)
    printed a row and a reason line per dead reader, burying the live engines; the text now
    lists 20 dead receivers and counts the rest (`--all` lists every one; `--json` always
    does)."""
    from cli.main import DEAD_LISTED

    readers = os.path.join(store_v1, "readers")
    with dbsync.Receiver(store_v1, reader_id="engine-0") as rx:
        rx.load(lambda pairs: None)
        record = Store(store_v1).read_leases()["engine-0"]
        an_hour_ago = time.time() - 3600
        for i in range(DEAD_LISTED + 15):
            path = os.path.join(readers, f"gone-host-{i}-4242-0a1b2c3d.json")
            with open(path, "w") as f:
                json.dump(dict(record, host=f"gone-host-{i}", pid=4242, boot_id="other-boot",
                               updated_at=an_hour_ago), f)
            os.utime(path, (an_hour_ago, an_hour_ago))
        # (one that died minutes ago, last by name: listed before those gone for an hour)
        path = os.path.join(readers, "zz-recently-gone.json")
        minutes_ago = time.time() - 300
        with open(path, "w") as f:
            json.dump(dict(record, host="zz-host", pid=4242, boot_id="other-boot",
                           updated_at=minutes_ago), f)
        os.utime(path, (minutes_ago, minutes_ago))
        text = run("status", store_v1).stdout
        every = run("status", store_v1, "--all").stdout
        info = json.loads(run("status", store_v1, "--json").stdout)
    assert f"receivers  {DEAD_LISTED + 17} (1 idle, {DEAD_LISTED + 16} dead)" in text
    assert "engine-0" in text and "... and 16 more dead receivers, seen longer ago" in text
    assert "zz-recently-gone" in text  # (listed: it was seen last)
    assert text.count(" dead: ") == DEAD_LISTED  # (a reason line each, below the table)
    assert every.count(" dead: ") == DEAD_LISTED + 16 and "more dead" not in every
    assert len(info["receivers"]) == DEAD_LISTED + 17


def test_status_does_not_compare_versions_of_two_runs(tmp_path):
    """A store recreated at the same path is a new run: an engine still on the old run's
    version 5 that refused the new run's version 1 is shown refused, with that reason and
    no lag (not "idle" with a lag of -4); a trainer of a later run is not failed by it."""
    root = str(tmp_path / "store")
    with dbsync.Sender(root) as sender:
        for _ in range(5):
            sender.push({"w": torch.ones(4, 4)})
    target = {"w": torch.zeros(4, 4)}
    with dbsync.Receiver(root, reader_id="engine-0", lease_timeout=1.0) as rx:
        assert rx.load(target) == 5
        shutil.rmtree(root)
        with dbsync.Sender(root) as sender:
            sender.push({"w": torch.ones(8, 4)})  # another shape: refused
            new_run = sender.run_id
        with pytest.raises(dbsync.IncompatibleWeightsError):
            rx.load(target)
        info = json.loads(run("status", root, "--json").stdout)
        [engine] = info["receivers"]
        assert engine["state"] == "refused" and engine["lag"] is None
        assert engine["refused"]["version"] == 1 and engine["refused"]["run_id"] == new_run
        assert "refused" in run("status", root).stdout
        shutil.rmtree(root)  # a third run: the second run's refusal is not this run's
        with dbsync.Sender(root) as sender:
            v = sender.push({"w": torch.ones(4, 4)})
            deadline = time.monotonic() + 30  # (its lease, renewed every 0.25 s, comes back)
            while not (listed := json.loads(run("status", root, "--json").stdout)["receivers"]):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert listed[0]["state"] != "refused", listed  # (the second run's refusal)
            assert rx.load(target) == v
            assert sender.wait_for_receivers(v, 1, timeout=5)
        [engine] = json.loads(run("status", root, "--json").stdout)["receivers"]
        assert engine["state"] != "refused" and engine["lag"] == 0 and engine["refused"] is None


def test_status_of_empty_and_missing_stores(tmp_path):
    empty = tmp_path / "empty"
    Store(str(empty), create=True)
    result = run("status", str(empty), "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["version"] is None
    assert "none published yet" in run("status", str(empty)).stdout
    bare = tmp_path / "bare"  # a plain writable directory (a volume not mounted there?):
    bare.mkdir()  # not called a read-only view; said to hold no store files
    info = json.loads(run("status", str(bare), "--json").stdout)
    assert info["leases_writable"] is True and "read-only" not in info["note"]
    text = run("status", str(bare)).stdout
    assert "holds no store files" in text and "check that it is mounted" in text
    missing = str(tmp_path / "missing")
    gone = run("status", missing)
    assert gone.exit_code == 1 and missing in gone.stderr
    gone_json = run("status", missing, "--json")  # a monitoring script still gets JSON
    assert gone_json.exit_code == 1 and "does not exist" in json.loads(gone_json.stdout)["error"]
    assert json.loads(gone_json.stdout)["version"] is None
    a_file = tmp_path / "a-file"  # (not a usage error: still one JSON object, exit 1)
    a_file.write_text("")
    filed = run("status", str(a_file), "--json")
    assert filed.exit_code == 1 and "is a regular file" in json.loads(filed.stdout)["error"]
    watched = run("watch", missing, "--json")  # (watch's lines: one JSON line too)
    assert watched.exit_code == 1 and json.loads(watched.stdout)["version"] is None
    assert not os.path.exists(missing)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_status_names_truncated_and_missing_slot_files(store_v1, damage):
    path, _ = shard_path(store_v1, "model.embed.weight")
    if damage == "truncate":
        os.truncate(path, 10)
    else:
        os.unlink(path)
    result = run("status", store_v1, "--json")
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert sorted(problems) == ["shard-00000.bin"]
    assert ("has 10 bytes, expected" if damage == "truncate" else "is missing") in problems[
        "shard-00000.bin"]
    human = run("status", store_v1)
    assert human.exit_code == 1
    assert "DAMAGED    shard-00000.bin" in human.stdout
    assert "damaged" in human.stderr and "dbsync push" in human.stderr


def test_status_of_a_slot_without_its_index_shows_the_rest_and_names_it(store_v1):
    """A missing index made ``status`` print one error line (``--json``: version null and no
    receivers), though the head and the leases read well: now the index is the damage
    named, beside everything else."""
    os.unlink(os.path.join(store_v1, "slots", "a", "index.json"))
    result = run("status", store_v1, "--json")
    assert result.exit_code == 1
    info = json.loads(result.stdout)
    assert info["version"] == 1 and "receivers" in info, info
    assert list(info["problems"]) == ["slots/a/index.json"], info["problems"]
    human = run("status", store_v1)
    assert human.exit_code == 1 and "DAMAGED    slots/a/index.json" in human.stdout


def test_status_says_a_push_is_being_written_then_that_it_was_cut_short(store_v1):
    """A trainer mid-push (held in its progress callback): status names the slot it writes
    and who writes it; once that trainer is killed, it says the push was cut short and that
    nothing is lost. (It said nothing of either: only the last published version.)"""
    trainer = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch, dbsync\n"
         "calls = []\n"
         "def held(done, total):\n"
         "    calls.append(done)\n"
         "    if len(calls) == 1:\n"
         "        print('writing', flush=True); sys.stdin.readline()\n"
         "with dbsync.Sender(sys.argv[1]) as s:\n"
         "    s.push({'w': torch.ones(1 << 16)}, progress=held)", store_v1],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "writing"
        during = run("status", store_v1)
        info = json.loads(run("status", store_v1, "--json").stdout)
    finally:
        trainer.kill()
        trainer.wait()
    assert during.exit_code == 0, during.output
    assert f"next slot  b: being written by {os.uname().nodename} pid {trainer.pid}" in (
        during.stdout), during.stdout
    assert info["next_slot"] == {"slot": "b", "writer_alive": True,
                                 "writer": f"{os.uname().nodename} pid {trainer.pid}"}
    after = run("status", store_v1)
    assert after.exit_code == 0 and "version    1 (slot a)" in after.stdout
    assert (f"next slot  b: a push was cut short before it published (its writer, "
            f"{os.uname().nodename} pid {trainer.pid}, is gone)") in after.stdout, after.stdout
    with dbsync.Sender(store_v1) as sender:  # (and the next push reuses the slot)
        assert sender.push({"w": torch.zeros(4)}) == 2
    assert "next slot" not in run("status", store_v1).stdout


def test_status_names_the_receivers_the_next_push_will_wait_for(store_v1):
    """A receiver holding the version in the slot the next push must write: status says
    that push will wait for it (and what it holds), in text and JSON; once it lets go, no
    more. (The writer's own log said so; an operator's status did not.)"""
    with dbsync.Receiver(store_v1, reader_id="slowpoke") as rx:
        snap = rx.open()  # holds version 1, in slot a
        with dbsync.Sender(store_v1) as sender:
            assert sender.push({"w": torch.zeros(4)}) == 2  # (slot b: a holds nothing new)
        try:
            text = run("status", store_v1).stdout
            info = json.loads(run("status", store_v1, "--json").stdout)
        finally:
            snap.close()
        after = json.loads(run("status", store_v1, "--json").stdout)
    assert ("next push  waits for slowpoke (live, holding version 1) to release slot a"
            in text), text
    assert info["next_push_waits_for"] == ["slowpoke"], info
    assert [r["holding"] for r in info["receivers"]] == [[["a", 1]]], info["receivers"]
    assert after["next_push_waits_for"] == [] and after["receivers"][0]["holding"] == []


def test_status_on_garbled_manifest(store_v1):
    with open(os.path.join(store_v1, MANIFEST_FILE), "wb") as f:
        f.write(b'{"format": "dbsync", "format_')
    result = run("status", store_v1)
    assert result.exit_code == 1
    assert MANIFEST_FILE in result.stderr and "not valid JSON" in result.stderr


# ---- verify --------------------------------------------------------------------------------
def test_verify_good_store_and_version_check(store_v1, st_file):
    ok = run("verify", store_v1)
    assert ok.exit_code == 0
    assert "version 1 OK: 4 tensors" in ok.stdout
    assert run("verify", store_v1, "--version", "1").exit_code == 0
    run("push", st_file, store_v1)
    stale = run("verify", store_v1, "--version", "1")
    assert stale.exit_code == 1
    assert "version 1 is not current" in stale.stderr and "current: 2" in stale.stderr
    # verify registered as a receiver only while it ran
    assert Store(store_v1).read_leases() == {}


def test_verify_names_exactly_the_tensors_of_the_corrupted_range(store_v1):
    path, offset = shard_path(store_v1, "model.layers.0.mlp.weight")
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    result = run("verify", store_v1)
    assert result.exit_code == 1
    with dbsync.Receiver(store_v1) as rx:
        manifest = rx.manifest()
    hit = manifest.entry("model.layers.0.mlp.weight").range
    sharing = {t.name for t in manifest.tensors if t.range == hit and t.nbytes}
    r = manifest.ranges[hit]
    assert "  checksum" in result.stderr and \
        f"bytes [{r.offset}, {r.offset + r.nbytes}) of shard {r.shard}):" in result.stderr
    named = {line.strip() for line in result.stderr.splitlines() if line.startswith("    ")}
    assert named == sharing and "model.layers.0.mlp.weight" in named
    assert f"{len(sharing)} of 4 tensor(s)" in result.stderr
    # status only checks sizes: it does not see a flipped bit
    assert run("status", store_v1).exit_code == 0


def test_verify_names_truncated_tensor(store_v1):
    os.truncate(shard_path(store_v1, "model.layers.0.mlp.bias")[0], 3)
    result = run("verify", store_v1)
    assert result.exit_code == 1
    assert "\n    model.layers.0.mlp.bias\n" in result.stderr and "has 3 bytes, expected" in (
        result.stderr)


def test_verify_damaged_slot_stamp(store_v1):
    """A stamp that does not name the head's version is said in words (it printed a Python
    tuple, "stamped (None, None)"), and damage is told from a writer that moved on."""
    store = Store(store_v1)
    slot = store.require_manifest().slot
    store.write_stamp(slot, "writing", None, durable=False)
    result = run("verify", store_v1)
    assert result.exit_code == 1
    assert (f"slot {slot} of {store.root} holds a stamp of version 'writing', run None while "
            "the head names version 1 there: its stamp is missing or damaged; publish again"
            ) in result.stderr and "dbsync push" in result.stderr
    assert run("status", store_v1).exit_code == 1
    os.unlink(os.path.join(store.slot_dir(slot), "dbsync-slot.json"))
    result = run("verify", store_v1)
    assert result.exit_code == 1 and f"slot {slot} of {store.root} holds no stamp" in (
        result.stderr) and "(None" not in result.stderr


def test_verify_nothing_published(tmp_path):
    empty = str(tmp_path / "empty")
    Store(empty, create=True)
    result = run("verify", empty)
    assert result.exit_code == 1
    assert "no version has been published" in result.stderr
    assert run("verify", str(tmp_path / "missing")).exit_code == 1
    assert not os.path.exists(tmp_path / "missing")


# ---- watch ---------------------------------------------------------------------------------
def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_watch_sees_two_flips(store_v1, st_file):
    proc = subprocess.Popen(cli_cmd("watch", store_v1, "--json", "--count", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=REPO)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    try:
        seen = [json.loads(lines.get(timeout=60))]
        for _ in range(2):
            assert run("push", st_file, store_v1).exit_code == 0
            seen.append(json.loads(lines.get(timeout=30)))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [s["version"] for s in seen] == [1, 2, 3]
    assert [s["slot"] for s in seen] == ["a", "b", "a"]
    assert all(s["tensors"] == 4 for s in seen)


def test_watch_human_lines(store_v1):
    result = run("watch", store_v1, "--count", "1")
    assert result.exit_code == 0
    assert result.stdout.startswith("version 1  slot a  4 tensors")


def test_watch_says_it_waits_for_a_first_version_then_prints_it(tmp_path, st_file):
    root = tmp_path / "store"
    root.mkdir()  # made by the deployment; nothing pushed yet
    proc = subprocess.Popen(cli_cmd("watch", str(root), "--json", "--count", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=REPO)
    try:
        said = proc.stderr.readline()  # (the watcher starts next, and reports the version
        # current by then: a push from here on is seen, whenever it lands)
        assert "nothing is published" in said and "waiting for the first version" in said
        assert run("push", st_file, str(root)).exit_code == 0
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert json.loads(out)["version"] == 1


def test_watch_lines_keep_their_keys_when_the_head_moved_on(store_v1, st_file):
    """A line about a version the head already moved past (pushes faster than the watch
    prints) was ``{"version": 88}`` alone: a script telling runs apart by ``run_id`` broke.
    Every line now has every key, and the run id the watcher read with the version."""
    from cli.main import _version_line
    from dbsync.store import Store

    assert run("push", st_file, store_v1).exit_code == 0
    store = Store(store_v1)
    run_id = store.read_head().run_id
    line = json.loads(_version_line(store, 1, run_id, True))
    assert line == {"version": 1, "run_id": run_id, "slot": None, "tensors": None,
                    "bytes": None, "published_at": None}
    now = json.loads(_version_line(store, 2, run_id, True))
    assert set(now) == set(line) and now["slot"] == "b" and now["tensors"] == 4
    assert _version_line(store, 1, run_id, False) == (
        f"version 1  run {run_id}  (superseded as it was read)")


def test_watch_json_on_a_newer_format_prints_its_error_as_json(store_v1):
    """``watch --json`` promises one JSON line with "error" where it cannot watch, as
    ``status --json`` does; a store of a newer format printed nothing on stdout."""
    head_path = os.path.join(store_v1, "dbsync.json")
    head = json.loads(open(head_path).read())
    head["format_version"] = 99
    with open(head_path, "w") as f:
        json.dump(head, f)
    result = run("watch", store_v1, "--json", "--count", "1")
    assert result.exit_code == 1
    said = json.loads(result.stdout)
    assert said["version"] is None and "format" in said["error"], said


def test_watch_missing_root(tmp_path):
    result = run("watch", str(tmp_path / "missing"), "--count", "1")
    assert result.exit_code == 1
    assert not os.path.exists(tmp_path / "missing")


# ---- the installed entry point -------------------------------------------------------------
def test_subprocess_errors_are_plain_and_help_lists_commands(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 40)
    proc = subprocess.run(cli_cmd("push", str(bad), str(tmp_path / "store")),
                          capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: ") and str(bad) in proc.stderr
    assert not os.path.exists(tmp_path / "store")
    helped = run("--help")
    assert helped.exit_code == 0
    for command in ("push", "status", "watch", "verify", "serve-vllm"):
        assert command in helped.stdout
    # The release's minor number follows the store format (pip upgrades across a format
    # change: every build was 0.1.0), and --version says the format.
    from importlib.metadata import version

    from dbsync.format import FORMAT_VERSION
    assert run("--version").stdout.strip() == (
        f"dbsync {dbsync.__version__} (store format {FORMAT_VERSION})")
    assert dbsync.__version__.split(".")[1] == str(FORMAT_VERSION)
    assert version("dbsync-weights") == dbsync.__version__


# ---- progress bar --------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_reaches_the_total(root):
    from cli.progress import ProgressBar

    weights = {f"w{i}": torch.ones(1024, 256) for i in range(4)}  # 4 MiB
    terminal, log = _Terminal(), io.StringIO()
    with dbsync.Sender(root, num_threads=2) as sender:
        bar = ProgressBar(delay=0, stream=terminal, min_interval=0)
        sender.push(weights, progress=bar)
        bar.finish()
        quiet = ProgressBar(delay=60, stream=log)  # a quick push shows nothing
        sender.push(weights, progress=quiet)
        quiet.finish()
    final = terminal.getvalue().rsplit("\r", 1)[-1]
    assert "100.0%" in final and "4.0 MiB / 4.0 MiB" in final and final.endswith("\n")
    assert log.getvalue() == ""


# ---- serve-vllm ----------------------------------------------------------------------------
def test_serve_vllm_usage():
    missing_model = run("serve-vllm", "some-root")
    assert missing_model.exit_code == 2 and "--model" in missing_model.output
    helped = run("serve-vllm", "--help")
    assert helped.exit_code == 0 and "/dbsync/status" in helped.stdout


@pytest.mark.parametrize("case", ["missing store", "missing model", "owned option",
                                  "max-loras alone"])
def test_serve_vllm_refuses_bad_arguments_before_importing_vllm(tmp_path, case):
    """Mistakes serve-vllm can see without vLLM are said at once (importing vLLM takes 10-20
    s on a CPU box): a store that is not there (exit 1, as `status` says it), a --model that
    is no directory, one of its own options after '--', --max-loras without --lora (exit 2)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    store = tmp_path / "store"
    store.mkdir()
    args = {"missing store": [str(tmp_path / "stroe"), "--model", str(model)],
            "missing model": [str(store), "--model", str(tmp_path / "modle")],
            "owned option": [str(store), "--model", str(model), "--", "--port", "9"],
            "max-loras alone": [str(store), "--model", str(model), "--max-loras", "3"]}[case]
    probe = ("import sys; from click.testing import CliRunner; from cli.main import cli; "
             "r = CliRunner().invoke(cli, sys.argv[1:]); "
             "print(r.exit_code, 'vllm' in sys.modules, 'torch' in sys.modules); "
             "print(r.output)")
    proc = subprocess.run([sys.executable, "-c", probe, "serve-vllm", *args], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    code, vllm_loaded, torch_loaded = proc.stdout.split("\n")[0].split()
    assert (vllm_loaded, torch_loaded) == ("False", "False"), proc.stdout
    assert code == ("1" if case == "missing store" else "2"), proc.stdout
    said = {"missing store": "does not exist or is not a directory",
            "missing model": "no such directory on this host",
            "owned option": "pass --port to serve-vllm itself",
            "max-loras alone": "--max-loras only applies with --lora"}[case]
    assert said in proc.stdout, proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_serve_vllm_delegates_and_refuses_options_it_owns(tmp_path):
    """Reaches dbsync.vllm.server (no engine starts): options serve-vllm owns may not be
    passed to vLLM after '--'."""
    root = tmp_path / "store"
    proc = subprocess.run(
        cli_cmd("serve-vllm", str(root), "--model", str(tmp_path / "model"), "--",
                "--port", "9"),
        capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=300)
    assert proc.returncode == 2
    assert "pass --port to serve-vllm itself" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not root.exists()


@pytest.mark.parametrize("args", [
    ("watch", "{root}", "--poll-interval", "inf"), ("watch", "{root}", "--poll-interval", "nan"),
    ("watch", "{root}", "--poll-interval", "1e10"), ("push", "{src}", "{root}", "--wait-for",
                                                     "1", "--timeout", "nan"),
    ("push", "{src}", "{root}", "--max-lag", "1", "--max-lag-timeout", "-inf"),
], ids=["watch-inf", "watch-nan", "watch-huge", "push-timeout-nan", "push-lag-timeout-inf"])
def test_seconds_that_are_no_time_are_usage_errors(store_v1, st_file, args):
    """NaN, infinity or an absurd number of seconds: exit 2 before anything runs. (A NaN
    timeout waited forever, a NaN poll interval polled ~100 times a second, and infinity
    killed the watcher's thread while `dbsync watch` ran on, reporting nothing.)"""
    result = run(*[a.format(root=store_v1, src=st_file) for a in args])
    assert result.exit_code == 2
    assert "is not a number of seconds above 0" in result.stderr
    assert current_version(store_v1) == 1


def test_a_missing_dependency_is_named_not_called_a_bug(store_v1, st_file):
    """torch not importable (a trainer-only image built wrong): `dbsync push` names it and
    how to install it, not "this is a bug in dbsync"."""
    script = ("import sys\nsys.modules['torch'] = None\nfrom cli.main import cli\n"
              "cli.main(sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", script, "push", st_file, store_v1],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 1, proc.stderr
    assert "this command needs torch" in proc.stderr and "pip install" in proc.stderr
    assert "bug" not in proc.stderr and "Traceback" not in proc.stderr


def test_status_of_a_store_in_another_format_names_its_writer_and_readers(root):
    """FORMAT.md promises that for a stray writer of another release `dbsync status` names the
    host and pid that wrote the current version; it printed the format error alone."""
    import dbsync

    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(2)})
    with dbsync.Receiver(root, reader_id="engine-7") as rx:
        rx.load(lambda pairs: None)
        head_path = os.path.join(root, "dbsync.json")
        head = json.load(open(head_path))
        head["format_version"] = dbsync.FORMAT_VERSION + 1
        open(head_path, "w").write(json.dumps(head))
        shown = run("status", root)
        assert shown.exit_code == 1 and "upgrade dbsync on this host" in shown.output
        assert f"by {head['writer']['host']} pid {head['writer']['pid']}" in shown.output
        assert "engine-7 on" in shown.output and "version 1" in shown.output
        as_json = json.loads(run("status", root, "--json").stdout)
        assert as_json["head"]["writer"] == head["writer"] and "error" in as_json
        assert [r["id"] for r in as_json["receivers"]] == ["engine-7"]
