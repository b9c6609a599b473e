"""`dbsync serve-vllm` as a pod on another host: its own UTS and PID namespaces (another
hostname, its pids meaningless to the writer), the store given to it read-only (a bind mount
remounted ro), a real CPU vLLM engine. What it serves is compared with fresh engines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dbsync
from tests.fleet_mounts import needs_root, read_only_view
from tests.fleet_workers import HERE
from tests.vllm_helpers import (
    DTYPE,
    KV_CACHE_BYTES,
    PROMPTS,
    REPO,
    Server,
    child_env,
    complete,
    free_port,
    reference,
    tiny_model,
    wait_until,
)

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def pod_server(root: str, model_dir: Path, log_path: Path, hostname: str) -> Server:
    """``python -m dbsync.vllm.server ROOT`` (the command behind ``dbsync serve-vllm``) in new
    UTS and PID namespaces; same network, so the test reaches its port."""
    server = Server.__new__(Server)
    server.port = free_port()
    server.base = f"http://127.0.0.1:{server.port}"
    server.model = str(model_dir)
    server.log_path = log_path
    cmd = ["unshare", "--uts", "--pid", "--fork", "--kill-child", sys.executable,
           os.path.join(HERE, "fleet_workers.py"), "namespaced", hostname, "-", "exec",
           sys.executable, "-m", "dbsync.vllm.server", root, "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(server.port), "--poll-interval", "0.2", "--",
           "--dtype", DTYPE, "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
           "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    server._log = open(log_path, "wb")  # noqa: SIM115 - closed by server.stop()
    server.proc = subprocess.Popen(cmd, cwd=REPO, stdout=server._log,
                                   stderr=subprocess.STDOUT,
                                   env=child_env(FLEET_HOST_UTS=str(os.stat(
                                       "/proc/self/ns/uts").st_ino)))
    return server


def served(server: Server) -> list[str]:
    return [complete(server.base, server.model, p) for p in PROMPTS]


class Pod:
    """The pod, the trainer's Sender and the store, shared by the tests of this module."""

    def __init__(self, server: Server, shared: Path) -> None:
        self.server = server
        self.store = shared / "store"
        self.sender = dbsync.Sender(self.store)
        self.from_a: list[str] = []


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    reference("B")  # a fresh engine from B, started now: overlaps the pod's start-up
    tmp = tmp_path_factory.mktemp("pod")
    shared = tmp / "shared"
    (shared / "store").mkdir(parents=True)
    with read_only_view(shared, tmp / "view") as view:
        pod = Pod(pod_server(os.path.join(view, "store"), tiny_model("A"), tmp / "pod.log",
                             "pod-host"), shared)
        try:
            pod.server.wait_ready()
            pod.from_a = served(pod.server)  # a fresh engine from A, by construction
            yield pod
        finally:
            pod.server.stop()
            pod.sender.close()


@needs_root
def test_pod_serves_pushed_versions_through_a_read_only_view(pod: Pod) -> None:
    """A version pushed into the store is served exactly: the completions of a fresh engine
    from those weights. The read-only pod registers nothing."""
    assert pod.sender.push(str(tiny_model("B"))) == 1
    status = pod.server.wait_version(1, timeout=120)
    assert status["healthy"] and status["last_error"] is None, status
    assert served(pod.server) == reference("B").result()
    assert os.listdir(pod.store / "readers") == []


@needs_root
def test_pod_follows_a_new_run_at_the_same_path(pod: Pod) -> None:
    """The store is wiped and a new training run publishes version 1 again, with other
    weights (A's): the pod applies it."""
    swaps = pod.server.status()["swaps"]
    pod.sender.close()
    shutil.rmtree(pod.store)  # a new training run at the same path
    pod.sender = dbsync.Sender(pod.store)
    assert pod.sender.push(str(tiny_model("A"))) == 1
    try:
        wait_until(lambda: pod.server.status()["swaps"] > swaps, 30, 0.2,
                   "the new run's version 1 to be applied")
    finally:
        print(pod.server.status(), file=sys.stderr)
    assert served(pod.server) == pod.from_a
    status = pod.server.status()
    assert status["version"] == 1 and status["last_error"] is None, status
