"""Processes for tests/test_fleet.py: readers and writers that run in their own PID (and UTS)
namespaces, hold slots, loop loads, publish with restarting Senders. Not a test module.

Every version v holds tensors whose every element tells v (tests/_workers.py), so a load's
values alone tell whether it applied exactly one version. Results are JSON files; readiness
is a file the test waits for (no sleeps order events)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _write_json(path: str, record: object) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _wait_for_version(receiver: object) -> None:
    deadline = time.monotonic() + 30
    while receiver.latest_version() is None:  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise SystemExit("nothing was published within 30 s")
        time.sleep(0.01)


def namespaced(hostname: str, pid: str, *worker: str) -> None:
    """Run as PID 1 of a fresh PID namespace (``unshare --pid --fork``): set the hostname
    ('-' keeps the writer's), make the worker's pid ``pid`` (a pid that does not exist in the
    writer's namespace, as a container's pids do not), run it and exit with its status.
    ``exec CMD...`` as the worker runs CMD instead. The starter's UTS namespace inode is in
    ``FLEET_HOST_UTS``: the host is never renamed by mistake."""
    if hostname != "-":
        if str(os.stat("/proc/self/ns/uts").st_ino) == os.environ.get("FLEET_HOST_UTS", ""):
            raise SystemExit("refusing to rename the host: not in a UTS namespace of its own")
        socket.sethostname(hostname)
    if pid != "-":
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(int(pid) - 1))
        except OSError as exc:
            print(f"cannot choose the pid ({exc}); using the next free one", file=sys.stderr)
    child = os.fork()
    if child == 0:
        if worker[0] == "exec":  # any command (a server), not one of the workers here
            os.execvp(worker[1], list(worker[1:]))
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *worker])
    _, status = os.waitpid(child, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


def hold(root: str, ready: str, out: str, lease: str, seconds: str) -> None:
    """Open (hold) the current version, write ``ready`` ({version, pid, host, pidns}), keep
    holding it for ``seconds`` (forever if 'forever') while the heartbeat runs, then read
    every tensor's values, check the slot was not reused, and write ``out``."""
    import dbsync

    receiver = dbsync.Receiver(root, lease_timeout=float(lease))
    snap = receiver.open()
    _write_json(ready, {"version": snap.version, "pid": os.getpid(),
                        "host": socket.gethostname(), "leased": getattr(snap, "leased", True),
                        "pidns": os.stat("/proc/self/ns/pid").st_ino})
    if seconds == "forever":
        while True:
            time.sleep(1)
    time.sleep(float(seconds))  # the hold itself: the writer must wait it out
    values = sorted({float(v) for _, t in snap.tensors() for v in t.float().unique()})
    try:
        snap.check_unchanged()
        trusted = True
    except dbsync.LeaseExpiredError:
        trusted = False
    released = time.monotonic()
    snap.close()
    receiver.close()
    _write_json(out, {"version": snap.version, "values": values, "trusted": trusted,
                      "released_at": released})


def idle(root: str, ready: str, lease: str, reader_id: str = "") -> None:
    """A registered receiver (reader id ``reader_id`` if given) that never loads (heartbeat
    only), until killed."""
    import dbsync

    receiver = dbsync.Receiver(root, reader_id=reader_id or None, lease_timeout=float(lease))
    _write_json(ready, {"reader_id": receiver.reader_id, "pid": os.getpid()})
    while True:
        time.sleep(1)


def loaded(root: str, ready: str, lease: str) -> None:
    """A receiver that loads the current version (reporting it loaded), writes ``ready``
    ({version, reader_id}), and then only beats, until killed."""
    import dbsync

    receiver = dbsync.Receiver(root, lease_timeout=float(lease))
    version = receiver.load(lambda pairs: None)
    _write_json(ready, {"version": version, "reader_id": receiver.reader_id})
    while True:
        time.sleep(1)


def reader_loop(root: str, out: str, stop: str, lease: str, min_loads: str) -> None:
    """Load again and again until ``stop`` exists (and at least ``min_loads`` loads were
    made). Per load: the version returned and the distinct values applied. Errors that say
    "load again" (the slot was reused under a leaseless read) are counted, not hidden."""
    import dbsync

    receiver = dbsync.Receiver(root, lease_timeout=float(lease))
    _wait_for_version(receiver)
    loads: list[dict[str, object]] = []
    retried = 0
    errors: list[dict[str, object]] = []
    while len(loads) < int(min_loads) or not os.path.exists(stop):
        seen: set[float] = set()

        def apply(pairs: object, seen: set[float] = seen) -> None:
            for _name, tensor in pairs:  # type: ignore[attr-defined]
                seen.update(float(v) for v in tensor.float().unique())

        try:
            version = receiver.load(apply)
        except dbsync.LeaseExpiredError as exc:
            retried += 1
            errors.append({"error": str(exc), "applied": sorted(seen)})
            continue
        loads.append({"version": version, "values": sorted(seen)})
    receiver.close()
    _write_json(out, {"loads": loads, "retried": retried, "errors": errors[:20],
                      "read_only": getattr(receiver, "read_only", None)})


def writer_loop(root: str, stop: str, per_sender: str, out: str, pause: str = "0") -> None:
    """Publish version after version (content = the version number) until ``stop`` exists,
    closing the Sender and starting a new one every ``per_sender`` pushes (a trainer that
    restarts, or `dbsync push` once per checkpoint), ``pause`` seconds between pushes."""
    import time
    sys.path.insert(0, HERE)
    from _workers import weights_for

    import dbsync

    pushed: list[int] = []
    senders = 0
    while not os.path.exists(stop):
        with dbsync.Sender(root, num_threads=2, lease_timeout=2.0) as sender:
            senders += 1
            for _ in range(int(per_sender)):
                version = (sender.latest_version() or 0) + 1
                pushed.append(sender.push(weights_for(version)))
                time.sleep(float(pause))  # (the pace of the soak, not an ordering)
    _write_json(out, {"pushed": pushed, "senders": senders})


def default_ids(root: str, out: str) -> None:
    """Open a Receiver with the default reader id, load, and write {receiver's id, a role's
    id twice, version loaded}."""
    import dbsync
    from dbsync.leases import default_reader_id

    with dbsync.Receiver(root) as receiver:
        version = receiver.load(lambda pairs: None)
        _write_json(out, {"receiver": receiver.reader_id, "version": version,
                          "role": [default_reader_id("vllm-staging") for _ in range(2)]})


if __name__ == "__main__":
    {"namespaced": namespaced, "hold": hold, "idle": idle, "loaded": loaded,
     "reader_loop": reader_loop, "writer_loop": writer_loop,
     "default_ids": default_ids}[sys.argv[1]](*sys.argv[2:])
