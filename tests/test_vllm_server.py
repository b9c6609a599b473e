"""`serve-vllm` end to end on the real CPU engine: one server started from checkpoint A on an
empty store; versions pushed while it runs. The tests run in file order and share the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dbsync
from tests.vllm_helpers import (
    PROMPTS,
    Server,
    complete,
    http_json,
    reference,
    running_server,
    tiny_model,
    wait_until,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "store"


@pytest.fixture(scope="module")
def sender(store: Path) -> Any:
    with dbsync.Sender(store) as s:
        yield s


@contextlib.contextmanager
def short_temp_dir() -> Iterator[Path]:
    """A server's temp directory (``TMPDIR``), where what it leaves is seen. Its path is short:
    serve-vllm keeps vLLM's default (sockets in the temp directory itself, left behind) where
    a socket path one directory deeper would not fit, as under pytest's temp directories."""
    path = Path(tempfile.mkdtemp(prefix="dbsync-test-tmp-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server_tmp() -> Iterator[Path]:
    with short_temp_dir() as path:
        yield path


@pytest.fixture(scope="module")
def server(store: Path, sender: Any, server_tmp: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    # the sender creates the (empty) store: a reader given a missing ROOT fails at once
    reference("B")  # start the reference engine now: it overlaps the server's start-up
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with running_server(store, tiny_model("A"), log, env={"TMPDIR": str(server_tmp)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def a_completions(server: Server) -> list[str]:
    """What the server answers before any version: a fresh engine from A, by construction."""
    return [complete(server.base, server.model, p) for p in PROMPTS]


def test_status_before_any_version(server: Server, a_completions: list[str]) -> None:
    status = server.status()
    assert status["version"] is None
    assert status["loaded_at"] is None
    assert status["last_error"] is None
    assert status["healthy"] is True
    assert len(a_completions) == len(PROMPTS)


def test_swap_matches_fresh_engine(server: Server, sender: Any,
                                   a_completions: list[str]) -> None:
    version = sender.push(str(tiny_model("B")))
    status = server.wait_version(version, timeout=60)
    assert status["healthy"] and status["last_error"] is None
    assert status["loaded_at"] is not None
    timings = status["timings"]
    assert timings["version"] == version
    assert 0 < timings["apply_s"] <= timings["pause_s"]
    got = [complete(server.base, server.model, p) for p in PROMPTS]
    assert got == reference("B").result()
    assert got != a_completions


def test_requests_during_swap_all_succeed(server: Server, sender: Any,
                                          a_completions: list[str]) -> None:
    """Four clients keep sending requests while A's weights are pushed as the next version."""
    stop = threading.Event()
    results: list[tuple[float, float, str | None]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        while not stop.is_set():
            t0 = time.time()
            try:
                text = complete(server.base, server.model, PROMPTS[i % len(PROMPTS)],
                                max_tokens=48)
                results.append((t0, time.time(), text))
            except BaseException as exc:  # every failure is a test failure below
                errors.append(exc)
                return

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    pushed_at = time.time()
    version = sender.push(str(tiny_model("A")))
    status = server.wait_version(version, timeout=60)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) >= 8
    assert all(text for _, _, text in results)
    spanning = [r for r in results if r[0] < status["loaded_at"] < r[1]]
    assert spanning, "no request was in flight during the swap"
    assert pushed_at < status["loaded_at"]
    got = [complete(server.base, server.model, p) for p in PROMPTS]
    assert got == a_completions


def test_incompatible_version_refused(server: Server, sender: Any,
                                      a_completions: list[str]) -> None:
    served = server.status()["version"]
    bad = sender.push(str(tiny_model("C")))
    status = server_wait(server, lambda s: s["last_error_version"] == bad)
    assert status["version"] == served
    assert status["healthy"] is True
    assert bad in status["refused_versions"]
    error = status["last_error"]
    assert f"version {bad} refused" in error
    assert "model.layers.0.mlp.gate_proj.weight: shape [384, 128] != expected [256, 128]" in error
    got = [complete(server.base, server.model, p) for p in PROMPTS]
    assert got == a_completions
    log = server.tail(200_000)
    assert log.count(f"version {bad} refused") == 1


def test_recovers_after_refusal(server: Server, sender: Any) -> None:
    version = sender.push(str(tiny_model("B")))
    status = server.wait_version(version, timeout=60)
    assert status["last_error"] is None
    got = [complete(server.base, server.model, p) for p in PROMPTS]
    assert got == reference("B").result()


def test_no_dev_mode_routes(server: Server) -> None:
    for path in ("/pause", "/update_weights", "/collective_rpc"):
        with pytest.raises(urllib.error.HTTPError) as info:
            http_json(f"{server.base}{path}", {})
        assert info.value.code == 404


def server_wait(server: Server, predicate: Any, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = server.status()
        if predicate(status):
            return status
        time.sleep(0.1)
    raise TimeoutError(f"status never matched: {server.status()}")



def _sockets_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_socket()]


def test_ctrl_c_stops_cleanly_with_exit_status_130(server: Server, server_tmp: Path) -> None:
    """The last test of the module: it stops the shared server. Ctrl-C is a clean stop, as
    SIGTERM is (test_vllm_serving), but its exit status says it was an interruption. Nothing
    is left in the server's temp directory: vLLM leaves its engine sockets behind at every
    stop, and a server its supervisor restarts used to fill /tmp with them."""
    import signal

    serving = _sockets_under(server_tmp)
    assert serving and all(p.parent.name.startswith("dbsync-sockets-") for p in serving), (
        serving)
    start = len(server.tail(10_000_000))
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(60) == 130
    after = server.tail(10_000_000)[start:]
    for noise in ("Traceback", "EngineDeadError", " ERROR "):
        assert noise not in after, after[-3000:]
    assert list(server_tmp.iterdir()) == []


def _descendants(pid: int) -> set[int]:
    """The live processes below ``pid`` (from /proc: parent ids)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process not yet reaped, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def starting_tmp() -> Iterator[Path]:
    with short_temp_dir() as path:
        yield path


def test_sigterm_while_the_engine_starts_stops_its_processes_too(
        store: Path, sender: Any, tmp_path: Path, starting_tmp: Path) -> None:
    """SIGTERM (``timeout``, a supervisor, a test harness's ``terminate()``) while the engine
    loads, before vLLM's own handlers are in place: the default action killed the server
    alone, and vLLM's engine and worker processes ran on (on a GPU, holding its memory). Now
    the start-up is cancelled as Ctrl-C cancels it: exit 143, nothing left running, nothing
    left in the temp directory. Started with SIGINT ignored, as a shell script's background
    job is: the first fix passed SIGTERM on as SIGINT, so there it still killed the server
    alone and left the engine running."""
    import signal

    srv = Server(store, tiny_model("A"), tmp_path / "starting.log",
                 env={"TMPDIR": str(starting_tmp)}, sigint_ignored=True)
    try:
        # the handshake: the engine's processes exist (the server is loading, not serving)
        wait_until(lambda: len(_descendants(srv.proc.pid)) >= 2 or srv.proc.poll() is not None,
                   180, 0.2, "the engine's processes to start")
        assert srv.proc.poll() is None, srv.tail()
        engine = _descendants(srv.proc.pid)
        with open(f"/proc/{srv.proc.pid}/status") as status:  # (the ignored-signal mask)
            ignored = int(next(x for x in status if x.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(120) == 128 + signal.SIGTERM, srv.tail()
        assert "stopped by SIGTERM while starting" in srv.tail()
        wait_until(lambda: not any(_alive(p) for p in engine), 60, 0.2,
                   "the engine's processes to end")
        assert list(starting_tmp.iterdir()) == []  # (vLLM's engine sockets included)
    finally:
        srv.stop()
