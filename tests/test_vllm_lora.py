"""LoRA adapter sync on a real vLLM CPU engine (issue 13).

One module, two engines started side by side: ``dbsync serve-vllm ROOT --model A --lora
policy --max-loras 2`` (the subject, a child process) and an offline ``vllm.LLM`` with LoRA
enabled and the same engine settings (the reference: a fresh engine given each adapter
directory directly through a ``LoRARequest``; it also hosts ``attach(llm, ROOT, lora=...)``).
Adapters are written with safetensors (PEFT key names), pushed with ``Sender.push(dir)``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import dbsync
from dbsync import Sender
from dbsync.errors import ReceiverRefusedError
from dbsync.status import wait_for_receivers

vllm = pytest.importorskip("vllm") if not os.environ.get("CI") else __import__("vllm")

from tests.fleet_mounts import needs_root, tmpfs  # noqa: E402
from tests.vllm_helpers import (  # noqa: E402
    KV_CACHE_BYTES,
    PROMPTS,
    Server,
    engine_kwargs,
    flip_a_byte,
    scrape_metrics,
    tiny_model,
    wait_until,
)

NAME = "policy"
MAX_RANK = 8
MAX_TOKENS = 12
STREAM_TOKENS = 1200
MAX_MODEL_LEN = 2048
MODULES = ("q_proj", "v_proj", "down_proj")


def layer_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of the checkpoint's linear layers, from its header."""
    from dbsync.vllm.checkpoint import read_safetensors_header

    header = read_safetensors_header(str(model_dir / "model.safetensors"))
    return {n[: -len(".weight")]: (s[0], s[1]) for n, (s, _) in header.items()
            if n.endswith(".weight") and len(s) == 2}


def write_adapter(path: Path, seed: int, shapes: dict[str, tuple[int, int]], rank: int = 4,
                  modules: tuple[str, ...] = MODULES, target_modules: list[str] | None = None,
                  ) -> Path:
    """A random PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors),
    written with safetensors directly (PEFT key names)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_f, in_f) in shapes.items():
        if module.rsplit(".", 1)[-1] not in modules:
            continue
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny-A",
              "target_modules": target_modules or list(modules)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


class Stack:
    """The module's two engines and stores."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        # checkpoint A with room for a long stream (RoPE: the weights do not depend on it)
        self.model = tmp / "A-long"
        shutil.copytree(tiny_model("A"), self.model)
        config = json.loads((self.model / "config.json").read_text())
        config["max_position_embeddings"] = MAX_MODEL_LEN
        (self.model / "config.json").write_text(json.dumps(config))
        self.shapes = layer_shapes(self.model)
        self.root = tmp / "store"
        self.sender = Sender(self.root, durable=False)
        self.server = Server(self.root, self.model, tmp / "server.log", "--lora", NAME,
                             "--max-loras", "2", "--poll-interval", "0.2", "--",
                             "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                             "--max-num-seqs", "8", "--kv-cache-memory-bytes",
                             str(KV_CACHE_BYTES), "--max-lora-rank", str(MAX_RANK),
                             "--seed", "0", plain=True)
        from vllm import LLM

        self.llm = LLM(model=str(self.model), **engine_kwargs(
            enable_lora=True, max_lora_rank=MAX_RANK, max_loras=2,
            max_model_len=MAX_MODEL_LEN))
        self.server.wait_ready()
        self.seeds = iter(range(100, 10_000))
        self.ref_ids = iter(range(1, 1_000_000))

    def adapter(self, **kwargs: Any) -> Path:
        seed = next(self.seeds)
        return write_adapter(self.tmp / f"adapter-{seed}", seed,
                             kwargs.pop("shapes", self.shapes), **kwargs)

    def reference(self, adapter_dir: Path | None, prompts: list[str] = PROMPTS,
                  max_tokens: int = MAX_TOKENS) -> list[str]:
        """Greedy completions of the reference engine given ``adapter_dir`` directly."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        request = None if adapter_dir is None else LoRARequest(
            f"direct-{adapter_dir.name}", next(self.ref_ids), str(adapter_dir))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def served(self, prompts: list[str] = PROMPTS, model: str = NAME) -> list[str]:
        return [complete(self.server.base, model, p) for p in prompts]

    def push_and_wait(self, adapter_dir: Path) -> tuple[int, dict[str, Any]]:
        version = self.sender.push(adapter_dir)
        status = wait_until(
            lambda: (s := self.server.status())["version"] == version and s, 60, 0.05,
            f"adapter version {version} to be served")
        return version, status

    def close(self) -> None:
        self.server.stop()
        self.sender.close()


def complete(base: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    return complete_with_version(base, model, prompt, max_tokens)[0]


def complete_with_version(base: str, model: str, prompt: str, max_tokens: int = MAX_TOKENS,
                          ) -> tuple[str, str | None]:
    """The completion and its ``x-dbsync-version`` header (the adapter version it ran on).
    The answer names the model as it was asked for (never an internal per-version name)."""
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        body = json.loads(resp.read())
        assert body["model"] == model, f"answered as {body['model']!r}, asked for {model!r}"
        return body["choices"][0]["text"], resp.headers.get("x-dbsync-version")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Stack(tmp_path_factory.mktemp("lora"))
    try:
        yield s
    finally:
        s.close()


def test_served_versions_equal_a_fresh_engine_given_the_adapter(stack: Stack) -> None:
    base = stack.reference(None)
    previous = base
    ids = set()
    for _ in range(3):
        adapter = stack.adapter()
        version, status = stack.push_and_wait(adapter)
        expected = stack.reference(adapter)
        assert expected != previous  # each version changes what is generated
        assert stack.served() == expected, f"version {version}"
        assert complete_with_version(stack.server.base, NAME, PROMPTS[0])[1] == str(version)
        assert stack.served(model=str(stack.model)) == base  # the base model is untouched
        # the base model's answers are labelled as its own weights
        assert complete_with_version(stack.server.base, str(stack.model),
                                     PROMPTS[0])[1] == "default"
        # /v1/models lists the adapter by the name clients request it by
        with urllib.request.urlopen(f"{stack.server.base}/v1/models", timeout=60) as resp:
            listed = [card["id"] for card in json.loads(resp.read())["data"]]
        assert sorted(listed) == sorted([str(stack.model), NAME]), listed
        ids.add(status["lora_int_id"])
        assert len(status["kept"]) <= 2 and status["kept"][-1]["version"] == version
        previous = expected
    assert len(ids) == 3  # a distinct lora_int_id per version: no prefix cache is shared
    assert stack.sender.wait_for_receivers(version, count=1, timeout=10)


_STREAM_CHILD = r"""
import json, sys, time, urllib.request
base, body = sys.argv[1], sys.argv[2].encode()
req = urllib.request.Request(base + "/v1/completions", data=body,
                             headers={"Content-Type": "application/json"})
out = {"done": True, "tokens": None, "versions": []}
with urllib.request.urlopen(req, timeout=300) as resp:
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "dbsync_versions" in chunk:
            out["versions"] = chunk["dbsync_versions"]
        if chunk.get("usage"):
            out["tokens"] = chunk["usage"]["completion_tokens"]
        if chunk.get("choices"):
            choice = chunk["choices"][0]
            print(json.dumps({"t": time.monotonic(), "text": choice["text"],
                              "n": len(choice["logprobs"]["tokens"])}), flush=True)
print(json.dumps(out), flush=True)
"""


class Stream:
    """A streaming completion read by a child process (so that the pushes this process makes
    cannot delay the reading), with each chunk's arrival time (the monotonic clock is
    system-wide)."""

    def __init__(self, base: str, prompt: str, max_tokens: int):
        self.times: list[float] = []
        self.texts: list[str] = []
        self.counts: list[int] = []  # tokens per chunk
        self.first = threading.Event()
        self.error: str | None = None
        self.tokens: int | None = None  # completion tokens, from the usage chunk
        self.versions: list[int] = []  # dbsync_versions of the last chunks
        body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "stream": True,
                           "logprobs": 0, "stream_options": {"include_usage": True}})
        self._proc = subprocess.Popen([sys.executable, "-c", _STREAM_CHILD, base, body],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        try:
            for line in self._proc.stdout:
                record = json.loads(line)
                if record.get("done"):
                    self.tokens, self.versions = record["tokens"], record["versions"]
                    continue
                self.times.append(record["t"])
                self.texts.append(record["text"])
                self.counts.append(record["n"])
                self.first.set()
            if self._proc.wait(60) != 0:
                self.error = self._proc.stderr.read()[-2000:] if self._proc.stderr else "?"
        finally:
            self.first.set()


def test_a_stream_in_flight_during_three_swaps_never_pauses_and_stays_on_its_version(
        stack: Stack) -> None:
    start = stack.adapter()
    start_version, _ = stack.push_and_wait(start)
    prompt = PROMPTS[0]
    expected = stack.reference(start, [prompt], STREAM_TOKENS)[0]
    stream = Stream(stack.server.base, prompt, STREAM_TOKENS)
    assert stream.first.wait(120) and stream.error is None
    wait_until(lambda: len(stream.times) >= 10, 60, 0.01, "10 tokens before the first swap")
    windows = []
    steps: list[str] = []
    newer = []
    for _ in range(3):
        adapter = stack.adapter()
        t0 = time.monotonic()
        version = stack.sender.push(adapter)
        pushed = time.monotonic()
        # the server acknowledges in its lease once NAME points at the new version (read from
        # the store, so that no status request adds work to the server meanwhile)
        assert wait_for_receivers(stack.sender.store, version, 1, timeout=60, interval=0.01)
        windows.append((t0, time.monotonic()))
        steps.append(f"push {1e3 * (pushed - t0):.0f} ms, served "
                     f"{1e3 * (windows[-1][1] - pushed):.0f} ms later")
        newer.append((version, adapter))
    swaps_done_at = len(stream.times)
    # the version the stream started on fell out of the last two; it stays until the end
    asked = time.monotonic()
    retiring = stack.server.status()["retiring"]
    quiet = (asked, time.monotonic())
    stream.thread.join(300)
    assert stream.error is None
    assert swaps_done_at < STREAM_TOKENS, (
        f"the stream ended before the three swaps ({steps}; the stream took "
        f"{stream.times[-1] - stream.times[0]:.2f} s)")
    # every token arrived (a chunk may carry several when the client reads late), and the
    # request finished on the version it started on
    assert "".join(stream.texts) == expected
    assert stream.tokens == STREAM_TOKENS
    assert stream.versions == [start_version]
    if any(t > quiet[1] for t in stream.times):  # it still ran when status answered
        assert [(r["version"], r["in_flight"]) for r in retiring] == [(start_version, 1)]
    normal: list[float] = []
    during: list[float] = []
    for a, b in zip(stream.times, stream.times[1:], strict=False):
        overlaps = any(w0 - 0.05 <= b and a <= w1 + 0.05 for w0, w1 in windows)
        if not overlaps and quiet[0] - 0.05 <= b and a <= quiet[1] + 0.05:
            continue  # the status request above
        (during if overlaps else normal).append(b - a)
    median = statistics.median(normal)
    worst_normal = max(normal)
    worst_during = max(during) if during else 0.0
    print(f"\nstream gaps: median {1e3 * median:.1f} ms, worst outside swaps "
          f"{1e3 * worst_normal:.1f} ms, worst during swaps {1e3 * worst_during:.1f} ms "
          f"({len(during)} gaps during {len(windows)} swaps of "
          f"{', '.join(f'{1e3 * (b - a):.0f}' for a, b in windows)} ms: {'; '.join(steps)})")
    assert during, "no token arrived during the swaps"
    # A normal step: the longest gap outside the swaps (at least 4 median steps). The 1.5
    # margin absorbs scheduling noise on a shared 2-core machine; a pause for a swap costs
    # tens to hundreds of milliseconds and is caught.
    assert worst_during <= 1.5 * max(worst_normal, 4 * median), (
        f"a gap of {worst_during:.3f} s during a swap (normal steps: median {median:.3f} s, "
        f"worst {worst_normal:.3f} s)")
    # requests admitted after the swaps get the newest version
    last_version, last_dir = newer[-1]
    assert stack.served(PROMPTS[:2]) == stack.reference(last_dir, PROMPTS[:2])
    status = stack.server.status()
    assert status["version"] == last_version
    assert [k["version"] for k in status["kept"]] == [v for v, _ in newer[-2:]]


def with_a_nan(adapter_dir: Path) -> Path:
    """The adapter with one value of its first tensor NaN (a diverged training step)."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors[sorted(tensors)[0]].view(-1)[0] = float("nan")
    save_file(tensors, path)
    return adapter_dir


def test_unfit_adapters_are_refused_and_the_previous_one_keeps_serving(stack: Stack) -> None:
    before = scrape_metrics(stack.server.base)
    good = stack.adapter()
    good_version, _ = stack.push_and_wait(good)
    expected = stack.reference(good)
    served = scrape_metrics(stack.server.base)  # vLLM's /metrics carries the adapter swaps
    applied, refused = ('dbsync_swaps_total{outcome="applied"}',
                        'dbsync_swaps_total{outcome="refused"}')
    assert served["dbsync_served_version"] == good_version
    assert served[applied] == before[applied] + 1
    assert served["dbsync_applied_bytes_total"] > before["dbsync_applied_bytes_total"]
    other_base = {m: (o * 3 // 4, i * 3 // 4) for m, (o, i) in stack.shapes.items()}
    unfit = {
        "rank": (stack.adapter(rank=16), "above the engine's max_lora_rank 8"),
        "module": (stack.adapter(target_modules=[*MODULES, "foo_proj"]),
                   "'foo_proj'"),
        "base": (stack.adapter(shapes=other_base), "another base model"),
        "nan": (with_a_nan(stack.adapter()), "NaN or infinite"),
    }
    for what, (adapter, reason) in unfit.items():
        version = stack.sender.push(adapter)
        status = wait_until(
            lambda v=version: (s := stack.server.status())["refused"] and
            s["refused"]["version"] == v and s, 60, 0.05, f"version {version} refused")
        assert reason in status["refused"]["reason"], (what, status["refused"])
        assert status["version"] == good_version
        assert stack.served() == expected, what
        with pytest.raises(ReceiverRefusedError):
            stack.sender.wait_for_receivers(version, count=1, timeout=10)
    assert status["refusals"] >= len(unfit)
    after = scrape_metrics(stack.server.base)
    assert after[refused] == served[refused] + len(unfit)
    assert after["dbsync_served_version"] == good_version
    assert after["dbsync_published_version"] == version
    assert after["dbsync_version_lag"] == version - good_version
    fixed = stack.adapter()
    version, status = stack.push_and_wait(fixed)
    assert status["refused"] is None
    assert stack.served() == stack.reference(fixed)


def test_a_damaged_adapter_version_is_refused_at_once_not_retried(tmp_path: Path) -> None:
    """An adapter version damaged in the store is refused like a full version (reading it
    again cannot repair it): named as damaged, not prepared again, and the trainer's
    ``wait_for_receivers`` fails at once naming the engine. (It was retried forever.)"""
    from dbsync.store import Store
    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import AdapterRefusedError, AdapterVersions

    model = tiny_model("A")
    expected = read_safetensors_header(str(model / "model.safetensors"))
    root = tmp_path / "store"
    with Sender(root) as sender:
        version = sender.push(str(write_adapter(tmp_path / "adapter", 1, layer_shapes(model))))
    flip_a_byte(root, 0)
    versions = AdapterVersions(root, NAME, expected, MAX_RANK, workdir=str(tmp_path / "work"))
    try:
        with pytest.raises(AdapterRefusedError, match="is damaged"):
            versions.prepare()
        assert versions.prepare() is None  # refused: not read again
        assert versions.refused["version"] == version and versions.refusals == 1
        with pytest.raises(ReceiverRefusedError, match="damaged"):
            wait_for_receivers(Store(str(root)), version, 1, timeout=5)
    finally:
        versions.close()


@needs_root
def test_a_work_directory_without_room_is_said_as_such(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapters are written into a work directory (``/dev/shm`` by default, 64 MiB in a
    container): full, that was a bare "[Errno 28] No space left on device", retried for
    ever. It now names the directory, the adapter's size and what to do; the directory is
    chosen by ``DBSYNC_LORA_WORKDIR``."""
    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import AdapterVersions, default_workdir

    model = tiny_model("A")
    expected = read_safetensors_header(str(model / "model.safetensors"))
    root = tmp_path / "store"
    with Sender(root) as sender:
        sender.push(str(write_adapter(tmp_path / "adapter", 1, layer_shapes(model))))
    with tmpfs(tmp_path / "small", "16k") as small:
        monkeypatch.setenv("DBSYNC_LORA_WORKDIR", small)
        versions = AdapterVersions(root, NAME, expected, MAX_RANK)
        try:
            assert versions.workdir.startswith(small)
            with pytest.raises(dbsync.DBSyncError, match="no room for adapter version 1") as info:
                versions.prepare()
            assert small in str(info.value) and "DBSYNC_LORA_WORKDIR" in str(info.value)
        finally:
            versions.close()
    monkeypatch.setenv("DBSYNC_LORA_WORKDIR", str(tmp_path / "roomy"))
    workdir = default_workdir()
    assert workdir.startswith(str(tmp_path / "roomy"))


def test_a_request_whose_version_was_dropped_while_it_waited_runs_on_the_newest(
        tmp_path: Path) -> None:
    """Requests resolved to version 1 when they arrived, and started only after versions 2
    and 3 had come and 1 was dropped from the engine: they run on version 3 and are labelled
    3 (one ran unlabelled on an adapter no longer loaded; one got version 1 back because
    another request still ran on it). A request already running on 1 keeps its directory."""
    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import AdapterVersions

    model = tiny_model("A")
    expected = read_safetensors_header(str(model / "model.safetensors"))
    shapes = layer_shapes(model)
    root = tmp_path / "store"
    sender = Sender(root)
    versions = AdapterVersions(root, NAME, expected, MAX_RANK, keep=2,
                               workdir=str(tmp_path / "work"))
    try:
        with sender:
            served, running = [], None
            for seed in (1, 2, 3):
                sender.push(str(write_adapter(tmp_path / f"adapter{seed}", seed, shapes)))
                prepared = versions.prepare()
                for old in versions.commit(prepared):
                    versions.retire(old)
                served.append(prepared)
                if seed == 1:
                    running = versions.acquire_request(prepared.request)  # (runs meanwhile)
        first, newest = served[0], served[-1]
        assert running is first
        assert versions.status()["retiring"][0]["version"] == 1  # (dropped, still running)
        late = versions.acquire_request(first.request)
        assert late is newest and late.version == 3
        assert os.path.isdir(late.directory) and os.path.isdir(first.directory)
        assert versions.status()["kept"][-1]["in_flight"] == 1
        versions.release(late.lora_int_id)
        versions.release(running.lora_int_id)  # its last request ends: its directory goes
        assert not os.path.exists(first.directory)
        assert versions.acquire_request(first.request) is newest  # (nothing held it)
        versions.release(newest.lora_int_id)
        assert versions.acquire_request(served[1].request) is served[1]  # still kept
        versions.release(served[1].lora_int_id)
    finally:
        versions.close()
    assert (tmp_path / "work").is_dir() and not os.listdir(tmp_path / "work")


def test_the_lag_counts_a_new_runs_versions_above_the_served_number(tmp_path: Path) -> None:
    """The old run's version 1 is served; a new run at the same path publishes 1, 2, 3 (its
    adapters refused, or not yet applied): every one of them is unserved, so the lag is 3,
    not 3 - 1."""
    import asyncio
    import shutil

    from prometheus_client import CollectorRegistry

    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import AdapterVersions
    from dbsync.vllm.lora_server import LoRAServing
    from dbsync.vllm.metrics import SwapMetrics

    model = tiny_model("A")
    expected = read_safetensors_header(str(model / "model.safetensors"))
    shapes = layer_shapes(model)
    root = tmp_path / "store"
    with Sender(root) as sender:
        sender.push(str(write_adapter(tmp_path / "adapter1", 1, shapes)))
    versions = AdapterVersions(root, NAME, expected, MAX_RANK, workdir=str(tmp_path / "work"))
    registry = CollectorRegistry()
    loop = asyncio.new_event_loop()
    serving = LoRAServing(versions, engine=None, loop=loop,
                          metrics=SwapMetrics(registry=registry))
    try:
        versions.commit(versions.prepare())  # (served, as far as the lag is concerned)
        serving._noticed(1)
        assert registry.get_sample_value("dbsync_version_lag") == 0
        shutil.rmtree(root)  # a new run
        with Sender(root) as sender:
            for seed in (2, 3, 4):
                sender.push(str(write_adapter(tmp_path / f"adapter{seed}", seed, shapes)))
        serving._noticed(3)
        assert registry.get_sample_value("dbsync_version_lag") == 3
    finally:
        versions.close()
        loop.close()


def test_an_adapter_version_whose_stamp_is_damaged_is_refused_not_retried(
        tmp_path: Path) -> None:
    """The current adapter slot's stamp damaged (the head did not move): refused as a damaged
    version, once, and the trainer hears of it. (It was retried as a read error forever.)"""
    from dbsync.format import SLOT_STAMP_FILE
    from dbsync.store import Store
    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import AdapterRefusedError, AdapterVersions

    model = tiny_model("A")
    expected = read_safetensors_header(str(model / "model.safetensors"))
    root = tmp_path / "store"
    with Sender(root) as sender:
        version = sender.push(str(write_adapter(tmp_path / "adapter", 1, layer_shapes(model))))
    head = Store(str(root)).read_head()
    (root / "slots" / head.slot / SLOT_STAMP_FILE).write_text('{"version": 77}')
    versions = AdapterVersions(root, NAME, expected, MAX_RANK, workdir=str(tmp_path / "work"))
    try:
        with pytest.raises(AdapterRefusedError, match="stamp is missing or damaged"):
            versions.prepare()
        assert versions.prepare() is None  # refused: not read again
        assert versions.refused["version"] == version and versions.refusals == 1
        with pytest.raises(ReceiverRefusedError, match="damaged"):
            wait_for_receivers(Store(str(root)), version, 1, timeout=5)
    finally:
        versions.close()


def test_attach_lora_returns_the_newest_versions_request(stack: Stack, tmp_path: Path) -> None:
    from dbsync.errors import NothingPublishedError
    from dbsync.vllm import attach
    from dbsync.vllm.lora import AdapterRefusedError

    root = tmp_path / "offline"
    with Sender(root, durable=False) as sender:
        sender.push(stack.adapter(rank=16))  # refused, and nothing served yet: raises
        adapter = attach(stack.llm, root, lora="offline")
        try:
            with pytest.raises(AdapterRefusedError, match="max_lora_rank"):
                adapter.latest()
            seen = set()
            for _ in range(3):
                source = stack.adapter()
                version = sender.push(source)
                request = adapter.latest()
                assert adapter.version == version and request.lora_int_id not in seen
                seen.add(request.lora_int_id)
                assert adapter.latest() is request  # nothing new: the same request
                from vllm import SamplingParams

                params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                        ignore_eos=True)
                got = [o.outputs[0].text for o in stack.llm.generate(
                    PROMPTS, params, lora_request=request, use_tqdm=False)]
                # the same engine given the same adapter directly, under another id
                assert got == stack.reference(source)
            sender.push(stack.adapter(shapes={m: (o + 8, i) for m, (o, i)
                                              in stack.shapes.items()}))
            assert adapter.latest() is request  # refused: the previous one keeps serving
            status = adapter.status()
            assert status["refused"]["version"] == version + 1
            assert len(status["kept"]) == 2
            damaged = sender.push(stack.adapter())
            flip_a_byte(sender.root)
            assert adapter.latest() is request  # damaged: the previous one keeps serving
            status = adapter.status()  # refused (damaged), not retried as a read error
            assert status["refused"]["version"] == damaged
            assert "is damaged" in status["refused"]["reason"]
            assert adapter.version == version != damaged
            fixed = stack.adapter()
            sender.push(fixed)
            assert adapter.latest() is not request and adapter.status()["last_error"] is None
        finally:
            adapter.detach()
        assert not os.path.exists(adapter.versions.workdir)
    with Sender(tmp_path / "empty") as empty:
        nothing = attach(stack.llm, empty.root, lora="x")
        with pytest.raises(NothingPublishedError):
            nothing.latest()
        nothing.detach()


@pytest.mark.parametrize("config, tensors, reason", [
    (None, [], "holds full weights"),
    ({"peft_type": "IA3", "r": 4}, [], "'IA3' adapters are not served"),
    ({"r": 4, "use_dora": True}, [], "DoRA"),
    ({"r": 4, "modules_to_save": ["lm_head"]}, [], "train whole modules"),
    ({"r": 0}, [], "integer rank r >= 1"),
    ({"r": 4}, [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (4, 128),
                 torch.float32)], "without its pair"),
    ({"r": 4}, [("model.layers.0.self_attn.q_proj.weight", (128, 128), torch.float32)],
     "not a PEFT LoRA weight"),
    ({"r": 4}, [("base_model.model.model.embed_tokens.lora_A.weight", (4, 512),
                 torch.float32)], "embeddings and the LM head are not served"),
    ({"r": 4}, [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (4, 128),
                 torch.int8),
                ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", (128, 4),
                 torch.int8)], "not a floating dtype"),
    ({"r": 4}, [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (4, 128),
                 torch.float32),
                ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", (128, 2),
                 torch.float32)], "lora_B [128, 2] has rank 2"),
])
def test_check_adapter_names_why_an_adapter_does_not_fit(config: Any, tensors: Any,
                                                         reason: str) -> None:
    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import check_adapter

    expected = read_safetensors_header(str(tiny_model("A") / "model.safetensors"))
    problems = check_adapter(config, tensors, expected, max_rank=8)
    assert any(reason in why for why in problems.values()), problems
    fits = [(f"base_model.model.model.layers.0.self_attn.q_proj.lora_{p}.weight", s,
             torch.float32) for p, s in (("A", (4, 128)), ("B", (128, 4)))]
    assert check_adapter({"r": 4, "target_modules": ["q_proj"]}, fits, expected, 8) == {}


def test_check_adapter_takes_ranks_from_peft_rank_pattern() -> None:
    """PEFT's ``rank_pattern`` gives modules ranks of their own (v_proj rank 8 in an r=4
    adapter): such valid adapters were refused, "lora_A rank 8 != the config's r 4". The
    pattern's rank is checked now, and the largest rank against ``max_lora_rank``."""
    from dbsync.vllm.checkpoint import read_safetensors_header
    from dbsync.vllm.lora import check_adapter

    expected = read_safetensors_header(str(tiny_model("A") / "model.safetensors"))
    layer = "base_model.model.model.layers.0.self_attn"
    kv = 64  # (the tiny model's k/v projections: 128 -> 64)
    pairs = [(f"{layer}.q_proj.lora_A.weight", (4, 128)), (f"{layer}.q_proj.lora_B.weight",
                                                           (128, 4)),
             (f"{layer}.v_proj.lora_A.weight", (8, 128)), (f"{layer}.v_proj.lora_B.weight",
                                                           (kv, 8))]
    tensors = [(n, s, torch.float32) for n, s in pairs]
    config = {"r": 4, "rank_pattern": {"v_proj": 8}, "target_modules": ["q_proj", "v_proj"]}
    assert check_adapter(config, tensors, expected, max_rank=8) == {}
    assert "max_lora_rank 4" in check_adapter(config, tensors, expected, max_rank=4)["r"]
    wrong = check_adapter(dict(config, rank_pattern={"v_proj": 6}), tensors, expected, 8)
    assert wrong == {"model.layers.0.self_attn.v_proj":
                     "lora_A rank 8 != its rank_pattern rank 6"}, wrong
    # keys are patterns matched as PEFT and vLLM match them, ``(.*\.)?(key)$``: an
    # alternation names each of its modules (was read as ``.*\.q_proj|v_proj$``, which gave
    # v_proj the config's r, and the adapter was refused)
    both = {"r": 8, "rank_pattern": {"q_proj|v_proj": 4}, "target_modules": ["q_proj", "v_proj"]}
    four = [(n, (4, s[1]) if "lora_A" in n else (s[0], 4), d) for n, s, d in tensors]
    assert check_adapter(both, four, expected, max_rank=8) == {}
