import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture
def worker_env():
    """Environment for helper processes started from tests (they import dbsync from here)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def worker_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.join(REPO, "tests", "_workers.py"), *args]
