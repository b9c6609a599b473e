"""The ``dbsync`` command as a process: quick start without torch, Ctrl-C during a push (nothing
published before the flip, the truth after it), a reader of its output that goes away, bad
stores reported in one line without spinning, and the fleet view of ``dbsync status``."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import dbsync
from cli.main import cli
from dbsync.format import MANIFEST_FILE
from dbsync.store import Store
from tests.fleet_mounts import needs_root

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("DBSYNC_DEBUG", None)
    return env


class Lines:
    """Lines of a child's stream, read by a thread; ``wait_for`` blocks (bounded) for one."""

    def __init__(self, stream):
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, needle: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self._q.get(timeout=max(deadline - time.monotonic(), 0.01))
            if line is None:
                raise AssertionError(f"stream ended before {needle!r}: {self.seen}")
            self.seen.append(line)
            if needle in line:
                return line

    def rest(self) -> str:
        while (line := self._q.get(timeout=60)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


def version_of(root: str) -> int | None:
    manifest = Store(root).read_manifest()
    return None if manifest is None else manifest.version


@pytest.fixture
def st_file(tmp_path) -> str:
    path = str(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(64, 64, generator=g),
               "b.weight": torch.randn(256, 64, generator=g)}, path)
    return path


@pytest.fixture
def store2(root) -> str:
    """A store at version 2 (1 in slot a, 2 in slot b)."""
    with dbsync.Sender(root, durable=False) as sender:
        sender.push({"w": torch.ones(4)})
        sender.push({"w": torch.full((4,), 2.0)})
    return root


# ---- start-up ------------------------------------------------------------------------------
def test_help_starts_fast_and_without_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "cli.main", "--help"],
                          capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0 and "serve-vllm" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "click" in imported
    assert not {"torch", "numpy", "safetensors", "tensordict"} & imported
    walls = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run(cli_cmd("--help"), capture_output=True, env=cli_env(), cwd=REPO,
                       timeout=60, check=True)
        walls.append(time.monotonic() - t0)
    assert min(walls) < 0.5, walls


def test_status_and_watch_import_no_torch(store2):
    """Commands that only read the store start without torch (and its seconds of imports)."""
    script = (
        "import sys, json\n"
        "from cli.main import cli\n"
        "for args in (['status', sys.argv[1], '--json'], ['watch', sys.argv[1], '--count', '1']):\n"
        "    assert cli.main(args, standalone_mode=False) in (None, 0), args\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, store2], capture_output=True,
                          text=True, env=cli_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"version": 2' in proc.stdout  # both commands ran and printed the store
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# ---- a push waiting for readers ------------------------------------------------------------
@contextlib.contextmanager
def reader_holding(root: str, **receiver_args: Any) -> Iterator[subprocess.Popen]:
    """A Receiver in a process of its own (``Receiver(root, **receiver_args)``) holding the
    current version open until the block ends (then killed)."""
    code = ("import json, sys, dbsync; r = dbsync.Receiver(sys.argv[1], **json.loads(sys.argv[2]));"
            " s = r.open(); print(s.version, flush=True); sys.stdin.read()")
    reader = subprocess.Popen([sys.executable, "-c", code, root, json.dumps(receiver_args)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=cli_env())
    try:
        assert reader.stdout.readline().strip() == str(version_of(root))  # holding it
        yield reader
    finally:
        reader.kill()
        reader.wait()


def test_a_push_that_waited_out_a_stopped_reader_says_so(store2, st_file):
    """A reader stopped (SIGSTOP: a frozen or hung engine) while it holds the slot the push
    needs: the push waits out its lease timeout, then says at WARNING that the slot was taken
    from a reader judged dead, and its summary tells the wait apart from the writing (it
    said "wrote 1 MiB in 2.0 s" of a write that took milliseconds, and nothing else)."""
    with reader_holding(store2, lease_timeout=1.0) as reader:  # version 2: slot b
        with dbsync.Sender(store2, durable=False) as sender:
            assert sender.push({"w": torch.full((4,), 3.0)}) == 3  # slot a; next needs b
        os.kill(reader.pid, signal.SIGSTOP)
        pushed = subprocess.run(cli_cmd("push", st_file, store2), capture_output=True,
                                text=True, env=cli_env(), timeout=120)
    assert pushed.returncode == 0, pushed.stderr
    assert version_of(store2) == 4  # published, into the slot the stopped reader held
    assert "judged dead" in pushed.stderr and "is free after" in pushed.stderr
    [summary] = [line for line in pushed.stderr.splitlines() if line.startswith("published")]
    waited = float(summary.split("(of it ")[1].split(" s waiting for readers")[0])
    assert waited >= 0.9, summary  # the lease timeout, said as waiting (not as writing)


def test_reader_timeout_bounds_the_wait_for_a_live_reader(store2, st_file):
    """A live reader (renewing its lease: a hung load, an engine that never finishes) holds
    the slot the push must write: with --reader-timeout / ``reader_timeout`` the push gives
    up after that long, naming the reader, and publishes nothing (it waited for ever). A
    reader that stopped renewing (SIGSTOP, a crashed host) is waited out to its lease timeout
    instead: each new writer starts that clock again, so refusing at reader_timeout would
    refuse for ever."""
    with reader_holding(store2, reader_id="stuck-engine", lease_timeout=2.0) as reader:
        with dbsync.Sender(store2, durable=False, reader_timeout=0.5) as sender:
            assert sender.push({"w": torch.full((4,), 3.0)}) == 3  # slot a; next needs b
            start = time.monotonic()
            with pytest.raises(dbsync.SlotHeldError, match="stuck-engine") as info:
                sender.push({"w": torch.full((4,), 4.0)})
            assert 0.5 <= time.monotonic() - start < 5
            assert "nothing was published" in str(info.value)
        pushed = subprocess.run(cli_cmd("push", st_file, store2, "--reader-timeout", "0.5"),
                                capture_output=True, text=True, env=cli_env(), timeout=120)
        assert version_of(store2) == 3  # nothing was published by either
        os.kill(reader.pid, signal.SIGSTOP)
        with dbsync.Sender(store2, durable=False, reader_timeout=0.5) as sender:
            start = time.monotonic()
            assert sender.push({"w": torch.full((4,), 4.0)}) == 4  # the stopped one waited out
            assert 1.0 <= time.monotonic() - start < 10
    assert pushed.returncode == 1 and "stuck-engine" in pushed.stderr, pushed.stderr
    assert "Traceback" not in pushed.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_while_waiting_for_a_reader_publishes_nothing(store2, st_file, signum):
    """A reader holds the slot the push must write, so the push waits before writing; Ctrl-C
    then, and the push stops at once, the reader still holding: version 3 stays current.
    SIGTERM (from ``timeout``, systemd, Kubernetes) is handled the same way, saying
    "terminated" and exiting 143. (It killed the push with no word, and an interrupted push
    claimed "wrote <every byte>" before saying nothing was published.)"""
    with dbsync.Receiver(store2) as reader:
        snap = reader.open()  # leases version 2's slot
        with dbsync.Sender(store2, durable=False) as sender:
            assert sender.push({"w": torch.full((4,), 3.0)}) == 3  # into the other slot
        # The next push needs the slot ``snap`` holds.
        proc = subprocess.Popen(cli_cmd("push", st_file, store2), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO)
        err, out = Lines(proc.stderr), Lines(proc.stdout)
        try:
            err.wait_for("publishing 2 tensors")  # the Ctrl-C handler is in place
            proc.send_signal(signum)
            err.wait_for("stopping before the new version is published")
            # (while the reader still holds the slot)
            assert proc.wait(timeout=60) == (130 if signum == signal.SIGINT else 143)
        finally:
            snap.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = err.rest()
    assert "nothing was published" in stderr and "still serves version 3" in stderr
    assert ("terminated (SIGTERM)" in stderr) == (signum == signal.SIGTERM)
    assert "wrote" not in stderr
    assert "Traceback" not in stderr
    assert out.rest() == ""
    assert version_of(store2) == 3
    got: dict[str, torch.Tensor] = {}
    dbsync.Receiver(store2).load(lambda pairs: got.update((n, t.clone()) for n, t in pairs))
    assert torch.equal(got["w"], torch.full((4,), 3.0))  # version 3 still serves, intact


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_after_the_flip_says_what_was_published(store2, st_file, signum):
    """Stopped while waiting for receivers: the version stays published, and the push says so
    (SIGTERM used to kill it without a word)."""
    proc = subprocess.Popen(cli_cmd("push", st_file, store2, "--wait-for", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=REPO)
    err, out = Lines(proc.stderr), Lines(proc.stdout)
    try:
        assert out.wait_for("3").strip() == "3"  # published; now waiting for receivers
        err.wait_for("waiting for 1 receiver")
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.rest()
    assert "version 3 is published" in stderr and "Traceback" not in stderr
    assert ("terminated (SIGTERM) while waiting" in stderr) == (signum == signal.SIGTERM)
    assert version_of(store2) == 3


# ---- a reader that goes away -----------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ("status", "{root}"), ("status", "{root}", "--json"), ("watch", "{root}"),
    ("watch", "{root}", "--json"), ("verify", "{root}"), ("push", "{src}", "{root}"),
    ("--help",), ("--version",),
], ids=lambda a: "-".join(x.strip("{}-") for x in a))
def test_closed_output_pipe_exits_quietly(store2, st_file, args):
    argv = [a.format(root=store2, src=st_file) for a in args]
    proc = subprocess.Popen(cli_cmd(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(), cwd=REPO)
    proc.stdout.close()  # before the child can write a byte: its first write fails
    try:
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code in (0, 141), (code, stderr)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert "Broken pipe" not in stderr and "Error" not in stderr, stderr


def test_watch_into_head_exits_without_waiting_for_a_version(store2, st_file):
    """`dbsync watch ROOT | head -1`: head exits after one line; watch ends quietly (141)
    within a second, with nothing more published (before, it went on until the next
    version, forever on an idle store)."""
    script = (f"{' '.join(cli_cmd('watch', store2))} | head -1; "
              'echo "watch exit ${PIPESTATUS[0]}" >&2')
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        assert out.wait_for("version 2").startswith("version 2")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.rest()
    assert "watch exit 141" in stderr, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


# ---- bad stores --------------------------------------------------------------------------------
def run(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        result.exception)
    return result


def test_manifest_that_is_a_directory_is_one_plain_line(store2):
    path = os.path.join(store2, MANIFEST_FILE)
    os.replace(path, path + ".bak")
    os.mkdir(path)
    for args in (("status", store2), ("verify", store2)):
        result = run(*args)
        assert result.exit_code == 1, result.output
        lines = [x for x in result.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
        assert MANIFEST_FILE in lines[0] and "bug in dbsync" not in lines[0]


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
def test_watch_as_a_containers_first_process_stops_on_sigterm(store2, signum):
    """`dbsync watch` as PID 1 of its PID namespace (a container's entry point): the kernel
    ignores signals PID 1 has no handler for, so SIGTERM (`docker stop`, Kubernetes) left it
    running until the grace period's SIGKILL. It now exits 143 at once (SIGHUP: 129)."""
    proc = subprocess.Popen(["unshare", "--pid", "--fork", *cli_cmd("watch", store2)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), cwd=REPO)
    try:
        assert proc.stdout.readline().startswith("version 2")  # watching
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            (inner,) = f.read().split()  # the watch itself: PID 1 inside
        os.kill(int(inner), signum)
        assert proc.wait(timeout=10) == 128 + signum
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_on_a_garbled_manifest_warns_once_and_keeps_watching(store2):
    path = os.path.join(store2, MANIFEST_FILE)
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(b'{"format": "dbsync", "vers')
    proc = subprocess.Popen(cli_cmd("watch", store2, "--json"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        err.wait_for("cannot read the manifest")
        with open(path + ".tmp", "wb") as f:
            f.write(good)
        os.replace(path + ".tmp", path)  # repaired: version 2 readable again
        assert json.loads(out.wait_for("version"))["version"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130  # interrupted, as the README says
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.rest()
    assert stderr.count("cannot read the manifest") == 1, stderr
    assert len(stderr.splitlines()) <= 3, stderr
    assert "Traceback" not in stderr


# ---- fleet view ------------------------------------------------------------------------------
def test_status_fleet_view_live_idle_dead_refused(store2):
    """Each receiver's state (the library's judgement) and, for dead, stale and refused ones,
    why, in
    the table and in --json. Leases of receivers elsewhere are written as they would write
    them; the live and idle ones are real receivers in this process."""
    from dbsync.leases import host_identity

    store = Store(store2)
    finished = subprocess.Popen(["true"])
    finished.wait()
    now = time.time()

    def lease(reader_id: str, **fields) -> None:
        record = {"reader_id": reader_id, "host": "node-7", "pid": 4242, "state": "idle",
                  "loaded_version": 2, "beat": 1, "updated_at": now}
        record.update(fields)
        store.write_lease(reader_id, record)
        written = record["updated_at"]  # (its file written then, as the store's clock says)
        os.utime(store.lease_path(reader_id), (written, written))

    lease("local-gone", **host_identity(), pid=finished.pid)
    lease("remote-stale", updated_at=now - 130, lease_timeout=60)
    lease("remote-slow-beat", updated_at=now - 100, lease_timeout=60)
    lease("remote-refused", loaded_version=1,
          refused={"version": 2, "reason": "lm_head.weight: shape [8, 4] != [16, 4]"})
    lease("remote-old-refusal", refused={"version": 1, "reason": "since replaced"})
    with dbsync.Receiver(store2, reader_id="engine-reading") as reading, \
            dbsync.Receiver(store2, reader_id="engine-idle") as idle:
        idle.load(lambda pairs: None)
        with reading.open():  # reading now: live
            result = run("status", store2, "--json")
            human = run("status", store2).stdout
    assert result.exit_code == 0, result.output
    rx = {r["id"]: r for r in json.loads(result.stdout)["receivers"]}
    assert {k: v["state"] for k, v in rx.items()} == {
        "engine-reading": "live", "engine-idle": "idle", "local-gone": "dead",
        "remote-stale": "dead", "remote-slow-beat": "stale", "remote-refused": "refused",
        "remote-old-refusal": "idle",
    }
    assert (rx["engine-idle"]["version"], rx["engine-idle"]["lag"]) == (2, 0)
    assert rx["engine-idle"]["host"] == socket.gethostname()
    assert rx["local-gone"]["reason"] == f"process {finished.pid} on {socket.gethostname()} is gone"
    assert rx["remote-stale"]["reason"].startswith("lease not refreshed for 130 s")
    assert "twice its 60 s lease timeout" in rx["remote-stale"]["reason"]
    # past its lease timeout (the writer no longer waits for it), not yet twice it
    assert "waits at most one more lease timeout" in rx["remote-slow-beat"]["reason"]
    assert rx["remote-refused"]["reason"] == "version 2: lm_head.weight: shape [8, 4] != [16, 4]"
    assert rx["remote-refused"]["lag"] == 1 and rx["remote-refused"]["refused"]["version"] == 2
    assert "receivers  7 (1 live, 2 idle, 1 refused, 1 stale, 2 dead)" in human
    assert "remote-refused refused: version 2: lm_head.weight" in human
    assert "remote-stale dead: lease not refreshed for 130 s" in human


def test_status_names_reader_files_that_are_not_leases(store2):
    """Garbage in readers/ is not counted as a receiver: status names it and says why."""
    readers = os.path.join(store2, "readers")
    with open(os.path.join(readers, "empty.json"), "w") as f:
        f.write("{}")
    with open(os.path.join(readers, "odd.json"), "w") as f:
        json.dump({"host": "node-1", "pid": "abc", "lease_timeout": -5,
                   "updated_at": time.time()}, f)
    with dbsync.Receiver(store2, reader_id="engine"):
        human = run("status", store2).stdout
        as_json = json.loads(run("status", store2, "--json").stdout)
    assert "receivers  1 (1 idle)" in human
    assert "ignored    readers/empty.json: not a reader's lease (no host name)" in human
    assert "readers/odd.json: not a reader's lease (pid 'abc'" in human
    assert [r["id"] for r in as_json["receivers"]] == ["engine"]
    assert set(as_json["malformed_reader_files"]) == {"empty", "odd"}


def test_status_shows_a_stores_control_characters_escaped(store2, st_file):
    """Host names and refusal reasons are anyone's text: escape sequences, carriage returns
    and newlines from the store are shown escaped, never acted on by the terminal or forging
    lines of their own."""
    lease = {"reader_id": "evil", "host": "h\x1b[2Jx", "pid": 4242, "lease_timeout": 30,
             "beat": 1, "updated_at": time.time(), "held": [], "loaded_version": 1,
             "loaded_run_id": None, "refused": {"version": 2, "at": time.time(),
                                                "reason": "bad\x1b]0;title\x07\nversion    999"}}
    with open(os.path.join(store2, "readers", "evil.json"), "w") as f:
        json.dump(lease, f)
    human = run("status", store2).stdout
    assert "\x1b" not in human and "\x07" not in human
    assert "version    999" not in human.splitlines()
    assert "h\\x1b[2Jx" in human
    assert "\\x07\\nversion    999" in human  # the reason shown, escaped

    # the same reason ends a push waiting for receivers: its error shows it escaped too
    lease["refused"]["version"] = 3  # the version about to be pushed
    with open(os.path.join(store2, "readers", "evil.json"), "w") as f:
        json.dump(lease, f)
    pushed = run("push", st_file, store2, "--wait-for", "1", "--timeout", "30")
    assert pushed.exit_code == 1
    assert "evil" in pushed.stderr and "\\x07\\nversion    999" in pushed.stderr
    assert "\x1b" not in pushed.stderr and "\x07" not in pushed.stderr


def test_impossible_times_and_numbers_in_a_store_still_print(store2):
    """A head whose ``created_at`` no calendar holds (1e20) and a reader file renewed at
    ``Infinity``: ``status`` and ``watch`` print the version (the time said to be none), and
    ``status --json`` stays strict JSON (the reader file is listed as no lease)."""
    path = os.path.join(store2, MANIFEST_FILE)
    with open(path) as f:
        head = json.load(f)
    head["created_at"] = 1e20
    with open(path, "w") as f:
        json.dump(head, f)
    with open(os.path.join(store2, "readers", "odd.json"), "w") as f:
        f.write('{"reader_id": "odd", "host": "h", "pid": 7, "updated_at": Infinity}')
    human = run("status", store2)
    assert human.exit_code == 0 and "1e+20 (not a time)" in human.stdout, human.output
    strict = json.loads(run("status", store2, "--json").stdout,
                        parse_constant=lambda c: pytest.fail(f"non-standard JSON: {c}"))
    assert strict["version"] == 2 and "odd" in strict["malformed_reader_files"]
    watched = run("watch", store2, "--count", "1")
    assert watched.exit_code == 0 and watched.stdout.startswith("version 2"), watched.output


def test_log_level_shows_the_library_lines_a_user_asks_for(store2, st_file, tmp_path):
    """``--log-level`` (or DBSYNC_LOG_LEVEL) shows the library's own lines, each with its
    level; before, only warnings came out, through Python's last-resort handler, without
    one. A level that is none is a usage error (exit 2) that names the choices."""
    env = dict(cli_env(), DBSYNC_LOG_LEVEL="debug")
    shown = subprocess.run(cli_cmd("push", st_file, store2), capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=120)
    quiet = subprocess.run(cli_cmd("--log-level", "error", "push", st_file, store2),
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert shown.returncode == quiet.returncode == 0, shown.stderr + quiet.stderr
    assert "(dbsync) DEBUG" in shown.stderr or "(dbsync) INFO" in shown.stderr, shown.stderr
    assert "(dbsync)" not in quiet.stderr  # (the option wins over the environment)
    bad = subprocess.run(cli_cmd("--log-level", "loud", "status", store2), capture_output=True,
                         text=True, env=cli_env(), cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "debug" in bad.stderr and "Traceback" not in bad.stderr
