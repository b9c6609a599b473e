"""Mounts for the fleet tests: a small tmpfs (a disk that fills up) and read-only views of a
store (a bind mount remounted ro, or a bindfs FUSE view). Need root; ``needs_root`` skips
tests elsewhere, saying why."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None,
    reason="needs root and util-linux (unshare, mount) to make namespaces and mounts; CI runs "
           "as root",
)


@contextlib.contextmanager
def tmpfs(path: Any, size: str, options: str = "") -> Iterator[str]:
    """A small filesystem of its own (``size`` like "4m"; ``options`` more mount options, like
    "nr_inodes=40"): a disk that can fill up."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    more = f",{options}" if options else ""
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755{more}", "tmpfs",
                    path], check=True)
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


@contextlib.contextmanager
def ext4_that_fails(path: Any, size: str = "64M") -> Iterator[Callable[[], None]]:
    """A small ext4 on a loop device mounted at ``path`` with ``errors=remount-ro``; yields
    the call that makes the kernel take it for damaged, so it turns read-only at once, files
    open or not (as a disk error does). Skips where no loop device or mkfs.ext4 is at hand."""
    path = str(path)
    image = path + ".img"
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 (e2fsprogs) for an ext4 that fails")
    os.makedirs(path, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(_bytes(size))
    subprocess.run(["mkfs.ext4", "-q", image], check=True)
    mounted = subprocess.run(["mount", "-o", "loop,errors=remount-ro", image, path],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        os.unlink(image)
        pytest.skip(f"no loop device to mount an ext4 image ({mounted.stderr.strip()})")
    try:
        source = subprocess.run(["findmnt", "-no", "SOURCE", path], capture_output=True,
                                text=True, check=True).stdout.strip()
        trigger = f"/sys/fs/ext4/{os.path.basename(source)}/trigger_fs_error"

        def fail() -> None:
            with open(trigger, "w") as f:
                f.write("dbsync test")

        yield fail
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        os.unlink(image)


def _bytes(size: str) -> int:
    return int(size[:-1]) << {"K": 10, "M": 20, "G": 30}[size[-1].upper()]


class FuseView:
    """A read-write bindfs (FUSE) view of ``base`` at ``view`` whose daemon can be killed
    (``kill``: its connection dies, ENOTCONN, as when a FUSE daemon or NFS client crashes)
    and mounted again (``mount`` once more). ``options``: more bindfs/FUSE options (``-o``)."""

    def __init__(self, base: Any, view: Any, options: str = ""):
        if shutil.which("bindfs") is None or not os.path.exists("/dev/fuse"):
            pytest.skip("bindfs/FUSE not available here (.ci/run installs it)")
        self.base, self.view = str(base), str(view)
        self.options = ["-o", options] if options else []
        os.makedirs(self.view, exist_ok=True)
        self._daemon: subprocess.Popen | None = None

    def mount(self) -> str:
        # -f: the daemon stays our child (killable); mounted once findmnt lists it
        self._daemon = subprocess.Popen(["bindfs", "-f", *self.options, self.base,
                                         self.view])
        for _ in range(500):
            if subprocess.run(["findmnt", "-n", self.view], capture_output=True).returncode == 0:
                return self.view
            if self._daemon.poll() is not None:
                break
            threading.Event().wait(0.01)  # (a bounded pause between looks)
        raise RuntimeError(f"bindfs did not mount {self.view}")

    def kill(self) -> None:
        assert self._daemon is not None
        self._daemon.kill()
        self._daemon.wait()
        subprocess.run(["umount", "-l", self.view], check=False)

    def close(self) -> None:
        if self._daemon is not None and self._daemon.poll() is None:
            subprocess.run(["umount", "-l", self.view], check=False)
            self._daemon.kill()
            self._daemon.wait()
