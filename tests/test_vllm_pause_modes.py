"""Pause modes and transient read errors on a real ``AsyncLLM`` (CPU) with an attached store.

One engine and one attachment for the module; ``outcome`` runs the phases once, in order, and
each test asserts one phase:
1. pause mode "wait" under a steady stream of requests: no response spans two versions;
2. "wait" whose drain times out: the rest is held ("keep"), so a request spans both versions;
3. "abort": the request in flight ends early with finish_reason "abort";
4. an injected ESTALE while the controller opens the new version: not marked seen, retried
   with backoff (visible in the status meanwhile), served once the store reads again.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dbsync import Sender
from tests.vllm_helpers import PROMPTS, engine_kwargs, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CLIENTS = 4


async def generate(engine: Any, prompt: str, max_tokens: int,
                   started: asyncio.Event | None = None) -> dict[str, Any]:
    """One greedy request: its text, token count, finish reason, versions and times."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    begin, final = time.time(), None
    async for out in engine.generate(prompt, params, request_id=f"r-{time.monotonic_ns()}"):
        final = out.outputs[0]
        if started is not None:
            started.set()
    assert final is not None
    return {"text": final.text, "tokens": len(final.token_ids),
            "finish": final.finish_reason, "start": begin, "end": time.time(),
            "versions": [s.version for s in final.weight_versions or ()]}


async def until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_phase(engine: Any, att: Any, sender: Sender) -> dict[str, Any]:
    """Clients send requests back to back; a version is pushed while they run."""
    att.controller.pause_mode, att.controller.drain_timeout = "wait", 60.0
    done: list[dict[str, Any]] = []
    counts = [0] * CLIENTS
    stop = False

    async def client(i: int) -> None:
        while not stop:
            done.append(await generate(engine, PROMPTS[i % len(PROMPTS)], 24))
            counts[i] += 1

    tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    await until(lambda: min(counts) >= 1, 60, "every client to finish a request")
    pushed_at = time.time()
    version = await asyncio.to_thread(sender.push, str(tiny_model("B")))
    await until(lambda: att.version == version, 60, "the swap")
    marks = list(counts)
    await until(lambda: all(c >= m + 2 for c, m in zip(counts, marks, strict=True)), 60,
                "every client to finish two requests after the swap")
    stop = True
    await asyncio.gather(*tasks)
    return {"version": version, "pushed_at": pushed_at, "done": done,
            "status": att.status()}


async def held_phase(engine: Any, att: Any, sender: Sender, mode: str, drain_timeout: float,
                     model: str) -> dict[str, Any]:
    """One long request in flight when a version is pushed."""
    att.controller.pause_mode, att.controller.drain_timeout = mode, drain_timeout
    old = att.version
    started = asyncio.Event()
    task = asyncio.create_task(generate(engine, PROMPTS[3], 200, started))
    await asyncio.wait_for(started.wait(), 60)
    version = await asyncio.to_thread(sender.push, str(tiny_model(model)))
    await until(lambda: att.version == version, 60, "the swap")
    return {"old": old, "version": version, "request": await task, "status": att.status()}


async def transient_phase(engine: Any, att: Any, sender: Sender) -> dict[str, Any]:
    """ESTALE on every open of the store until cleared; a version is pushed meanwhile."""
    att.controller.pause_mode = "keep"
    controller = att.controller
    real_open = controller.receiver.open
    failing = threading.Event()
    failing.set()
    failures: list[float] = []
    three = threading.Event()

    def flaky_open(*args: Any, **kwargs: Any) -> Any:
        if failing.is_set():
            failures.append(time.monotonic())
            if len(failures) >= 3:
                three.set()
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real_open(*args, **kwargs)

    controller.receiver.open = flaky_open
    try:
        old = att.version
        version = await asyncio.to_thread(sender.push, str(tiny_model("A")))
        assert await asyncio.to_thread(three.wait, 60)
        during = att.status()
        failing.clear()
        await until(lambda: att.version == version, 60, "the retried swap")
    finally:
        controller.receiver.open = real_open
    after = [(await generate(engine, p, 12))["text"] for p in PROMPTS]
    return {"old": old, "version": version, "during": during, "after": after,
            "status": att.status(), "failures": failures}


async def scenario(root: Path) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from dbsync import vllm as dbsync_vllm

    args = AsyncEngineArgs(model=str(tiny_model("A")),
                           **engine_kwargs(**dbsync_vllm.engine_args()))
    engine = AsyncLLM.from_engine_args(args)
    out: dict[str, Any] = {}
    try:
        with Sender(root) as sender, dbsync_vllm.attach(engine, root, poll_interval=0.1,
                                                        transport="filesystem") as att:
            out["wait"] = await wait_phase(engine, att, sender)
            out["drain_timeout"] = await held_phase(engine, att, sender, "wait", 0.05, "A")
            out["abort"] = await held_phase(engine, att, sender, "abort", 30.0, "B")
            out["transient"] = await transient_phase(engine, att, sender)
    finally:
        engine.shutdown()
    return out


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    reference("A")  # started now: overlaps the engine's start-up
    # Import vLLM here, not inside the coroutine: an import error that vLLM's dependencies keep
    # would otherwise keep the coroutine's frame, and with it the engine, alive until exit.
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401

    import dbsync.vllm  # noqa: F401

    result = asyncio.run(scenario(tmp_path_factory.mktemp("pause") / "store"))
    gc.collect()  # finalize the shut-down engine now, not during interpreter exit
    return result


def test_wait_mode_no_response_spans_two_versions(outcome: dict[str, Any]) -> None:
    phase = outcome["wait"]
    new = str(phase["version"])
    done = phase["done"]
    assert all(len(r["versions"]) == 1 for r in done), [r["versions"] for r in done]
    assert all(r["tokens"] == 24 and r["finish"] == "length" for r in done)
    # requests in flight at the push were drained on the old version (one not yet scheduled
    # when the pause began waits and runs on the new one instead)
    in_flight = [r for r in done if r["start"] < phase["pushed_at"] < r["end"]]
    assert any(r["versions"] == ["default"] for r in in_flight)
    assert any(r["versions"] == [new] for r in done)
    assert phase["status"]["timings"]["pause_mode"] == "wait"


def test_wait_mode_falls_back_to_keep_after_the_drain_timeout(outcome: dict[str, Any]) -> None:
    phase = outcome["drain_timeout"]
    request = phase["request"]
    assert request["versions"] == [str(phase["old"]), str(phase["version"])]
    assert request["tokens"] == 200 and request["finish"] == "length"
    assert phase["status"]["timings"]["pause_mode"] == "keep"


def test_abort_mode_ends_requests_in_flight(outcome: dict[str, Any]) -> None:
    phase = outcome["abort"]
    request = phase["request"]
    assert request["finish"] == "abort" and request["tokens"] < 200
    assert request["versions"] == [str(phase["old"])]
    assert phase["status"]["timings"]["pause_mode"] == "abort"


def test_transient_read_error_retried_until_served(outcome: dict[str, Any]) -> None:
    phase = outcome["transient"]
    during = phase["during"]
    assert during["version"] == phase["old"] != phase["version"]
    assert during["retrying"] and during["healthy"]
    assert "Stale file handle" in during["last_error"]
    status = phase["status"]
    assert status["version"] == phase["version"] and status["last_error"] is None
    assert not status["retrying"]
    assert phase["after"] == reference("A").result()
    gaps = [b - a for a, b in zip(phase["failures"], phase["failures"][1:], strict=False)]
    assert min(gaps) >= 0.15  # bounded rate: backoff from 0.2 s
