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
    rx = dbsync.Receiver(root, reader_id="engine-0", read_only=which.endswith("read-only"))
    rx.load(lambda pairs: None)  # (threads and caches warmed up: only the limit differs)
    from dbsync import unmapping
    assert unmapping.dropped(60)  # (that load's mapping is gone before VmSize is read)
    out = {}
    if which.startswith("address space"):
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


@pytest.mark.parametrize("which", ["address space", "address space, read-only",
                                   "open files 0", "open files 1"])
def test_a_load_at_a_process_limit_names_the_limit_and_blames_no_version(big_store, which):
    """Before: out of address space (``ulimit -v``, or ``vm.max_map_count`` used up) the
    intact version was "damaged ... publish again" and recorded as refused (the trainer's
    ``wait_for_receivers`` failed), also for a reader without a lease, whose private copy of
    a shard did not fit; out of descriptors, a bare EMFILE, or a lease "that cannot be
    written" and a private copy of the whole version."""
    out = run_limited(LOAD_AT_A_LIMIT, big_store, which)
    assert out["error"] == "ResourceLimitError", out
    limit = "ulimit -v" if which.startswith("address space") else "ulimit -n"
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


def _memory_cgroup() -> str | None:
    """A new memory cgroup (v1, or v2 where the root delegates memory), or None."""
    if os.geteuid() != 0:
        return None
    name = f"dbsync-test-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        path = os.path.join(v1, name)
    else:
        try:
            with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
                if "memory" not in f.read().split():
                    return None
        except OSError:
            return None
        path = os.path.join("/sys/fs/cgroup", name)
    try:
        os.mkdir(path)
    except OSError:
        return None
    return path


def test_a_leaseless_load_past_the_memory_limit_is_refused_not_killed(root):
    """A reader without a lease (a read-only view) copies the version into private memory;
    in a container whose memory limit leaves less than that, the kernel killed it (exit 137,
    no word to anyone). It now refuses with ResourceLimitError naming what it needs and what
    the limit leaves, nothing applied, and loads once the limit allows."""
    with open("/proc/meminfo") as f:
        if any(line.split()[:2] not in (["SwapTotal:", "0"],)
               for line in f if line.startswith("SwapTotal:")):
            pytest.skip("this host swaps: past a memory limit a process swaps, and is not "
                        "refused")
    cgroup = _memory_cgroup()
    if cgroup is None:
        pytest.skip("needs root and a memory cgroup controller to make a limited cgroup")
    with dbsync.Sender(root, durable=False) as sender:
        sender.push({f"w{i}": torch.ones(2**24) for i in range(4)})  # 256 MiB
    try:
        out = run_limited("""
            import json, os, sys
            import torch, dbsync
            root, cgroup = sys.argv[1], sys.argv[2]
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
            v1 = os.path.exists(os.path.join(cgroup, "memory.limit_in_bytes"))
            limit_file = os.path.join(cgroup, "memory.limit_in_bytes" if v1 else "memory.max")
            usage_file = os.path.join(cgroup, "memory.usage_in_bytes" if v1 else
                                      "memory.current")
            weights = {f"w{i}": torch.full((2**24,), 2.0) for i in range(4)}
            usage = int(open(usage_file).read())
            with open(limit_file, "w") as f:
                f.write(str(usage + (96 << 20)))  # room for far less than 256 MiB
            rx = dbsync.Receiver(root, read_only=True)
            got = []
            try:
                rx.load(lambda pairs: got.extend(name for name, _ in pairs))
                out = {"error": None}
            except dbsync.ResourceLimitError as exc:
                out = {"error": str(exc), "applied": len(got)}
            with dbsync.Sender(root, durable=False) as sender:
                try:  # (a background push's staging copy of the weights)
                    sender.push(weights, blocking=False).result()
                    out["async_error"] = None
                except dbsync.ResourceLimitError as exc:
                    out["async_error"] = str(exc)
                out["published"] = sender.latest_version()
            with open(limit_file, "w") as f:
                f.write("-1" if v1 else "max")
            out["after"] = rx.load(lambda pairs: None)
            print(json.dumps(out))
        """, root, cgroup)
    finally:
        os.rmdir(cgroup)
    assert out["error"] is not None, out
    assert "needs 256 MiB" in out["error"] and "Nothing was applied" in out["error"], out
    assert out["applied"] == 0 and out["after"] == 1
    assert "background push" in out["async_error"] and "blocking=True" in out["async_error"]
    assert out["published"] == 1


def test_memory_room_reads_the_tightest_cgroup_limit(tmp_path):
    """cgroup v2 (the files a container sees): the tightest level's limit, page cache the
    kernel can drop counted as free (tmpfs pages not), "max" as no limit; v1's effective
    (hierarchical) limit; nothing where no limit binds."""
    from dbsync import memlimit

    def files(where, **values):
        os.makedirs(where, exist_ok=True)
        for name, value in values.items():
            with open(os.path.join(where, name.replace("_", ".", 1)), "w") as f:
                f.write(value)

    noswap = tmp_path / "meminfo"
    noswap.write_text("MemTotal: 16000000 kB\nSwapFree: 0 kB\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/engine\n")
    v2 = tmp_path / "v2"
    files(v2 / "pod", memory_max=str(8 << 30), memory_current=str(1 << 30),
          memory_stat="file 0\nshmem 0\n")
    files(v2 / "pod" / "engine", memory_max=str(2 << 30), memory_current=str(1536 << 20),
          memory_stat=f"anon {1 << 30}\nfile {512 << 20}\nshmem {128 << 20}\n")
    found = memlimit.room(str(proc), str(v2), str(noswap))
    assert found is not None and found.limit == 2 << 30
    assert found.free == (2 << 30) - (1536 << 20) + (384 << 20)  # cache but tmpfs is free
    files(v2 / "pod" / "engine", memory_max="max")
    assert memlimit.room(str(proc), str(v2), str(noswap)).limit == 8 << 30  # the parent's binds
    files(v2 / "pod", memory_max="max")
    assert memlimit.room(str(proc), str(v2), str(noswap)) is None

    proc.write_text("7:memory:/job\n0::/\n")
    v1 = tmp_path / "v1" / "memory" / "job"
    files(v1, memory_usage_in_bytes=str(600 << 20),
          memory_stat=f"hierarchical_memory_limit {1 << 30}\ntotal_cache {200 << 20}\n"
                      f"total_shmem 0\n")
    v1_room = memlimit.room(str(proc), str(tmp_path / "v1"), str(noswap))
    assert v1_room.free == (1 << 30) - (400 << 20)
    # a parent's limit (a slice, a pod) binds what all its children use together
    proc.write_text("7:memory:/slice/engine\n")
    files(tmp_path / "v1" / "memory" / "slice", memory_limit_in_bytes=str(1100 << 20),
          memory_usage_in_bytes=str(700 << 20), memory_stat="total_cache 0\ntotal_shmem 0\n")
    files(tmp_path / "v1" / "memory" / "slice" / "engine", memory_usage_in_bytes=str(400 << 20),
          memory_stat=f"hierarchical_memory_limit {1100 << 20}\ntotal_cache 0\n")
    parent = memlimit.room(str(proc), str(tmp_path / "v1"), str(noswap))
    assert parent.free == 400 << 20 and parent.where.endswith("slice")
    proc.write_text("7:memory:/job\n")
    # without a cgroup namespace v1 names the host's path; the mount is this cgroup's own
    proc.write_text("7:memory:/docker/0123abcd\n")
    (tmp_path / "v1" / "memory" / "memory.stat").write_text(
        f"hierarchical_memory_limit {1 << 30}\ntotal_cache 0\ntotal_shmem 0\n")
    (tmp_path / "v1" / "memory" / "memory.usage_in_bytes").write_text(str(100 << 20))
    assert memlimit.room(str(proc), str(tmp_path / "v1"), str(noswap)).free == 924 << 20
    # swap the cgroup may use is room too (past the limit the kernel swaps, not kills)
    swap = tmp_path / "swapinfo"
    swap.write_text("SwapFree: 2097152 kB\n")  # 2 GiB free on the host
    (tmp_path / "v1" / "memory" / "memory.memsw.limit_in_bytes").write_text(str(1536 << 20))
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text(str(1 << 30))
    (tmp_path / "v1" / "memory" / "memory.memsw.usage_in_bytes").write_text(str(100 << 20))
    assert memlimit.room(str(proc), str(tmp_path / "v1"), str(swap)).free == (924 + 512) << 20

def test_a_write_whose_thread_could_not_start_never_writes_after_the_push_fails(
        tmp_path, monkeypatch):
    """``ThreadPoolExecutor.submit`` queues its task before it fails to start a thread for it
    (the thread limit): that task, with no future to cancel, ran later on a pool thread into
    a descriptor the push had closed meanwhile, and the number had been reused by another
    file (here: 8 MiB landed in it). Once a submit fails, no queued task starts writing."""
    from concurrent.futures import ThreadPoolExecutor

    from dbsync import fileio

    size = fileio.GROUP_BYTES
    views = [memoryview(bytes([65 + i]) * size) for i in range(2)]  # two tasks, one shard
    placed = fileio.Placed.of(views, [0, 0], [0, size])
    fd = os.open(tmp_path / "shard", os.O_RDWR | os.O_CREAT)
    pool = ThreadPoolExecutor(4)
    first_started = threading.Event()
    release = threading.Event()

    def gate() -> None:  # the first task holds the pool's only thread a while
        first_started.set()
        release.wait(0.5)

    real_start = threading.Thread.start
    started = [0]

    def start(thread) -> None:
        started[0] += 1
        if started[0] > 1:  # (the thread limit: a container's pids.max)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        fileio.write_shards([fd], placed, pool, durable=False, gate=gate)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    os.close(fd)  # the push closes its shard ...
    other = os.open(tmp_path / "unrelated", os.O_RDWR | os.O_CREAT)  # ... and fds are reused
    try:
        release.set()
        pool.shutdown(wait=True)  # (every queued task has run, or returned at once)
        assert os.path.getsize(tmp_path / "unrelated") == 0
    finally:
        os.close(other)


OUT_OF_FILES_AFTER_THE_APPLY = """
    import io, json, logging, os, resource, sys
    import torch, dbsync
    root = sys.argv[1]
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(16)})
    said = io.StringIO()
    logging.getLogger("dbsync").addHandler(logging.StreamHandler(said))
    logging.getLogger("dbsync").setLevel(logging.INFO)
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []

    def use_every_descriptor(pairs):  # (the apply leaves no descriptor free)
        for _ in pairs:
            pass
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass

    rx = dbsync.Receiver(root)
    try:
        rx.load(use_every_descriptor)
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    for fd in held:
        os.close(fd)
    again = rx.load(lambda pairs: None)
    print(json.dumps({"error": error, "again": again, "said": said.getvalue()}))
"""


def test_out_of_files_when_checking_the_slot_after_the_apply_is_no_reused_slot(tmp_path):
    """A reader whose process ran out of open files by the time it checks, after the apply,
    that the slot still holds the version: it is told that limit (what was read is not
    trusted), not that "a writer reused it without seeing this reader's lease ... NFS or
    FUSE caches" (nothing was reused; it read the stamp as changed), and no "replaced while
    it read it" is logged. It loads once descriptors are free (*)."""
    out = run_limited(OUT_OF_FILES_AFTER_THE_APPLY, str(tmp_path / "store"))
    assert out["error"] is not None and out["error"][0] == "ResourceLimitError", out
    assert "checking that slot a still holds version 1" in out["error"][1], out
    assert "open files" in out["error"][1] and "reused" not in out["error"][1], out
    assert "replaced while" not in out["said"], out["said"]
    assert out["again"] == 1
