"""Stores shared between accounts, as clusters run them: trainers and engines under different
uids (Kubernetes ``runAsUser``, systemd ``User=``), group-shared directories, a trainer
restarted under another account of its group. Every process here is a real one running as
another uid (``setpriv``)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

import dbsync

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP = 54400
TRAINER_A, TRAINER_B, ENGINE, OUTSIDER = 54401, 54402, 54403, 54404


def as_user(uid: int, groups: list[int], script: str, *args: str) -> dict:
    """Run ``script`` (its last line prints one JSON object) as ``uid`` with ``groups``."""
    group_flags = ([f"--groups={','.join(map(str, groups))}"] if groups
                   else ["--clear-groups"])
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", *group_flags, sys.executable, "-c",
           textwrap.dedent(script), *args]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOME="/tmp")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


@pytest.fixture
def shared_base():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run processes as other users")
    probe = subprocess.run(["setpriv", f"--reuid={OUTSIDER}", f"--regid={OUTSIDER}",
                            "--clear-groups", sys.executable, "-c", "import sys; "
                            "sys.path.insert(0, sys.argv[1]); import dbsync", REPO],
                           capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip("this checkout or its Python cannot be read by another user")
    base = tempfile.mkdtemp(prefix="dbsync-accounts-")  # (pytest's own is root's alone)
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


PUSH = """
    import json, sys, torch, dbsync
    root, value = sys.argv[1], float(sys.argv[2])
    with dbsync.Sender(root) as sender:
        version = sender.push({"w": torch.full((1000,), value), "b": torch.full((3,), value)})
    print(json.dumps({"version": version}))
"""

LOAD = """
    import json, os, sys, dbsync
    root = sys.argv[1]
    got = {}
    with dbsync.Receiver(root, reader_id=sys.argv[2]) as rx:
        version = rx.load(lambda pairs: got.update({n: t[0].item() for n, t in pairs}))
        lease = os.path.join(root, "readers", sys.argv[2] + ".json")
        print(json.dumps({"version": version, "values": got, "problem": rx.store_problem(),
                          "lease_owner": os.stat(lease).st_uid if os.path.exists(lease)
                          else None}))
"""


def test_a_group_shared_store_is_continued_by_every_member_of_the_group(shared_base):
    """A team directory (setgid, group-writable): a trainer restarted under another account
    of the group continued the store only until the first account's 0644 files and 0755
    directories stood in its way ("Operation not permitted", "not writable here" blaming
    ROOT, pushes failing every other time). Now what dbsync creates there is 2775 / 0664:
    members push in turn, and an engine of the group leases."""
    team = os.path.join(shared_base, "team")
    os.mkdir(team)
    os.chown(team, 0, GROUP)
    os.chmod(team, 0o2775)
    root = os.path.join(team, "runs", "policy")  # (its parents are created too)
    for version, trainer in enumerate((TRAINER_A, TRAINER_B, TRAINER_A, TRAINER_B), start=1):
        out = as_user(trainer, [GROUP], PUSH, root, str(version))
        assert out["version"] == version, out
    read = as_user(ENGINE, [GROUP], LOAD, root, "engine-0")
    assert read["version"] == 4 and read["values"] == {"w": 4.0, "b": 4.0}, read
    assert read["problem"] is None and read["lease_owner"] == ENGINE, read
    for where, _dirs, files in os.walk(os.path.join(team, "runs")):
        assert stat.S_IMODE(os.stat(where).st_mode) == 0o2775, where
        assert os.stat(where).st_gid == GROUP, where
        for name in files:
            path = os.path.join(where, name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o664, path


def test_an_engine_of_another_account_says_it_cannot_lease_and_how_to_let_it(shared_base):
    """An engine running as another user than the trainer's: ``readers/`` is 0755, so it
    loads without a lease. That was said at INFO, as for a read-only mount, and
    ``store_problem()`` (serve-vllm's ``dbsync_store_ok``) said all was well while the
    trainer's ``--wait-for`` timed out. Now it warns with owners, modes and the command; after
    that command (``chmod 1777 readers``) it leases."""
    root = os.path.join(shared_base, "store")
    with dbsync.Sender(root) as sender:
        sender.push({"w": torch.full((1000,), 1.0), "b": torch.full((3,), 1.0)})
        denied = as_user(OUTSIDER, [], LOAD, root, "engine-0")
        assert denied["version"] == 1 and denied["values"] == {"w": 1.0, "b": 1.0}
        assert denied["lease_owner"] is None
        assert "may not write its lease" in denied["problem"], denied
        readers = os.path.join(root, "readers")
        assert "WARNING" in denied["stderr"] or "may not write its lease" in denied["stderr"]
        assert f"chmod 1777 {readers}" in denied["stderr"], denied["stderr"]
        assert f"uid {OUTSIDER}" in denied["stderr"]
        os.chmod(readers, 0o1777)
        leased = as_user(OUTSIDER, [], LOAD, root, "engine-0")
        assert leased["problem"] is None and leased["lease_owner"] == OUTSIDER, leased
        assert sender.push({"w": torch.full((1000,), 2.0), "b": torch.full((3,), 2.0)}) == 2
    assert stat.S_IMODE(os.stat(readers).st_mode) == 0o1777  # (never reset by a writer)


def test_a_file_in_readers_the_trainer_may_not_read_does_not_stall_its_pushes(shared_base):
    """``readers/`` is 1777 (as DEPLOY.md advises for engines of other accounts), and another
    account leaves ``readers/x.json`` there with mode 0600. The trainer could not read it and
    counted it as an unreadable lease holding every slot for up to an hour: every push (and
    every new ``dbsync push``) waited. Every lease dbsync writes is readable by all, so a
    file the trainer may not read by its mode is no lease: it is named in a WARNING and
    ignored, and the pushes go on."""
    root = os.path.join(shared_base, "store")
    os.makedirs(os.path.join(root, "readers"))
    os.chmod(root, 0o777)
    os.chmod(os.path.join(root, "readers"), 0o1777)
    stray = os.path.join(root, "readers", "x.json")
    with open(stray, "w") as f:
        f.write('{"reader_id": "x"}')
    os.chown(stray, OUTSIDER, OUTSIDER)
    os.chmod(stray, 0o600)
    pushes = """
        import json, sys, time, torch, dbsync
        root = sys.argv[1]
        started = time.monotonic()
        with dbsync.Sender(root, reader_timeout=60) as sender:
            versions = [sender.push({"w": torch.full((10,), float(v))}) for v in (1, 2, 3)]
        print(json.dumps({"versions": versions, "seconds": time.monotonic() - started}))
    """
    out = as_user(TRAINER_A, [], pushes, root)
    assert out["versions"] == [1, 2, 3] and out["seconds"] < 30, out
    assert "ignoring" in out["stderr"] and "x.json: not a reader's lease" in out["stderr"]
    assert "mode 0600" in out["stderr"], out["stderr"]
    assert os.path.exists(stray)  # (not the trainer's to remove: only named)
