"""Mounts for the fleet tests: a small tmpfs (a disk that fills up) and read-only views of a
store (a bind mount remounted ro, or a bindfs FUSE view). Need root; ``needs_root`` skips
tests elsewhere, saying why."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None,
    reason="needs root and util-linux (unshare, mount) to make namespaces and mounts; CI runs "
           "as root",
)


@contextlib.contextmanager
def tmpfs(path: Any, size: str) -> Iterator[str]:
    """A small filesystem of its own (``size`` like "4m"): a disk that can fill up."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@contextlib.contextmanager
def read_only_view(base: Any, view: Any, how: str = "bind") -> Iterator[str]:
    """What a pod given the store read-only sees: ``mount --bind`` + ``remount,ro`` (a
    read-only volume), or ``bindfs -o ro`` (a FUSE view: no inotify events for changes made
    in ``base``, as on NFS from another host)."""
    os.makedirs(view, exist_ok=True)
    if how == "bindfs":
        if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse"):
            pytest.skip("bindfs/FUSE not available here (.ci/run installs it)")
        subprocess.run(["bindfs", "-o", "ro", str(base), str(view)], check=True)
    else:
        subprocess.run(["mount", "--bind", str(base), str(view)], check=True)
    try:
        if how != "bindfs":
            subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
        yield str(view)
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)
