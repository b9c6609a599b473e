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


async def generate_timed(engine: Any, prompt: str, tag: str, max_tokens: int,
                         generating: asyncio.Event | None = None
                         ) -> tuple[str, int, float, float]:
    """(text, tokens generated, start, end): a request cut short shows fewer tokens.
    ``generating`` is set once the first token came."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    text, tokens, start = "", 0, time.time()
    async for out in engine.generate(prompt, params, request_id=f"{tag}-{time.monotonic_ns()}"):
        text, tokens = out.outputs[0].text, len(out.outputs[0].token_ids)
        if generating is not None:
            generating.set()
    return text, tokens, start, time.time()


#: pushes of the same weights while requests run, until one of those requests spans the swap
#: (each round's requests are generating before its push; on a busy machine they may still
#: all end before the watcher applies it: all of 4 rounds once did, with another vLLM test
#: running beside)
ROUNDS = 8


async def push_while_generating(engine: Any, att: Any, sender: Any) -> dict[str, Any]:
    """One round: requests generating, then a push of model B; the round's version, its
    requests' (text, tokens, start, end) and when the version was applied."""
    generating = [asyncio.Event() for _ in PROMPTS]
    background = [asyncio.create_task(generate_timed(engine, p, "bg", BG_TOKENS, started))
                  for p, started in zip(PROMPTS, generating, strict=True)]
    for started in generating:
        await started.wait()
    version = await asyncio.to_thread(sender.push, str(tiny_model("B")))
    deadline = time.monotonic() + 60
    while att.version != version and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return {"version": att.version, "pushed": version,
            "background": await asyncio.gather(*background),
            "loaded_at": att.status()["loaded_at"]}


def spanned(round_: dict[str, Any]) -> bool:
    return any(start < round_["loaded_at"] < end for _, _, start, end in round_["background"])


async def scenario(store: Path) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from dbsync import vllm as dbsync_vllm

    args = AsyncEngineArgs(model=str(tiny_model("A")),
                           **engine_kwargs(**dbsync_vllm.engine_args()))
    engine = AsyncLLM.from_engine_args(args)
    out: dict[str, Any] = {"rounds": []}
    try:
        with Sender(store) as sender, dbsync_vllm.attach(engine, store, poll_interval=0.1) as att:
            out["before"] = [await generate(engine, p, "a") for p in PROMPTS]
            while len(out["rounds"]) < ROUNDS and not any(map(spanned, out["rounds"])):
                out["rounds"].append(await push_while_generating(engine, att, sender))
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
    pushed = out["rounds"][-1]["pushed"]
    assert all(r["version"] == r["pushed"] for r in out["rounds"])
    assert out["weight_version"] == str(pushed)
    assert out["on_demand"] == pushed
    # every request held across a swap ran to its full length, and some did span one
    assert all(tokens == BG_TOKENS for r in out["rounds"] for _, tokens, _, _ in r["background"])
    assert spanned(out["rounds"][-1]), out["rounds"]
    assert out["after"] == expected.result()
    assert out["after"] != out["before"]
    assert out["status"]["healthy"] and out["status"]["last_error"] is None
