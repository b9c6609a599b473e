"""Which weight version answered each HTTP request of ``serve-vllm``.

vLLM labels each generated token with the weight version that produced it
(``CompletionOutput.weight_versions``: spans over output tokens, set on the final output).
``serve-vllm`` labels each applied dbsync version with its number, and the model's own
checkpoint is labelled ``default``. This module passes those labels on to plain OpenAI clients:

- non-streaming responses get two headers: ``x-dbsync-version`` (the version that produced the
  first generated token, i.e. the version the request was admitted to) and
  ``x-dbsync-versions`` (every version that produced tokens, comma-separated, in order; two
  or more only when the request was held across a swap with pause mode ``keep``);
- streaming responses (``text/event-stream``) carry the same as JSON fields in every chunk sent
  after the last output was generated (the chunk with ``finish_reason``, and the usage chunk
  if requested): ``"dbsync_version": 3, "dbsync_versions": [2, 3]`` (numbers for dbsync
  versions, the string ``"default"`` for the model's own weights).

How: ``wrap_generate`` replaces the engine client's ``generate`` with one that records the final
output's spans into the record of the HTTP request being served (a context variable that
``VersionStamp``, the outermost ASGI layer, sets per request).

Hazards: a request whose prompt produced no token (an error, ``max_tokens`` 0) carries no
version. A request served by several engine calls (several prompts, ``n`` > 1, beam search)
reports the union of their versions, with ``x-dbsync-version`` the first call's first one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

HEADER = "x-dbsync-version"
HEADER_ALL = "x-dbsync-versions"
FIELD = "dbsync_version"
FIELD_ALL = "dbsync_versions"


def _label(version: str) -> int | str:
    """A dbsync version number as an int; another label (``default``) as it is."""
    return int(version) if version.isdecimal() else version


@dataclass
class RequestVersions:
    """What the engine calls of one HTTP request generated, and with which versions."""

    versions: list[str] = field(default_factory=list)  # in order of first appearance
    active: int = 0  # engine calls started and not finished

    def record(self, output: Any) -> None:
        for completion in getattr(output, "outputs", None) or ():
            for span in getattr(completion, "weight_versions", None) or ():
                if span.version not in self.versions:
                    self.versions.append(span.version)

    @property
    def done(self) -> bool:
        return bool(self.versions) and self.active == 0

    def fields(self) -> dict[str, Any]:
        return {FIELD: _label(self.versions[0]), FIELD_ALL: [_label(v) for v in self.versions]}

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(HEADER.encode(), self.versions[0].encode()),
                (HEADER_ALL.encode(), ",".join(self.versions).encode())]


_current: ContextVar[RequestVersions | None] = ContextVar("dbsync_request_versions",
                                                          default=None)


def wrap_generate(engine_client: Any) -> None:
    """Make ``engine_client.generate`` record each final output's version spans into the
    current HTTP request's ``RequestVersions`` (no-op outside a request)."""
    original = engine_client.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        record = _current.get()
        if record is None:
            async for output in original(*args, **kwargs):
                yield output
            return
        record.active += 1
        counted = True
        try:
            async for output in original(*args, **kwargs):
                if getattr(output, "finished", False) and counted:
                    record.record(output)
                    record.active -= 1  # before the caller turns it into the last chunk
                    counted = False
                yield output
        finally:
            if counted:
                record.active -= 1

    engine_client.generate = generate


class VersionStamp:
    """ASGI layer that adds the versions to POST responses (see the module docstring)."""

    def __init__(self, inner: Any):
        self.inner = inner

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.inner(scope, receive, send)
            return
        record = RequestVersions()
        token = _current.set(record)
        streaming = False

        async def stamped(message: dict[str, Any]) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                streaming = ctype.startswith(b"text/event-stream")
                if not streaming and record.done:
                    message = {**message, "headers": headers + record.headers()}
            elif (message["type"] == "http.response.body" and streaming and record.done
                  and message.get("body")):
                message = {**message, "body": stamp_events(message["body"], record.fields())}
            await send(message)

        try:
            await self.inner(scope, receive, stamped)
        finally:
            _current.reset(token)


def stamp_events(body: bytes, fields: dict[str, Any]) -> bytes:
    """Add ``fields`` to every JSON object sent as ``data:`` in server-sent events."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                obj = json.loads(line[6:])
            except ValueError:
                out.append(line)
                continue
            if isinstance(obj, dict):
                obj.update(fields)
                line = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        out.append(line)
    return b"\n".join(out)
