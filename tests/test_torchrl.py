"""``dbsync.torchrl`` through torchrl 0.14.1's own code: its ``UpdateWeights`` trainer hook and
``Collector`` weight sync drive a real vLLM (CPU) engine, which then serves the pushed weights
token for token; the scheme matches torchrl's ``VLLMDoubleBufferSyncScheme`` name for name.

Runs in ``.venv-torchrl`` (``make test`` creates it: torchrl 0.14.1 with the tensordict it pins,
below 0.15, over the main environment's torch and vLLM). Where torchrl is missing this module
is skipped, unless DBSYNC_REQUIRE_TORCHRL=1 (set by ``make test``) makes that a failure.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

if os.environ.get("DBSYNC_REQUIRE_TORCHRL") != "1":
    pytest.importorskip("torchrl", reason="runs in .venv-torchrl (make test)")

import tensordict  # noqa: E402
import torchrl  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torchrl.collectors import Collector, MultiSyncCollector  # noqa: E402
from torchrl.envs import PendulumEnv  # noqa: E402
from torchrl.trainers import UpdateWeights  # noqa: E402
from torchrl.weight_update.llm import (  # noqa: E402
    VLLMDoubleBufferSyncScheme as TorchrlDoubleBufferScheme,
)
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme  # noqa: E402

import dbsync  # noqa: E402
from dbsync import IncompatibleWeightsError, InvalidWeightsError  # noqa: E402
from dbsync.torchrl import VLLMDoubleBufferSyncScheme  # noqa: E402
from tests.vllm_helpers import engine_kwargs, greedy, reference, tiny_model  # noqa: E402


def shipped(scheme: Any) -> Any:
    """The scheme as a worker process receives it: rebuilt from the state its pickle protocol
    exports (``__getstate__`` / ``__setstate__``, what torchrl's pickling calls), without
    serializing to bytes."""
    return copy.deepcopy(scheme)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:state_dict strategy is experimental")]
STRATEGIES = ["tensordict", "state_dict"]


def test_environment_is_torchrls() -> None:
    """The versions this module claims to test (and pyproject's lowest tensordict)."""
    if os.environ.get("DBSYNC_REQUIRE_TORCHRL") != "1":
        pytest.skip("only checked in .venv-torchrl")
    assert torchrl.__version__ == "0.14.1"
    assert tensordict.__version__ == "0.14.3"


def hf_model(name: str) -> nn.Module:
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32)


class Pendulum(nn.Module):
    """A tiny policy for torchrl's pure-torch PendulumEnv."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("scale", torch.ones(1))  # persistent: published
        self.register_buffer("cache", torch.zeros(3), persistent=False)  # not a weight

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.stack([th, thdot], -1)) * self.scale


def assert_collected_with(batch: Any, w: float, i: int) -> None:
    """The batch's actions are those of ``pendulum_policy(fill=w)`` (weight w, bias -w)."""
    expected = w * (batch["th"] + batch["thdot"]) - w
    assert torch.allclose(batch["action"].squeeze(-1), expected, atol=1e-5), i


def pendulum_policy(fill: float | None = None) -> TensorDictModule:
    policy = TensorDictModule(Pendulum(), in_keys=["th", "thdot"], out_keys=["action"])
    if fill is not None:
        with torch.no_grad():
            policy.module.lin.weight.fill_(fill)
            policy.module.lin.bias.fill_(-fill)
    return policy


@pytest.fixture(scope="module")
def engine() -> Any:
    """One engine started from checkpoint A, and A's greedy completions."""
    from vllm import LLM

    from dbsync import vllm as dbsync_vllm

    reference("B")  # overlaps this engine's start-up
    llm = LLM(model=str(tiny_model("A")), **engine_kwargs(**dbsync_vllm.engine_args()))
    yield llm, greedy(llm)
    llm.llm_engine.engine_core.shutdown()


# ---- torchrl's flows into a real engine ----------------------------------------------------
def test_update_weights_hook_drives_vllm(engine: Any, tmp_path: Path) -> None:
    """torchrl's UpdateWeights trainer hook pushes through the scheme's sender (tensordict
    extraction of a transformers model); the receiver's poll_and_apply swaps each version into
    the engine, which then answers with the pushed weights' tokens."""
    llm, a_tokens = engine
    b_tokens = reference("B").result()
    assert b_tokens != a_tokens
    scheme = VLLMDoubleBufferSyncScheme(remote_addr=str(tmp_path / "store"), num_threads=2,
                                        strategy="tensordict")
    receiver = scheme.create_receiver(llm)  # before the trainer created the store
    with pytest.raises(dbsync.StoreNotFoundError, match="still does not exist after 0.2 s"):
        receiver.poll_and_apply(timeout=0.2)  # a wrong path is not "nothing new" forever

    trainer_model = hf_model("B")
    sender = scheme.create_sender()
    sender.register_model(trainer_model)
    hook = UpdateWeights(sender=sender, update_weights_interval=2)
    hook()  # first of two batches: torchrl's hook does not push yet
    assert not os.path.exists(scheme.remote_addr)
    hook()
    assert receiver.poll_and_apply() is True
    assert receiver.version == 1 and llm.get_weight_version() == "1"
    assert greedy(llm) == b_tokens
    assert receiver.poll_and_apply() is False  # already serving the newest

    trainer_model.load_state_dict(hf_model("A").state_dict())  # "training" moves to A
    hook()
    hook()
    assert receiver.poll_and_apply() is True
    assert receiver.version == 2 and llm.get_weight_version() == "2"
    assert greedy(llm) == a_tokens
    assert receiver.status()["version"] == 2
    receiver.close()
    scheme.shutdown()


def test_collector_sync_drives_vllm_through_torchrls_receive(engine: Any,
                                                            tmp_path: Path) -> None:
    """A torchrl Collector holds the scheme (init_on_sender + connect), collects, and
    update_policy_weights_ sends through it (state_dict extraction); a receiver-side copy of
    the scheme (pickled, as torchrl ships schemes to workers) goes through torchrl's
    init_on_receiver/connect/receive into the engine."""
    llm, a_tokens = engine
    b_tokens = reference("B").result()
    store = str(tmp_path / "store")
    scheme = VLLMDoubleBufferSyncScheme(store, strategy="state_dict")
    collector = Collector(PendulumEnv(), pendulum_policy(), frames_per_batch=8,
                          total_frames=16, weight_sync_schemes={"vllm": scheme},
                          auto_register_policy_transforms=False)
    try:
        assert scheme.initialized_on_sender and scheme.synchronized_on_sender
        assert next(iter(collector)).numel() == 8
        collector.update_policy_weights_(hf_model("B"), model_id="vllm")
        assert scheme.version == 1

        worker_side = shipped(scheme)
        worker_side.init_on_receiver(model_id="vllm", model=llm)
        worker_side.connect(worker_idx=0)  # a late joiner applies the current version
        assert llm.get_weight_version() == "1" and greedy(llm) == b_tokens
        assert worker_side.receive() is None  # nothing newer

        collector.update_policy_weights_(hf_model("A"), model_id="vllm")
        assert scheme.version == 2
        assert worker_side.receive() == 2
        assert llm.get_weight_version() == "2" and greedy(llm) == a_tokens

        # A version the served model does not fit is refused by name; 2 keeps serving.
        collector.update_policy_weights_(hf_model("C"), model_id="vllm")
        with pytest.raises(IncompatibleWeightsError, match="mlp.down_proj.weight"):
            worker_side.receive()
        assert llm.get_weight_version() == "2" and greedy(llm) == a_tokens
        worker_side.shutdown()
    finally:
        collector.shutdown()
        scheme.shutdown()


# ---- the scheme through torchrl's double-buffer code paths ---------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_names_and_values_as_torchrls_scheme(strategy: str, tmp_path: Path) -> None:
    """Both schemes' sender -> transport round trip on the same model: the same tensors under
    the same names, except the non-persistent buffers torchrl's tensordict extraction adds."""
    model = hf_model("B")
    theirs = TorchrlDoubleBufferScheme(remote_addr=str(tmp_path / "torchrl"), strategy=strategy)
    ours = VLLMDoubleBufferSyncScheme(remote_addr=str(tmp_path / "dbsync"), strategy=strategy)
    for scheme in (theirs, ours):
        sender = scheme.create_sender()
        sender.register_model(model)
        sender.update_weights()
    got_theirs = theirs.create_transport().receive_weights()
    got_ours = ours.create_transport().receive_weights()
    names = set(model.state_dict())
    assert set(got_ours.keys()) == names
    extra = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert set(got_theirs.keys()) == (names | extra if strategy == "tensordict" else names)
    for name in names:
        assert torch.equal(got_ours[name], got_theirs[name]), name
    ours.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_double_buffer_paths_on_modules(strategy: str, tmp_path: Path) -> None:
    """torchrl's sender/receiver/transport calls and its 0.10 names (init_on_worker,
    get_sender, get_receiver), with versions where torchrl has none and errors where it skips."""
    store = str(tmp_path / "store")
    scheme = VLLMDoubleBufferSyncScheme(store, strategy=strategy)
    assert isinstance(scheme, WeightSyncScheme) and scheme.strategy_str == strategy
    trained = pendulum_policy(fill=0.5)
    scheme.init_on_sender(model_id="policy", model=trained)
    scheme.connect()  # the initial weights, as torchrl's schemes ship them
    assert scheme.version == 1 and dbsync.Receiver(store).latest_version() == 1
    assert scheme.send() == 2  # the model given to init_on_sender
    transport = scheme.create_transport()
    assert transport.send_weights("vllm_model", trained) == 3  # torchrl's call shape
    with pytest.raises(ValueError, match="worker_ids"):
        scheme.send(worker_ids=[0])
    with pytest.raises(InvalidWeightsError, match="empty"):
        scheme.send(weights={})

    worker = shipped(scheme)
    target = pendulum_policy(fill=0.0)
    worker.init_on_worker("policy", model=target)
    worker.connect(worker_idx=0)  # applies version 3
    receiver = worker.get_receiver()
    assert receiver.version == 3
    assert torch.equal(target.module.lin.weight, trained.module.lin.weight)
    assert receiver.poll_and_apply() is False
    with torch.no_grad():
        trained.module.lin.weight.fill_(-2.0)
    assert scheme.get_sender().update_weights() == 4
    got = worker.receive()
    assert sorted(got.keys()) == ["module.lin.bias", "module.lin.weight", "module.scale"]
    assert torch.equal(target.module.lin.weight, trained.module.lin.weight)
    # weights applied by hand: no version is claimed, and the next poll restores version 4
    # (it said "nothing newer", leaving the hand-applied weights for good)
    receiver.apply_weights({"module.lin.weight": torch.zeros(1, 2)})
    assert receiver.version is None and not target.module.lin.weight.any()
    assert receiver.poll_and_apply() is True and receiver.version == 4
    assert torch.equal(target.module.lin.weight, trained.module.lin.weight)
    with pytest.raises(RuntimeError, match="init_on_sender"):
        worker.get_sender()
    worker.shutdown()
    scheme.shutdown()
    assert dbsync.Receiver(store).latest_version() == 4
    # shut down means released: no call takes the writer lock again, nor re-reads a version
    with pytest.raises(RuntimeError, match="shut down"):
        scheme.send()
    with pytest.raises(RuntimeError, match="shut down"):
        worker.receive()
    with dbsync.Sender(store) as another:  # the lock is free
        assert another.push(trained) == 5
    assert not os.listdir(os.path.join(store, "readers"))  # no lease left behind


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_module_that_does_not_fit_is_refused_untouched(strategy: str, tmp_path: Path
                                                         ) -> None:
    """A receiver module whose shapes or names differ from the published version: one
    IncompatibleWeightsError naming every problem, nothing applied (before: tensordict's bare
    KeyError with the module holding parts of two versions), and no version taken."""
    store = str(tmp_path / "store")
    scheme = VLLMDoubleBufferSyncScheme(store, strategy=strategy)
    sender = scheme.create_sender()
    trained = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    sender.register_model(trained)  # (held by a weak reference)
    assert sender.update_weights() == 1
    wider = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    extra = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    extra.register_buffer("extra", torch.zeros(1))
    for target, named in ((wider, {"2.weight", "2.bias"}), (extra, {"extra"})):
        before = {k: v.clone() for k, v in target.state_dict().items()}
        receiver = scheme.create_receiver(target)
        with pytest.raises(IncompatibleWeightsError) as refused:
            receiver.poll_and_apply()
        assert set(refused.value.problems) == named, refused.value.problems
        assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
        assert receiver.version is None
        receiver.close()
    scheme.shutdown()


def test_engine_receiver_refuses_what_torchrl_would_apply_unversioned(engine: Any,
                                                                     tmp_path: Path) -> None:
    """apply_weights(tensors) would bypass versions and checks: refused for an engine, with
    what to do instead."""
    llm, _ = engine
    scheme = VLLMDoubleBufferSyncScheme(str(tmp_path / "store"))
    receiver = scheme.create_receiver(llm)
    with pytest.raises(dbsync.DBSyncError, match="poll_and_apply"):
        receiver.apply_weights({"lm_head.weight": torch.zeros(1)})
    receiver.close()


def test_multiprocess_collector_workers_follow_the_store(tmp_path: Path) -> None:
    """torchrl's MultiSyncCollector ships the scheme to two worker processes. Their policies
    start without weights (torchrl sends them on the meta device): connect gives them the
    initial version; a background receiver applies each update, and send() returns only once
    both workers applied it, so every batch is collected with the weights last pushed."""
    policy = pendulum_policy(fill=1.0)
    scheme = VLLMDoubleBufferSyncScheme(str(tmp_path / "store"))
    collector = MultiSyncCollector([PendulumEnv, PendulumEnv], policy, frames_per_batch=8,
                                   total_frames=64, weight_sync_schemes={"policy": scheme},
                                   auto_register_policy_transforms=False)
    try:
        for i, batch in enumerate(collector):
            w = 1.0 + i
            assert_collected_with(batch, w, i)
            with torch.no_grad():
                policy.module.lin.weight.fill_(w + 1)
                policy.module.lin.bias.fill_(-(w + 1))
            collector.update_policy_weights_()
            assert scheme.version == i + 2
            if i == 2:
                break
    finally:
        collector.shutdown()
        scheme.shutdown()
    status = dbsync.Receiver(str(tmp_path / "store")).latest_version()
    assert status == 4


def test_a_worker_policy_without_weights_is_refused_a_version_of_another_shape(
        tmp_path: Path) -> None:
    """A collector worker's policy starts on the meta device and gets the first version out of
    place. That path checked nothing: a version with fewer tensors left parameters on the
    meta device (the worker failed later, on an unrelated-looking device error), and one of
    other shapes replaced them silently. Both are refused now, every problem named, nothing
    applied."""
    from torch import nn

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.extra = nn.Linear(2, 2)

    root = str(tmp_path / "store")
    published = [{"lin.weight": torch.ones(1, 2), "lin.bias": torch.ones(1)},
                 {"lin.weight": torch.ones(3, 2), "lin.bias": torch.ones(3),
                  "extra.weight": torch.ones(2, 2), "extra.bias": torch.ones(2)}]
    said = ["extra.weight: missing from the published version",
            "lin.weight: shape [3, 2] != the model's [1, 2]"]
    for weights, problem in zip(published, said, strict=True):
        with dbsync.Sender(root) as sender:
            sender.push(weights)
        with torch.device("meta"):
            policy = Policy()
        scheme = VLLMDoubleBufferSyncScheme(root, connect_timeout=30)
        scheme.init_on_receiver(model_id="policy", model=policy)
        try:
            with pytest.raises(dbsync.IncompatibleWeightsError, match="nothing was applied"
                               ) as refused:
                scheme.connect()
            assert problem in str(refused.value)
            assert all(p.is_meta for p in policy.parameters())
        finally:
            scheme.shutdown()


# ---- what torchrl users run into -------------------------------------------------------------
def test_a_single_process_collector_collects_with_the_weights_it_sends(tmp_path: Path) -> None:
    """A single-process ``Collector`` runs its policy in the trainer's process, where no
    receiver is: ``update_policy_weights_(new)`` published ``new`` to the store while the
    collector went on collecting with the old weights, saying nothing. The scheme now copies
    what it sends into that policy too (checked first: nothing is published for a policy the
    weights do not fit), so every batch is collected with the weights last sent."""
    policy = pendulum_policy(fill=1.0)
    scheme = VLLMDoubleBufferSyncScheme(str(tmp_path / "store"))
    collector = Collector(PendulumEnv(), policy, frames_per_batch=8, total_frames=32,
                          weight_sync_schemes={"policy": scheme},
                          auto_register_policy_transforms=False)
    try:
        for i, batch in enumerate(collector):
            w = 1.0 + i
            assert_collected_with(batch, w, i)
            collector.update_policy_weights_(tensordict.TensorDict.from_module(
                pendulum_policy(fill=w + 1)))
            with dbsync.Receiver(scheme.remote_addr) as rx:
                got = rx.open().tensors()
                assert rx.latest_version() == scheme.version and float(
                    dict(got)["module.lin.weight"].flatten()[0]) == w + 1
        other = TensorDictModule(nn.Linear(3, 1), in_keys=["th"], out_keys=["action"])
        published = scheme.version
        with pytest.raises(IncompatibleWeightsError):
            collector.update_policy_weights_(tensordict.TensorDict.from_module(other))
        assert scheme.version == published  # (refused before publishing)
    finally:
        collector.shutdown()
        scheme.shutdown()


def test_bad_scheme_options_are_refused_before_anything_is_published_and_waits_are_kept(
        tmp_path: Path) -> None:
    """``wait_for=-1`` never waited and a NaN ``wait_timeout`` raised only after ``send`` had
    published; both are refused at construction now. ``sender.update_weights()`` (the path of
    torchrl's ``UpdateWeights`` hook) ignored ``wait_for``: it waits as ``send`` does."""
    store = str(tmp_path / "store")
    for options, what in (({"wait_for": -1}, "wait_for"),
                          ({"wait_timeout": float("nan")}, "wait_timeout"),
                          ({"connect_timeout": -1.0}, "connect_timeout"),
                          ({"poll_interval": -1.0}, "poll_interval"),
                          # (a bare TypeError, or accepted until the first send)
                          ({"num_threads": "8"}, "num_threads"),
                          ({"num_threads": 2.5}, "num_threads"),
                          ({"dtype": torch.int8}, "16 bits or more"),
                          ({"durable": "no"}, "durable"), ({"verify": "no"}, "verify")):
        with pytest.raises(ValueError, match=what):
            VLLMDoubleBufferSyncScheme(store, **options)
    assert not os.path.exists(store)
    scheme = VLLMDoubleBufferSyncScheme(store, wait_for=1, wait_timeout=0.5)
    try:
        sender = scheme.create_sender()
        model = nn.Linear(2, 2)
        sender.register_model(model)
        with pytest.raises(TimeoutError, match="fewer than 1 receivers applied version 1"):
            sender.update_weights()
    finally:
        scheme.shutdown()


def test_nested_dict_weights_publish_dotted_names_as_torchrls_scheme(tmp_path: Path) -> None:
    """``update_weights({"lin": {"weight": w, "bias": b}})``: torchrl's scheme sends it as a
    TensorDict (``lin.weight``, ``lin.bias``); it was refused here as "a training checkpoint"."""
    weights = {"lin": {"weight": torch.randn(3, 2), "bias": torch.randn(3)}}
    theirs = TorchrlDoubleBufferScheme(remote_addr=str(tmp_path / "torchrl"))
    ours = VLLMDoubleBufferSyncScheme(remote_addr=str(tmp_path / "dbsync"))
    for scheme in (theirs, ours):
        sender = scheme.create_sender()
        sender.register_model(nn.Linear(2, 3))
        sender.update_weights(copy.deepcopy(weights))
    got_theirs = theirs.create_transport().receive_weights()
    got_ours = ours.create_transport().receive_weights()
    assert set(got_ours.keys()) == set(got_theirs.keys()) == {"lin.weight", "lin.bias"}
    for name in ("weight", "bias"):
        assert torch.equal(got_ours[f"lin.{name}"], weights["lin"][name])
    ours.shutdown()


def test_a_tensordict_of_the_registered_model_leaves_out_its_non_persistent_buffers(
        tmp_path: Path) -> None:
    """``update_weights(TensorDict.from_module(model))`` publishes what the model's own
    extraction publishes: its state_dict, not the rotary ``inv_freq`` tables (an engine
    refuses those by name)."""
    model = hf_model("B")
    scheme = VLLMDoubleBufferSyncScheme(remote_addr=str(tmp_path / "store"))
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.update_weights(tensordict.TensorDict.from_module(model))
    got = scheme.create_transport().receive_weights()
    assert set(got.keys()) == set(model.state_dict())
    scheme.shutdown()


def scheme_with_version_1(root: Path) -> tuple[Any, nn.Module]:
    """A scheme over ``root`` whose sender published version 1 of a small model (returned:
    the sender holds it by a weak reference only)."""
    scheme = VLLMDoubleBufferSyncScheme(remote_addr=str(root))
    sender = scheme.create_sender()
    model = nn.Linear(2, 2)
    sender.register_model(model)
    assert sender.update_weights() == 1
    return scheme, model


def test_a_transport_refuses_to_receive_after_shutdown_and_leaves_no_reader(
        tmp_path: Path) -> None:
    """TORCHRL.md: shutdown releases the readers' leases, and receiving afterwards raises.
    A transport the scheme made received on, registering a reader nothing released."""
    root = tmp_path / "store"
    scheme, _model = scheme_with_version_1(root)
    transport = scheme.create_transport()
    assert transport.receive_weights() is not None  # (a reader with a lease)
    assert os.listdir(root / "readers")
    scheme.shutdown()
    assert not os.listdir(root / "readers")  # its lease is released with the scheme
    with pytest.raises(RuntimeError, match="shut down"):
        transport.receive_weights()
    assert not os.listdir(root / "readers")


def test_a_receiver_whose_store_was_removed_says_so_at_once(tmp_path: Path) -> None:
    """The store a receiver applied version 1 from is removed (a lost mount): each
    ``poll_and_apply()`` waited out its whole timeout (180 s by default) before raising."""
    import shutil
    import time

    root = tmp_path / "store"
    scheme, _model = scheme_with_version_1(root)
    target = nn.Linear(2, 2)
    receiver = scheme.create_receiver(target)
    assert receiver.poll_and_apply() and receiver.version == 1
    scheme.shutdown()  # (the trainer is done; then the store goes)
    shutil.rmtree(root)
    started = time.monotonic()
    with pytest.raises(dbsync.StoreNotFoundError, match="no longer exists.*keeps version 1"):
        receiver.poll_and_apply(timeout=30)
    assert time.monotonic() - started < 5
    receiver.close()
