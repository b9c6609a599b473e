"""Fan-out benchmark: one BroadcastSender on GPU 0, N-1 BroadcastReceivers on GPUs 1..N-1,
against a raw bucketed ``torch.distributed.broadcast`` of the same bytes in a world of the same
N processes, measured in the same run.

    python bench/bench_broadcast_fanout.py [--gpus N] [--gb 4 12] [--tensors 300]
        [--bucket-mib 256] [--iters 5] [--code DIR] [--sender-kwargs JSON]
        [--receiver-kwargs JSON] [--faults] [--phases] [--set MODULE.ATTR=JSON]
        [--label NAME] [--out results.json]

Each receiver takes every tensor into its own preallocated parameters and synchronizes: by
default through ``receive(params)`` (dbsync copies, verified bucket by bucket, on a few SMs);
``--receiver-load copy`` through a load_weights that copies each tensor handed out;
``keep`` / ``windows``: staged as vLLM workers stage, the whole version or only a
tensor-parallel rank's rows of each tensor (``--window-parts N``), with each receiver's peak
and held GPU memory per take. Every
version differs from the one before (a few elements change), and after
every take each receiver's parameters are compared with the sender's weights by exact int64
fingerprints (bit-exact, no hash). Sender side: ``broadcast_seconds`` of the push (poll joins,
header, handshake, bucket stream, last bucket done). Receiver side: header seen -> last tensor
copied and synchronized. Raw: every rank enqueues the same number of same-size bucket
broadcasts from two preallocated buffers (no packing, no handshake, no checksums), timed from a
barrier to the last rank's synchronize.

Windows compared: raw is timed per rank from a barrier to its last synchronize (the slowest
rank counts); the sender's window opens before it polls joins, so it includes telling the
receivers (the header), which raw gets from its barrier, and closes when its own last bucket
is done (~0.1 ms before a receiver's last byte); the receiver's opens when it sees the
header. ``--phases`` records where a push's time goes on every rank (see ``Phases``;
``phases_us`` in the JSON: medians in microseconds from the sender's window opening).

``--code DIR`` imports ``dbsync`` from DIR (a copy of an older revision, for before/after runs
on the same machine). ``--faults`` (current code) then measures, with small versions: a receiver
that stalls (is not receiving) during a push, and one killed in the middle of a push: what the
push costs the sender and the others, and that the survivors take the next version over the
broadcast; and a byte flipped on arrival at one receiver (before verification): that receiver
takes the version from the filesystem, exact, the others from the broadcast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_shapes(gb: float, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """Per layer: qkv [3h, h], o [h, h], up [4h, h], down [h, 4h], two norms [h]; bf16."""
    layers = max(1, tensors // 6)
    h = int(math.sqrt(gb * 1e9 / (layers * 2 * 12)))
    h = max(128, h // 128 * 128)
    shapes = []
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)),
                   (p + "self_attn.qkv_proj.weight", (3 * h, h)),
                   (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.up_proj.weight", (4 * h, h)),
                   (p + "mlp.down_proj.weight", (h, 4 * h))]
    return shapes


def fingerprint(t: torch.Tensor) -> list[int]:
    """Exact int64 sums of the 16-bit words and of their squares (bit-level check, no hash)."""
    words = t.view(torch.int16).reshape(-1).to(torch.int64)
    return [int(words.sum()), int((words * words).sum())]


def fingerprints(tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {n: fingerprint(t) for n, t in tensors.items()}


def row_windows(shapes: list[tuple[str, tuple[int, ...]]], part: int, parts: int
                ) -> dict[str, tuple[int, int]]:
    """Byte windows of a tensor-parallel rank's rows (``part`` of ``parts``) of each tensor,
    as a column-parallel weight is sharded: one contiguous range per tensor (bf16)."""
    out = {}
    for name, shape in shapes:
        row_bytes = 2 * math.prod(shape[1:])
        out[name] = (shape[0] * part // parts * row_bytes,
                     shape[0] * (part + 1) // parts * row_bytes)
    return out


def window_fingerprints(tensors: dict[str, torch.Tensor], windows: dict[str, tuple[int, int]]
                        ) -> dict[str, list[int]]:
    return {n: fingerprint(t.reshape(-1).view(torch.uint8)[lo:hi])
            for n, t in tensors.items() for lo, hi in [windows[n]]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def profiled(args: argparse.Namespace, rank: int, on: bool) -> Iterator[None]:
    """With ``--profile DIR`` and ``on``: a CUDA kernel trace of the block, DIR/rank<r>.json."""
    if not (on and args.profile):
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    torch.cuda.synchronize()
    os.makedirs(args.profile, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.profile, f"rank{rank}.json"))


class Phases:
    """``--phases``: where the time of one push (sender) or take (receiver) goes. Host time
    stamps (``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process of the host)
    from hooks around ``dbsync.nccl``'s methods; device times from CUDA events, placed on the
    host clock through a reference event recorded on the idle stream (within microseconds);
    each broadcast's NCCL kernel time (``TORCH_NCCL_ENABLE_TIMING=1``). The hooks cost a few
    microseconds per bucket; ratios of runs without ``--phases`` are the ones to report."""

    def __init__(self) -> None:
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.marks: dict[str, list[float]] = {}
        self.events: list[tuple[str, Any]] = []
        self.works: list[Any] = []
        self.ref: tuple[float, Any] | None = None

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, []).append(time.perf_counter())

    def reference(self) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.ref = (time.perf_counter(), ev)

    def event(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.events.append((name, ev))

    def resolve(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        out: dict[str, Any] = {k: list(v) for k, v in self.marks.items()}
        if self.ref is not None:
            t_ref, ref = self.ref
            for name, ev in self.events:
                out.setdefault("dev_" + name, []).append(t_ref + ref.elapsed_time(ev) / 1e3)
        durations = []
        for work in self.works:
            try:
                durations.append(float(work._get_duration()) / 1e3)
            except Exception:  # noqa: BLE001 - timing off or unsupported
                durations.append(None)
        out["nccl_seconds"] = durations
        self.reset()
        return out


def install_phase_hooks(ph: Phases, rank: int) -> None:
    """Wrap the methods of ``dbsync.nccl`` (whichever copy ``--code`` imported) that mark the
    phases of a push and of a take; their behaviour is unchanged."""
    from dbsync.nccl import group, member, membership, outgoing, paced, sender, stream

    def wrap(cls: Any, name: str, before: Any = None, after: Any = None) -> None:
        orig = getattr(cls, name)

        def hooked(*a: Any, **k: Any) -> Any:
            if ph.active and before is not None:
                before()
            out = orig(*a, **k)
            if ph.active and after is not None:
                after(out)
            return out

        setattr(cls, name, hooked)

    def bcast_in() -> None:
        ph.mark("bcast_call")
        if rank == 0:
            ph.event("pack_done")  # the stream position the broadcast waits for

    def bcast_out(work: Any) -> None:
        ph.mark("bcast_ret")
        ph.works.append(work)

    wrap(group.Group, "broadcast", bcast_in, bcast_out)
    wrap(group.Group, "wait", None, lambda _: ph.mark("landed"))
    if rank == 0:
        wrap(membership.Membership, "refresh", lambda: ph.mark("t0"),
             lambda _: ph.mark("refreshed"))
        if hasattr(membership.Membership, "announce"):  # (header and doorbells set)
            wrap(membership.Membership, "announce", None, lambda _: ph.mark("announced"))
            wrap(outgoing.OutgoingStream, "send", lambda: ph.mark("send_in"),
                 lambda _: ph.mark("sent"))
        else:  # an older code: announced right before the stream starts
            wrap(outgoing.OutgoingStream, "send", lambda: ph.mark("announced"),
                 lambda _: ph.mark("sent"))
        wrap(sender.BroadcastSender, "_header", lambda: ph.mark("header_in"),
             lambda _: ph.mark("header_built"))
        wrap(outgoing.OutgoingStream, "_fused_bucket", lambda: ph.mark("plan_in"),
             lambda _: ph.mark("plan_out"))
        wrap(paced.PackSeal, "run", lambda: ph.mark("packrun_in"),
             lambda _: ph.mark("packrun_out"))
    else:
        # Before the header is seen (kept across the reset below): the doorbell's thread back
        # from the store's wait, the waiting thread woken, maintain's reads, the header read.
        early: dict[str, float] = {}

        def stamp(name: str) -> Any:
            return lambda *_: early.__setitem__(name, time.perf_counter())

        def seen(header: Any) -> None:
            if header is not None:
                ph.reset()
                for name, at in early.items():
                    ph.marks[name] = [at]
                ph.mark("header_seen")
                ph.reference()
            early.clear()

        from dbsync.nccl import keywatch

        def watched(self: Any, connect: Any, *a: Any, **k: Any) -> None:
            def connect_stamped() -> Any:
                client = connect()

                class Stamped:
                    def wait(self, *args: Any) -> Any:
                        out = client.wait(*args)
                        stamp("bell_back")()
                        return out

                    def __getattr__(self, name: str) -> Any:
                        return getattr(client, name)

                return Stamped()

            init(self, connect_stamped, *a, **k)

        init = keywatch.KeyWatch.__init__
        keywatch.KeyWatch.__init__ = watched  # type: ignore[method-assign]
        wrap(member.MemberLink, "wait_for_push", None, stamp("woke"))
        wrap(member.MemberLink, "maintain", stamp("maintain_in"), stamp("maintain_out"))
        wrap(member.MemberLink, "poll_push", stamp("poll_in"), seen)
        wrap(stream.IncomingVersion, "start", lambda: ph.mark("start_in"),
             lambda _: ph.mark("posted"))
        wrap(paced.VerifyCopy, "run", lambda: ph.mark("pass_call"),
             lambda _: ph.event("pass_done"))
        wrap(stream.IncomingVersion, "copy_into", None, lambda _: ph.mark("copied"))


PHASES = Phases()


def raw_bucketed(total: int, bucket: int, iters: int) -> list[float]:
    import torch.distributed as dist

    bufs = [torch.empty(bucket, dtype=torch.uint8, device="cuda") for _ in range(2)]
    if dist.get_rank() == 0:
        for b in bufs:
            b.random_(0, 256)
    sizes = [min(bucket, total - lo) for lo in range(0, total, bucket)]
    times = []
    for i in range(iters + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k, n in enumerate(sizes):
            dist.broadcast(bufs[k % 2][:n], 0)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    del bufs
    return times


def worker(rank: int, world: int, args: argparse.Namespace, root: str, port: int,
           commands: Any, results: Any) -> None:
    """One process per GPU, driven by JSON commands (rank 0: sender, others: receivers)."""
    sys.path.insert(0, os.path.abspath(args.code))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.phases:
        os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    import torch.distributed as dist

    import dbsync

    for knob in args.set:  # MODULE.ATTR=JSON, e.g. dbsync.nccl.paced.PACK_SHARE=1.0
        target, _, value = knob.partition("=")
        module, _, attr = target.rpartition(".")
        __import__(module)
        setattr(sys.modules[module], attr, json.loads(value))
    if args.phases:
        install_phase_hooks(PHASES, rank)
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=torch.device("cuda", rank))
        dist.barrier()
        if rank == 0:
            _sender(args, root, commands, results, dbsync)
        else:
            _receiver(rank, args, root, commands, results)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        results.put(json.dumps({"rank": rank, "exception": repr(exc),
                                "traceback": traceback.format_exc()}))


def _sender(args: argparse.Namespace, root: str, commands: Any, results: Any,
            dbsync: Any) -> None:
    from dbsync.nccl import BroadcastSender

    sender = dbsync.Sender(root, durable=False)
    kwargs = dict(address="127.0.0.1", device="cuda:0", timeout=args.timeout,
                  join_timeout=120.0, bucket_bytes=args.bucket_mib * 2**20)
    kwargs.update(json.loads(args.sender_kwargs))
    t0 = time.perf_counter()
    bs = BroadcastSender(sender, **kwargs)
    construct = time.perf_counter() - t0
    weights: dict[str, torch.Tensor] = {}
    results.put(json.dumps({"rank": 0, "ready": True, "construct_seconds": construct,
                            "fused_packing": getattr(bs.outgoing, "fused", None)}))
    while True:
        cmd = json.loads(commands.get())
        op = cmd["op"]
        if op == "exit":
            bs.close()
            sender.close()
            return
        if op == "weights":
            weights.clear()
            torch.cuda.empty_cache()
            gen = torch.Generator(device="cuda:0").manual_seed(cmd["seed"])
            for n, s in model_shapes(cmd["gb"], args.tensors):
                weights[n] = torch.randn(s, generator=gen, device="cuda:0").to(torch.bfloat16)
            torch.cuda.synchronize()
            results.put(json.dumps({"rank": 0, "bytes": sum(t.nbytes for t in weights.values()),
                                    "tensors": len(weights)}))
        elif op == "join":
            t = time.perf_counter()
            ok = bs.wait_for_joins(cmd["count"], 300)
            setup = bs.prepare()
            results.put(json.dumps({"rank": 0, "joined": ok, "setup_seconds": setup,
                                    "wait_seconds": time.perf_counter() - t}))
        elif op == "push":
            names = list(weights)
            changed = weights[names[cmd["version_hint"] % len(names)]].view(-1)
            changed[:4096] += 1  # every version differs from the last
            torch.cuda.synchronize()
            with profiled(args, 0, cmd.get("profile", False)):
                PHASES.reset()
                PHASES.reference()
                PHASES.active = args.phases
                t = time.perf_counter()
                version = bs.push(weights)
                wall = time.perf_counter() - t
                PHASES.active = False
            stats = dict(bs.last_push_stats)
            if args.phases:
                stats["phases"] = PHASES.resolve()
            if args.receiver_load == "windows":  # what each receiver keeps of it
                shapes = [(n, tuple(t.shape)) for n, t in weights.items()]
                prints: Any = {str(r): window_fingerprints(weights, row_windows(
                    shapes, (r - 1) % args.window_parts, args.window_parts))
                    for r in range(1, cmd["world"])}
            else:
                prints = fingerprints(weights)
            results.put(json.dumps({"rank": 0, "version": version, "push_wall_seconds": wall,
                                    "stats": stats, "fingerprints": prints}, default=str))
        elif op == "raw":
            times = raw_bucketed(cmd["bytes"], args.bucket_mib * 2**20, args.iters)
            results.put(json.dumps({"rank": 0, "raw": times}))


def _receiver(rank: int, args: argparse.Namespace, root: str, commands: Any,
              results: Any) -> None:
    from dbsync.nccl import BroadcastReceiver

    device = f"cuda:{rank}"
    kwargs = dict(device=device, timeout=args.timeout, address="127.0.0.1",
                  fallback_timeout=300.0, reader_id=f"gpu{rank}")
    kwargs.update(json.loads(args.receiver_kwargs))
    rx = BroadcastReceiver(root, **kwargs)
    params: dict[str, torch.Tensor] = {}

    from dbsync.nccl import paced

    paced.DEFAULT_PROGRAMS = args.paced_programs or paced.DEFAULT_PROGRAMS
    paced._ROWS_PER_STEP = args.paced_step or paced._ROWS_PER_STEP
    paced._WARPS = args.paced_warps or paced._WARPS

    def flip_one_byte(bucket: int, payload: Any) -> None:
        if bucket == 1:
            payload[payload.numel() // 2] ^= 0x10

    def load_weights(pairs: Any) -> None:
        if args.receiver_load == "iterate":  # diagnosis: take the stream, copy nothing
            for _name, _t in pairs:
                pass
        elif args.receiver_load == "keep":  # as vLLM staging: keep what whole_version hands out
            for name, t in pairs:
                params[name] = t
        else:
            for name, t in pairs:
                params[name].copy_(t)
        torch.cuda.synchronize()

    shapes: list[tuple[str, tuple[int, ...]]] = []
    staged: dict[str, Any] = {}

    def keep_windows(incoming: Any) -> None:
        """As vLLM staging keeps a tensor-parallel rank's reads once it knows them: one
        allocation of this receiver's windows, filled by the verified copy-out of each bucket
        and, once the version was applied, reused (with its copy plans) by the next one."""
        from dbsync.nccl.stream import ByteWindow

        if staged.get("shapes") != shapes:
            windows = row_windows(shapes, (rank - 1) % args.window_parts, args.window_parts)
            flat = torch.empty(sum(hi - lo for lo, hi in windows.values()), dtype=torch.uint8,
                               device=device)
            dest, at = {}, 0
            for name, (lo, hi) in windows.items():
                dest[name] = ByteWindow(lo, hi, flat[at:at + hi - lo])
                at += hi - lo
            staged.update(shapes=list(shapes), dest=dest, plans={})
        incoming.copy_into(staged["dest"], staged["plans"])
        torch.cuda.synchronize()
        params.update({n: w.into for n, w in staged["dest"].items()})

    def dying(pairs: Any) -> None:
        for _name, _t in pairs:
            os.kill(os.getpid(), signal.SIGKILL)

    results.put(json.dumps({"rank": rank, "ready": True}))
    while True:
        cmd = json.loads(commands.get())
        op = cmd["op"]
        if op == "exit":
            rx.close()
            return
        if op == "alloc":
            params.clear()
            staged.clear()
            torch.cuda.empty_cache()
            shapes[:] = model_shapes(cmd["gb"], args.tensors)
            if args.receiver_load not in ("keep", "windows"):  # those stage their own
                params.update({n: torch.zeros(s, dtype=torch.bfloat16, device=device)
                               for n, s in shapes})
            results.put(json.dumps({"rank": rank, "allocated": True}))
        elif op == "receive":
            if cmd.get("stall"):
                time.sleep(cmd["stall"])  # not receiving while the sender pushes
            rx.before_verify = flip_one_byte if cmd.get("flip") else None
            target = (dying if cmd.get("die") else
                      params if args.receiver_load == "into" else
                      keep_windows if args.receiver_load == "windows" else load_weights)
            if args.receiver_load in ("keep", "windows"):
                params.clear()  # the last staged version was applied (windows: reused)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with profiled(args, rank, cmd.get("profile", False)):
                PHASES.reset()
                PHASES.active = args.phases
                t = time.perf_counter()
                version = rx.receive(target, timeout=600)
                wall = time.perf_counter() - t
                if target is params:
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t
                PHASES.mark("synced")
                PHASES.active = False
            phases = PHASES.resolve() if args.phases else None
            held = sum(t.numel() * t.element_size() for t in params.values())
            results.put(json.dumps({
                "rank": rank, "version": version, "source": rx.last_source,
                "error": rx.last_error, "stats": dict(rx.last_stats, phases=phases),
                "wall_seconds": wall,
                "peak_bytes": torch.cuda.max_memory_allocated(device) - base,
                "held_bytes": held, "allocated_bytes": torch.cuda.memory_allocated(device),
                "fingerprints": fingerprints(params)}, default=str))
        elif op == "raw":
            times = raw_bucketed(cmd["bytes"], args.bucket_mib * 2**20, args.iters)
            results.put(json.dumps({"rank": rank, "raw": times}))


class Driver:
    def __init__(self, args: argparse.Namespace, world: int):
        ctx = mp.get_context("spawn")
        self.root = tempfile.mkdtemp(prefix="dbsync-fanout-", dir="/dev/shm")
        port = free_port()
        self.world = world
        self.cmds = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.procs = [ctx.Process(target=worker, args=(r, world, args, self.root, port,
                                                       self.cmds[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.ready = self.collect(range(world), 300)

    def send(self, ranks: Any, **cmd: Any) -> None:
        for r in ranks:
            self.cmds[r].put(json.dumps(cmd))

    def collect(self, ranks: Any, timeout: float) -> dict[int, dict[str, Any]]:
        """One answer from each of ``ranks``; answers of other ranks are kept for later."""
        want = set(ranks)
        got: dict[int, dict[str, Any]] = {}
        for r in want:
            if self.pending.get(r):
                got[r] = self.pending[r].pop(0)
        deadline = time.monotonic() + timeout
        while want - set(got):
            try:
                out = json.loads(self.results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise TimeoutError(f"no answer from ranks {sorted(want - set(got))}") from None
            if "exception" in out:
                raise RuntimeError(f"rank {out['rank']}: {out['traceback']}")
            r = out["rank"]
            if r in want and r not in got:
                got[r] = out
            else:
                self.pending.setdefault(r, []).append(out)
        return got

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.is_alive():
                self.cmds[r].put(json.dumps({"op": "exit"}))
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def measure_size(d: Driver, args: argparse.Namespace, gb: float, seed: int) -> dict[str, Any]:
    world = d.world
    receivers = range(1, world)
    d.send([0], op="weights", gb=gb, seed=seed)
    d.send(receivers, op="alloc", gb=gb)
    got = d.collect(range(world), 600)
    nbytes, ntensors = got[0]["bytes"], got[0]["tensors"]
    takes: list[dict[int, dict[str, Any]]] = []
    pushes: list[dict[str, Any]] = []
    exact = True
    setup = None
    for i in range(args.iters + 1):
        last = i == args.iters
        d.send(receivers, op="receive", profile=last)
        if i == 0:
            d.send([0], op="join", count=world - 1)
            setup = d.collect([0], 600)[0]
        d.send([0], op="push", version_hint=i, profile=last, world=world)
        push = d.collect([0], 600)[0]
        take = d.collect(receivers, 600)
        for r in receivers:
            if args.receiver_load == "windows":
                exact &= take[r]["fingerprints"] == push["fingerprints"][str(r)]
            elif args.receiver_load != "iterate":
                exact &= take[r]["fingerprints"] == push["fingerprints"]
            take[r].pop("fingerprints")
        push.pop("fingerprints")
        pushes.append(push)
        takes.append(take)
    d.send(range(world), op="raw", bytes=nbytes)
    raw = d.collect(range(world), 600)
    raw_times = [max(raw[r]["raw"][i] for r in range(world)) for i in range(args.iters)]
    timed = range(1, args.iters + 1)
    send_s = [pushes[i]["stats"]["broadcast_seconds"] for i in timed]
    recv_s = {r: [takes[i][r]["stats"]["seconds"] for i in timed] for r in receivers}
    sources = sorted({takes[i][r]["source"] for i in range(args.iters + 1) for r in receivers})

    def gbps(seconds: list[float]) -> float:
        return nbytes / statistics.median(seconds) / 1e9

    raw_gbps = gbps(raw_times)
    slowest = min(gbps(v) for v in recv_s.values())
    return {
        "gb_requested": gb, "bytes": nbytes, "tensors": ntensors, "receivers": world - 1,
        "bit_exact_every_version": exact, "sources": sources,
        "sender_GBps": gbps(send_s), "slowest_receiver_GBps": slowest,
        "receivers_GBps": {str(r): gbps(v) for r, v in recv_s.items()},
        "raw_bucketed_GBps": raw_gbps,
        "ratio_sender": gbps(send_s) / raw_gbps, "ratio_slowest_receiver": slowest / raw_gbps,
        "setup": setup,
        "push_stats": [p["stats"] for p in pushes],
        "push_wall_seconds": [p["push_wall_seconds"] for p in pushes],
        "raw_seconds": raw_times,
        # on each receiver, during a take (the last version released first, as once applied):
        # peak bytes allocated above what it held before, and bytes it holds afterwards
        "receiver_peak_bytes": {str(r): max(takes[i][r]["peak_bytes"] for i in timed)
                                for r in receivers},
        "receiver_held_bytes": {str(r): takes[args.iters][r]["held_bytes"] for r in receivers},
        # everything the receiver process has allocated after the last take (with the bucket
        # buffers of the non-whole-version modes)
        "receiver_allocated_bytes": {str(r): takes[args.iters][r]["allocated_bytes"]
                                     for r in receivers},
        "receiver_seconds": {str(r): v for r, v in recv_s.items()},
        "errors": sorted({str(takes[i][r]["error"]) for i in range(args.iters + 1)
                          for r in receivers}),
        "phases_us": phase_summary(pushes, takes, timed, receivers) if args.phases else None,
    }


def phase_summary(pushes: list[dict[str, Any]], takes: list[dict[int, dict[str, Any]]],
                  timed: range, receivers: range) -> dict[str, Any]:
    """Medians over the timed pushes, in microseconds from the sender's ``t0`` (push's
    broadcast window opens), of the phases each side went through (see ``Phases``)."""

    def at(ph: dict[str, Any], name: str, k: int) -> float | None:
        v = ph.get(name) or []
        return v[k] if -len(v) <= k < len(v) else None

    rows: dict[str, list[float]] = {}

    def put(key: str, value: float | None, base: float = 0.0, scale: float = 1e6) -> None:
        if value is not None:
            rows.setdefault(key, []).append((value - base) * scale)

    for i in timed:
        s = pushes[i]["stats"].get("phases") or {}
        if not s.get("t0"):
            continue
        t0 = s["t0"][0]
        for name, k in (("refreshed", 0), ("header_in", 0), ("header_built", 0),
                        ("announced", 0), ("send_in", 0),
                        ("plan_in", 0), ("plan_out", 0),
                        ("packrun_in", 0), ("packrun_out", 0), ("bcast_call", 0),
                        ("bcast_ret", 0), ("dev_pack_done", 0), ("dev_pack_done", 1),
                        ("landed", 0), ("landed", -1), ("sent", 0)):
            put(f"S.{name}[{k}]", at(s, name, k), t0)
        nccl = [x for x in s.get("nccl_seconds", []) if x is not None]
        if len(nccl) > 2:
            put("S.nccl[0]", nccl[0], 0.0)
            put("S.nccl[mid]", statistics.median(nccl[1:-1]), 0.0)
            put("S.nccl[-1]", nccl[-1], 0.0)
        for r in receivers:
            ph = takes[i][r]["stats"].get("phases") or {}
            for name, k in (("bell_back", 0), ("woke", 0), ("maintain_in", 0),
                            ("maintain_out", 0), ("poll_in", 0),
                            ("header_seen", 0), ("start_in", 0), ("bcast_call", 0),
                            ("posted", 0), ("landed", 0), ("pass_call", 0),
                            ("dev_pass_done", 0), ("landed", -1), ("pass_call", -1),
                            ("dev_pass_done", -2), ("dev_pass_done", -1), ("copied", 0),
                            ("synced", 0)):
                put(f"R{r}.{name}[{k}]", at(ph, name, k), t0)
            nccl = [x for x in ph.get("nccl_seconds", []) if x is not None]
            if len(nccl) > 2:
                put(f"R{r}.nccl[0]", nccl[0], 0.0)
                put(f"R{r}.nccl[mid]", statistics.median(nccl[1:-1]), 0.0)
    return {k: round(statistics.median(v), 1) for k, v in rows.items()}


def measure_faults(d: Driver, args: argparse.Namespace) -> dict[str, Any]:
    """A stalled and then a killed receiver (the last rank), with 2 GB versions."""
    world = d.world
    receivers = list(range(1, world))
    victim, survivors = receivers[-1], receivers[:-1]
    gb = 2.0  # 8 buckets of 256 MiB: a death at the first tensor leaves buckets unsent
    d.send([0], op="weights", gb=gb, seed=99)
    d.send(receivers, op="alloc", gb=gb)
    d.collect(range(world), 600)
    out: dict[str, Any] = {"timeout": args.timeout, "victim_rank": victim}

    def push_to(ranks: list[int], hint: int
                ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        """Push; collect the sender's answer and ``ranks``' takes, each marked exact or not."""
        d.send([0], op="push", version_hint=hint)
        push = d.collect([0], 600)[0]
        takes = d.collect(ranks, 600)
        for r in ranks:
            takes[r]["exact"] = takes[r].pop("fingerprints") == push["fingerprints"]
        push.pop("fingerprints")
        return push, takes

    def one_push(hint: int, victim_cmd: dict[str, Any] | None, who: list[int]
                 ) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        d.send(survivors, op="receive")
        if victim_cmd is not None:
            d.send([victim], **victim_cmd)
        d.send([0], op="join", count=len(who))
        d.collect([0], 600)
        return push_to(survivors + ([victim] if victim_cmd is not None else []), hint)

    def summary(push: dict[str, Any], takes: dict[int, dict[str, Any]]) -> dict[str, Any]:
        return {"push_wall_seconds": push["push_wall_seconds"],
                "broadcast": push["stats"].get("broadcast"),
                "error": push["stats"].get("error"),
                "takes": {str(r): {k: t[k] for k in ("version", "source", "exact", "error")}
                          for r, t in takes.items()}}

    push, takes = one_push(1, {"op": "receive"}, receivers)
    out["warm"] = summary(push, takes)
    # stall: the victim enters receive only after timeout + 2 s
    push, takes = one_push(2, {"op": "receive", "stall": args.timeout + 2}, receivers)
    out["stall"] = summary(push, takes)
    push, takes = one_push(3, {"op": "receive"}, receivers)
    out["after_stall"] = summary(push, takes)
    # kill: the victim dies at its first tensor
    d.send(survivors, op="receive")
    d.send([victim], op="receive", die=True)
    push, takes = push_to(survivors, 4)
    d.procs[victim].join(30)
    out["kill"] = summary(push, takes)
    out["kill"]["victim_exitcode"] = d.procs[victim].exitcode
    d.send(survivors, op="receive")
    d.send([0], op="join", count=len(survivors))
    d.collect([0], 600)
    push, takes = push_to(survivors, 5)
    out["after_kill"] = summary(push, takes)
    # (the timeout, then the filesystem publish, about what a warm push takes, plus margin)
    bound = args.timeout + out["warm"]["push_wall_seconds"] + 1.0
    out["ok"] = (out["stall"]["push_wall_seconds"] < bound
                 and out["kill"]["push_wall_seconds"] < bound
                 and out["kill"]["victim_exitcode"] == -9
                 and all(t["source"] == "broadcast" and t["exact"]
                         for key in ("after_stall", "after_kill")
                         for t in out[key]["takes"].values())
                 and all(t["exact"] for key in ("stall", "kill")
                         for t in out[key]["takes"].values()))
    if not survivors:  # (one receiver: it was the victim; no one is left for the flip)
        return out
    # a byte flipped on arrival at the first survivor, before verification
    flipped = survivors[0]
    d.send([r for r in survivors if r != flipped], op="receive")
    d.send([flipped], op="receive", flip=True)
    push, takes = push_to(survivors, 6)
    out["flip"] = summary(push, takes)
    out["ok"] = (out["ok"]
                 and all(t["exact"] for t in out["flip"]["takes"].values())
                 and out["flip"]["takes"][str(flipped)]["source"] == "filesystem"
                 and "damaged" in str(out["flip"]["takes"][str(flipped)]["error"])
                 and all(t["source"] == "broadcast" for r, t in out["flip"]["takes"].items()
                         if r != str(flipped)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=0, help="default: every visible GPU")
    ap.add_argument("--gb", type=float, nargs="+", default=[4.0, 12.0])
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--code", default=REPO, help="directory to import dbsync from")
    ap.add_argument("--sender-kwargs", default="{}")
    ap.add_argument("--receiver-kwargs", default="{}")
    ap.add_argument("--window-parts", type=int, default=2,
                    help="windows: keep 1/N of each tensor's rows (receiver r: part (r-1) %% N)")
    ap.add_argument("--receiver-load", choices=("into", "copy", "keep", "iterate", "windows"),
                    default="into",
                    help="into: receive(params), dbsync copies into the receiver's own "
                         "parameters; copy: a load_weights that copies each tensor handed out "
                         "into them; keep: keep the tensors handed out (with receiver "
                         "whole_version, as vLLM staging does before it knows a worker's "
                         "reads); windows: keep only a tensor-parallel rank's rows of each "
                         "tensor (--window-parts), as vLLM staging does once it knows them; "
                         "iterate: copy nothing (diagnosis; not bit-checked)")
    ap.add_argument("--paced-programs", type=int, default=0,
                    help="CTAs of the receivers' paced kernels (default: dbsync's)")
    ap.add_argument("--paced-step", type=int, default=0, help="tuning: rows per CTA step")
    ap.add_argument("--paced-warps", type=int, default=0, help="tuning: warps per CTA")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--phases", action="store_true",
                    help="time stamps of each push's and take's phases (see Phases)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=JSON",
                    help="set a module attribute in every process (tuning, A/B runs)")
    ap.add_argument("--profile", default="", help="write kernel traces of the last push here")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    world = args.gpus or torch.cuda.device_count()
    if world < 2:
        print("bench_broadcast_fanout needs at least 2 CUDA GPUs; found", world)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    result: dict[str, Any] = {
        "label": args.label, "device": torch.cuda.get_device_name(0), "gpus": world,
        "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "code": os.path.relpath(os.path.abspath(args.code), REPO),
        "sender_kwargs": json.loads(args.sender_kwargs),
        "receiver_kwargs": json.loads(args.receiver_kwargs),
        "bucket_mib": args.bucket_mib, "iters": args.iters,
        "receiver_load": args.receiver_load,
        "paced_programs": args.paced_programs or "default", "sizes": []}
    d = Driver(args, world)
    result["sender_construct_seconds"] = d.ready[0]["construct_seconds"]
    result["sender_fused_packing"] = d.ready[0]["fused_packing"]
    try:
        for i, gb in enumerate(args.gb):
            result["sizes"].append(measure_size(d, args, gb, seed=i + 1))
            s = result["sizes"][-1]
            print(f"[{args.label}] {s['bytes'] / 1e9:.2f} GB x{world - 1}: sender "
                  f"{s['sender_GBps']:.0f} GB/s, slowest receiver "
                  f"{s['slowest_receiver_GBps']:.0f}, raw {s['raw_bucketed_GBps']:.0f} -> "
                  f"{s['ratio_sender']:.3f} / {s['ratio_slowest_receiver']:.3f}, exact "
                  f"{s['bit_exact_every_version']}, sources {s['sources']}", flush=True)
            if s["phases_us"]:
                print(f"[{args.label}] phases (us from t0): {json.dumps(s['phases_us'])}",
                      flush=True)
        if args.faults:
            result["faults"] = measure_faults(d, args)
            print(f"[{args.label}] faults: {json.dumps(result['faults'], default=str)}",
                  flush=True)
    finally:
        d.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    ok = all(s["bit_exact_every_version"] for s in result["sizes"])
    return 0 if ok and result.get("faults", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
