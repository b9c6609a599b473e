"""Start-up time of the ``dbsync`` command, against the interpreter's own start-up.

    python bench/bench_startup.py [--runs 7] [--json OUT]

Wall time (best and median of ``--runs``) of ``dbsync --help``, ``dbsync status ROOT --json``
and ``dbsync watch ROOT --count 1`` on a one-version store, each against ``python -c pass``
and ``python -c "import click"`` (the floor any click command pays), and whether torch was
imported (``python -X importtime``).

Hazard: a busy machine stretches every number alike; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout: python bench/bench_startup.py
    sys.path.insert(0, str(REPO))


def timed(argv: list[str], runs: int, env: dict[str, str]) -> dict[str, float]:
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                       cwd=REPO, check=True, timeout=120)
        walls.append(time.perf_counter() - t0)
    return {"best_s": round(min(walls), 3), "median_s": round(statistics.median(walls), 3)}


def imports_torch(argv: list[str], env: dict[str, str]) -> bool:
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in proc.stderr.splitlines())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json", default=str(REPO / "bench/results/startup_cpu2.json"))
    args = p.parse_args()
    import torch

    import dbsync

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="dbsync-startup-") as work:
        root = os.path.join(work, "store")
        with dbsync.Sender(root, durable=False) as sender:
            sender.push({"w": torch.zeros(16)})
        commands = {
            "python -c pass": [py, "-c", "pass"],
            "python -c 'import click'": [py, "-c", "import click"],
            "dbsync --help": [py, "-m", "cli.main", "--help"],
            "dbsync status ROOT --json": [py, "-m", "cli.main", "status", root, "--json"],
            "dbsync watch ROOT --count 1": [py, "-m", "cli.main", "watch", root, "--count",
                                            "1"],
        }
        results = {}
        for name, argv in commands.items():
            results[name] = {**timed(argv, args.runs, env),
                             "imports_torch": imports_torch(argv, env)}
            print(f"{name:30s} {results[name]}", flush=True)
    machine = (f"{socket.gethostname()}: {os.cpu_count()} cores, {platform.machine()}, "
               f"{platform.platform()}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "runs": args.runs, "results": results}, f, indent=1)
        f.write("\n")
    print(f"machine: {machine}\nwrote {args.json}")


if __name__ == "__main__":
    main()
