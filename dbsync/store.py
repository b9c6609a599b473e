"""Store: the only code that knows where files live under a dbsync root.

    ROOT/dbsync.json                 the manifest: which version is current and where it lives
    ROOT/slots/{a,b}/                two reusable slots, each a tensordict memmap directory
    ROOT/slots/X/dbsync-slot.json    the slot stamp: which version the slot holds (or "writing")
    ROOT/readers/<reader_id>.json    one lease file per receiver
    ROOT/writer.lock                 flock'ed by the single writer

Hazards:
- ``flock`` succeeds silently on some NFS, Lustre and GPFS setups without excluding anyone.
  Run one Sender per store; the lock only catches mistakes where locks work.
- On NFS, directory listings are attribute-cached: a receiver that registers (creates its lease
  file) moments before a writer lists ``readers/`` may be missed for up to ``acdirmax``.
  Receivers therefore register when constructed, long before they read, and the slot stamp
  check after every read catches the remaining window.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from typing import Any

from . import fileio
from .errors import FormatError, NothingPublishedError, StoreBusyError
from .format import (
    FILE_SUFFIX,
    MANIFEST_FILE,
    READERS_DIR,
    SLOT_STAMP_FILE,
    SLOTS,
    SLOTS_DIR,
    TENSORDICT_META_FILE,
    WRITER_LOCK_FILE,
    Manifest,
    check_reader_id,
)

WRITING = "writing"


class Store:
    """Paths and small atomic records under one dbsync root."""

    def __init__(self, root: str | os.PathLike[str], create: bool = False):
        self.root = os.path.abspath(os.fspath(root))
        if create:
            for d in (self.root, self.readers_dir, *(self.slot_dir(s) for s in SLOTS)):
                os.makedirs(d, exist_ok=True)
        elif not os.path.isdir(self.root):
            raise NothingPublishedError(
                f"{self.root} does not exist; nothing has been published there yet "
                "(create it with a Sender, or check the path and mount)"
            )

    # ---- paths -------------------------------------------------------------------------
    @property
    def manifest_path(self) -> str:
        return os.path.join(self.root, MANIFEST_FILE)

    @property
    def readers_dir(self) -> str:
        return os.path.join(self.root, READERS_DIR)

    def slot_dir(self, slot: str) -> str:
        if slot not in SLOTS:
            raise FormatError(f"unknown slot {slot!r}")
        return os.path.join(self.root, SLOTS_DIR, slot)

    def tensor_path(self, slot: str, file: str) -> str:
        """Path of one tensor file. ``file`` must already be validated by ``Manifest``; this
        re-checks that it stays inside the slot (defence in depth)."""
        directory = self.slot_dir(slot)
        path = os.path.join(directory, file)
        if os.path.dirname(path) != directory or not file.endswith(FILE_SUFFIX):
            raise FormatError(f"file name {file!r} would leave slot {slot}; refusing")
        return path

    def lease_path(self, reader_id: str) -> str:
        return os.path.join(self.readers_dir, check_reader_id(reader_id) + ".json")

    # ---- manifest ----------------------------------------------------------------------
    def read_manifest(self) -> Manifest | None:
        """The current manifest, read from a fresh open (NFS close-to-open revalidates)."""
        try:
            with open(self.manifest_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        return Manifest.loads(raw, source=self.manifest_path)

    def require_manifest(self) -> Manifest:
        manifest = self.read_manifest()
        if manifest is None:
            raise NothingPublishedError(
                f"no version has been published in {self.root} yet; push one first "
                "(dbsync push SRC ROOT, or Sender(ROOT).push(weights))"
            )
        return manifest

    def publish_manifest(self, manifest: Manifest, durable: bool) -> None:
        """The flip: atomically replace the manifest. Call only once the slot is complete
        (and durable, when ``durable``)."""
        fileio.write_atomic(self.manifest_path, manifest.dumps(), durable=durable)

    # ---- slots -------------------------------------------------------------------------
    def read_stamp(self, slot: str) -> int | str | None:
        try:
            with open(os.path.join(self.slot_dir(slot), SLOT_STAMP_FILE), "rb") as f:
                value = json.loads(f.read()).get("version")
        except (FileNotFoundError, ValueError, AttributeError):
            return None
        return value

    def write_stamp(self, slot: str, version: int | str, durable: bool,
                    sync_dir: bool = True) -> None:
        path = os.path.join(self.slot_dir(slot), SLOT_STAMP_FILE)
        fileio.write_atomic(path, json.dumps({"version": version}).encode(), durable=durable,
                            sync_dir=sync_dir)

    def sync_slot(self, slot: str) -> None:
        """fsync the slot directory (makes replaces and unlinks inside it durable)."""
        fileio.fsync_dir(self.slot_dir(slot))

    def write_tensordict_meta(self, manifest: Manifest, durable: bool,
                              sync_dir: bool = True) -> None:
        """Write tensordict's ``meta.json`` so ``TensorDict.load_memmap(slot_dir)`` opens the
        slot (keys are the file stems; the manifest maps them back to tensor names)."""
        meta: dict[str, Any] = {
            t.file[: -len(FILE_SUFFIX)]: {
                "device": "cpu",
                "shape": list(t.shape),
                "dtype": f"torch.{t.dtype}",
                "is_nested": False,
            }
            for t in manifest.tensors
        }
        meta.update({
            "shape": [],
            "device": "cpu",
            "_type": "<class 'tensordict._td.TensorDict'>",
            "_format_version": 1,
            "_class": "tensordict:TensorDict",
        })
        path = os.path.join(self.slot_dir(manifest.slot), TENSORDICT_META_FILE)
        fileio.write_atomic(path, json.dumps(meta).encode(), durable=durable,
                            sync_dir=sync_dir)

    def remove_unlisted_files(self, slot: str, keep: set[str]) -> None:
        directory = self.slot_dir(slot)
        for entry in os.scandir(directory):
            if entry.name.endswith(FILE_SUFFIX) and entry.name not in keep:
                os.unlink(entry.path)

    def remove_temp_files(self) -> None:
        """Remove temp files a killed writer left behind (they are never referenced)."""
        for directory in (self.root, self.readers_dir, *(self.slot_dir(s) for s in SLOTS)):
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.name.startswith(".tmp-"):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass

    # ---- writer lock -------------------------------------------------------------------
    def lock_writer(self) -> int:
        """Take the writer lock (non-blocking). Returns the fd; pass it to ``unlock_writer``."""
        fd = os.open(os.path.join(self.root, WRITER_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusyError(
                f"another writer holds {self.root}/{WRITER_LOCK_FILE}; only one Sender may "
                "publish into a store at a time (stop the other one, or use another root)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        return fd

    @staticmethod
    def unlock_writer(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    # ---- reader leases -----------------------------------------------------------------
    def write_lease(self, reader_id: str, record: dict[str, Any]) -> None:
        # Not fsynced: a lease is only meaningful while its reader lives.
        fileio.write_atomic(self.lease_path(reader_id), json.dumps(record).encode(),
                            durable=False)

    def remove_lease(self, reader_id: str) -> None:
        try:
            os.unlink(self.lease_path(reader_id))
        except FileNotFoundError:
            pass

    def read_leases(self) -> dict[str, dict[str, Any]]:
        leases: dict[str, dict[str, Any]] = {}
        try:
            entries = list(os.scandir(self.readers_dir))
        except FileNotFoundError:
            return leases
        for entry in entries:
            if not entry.name.endswith(".json") or entry.name.startswith("."):
                continue
            try:
                with open(entry.path, "rb") as f:
                    record = json.loads(f.read())
            except (FileNotFoundError, ValueError):
                continue  # removed or being replaced right now: the next look sees it
            if isinstance(record, dict):
                leases[entry.name[: -len(".json")]] = record
        return leases
