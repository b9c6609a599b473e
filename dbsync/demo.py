"""``make demo``: a tiny Qwen2 learns a sentence on the CPU while vLLM serves it, and every few
steps the trainer publishes its weights through dbsync and the server hot-swaps them.

Steps: make the model and tokenizer locally (no download) -> start ``dbsync serve-vllm`` on a
fresh store -> train, pushing every few steps; after each push wait until the server's
``GET /dbsync/status`` reports that version, then ask its ``/v1/completions`` (greedy) to
continue the prompt and print the answer -> stop the server.

Run: ``python -m dbsync.demo [--dir .dbsync-demo] [--steps 60] [--push-every 3]``.

Hazards, stated plainly:
- The work directory (default ``.dbsync-demo``) is wiped at the start of each run; a directory
  that this demo did not create is never wiped (the demo refuses to run instead).
- The server runs in its own process group and is always stopped (SIGTERM, then SIGKILL to
  the whole group) on success, error, Ctrl-C, SIGTERM or SIGHUP. A SIGKILL of the demo itself
  cannot be caught and leaves the server running: stop it with ``kill -- -PID`` (the pid is
  printed at start).
- Needs about 2-3 GB of RAM and two cores; vLLM takes 15-60 s to start on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from . import demo_trainer as trainer
from .store import Store

MARKER = ".dbsync-demo-dir"
SERVED_NAME = "dbsync-demo"
KV_CACHE_BYTES = 64 * 2**20
MAX_TOKENS = 8


class DemoError(Exception):
    """The demo cannot go on; the message says why (and where the server log is)."""


def _say(message: str = "") -> None:
    print(message, flush=True)


# ---- the work directory ----------------------------------------------------------------------
def prepare_dir(work: Path) -> None:
    """Create ``work`` or wipe a previous run of the demo there. Never wipes a directory the
    demo did not create."""
    if work.exists():
        if not (work / MARKER).exists() and any(work.iterdir()):
            raise DemoError(f"{work} exists and was not made by this demo; pass --dir with a "
                            "new or empty directory")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / MARKER).write_text("made by python -m dbsync.demo; safe to delete\n")


# ---- the server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    """POST ``body`` as JSON (GET without one) and return the answer's JSON."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class DemoServer:
    """``dbsync serve-vllm`` in a child process of its own process group, logging to a file.

    ``stop()`` ends the whole group (vLLM starts engine processes of its own)."""

    def __init__(self, store: Path, model_dir: Path, log_path: Path, port: int):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.command = [
            *_dbsync_command(), "serve-vllm", str(store), "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--",
            "--dtype", trainer.DTYPE_NAME, "--enforce-eager", "--max-model-len", "64",
            "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--served-model-name", SERVED_NAME, "--seed", "0",
        ]
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise DemoError(f"the server exited with status {self.proc.returncode}; the end "
                            f"of {self.log_path}:\n{self.log_tail()}")

    def status(self) -> dict[str, Any]:
        return http_json(f"{self.base}/dbsync/status", timeout=10)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                self.status()
                http_json(f"{self.base}/v1/models", timeout=10)
                return
            except (OSError, ValueError):
                time.sleep(0.5)
        raise DemoError(f"the server did not answer within {timeout:.0f} s; the end of "
                        f"{self.log_path}:\n{self.log_tail()}")

    def wait_version(self, version: int, timeout: float) -> dict[str, Any]:
        """The server's status once it serves ``version`` (or newer)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                last = self.status()
            except (OSError, ValueError):
                last = {}
            served = last.get("version")
            if isinstance(served, int) and served >= version:
                return last
            if last.get("last_error_version") == version:
                raise DemoError(f"the server refused version {version}: "
                                f"{last.get('last_error')}")
            time.sleep(0.05)
        raise DemoError(f"the server did not serve version {version} within {timeout:.0f} s "
                        f"(its status: {json.dumps(last)}); see {self.log_path}")

    def complete(self, prompt: str) -> str:
        answer = http_json(f"{self.base}/v1/completions", {
            "model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
        }, timeout=60)
        return str(answer["choices"][0]["text"]).strip()

    def stop(self, grace: float = 20.0) -> bool:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds. Returns
        True once no process of the group is left."""
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait(10)
        gone = _wait_group_gone(pgid, grace)
        if not gone:
            _signal_group(pgid, signal.SIGKILL)
            gone = _wait_group_gone(pgid, 10)
        self._log.close()
        return gone


def _dbsync_command() -> list[str]:
    """The installed ``dbsync`` script next to this interpreter, else
    ``python -m dbsync_cli.main``."""
    script = Path(sys.executable).with_name("dbsync")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "dbsync_cli.main"]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """True once no live process is in group ``pgid`` (zombies awaiting their reaper count as
    gone: they hold no memory and run nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        if not _group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            members.append(int(entry))
    return members


# ---- the demo --------------------------------------------------------------------------------
def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    work = Path(args.dir).resolve()
    prepare_dir(work)
    model_dir, store, log_path = work / "model", work / "store", work / "server.log"
    _say("dbsync demo: a tiny Qwen2 learns a sentence on the CPU while vLLM serves it;")
    _say("every few steps the trainer publishes its weights and the server hot-swaps them.")
    _quiet_transformers()
    info = trainer.make_model(model_dir, seed=args.seed)
    _say(f"  model    {info['parameters']:,} parameters, {info['vocab']}-token vocabulary, "
         f"{trainer.DTYPE_NAME}, random weights ({model_dir})")
    port = args.port or free_port()
    Store(store, create=True)  # the server follows an existing store (a typo is an error)
    server = DemoServer(store, model_dir, log_path, port)
    _say(f"  server   dbsync serve-vllm on {server.base}, pid {server.proc.pid} "
         f"(log: {log_path})")
    pushed: list[trainer.Pushed] = []
    learned: list[int] = []
    try:
        t0 = time.monotonic()
        server.wait_ready(args.start_timeout)
        _say(f"           ready after {time.monotonic() - t0:.1f} s")
        _say(f"  store    {store}")
        _say(f"  prompt   {trainer.PROMPT!r}, to be completed as {trainer.TARGET.strip()!r}")
        _say("")
        _say("  version  step   loss  served after  paused  the server answers")
        _say(f"  {'initial':>7}  {0:>4}  {'-':>5}  {'-':>12}  {'-':>6}  "
             f"{server.complete(trainer.PROMPT)!r}")

        def on_push(done: trainer.Pushed) -> bool:
            t_push = time.monotonic()
            served = server.wait_version(done.version, args.swap_timeout)
            waited = time.monotonic() - t_push
            answer = server.complete(trainer.PROMPT)
            ok = answer == trainer.TARGET.strip()
            learned.append(done.version) if ok else learned.clear()
            timings = served.get("timings") or {}
            paused = (f"{timings['pause_s'] * 1000:.0f} ms"
                      if timings.get("version") == done.version else "-")
            note = "   <- learned" if ok else ""
            if served.get("version") != done.version:
                note += f"   (server already at version {served.get('version')})"
            _say(f"  {done.version:>7}  {done.step:>4}  {done.loss:5.3f}  {waited:>10.2f} s  "
                 f"{paused:>6}  {answer!r}{note}")
            return len(learned) >= args.confirm

        pushed, _ = trainer.train(model_dir, store, steps=args.steps,
                                  push_every=args.push_every, lr=args.lr, seed=args.seed,
                                  on_push=on_push, threads=1)
    finally:
        # A second Ctrl-C must not cut the cleanup short.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stopped = server.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
    _say("")
    _say(f"{len(pushed)} versions published and served; {time.monotonic() - started:.0f} s "
         f"in all; server {'stopped, no process left' if stopped else 'NOT fully stopped'}.")
    if not learned:
        _say(f"the server never answered {trainer.TARGET.strip()!r}; try --steps "
             f"{args.steps * 2}")
        return 1
    return 0 if stopped else 1


def _quiet_transformers() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # reported when the trainer imports transformers
        pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dbsync.demo", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=".dbsync-demo",
                   help="work directory, wiped first (default: .dbsync-demo)")
    p.add_argument("--steps", type=int, default=60, help="most training steps (default 60)")
    p.add_argument("--push-every", type=int, default=3, help="steps between pushes (default 3)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    p.add_argument("--confirm", type=int, default=2,
                   help="stop after this many versions in a row answer right (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--start-timeout", type=float, default=300,
                   help="seconds to wait for the server to start (default 300)")
    p.add_argument("--swap-timeout", type=float, default=60,
                   help="seconds to wait for the server to serve a version (default 60)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM,
                                                                     signal.SIGHUP)}
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted; the server was stopped", file=sys.stderr, flush=True)
        return 130
    except DemoError as exc:
        print(f"demo failed: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
