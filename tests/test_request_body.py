"""serve-vllm's finish chunk for a stream that sent no chunk takes the model's name from the
request body it kept (at most its first 64 KiB): the name a client sends ahead of a long
prompt, and nothing where the kept text does not say it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from dbsync.vllm.versions import _RequestBody  # noqa: E402


def _model(body: bytes) -> str:
    kept = _RequestBody(receive=None)
    kept._parts = [body]
    return kept.model()


@pytest.mark.parametrize(("body", "model"), [
    (b'{"model": "policy", "prompt": "w1"}', "policy"),
    (b'{"model": "policy", "prompt": "' + b"w1 " * 40_000 + b'"}', "policy"),  # cut at 64 KiB
    (b'{"prompt": "' + b"w1 " * 40_000, ""),  # the name, if any, comes after what was kept
    (b'{"model": 7}', ""),  # not a name
    (b'"policy" and more', ""),  # no "model" key: the text's first value is no name
])
def test_the_model_name_is_read_from_the_kept_body(body: bytes, model: str) -> None:
    assert _model(body) == model
