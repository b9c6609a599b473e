"""Whether the files a push reads its weights from were rewritten while it read them.

A path pushed (a ``.safetensors`` or ``.pt`` file, a checkpoint or tensordict directory) is
memory-mapped, not copied: its bytes are read while the shards are written, long after the
tensors were checked. A file rewritten in place meanwhile (``torch.save`` or
``save_file`` to the same path truncates and rewrites the same file) shows through the
mapping, so a version could mix the old file's tensors and the new one's, each with a
matching checksum. The push looks at its files again before its flip and refuses when one
changed.

Hazards, stated plainly:
- A file replaced by a new one (written elsewhere, then renamed over the path, the safe way
  to save) is not a change here: the mapping keeps the old file's bytes, whole.
- A rewrite that keeps both the size and the modification time (to the nanosecond) is not
  seen. A rewrite that shrinks the file while it is being read can still end the process
  with SIGBUS ("Bus error") before any check: the kernel's answer to a read of a mapped
  page that no longer exists. Save checkpoints to a temporary name and rename them.
Torch-free.
"""

from __future__ import annotations

import os
import stat

#: files looked at in a directory pushed (a tensordict of tens of thousands of memory maps
#: is looked at whole; beyond this, files past the first are not)
MAX_FILES = 200_000

_State = tuple[int, int, int, int]  # (device, inode, size, modification time in ns)


class SourceFiles:
    """The states of the regular files under a pushed path, taken before it is read."""

    def __init__(self, path: str):
        self.path = path
        self.states = _states(path)

    def changed(self) -> list[str]:
        """The files (relative to the path pushed) rewritten in place since: the same file,
        another size or modification time. Files removed or replaced by others are not."""
        now = _states(self.path)
        out = []
        for name, (dev, ino, size, mtime) in self.states.items():
            seen = now.get(name)
            if seen is not None and seen[:2] == (dev, ino) and seen[2:] != (size, mtime):
                out.append(name)
        return sorted(out)


def _states(path: str) -> dict[str, _State]:
    states: dict[str, _State] = {}
    try:
        st = os.stat(path)
    except OSError:
        return states
    if stat.S_ISREG(st.st_mode):
        states[os.path.basename(path)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return states
    if not stat.S_ISDIR(st.st_mode):
        return states
    for where, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            if len(states) >= MAX_FILES:
                return states
            full = os.path.join(where, name)
            try:
                st = os.stat(full, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                states[os.path.relpath(full, path)] = (st.st_dev, st.st_ino, st.st_size,
                                                       st.st_mtime_ns)
    return states
