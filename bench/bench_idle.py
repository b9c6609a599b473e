"""What following a store costs while nothing is published, and how fast a flip is noticed.

    python bench/bench_idle.py [--seconds 60] [--flips 20] [--serve-vllm] [--json OUT]

Idle CPU (percent of one core, from utime+stime in /proc/<pid>/stat of the process and its
children) over ``--seconds``, each against a baseline measured in the same run:

- ``Receiver.watch``: one process; its own CPU while it only waits (baseline window), then
  while a watcher follows the store (same length).
- ``Receiver.watch polling``: the same with polling forced (what NFS/FUSE mounts get), at the
  default interval (1 s).
- ``Receiver.wait``: the same, blocked in ``receiver.wait(...)``.
- ``dbsync watch``: the command; baseline: a process with the same imports, sleeping.
- ``BroadcastReceiver member`` (with ``--member``): a receiver in the sender's broadcast group
  (gloo, 127.0.0.1), inside ``receive()`` while nothing is pushed; baseline: the same process
  before it joins. Its latency is from the start of ``BroadcastSender.push`` (a 4 KiB
  version) to the member's ``receive`` returning it.
- ``serve-vllm`` (with ``--serve-vllm``): the server with a tiny model (CPU engine) after it
  applied the store's version; baseline: vLLM's own OpenAI server of the same model and
  arguments, without dbsync.

Flip latency: after the idle windows, ``--flips`` versions are pushed by this process; each
follower reports when it noticed (``time.time()``). The flip's moment is taken as the earlier
of ``push`` returning and the raw limit noticing it: a blocking read on a bare inotify
instance watching the same directory, in the same run (``over_raw`` is the difference to it).

Hazards: the CPU numbers are per process (other load on the machine does not count), the
latencies are not (a busy machine delays wake-ups). /proc accounting ticks are 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout: python bench/bench_idle.py
    sys.path.insert(0, str(REPO))
TICK = os.sysconf("SC_CLK_TCK")


# ---- children ----------------------------------------------------------------------------------
def child_receiver(root: str, mode: str) -> None:
    """``ready`` -> (baseline window: blocked on stdin) -> ``go`` -> follow the store, print
    ``noticed V T`` per version; ``quit`` on stdin ends it."""
    import dbsync

    receiver = dbsync.Receiver(root, reader_id=f"bench-{mode}")
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    if mode in ("watch", "poll"):
        watcher = receiver.watch(lambda v: print(f"noticed {v} {time.time()!r}", flush=True),
                                 use_polling=mode == "poll")
        sys.stdin.readline()
        watcher.stop()
        reads, parses = getattr(watcher, "reads", -1), getattr(watcher, "parses", -1)
        print(f"reads {reads} parses {parses}", flush=True)  # -1: not counted
    else:
        threading.Thread(target=lambda: (sys.stdin.readline(), os._exit(0)),
                         daemon=True).start()
        current = receiver.latest_version()
        print(f"noticed {current} {time.time()!r}", flush=True)
        while True:
            got = receiver.wait(newer_than=current, timeout=3600)
            if got is not None:
                print(f"noticed {got} {time.time()!r}", flush=True)
                current = got


def child_raw(root: str) -> None:
    """The latency limit: a blocking read on a bare inotify instance (IN_MOVED_TO only)."""
    import ctypes
    import ctypes.util

    from dbsync.format import MANIFEST_FILE

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, os.fsencode(root), 0x80) < 0:  # IN_MOVED_TO
        raise OSError(ctypes.get_errno(), "inotify")

    def read_forever() -> None:
        while True:
            data = os.read(fd, 4096)
            at = time.time()
            offset = 0
            while offset + 16 <= len(data):
                length = int.from_bytes(data[offset + 12: offset + 16], sys.byteorder)
                name = data[offset + 16: offset + 16 + length].rstrip(b"\0")
                offset += 16 + length
                if name == MANIFEST_FILE.encode():
                    print(f"noticed ? {at!r}", flush=True)

    threading.Thread(target=read_forever, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()


def child_member(root: str) -> None:
    """``ready`` -> (baseline window: blocked on stdin) -> ``go`` -> ``receive`` versions in a
    loop (the first from the filesystem, then as a member of the broadcast group), printing
    ``noticed V T`` for each; ``quit`` on stdin ends it."""
    from dbsync.nccl import BroadcastReceiver

    receiver = BroadcastReceiver(root, reader_id="bench-member", device="cpu",
                                 address="127.0.0.1", timeout=30.0)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    threading.Thread(target=lambda: (sys.stdin.readline(), os._exit(0)), daemon=True).start()
    while True:
        version = receiver.receive(lambda pairs: [t.clone() for _, t in pairs], timeout=3600)
        if version is not None:
            print(f"noticed {version} {time.time()!r} {receiver.last_source}", flush=True)


def member_idle(root: str, seconds: float, pushes: int, gap: float) -> dict[str, Any]:
    """The ``BroadcastReceiver member`` row (see the module docstring)."""
    import torch

    import dbsync
    from dbsync.nccl import BroadcastSender

    sender = dbsync.Sender(root, durable=False)
    bs = BroadcastSender(sender, address="127.0.0.1", device="cpu", timeout=30.0)
    member = Child("BroadcastReceiver member", [*this_file(), "--child", "member", root])
    try:
        weights = {"w": torch.zeros(1024)}
        bs.push(weights)
        member.expect("ready")
        print(f"member baseline window ({seconds:g} s) ...", flush=True)
        base = window([member], seconds)
        member.send("go")
        member.expect("noticed")  # the first version, from the filesystem
        if not bs.wait_for_joins(1, 60):
            raise RuntimeError("the member did not ask to join")
        bs.push(weights)
        line, _ = member.expect("noticed")
        if not line.endswith("broadcast"):
            raise RuntimeError(f"the member did not take the broadcast: {line}")
        print(f"member idle window ({seconds:g} s) ...", flush=True)
        idle = window([member], seconds)
        took = []
        for _ in range(pushes):
            t = time.time()
            version = bs.push(weights)
            line, _ = member.expect("noticed")
            _, noticed, when = line.split()[:3]
            if int(noticed) != version:
                raise RuntimeError(f"the member applied {noticed}, not {version}")
            took.append(1000 * (float(when) - t))
            threading.Event().wait(gap)
    finally:
        member.stop()
        bs.close()
        sender.close()
    return {"cpu_percent": round(idle[member.name], 3),
            "baseline_percent": round(base[member.name], 3),
            "above_baseline_percent": round(idle[member.name] - base[member.name], 3),
            "pushes": pushes, "push_to_applied_median_ms": round(statistics.median(took), 2),
            "push_to_applied_max_ms": round(max(took), 2)}


def child_sleep() -> None:
    """The CLI's baseline: the same imports, then nothing."""
    import cli.main  # noqa: F401
    import dbsync.watch  # noqa: F401

    print("ready", flush=True)
    sys.stdin.readline()


# ---- measuring ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and of every live descendant (vLLM starts engine processes)."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, ValueError):
            pass
    return total


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Child:
    """A child process whose stdout lines are read (and time-stamped on arrival) by a thread."""

    def __init__(self, name: str, argv: list[str], **kw: Any):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(kw.pop("env", {}))
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=REPO, **kw)
        self.lines: queue.Queue[tuple[str, float]] = queue.Queue()
        self.noticed: dict[int, float] = {}
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((line.strip(), time.time()))

    def expect(self, prefix: str, timeout: float = 300) -> tuple[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            line, at = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            if line.startswith(prefix):
                return line, at
            self._note(line, at)

    def _note(self, line: str, at: float) -> None:
        if line.startswith("{"):  # dbsync watch --json
            self.noticed[json.loads(line)["version"]] = at
        elif line.startswith("noticed "):
            _, version, when = line.split()[:3]
            if version != "?":
                self.noticed[int(version)] = float(when)
            else:
                self.noticed[len(self.noticed) + 1_000_000] = float(when)

    def drain(self) -> None:
        while True:
            try:
                self._note(*self.lines.get_nowait())
            except queue.Empty:
                return

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass

    def stop(self) -> None:
        self.send("quit")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def window(children: list[Child], seconds: float) -> dict[str, float]:
    """CPU percent of one core of each child over the next ``seconds``."""
    start = {c.name: cpu_seconds(c.proc.pid) for c in children}
    t0 = time.monotonic()
    threading.Event().wait(seconds)
    took = time.monotonic() - t0
    return {c.name: 100.0 * (cpu_seconds(c.proc.pid) - start[c.name]) / took
            for c in children}


def this_file() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve())]


# ---- serve-vllm --------------------------------------------------------------------------------
def serve_vllm_idle(work: Path, seconds: float) -> dict[str, Any]:
    """Idle CPU of ``dbsync serve-vllm`` (after applying a version) and of vLLM's own server."""
    import dbsync
    from dbsync import demo_trainer

    model = work / "model"
    _tiny_model(model, demo_trainer)
    store = work / "vllm-store"
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    with dbsync.Sender(store, durable=False) as sender:
        sender.push({k: v.clone() for k, v in weights.items()})
    vllm_args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
                 "--max-num-seqs", "2", "--kv-cache-memory-bytes", str(64 * 2**20),
                 "--seed", "0"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    out: dict[str, Any] = {}
    commands = {
        "vllm_plain": [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(model), "--host", "127.0.0.1", "--port", "{port}",
                       *vllm_args],
        "serve_vllm": [sys.executable, "-m", "cli.main", "serve-vllm", str(store),
                       "--model", str(model), "--host", "127.0.0.1", "--port", "{port}",
                       "--", *vllm_args],
    }
    for name, argv in commands.items():
        port = _free_port()
        argv = [a.replace("{port}", str(port)) for a in argv]
        log_path = work / f"{name}.log"
        with open(log_path, "wb") as log:
            envs = dict(os.environ, PYTHONPATH=str(REPO), **env)
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=envs,
                                    cwd=REPO, start_new_session=True)
            try:
                started = time.monotonic()
                try:
                    _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, timeout=600)
                except RuntimeError as exc:
                    raise RuntimeError(f"{name}: {exc}; see {log_path}") from None
                ready = time.monotonic() - started
                threading.Event().wait(5)  # let start-up work settle
                t0, c0 = time.monotonic(), cpu_seconds(proc.pid)
                threading.Event().wait(seconds)
                pct = 100.0 * (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
                out[name] = {"cpu_percent": round(pct, 3), "start_s": round(ready, 1),
                             "processes": 1 + len(descendants(proc.pid))}
                if name == "serve_vllm":
                    status = _http_json(f"http://127.0.0.1:{port}/dbsync/status")
                    out[name]["served_version"] = status.get("version")
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        print(f"  {name}: {out[name]}", flush=True)
    out["above_baseline_percent"] = round(
        out["serve_vllm"]["cpu_percent"] - out["vllm_plain"]["cpu_percent"], 3)
    return out


def _tiny_model(model_dir: Path, demo_trainer: Any) -> None:
    """The demo's tiny Qwen2 and tokenizer, with the vocabulary rounded up to 512 rows (vLLM
    pads a vocabulary to a multiple of 64; an unpadded one currently crashes the worker's
    apply, which is not what this bench measures)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_dir.mkdir(parents=True, exist_ok=True)
    demo_trainer.build_tokenizer(model_dir)
    config = Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            _http_json(url)
            return
        except OSError:
            threading.Event().wait(0.5)
    raise RuntimeError(f"{url} not ready in {timeout} s")


# ---- main --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import dbsync

    work = Path(tempfile.mkdtemp(prefix="dbsync-idle-", dir=args.dir))
    root = str(work / "store")
    sender = dbsync.Sender(root, durable=False)
    sender.push({"w": torch.zeros(1024)})
    try:
        rx_watch = Child("Receiver.watch", [*this_file(), "--child", "watch", root])
        rx_wait = Child("Receiver.wait", [*this_file(), "--child", "wait", root])
        rx_poll = Child("Receiver.watch polling", [*this_file(), "--child", "poll", root])
        control = Child("sleeping CLI imports", [*this_file(), "--child", "sleep"])
        raw = Child("raw inotify", [*this_file(), "--child", "raw", root])
        for c in (rx_watch, rx_wait, rx_poll, control, raw):
            c.expect("ready")
        print(f"baseline window ({args.seconds:g} s) ...", flush=True)
        base = window([rx_watch, rx_wait, rx_poll], args.seconds)
        cli_watch = Child("dbsync watch", [sys.executable, "-m", "cli.main", "watch", root,
                                           "--json"])
        cli_watch.expect("{")
        for c in (rx_watch, rx_wait, rx_poll):
            c.send("go")
            c.expect("noticed")
        print(f"idle window ({args.seconds:g} s) ...", flush=True)
        idle = window([rx_watch, rx_wait, rx_poll, cli_watch, control, raw], args.seconds)

        pushed: dict[int, float] = {}
        for _ in range(args.flips):
            version = sender.push({"w": torch.zeros(1024)})
            pushed[version] = time.time()
            threading.Event().wait(args.flip_gap)
        threading.Event().wait(1.0)
        rx_watch.send("quit")
        reads_line, _ = rx_watch.expect("reads")
        rx_poll.send("quit")
        poll_line, _ = rx_poll.expect("reads")
        for c in (rx_watch, rx_wait, rx_poll, cli_watch, raw):
            c.drain()
        cli_watch.proc.send_signal(signal.SIGINT)
        for c in (rx_wait, rx_poll, cli_watch, control, raw, rx_watch):
            c.stop()
    finally:
        sender.close()

    raw_times = sorted(raw.noticed.values())
    half = args.flip_gap / 2
    raw_at = {v: next((x for x in raw_times if t - half <= x < t + half), None)
              for v, t in pushed.items()}

    def latencies(child: Child) -> dict[str, Any]:
        """ms from the flip (the earlier of ``push`` returning and the raw observer's event)
        to this child noticing it, and the same minus the raw observer's own latency."""
        noticed = raw_at if child is raw else child.noticed
        flip = {v: min(t, raw_at[v] if raw_at[v] is not None else t)
                for v, t in pushed.items()}
        ms = [1000 * (noticed[v] - flip[v]) for v in pushed if noticed.get(v) is not None]
        over = [1000 * (noticed[v] - raw_at[v]) for v in pushed
                if noticed.get(v) is not None and raw_at[v] is not None]
        out: dict[str, Any] = {"noticed": f"{len(ms)}/{len(pushed)}",
                               "latency_median_ms": round(statistics.median(ms), 2) if ms
                               else None,
                               "latency_max_ms": round(max(ms), 2) if ms else None}
        if child is not raw and over:
            out["over_raw_median_ms"] = round(statistics.median(over), 2)
        return out

    _, reads, _, parses = reads_line.split()
    results: dict[str, Any] = {
        "Receiver.watch": {"cpu_percent": round(idle[rx_watch.name], 3),
                           "baseline_percent": round(base[rx_watch.name], 3),
                           "manifest_reads": int(reads), "manifest_parses": int(parses),
                           **latencies(rx_watch)},
        "Receiver.watch polling": {"cpu_percent": round(idle[rx_poll.name], 3),
                                   "baseline_percent": round(base[rx_poll.name], 3),
                                   "manifest_reads": int(poll_line.split()[1]),
                                   "manifest_parses": int(poll_line.split()[3]),
                                   **latencies(rx_poll)},
        "Receiver.wait": {"cpu_percent": round(idle[rx_wait.name], 3),
                          "baseline_percent": round(base[rx_wait.name], 3),
                          **latencies(rx_wait)},
        "dbsync watch": {"cpu_percent": round(idle[cli_watch.name], 3),
                         "baseline_percent": round(idle[control.name], 3),
                         **latencies(cli_watch)},
        "raw inotify read": {"cpu_percent": round(idle[raw.name], 3), **latencies(raw)},
    }
    for name in ("Receiver.watch", "Receiver.watch polling", "Receiver.wait", "dbsync watch"):
        r = results[name]
        r["above_baseline_percent"] = round(r["cpu_percent"] - r["baseline_percent"], 3)
    if args.serve_vllm:
        print(f"serve-vllm vs vLLM's own server ({args.seconds:g} s each) ...", flush=True)
        try:
            results["serve-vllm"] = serve_vllm_idle(work, args.seconds)
        except RuntimeError as exc:  # recorded, and the other numbers still written
            results["serve-vllm"] = {"error": str(exc)}
            return results  # keep ``work``: the server's log is in it
    shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind = sys.argv[2]
        if kind in ("watch", "poll", "wait"):
            child_receiver(sys.argv[3], kind)
        elif kind == "raw":
            child_raw(sys.argv[3])
        elif kind == "member":
            child_member(sys.argv[3])
        else:
            child_sleep()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of each CPU window")
    p.add_argument("--flips", type=int, default=20)
    p.add_argument("--flip-gap", type=float, default=1.1,
                   help="seconds between flips (above the 1 s poll interval)")
    p.add_argument("--serve-vllm", action="store_true", help="also measure serve-vllm")
    p.add_argument("--member", action="store_true",
                   help="also measure a broadcast group member (gloo)")
    p.add_argument("--only-member", action="store_true",
                   help="measure the broadcast group member alone")
    p.add_argument("--dir", default=None, help="where the store lives (default: tmp)")
    p.add_argument("--json", default=str(REPO / "bench/results/idle_cpu2.json"))
    args = p.parse_args()
    machine = (f"{socket.gethostname()}: {os.cpu_count()} cores, {platform.machine()}, "
               f"{platform.platform()}")
    print(f"machine: {machine}", flush=True)
    results = {} if args.only_member else run(args)
    if args.member or args.only_member:
        work = Path(tempfile.mkdtemp(prefix="dbsync-idle-member-", dir=args.dir))
        try:
            results["BroadcastReceiver member"] = member_idle(
                str(work / "store"), args.seconds, args.flips, min(args.flip_gap, 0.2))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for name, r in results.items():
        print(f"{name:24s} {r}")
    record = {"machine": machine, "seconds": args.seconds, "flips": args.flips,
              "results": results}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
