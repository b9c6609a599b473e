"""Broadcast on 2 GPUs against a raw bucketed torch.distributed.broadcast of the same bytes, in
the same run: ``bench_broadcast_fanout.py`` with one receiver, at 2 and 8 GiB by default, in
the default (verified) configuration: sealed buckets, each checked on the receiver's GPU.

    python bench/bench_broadcast.py [--gb 2.147 8.59] [--iters 5] [--out results.json]
        [any other bench_broadcast_fanout.py option]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_broadcast_fanout  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--gb" not in argv:
        argv = ["--gb", "2.147", "8.59", *argv]
    sys.argv = [sys.argv[0], "--gpus", "2", *argv]
    sys.exit(bench_broadcast_fanout.main())
