"""A server started after a version was published serves that version from its first request."""

from __future__ import annotations

from pathlib import Path

import pytest

import dbsync
from tests.vllm_helpers import PROMPTS, complete, reference, running_server, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_late_joiner_serves_current_version(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with dbsync.Sender(store) as sender:
        sender.push(str(tiny_model("C")))  # an older, unfit version: superseded, never read
        version = sender.push(str(tiny_model("B")))
    expected = reference("B")
    with running_server(store, tiny_model("A"), tmp_path / "server.log") as server:
        status = server.status()  # the first answer the port ever gave
        assert status["version"] == version
        assert status["healthy"] is True
        assert status["last_error"] is None
        assert status["refused_versions"] == []
        got = [complete(server.base, server.model, p) for p in PROMPTS]
    assert got == expected.result()
