"""transformers models pushed and loaded as modules: a mixture-of-experts model, whose experts
transformers keeps fused in memory (one tensor per projection), is published under its
checkpoint's names (one tensor per expert and projection, what a served engine expects), from
views of its own tensors; and a version under those names loads back into such a module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dbsync
from dbsync.hfcheckpoint import checkpoint_views
from dbsync.testing import make_tiny_qwen2, make_tiny_qwen2_moe

transformers = pytest.importorskip("transformers")
load_file = pytest.importorskip("safetensors.torch").load_file


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("moe")
    return make_tiny_qwen2_moe(base / "A", seed=1), make_tiny_qwen2_moe(base / "B", seed=2)


def _module(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_an_moe_module_is_published_under_its_checkpoint_names(moe, tmp_path: Path) -> None:
    model_a, _ = moe
    module = _module(model_a)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in module.state_dict())
    state = module.state_dict()
    views = checkpoint_views(module, state)
    fused = {t.untyped_storage().data_ptr() for t in state.values()}
    assert views is not None and all(  # (no copy of the experts: views of the module's own)
        t.untyped_storage().data_ptr() in fused for t in views.values())

    with dbsync.Sender(tmp_path / "store") as sender, dbsync.Receiver(tmp_path / "store") as rx:
        sender.push(module)
        got: dict[str, torch.Tensor] = {}
        rx.load(lambda pairs: got.update((name, t.clone()) for name, t in pairs))
    expected = _checkpoint(model_a)
    assert list(got) == list(views) and set(got) == set(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_a_version_under_checkpoint_names_loads_into_an_moe_module(moe, tmp_path: Path) -> None:
    model_a, model_b = moe
    module, wanted = _module(model_a), _module(model_b)
    with dbsync.Sender(tmp_path / "store") as sender, dbsync.Receiver(tmp_path / "store") as rx:
        sender.push(model_b)  # the checkpoint directory itself
        rx.load(module)
        assert all(torch.equal(module.state_dict()[k], v) for k, v in wanted.state_dict().items())

        with torch.no_grad():  # a change inside one expert's part of a fused tensor
            wanted.model.layers[1].mlp.experts.gate_up_proj[3, 45, 7] += 1.0
        sender.push(wanted)  # a module: published from views, loaded into views
        rx.load(module)
        assert torch.equal(module.model.layers[1].mlp.experts.gate_up_proj,
                           wanted.model.layers[1].mlp.experts.gate_up_proj)


def test_a_dense_module_keeps_its_own_names(tmp_path: Path) -> None:
    module = _module(make_tiny_qwen2(tmp_path / "dense", seed=1))
    assert checkpoint_views(module, module.state_dict()) is None
    with dbsync.Sender(tmp_path / "store") as sender, dbsync.Receiver(tmp_path / "store") as rx:
        sender.push(module)
        assert [t.name for t in rx.manifest().tensors] == list(module.state_dict())
