"""How much more memory this process may take before its memory cgroup's limit (a container's
``--memory``, Kubernetes ``limits.memory``, systemd ``MemoryMax=``): at that limit the kernel
kills the process (exit 137), it never sees an allocation fail. So work that needs a large
private copy (a leaseless load, a background push's staging buffer) checks first and raises
``ResourceLimitError`` saying what it needs and what is left.

The room counts page cache the kernel can drop (files read, not ``tmpfs``) and the swap the
cgroup may still use as free, so it errs on the side of going on: a refusal means the copy
cannot fit even then. Where no limit binds (no cgroup, no limit set, unreadable files)
nothing is refused. A cgroup path this process cannot see (cgroup v1 without a cgroup
namespace: ``/proc/self/cgroup`` names the host's path, while ``/sys/fs/cgroup/memory`` is
the container's own cgroup) is read at the controller's mount root. Torch-free."""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

from .errors import ResourceLimitError

_CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60  # (cgroup v1 says "no limit" with a number near 2**63)


class Room(NamedTuple):
    #: bytes this process may still take
    free: int
    #: the limit that binds
    limit: int
    #: the cgroup directory that sets it
    where: str


def room(proc_cgroup: str = "/proc/self/cgroup", root: str = _CGROUP_ROOT,
         meminfo: str = "/proc/meminfo") -> Room | None:
    """The memory cgroup room of this process (None where no limit binds or it cannot be
    read). ``proc_cgroup``, ``root`` and ``meminfo`` are for tests."""
    found = _cgroup_room(proc_cgroup, root)
    if found is None:
        return None
    swap = _host_swap_free(meminfo)
    if swap:
        found = found._replace(free=found.free + min(swap, _cgroup_swap_room(found.where)))
    return found


def _cgroup_room(proc_cgroup: str, root: str) -> Room | None:
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:  # cgroup v1: "N:memory:/path" (possibly among other controllers)
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            mount = os.path.join(root, "memory")
            where = os.path.join(mount, path.lstrip("/"))
            return _v1_room(where if os.path.isdir(where) else mount, mount)
    for line in lines:  # cgroup v2: "0::/path"
        if line.startswith("0::"):
            return _v2_room(root, line[3:])
    return None


def check_room(nbytes: int, doing: str, outcome: str) -> None:
    """Raise ``ResourceLimitError`` if ``nbytes`` more would pass the memory cgroup's limit
    (``doing``: what needs them; ``outcome``: what happened and what else to do)."""
    found = room()
    if found is None or nbytes <= found.free:
        return
    raise ResourceLimitError(
        f"{doing} needs {_mib(nbytes)} of memory, and this process's memory limit "
        f"({_mib(found.limit)}, set by the cgroup {found.where}: a container's --memory, "
        f"Kubernetes limits.memory, systemd MemoryMax=) leaves {_mib(found.free)}: past it the "
        f"kernel kills the process. {outcome}; or raise the limit by at least "
        f"{_mib(nbytes - found.free)}", errno.ENOMEM)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # ("max": no limit)


def _stat(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(os.path.join(path, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


def _v1_room(path: str, mount: str) -> Room | None:
    """The tightest limit from ``path`` up to ``mount``, each level's against its own usage
    (a parent's limit binds the use of all its children: a slice, a pod)."""
    best: Room | None = None
    where = path
    while True:
        stat = _stat(where)
        limit = _read_int(os.path.join(where, "memory.limit_in_bytes"))
        usage = _read_int(os.path.join(where, "memory.usage_in_bytes"))
        if where == path and stat.get("hierarchical_memory_limit") is not None and (
                limit is None or limit >= _NO_LIMIT):
            # (the limit of a parent not visible here, e.g. above a container's mount: only
            # this level's usage can be set against it)
            limit = stat["hierarchical_memory_limit"]
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            best = _tighter(best, limit, usage,
                            stat.get("total_cache", 0) - stat.get("total_shmem", 0), where)
        if os.path.normpath(where) == os.path.normpath(mount):
            return best
        parent = os.path.dirname(where)
        if parent == where:
            return best
        where = parent


def _host_swap_free(meminfo: str) -> int:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("SwapFree:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_swap_room(where: str) -> int:
    """The swap the cgroup at ``where`` may still use (v2 ``memory.swap.max`` less its use;
    v1 ``memsw`` less ``memory``), unbounded (a large number) where no swap limit is set."""
    limit = _read_int(os.path.join(where, "memory.swap.max"))
    if limit is not None:
        used = _read_int(os.path.join(where, "memory.swap.current")) or 0
        return max(0, limit - used)
    both = _read_int(os.path.join(where, "memory.memsw.limit_in_bytes"))
    memory = _read_int(os.path.join(where, "memory.limit_in_bytes"))
    if both is not None and memory is not None and both < _NO_LIMIT:
        used = ((_read_int(os.path.join(where, "memory.memsw.usage_in_bytes")) or 0)
                - (_read_int(os.path.join(where, "memory.usage_in_bytes")) or 0))
        return max(0, both - memory - used)
    if os.path.exists(os.path.join(where, "memory.swap.max")):  # ("max": no swap limit)
        return _NO_LIMIT
    return _NO_LIMIT if both is None or both >= _NO_LIMIT else 0


def _v2_room(root: str, path: str) -> Room | None:
    """The tightest limit from the process's cgroup up to the root (each level's own)."""
    best: Room | None = None
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        where = os.path.join(root, *parts[:depth])
        limit = _read_int(os.path.join(where, "memory.max"))
        usage = _read_int(os.path.join(where, "memory.current"))
        if limit is None or usage is None:
            continue
        stat = _stat(where)
        best = _tighter(best, limit, usage, stat.get("file", 0) - stat.get("shmem", 0), where)
    return best


def _tighter(best: Room | None, limit: int, usage: int, droppable: int, where: str
             ) -> Room:
    """``best`` or the room of one level (``limit`` against ``usage`` less the page cache
    the kernel can drop), whichever leaves less."""
    level = Room(max(0, limit - max(0, usage - droppable)), limit, where)
    return level if best is None or level.free < best.free else best
