"""Cost that must not grow with the tensor count or the push rate: bounded open files and
mappings, a second staging buffer for background pushes, parallel loads into plain modules."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import dbsync

MANY = r"""
import resource, sys, torch, dbsync
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
root, count = sys.argv[1], int(sys.argv[2])
weights = {f"experts.{i}.w": torch.full((3 + i % 5,), float(i)) for i in range(count)}
with dbsync.Sender(root) as sender:
    sender.shard_bytes = 1024          # many shards too: more than one batch of open files
    assert sender.push(weights) == 1
dest = {k: torch.zeros_like(v) for k, v in weights.items()}
with dbsync.Receiver(root) as rx:
    assert rx.load(dest) == 1
    shards = len(rx.manifest().shards)
assert all(torch.equal(dest[k], v) for k, v in weights.items())
print(shards)
"""


def test_thousands_of_tensors_and_shards_under_a_low_open_file_limit(root):
    """2,000 tensors in ~130 shards, pushed and loaded (verified) by a process allowed only
    256 open files: one file per tensor (format 1) needed 2,000."""
    out = subprocess.run([sys.executable, "-c", MANY, root, "2000"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) > 64  # more shards than one batch of open files
    assert len(os.listdir(os.path.join(root, "slots", "a"))) == int(out.stdout) + 2


def test_background_push_returns_while_the_previous_one_is_still_writing(root):
    """Two staging buffers: the trainer's stall is one snapshot copy, not the previous write."""
    release, writing = threading.Event(), threading.Event()

    def hold_first_write(done: int, total: int) -> None:
        writing.set()
        assert release.wait(30)

    weights = {"w": torch.full((1024,), 1.0)}
    with dbsync.Sender(root) as sender:
        first = sender.push(weights, blocking=False, progress=hold_first_write)
        assert writing.wait(30)
        weights["w"].fill_(2.0)  # the trainer moved on
        second = sender.push(weights, blocking=False)  # returns: the other buffer is free
        assert not first.done(), "the first push must still be writing"
        weights["w"].fill_(3.0)
        release.set()
        assert (first.result(timeout=30), second.result(timeout=30)) == (1, 2)
    got = {}
    with dbsync.Receiver(root) as rx:
        rx.load(lambda pairs: got.update({n: t.clone() for n, t in pairs}))
    assert torch.equal(got["w"], torch.full((1024,), 2.0))  # the snapshot, not later edits


def test_load_into_a_plain_module_checks_first_then_copies(root):
    source = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with dbsync.Sender(root) as sender:
        sender.push(source)
    target = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    with dbsync.Receiver(root) as rx:
        assert rx.load(target, threads=3) == 1
    for (name, want), got in zip(source.state_dict().items(), target.state_dict().values(),
                                 strict=True):
        assert torch.equal(want, got), name
    wrong = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.BatchNorm1d(5))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with dbsync.Receiver(root) as rx, pytest.raises(dbsync.IncompatibleWeightsError,
                                                   match="shape"):
        rx.load(wrong)
    assert all(torch.equal(before[k], v) for k, v in wrong.state_dict().items())


def test_latest_version_reads_only_the_small_head(root):
    with dbsync.Sender(root) as sender:
        sender.push({f"t{i}": torch.ones(1) for i in range(3000)})
    head = os.path.getsize(os.path.join(root, "dbsync.json"))
    assert head < 2048  # whatever the tensor count
    index = os.path.join(root, "slots", "a", "index.json")
    os.truncate(index, 10)  # the index is damaged: the head alone still answers
    with dbsync.Receiver(root) as rx:
        assert rx.latest_version() == 1
        with pytest.raises(dbsync.FormatError):
            rx.load(lambda pairs: None)
