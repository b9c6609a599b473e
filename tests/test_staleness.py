"""Bounded staleness and refusals the trainer can see: ``Sender(max_lag=K)`` blocks while a
live receiver is more than K versions behind and goes on as it catches up; a receiver's
refusal makes ``wait_for_receivers`` and ``dbsync push --wait-for`` fail at once."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import dbsync


def test_max_lag_blocks_until_receivers_catch_up(root):
    with dbsync.Sender(root, max_lag=1, max_lag_timeout=60) as sender:
        sender.push({"w": torch.full((4,), 1.0)})
        with dbsync.Receiver(root, reader_id="engine") as engine:
            assert engine.load(lambda pairs: None) == 1
            assert sender.push({"w": torch.full((4,), 2.0)}) == 2  # engine 0 behind
            assert sender.push({"w": torch.full((4,), 3.0)}) == 3  # engine 1 behind: allowed
            fourth = sender.push({"w": torch.full((4,), 4.0)}, blocking=False)
            with pytest.raises(concurrent.futures.TimeoutError):
                fourth.result(timeout=1.0)  # engine 2 behind, more than 1: the push waits
            with dbsync.Receiver(root) as probe:
                assert probe.latest_version() == 3  # nothing published meanwhile
            assert engine.load(lambda pairs: None) == 3  # it catches up ...
            assert fourth.result(timeout=30) == 4  # ... and the push goes on
            assert sender.last_push_seconds["wait_for_lag"] >= 1.0


def test_max_lag_timeout_names_the_receivers_behind(root):
    with dbsync.Sender(root, max_lag=0, max_lag_timeout=0.5) as sender:
        sender.push({"w": torch.ones(2)})
        with dbsync.Receiver(root, reader_id="slow-engine") as engine:
            engine.load(lambda pairs: None)
            sender.push({"w": torch.ones(2)})
            with pytest.raises(dbsync.StalenessError, match="slow-engine"):
                sender.push({"w": torch.ones(2)})
            assert sender.latest_version() == 2


def test_max_lag_does_not_wait_for_a_receiver_that_refused_the_newest_version(root, caplog):
    """A receiver that refused the newest version (its tensors do not fit) cannot catch up
    until another is published: the next push (the fix) is not held for it (before: held
    until ``max_lag_timeout``, then "still behind", the fix never published)."""
    with dbsync.Sender(root, max_lag=0, max_lag_timeout=30) as sender:
        sender.push({"w": torch.ones(2)})
        with dbsync.Receiver(root, reader_id="engine-3") as engine:
            model = {"w": torch.zeros(2)}
            assert engine.load(model) == 1
            sender.push({"w": torch.ones(3)})  # does not fit the engine's model
            with pytest.raises(dbsync.IncompatibleWeightsError):
                engine.load(model)
            start = time.monotonic()
            assert sender.push({"w": torch.full((2,), 3.0)}) == 3  # the fix
            assert time.monotonic() - start < 10
            assert engine.load(model) == 3 and torch.equal(model["w"], torch.full((2,), 3.0))
            # caught up: the bound holds again for it
            sender.push({"w": torch.full((2,), 4.0)})
            with pytest.raises(dbsync.StalenessError, match="engine-3"):
                sender.max_lag_timeout = 0.5
                sender.push({"w": torch.full((2,), 5.0)})
    assert any("refused version 2" in r.getMessage() for r in caplog.records)


def test_close_abandons_a_push_waiting_for_a_lag_bound_after_its_bound(root, monkeypatch,
                                                                       caplog):
    """``max_lag`` with no timeout and a receiver that does not load: ``close()`` waits for
    the pending push at most ``EXIT_WAIT_SECONDS`` (before: for ever), then abandons it
    before its flip, saying so; nothing more is published."""
    monkeypatch.setattr(dbsync.sender, "EXIT_WAIT_SECONDS", 1.0)
    sender = dbsync.Sender(root, max_lag=0)
    with dbsync.Receiver(root, reader_id="idle-engine") as engine:
        sender.push({"w": torch.ones(2)})
        assert engine.load(lambda pairs: None) == 1
        sender.push({"w": torch.full((2,), 2.0)})
        waiting = sender.push({"w": torch.full((2,), 3.0)}, blocking=False)
        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 10
        with pytest.raises(Exception, match="nothing was published"):
            waiting.result(timeout=10)
        assert engine.latest_version() == 2
    assert any("abandoned the background push" in r.getMessage() for r in caplog.records)


def test_refusal_makes_push_wait_for_fail_at_once(root, tmp_path, worker_env):
    from safetensors.torch import save_file

    src = str(tmp_path / "w.safetensors")
    save_file({"w": torch.ones(3)}, src)
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.ones(3)})
    with dbsync.Receiver(root, reader_id="engine-7") as engine:
        engine.load(lambda pairs: None)
        engine.report_refusal(2, "w: shape [3] != expected [4]")  # what the engine will say
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "cli.main", "push", src, root, "--wait-for", "1",
             "--timeout", "30"], capture_output=True, text=True, env=worker_env, timeout=60,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stderr
    assert "engine-7" in out.stderr and "shape [3] != expected [4]" in out.stderr
    assert elapsed < 15  # not the 30 s timeout (the command's own start-up included)


def test_push_max_lag_from_the_command_line(root, tmp_path, worker_env):
    from safetensors.torch import save_file

    src = str(tmp_path / "w.safetensors")
    save_file({"w": torch.ones(3)}, src)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def push(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "push", src, root, *extra],
                              capture_output=True, text=True, env=worker_env, timeout=120,
                              cwd=repo)

    assert push().returncode == 0
    with dbsync.Receiver(root, reader_id="lagging") as engine:
        engine.load(lambda pairs: None)  # version 1
        assert push("--max-lag", "0").stdout.split() == ["2"]  # 0 behind: published
        refused = push("--max-lag", "0", "--max-lag-timeout", "0.5")  # now 1 behind
        assert refused.returncode == 1 and "lagging" in refused.stderr, refused.stderr
        assert engine.latest_version() == 2  # nothing published
        engine.load(lambda pairs: None)
        assert push("--max-lag", "0", "--max-lag-timeout", "30").stdout.split() == ["3"]


def test_waiting_for_a_version_a_receiver_loaded_is_not_failed_by_its_refusal_of_the_next(
        root):
    """A pipelined trainer waits for version 1 while the engine, having loaded version 1,
    refuses version 2: the wait for version 1 counts that engine as loaded and times out for
    the second receiver it never had, rather than blaming a refusal of version 1. A receiver
    that loaded nothing of version 1 and refused version 2 still fails the wait at once."""
    with dbsync.Sender(root, durable=False) as sender:
        assert sender.push({"w": torch.ones(2)}) == 1
        with dbsync.Receiver(root, reader_id="engine-0") as engine:
            engine.load(lambda pairs: None)
            assert sender.push({"w": torch.ones(2)}) == 2
            engine.report_refusal(2, "w: shape [2] != expected [3]")
            assert sender.wait_for_receivers(1, 1, timeout=0)
            assert not sender.wait_for_receivers(1, 2, timeout=0.2)
            with pytest.raises(dbsync.ReceiverRefusedError, match="engine-0 refused version 2"):
                sender.wait_for_receivers(2, 1, timeout=30)
            with dbsync.Receiver(root, reader_id="engine-1") as late:
                late.report_refusal(2, "w: shape [2] != expected [3]")
                with pytest.raises(dbsync.ReceiverRefusedError, match="engine-1"):
                    sender.wait_for_receivers(1, 2, timeout=30)


def test_a_load_of_an_earlier_run_is_not_counted_for_the_new_runs_version(root):
    """The store is removed and made anew (a new training run) under a running receiver
    that had loaded version 3 of the old run: waiting for the new run's version 1 does not
    count that load (it said "1 receiver(s) loaded version 1" at once), and the receiver's
    refusal of the new version fails the wait, naming it."""
    import shutil

    with dbsync.Sender(root, durable=False) as sender:
        for value in range(3):
            sender.push({"w": torch.full((4,), float(value))})
    with dbsync.Receiver(root, reader_id="engine-0") as engine:
        engine.load(lambda pairs: None)
        shutil.rmtree(root)
        with dbsync.Sender(root, durable=False) as sender:
            version = sender.push({"w": torch.zeros(4)})
            assert version == 1
            engine.report_refusal(version, "the new run's version does not fit")  # (its lease
            # still says: loaded version 3, of the old run)
            with pytest.raises(dbsync.ReceiverRefusedError, match="engine-0 refused version 1"):
                sender.wait_for_receivers(version, 1, timeout=30)
            from dbsync.status import receivers_at

            assert receivers_at(sender.store, 1) == []


def test_a_push_inside_its_own_threads_snapshot_is_refused_not_hung(root):
    """A trainer keeping its reference weights as a snapshot's views, pushing inside the
    ``with receiver.open()`` block: the second push needs the slot the same thread holds, and
    used to wait for ever. It raises at once and publishes nothing; from another thread the
    push waits until the snapshot closes, then publishes."""
    with dbsync.Sender(root) as sender, dbsync.Receiver(root) as rx:
        sender.push({"w": torch.full((4,), 1.0)})
        with rx.open() as snap:
            assert sender.push({"w": torch.full((4,), 2.0)}) == 2  # the other slot is free
            started = time.monotonic()
            with pytest.raises(dbsync.SelfHeldSlotError, match="this thread holds version 1"):
                sender.push({"w": torch.full((4,), 3.0)})
            assert time.monotonic() - started < 5
            assert rx.latest_version() == 2  # nothing published
            background = sender.push({"w": torch.full((4,), 3.0)}, blocking=False)
            with pytest.raises(concurrent.futures.TimeoutError):
                background.result(timeout=0.5)  # another thread's push waits for the close
            assert torch.equal(snap.tensordict()["w"], torch.full((4,), 1.0))
        assert background.result(timeout=30) == 3
        got = {}
        assert rx.load(lambda pairs: got.update((n, t.clone()) for n, t in pairs)) == 3
        assert torch.equal(got["w"], torch.full((4,), 3.0))  # the refused push's bytes: none


def test_max_lag_refuses_to_wait_for_a_receiver_only_the_pushing_thread_loads(root):
    """A reference model loaded by the training loop itself: with ``max_lag`` the push used to
    wait for it for ever (only the blocked thread could load it). It raises at once naming
    it; ``report_loaded=False`` keeps such a receiver out of ``max_lag``."""
    with dbsync.Sender(root, max_lag=1) as sender:
        sender.push({"w": torch.ones(2)})
        with dbsync.Receiver(root, reader_id="reference") as reference:
            reference.load(lambda pairs: None)
            assert [sender.push({"w": torch.ones(2)}) for _ in range(2)] == [2, 3]
            started = time.monotonic()
            with pytest.raises(dbsync.StalenessError, match="reference of this process is 2 "
                               "versions behind.*report_loaded=False"):
                sender.push({"w": torch.ones(2)})
            assert time.monotonic() - started < 5
            assert reference.latest_version() == 3
        with dbsync.Receiver(root, report_loaded=False) as quiet:
            quiet.load(lambda pairs: None)
            assert [sender.push({"w": torch.ones(2)}) for _ in range(3)] == [4, 5, 6]


def test_a_receiver_of_another_store_format_is_named_and_not_waited_for(root, caplog):
    """A reader of another release's store format (a fleet half upgraded) can never load this
    store: ``max_lag`` waited for it until its timeout and `dbsync status` showed it as an
    ordinary slow reader. Leases say which format their reader reads (``reads_format``)."""
    import logging

    from dbsync.leases import host_identity
    from dbsync.store import Store

    with dbsync.Sender(root, max_lag=0, max_lag_timeout=20) as sender:
        sender.push({"w": torch.ones(2)})
        with dbsync.Receiver(root, reader_id="engine") as engine:
            engine.load(lambda pairs: None)
            assert Store(root).read_lease("engine")["reads_format"] == dbsync.FORMAT_VERSION
        older = {"reader_id": "old-engine", **host_identity(), "pid": os.getpid(),
                 "lease_timeout": 30.0, "state": "idle", "slot": None, "version": None,
                 "held": [], "loaded_version": 1, "loaded_run_id": None, "loaded_at": None,
                 "refused": None, "beat": 1, "updated_at": time.time(),
                 "reads_format": dbsync.FORMAT_VERSION + 1}
        Store(root).write_lease("old-engine", older)
        sender.push({"w": torch.ones(2)})
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="dbsync"):
            assert sender.push({"w": torch.ones(2)}) == 3  # (1 behind, max_lag=0)
        assert time.monotonic() - started < 10
        assert "not waiting for receiver old-engine, which reads store format" in caplog.text
        status = subprocess.run([sys.executable, "-m", "dbsync", "status", root, "--json"],
                                capture_output=True, text=True, timeout=120)
        rx = {r["id"]: r for r in json.loads(status.stdout)["receivers"]}
        assert "upgrade dbsync on its host" in rx["old-engine"]["reason"], rx
