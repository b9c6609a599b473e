"""A vision-language model across a swap: vLLM keeps the vision encoder's outputs by image (an
image sent again is not encoded again), so after a swap an image seen before was answered with
the old encoder's embeddings and the new decoder: neither version, while the engine reported
the new one. The engine now drops that cache with every swap, as vLLM's own update path does.

The engine runs in a child process (``multimodal_worker.py``) with ``torchvision_standin`` on
its path: vLLM's CPU build imports torchvision for every vision model, which this model never
calls, and PyPI's wheels of it break vLLM on CPU (see the stand-in's docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_helpers import child_env

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent


def test_images_seen_before_a_swap_are_answered_with_the_new_weights(tmp_path: Path) -> None:
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "torchvision_standin"), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, str(HERE / "multimodal_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["served_a"] != result["fresh_b"]  # (A and B answer each image differently)
    assert result["after_push_b"] == result["fresh_b"]
