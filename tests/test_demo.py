"""The demo's trainer, without vLLM: it publishes versions a Receiver loads, and those weights
(not the model directory's) are what a fresh model answers with."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import dbsync
from dbsync import demo, demo_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("demo") / "model"
    info = demo_trainer.make_model(path, seed=0)
    assert info["parameters"] > 300_000
    return str(path)


def load_version(root: str) -> tuple[int, dict[str, torch.Tensor]]:
    got: dict[str, torch.Tensor] = {}
    with dbsync.Receiver(root, reader_id="demo-test") as rx:
        version = rx.load(lambda pairs: got.update((n, t.clone()) for n, t in pairs))
    return version, got


def test_model_directory_is_a_tiny_qwen2_with_a_word_tokenizer(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "qwen2"
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 2, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    _, tokenizer = demo_trainer.load_model(model_dir)
    ids = tokenizer(demo_trainer.SENTENCE)["input_ids"]
    assert len(ids) == len(demo_trainer.SENTENCE.split())  # one token per word
    assert tokenizer.decode(ids) == demo_trainer.SENTENCE


def test_trainer_pushes_versions_a_receiver_loads(model_dir, tmp_path):
    root = str(tmp_path / "store")
    seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    def on_push(pushed: demo_trainer.Pushed) -> None:
        seen.append(load_version(root))  # what a receiver gets right after this push

    pushed, model = demo_trainer.train(model_dir, root, steps=5, push_every=2, on_push=on_push)
    assert [(p.version, p.step) for p in pushed] == [(1, 2), (2, 4), (3, 5)]
    assert [v for v, _ in seen] == [1, 2, 3]
    assert pushed[0].loss > pushed[-1].loss
    # Every published version is the complete set of the model's weights, in fp32 ...
    state = model.state_dict()
    for _, tensors in seen:
        assert list(tensors) == list(state)
        assert all(t.dtype == torch.float32 for t in tensors.values())
    # ... the last one is exactly the trained model, and versions differ from each other.
    for name, tensor in state.items():
        assert torch.equal(seen[-1][1][name], tensor), name
    assert not torch.equal(seen[0][1]["lm_head.weight"], seen[-1][1]["lm_head.weight"])


def test_published_weights_learn_the_sentence(model_dir, tmp_path):
    """What the demo shows, without a server: a fresh model loaded from the store completes
    the prompt with the target once trained, and did not before."""
    root = str(tmp_path / "store")
    fresh, tokenizer = demo_trainer.load_model(model_dir)
    before = demo_trainer.complete(fresh, tokenizer)
    assert before.strip() != demo_trainer.TARGET.strip()
    demo_trainer.train(model_dir, root, steps=24, push_every=12)
    version, tensors = load_version(root)
    assert version == 2
    fresh.load_state_dict(tensors)
    assert demo_trainer.complete(fresh, tokenizer).strip() == demo_trainer.TARGET.strip()


def test_demo_refuses_to_wipe_a_directory_it_did_not_make(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    with pytest.raises(demo.DemoError, match="not made by this demo"):
        demo.prepare_dir(precious)
    assert (precious / "data.txt").read_text() == "keep me"
    work = tmp_path / "work"
    demo.prepare_dir(work)
    (work / "store").mkdir()
    demo.prepare_dir(work)  # a previous run of the demo is wiped
    assert sorted(os.listdir(work)) == [demo.MARKER]


def _group_alive(pgid: int) -> list[int]:
    return demo._group_members(pgid)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_demo_end_to_end(tmp_path):
    """``make demo`` as a user runs it: the server answers gibberish first and the sentence at
    the end, and no process of the server is left."""
    work = tmp_path / "demo"
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "dbsync.demo", "--dir", str(work)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    versions = [int(m.group(1)) for m in re.finditer(r"^ +(\d+) +\d+ +\d\.\d+ ", out, re.M)]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 2
    initial = next(line for line in out.splitlines() if line.strip().startswith("initial"))
    assert demo_trainer.TARGET.strip() not in initial
    assert out.count("<- learned") == 2
    assert "no process left" in out
    pid = int(re.search(r"pid (\d+)", out).group(1))
    assert _group_alive(pid) == []
    assert int(json.loads((work / "store" / "dbsync.json").read_text())["version"]) == versions[-1]
