"""Bit-exact round trips through a real store on disk."""

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from tensordict import TensorDict

import dbsync
from dbsync.format import DTYPE_SIZES


def load_all(root: str) -> tuple[int, dict[str, torch.Tensor]]:
    got: dict[str, torch.Tensor] = {}
    with dbsync.Receiver(root) as receiver:
        version = receiver.load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    return version, got


def assert_bit_exact(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)  # manifest order is the input order
    for name, tensor in expected.items():
        out = got[name]
        assert out.dtype == tensor.dtype and out.shape == tensor.shape, name
        tensor = tensor.detach().resolve_conj()
        a = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else tensor
        b = out.contiguous().reshape(-1).view(torch.uint8) if out.numel() else out
        assert torch.equal(a, b), name


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in DTYPE_SIZES:
        dtype = getattr(torch, name)
        high = 2 if dtype == torch.bool else 256  # a bool byte other than 0/1 is not a bool
        raw = torch.randint(0, high, (3, 5, 8), dtype=torch.uint8, generator=g)
        item = torch.empty((), dtype=dtype).element_size()
        out[f"t.{name}"] = raw.reshape(-1)[: 120 - 120 % item].view(dtype)
    out["zero_d"] = torch.tensor(3.5, dtype=torch.bfloat16)
    out["empty"] = torch.empty(0, 7)
    out["non_contiguous"] = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    out["strided_slice"] = torch.arange(40, dtype=torch.int32)[::3]
    out["requires_grad"] = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    out["conj_view"] = torch.randn(6, dtype=torch.complex64, generator=g).conj()
    return out


@pytest.mark.parametrize("blocking", [True, False])  # (False: through the staging copy)
def test_every_dtype_and_shape_round_trips_bit_exact(root, blocking):
    weights = every_dtype()
    with dbsync.Sender(root, num_threads=3) as sender:
        result = sender.push(weights, blocking=blocking)
        assert (result if blocking else result.result(timeout=60)) == 1
    version, got = load_all(root)
    assert version == 1
    assert_bit_exact(weights, got)


def test_versions_alternate_slots_and_reuse_files(root):
    weights = {"w": torch.randn(64, 64)}
    inodes: dict[int, int] = {}
    with dbsync.Sender(root) as sender:
        for expected in range(1, 5):
            weights["w"].add_(1)
            assert sender.push(weights) == expected
            version, got = load_all(root)
            assert version == expected and torch.equal(got["w"], weights["w"])
            manifest = dbsync.Receiver(root).manifest()
            assert manifest.slot == "ab"[(expected - 1) % 2]
            path = os.path.join(root, "slots", manifest.slot, "shard-00000.bin")
            inodes[expected] = os.stat(path).st_ino
    assert inodes[1] == inodes[3] and inodes[2] == inodes[4]  # rewritten in place


def test_nonblocking_push_snapshots_before_returning(root):
    weights = {"w": torch.zeros(1000), "b": torch.zeros(3, dtype=torch.bfloat16)}
    with dbsync.Sender(root) as sender:
        future = sender.push(weights, blocking=False)
        weights["w"].fill_(7)  # the trainer moves on at once
        weights["b"].fill_(7)
        assert future.result(timeout=30) == 1
    _, got = load_all(root)
    assert torch.count_nonzero(got["w"]) == 0 and torch.count_nonzero(got["b"]) == 0


@pytest.mark.parametrize("blocking", [True, False])
def test_dtype_conversion_only_touches_floating_tensors(root, blocking):
    weights = {"f": torch.randn(10), "i": torch.arange(4),
               "fp8": torch.randn(6).to(torch.float8_e4m3fn)}  # (quantized: kept as it is)
    with dbsync.Sender(root, dtype=torch.bfloat16) as sender:
        result = sender.push(weights, blocking=blocking)
        assert (result if blocking else result.result()) == 1
    _, got = load_all(root)
    assert got["f"].dtype == torch.bfloat16 and torch.equal(got["f"], weights["f"].bfloat16())
    assert got["i"].dtype == torch.int64 and torch.equal(got["i"], weights["i"])
    assert got["fp8"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["fp8"].view(torch.uint8), weights["fp8"].view(torch.uint8))


def test_tensordict_directory_with_a_missing_file_is_refused(root, tmp_path):
    td = TensorDict({"enc": {"w": torch.ones(3)}, "head": torch.zeros(2)}, [])
    td.memmap(str(tmp_path / "td"))
    os.unlink(tmp_path / "td" / "head.memmap")
    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError,
                                                      match="head.memmap"):
        sender.push(str(tmp_path / "td"))
    assert dbsync.Receiver(root).latest_version() is None


def test_tensordict_directory_entries_named_like_its_metadata_are_published(root, tmp_path):
    """Tensors and sub-tensordicts whose keys are names tensordict uses for its own metadata
    (``meta``, ``names``, ``batch_size``, ``leaves``, ...) are entries like any other. Before,
    they were dropped without a word: a version published with tensors missing, exit 0."""
    td = TensorDict({"w": torch.ones(3), "meta": torch.arange(4.0), "leaves": torch.zeros(2),
                     "batch_size": torch.full((2,), 7.0),
                     "layers": {"names": torch.ones(1), "meta": {"weight": torch.ones(2)}}}, [])
    td.memmap(str(tmp_path / "td"))
    with dbsync.Sender(root) as sender:
        sender.push(str(tmp_path / "td"))
    _, got = load_all(root)
    want = {k: v for k, v in td.flatten_keys(".").items()}
    assert sorted(got) == sorted(want)
    assert_bit_exact(want, got)


def test_tensordict_directory_entries_its_metadata_overwrote_are_refused(root, tmp_path):
    """tensordict writes its own ``device``/``shape``/... over an entry of that name in
    ``meta.json`` (the entry's data is saved all the same): such an entry is named and the
    push refused, not published without it."""
    td = TensorDict({"a": torch.ones(3), "device": torch.arange(4.0),
                     "sub": {"shape": torch.ones(2), "w": torch.ones(1)}}, [])
    td.memmap(str(tmp_path / "td"))
    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError) as refused:
        sender.push(str(tmp_path / "td"))
    said = str(refused.value)
    assert "device: saved in" in said and "sub.shape: saved in" in said, said
    assert "rename the entry" in said
    assert dbsync.Receiver(root).latest_version() is None


@pytest.mark.parametrize("blocking", [True, False])
def test_a_nested_tensor_is_named_among_every_bad_entry(root, blocking):
    """A nested tensor (strided, torch's default layout for them) is refused by name in the
    one error listing every bad entry, nothing written (before: a bare ValueError or
    RuntimeError, and a listing without it)."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    bad = {"nt": nested, "meta": torch.empty(2, device="meta"), "ok": torch.ones(2)}
    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError) as refused:
        result = sender.push(bad, blocking=blocking)
        if not blocking:
            result.result()
    said = str(refused.value)
    assert "'nt': a nested tensor" in said and "'meta'" in said, said
    # alone next to good tensors (before: "the writer needs contiguous CPU tensors" from a
    # writer thread, or torch's internal error)
    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError) as refused:
        result = sender.push({"nt": nested, "ok": torch.ones(2)}, blocking=blocking)
        if not blocking:
            result.result()
    assert "'nt': a nested tensor" in str(refused.value)
    assert dbsync.Receiver(root).latest_version() is None


def test_a_refusal_of_many_bad_entries_stays_readable(root):
    """100,000 bad entries: the refusal counts them all and names the first 50 (before: a
    message of 8 million characters); a 10,000-character name is cut short in it."""
    bad = {"x" * 10_000: None, **{f"step{i}": i for i in range(100_000)}}
    with dbsync.Sender(root) as sender, pytest.raises(dbsync.InvalidWeightsError) as refused:
        sender.push(bad)
    said = str(refused.value)
    assert said.startswith("100001 entries cannot be published") and "and 99951 more" in said
    assert len(said) < 10_000 and "(10002 characters)" in said, len(said)
    assert dbsync.Receiver(root).latest_version() is None


def test_shapes_no_reader_takes_are_refused_before_any_write(root):
    """65 dimensions, or an empty tensor with a dimension past 2**62: refused by name (before:
    published, then refused by every reader as an invalid index, "publish again"); 64
    dimensions round-trip."""
    with dbsync.Sender(root) as sender:
        for bad in (torch.zeros([1] * 65), torch.empty(0, 2**62 + 1)):
            with pytest.raises(dbsync.InvalidWeightsError, match="at most 64 dimensions"):
                sender.push({"a": bad, "ok": torch.ones(2)})
        assert dbsync.Receiver(root).latest_version() is None
        assert sender.push({"a": torch.full([1] * 64, 3.0)}) == 1
    _, got = load_all(root)
    assert got["a"].shape == (1,) * 64 and float(got["a"].flatten()[0]) == 3.0


def test_module_tensordict_and_checkpoint_sources(root, tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with dbsync.Sender(root) as sender:
        sender.push(module)
        _, got = load_all(root)
        assert_bit_exact(dict(module.state_dict()), got)

        td = TensorDict({"a": {"b": torch.ones(2)}, "c": torch.zeros(3)}, [])
        sender.push(td)
        _, got = load_all(root)
        assert set(got) == {"a.b", "c"} and torch.equal(got["a.b"], torch.ones(2))

        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        save_file({"model.layers.0.w": torch.ones(2)}, str(ckpt / shard1))
        save_file({"model.layers.1.w": torch.full((2,), 2.0)}, str(ckpt / shard2))
        weight_map = {"model.layers.0.w": shard1, "model.layers.1.w": shard2}
        (ckpt / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
        assert sender.push(str(ckpt)) == 3
        _, got = load_all(root)
        assert list(got) == ["model.layers.0.w", "model.layers.1.w"]
        assert torch.equal(got["model.layers.1.w"], torch.full((2,), 2.0))


def test_snapshot_opens_as_a_tensordict(root):
    weights = {"layer.weight": torch.randn(3, 4).bfloat16(), "odd/name": torch.arange(3),
               "fp8": torch.ones(4).to(torch.float8_e4m3fn)}
    with dbsync.Sender(root) as sender:
        sender.push(weights)
    with dbsync.Receiver(root) as receiver, receiver.open() as snap:
        td = snap.tensordict()
        for name, tensor in weights.items():
            assert td[name].dtype == tensor.dtype
            assert torch.equal(td[name].view(torch.uint8), tensor.view(torch.uint8))


names = st.lists(st.sampled_from(list("ab/._-Zü✓ 0") + ["..", "/"]), min_size=1,
                 max_size=8).map("".join)
tensors = st.builds(
    lambda shape, dtype, seed: torch.randn(shape, generator=torch.Generator().manual_seed(seed)
                                            ).to(dtype),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.bool]),
    st.integers(0, 2**16),
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(names, tensors, min_size=1, max_size=6))
def test_random_dicts_and_names_round_trip(tmp_path_factory, weights):
    root = str(tmp_path_factory.mktemp("case") / "store")
    with dbsync.Sender(root, num_threads=2) as sender:
        sender.push(weights)
        sender.push(weights)
    _, got = load_all(root)
    assert_bit_exact(weights, got)
    for dirpath, _dirs, files in os.walk(os.path.dirname(root)):  # nothing outside the store
        assert all(os.path.join(dirpath, f).startswith(root + os.sep) for f in files)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/abs/path", "a/../../b", "..", ".hidden",
                                  "con", "x" * 400, "shape", "_x_lookalike"])
def test_traversal_looking_names_stay_inside_the_slot(root, name):
    with dbsync.Sender(root) as sender:
        sender.push({name: torch.ones(2)})
    store_files = []
    for dirpath, _dirs, files in os.walk(os.path.dirname(root)):
        store_files += [os.path.join(dirpath, f) for f in files]
    assert all(p.startswith(root + os.sep) for p in store_files)
    _, got = load_all(root)
    assert list(got) == [name] and torch.equal(got[name], torch.ones(2))


def test_a_module_pushed_as_a_tensordict_loads_into_the_same_kind_of_module(tmp_path):
    """``strategy="tensordict"`` publishes a module's parameters and persistent buffers (its
    state_dict's tensors), not its non-persistent buffers (a rotary table computed at
    construction): a receiver loading into the same kind of module has nowhere to put them."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)
            self.register_buffer("steps", torch.zeros(1))
            self.register_buffer("table", torch.arange(6.0), persistent=False)

    source, target = Block(), Block()
    source.steps.fill_(9.0)
    root = str(tmp_path / "store")
    with dbsync.Sender(root, strategy="tensordict") as sender:
        sender.push(source)
    with dbsync.Receiver(root) as rx:
        assert {e.name for e in rx.manifest().tensors} == {"lin.weight", "lin.bias", "steps"}
        assert rx.load(target) == 1
    for name, want in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], want), name


def test_a_nested_tensordict_loads_in_place(tmp_path):
    from tensordict import TensorDict

    source = TensorDict({"a": {"b": torch.arange(4.0), "c": torch.ones(2, 2)},
                         "d": torch.full((3,), 5.0)}, batch_size=[])
    target = source.apply(torch.zeros_like)
    leaf = target["a", "b"]
    root = str(tmp_path / "store")
    with dbsync.Sender(root) as sender:
        sender.push(source)
    with dbsync.Receiver(root) as rx:
        assert rx.load(target) == 1
    assert (target == source).all()
    assert target["a", "b"] is leaf  # copied into the tensors the caller holds


def test_a_compiled_module_publishes_and_loads_under_its_own_names(tmp_path):
    """``torch.compile(model)`` names every tensor ``_orig_mod.<name>`` in its state_dict:
    pushed as is, it fitted no plain model. It publishes the model's own names, and a compiled
    receiver model loads them too."""
    import dbsync

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    trained = model()
    root = tmp_path / "store"
    with dbsync.Sender(root, durable=False) as sender:
        sender.push(torch.compile(trained))
    plain, compiled = model(), torch.compile(model())
    with dbsync.Receiver(root) as receiver:
        with receiver.open() as snap:
            assert [t.name for t in snap.manifest.tensors] == list(trained.state_dict())
        assert receiver.load(plain) == 1 and receiver.load(compiled) == 1
    for name, tensor in trained.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor)
        assert torch.equal(compiled._orig_mod.state_dict()[name], tensor)


def test_wrapped_modules_publish_the_plain_models_names(tmp_path):
    """``sender.push(ddp_model)`` (the natural call on rank 0) published ``module.<name>`` and
    a compiled submodule ``<path>._orig_mod.<name>``: no plain engine model fitted them. The
    wrappers are looked through; a version that does fit only with a prefix says so."""
    import dbsync

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = torch.nn.DataParallel(plain)  # (DDP's naming, with no process group needed)
    partly = torch.nn.Sequential(torch.compile(plain[0]), plain[1], plain[2])
    root = tmp_path / "store"
    with dbsync.Sender(root, durable=False) as sender, dbsync.Receiver(root) as rx:
        for version, model in enumerate((wrapped, partly), start=1):
            assert sender.push(model) == version
            with rx.open() as snap:
                assert [t.name for t in snap.manifest.tensors] == list(plain.state_dict())
            target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(),
                                         torch.nn.Linear(4, 2))
            assert rx.load(target) == version
            for name, tensor in plain.state_dict().items():
                assert torch.equal(target.state_dict()[name], tensor)
        sender.push({f"model.{k}": v for k, v in plain.state_dict().items()})
        with pytest.raises(dbsync.IncompatibleWeightsError,
                           match="published names carry an extra prefix 'model.'"):
            rx.load(target)
