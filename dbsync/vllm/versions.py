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

A streamed choice that ended without generating a token (a request aborted by a swap's pause
mode ``abort``, or at shutdown, before its first token) gets the chunk vLLM leaves out for it:
``finish_reason`` ``"abort"`` (or whatever ended it) with empty text, before the usage chunk
and ``[DONE]``. Without it the stream ended with no ``finish_reason`` at all, which a client
cannot tell from an empty answer.

Hazards: a request whose prompt produced no token (an error, ``max_tokens`` 0) carries no
version. The missing finish chunk is added only for a request of one engine call (chat, or a
completion of one prompt): with several prompts the choices' numbering is the server's own.
A request served by several engine calls (several prompts, ``n`` > 1, beam search)
reports the union of their versions, with ``x-dbsync-version`` the first call's first one.
"""

from __future__ import annotations

import json
import time
import uuid
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
    calls: int = 0  # engine calls started
    #: choice index -> finish reason, for choices that ended without generating a token
    silent: dict[int, str] = field(default_factory=dict)

    def record(self, output: Any) -> None:
        for completion in getattr(output, "outputs", None) or ():
            for span in getattr(completion, "weight_versions", None) or ():
                if span.version not in self.versions:
                    self.versions.append(span.version)

    def unanswered(self) -> dict[int, str]:
        """The silent choices a stream must still end, once every engine call is done; none
        for a request of several engine calls (see the module docstring)."""
        return dict(self.silent) if self.calls == 1 and self.active == 0 else {}

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
        record.calls += 1
        counted = True
        produced: set[int] = set()
        try:
            async for output in original(*args, **kwargs):
                for completion in getattr(output, "outputs", None) or ():
                    if completion.token_ids:
                        produced.add(completion.index)
                    elif completion.finish_reason is not None and (
                            completion.index not in produced):  # (ended with no token)
                        record.silent[completion.index] = str(completion.finish_reason)
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
        request = _RequestBody(receive)
        stream = _StreamEnd(record, scope.get("path", ""), request)

        async def stamped(message: dict[str, Any]) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                streaming = ctype.startswith(b"text/event-stream")
                if not streaming and record.done:
                    message = {**message, "headers": headers + record.headers()}
            elif message["type"] == "http.response.body" and streaming and message.get("body"):
                body = stream.end_silent_choices(message["body"])
                if record.done:
                    body = stamp_events(body, record.fields())
                message = {**message, "body": body}
            await send(message)

        try:
            await self.inner(scope, request.receive, stamped)
        finally:
            _current.reset(token)


class _RequestBody:
    """Keeps the first ``LIMIT`` bytes of a request's body as the app reads it (the model name
    a finish chunk must carry when the stream sent no chunk to copy it from; clients send it
    ahead of the prompt, and a body is parsed only in that rare case)."""

    LIMIT = 64 << 10

    def __init__(self, receive: Any):
        self._receive = receive
        self._parts: list[bytes] = []
        self._size = 0

    async def receive(self) -> Any:
        message = await self._receive()
        body = message.get("body") if message.get("type") == "http.request" else None
        if body and self._size < self.LIMIT:
            self._parts.append(body)
            self._size += len(body)
        return message

    def model(self) -> str:
        """The request's ``"model"``, or "" where its first ``LIMIT`` bytes do not say it."""
        text = b"".join(self._parts)[: self.LIMIT].decode("utf-8", "replace")
        try:
            value = json.loads(text).get("model")  # (the whole body came)
        except (ValueError, AttributeError):
            key = text.find('"model"')
            colon = text.find(":", key) if key >= 0 else -1
            if colon < 0:
                return ""  # (not a string after a colon: decoding the whole text would
                # hand back whatever value the body starts with)
            try:
                value = json.JSONDecoder().raw_decode(text[colon + 1:].lstrip())[0]
            except ValueError:
                return ""
        return value if isinstance(value, str) else ""


class _StreamEnd:
    """Adds the finish chunk vLLM leaves out of a stream for a choice that ended without a
    token (see the module docstring): before the usage chunk or ``[DONE]``, once."""

    def __init__(self, record: RequestVersions, path: str, request: _RequestBody):
        self.record = record
        self.chat = path.rstrip("/").endswith("chat/completions")
        self.request = request
        self.first_event: bytes | None = None  # the stream's first JSON event (a template)
        self.finished: set[int] = set()  # choices whose finish vLLM streamed
        self.ended = False

    def _note_finished(self, body: bytes) -> None:
        for line in body.split(b"\n"):
            if line.startswith(b"data: {") and b'"finish_reason":"' in line:
                try:
                    event = json.loads(line[6:])
                except ValueError:
                    continue
                for choice in event.get("choices") or () if isinstance(event, dict) else ():
                    if isinstance(choice, dict) and choice.get("finish_reason"):
                        self.finished.add(choice.get("index"))

    def end_silent_choices(self, body: bytes) -> bytes:
        if self.ended:
            return body
        if self.first_event is None:
            self.first_event = next(
                (line[6:] for line in body.split(b"\n") if line.startswith(b"data: {")), None)
        if not self.record.silent:
            return body
        if b'"finish_reason":"' in body:  # (vLLM sent some finish itself: an echoed prompt)
            self._note_finished(body)
        if not (b"data: [DONE]" in body or b'"choices":[]' in body):
            return body
        unanswered = {index: reason for index, reason in self.record.unanswered().items()
                      if index not in self.finished}
        if not unanswered:
            return body
        self.ended = True
        out: list[bytes] = []
        added = False
        for line in body.split(b"\n"):
            if not added and (line.startswith(b"data: [DONE]") or (
                    line.startswith(b"data: {") and b'"choices":[]' in line)):
                out += [b"data: " + json.dumps(self._chunk(line, unanswered),
                                               separators=(",", ":")).encode(), b""]
                added = True
            out.append(line)
        return b"\n".join(out)

    def _chunk(self, line: bytes, unanswered: dict[int, str]) -> dict[str, Any]:
        template: dict[str, Any] = {}
        for event in (line[6:] if line.startswith(b"data: {") else None, self.first_event):
            try:
                template = json.loads(event) if event else {}
            except ValueError:
                continue
            if isinstance(template, dict) and template.get("id"):
                break
            template = {}
        if self.chat:
            choices = [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
                       for i, reason in sorted(unanswered.items())]
        else:
            choices = [{"index": i, "text": "", "logprobs": None, "finish_reason": reason}
                       for i, reason in sorted(unanswered.items())]
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": template.get("id") or f"{prefix}-{uuid.uuid4().hex}",
                "object": template.get("object") or (
                    "chat.completion.chunk" if self.chat else "text_completion"),
                "created": template.get("created") or int(time.time()),
                "model": template.get("model") or self.request.model(),
                "choices": choices}


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
