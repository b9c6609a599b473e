"""`dbsync serve-vllm ROOT --model DIR` typed plainly on a CPU host, driven by the `openai`
client: the version of each response (headers, last streamed chunks, both versions for a
request held across a swap), float32 pushes into the bfloat16-served model, `/metrics`,
`/openapi.json`, and a clean SIGTERM. One server for the module (tests run in file order); the
model directory is sharded with an index and a stray safetensors file the index does not name.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import dbsync
from dbsync.store import Store
from tests.vllm_helpers import (
    PROMPTS,
    REPO,
    Server,
    child_env,
    http_json,
    reference,
    scrape_metrics,
    tiny_model,
    wait_until,
)

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LONG = 300  # tokens: a request that lasts seconds on this machine


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serving") / "store"


@pytest.fixture(scope="module")
def sender(store: Path) -> Any:
    with dbsync.Sender(store) as s:
        yield s


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's apply test hook (``DBSYNC_TEST_APPLY_FAULTS``): empty until a test says."""
    path = tmp_path_factory.mktemp("serving-faults") / "faults"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def notify_socket(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A socket standing for systemd's (``$NOTIFY_SOCKET`` of a ``Type=notify`` unit)."""
    path = tmp_path_factory.mktemp("systemd") / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield sock


@pytest.fixture(scope="module")
def server(store: Path, sender: Any, faults: Path, notify_socket: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    # the sender creates the (empty) store: a reader given a missing ROOT fails at once
    reference("B", "bfloat16")  # started now: overlaps the server's start-up
    log = tmp_path_factory.mktemp("serving-log") / "server.log"
    srv = Server(store, tiny_model("A-sharded"), log, plain=True,
                 env={"DBSYNC_TEST_APPLY_FAULTS": str(faults),
                      "NOTIFY_SOCKET": notify_socket.getsockname()})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def complete(client: Any, server: Server, prompt: str, max_tokens: int = 12
             ) -> tuple[str, Any]:
    """(text, response headers) of a greedy non-streaming completion."""
    raw = client.completions.with_raw_response.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
        extra_body={"ignore_eos": True})
    return raw.parse().choices[0].text, raw.headers


def stream(client: Any, server: Server, prompt: str, max_tokens: int,
           first: threading.Event | None = None) -> list[Any]:
    chunks = []
    for chunk in client.completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        chunks.append(chunk)
        if first is not None:
            first.set()
    return chunks


def test_plain_command_starts_on_cpu(server: Server, notify_socket: Any) -> None:
    status = server.status()
    assert status["version"] is None and status["healthy"]
    # systemd (a Type=notify unit) was told once it served: one datagram, sent before the
    # routes answered
    notify_socket.settimeout(0)
    told = notify_socket.recv(4096).decode().splitlines()
    assert told[0] == "READY=1" and told[1].startswith("STATUS=serving no version yet of ")
    assert status["pause_mode"] == "keep"
    log = server.tail(400_000)
    assert "CPU host: KV cache of" in log and "running the model eagerly" in log


def test_openapi_json_answers(server: Server) -> None:
    schema = http_json(f"{server.base}/openapi.json")
    assert "/dbsync/status" in schema["paths"] and "/v1/completions" in schema["paths"]


def test_float32_push_into_bfloat16_model_matches_fresh_engine(
        server: Server, sender: Any, client: Any) -> None:
    """The model is served in bfloat16 (vLLM's CPU default for a float32 checkpoint); the
    float32 version is cast on apply, token-exact with a fresh bfloat16 engine of it. Each
    response names the version that produced it."""
    version = sender.push(str(tiny_model("B")))
    server.wait_version(version, timeout=60)
    got = [complete(client, server, p) for p in PROMPTS]
    assert [text for text, _ in got] == reference("B", "bfloat16").result()
    for _, headers in got:
        assert headers["x-dbsync-version"] == str(version)
        assert headers["x-dbsync-versions"] == str(version)
    # The cast is said once per swap, not as vLLM's WARNING per tensor (hundreds per swap
    # for a real model)
    log = server.log_path.read_text(errors="replace")
    said = log.index("dbsync: cast")  # (the start-up load's own warnings come before)
    assert "from float32 to bfloat16" in log[said:said + 300]
    assert "Attempted to load weight" not in log[said:]
    # nor as vLLM's WARNING that the (computed) rotary tables were not in the version
    assert "Failed to load weights" not in log, log[-3000:]


def test_streamed_response_names_its_version(server: Server, client: Any) -> None:
    version = server.status()["version"]
    chunks = stream(client, server, PROMPTS[0], 8)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and chunks[-1].usage is not None
    for chunk in (finish[-1], chunks[-1]):  # the finish chunk and the usage chunk
        assert chunk.dbsync_version == version and chunk.dbsync_versions == [version]
    assert getattr(chunks[0], "dbsync_version", None) is None  # only once all is generated


def test_chat_completion_names_its_version(server: Server, client: Any) -> None:
    version = server.status()["version"]
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=6,
        temperature=0.0, extra_body={"ignore_eos": True})
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-dbsync-version"] == str(version)
    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=6,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason and chunks[-1].dbsync_versions == [version]


def test_request_held_across_a_swap_reports_both_versions(
        server: Server, sender: Any, client: Any) -> None:
    """Pause mode keep: requests in flight finish on the new version and say so. Two clients
    (one streaming) send long requests back to back, so each has one in flight at the swap."""
    old = server.status()["version"]
    plain: list[tuple[str, Any]] = []
    streamed: list[list[Any]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop(results: list[Any], call: Any) -> None:
        try:
            while not stop.is_set():
                results.append(call())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=(plain, lambda: complete(
            client, server, PROMPTS[1], LONG))),
        threading.Thread(target=loop, args=(streamed, lambda: stream(
            client, server, PROMPTS[2], LONG)))]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sum(scrape_metrics(
            server.base, "vllm:num_requests_running").values()) >= 2, 60, 0.05,
            "both clients to have a request running")
        new = sender.push(str(tiny_model("A")))
        server.wait_version(new, timeout=60)
        counts = (len(plain), len(streamed))
        wait_until(lambda: len(plain) > counts[0] and len(streamed) > counts[1] or errors,
                   120, 0.1, "one more response from each client")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    spanning = [h for _, h in plain if h["x-dbsync-versions"] == f"{old},{new}"]
    assert spanning and all(h["x-dbsync-version"] == str(old) for h in spanning)
    finals = [chunks[-1] for chunks in streamed]
    assert any(c.dbsync_version == old and c.dbsync_versions == [old, new] for c in finals)
    assert all(c.usage.completion_tokens == LONG for c in finals)  # held, not cut short


def test_metrics_follow_each_swap(server: Server, sender: Any) -> None:
    before = scrape_metrics(server.base)
    version = sender.push(str(tiny_model("B")))
    server.wait_version(version, timeout=60)
    after = scrape_metrics(server.base)
    nbytes = Store(sender.root).require_manifest().total_bytes
    assert after["dbsync_served_version"] == version
    assert after["dbsync_published_version"] == version
    assert after["dbsync_version_lag"] == 0
    applied = 'dbsync_swaps_total{outcome="applied"}'
    assert after[applied] == before[applied] + 1
    assert after["dbsync_pause_seconds_count"] == before["dbsync_pause_seconds_count"] + 1
    assert after["dbsync_pause_seconds_sum"] > before["dbsync_pause_seconds_sum"]
    assert (after["dbsync_read_verify_seconds_count"]
            == before["dbsync_read_verify_seconds_count"] + 1)
    assert after["dbsync_applied_bytes_total"] == before["dbsync_applied_bytes_total"] + nbytes
    assert after['dbsync_source{source="filesystem"}'] == 1
    assert after['dbsync_source{source="broadcast"}'] == 0

    bad = sender.push(str(tiny_model("C")))  # does not fit: refused
    wait_until(lambda: server.status()["last_error_version"] == bad, 60, 0.1, "the refusal")
    refused = scrape_metrics(server.base)
    key = 'dbsync_swaps_total{outcome="refused"}'
    assert refused[key] == after[key] + 1
    assert refused["dbsync_served_version"] == version
    assert refused["dbsync_published_version"] == bad
    assert refused["dbsync_version_lag"] == bad - version
    assert refused[applied] == after[applied]


def test_sigterm_during_a_swap_holding_a_stream_stops_cleanly(
        server: Server, sender: Any, client: Any, faults: Path) -> None:
    """SIGTERM while a swap holds generation paused (pause mode keep) with a stream in flight,
    the apply ending soon after: the held stream is aborted rather than kept waiting on an
    engine left paused, and the server exits 0 within its shutdown timeout, without
    tracebacks. (It waited for the stream forever.) Two more streams, sent while the swap
    held generation, never generated a token: each still ends with finish_reason "abort"
    (vLLM streamed no finish for them: the completion stream was empty, the chat stream a
    role chunk and usage, both indistinguishable from an empty answer)."""
    version = sender.next_version
    faults.write_text(f"{version} hold\n")  # the apply stays under way until the stop
    first, result = threading.Event(), {}

    def run() -> None:
        try:
            result["chunks"] = stream(client, server, PROMPTS[2], LONG, first)
        except Exception as exc:  # noqa: BLE001 - a stream cut short is an answer too
            result["error"] = exc

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    assert first.wait(60), "the stream never started"
    # (LONG tokens last seconds here: the swap pauses generation well before the end)
    assert sender.push(str(tiny_model("A"))) == version
    wait_until(lambda: (s := server.status())["applying"] == version and s["paused"], 60,
               0.05, "the swap to hold generation")
    unstarted = [RawStream(server, "/v1/completions", {"prompt": PROMPTS[0]}),
                 RawStream(server, "/v1/chat/completions", {
                     "messages": [{"role": "user", "content": PROMPTS[0]}],
                     "stream_options": {"include_usage": True}})]
    start = len(server.tail(10_000_000))
    server.proc.send_signal(signal.SIGTERM)
    # The apply under way ends soon after the signal, once the server took it (/health answers
    # 503, or no longer at all): ended before, it would resume generation first (it did once
    # on a loaded machine, and the held stream ran to its end).
    wait_until(lambda: _shutting_down(server), 60, 0.05, "the server to take the SIGTERM")
    faults.write_text("")
    assert server.proc.wait(60) == 0
    reader.join(30)
    assert not reader.is_alive(), "the held stream was never ended"
    ends = [c.choices[0].finish_reason for c in result.get("chunks", []) if c.choices]
    assert "length" not in ends, "the held request ran to its end: it was never held"
    for raw in unstarted:
        events = raw.events()
        assert events[-1] == "[DONE]", events
        finishes = [c for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert [(c["finish_reason"], c.get("text") or c.get("delta", {}).get("content") or "")
                for c in finishes] == [("abort", "")], (raw.path, events)
        assert all(e["model"] == server.model for e in events[:-1]), events
    after = server.tail(10_000_000)[start:]
    # (ended by the server's front end: the engine core, shutting down, may refuse the call)
    assert "request(s) held by the swap (finish_reason \"abort\")" in after, after[-3000:]
    for noise in ("Traceback", "EngineDeadError", "leaked", " ERROR "):
        assert noise not in after, after[-3000:]


def test_mistyped_model_path_fails_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve-vllm", str(tmp_path / "store"),
         "--model", str(tmp_path / "modle")], cwd=REPO, env=child_env(),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no such directory on this host" in proc.stderr
    assert "huggingface" not in (proc.stdout + proc.stderr).lower()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("args, hint", [
    (["--poll-intervall", "2"], "--poll-intervall: did you mean --poll-interval?"),
    (["--", "--pause-mode", "wait"], "--pause-mode is an option of serve-vllm itself: give it "
                                     "before '--'"),
    (["--", "--max-model-len", "abc"], "argument --max-model-len: invalid"),
    (["--", "--data-parallel-size", "2", "--data-parallel-external-lb"],
     "remove --data-parallel-rank / --data-parallel-external-lb"),
    (["--lora", "policy", "--", "--api-server-count", "2"], "remove --api-server-count"),
])
def test_a_bad_option_is_one_line_naming_it(tmp_path: Path, args: list[str], hint: str) -> None:
    """Not the pages of vLLM's usage text: what is wrong, and what was meant."""
    (tmp_path / "store").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve-vllm", str(tmp_path / "store"),
         "--model", str(tiny_model("A")), *args], cwd=REPO, env=child_env(),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    said = [line for line in proc.stderr.splitlines() if line.startswith("dbsync serve-vllm:")]
    assert len(said) == 1 and hint in said[0], proc.stderr[-2000:]
    assert "usage:" not in proc.stderr and "Initializing a V1 LLM engine" not in proc.stderr


def test_missing_store_fails_at_once(tmp_path: Path) -> None:
    """A mistyped ROOT is an error before the engine starts, not a store created and waited
    on."""
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve-vllm", str(tmp_path / "stroe"),
         "--model", str(tiny_model("A"))], cwd=REPO, env=child_env(),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "does not exist or is not a directory" in proc.stderr
    assert "Initializing a V1 LLM engine" not in proc.stdout + proc.stderr
    assert not (tmp_path / "stroe").exists()


def test_an_unusable_lora_work_directory_fails_at_once(tmp_path: Path) -> None:
    """``DBSYNC_LORA_WORKDIR`` naming a directory that cannot be made is said before the
    engine starts (it was a bare traceback after vLLM's 30-60 s start)."""
    store = tmp_path / "store"
    dbsync.Sender(store).close()
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve-vllm", str(store), "--model",
         str(tiny_model("A")), "--lora", "policy"], cwd=REPO,
        env={**child_env(), "DBSYNC_LORA_WORKDIR": "/proc/no-such-dir"},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "DBSYNC_LORA_WORKDIR=/proc/no-such-dir: cannot create it" in proc.stderr
    assert "Traceback" not in proc.stderr and "Initializing" not in proc.stdout + proc.stderr


def test_a_configuration_vllm_refuses_is_said_as_such_not_as_a_bug(tmp_path: Path) -> None:
    """An option vLLM's own configuration checks refuse (a context longer than the model's)
    is reported as vLLM refusing its configuration, not as a bug in dbsync."""
    root = tmp_path / "store"
    root.mkdir()  # (a store with nothing published yet: served as soon as one comes)
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve-vllm", str(root),
         "--model", str(tiny_model("A")), "--", "--max-model-len", "1000000"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "vLLM refused its configuration" in proc.stderr, proc.stderr[-2000:]
    assert "max_model_len" in proc.stderr or "max-model-len" in proc.stderr
    assert "bug in dbsync" not in proc.stderr


class RawStream:
    """A streamed request sent over a plain HTTP connection, read in a thread; the constructor
    returns once the response's headers came (the server handed the request to the engine)."""

    def __init__(self, server: Server, path: str, body: dict[str, Any]):
        self.path = path
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        self.conn.request("POST", path, json.dumps({
            "model": server.model, "max_tokens": 20, "temperature": 0.0, "stream": True,
            **body}), {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        self.body = b""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        self.body = self.response.read()
        self.conn.close()

    def events(self) -> list[Any]:
        """The stream's events: JSON objects, and the closing "[DONE]"."""
        self.reader.join(60)
        assert not self.reader.is_alive(), f"the stream of {self.path} never ended"
        data = [line[6:] for line in self.body.decode().splitlines()
                if line.startswith("data: ")]
        return [d if d == "[DONE]" else json.loads(d) for d in data]


def _shutting_down(server: Server) -> bool:
    """Whether the server took its stop signal: /health says 503, or nothing listens."""
    try:
        with urllib.request.urlopen(f"{server.base}/health", timeout=5):
            return False
    except urllib.error.HTTPError as exc:
        return exc.code == 503
    except (urllib.error.URLError, ConnectionError):
        return True
