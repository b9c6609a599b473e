"""A process at one of its own limits (address space, open files, threads) is told which limit,
and the version it was reading is not blamed: no "damaged, publish again", no refusal the
trainer sees, and the same receiver loads it once the limit is lifted. Each case runs in a
process of its own, whose limits it lowers for real (``setrlimit``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import types

import pytest
import torch
from conftest import REPO

import dbsync
from dbsync import format as fmt


def run_limited(script: str, *args: str, user: int | None = None) -> dict:
    """Run ``script`` (Python, its last line printing one JSON object) in a process of its
    own; ``user``: as that uid (its thread limit, RLIMIT_NPROC, binds only a non-root user)."""
    cmd = [sys.executable, "-c", textwrap.dedent(script), *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LOAD_AT_A_LIMIT = """
    import json, os, resource, sys
    import torch, dbsync
    root, which = sys.argv[1], sys.argv[2]
    rx = dbsync.Receiver(root, reader_id="engine-0")
    rx.load(lambda pairs: None)  # (threads and caches warmed up: only the limit differs)
    from dbsync import unmapping
    assert unmapping.dropped(60)  # (that load's mapping is gone before VmSize is read)
    out = {}
    if which == "address space":
        size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        limit = resource.RLIMIT_AS, size + (64 << 20)  # less than the version's one shard
    else:
        held = len(os.listdir("/proc/self/fd"))
        limit = resource.RLIMIT_NOFILE, held + int(which.split()[-1])
    saved = resource.getrlimit(limit[0])
    resource.setrlimit(limit[0], (limit[1], saved[1]))
    try:
        rx.load(lambda pairs: None)
        out["error"] = None
    except Exception as exc:
        out["error"], out["message"] = type(exc).__name__, str(exc)
        out["errno"] = getattr(exc, "errno", None)
    resource.setrlimit(limit[0], saved)
    got = {}
    out["version_after"] = rx.load(lambda pairs: got.update(
        {n: float(t.float().sum()) for n, t in pairs}))
    out["sums"] = got
    rx.close()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """A version of 192 MiB in one shard (so one mapping of that size), and a small tensor."""
    root = str(tmp_path_factory.mktemp("limits") / "store")
    with dbsync.Sender(root, durable=False) as sender:
        sender.push({"big": torch.ones(48 << 20), "small": torch.arange(4.0)})
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("which", ["address space", "open files 0", "open files 1"])
def test_a_load_at_a_process_limit_names_the_limit_and_blames_no_version(big_store, which):
    """Before: out of address space (``ulimit -v``, or ``vm.max_map_count`` used up) the
    intact version was "damaged ... publish again" and recorded as refused (the trainer's
    ``wait_for_receivers`` failed); out of descriptors, a bare EMFILE, or a lease "that
    cannot be written" and a private copy of the whole version."""
    out = run_limited(LOAD_AT_A_LIMIT, big_store, which)
    assert out["error"] == "ResourceLimitError", out
    limit = "ulimit -v" if which == "address space" else "ulimit -n"
    assert limit in out["message"] and "nothing is known to be damaged" in out["message"]
    assert "publish again" not in out["message"]
    assert out["version_after"] == 1
    assert out["sums"] == {"big": float(48 << 20), "small": 6.0}
    lease = dbsync.store.Store(big_store).read_lease("engine-0")
    assert lease is None or lease.get("refused") is None  # (the trainer sees no refusal)
    with dbsync.Sender(big_store, durable=False) as sender:
        assert sender.wait_for_receivers(1, count=0, timeout=1)


def test_an_index_too_big_for_the_memory_left_is_not_called_damaged():
    """Parsing a manifest index needs memory; a process without enough was told the file was
    "not valid JSON ... something other than dbsync wrote it: publish again"."""
    out = run_limited("""
        import json, resource
        from dbsync import format as fmt
        raw = b"[" + b'"abcdefghij",' * 4_000_000 + b"1]"
        size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (size + (32 << 20), hard))
        try:
            fmt.loads_json(raw, "index.json")
            out = {"error": None}
        except Exception as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        print(json.dumps(out))
    """)
    assert out["error"] == "ResourceLimitError", out
    assert "reading index.json" in out["message"] and "ulimit -v" in out["message"]
    with pytest.raises(dbsync.FormatError, match="not valid JSON"):  # (damage still is)
        fmt.loads_json(b"[1, 2", "index.json")


def test_no_thread_left_names_the_thread_limit_and_the_sender_goes_on():
    """At the thread limit (``ulimit -u``; a container's pids.max) a push said "this Sender
    was closed (by another thread) ... create a new one", and receivers and watchers raised a
    bare RuntimeError. (RLIMIT_NPROC binds only a non-root user: run as one.)"""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as a non-root user")
    probe = subprocess.run(["setpriv", "--reuid=54321", "--regid=54321", "--clear-groups",
                            sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import dbsync", REPO], capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("this checkout or its Python cannot be read by another user")
    work = tempfile.mkdtemp(prefix="dbsync-threads-")  # (pytest's own is root's alone)
    os.chmod(work, 0o777)
    try:
        out = thread_limited(os.path.join(work, "store"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for what in ("push", "receiver", "writers"):
        assert out[what] is not None and out[what][0] == "ResourceLimitError", out
        assert "ulimit -u" in out[what][1]
    assert "nothing was published" in out["push"][1] and "closed" not in out["push"][1]
    assert "nothing was published" in out["writers"][1]  # (a bare RuntimeError before)
    assert out["pushed_after"] == 2 and out["loaded_after"] == 2


def thread_limited(root: str) -> dict:
    return run_limited("""
        import json, os, resource, sys
        import torch, dbsync
        root = sys.argv[1]
        sender = dbsync.Sender(root, durable=False)
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        resource.setrlimit(resource.RLIMIT_NPROC, (len(os.listdir("/proc/self/task")), hard))
        out = {}
        for what, call in [("push", lambda: sender.push({"w": torch.ones(4)})),
                           ("receiver", lambda: dbsync.Receiver(root))]:
            try:
                call()
                out[what] = None
            except Exception as exc:
                out[what] = [type(exc).__name__, str(exc)]
        # the writer threads, started as a push needs them: one pushed tensor needs one
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        sender.push({"w": torch.ones(4)})
        big = {f"w{i}": torch.ones(2**20 + 16) for i in range(6)}  # a writer thread each
        resource.setrlimit(resource.RLIMIT_NPROC, (len(os.listdir("/proc/self/task")), hard))
        try:
            sender.push(big)
            out["writers"] = None
        except Exception as exc:
            out["writers"] = [type(exc).__name__, str(exc)]
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        out["pushed_after"] = sender.push({"w": torch.ones(4)})
        with dbsync.Receiver(root) as rx:
            out["loaded_after"] = rx.load(lambda pairs: None)
        sender.close()
        print(json.dumps(out))
    """, root, user=54321)


def test_pushes_and_loads_go_on_while_another_thread_imports_tensordict(root, monkeypatch):
    """While a thread imports tensordict (``snap.tensordict()``, ``import torchrl``), the
    package sits in ``sys.modules`` half-initialized, without ``TensorDictBase``: a push or a
    load of plain dicts in another thread died with AttributeError ("partially initialized
    module"). That state, held still here: both go on, exact."""
    monkeypatch.setitem(sys.modules, "tensordict", types.ModuleType("tensordict"))
    weights = {"a": torch.arange(6.0), "b": torch.ones(2, 3)}
    done: dict[str, object] = {}

    def push_and_load() -> None:
        with dbsync.Sender(root) as sender:
            done["version"] = sender.push(weights)
        dest = {name: torch.zeros_like(t) for name, t in weights.items()}
        with dbsync.Receiver(root) as rx:
            done["loaded"] = rx.load(dest)
        done["dest"] = dest

    thread = threading.Thread(target=push_and_load)
    thread.start()
    thread.join(120)
    assert done.get("version") == 1 and done.get("loaded") == 1, done
    assert all(torch.equal(done["dest"][n], t) for n, t in weights.items())  # type: ignore[index]
