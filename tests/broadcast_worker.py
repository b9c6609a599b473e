"""A receiver process for the broadcast tests, driven by JSON commands over a queue (the test
plumbing only; the broadcast itself carries no pickled objects)."""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from typing import Any

import torch

from dbsync import fileio


def digest(t: torch.Tensor) -> list[Any]:
    host = t.detach().to("cpu").contiguous()
    return [str(host.dtype).removeprefix("torch."), list(host.shape),
            fileio.checksum(fileio.tensor_bytes(host))]


class Collector:
    """A load_weights that records each tensor's digest (optionally dying at the first)."""

    def __init__(self, die: bool = False):
        self.die = die
        self.calls = 0
        self.got: dict[str, list[Any]] = {}

    def __call__(self, pairs: Any) -> None:
        self.calls += 1
        self.got.clear()
        for name, tensor in pairs:
            if self.die:
                os.kill(os.getpid(), signal.SIGKILL)
            self.got[name] = digest(tensor)


def flip_one_byte(bucket: int, payload: Any) -> None:
    """A test hook: damage the second bucket on arrival, before it is verified."""
    if bucket == 1:
        payload[payload.numel() // 2] ^= 0x10


def run(root: str, reader_id: str, timeout: float, commands: Any, results: Any) -> None:
    from dbsync.nccl import BroadcastReceiver

    receiver = BroadcastReceiver(root, reader_id=reader_id, timeout=timeout,
                                 fallback_timeout=60.0, address="127.0.0.1")
    results.put(json.dumps({"ready": os.getpid()}))
    held: dict[str, torch.Tensor] = {}
    while True:
        command = json.loads(commands.get())
        op = command["op"]
        if op == "exit":
            receiver.close()
            results.put(json.dumps({"bye": True}))
            return
        if op == "sleep":
            time.sleep(command["seconds"])
            results.put(json.dumps({"slept": command["seconds"]}))
            continue
        collector = Collector(die=command.get("die", False))
        if command.get("corrupt"):
            receiver.before_verify = flip_one_byte
        # "into": {name: [dtype, shape]}: receive into existing tensors allocated here;
        # "again": into the tensors of the last "into" (minus "replace": fresh tensors)
        if command.get("again"):
            into = held
            for name in command.get("replace", []):
                into[name] = torch.full_like(into[name], 7)
        else:
            into = {name: torch.full(shape, 7, dtype=getattr(torch, dtype))
                    for name, (dtype, shape) in command.get("into", {}).items()}
        held = into
        kept = dict(into)  # the same objects must receive the bytes
        try:
            cpu, wall = time.process_time(), time.monotonic()
            version = receiver.receive(into or collector, timeout=command.get("timeout"))
            cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            receiver.before_verify = None
            if into:
                assert all(into[n] is kept[n] for n in kept)
                collector.got = {n: digest(t) for n, t in into.items()}
                collector.calls = 1
            results.put(json.dumps({
                "version": version, "source": receiver.last_source, "epoch": receiver.epoch,
                "error": receiver.last_error, "calls": collector.calls, "tensors": collector.got,
                "member": receiver.is_member, "cpu_seconds": cpu, "wall_seconds": wall}))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put(json.dumps({"exception": repr(exc),
                                    "traceback": traceback.format_exc()}))
