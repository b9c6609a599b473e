"""In-process API on an ``AsyncLLM``: the attached watcher applies each version in the
background (pause/resume around it) while requests run; on-demand apply from the event loop."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import pytest

from dbsync import Sender
from tests.vllm_helpers import MAX_TOKENS, PROMPTS, engine_kwargs, reference, tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


BG_TOKENS = 200


async def generate(engine: Any, prompt: str, tag: str, max_tokens: int = MAX_TOKENS) -> str:
    return (await generate_timed(engine, prompt, tag, max_tokens))[0]


async def generate_timed(engine: Any, prompt: str, tag: str, max_tokens: int
                         ) -> tuple[str, int, float, float]:
    """(text, tokens generated, start, end): a request cut short shows fewer tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    text, tokens, start = "", 0, time.time()
    async for out in engine.generate(prompt, params, request_id=f"{tag}-{time.monotonic_ns()}"):
        text, tokens = out.outputs[0].text, len(out.outputs[0].token_ids)
    return text, tokens, start, time.time()


async def scenario(store: Path) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from dbsync import vllm as dbsync_vllm

    args = AsyncEngineArgs(model=str(tiny_model("A")),
                           **engine_kwargs(**dbsync_vllm.engine_args()))
    engine = AsyncLLM.from_engine_args(args)
    out: dict[str, Any] = {}
    try:
        with Sender(store) as sender, dbsync_vllm.attach(engine, store, poll_interval=0.1) as att:
            out["before"] = [await generate(engine, p, "a") for p in PROMPTS]
            # long enough to outlast the push and the swap on a busy 2-core machine
            background = [asyncio.create_task(generate_timed(engine, p, "bg", BG_TOKENS))
                          for p in PROMPTS]
            await asyncio.sleep(0.2)
            version = await asyncio.to_thread(sender.push, str(tiny_model("B")))
            deadline = time.monotonic() + 60
            while att.version != version and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            out["version"], out["pushed"] = att.version, version
            out["background"] = await asyncio.gather(*background)
            out["after"] = [await generate(engine, p, "b") for p in PROMPTS]
            out["weight_version"] = await engine.get_weight_version()
            out["on_demand"] = await att.apply_latest_async()
            with pytest.raises(Exception, match="deadlock"):
                att.apply_latest()  # from the loop's own thread: refused, not hung
            out["status"] = att.status()
    finally:
        engine.shutdown()
    return out


def test_async_engine_follows_store(tmp_path: Path) -> None:
    expected = reference("B")
    # Import vLLM here, not inside the coroutine: an import error that vLLM's dependencies keep
    # would otherwise keep the coroutine's frame, and with it the engine, alive until exit.
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401

    import dbsync.vllm  # noqa: F401

    out = asyncio.run(scenario(tmp_path / "store"))
    gc.collect()  # finalize the shut-down engine now, not during interpreter exit
    assert out["version"] == out["pushed"]
    assert out["weight_version"] == str(out["pushed"])
    assert out["on_demand"] == out["pushed"]
    # every request held across the swap ran to its full length, and some did span it
    assert all(tokens == BG_TOKENS for _, tokens, _, _ in out["background"])
    loaded_at = out["status"]["loaded_at"]
    assert any(start < loaded_at < end for _, _, start, end in out["background"])
    assert out["after"] == expected.result()
    assert out["after"] != out["before"]
    assert out["status"]["healthy"] and out["status"]["last_error"] is None
