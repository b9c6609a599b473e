"""The broadcast fast path across real processes (gloo on CPU, multiprocessing spawn, free
ports on 127.0.0.1): bit-exact delivery of every dtype, three receivers with one killed
mid-push, a damaged bucket refused and read from the filesystem, a late joiner served from the
filesystem then joining the next epoch, a member that stops receiving costing the sender
no more than the timeout, and an idle member costing no CPU until the sender rings it."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import broadcast_worker
import pytest
import torch

from dbsync import DBSyncError, InvalidWeightsError, Receiver, Sender
from dbsync.format import DTYPE_SIZES
from dbsync.nccl import BroadcastSender, read_record

TIMEOUT = 3.0  # every collective and handshake step
SLACK = 3.0  # scheduling noise on a loaded 2-core CI machine


class Worker:
    def __init__(self, ctx: Any, root: str, reader_id: str):
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=broadcast_worker.run, daemon=True,
                                   args=(root, reader_id, TIMEOUT, self.commands, self.results))
        self.process.start()

    def send(self, **command: Any) -> None:
        self.commands.put(json.dumps(command))

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        out = json.loads(self.results.get(timeout=timeout))
        assert "exception" not in out, out.get("traceback")
        return out


@contextmanager
def workers(root: str, *ids: str) -> Iterator[list[Worker]]:
    ctx = mp.get_context("spawn")
    started = [Worker(ctx, root, i) for i in ids]
    try:
        for w in started:
            w.result()  # ready
        yield started
    finally:
        for w in started:
            if w.process.is_alive():
                w.send(op="exit")
        for w in started:
            w.process.join(10)
            if w.process.is_alive():
                w.process.kill()


@pytest.fixture
def bsender(tmp_path: Any) -> Iterator[BroadcastSender]:
    sender = Sender(tmp_path / "store", durable=False)
    bs = BroadcastSender(sender, address="127.0.0.1", device="cpu", bucket_bytes=4096,
                         timeout=TIMEOUT, join_timeout=15.0)
    try:
        yield bs
    finally:
        bs.close()
        sender.close()


def random_bytes_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator
                        ) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def all_dtype_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in DTYPE_SIZES:
        dtype = getattr(torch, name)
        weights[f"{name}.matrix"] = random_bytes_tensor(dtype, (33, 7), gen)
        weights[f"{name}.scalar"] = random_bytes_tensor(dtype, (), gen)
        weights[f"{name}.empty"] = random_bytes_tensor(dtype, (0, 5), gen)
    # spans several 4 KiB buckets; a transposed (non-contiguous) view; an odd-sized tail
    weights["big.bf16"] = random_bytes_tensor(torch.bfloat16, (50, 171), gen)
    weights["transposed"] = random_bytes_tensor(torch.float32, (40, 30), gen).t()
    weights["layers.0/odd name ünicode"] = random_bytes_tensor(torch.int8, (4099,), gen)
    return weights


def expected(weights: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {name: broadcast_worker.digest(t) for name, t in weights.items()}


def manifest_digests(root: str) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = {}

    def load(pairs: Any) -> None:
        for name, t in pairs:
            got[name] = broadcast_worker.digest(t)

    with Receiver(root) as r:
        r.load(load)
    return got


def test_every_dtype_bit_exact_to_two_receivers(bsender: BroadcastSender) -> None:
    root = bsender.sender.root
    with workers(root, "rx-a", "rx-b") as (a, b):
        for version, seed in ((1, 1), (2, 2)):
            weights = all_dtype_weights(seed)
            for w in (a, b):
                w.send(op="receive", timeout=60)
            assert bsender.wait_for_joins(2, 30)
            assert bsender.push(weights) == version
            stats = bsender.last_push_stats
            assert stats["broadcast"] and stats["members"] == 2, stats
            assert stats["buckets"] > 3 and stats["checksums"]
            if version == 2:
                assert stats["setup_seconds"] == 0.0  # same epoch: no new group
            want = expected(weights)
            for w in (a, b):
                got = w.result()
                assert got["version"] == version and got["source"] == "broadcast", got
                assert got["calls"] == 1
                assert list(got["tensors"]) == list(want)  # manifest (push) order
                assert got["tensors"] == want
            assert manifest_digests(root) == want  # the filesystem has the same version
        record = read_record(bsender.sender.store)
        assert record is not None and record.members == ("rx-a", "rx-b")
        assert record.world_size == 3 and record.epoch == bsender.epoch


def test_three_receivers_one_killed_mid_push(bsender: BroadcastSender) -> None:
    """Every version reaches every live receiver exactly; a receiver killed in the middle of a
    push costs that push at most the timeout; the others read that version from the
    filesystem and take the next one over the broadcast."""
    root = bsender.sender.root
    gen = torch.Generator().manual_seed(7)
    weights = {f"layer{i}": random_bytes_tensor(torch.bfloat16, (256, 128), gen)
               for i in range(48)}  # 3 MiB in 768 buckets of 4 KiB
    with workers(root, "victim", "s1", "s2") as (victim, *survivors):
        for w in (victim, *survivors):
            w.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(3, 30)
        assert bsender.push(weights) == 1
        assert bsender.last_push_stats["members"] == 3
        for w in (victim, *survivors):
            got = w.result()
            assert got["source"] == "broadcast" and got["tensors"] == expected(weights), got
        epoch = bsender.epoch

        weights2 = {k: v + 1 for k, v in weights.items()}
        victim.send(op="receive", timeout=60, die=True)
        for w in survivors:
            w.send(op="receive", timeout=60)
        time.sleep(0.3)  # all inside receive()
        t0 = time.monotonic()
        assert bsender.push(weights2) == 2
        elapsed = time.monotonic() - t0
        stats = bsender.last_push_stats
        victim.process.join(10)
        assert victim.process.exitcode == -9
        assert stats["error"] is not None and not stats["broadcast"], stats
        assert elapsed < TIMEOUT + SLACK, elapsed
        assert Receiver(root).latest_version() == 2  # published on the filesystem anyway
        for w in survivors:
            got = w.result()
            assert got["version"] == 2 and got["tensors"] == expected(weights2), got["source"]

        # the survivors re-join; the next push forms a new epoch without the dead receiver
        for w in survivors:
            w.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(2, 30)
        weights3 = {k: v + 2 for k, v in weights.items()}
        t0 = time.monotonic()
        assert bsender.push(weights3) == 3
        assert time.monotonic() - t0 < TIMEOUT + SLACK
        for w in survivors:
            got = w.result()
            assert got["source"] == "broadcast" and got["tensors"] == expected(weights3), got
        assert bsender.members == ("s1", "s2") and bsender.epoch > epoch
        assert bsender.last_push_stats["broadcast"]


def test_an_interrupted_push_never_reaches_a_receiver_mixed_with_the_next(
        bsender: BroadcastSender, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C between two buckets of a push, caught by the trainer, which pushes again: the
    receiver that was taking the interrupted push drops it (it used to complete it with the
    next push's buckets, each verifying on its own) and ends with the next version, exact."""
    from dbsync.nccl import group as group_module

    root = bsender.sender.root
    gen = torch.Generator().manual_seed(11)
    weights = {f"layer{i}": random_bytes_tensor(torch.bfloat16, (64, 64), gen)
               for i in range(16)}  # 128 KiB in 32 buckets of 4 KiB
    with workers(root, "rx") as (rx,):
        rx.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(1, 30)
        assert bsender.push(weights) == 1
        assert rx.result()["source"] == "broadcast"

        real_wait, calls = group_module.Group.wait, []

        def interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt  # (as Ctrl-C arrives: between two buckets)
            return real_wait(self, *args, **kwargs)

        rx.send(op="receive", timeout=60)
        monkeypatch.setattr(group_module.Group, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            bsender.push({k: v + 1 for k, v in weights.items()})
        monkeypatch.setattr(group_module.Group, "wait", real_wait)
        assert Receiver(root).latest_version() == 1  # nothing was published
        weights3 = {k: v + 2 for k, v in weights.items()}
        assert bsender.push(weights3) == 2  # the trainer goes on
        got = rx.result()
        assert got["version"] == 2 and got["tensors"] == expected(weights3), got["source"]


def test_a_group_that_cannot_form_costs_one_push_not_every_push(
        bsender: BroadcastSender, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver announcing an address the trainer cannot reach makes the group fail to
    form. After a second failure in a row, pushes go through the filesystem alone for a
    while, saying why, instead of each waiting join_timeout for a group that cannot form;
    receivers get every version."""
    from dbsync.nccl import membership as membership_module
    from dbsync.nccl.errors import BroadcastError

    attempts = []

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        raise BroadcastError("could not create the gloo group (as an unreachable member)")

    monkeypatch.setattr(membership_module.Group, "create", unreachable)
    root = bsender.sender.root
    with workers(root, "rx") as (rx,):
        for version in (1, 2, 3, 4):
            rx.send(op="receive", timeout=60)
            assert bsender.wait_for_joins(1, 30)  # (the receiver asked to join again)
            weights = {"w": torch.full((1000,), float(version))}
            assert bsender.push(weights) == version
            stats = bsender.last_push_stats
            assert not stats["broadcast"] and "could not form" in stats["error"], stats
            assert ("filesystem alone" in stats["error"]) == (version >= 2), stats["error"]
            got = rx.result()
            assert got["version"] == version and got["tensors"] == expected(weights)
            assert got["source"] == "filesystem"
    assert len(attempts) == 2  # (before: one attempt, and its wait, per push)


def test_damaged_bucket_is_refused_and_the_version_read_from_the_filesystem(
        bsender: BroadcastSender) -> None:
    """One byte of a bucket flipped on arrival (before verification): that receiver hands out
    nothing of that bucket, reads the version from the filesystem (exact), and takes the next
    push over the broadcast again; the other receiver is not affected."""
    root = bsender.sender.root
    gen = torch.Generator().manual_seed(11)
    weights = {f"w{i}": random_bytes_tensor(torch.float16, (64, 32), gen) for i in range(8)}
    with workers(root, "hit", "other") as (hit, other):
        hit.send(op="receive", timeout=60, corrupt=True)
        other.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(2, 30)
        assert bsender.push(weights) == 1
        got = hit.result()
        assert got["version"] == 1 and got["source"] == "filesystem", got
        assert "damaged" in (got["error"] or ""), got
        assert got["tensors"] == expected(weights)
        got = other.result()
        assert got["source"] == "broadcast" and got["tensors"] == expected(weights)

        weights2 = {k: v * 2 for k, v in weights.items()}
        for w in (hit, other):
            w.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(2, 30)
        assert bsender.push(weights2) == 2
        for w in (hit, other):
            got = w.result()
            assert got["source"] == "broadcast" and got["tensors"] == expected(weights2), got


def test_a_push_of_another_layout_under_the_same_names_reaches_members_exact(
        bsender: BroadcastSender) -> None:
    """The sender keeps the last push's header while the tensors keep their layout. Tensors
    of other shapes under the same names: a new header, and the member takes that version
    over the broadcast, exact, in the same epoch."""
    root = bsender.sender.root
    gen = torch.Generator().manual_seed(5)
    weights = {f"w{i}": random_bytes_tensor(torch.float16, (64, 32), gen) for i in range(6)}
    reshaped = {k: random_bytes_tensor(torch.float16, (32, 80), gen) for k in weights}
    with workers(root, "m") as (member,):
        for version, sent in enumerate((weights, weights, reshaped, reshaped), start=1):
            member.send(op="receive", timeout=60)
            assert bsender.wait_for_joins(1, 30)
            assert bsender.push(sent) == version
            got = member.result()
            assert got["source"] == "broadcast" and got["tensors"] == expected(sent), got
            assert bsender.epoch == 1, bsender.last_push_stats


def test_late_joiner_then_next_epoch_and_unresponsive_member(bsender: BroadcastSender) -> None:
    root = bsender.sender.root
    gen = torch.Generator().manual_seed(3)
    weights = {"w": random_bytes_tensor(torch.float16, (64, 64), gen),
               "b": random_bytes_tensor(torch.float32, (64,), gen)}
    assert bsender.push(weights) == 1  # nobody joined: filesystem only
    assert not bsender.last_push_stats["broadcast"]
    with workers(root, "late") as (late,):
        late.send(op="receive", timeout=60)
        got = late.result()
        assert got["version"] == 1 and got["source"] == "filesystem"
        assert got["tensors"] == expected(weights)

        late.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(1, 30)
        weights2 = {k: v * 2 for k, v in weights.items()}
        assert bsender.push(weights2) == 2
        got = late.result()
        assert got["source"] == "broadcast" and got["version"] == 2, got
        assert got["tensors"] == expected(weights2)
        assert bsender.members == ("late",)

        # A member busy elsewhere (not inside receive) costs one push at most the timeout.
        late.send(op="sleep", seconds=TIMEOUT + 2)
        time.sleep(0.2)
        t0 = time.monotonic()
        weights3 = {k: v * 3 for k, v in weights.items()}
        assert bsender.push(weights3) == 3
        assert time.monotonic() - t0 < TIMEOUT + SLACK
        assert "did not acknowledge" in bsender.last_push_stats["error"]
        late.result(timeout=30)  # slept
        late.send(op="receive", timeout=60)
        got = late.result()
        assert got["version"] == 3 and got["source"] == "filesystem"
        assert got["tensors"] == expected(weights3)


def test_receive_into_existing_tensors_verified_bucket_by_bucket(
        bsender: BroadcastSender) -> None:
    """``receive(dict of tensors)``: the bytes land in the receiver's own tensors (the same
    objects), bit-exact for every dtype, a float32 destination takes a bf16 tensor split
    across buckets by cast; a flipped byte makes that version come from the filesystem
    (exact); tensors that do not fit are refused with the filesystem's error naming them, and
    the receiver takes the next push over the broadcast again."""
    root = bsender.sender.root
    weights = all_dtype_weights(5)
    shapes = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)]
              for n, t in weights.items()}
    cast = dict(shapes, **{"big.bf16": ["float32", [50, 171]]})
    want = expected(weights)
    cast_want = dict(want, **{"big.bf16": broadcast_worker.digest(weights["big.bf16"].float())})
    with workers(root, "into", "cast") as (into, caster):
        into.send(op="receive", timeout=60, into=shapes)
        caster.send(op="receive", timeout=60, into=cast)
        assert bsender.wait_for_joins(2, 30)
        assert bsender.push(weights) == 1
        got = into.result()
        assert got["source"] == "broadcast" and got["tensors"] == want, got["error"]
        got = caster.result()
        assert got["source"] == "broadcast" and got["tensors"] == cast_want, got["error"]

        weights2 = all_dtype_weights(6)
        into.send(op="receive", timeout=60, into=shapes, corrupt=True)
        wrong = dict(shapes, **{"big.bf16": ["bfloat16", [171, 50]]})
        caster.send(op="receive", timeout=60, into=wrong)
        assert bsender.wait_for_joins(2, 30)
        assert bsender.push(weights2) == 2
        got = into.result()
        assert got["source"] == "filesystem" and "damaged" in got["error"], got
        assert got["tensors"] == expected(weights2)
        refused = json.loads(caster.results.get(timeout=60))
        assert "big.bf16" in refused.get("exception", ""), refused

        weights3 = all_dtype_weights(7)
        into.send(op="receive", timeout=60, into=shapes)
        caster.send(op="receive", timeout=60, into=shapes)
        assert bsender.wait_for_joins(2, 30)
        assert bsender.push(weights3) == 3
        for w in (into, caster):
            got = w.result()
            assert got["source"] == "broadcast" and got["tensors"] == expected(weights3), got

        # the same tensors again (the receiver reuses its copy plans), then with two of them
        # replaced by new tensors (the plans of their buckets are rebuilt)
        for version, seed, replace in ((4, 8, []), (5, 9, ["big.bf16", "int8.matrix"])):
            weights_n = all_dtype_weights(seed)
            for w in (into, caster):
                w.send(op="receive", timeout=60, again=True, replace=replace)
            assert bsender.wait_for_joins(2, 30)
            assert bsender.push(weights_n) == version
            for w in (into, caster):
                got = w.result()
                assert got["source"] == "broadcast", got
                assert got["tensors"] == expected(weights_n), version


def test_a_damaged_bucket_drained_in_order_up_to_a_short_last_bucket(tmp_path: Any) -> None:
    """Damage in bucket 1 of five (two receive buffers, the last bucket shorter): the drain
    must post the remaining receives in bucket order, as the sender sends them, or the short
    last bucket is matched with a full one and the group breaks. Both receivers, the damaged
    one included, take the next push over the broadcast."""
    sender = Sender(tmp_path / "store", durable=False)
    bs = BroadcastSender(sender, address="127.0.0.1", device="cpu", bucket_bytes=8192,
                         timeout=TIMEOUT, join_timeout=15.0)
    gen = torch.Generator().manual_seed(12)
    weights = {f"w{i}": random_bytes_tensor(torch.float16, (64, 64), gen) for i in range(4)}
    weights["tail"] = random_bytes_tensor(torch.float16, (100,), gen)
    try:
        with workers(str(tmp_path / "store"), "hit", "other") as (hit, other):
            hit.send(op="receive", timeout=60, corrupt=True)
            other.send(op="receive", timeout=60)
            assert bs.wait_for_joins(2, 30)
            assert bs.push(weights) == 1
            assert bs.last_push_stats["buckets"] == 5
            got = hit.result()
            assert got["source"] == "filesystem" and "damaged" in got["error"], got
            assert got["tensors"] == expected(weights)
            assert other.result()["source"] == "broadcast"

            weights2 = {k: v * 2 for k, v in weights.items()}
            for w in (hit, other):
                w.send(op="receive", timeout=60)
            assert bs.wait_for_joins(2, 30)
            assert bs.push(weights2) == 2
            assert bs.last_push_stats["broadcast"] and bs.last_push_stats["setup_seconds"] == 0
            for w in (hit, other):
                got = w.result()
                assert got["source"] == "broadcast" and got["tensors"] == expected(weights2), got
    finally:
        bs.close()
        sender.close()


def test_an_idle_member_costs_nothing_until_the_sender_rings_it(
        bsender: BroadcastSender) -> None:
    """A member waiting inside ``receive`` sleeps on its doorbell (a store wait), not on a
    polling loop: over 2 idle seconds the whole receiver process uses well under 5% of a core
    (polling every 0.25 ms used ~40%); the next push still wakes it and goes over the
    broadcast, and so does the one after an epoch change (a second member joining)."""
    root = bsender.sender.root
    gen = torch.Generator().manual_seed(11)
    weights = {"w": random_bytes_tensor(torch.bfloat16, (32, 64), gen)}
    assert bsender.push(weights) == 1
    with workers(root, "idle", "second") as (idle, second):
        idle.send(op="receive", timeout=60)
        assert idle.result()["source"] == "filesystem"
        idle.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(1, 30)
        assert bsender.push({"w": weights["w"] * 2}) == 2
        got = idle.result()
        assert got["source"] == "broadcast" and got["member"], got

        idle.send(op="receive", timeout=2.0)
        got = idle.result()
        assert got["version"] is None and got["member"]
        assert got["cpu_seconds"] < 0.05 * got["wall_seconds"], (
            f"{got['cpu_seconds']:.3f} s of CPU in {got['wall_seconds']:.2f} idle seconds")

        idle.send(op="receive", timeout=60)
        assert bsender.push({"w": weights["w"] * 3}) == 3
        got = idle.result()
        assert got["source"] == "broadcast" and got["version"] == 3, got
        assert got["tensors"] == expected({"w": weights["w"] * 3})

        # a second member: the next push forms a new epoch, the idle member is rung to follow
        second.send(op="receive", timeout=60)
        assert second.result()["version"] == 3
        second.send(op="receive", timeout=60)
        idle.send(op="receive", timeout=60)
        assert bsender.wait_for_joins(2, 30)
        epoch = bsender.epoch
        assert bsender.push({"w": weights["w"] * 4}) == 4
        assert bsender.epoch > epoch and bsender.members == ("idle", "second")
        for w in (idle, second):
            got = w.result()
            assert got["source"] == "broadcast" and got["version"] == 4, got


_SENDER_SCRIPT = """
import sys, torch
from dbsync.nccl import BroadcastSender
root, tensors, bucket_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sender = BroadcastSender(root, device="cpu", address="127.0.0.1", timeout=3.0,
                         **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
print("ready", flush=True)
for line in sys.stdin:
    op, arg = line.split()
    if op == "joins":
        print(sender.wait_for_joins(int(arg), 30), flush=True)
    elif tensors == 1:
        print(sender.push({"w": torch.full((64,), float(arg))}), flush=True)
    else:
        print(sender.push({f"w{i}": torch.full((1024,), float(arg)) for i in range(tensors)}),
              flush=True)
"""


class _Trainer:
    """A ``BroadcastSender`` in a process of its own (``_SENDER_SCRIPT``: ``tensors`` tensors
    per version, buckets of ``bucket_bytes``, 0: the default), driven a line at a time."""

    def __init__(self, root: str, tensors: int = 1, bucket_bytes: int = 0):
        import subprocess
        import sys

        self.process = subprocess.Popen(
            [sys.executable, "-c", _SENDER_SCRIPT, root, str(tensors), str(bucket_bytes)],
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def ask(self, line: str) -> str:
        self.tell(line)
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def end(self) -> None:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait()


def test_a_member_is_never_held_up_by_a_stopped_trainer(tmp_path: Any) -> None:
    """The trainer's process is stopped (SIGSTOP: a debugger, a frozen host) while a member
    idles in the group: a ``receive(timeout=1)`` returns within the step timeout, saying
    the sender does not answer. (It hung for as long as the trainer stayed stopped: its
    store accepts connections but never answers, and the epoch read had no bound.)"""
    import os
    import signal
    import threading

    from dbsync.nccl import BroadcastReceiver

    root = str(tmp_path)

    def keep(pairs: Any) -> None:
        got.update((name, tensor.clone()) for name, tensor in pairs)

    got: dict[str, torch.Tensor] = {}
    rx = None
    trainer = _Trainer(root)
    ask = trainer.ask
    try:
        assert ask("push 1") == "1"
        rx = BroadcastReceiver(root, timeout=TIMEOUT, address="127.0.0.1")
        assert rx.receive(keep, timeout=30) == 1  # (from the filesystem; it asks to join)
        result: dict[str, Any] = {}
        taking = threading.Thread(target=lambda: result.update(v=rx.receive(keep, timeout=60)))
        taking.start()
        assert ask("joins 1") == "True"
        assert ask("push 2") == "2"
        taking.join(60)
        assert result["v"] == 2 and rx.last_source == "broadcast" and rx.is_member
        assert torch.equal(got["w"], torch.full((64,), 2.0))
        os.kill(trainer.process.pid, signal.SIGSTOP)
        idle = threading.Thread(target=lambda: result.update(idle=rx.receive(keep, timeout=1)))
        t0 = time.monotonic()
        idle.start()
        idle.join(TIMEOUT + 1 + SLACK + 10)
        assert not idle.is_alive(), "receive() hung on a stopped trainer"
        assert time.monotonic() - t0 < TIMEOUT + 1 + SLACK
        assert result["idle"] is None and "no answer" in (rx.last_error or "")
    finally:
        trainer.end()
        if rx is not None:
            rx.close()


def test_a_broadcast_cut_short_by_a_dead_trainer_is_mended_by_the_next_receive(
        tmp_path: Any) -> None:
    """The trainer is killed after a member took 4 of version 2's 16 buckets into its tensors,
    before version 2 was published: ``receive`` raises after ``fallback_timeout`` saying "call
    receive again", the tensors holding parts of both versions. Called again, it waited for a
    version newer than 1 and left them torn for good. It now applies the newest published
    version first, and the tensors are version 1 again, whole."""
    import os
    import signal
    import threading

    from dbsync.nccl import BroadcastReceiver
    from dbsync.nccl.errors import BroadcastTimeoutError

    root = str(tmp_path)
    dest = {f"w{i}": torch.zeros(1024) for i in range(16)}
    rx = None
    trainer = _Trainer(root, tensors=16, bucket_bytes=4096)  # (16 buckets of one tensor)
    ask = trainer.ask
    try:
        assert ask("push 1") == "1"
        rx = BroadcastReceiver(root, timeout=TIMEOUT, address="127.0.0.1", fallback_timeout=2)
        assert rx.receive(dest, timeout=30) == 1  # (from the filesystem; it asks to join)

        def kill_the_trainer(bucket: int, payload: Any) -> None:
            if bucket == 4:  # (buckets 0-3 are in the tensors by now)
                os.kill(trainer.process.pid, signal.SIGKILL)
                trainer.process.wait()

        rx.before_verify = kill_the_trainer
        raised: list[BaseException] = []

        def taking() -> None:
            try:
                rx.receive(dest, timeout=60)
            except BaseException as exc:  # noqa: BLE001 - checked below
                raised.append(exc)

        thread = threading.Thread(target=taking)
        thread.start()
        assert ask("joins 1") == "True"  # (it joins while it waits in receive)
        trainer.tell("push 2")  # (no answer: the trainer is killed during it)
        thread.join(60)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], BroadcastTimeoutError), raised
        assert "call receive again" in str(raised[0])
        rx.before_verify = None
        assert {float(t[0]) for t in dest.values()} == {1.0, 2.0}  # torn, as said
        assert rx.receive(dest, timeout=30) == 1
        assert all(torch.equal(t, torch.full((1024,), 1.0)) for t in dest.values())
        assert rx.last_source == "filesystem" and rx.loaded_version == 1
    finally:
        trainer.end()
        if rx is not None:
            rx.close()


def test_a_stale_rendezvous_whose_port_another_sender_took_is_never_joined(
        bsender: BroadcastSender, tmp_path: Any) -> None:
    """Store A's trainer died and left ``A/broadcast.json``; another trainer, publishing store
    B, now listens on that port. A's receivers connected, joined B's group and applied B's
    weights as versions of A that A never published (and then skipped A's own versions of
    those numbers). A receiver now checks that the store it reached is the sender's that the
    file names, and reads from the filesystem otherwise."""
    import dataclasses

    from dbsync.nccl import rendezvous as rv

    root_a = str(tmp_path / "store-a")
    with Sender(root_a, durable=False) as sender_a:
        sender_a.push({"w": torch.ones(1024)})
        taken = read_record(bsender.sender.store)  # (B's own, at B's port)
        assert taken is not None
        rv.write_record(sender_a.store, dataclasses.replace(taken, sender_id="0" * 32))
        with workers(root_a, "rx") as (rx,):
            rx.send(op="receive", timeout=60)
            assert rx.result()["version"] == 1  # (from the filesystem)
            rx.send(op="receive", timeout=4)
            got = rx.result()
            assert got["version"] is None and "belongs to another sender" in got["error"], got
            assert not bsender.wait_for_joins(1, 0.5)  # never asked B to join
            bsender.push({"w": torch.full((1024,), 9.0)})
            sender_a.push({"w": torch.full((1024,), 2.0)})
            rx.send(op="receive", timeout=60)
            got = rx.result()
            assert (got["version"], got["source"]) == (2, "filesystem"), got
            assert got["tensors"] == {"w": broadcast_worker.digest(torch.full((1024,), 2.0))}


def test_a_closed_sender_frees_its_port_for_the_next_one(bsender: BroadcastSender) -> None:
    """``close()`` left the rendezvous store listening (a finished push's callbacks kept it),
    so a BroadcastSender made again on its configured port failed with EADDRINUSE."""
    port = bsender.port
    bsender.push({"w": torch.ones(4)})
    # (and one at a time per store: a second replaced broadcast.json, taking the receivers)
    with pytest.raises(DBSyncError, match="a BroadcastSender of this Sender is open already"):
        BroadcastSender(bsender.sender, address="127.0.0.1", device="cpu")
    bsender.close()
    again = BroadcastSender(bsender.sender, address="127.0.0.1", port=port, device="cpu",
                            timeout=TIMEOUT)
    try:
        assert again.port == port
    finally:
        again.close()


def test_a_push_its_sender_refuses_is_refused_before_members_take_it(tmp_path: Any) -> None:
    """Full weights pushed through a BroadcastSender into a store of LoRA adapters: the
    Sender refuses them (a store holds one kind), but only after the broadcast, so members
    applied a version that was never published and then waited their whole timeout to
    learn nothing. The Sender's checks now run first: no member takes anything."""
    root = str(tmp_path / "store")
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.ones(2, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               torch.zeros(8, 2)}
    with Sender(root, durable=False) as sender:
        sender.push(adapter, adapter_config={"r": 2, "target_modules": ["q_proj"],
                                             "peft_type": "LORA"})
        bs = BroadcastSender(sender, address="127.0.0.1", device="cpu", bucket_bytes=4096,
                             timeout=TIMEOUT, join_timeout=15.0)
        try:
            with workers(root, "rx") as (rx,):
                rx.send(op="receive", timeout=60)
                assert rx.result()["version"] == 1
                rx.send(op="receive", timeout=2 * TIMEOUT)
                assert bs.wait_for_joins(1, 30)
                with pytest.raises(InvalidWeightsError, match="holds adapter versions"):
                    bs.push({"model.embed_tokens.weight": torch.full((16, 8), 42.0)})
                got = rx.result()
                assert got["version"] is None and got["calls"] == 0, got
        finally:
            bs.close()
