"""transformers models pushed and loaded as modules: a mixture-of-experts model, whose experts
transformers keeps fused in memory (one tensor per projection), is published under its
checkpoint's names (one tensor per expert and projection, what a served engine expects), from
views of its own tensors; and a version under those names loads back into such a module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dbsync
from dbsync.hfcheckpoint import checkpoint_views, destinations
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


SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, eos_token_id=0, bos_token_id=0)
MOE_CONFIGS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                       num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1,
                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_the_views_are_what_save_pretrained_writes(kind: str) -> None:
    """Names and values exactly as transformers' own conversion (``save_pretrained``), each a
    view inside the model's own tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    config_name, model_name, extra = MOE_CONFIGS[kind]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**SMALL, **extra))
    state = model.state_dict()
    views = checkpoint_views(model, state)
    written = revert_weight_conversion(model, dict(state))
    assert views is not None and list(views) == list(written) and len(views) > len(state)
    assert all(torch.equal(views[name], written[name]) for name in written)
    loads_into = destinations(model, dict(state), written)  # (the views, where writable)
    assert {n: t.data_ptr() for n, t in loads_into.items()} == {
        n: t.data_ptr() for n, t in views.items()}
