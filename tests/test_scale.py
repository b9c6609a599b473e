"""Cost that must not grow with the tensor count or the push rate: bounded open files and
mappings, a second staging buffer for background pushes, parallel loads into plain modules."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import dbsync

MANY = r"""
import resource, sys, torch, dbsync
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
root, count = sys.argv[1], int(sys.argv[2])
weights = {f"experts.{i}.w": torch.full((3 + i % 5,), float(i)) for i in range(count)}
with dbsync.Sender(root) as sender:
    sender.shard_bytes = 1024          # many shards too: more than one batch of open files
    assert sender.push(weights) == 1
dest = {k: torch.zeros_like(v) for k, v in weights.items()}
with dbsync.Receiver(root) as rx:
    assert rx.load(dest) == 1
    shards = len(rx.manifest().shards)
assert all(torch.equal(dest[k], v) for k, v in weights.items())
print(shards)
"""


def test_thousands_of_tensors_and_shards_under_a_low_open_file_limit(root):
    """2,000 tensors in ~130 shards, pushed and loaded (verified) by a process allowed only
    256 open files: one file per tensor (format 1) needed 2,000."""
    out = subprocess.run([sys.executable, "-c", MANY, root, "2000"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) > 64  # more shards than one batch of open files
    # (the shards, the index, the stamp and the note that the version was published)
    assert len(os.listdir(os.path.join(root, "slots", "a"))) == int(out.stdout) + 3


def test_background_push_returns_while_the_previous_one_is_still_writing(root):
    """Two staging buffers: the trainer's stall is one snapshot copy, not the previous write."""
    release, writing = threading.Event(), threading.Event()

    def hold_first_write(done: int, total: int) -> None:
        writing.set()
        assert release.wait(30)

    weights = {"w": torch.full((1024,), 1.0)}
    with dbsync.Sender(root) as sender:
        first = sender.push(weights, blocking=False, progress=hold_first_write)
        assert writing.wait(30)
        weights["w"].fill_(2.0)  # the trainer moved on
        second = sender.push(weights, blocking=False)  # returns: the other buffer is free
        assert not first.done(), "the first push must still be writing"
        weights["w"].fill_(3.0)
        release.set()
        assert (first.result(timeout=30), second.result(timeout=30)) == (1, 2)
    got = {}
    with dbsync.Receiver(root) as rx:
        rx.load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    assert torch.equal(got["w"], torch.full((1024,), 2.0))  # the snapshot, not later edits


def test_next_version_counts_background_pushes_not_yet_published(root):
    """A trainer tagging each background push with ``next_version`` gets the number that
    push publishes, while earlier ones still write; a push that fails gives its number to the
    next."""
    release, writing = threading.Event(), threading.Event()

    def hold_first_write(done: int, total: int) -> None:
        writing.set()
        assert release.wait(30)

    with dbsync.Sender(root) as sender:
        said, futures = [], []

        def push(**kw: object) -> None:
            said.append(sender.next_version)
            futures.append(sender.push({"w": torch.full((1024,), float(said[-1]))},
                                       blocking=False, **kw))

        push(progress=hold_first_write)
        assert writing.wait(30)
        push()  # while the first one still writes
        release.set()
        push()
        push()
        assert [f.result(timeout=30) for f in futures] == said == [1, 2, 3, 4]
        release.clear()
        writing.clear()
        held = sender.push({"w": torch.full((1024,), 5.0)}, blocking=False,
                           progress=hold_first_write)
        assert writing.wait(30)
        queued = sender.push({"w": torch.full((1024,), 6.0)}, blocking=False)
        assert sender.next_version == 7
        assert queued.cancel()  # never runs: its number goes to the next push
        assert sender.next_version == 6
        release.set()
        assert held.result(timeout=30) == 5
        bad = sender.push({"w": torch.full((1024,), 6.0)}, blocking=False,
                          progress=lambda done, total: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.result(timeout=30)
        assert sender.next_version == 6
        assert sender.push({"w": torch.full((1024,), 6.0)}) == 6


def test_load_into_a_plain_module_checks_first_then_copies(root):
    source = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with dbsync.Sender(root) as sender:
        sender.push(source)
    target = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with dbsync.Receiver(root) as rx:
        assert rx.load(target, threads=3) == 1
    for (name, want), got in zip(source.state_dict().items(), target.state_dict().values(),
                                 strict=True):
        assert torch.equal(want, got), name
    wrong = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.BatchNorm1d(5))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with dbsync.Receiver(root) as rx, pytest.raises(dbsync.IncompatibleWeightsError,
                                                   match="shape"):
        rx.load(wrong)
    assert all(torch.equal(before[k], v) for k, v in wrong.state_dict().items())


def test_latest_version_reads_only_the_small_head(root):
    with dbsync.Sender(root) as sender:
        sender.push({f"t{i}": torch.ones(1) for i in range(3000)})
    head = os.path.getsize(os.path.join(root, "dbsync.json"))
    assert head < 2048  # whatever the tensor count
    index = os.path.join(root, "slots", "a", "index.json")
    os.truncate(index, 10)  # the index is damaged: the head alone still answers
    with dbsync.Receiver(root) as rx:
        assert rx.latest_version() == 1
        with pytest.raises(dbsync.FormatError):
            rx.load(lambda pairs: None)


@pytest.mark.parametrize("read_only", [False, True], ids=["leased-scatter", "leaseless-copy"])
@pytest.mark.parametrize("verify", [True, False])
def test_load_into_tensors_lands_every_byte_whatever_the_path(root, read_only, verify):
    """Same-dtype contiguous destinations take raw scatter reads (leased) or memory copies
    (leaseless private copy); casts, non-contiguous destinations, empty and 0-d tensors go
    through torch. Every byte lands, over many shards and odd sizes (padding between them)."""
    g = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    for i in range(300):
        n = 1 + (i * 37) % 301
        weights[f"w{i}"] = torch.randn(n, generator=g).to(
            [torch.float32, torch.bfloat16, torch.float16, torch.int8][i % 4]
            if i % 4 != 3 else torch.int8)
    weights["empty"] = torch.empty(0, 3)
    weights["scalar"] = torch.tensor(7.5)
    weights["matrix"] = torch.randn(6, 5, generator=g)
    weights["cast"] = torch.randn(33, generator=g).to(torch.bfloat16)
    with dbsync.Sender(root) as sender:
        sender.shard_bytes = 4096  # dozens of shards
        sender.push(weights)
    dest = {k: torch.zeros_like(v) for k, v in weights.items()}
    dest["matrix"] = torch.zeros(5, 6).t()  # a non-contiguous destination
    dest["cast"] = torch.zeros(33, dtype=torch.float32)  # cast on the way in
    with dbsync.Receiver(root, read_only=read_only) as rx:
        assert rx.read_only is read_only
        assert rx.load(dest, verify=verify, threads=4) == 1
    for name, want in weights.items():
        got = dest[name]
        if name == "cast":
            assert torch.equal(got, want.float()), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_small_tensors_after_a_big_one_land_at_their_own_offsets(root):
    """Small tensors around tensors big enough to be written alone (like the layer norms
    between the MLP matrices of any 7B model) are written where the index says: grouping
    them across a big tensor once wrote the later ones at the wrong offset, and every such
    version was refused as damaged."""
    from dbsync import fileio

    big = fileio.GROUP_BYTES // 4 + 1000  # float32 elements: just over GROUP_BYTES
    g = torch.Generator().manual_seed(1)
    weights = {}
    for layer in range(3):
        weights[f"l{layer}.norm_a"] = torch.randn(300, generator=g)
        weights[f"l{layer}.mlp"] = torch.randn(big, generator=g)
        weights[f"l{layer}.norm_b"] = torch.randn(77, generator=g)
    with dbsync.Sender(root) as sender:
        for version in (1, 2, 3):  # fresh files, then files reused in place
            assert sender.push(weights) == version
            dest = {k: torch.zeros_like(v) for k, v in weights.items()}
            with dbsync.Receiver(root) as rx:
                assert rx.load(dest) == version
            for name, want in weights.items():
                assert torch.equal(dest[name], want), name
            weights = {k: v + 1 for k, v in weights.items()}


@pytest.mark.parametrize("read_only", [False, True], ids=["leased", "leaseless"])
def test_load_into_odd_destinations_is_exact_and_visible_to_autograd(root, read_only):
    """Destinations raw bytes cannot go into (a wrapper subclass with no memory of its own)
    are copied by torch; every destination's autograd version moves, so a graph that saved
    the old weights refuses to run backward on the new ones, as after any in-place copy."""
    from torch.testing._internal.two_tensor import TwoTensor

    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.arange(4.0), "v": torch.arange(3.0)})
    wrapped = TwoTensor(torch.zeros(4), torch.zeros(4))
    param = torch.nn.Parameter(torch.zeros(3))
    graph = (param * param).sum()  # saves param for backward
    with dbsync.Receiver(root, read_only=read_only) as rx:
        assert rx.load({"w": wrapped, "v": param}) == 1
    assert torch.equal(wrapped.a, torch.arange(4.0)) and torch.equal(wrapped.b, torch.arange(4.0))
    assert torch.equal(param.detach(), torch.arange(3.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        graph.backward()


def test_every_destination_of_a_many_tensor_load_has_its_autograd_version_moved(root):
    """The versions are bumped in chunks while the reads run: a destination in every chunk
    (the first, a middle and the last tensor of 1,300) refuses backward afterwards."""
    from dbsync import snapshot

    count = 1300
    assert count > 2 * snapshot._BUMP_CHUNK  # (several chunks, the last one partial)
    with dbsync.Sender(root) as sender:
        sender.push({f"p{i}": torch.full((4,), float(i)) for i in range(count)})
    params = {f"p{i}": torch.nn.Parameter(torch.zeros(4)) for i in range(count)}
    watched = [0, snapshot._BUMP_CHUNK + 7, count - 1]
    graphs = [(params[f"p{i}"] * params[f"p{i}"]).sum() for i in watched]
    with dbsync.Receiver(root) as rx:
        assert rx.load(params) == 1
    for i, graph in zip(watched, graphs, strict=True):
        assert torch.equal(params[f"p{i}"].detach(), torch.full((4,), float(i)))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            graph.backward()


def test_a_missing_shard_with_empty_tensors_is_reported_as_damage(root):
    with dbsync.Sender(root) as sender:
        sender.push({"a": torch.arange(10.0), "e": torch.empty(0, 3)})
    os.remove(os.path.join(root, "slots", "a", "shard-00000.bin"))
    with dbsync.Receiver(root) as rx, pytest.raises(dbsync.DamagedVersionError,
                                                   match="shard file is missing"):
        rx.load({"a": torch.zeros(10), "e": torch.empty(0, 3)})


def test_pushing_a_tensor_without_memory_of_its_own_is_refused_clearly(root):
    from torch.testing._internal.two_tensor import TwoTensor

    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError,
                                                      match="no memory of its own"):
        sender.push({"w": TwoTensor(torch.zeros(4), torch.zeros(4))})


@pytest.mark.parametrize("read_only", [False, True], ids=["leased", "leaseless"])
def test_the_copy_plan_is_reused_only_while_the_destinations_stay_the_same(root, read_only):
    """Load after load into the same tensors reuses the copy plan; a destination replaced by
    a new tensor, given another dtype, made non-contiguous or tied to another name is planned
    again, and every load is exact, each in the tensors the caller holds at that moment."""
    names = [f"w{i}" for i in range(40)]

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {n: torch.full((3 + i % 4, 5), float(version * 100 + i)) for i, n in
                enumerate(names)}

    def check(dest: dict[str, torch.Tensor], version: int) -> None:
        for name, want in weights(version).items():
            assert torch.equal(dest[name].float(), want), (name, version)

    with dbsync.Sender(root) as sender, dbsync.Receiver(root, read_only=read_only) as rx:
        dest = {k: torch.zeros_like(v) for k, v in weights(1).items()}
        sender.push(weights(1))
        assert rx.load(dest) == 1
        check(dest, 1)
        kept = rx.copy_plans._kept
        assert kept is not None
        sender.push(weights(2))  # a new version of the same layout, same tensors: reused
        assert rx.load(dest) == 2
        check(dest, 2)
        assert rx.copy_plans._kept is kept
        old = dest["w3"]
        dest["w3"] = torch.zeros_like(old)  # a new tensor at another address
        dest["w4"] = torch.zeros(dest["w4"].shape, dtype=torch.float64)  # cast on the way in
        dest["w5"] = torch.zeros(tuple(reversed(dest["w5"].shape))).t()  # non-contiguous
        sender.push(weights(3))
        assert rx.load(dest) == 3
        check(dest, 3)
        assert rx.copy_plans._kept is not kept
        assert torch.equal(old, weights(2)["w3"])  # the replaced tensor was not written
        assert dest["w4"].dtype == torch.float64
        sender.push(weights(4))
        assert rx.load(dest) == 4  # reused again with the new tensors
        check(dest, 4)
        dest.pop("w7")  # a destination missing: refused, listing it, nothing applied
        with pytest.raises(dbsync.IncompatibleWeightsError, match="w7"):
            rx.load(dest)
        assert torch.equal(dest["w6"], weights(4)["w6"])


def test_a_kept_plan_takes_each_tensor_by_its_name_whatever_the_dict_order(root):
    """The kept plan takes a dict's values as they lie when its keys are the last load's, in
    the same order; a dict in another order than the version's, one rebuilt with equal keys,
    and one whose order changed since the last load all get every tensor by its name."""
    names = [f"w{i}" for i in range(30)]

    def weights(version: int) -> dict[str, torch.Tensor]:
        return {n: torch.full((2 + i % 3,), float(version * 100 + i)) for i, n in
                enumerate(names)}

    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        tensors = {k: torch.zeros_like(v) for k, v in weights(1).items()}
        dest = {k: tensors[k] for k in reversed(names)}  # not the version's order
        for version in (1, 2):
            sender.push(weights(version))
            assert rx.load(dest) == version
            assert all(torch.equal(dest[n], w) for n, w in weights(version).items())
        kept = rx.copy_plans._kept
        rebuilt = {str(k.encode().decode()): v for k, v in dest.items()}  # equal keys, new str
        sender.push(weights(3))
        assert rx.load(rebuilt) == 3
        assert all(torch.equal(tensors[n], w) for n, w in weights(3).items())
        shuffled = {k: tensors[k] for k in names[15:] + names[:15]}  # same keys, new order
        sender.push(weights(4))
        assert rx.load(shuffled) == 4
        assert all(torch.equal(tensors[n], w) for n, w in weights(4).items())
        assert rx.copy_plans._kept is kept  # the same tensors: never planned again


def test_a_push_reuses_its_layout_only_while_the_tensors_stay_the_same(root):
    """Push after push of the same tensors reuses the layout (places, views, index); a tensor
    reshaped or transposed in place at the same address, replaced, or a value that is not a
    tensor any more is looked at again: every version reads back exact, with its own shapes,
    and bad input is refused with nothing written."""
    base = {f"w{i}": torch.arange(12.0).reshape(3, 4) + i for i in range(30)}
    weights = dict(base)

    def published(rx: dbsync.Receiver) -> dict[str, torch.Tensor]:
        with rx.open() as snap:
            return {n: t.clone() for n, t in snap.tensors()}

    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        assert sender.push(weights) == 1
        kept = sender._layouts._kept[0]
        for t in weights.values():
            t.add_(100)  # the optimizer's in-place update: the same layout
        assert sender.push(weights) == 2
        assert sender._layouts._kept[0] is kept
        assert all(torch.equal(published(rx)[n], t) for n, t in weights.items())
        weights["w1"] = weights["w1"].view(4, 3)  # same address, another shape
        weights["w2"] = weights["w2"].t()  # same address, not contiguous
        weights["w3"] = torch.zeros(5)  # another tensor
        assert sender.push(weights) == 3
        got = published(rx)
        assert got["w1"].shape == (4, 3) and got["w2"].shape == (4, 3)
        assert all(torch.equal(got[n], t) for n, t in weights.items())
        weights["w4"] = "not a tensor"  # type: ignore[assignment]
        with pytest.raises(dbsync.InvalidWeightsError, match="w4"):
            sender.push(weights)
        assert rx.latest_version() == 3
        sender.shard_bytes = 64  # another shard size: planned again
        weights["w4"] = torch.ones(2)
        assert sender.push(weights) == 4
        assert len(rx.manifest().shards) > 1
        assert all(torch.equal(published(rx)[n], t) for n, t in weights.items())


def test_the_index_template_writes_what_dump_index_writes():
    from dbsync.format import dump_index
    from dbsync.pushlayout import IndexTemplate

    columns = {"name": ["a", "b\u00e9\x01\"x"], "dtype": ["float32", "bfloat16"],
               "shape": [[2, 3], []], "shard": [0, 0], "offset": [0, 64], "range": [0, 1]}
    ranges = {"shard": [0, 0], "offset": [0, 64], "nbytes": [24, 0]}
    sums = ["0123456789abcdef", "fedcba9876543210"]
    for adapter in (None, {"r": 8, "target_modules": ["q_proj"]}):
        template = IndexTemplate(columns, ranges, [80], adapter)
        want = dump_index("run-\u00e9", 12, columns, {**ranges, "checksum": sums}, [80],
                          adapter)
        assert template.fill("run-\u00e9", 12, sums) == want


def test_an_index_of_the_same_layout_reads_the_same_as_a_fresh_parse(root):
    """The next version's index (same layout, new checksums) takes the short path; its
    entries and ranges equal what a full parse gives, and a wrong checksum there is still
    refused."""
    from dbsync import format as fmt

    weights = {f"w{i}": torch.full((2, i % 3 + 1), float(i)) for i in range(50)}
    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        sender.push(weights)
        rx.manifest()  # the layout is remembered
        weights = {k: v + 1 for k, v in weights.items()}
        sender.push(weights)
        slot = rx.store.read_head().slot
        raw = open(os.path.join(rx.store.slot_dir(slot), fmt.INDEX_FILE), "rb").read()
        kept = fmt._LAST_TENSORS[0]
        short = fmt.Index.loads(raw)
        assert short.tensors is kept.entries  # its tensors section was compared, not parsed
        fmt._LAST_RANGES[0] = fmt._LAST_TENSORS[0] = None
        full = fmt.Index.loads(raw)
        assert short.tensors == full.tensors and short.ranges == full.ranges
        bad = raw.replace(full.ranges[0].checksum.encode(), b"XYZ" * 5 + b"0", 1)
        with pytest.raises(dbsync.FormatError):
            fmt.Index.loads(bad)


class _NoAddress(torch.Tensor):
    """A destination whose address cannot be read (as for some wrapper tensors): torch copies
    into it, and no kept plan can vouch for it."""

    def data_ptr(self) -> int:
        raise RuntimeError("this tensor has no address")


def test_kept_plans_and_layouts_follow_what_changed_in_place(root):
    """A plan is not kept for destinations whose state cannot be read (a plain destination
    replaced next to one is written, the old one left alone); a Sender's dtype changed
    between pushes converts again; an adapter configuration edited in place between pushes is
    written as it is now."""
    weights = {"w": torch.arange(4.0), "v": torch.arange(3.0)}
    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        sender.push(weights)
        dest = {"w": torch.zeros(4).as_subclass(_NoAddress), "v": torch.zeros(3)}
        rx.load(dest)
        old_v = dest["v"]
        dest["v"] = torch.zeros(3)  # replaced: a stale plan would write the old one
        weights["v"].add_(10)
        sender.push(weights)
        rx.load(dest)
        assert torch.equal(dest["v"], weights["v"]) and torch.equal(old_v, torch.arange(3.0))
        assert torch.equal(dest["w"].as_subclass(torch.Tensor), weights["w"])
        sender.dtype = torch.bfloat16  # changed after pushes of the same tensors
        sender.push(weights)
        assert {e.dtype for e in rx.manifest().tensors} == {"bfloat16"}
    config = {"r": 8, "target_modules": ["q_proj"]}
    lora = os.path.join(root, "lora")
    def adapter(rank: int) -> dict[str, torch.Tensor]:
        return {"base_model.model.q_proj.lora_A.weight": torch.zeros(rank, 16),
                "base_model.model.q_proj.lora_B.weight": torch.zeros(16, rank)}

    with dbsync.Sender(lora) as sender, dbsync.Receiver(lora) as rx:
        sender.push(adapter(8), adapter_config=config)
        config["r"] = 16
        config["target_modules"].append("v_proj")
        sender.push(adapter(16), adapter_config=config)
        assert rx.manifest().adapter == {"r": 16, "target_modules": ["q_proj", "v_proj"]}
        # PEFT's LoraConfig.to_dict() gives a set: published as a sorted list (it failed
        # after every shard was written, with a bare TypeError)
        sender.push(adapter(8), adapter_config={"r": 8, "target_modules": {"v_proj", "q_proj"}})
        assert rx.manifest().adapter == {"r": 8, "target_modules": ["q_proj", "v_proj"]}
        with pytest.raises(dbsync.InvalidWeightsError, match="cannot be written as JSON"):
            sender.push(adapter(8), adapter_config={"r": 8, "init": object()})
        assert rx.latest_version() == 3


def test_a_scatter_read_lands_exact_on_every_path_and_refuses_a_file_that_ended(
        tmp_path, monkeypatch):
    """One ``preadv`` call reads a whole scatter read; a vector longer than the kernel takes
    in one call, and a file that ends before the read does, take the careful path: the bytes
    land exactly, or the short file is an error (never a silent partial copy)."""
    import array

    from dbsync import scatter

    calls: list[int] = []
    preadv = scatter._preadv
    monkeypatch.setattr(scatter, "_preadv", lambda *a: calls.append(a[2]) or preadv(*a))
    data = os.urandom(3000 * 8 + 100)
    path = tmp_path / "shard.bin"
    path.write_bytes(data)

    def read(pieces: int, offset: int = 100) -> list[torch.Tensor]:
        dest = [torch.zeros(8, dtype=torch.uint8) for _ in range(pieces)]
        iov = array.array("Q")
        for t in dest:
            iov.extend((t.data_ptr(), 8))
        fd = os.open(path, os.O_RDONLY)
        try:
            scatter.read_into(fd, scatter.Read(offset, iov))
        finally:
            os.close(fd)
        assert list(iov[1::2]) == [8] * pieces  # the plan's vector is left as it was
        return dest

    for pieces, want_calls in ((10, [10]), (1024, [1024]), (1100, [1024, 76]),
                               (3000, [1024, 1024, 952])):  # IOV_MAX is 1024
        calls.clear()
        dest = read(pieces)
        assert b"".join(bytes(t.numpy()) for t in dest) == data[100:100 + 8 * pieces]
        assert calls == want_calls
    path.write_bytes(data[:1000])  # the file ends inside the read, or before it
    for pieces, offset in ((200, 100), (1000, 100), (3000, 100), (10, 2000)):
        with pytest.raises(OSError, match="ended before"):
            read(pieces, offset)


@pytest.mark.parametrize("how", ["torch-check", "columns"])
def test_tensor_states_see_every_change_a_kept_plan_depends_on(monkeypatch, how):
    """Kept plans and layouts are reused only while every tensor is as it was: another
    address, dtype, shape, stride, type, device kind, or a neg/conj view is a change, both
    through torch's tensor-match check and through the column comparison used where that
    check is missing."""
    from dbsync import tensorstate

    monkeypatch.setattr(tensorstate, "_MATCHER", [] if how == "torch-check" else [None])
    base = torch.zeros(4, 6)
    cplx = torch.zeros(3, dtype=torch.complex64)
    tensors = [base, torch.zeros(5), torch.nn.Parameter(torch.zeros(2)), cplx]
    states = tensorstate.States.of(tensors)
    assert (states._match is not None) == (how == "torch-check")
    assert states.matches(list(tensors)) and states.addresses == [t.data_ptr() for t in tensors]
    changes = {
        "another address": (1, torch.zeros(5)),
        "another dtype": (0, base.view(torch.int32)),
        "another shape": (0, base.view(6, 4)),
        "transposed": (0, base.view(6, 4).t()),
        "neg view": (0, torch._neg_view(base)),
        "conj view": (3, cplx.conj()),
        "plain tensor for a parameter": (2, tensors[2].detach()),
        "meta tensor": (1, torch.zeros(5, device="meta")),
        "not a tensor": (1, "w"),
    }
    for what, (at, other) in changes.items():
        changed = list(tensors)
        changed[at] = other
        assert not states.matches(changed), what
    assert not states.matches(tensors[:3])


def test_a_receiver_keeps_its_reader_threads_and_they_end_with_it(root):
    """Loads reuse the receiver's worker threads (no thread started per load: on a busy host
    each start waits for a core), and the threads end once the receiver is closed and
    dropped."""
    import gc

    weights = {f"w{i}": torch.full((100,), float(i)) for i in range(50)}
    dest = {k: torch.zeros_like(v) for k, v in weights.items()}

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("dbsync-read")}

    before = readers()
    with dbsync.Sender(root) as sender:
        sender.push(weights)
        rx = dbsync.Receiver(root)
        for _ in range(6):
            sender.push(weights)
            rx.load(dest, threads=3)
        started = readers() - before
        assert 1 <= len(started) <= 3
        for _ in range(3):
            rx.load(dest, threads=3)
        assert readers() - before == started  # the same threads, none new
        assert all(torch.equal(dest[k], v) for k, v in weights.items())
        rx.close()
        del rx
        gc.collect()
        for thread in started:
            thread.join(timeout=30)
            assert not thread.is_alive()


@pytest.mark.parametrize("read_only", [False, True], ids=["leased", "leaseless"])
def test_each_loads_shard_mappings_and_copies_are_freed_after_it(root, read_only):
    """A snapshot's shards (mappings, or private copies without a lease) are dropped in a
    thread of their own after the load returns; loading again and again holds no more of
    them: no mapping of a shard file stays, and the memory of private copies comes back."""
    from dbsync import unmapping

    def shard_mappings() -> int:
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if str(root) in line and "shard-" in line)

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    weights = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    dest = {k: torch.zeros_like(v) for k, v in weights.items()}
    with dbsync.Sender(root) as sender, dbsync.Receiver(root, read_only=read_only) as rx:
        sender.push(weights)
        rx.load(dest)
        assert unmapping.dropped(timeout=30)
        before = rss_mib()
        for version in range(2, 12):
            weights["w0"].fill_(float(version))
            sender.push(weights)
            assert rx.load(dest) == version
        assert unmapping.dropped(timeout=30)
        assert shard_mappings() == 0
        assert rss_mib() - before < 3 * 32  # ten versions' copies or mappings were not kept
        assert torch.equal(dest["w0"], weights["w0"])


def test_the_gil_switch_interval_is_restored_after_nested_and_concurrent_loads():
    """A verified load shortens the GIL switch interval only while it checks and hashes;
    nested and concurrent blocks share one change, and the interval found first comes back,
    also after an error."""
    from dbsync import gilswitch

    before = sys.getswitchinterval()
    inside = threading.Event()
    leave = threading.Event()

    def other() -> None:
        with gilswitch.fast_switching():
            inside.set()
            leave.wait(30)

    worker = threading.Thread(target=other)
    with gilswitch.fast_switching():
        assert sys.getswitchinterval() == pytest.approx(gilswitch.FAST_INTERVAL)
        worker.start()
        assert inside.wait(30)
    assert sys.getswitchinterval() == pytest.approx(gilswitch.FAST_INTERVAL)  # still inside
    leave.set()
    worker.join(30)
    assert sys.getswitchinterval() == before
    with pytest.raises(ZeroDivisionError), gilswitch.fast_switching():
        1 / 0  # noqa: B018
    assert sys.getswitchinterval() == before


def test_a_forked_child_gets_working_pools_and_the_process_settings_back():
    """A child forked while a load runs elsewhere in the parent gets its GC and GIL switch
    interval back (the parent's blocks never end in the child; when they do end there they
    change nothing), its own pauses work, and its worker pools run tasks (the parent's came
    without their threads: a task would wait forever)."""
    import contextlib
    import gc

    from dbsync import gcpause, gilswitch
    from dbsync.workers import WorkerPools

    pools = WorkerPools("dbsync-test")
    assert pools.get(2).submit(lambda: 1).result(timeout=30) == 1  # threads started
    before, gc_was = sys.getswitchinterval(), gc.isenabled()

    def as_before() -> bool:
        return gc.isenabled() == gc_was and sys.getswitchinterval() == before

    blocks = contextlib.ExitStack()
    blocks.enter_context(gcpause.paused())
    blocks.enter_context(gilswitch.fast_switching())
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only, whatever happens
        ok = False
        try:
            inside = as_before() and pools.get(2).submit(lambda: 7).result(timeout=20) == 7
            with gcpause.paused():
                blocks.close()  # the parent's blocks end here too, inside the child's pause
                paused = not gc.isenabled()
            ok = inside and paused and as_before()
        finally:
            os._exit(0 if ok else 3)
    assert not gc.isenabled()  # the parent's blocks still run
    blocks.close()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert as_before()
