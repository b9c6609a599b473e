"""Store: the only code that knows where files live under a dbsync root, and the one place
that opens them.

    ROOT/dbsync.json                 the head: which version is current, of which run, where
    ROOT/slots/{a,b}/index.json      the tensors of the version a slot holds (apply order)
    ROOT/slots/X/shard-NNNNN.bin     the tensors' bytes, packed, each at an aligned offset
    ROOT/slots/X/dbsync-slot.json    the slot stamp: which version the slot holds (or "writing")
    ROOT/readers/<reader_id>.json    one lease file per receiver
    ROOT/writer.lock                 flock'ed by the single writer

Every file below ROOT is opened through ``_open_at``: each path component is opened relative
to its parent with ``O_NOFOLLOW`` (a symlink anywhere below ROOT is refused, never followed),
with ``O_NONBLOCK`` (a FIFO cannot block the open), and checked with ``fstat`` to be a regular
file (or a directory) before a byte is read. JSON records are read with a size bound. ROOT
itself may be a symlink: that is the operator's choice, not the store's content.

Hazards:
- ``flock`` succeeds silently on some NFS, Lustre and GPFS setups without excluding anyone.
  Run one Sender per store; the lock only catches mistakes where locks work.
- On NFS, directory listings are attribute-cached: a receiver that registers moments before a
  writer lists ``readers/`` may be missed for up to ``acdirmax``. Receivers register when
  constructed, long before they read, and the slot stamp check after every read catches the
  remaining window.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import xxhash

from . import fileio
from .errors import (
    DBSyncError,
    FormatError,
    InvalidArgumentError,
    NothingPublishedError,
    StoreBusyError,
    StoreFullError,
    StoreNotFoundError,
    StoreReadOnlyError,
    StoreUnreachableError,
    short_repr,
)
from .format import (
    FORMAT_NAME,
    INDEX_FILE,
    MANIFEST_FILE,
    MAX_HEAD_BYTES,
    MAX_INDEX_BYTES,
    MAX_LEASE_BYTES,
    MAX_STAMP_BYTES,
    PUBLISHED_FILE,
    READERS_DIR,
    SLOT_STAMP_FILE,
    SLOTS,
    SLOTS_DIR,
    WRITER_LOCK_FILE,
    Head,
    Index,
    Manifest,
    check_reader_id,
    loads_json,
    shard_file,
)
from .processes import host_identity, own_start, process_start, process_state

log = logging.getLogger(__name__)

#: pauses before a record (head, stamp) read cut short is read again (``Store.read_record``)
REREAD_PAUSES = (0.05, 0.25, 1.0)
#: what an NFS client renames a file to that was unlinked while its own processes held it
NFS_SILLY_PREFIX = ".nfs"
#: how often a record whose read failed with ESTALE (replaced since it was opened, as NFS
#: says it) is opened again before the error is raised
STALE_REOPENS = 3
#: pauses between the tries of a writer's read of a lease that fails (EIO, ESTALE)
LEASE_READ_PAUSES = (0.02, 0.08)

#: the names a writer gives files in a slot (shards, the index, the stamp, temp files), or gave
#: them in format 1 (one ``<stem>.memmap`` per tensor and tensordict's ``meta.json``): the only
#: files it ever removes there, and the only ones a directory it is asked to make a store of
#: may hold in its slots
_SLOT_FILE = re.compile(r"shard-[0-9]{5}\.bin|index\.json|dbsync-slot\.json|meta\.json"
                        r"|dbsync-published\.json"
                        r"|[A-Za-z0-9_][A-Za-z0-9_.\-]{0,200}\.memmap|\.tmp-.*|\.nfs.*",
                        re.DOTALL)
#: what a store's root may hold besides hidden entries
_ROOT_ENTRIES = frozenset((MANIFEST_FILE, SLOTS_DIR, READERS_DIR, WRITER_LOCK_FILE,
                           "broadcast.json", "lost+found"))

#: path -> the bytes of a record that stayed no JSON through ``Store.read_record``'s pauses
#: (process-wide: a push reads the head through more than one Store)
_GARBLED: dict[str, bytes] = {}

WRITING = "writing"
DIR_MODE = 0o755
FILE_MODE = 0o644
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def rereads() -> Iterator[int]:
    """Looks over the time a caching mount (NFS, FUSE: caches of 1 s by default) may show
    files of different moments: the first at once, one after each of ``REREAD_PAUSES``
    (1.3 s in all). For a verdict such a mount can fake until its caches expire ("damaged",
    "unreachable"): the caller stops looking as soon as a look settles it, and gives the
    verdict only after the last. Hazard: a true verdict comes that much later."""
    yield 0
    for look, pause in enumerate(REREAD_PAUSES, 1):
        time.sleep(pause)
        yield look


class _DirFd:
    """``Store.dir_fd``'s context manager (a class, not a generator: an interrupt inside a
    generator-based one's entry leaves its descriptor open until the garbage collector runs)."""

    __slots__ = ("_store", "_parts", "_fd")

    def __init__(self, store: Store, parts: tuple[str, ...]):
        self._store, self._parts, self._fd = store, parts, -1

    def __enter__(self) -> int:
        self._fd = self._store._open_dir(self._parts)
        return self._fd

    def __exit__(self, *exc: object) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def check_root_path(root: object) -> None:
    """``InvalidArgumentError`` unless ``root`` can name a directory (a str, bytes or path
    object without NUL)."""
    if not isinstance(root, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(f"the store path must be a str or a path object, not "
                                   f"{type(root).__name__} ({short_repr(root)})")
    if "\0" in os.fsdecode(root):
        raise InvalidArgumentError(f"the store path {short_repr(os.fsdecode(root))} holds a "
                                   "NUL character; no file can be named so")


class Store:
    """Paths, safe opens and small atomic records under one dbsync root."""

    def __init__(self, root: str | os.PathLike[str], create: bool = False):
        check_root_path(root)
        if not os.fspath(root):  # ("" would be the current directory: an unset variable?)
            raise StoreNotFoundError("the store path is empty (an unset variable?); give the "
                                     "path of the store directory")
        self.root = os.path.abspath(os.fsdecode(root))  # (a bytes path too)
        self._parsed: dict[str, Index] = {}  # index checksum -> parsed index (the last two)
        #: an fd of the directory ROOT named when ``pin`` was called (None: ROOT is looked up
        #: by its path at each operation)
        self._pinned: int | None = None

        if create:
            self._refuse_foreign_directory()
            try:
                self._create_layout()
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise self.full_error(exc.errno, "the store's directories cannot be "
                                      "created") from None
        else:
            error = root_error(self.root)
            if error is not None:
                raise error

    def what_ran_out(self, code: int) -> tuple[str, str]:
        """(what ran out, what to do) for an ENOSPC or EDQUOT: space, or files (inodes:
        ``df -h`` then shows space left), or this user's quota."""
        root = self.root
        if code == errno.EDQUOT:
            return (f"this user's disk quota on the filesystem of {root} is exhausted",
                    "Free space within the quota (or raise it)")
        try:
            st = os.statvfs(root if os.path.isdir(root) else os.path.dirname(root))
            out_of_files = st.f_files > 0 and st.f_favail == 0 and st.f_bavail > 0
        except OSError:
            out_of_files = False
        if out_of_files:
            return (f"no free inodes left on the filesystem of {root} (it has free space; "
                    "`df -i` shows inodes)", "Remove files there")
        return f"no space left on the filesystem of {root}", "Free space there" + HELD_SPACE

    def full_error(self, code: int, what_failed: str) -> StoreFullError:
        """A ``StoreFullError`` for an ENOSPC or EDQUOT met while ``what_failed``."""
        what, todo = self.what_ran_out(code)
        return StoreFullError(f"{what}: {what_failed}; nothing was published. {todo}, then "
                              "push again", code)

    def _refuse_foreign_directory(self) -> None:
        """Refuse to make a store of a directory that holds other files (a checkpoint
        directory given as ROOT, SRC and ROOT swapped, a directory that only has a ``slots``
        or a ``dbsync.json`` of something else): a push would mix the store's files with
        them, and reuse its slots. A directory whose head is a dbsync head is a store (other
        files beside it are never touched). One without such a head (empty, damaged, or never
        published) may hold only what dbsync writes: the store's entries, slot files of
        dbsync's names, a mount's ``lost+found`` and hidden entries."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return  # created below (or refused there, saying why)
        if MANIFEST_FILE in names and self._holds_a_dbsync_head():
            return
        # (readers/ alone proves nothing: a receiver creates it wherever it is pointed)
        foreign = sorted(n for n in names if not n.startswith(".") and n not in _ROOT_ENTRIES)
        if SLOTS_DIR in names:
            foreign += self._foreign_slot_entries()
        if MANIFEST_FILE in names and SLOTS_DIR not in names and WRITER_LOCK_FILE not in names:
            foreign.append(f"{MANIFEST_FILE} (not a dbsync head)")
        if foreign:
            shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise FormatError(
                f"{self.root} is not a dbsync store but holds other files ({shown}); a push "
                "would mix a store's files with them (and reuse its slots). Give an empty or "
                "new directory, or the root of an existing store (is SRC given as ROOT?)")

    def _holds_a_dbsync_head(self) -> bool:
        """Whether the root's ``dbsync.json`` says it is a dbsync head (of any format version:
        a version this dbsync cannot read is refused later, saying so)."""
        try:
            data = self.read_raw_head_json()
        except (DBSyncError, OSError):
            return False
        return data is not None and data.get("format") == FORMAT_NAME

    def _foreign_slot_entries(self) -> list[str]:
        """The entries under ``slots/`` that dbsync does not write ("slots/a/x.csv")."""
        found: list[str] = []
        try:
            with self.dir_fd(SLOTS_DIR) as dfd:
                entries = list(os.scandir(dfd))
        except (OSError, DBSyncError):
            return found  # (not a directory: the layout's creation says so)
        for entry in entries:
            if entry.name in SLOTS and entry.is_dir(follow_symlinks=False):
                try:
                    with self.dir_fd(SLOTS_DIR, entry.name) as slot_fd:
                        inside = list(os.scandir(slot_fd))
                except (OSError, DBSyncError):
                    continue
                found += [f"{SLOTS_DIR}/{entry.name}/{e.name}" for e in inside
                          if e.is_dir(follow_symlinks=False) or not _SLOT_FILE.fullmatch(e.name)]
            elif not entry.name.startswith("."):
                found.append(f"{SLOTS_DIR}/{entry.name}")
        return sorted(found)

    def _create_layout(self) -> None:
        """Create ROOT, readers/ and the slots with explicit modes (never the caller's umask).
        Existing directories are kept, but a symlink or file in their place is refused."""
        try:
            _make_parents(os.path.dirname(self.root))
        except (FileExistsError, NotADirectoryError):
            raise FormatError(
                f"{self.root} cannot be created: a part of its path is a file, not a "
                "directory; give the path of a store directory") from None
        if not os.path.isdir(self.root):  # ROOT itself may be a symlink: the operator's choice
            _mkdir(self.root)
        layout = [os.path.join(self.root, *parts) for parts in
                  ((READERS_DIR,), (SLOTS_DIR,), *((SLOTS_DIR, s) for s in SLOTS))]
        for path in layout:  # (refused before any is made: a refused push leaves nothing)
            with contextlib.suppress(OSError):
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    _mkdir(path)  # (raises, saying what stands there)
        for path in layout:
            _mkdir(path)

    def create_readers_dir(self) -> None:
        """Create ``readers/`` only (a receiver that starts before the first push needs it for
        its lease; the slots are the writer's to create)."""
        _mkdir(self.readers_dir)

    # ---- safe opening ----------------------------------------------------------------------
    def dir_fd(self, *parts: str) -> _DirFd:
        """An fd of the directory ROOT/parts, every component opened without following links
        (``with store.dir_fd("slots", "a") as dfd:``; closed when the block ends). ROOT
        missing: FileNotFoundError (what is absent reads as nothing published); ROOT there
        but not to be opened (no permission, a dead mount): ``StoreUnreachableError``."""
        return _DirFd(self, parts)

    def pin(self) -> os.stat_result:
        """From now on, open everything through the directory ROOT names now, not by its path:
        once ROOT is removed and made anew, or a symlink ROOT is re-pointed, this store's
        operations reach the old directory (or fail, where it was removed), never the new one.
        A writer pins its store before it locks it: a writer left running beside a new run
        (a restarted trainer's old process) must not write into, or free, that run's slots.
        Returns the pinned directory's stat. Hazard: holds the fd until ``unpin``."""
        fd = self._open_dir(())
        self._pinned = fd
        return os.fstat(fd)

    def unpin(self) -> None:
        """Close the pinned directory's fd (``pin``); ROOT is looked up by path again."""
        fd, self._pinned = self._pinned, None
        if fd is not None:
            os.close(fd)

    def _open_dir(self, parts: tuple[str, ...]) -> int:
        try:
            pinned = self._pinned
            fd = (os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                  if pinned is None else
                  os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pinned))
        except OSError as exc:
            if exc.errno not in UNREACHABLE_ERRNOS:
                raise  # (missing: read as nothing published; EMFILE and such: as they are)
            raise _unreachable(self.root, exc) from None
        try:
            for part in parts:
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise FormatError(
                            f"{os.path.join(self.root, *parts)} is not a plain directory (a "
                            "symlink or a file stands in its place); dbsync never follows links "
                            "inside a store: remove it and publish again"
                        ) from None
                    raise
                # (one assignment, then the close: an interrupt (Ctrl-C) between the two
                # may leak the parent's fd, but never makes the ``except`` below close a
                # number twice, which another thread may have been given meanwhile)
                fd, parent = child, fd
                os.close(parent)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_regular(self, parts: tuple[str, ...]) -> int:
        """Open ROOT/parts read-only: no symlink followed, no FIFO blocking, regular files only.
        Raises FileNotFoundError if absent, FormatError if it is anything but a regular file."""
        *dirs, name = parts
        fd = -1
        try:  # (closed on any exception, an interrupt included)
            with self.dir_fd(*dirs) as dfd:
                try:
                    fd = os.open(name, _READ, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise self._not_regular(parts, "a symlink") from None
                    if exc.errno == errno.ENXIO:  # (what opening a socket gives)
                        raise self._not_regular(parts, "a socket or device") from None
                    # the same error (and class), naming the whole path, not the name alone
                    raise OSError(exc.errno, exc.strerror,
                                  os.path.join(self.root, *parts)) from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._not_regular(parts, _kind(st.st_mode))
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd

    def _not_regular(self, parts: tuple[str, ...], what: str) -> FormatError:
        return FormatError(
            f"{os.path.join(self.root, *parts)} is {what}, not a regular file; dbsync opens only "
            "regular files inside a store: remove it and publish again"
        )

    def read_small(self, parts: tuple[str, ...], limit: int,
                   exact: int | None = None) -> bytes | None:
        """The bytes of a small record (None if absent); FormatError if larger than ``limit``.
        With ``exact``, a file of any other size gives ``b""`` (at most ``exact + 1`` bytes
        are read: memory and time stay bounded by what the caller expects, not by the file).
        Read until end of file, whatever size ``fstat`` reports (see ``fileio.read_to_end``).

        ``ESTALE`` on a record opened a moment ago is the normal race of NFS (the writer, on
        another host, replaced the record between this open and its read): the record is
        opened again, up to ``STALE_REOPENS`` times, before it is said as the mount's failure."""
        for _ in range(STALE_REOPENS):
            try:
                return self._read_small_once(parts, limit, exact)
            except StoreUnreachableError as exc:
                if exc.errno != errno.ESTALE:
                    raise
        return self._read_small_once(parts, limit, exact)

    def _read_small_once(self, parts: tuple[str, ...], limit: int,
                         exact: int | None) -> bytes | None:
        fd = -1
        try:
            try:
                fd = self.open_regular(parts)
                if exact is not None:
                    data = fileio.read_to_end(fd, min(exact, limit) + 1)
                    return data if len(data) == exact else b""
                size = os.fstat(fd).st_size
                data = b"" if size > limit else fileio.read_to_end(fd, limit + 1)
            except FileNotFoundError:
                return None
            except PermissionError as exc:  # (not damage: this user may not read it)
                path = os.path.join(self.root, *parts)
                raise StoreUnreachableError(
                    f"{path}: {exc.strerror or exc} for this process{_owner_note(path)}; "
                    "nothing is wrong with the store's contents: read it as a user who may, or "
                    "make it readable (the writer creates files 0644)", exc.errno) from None
            except OSError as exc:  # (ESTALE, EIO: said as the mount's, not a bare errno)
                failed = mount_read_error(os.path.join(self.root, *parts), exc, "reading it")
                if failed is None:
                    raise
                raise failed from exc
            if size > limit or len(data) > limit:
                raise FormatError(
                    f"{os.path.join(self.root, *parts)} is {max(size, len(data))} bytes, more "
                    f"than the {limit} a dbsync record may have; publish again from the trainer"
                )
            return data
        finally:
            if fd >= 0:
                os.close(fd)

    # ---- head, index, manifest ---------------------------------------------------------------
    @property
    def manifest_path(self) -> str:
        return os.path.join(self.root, MANIFEST_FILE)

    @property
    def lock_path(self) -> str:
        return os.path.join(self.root, WRITER_LOCK_FILE)

    @property
    def readers_dir(self) -> str:
        return os.path.join(self.root, READERS_DIR)

    def slot_dir(self, slot: str) -> str:
        if slot not in SLOTS:
            raise FormatError(f"unknown slot {slot!r}")
        return os.path.join(self.root, SLOTS_DIR, slot)

    def read_head_bytes(self, known: bytes | None = None,
                        stop: threading.Event | None = None) -> bytes | None:
        """The raw head (bounded), for cheap change checks: compare before parsing. Read as
        ``read_record`` reads (``known``: bytes the caller already judged, a watcher's last
        look, come back at once; ``stop`` set: the pauses end at once)."""
        return self.read_record((MANIFEST_FILE,), MAX_HEAD_BYTES, known, stop)

    def read_record(self, parts: tuple[str, ...], limit: int, known: bytes | None = None,
                    stop: threading.Event | None = None) -> bytes | None:
        """A small JSON record (the head, a stamp), as ``read_small`` reads it; one that is
        not valid JSON is read again after short pauses (1.3 s in all) before it is handed
        on: through a mount that caches attributes (FUSE's ``attr_timeout``, 1 s by default)
        a record just replaced by a longer one can read cut to the old one's size until the
        cache expires. (Records are replaced atomically: anywhere else, one that is no JSON
        is damage, reported once these pauses are over; the same bytes read again later come
        back at once: a writer reads its head several times per push.) ``known`` comes back
        at once; once ``stop`` is set (a watcher stopping), what was read last comes back at
        once."""
        raw = self.read_small(parts, limit)
        where = os.path.join(self.root, *parts)
        garbled = _GARBLED.get(where)
        for pause in REREAD_PAUSES:
            if raw is None or raw == known or raw == garbled or _is_json(raw):
                break
            if stop is None:
                time.sleep(pause)
            elif stop.wait(pause):
                break
            raw = self.read_small(parts, limit)
        if raw is not None and raw != garbled and not _is_json(raw):
            # (waited out once: the same bytes again are damage, not a cache; no more pauses)
            if len(_GARBLED) >= 64:
                _GARBLED.clear()
            _GARBLED[where] = raw
        return raw

    def read_head(self) -> Head | None:
        """The current head (a fresh open: NFS close-to-open revalidates), None if nothing was
        published. Cheap: it never reads the tensor list."""
        raw = self.read_head_bytes()
        return None if raw is None else Head.loads(raw, self.manifest_path)

    def read_index(self, slot: str, head: Head | None = None) -> Index | None:
        """The index a slot holds (None if absent). With ``head``, None also when the index is
        not the one ``head`` names (the writer moved on: read the head again)."""
        raw = self.read_small((SLOTS_DIR, slot, INDEX_FILE), MAX_INDEX_BYTES,
                              exact=None if head is None else head.index_nbytes)
        if raw is None:
            return None
        digest = xxhash.xxh3_64_hexdigest(raw)
        if head is not None and (len(raw) != head.index_nbytes or digest != head.index_checksum):
            return None
        index = self._parsed.get(digest)
        if index is None:  # an index is immutable once named by a head: parse it once
            index = Index.loads(raw, os.path.join(self.slot_dir(slot), INDEX_FILE))
            self._parsed = {digest: index, **dict(list(self._parsed.items())[:1])}
        if head is not None and (index.run_id, index.version) != (head.run_id, head.version):
            raise FormatError(
                f"{self.slot_dir(slot)}/{INDEX_FILE} names version {index.version} of run "
                f"{index.run_id}, but its checksum matches the head of version {head.version}: "
                "the store is damaged; publish again from the trainer"
            )
        if head is not None:
            _check_totals(index, head, os.path.join(self.slot_dir(slot), INDEX_FILE))
        return index

    def read_manifest(self) -> Manifest | None:
        """The current version's head and index, consistent with each other."""
        for _ in range(50):
            head = self.read_head()
            if head is None:
                return None
            index = self.read_index(head.slot, head)
            if index is not None:
                return Manifest(head, index.tensors, index.shards, index.ranges,
                                index.adapter)
            if self._index_damaged(head.slot, head):
                raise FormatError(
                    f"{self.slot_dir(head.slot)}/{INDEX_FILE} is missing or does not match "
                    f"{self.manifest_path} (version {head.version}): the store is damaged; "
                    "publish again from the trainer"
                )
        raise DBSyncError(f"{self.root}: the head changed 50 times while reading it; is a "
                          "writer publishing in a tight loop?")

    def _index_damaged(self, slot: str, head: Head) -> bool:
        """Whether ``head`` stays current while its slot's index does not match it, looked at
        again after the pauses a caching mount needs (``REREAD_PAUSES``): through FUSE the
        kernel may show a replaced head for up to its entry and attribute timeouts (1 s by
        default) while the slot already holds the writer's next version, which is not
        damage. False as soon as the head moved or the index matches (read again)."""
        for _ in rereads():
            if self.read_head() != head or self.read_index(slot, head) is not None:
                return False
        stamp_version, stamp_run = self.read_stamp(slot)
        if (isinstance(stamp_version, int) and stamp_run == head.run_id
                and stamp_version > head.version):
            # (no damage: the slot moved on to a later version of the same run, so the head
            # this mount shows is outdated, cached longer than the pauses above)
            raise StoreUnreachableError(
                f"{self.manifest_path} names version {head.version} in slot {slot}, but that "
                f"slot already holds version {stamp_version}: this mount shows an outdated "
                "head (attribute caching of NFS or FUSE: lower actimeo / attr_timeout); "
                "nothing is damaged, try again", errno.ESTALE)
        return True

    def manifest_in_slot(self, slot: str, head: Head) -> Manifest | None:
        """The version a slot holds if its index is ``head``'s; for re-opening a version that
        is no longer current (its head was kept by the caller). None if the writer moved on;
        FormatError if ``head`` is still current and its slot's index does not match it (no
        writer rewrites the current slot: the store is damaged, and retrying cannot help)."""
        index = self.read_index(slot, head)
        if index is None:
            if self._index_damaged(slot, head):
                raise FormatError(
                    f"{self.slot_dir(slot)}/{INDEX_FILE} is missing or does not match "
                    f"{self.manifest_path} (version {head.version}): the store is damaged; "
                    "publish again from the trainer"
                )
            return None
        return Manifest(head, index.tensors, index.shards, index.ranges, index.adapter)

    def require_manifest(self) -> Manifest:
        manifest = self.read_manifest()
        if manifest is None:
            raise self.nothing_published()
        return manifest

    def nothing_published(self) -> NothingPublishedError:
        """The error for a head not found: nothing published yet, or the store itself gone
        since (removed, or its volume unmounted)."""
        error = root_error(self.root)
        if isinstance(error, StoreUnreachableError):
            return error
        if error is not None:  # (it was there when this Store was made)
            return StoreNotFoundError(f"{error}; it was there before: was it removed, or its "
                                      "volume unmounted?")
        return NothingPublishedError(
            f"no version has been published in {self.root} yet; push one first "
            "(dbsync push SRC ROOT, or Sender(ROOT).push(weights))")

    def read_raw_head_json(self) -> dict[str, Any] | None:
        """The head as plain JSON without format checks (a writer continuing an older store)."""
        raw = self.read_head_bytes()
        if raw is None:
            return None
        data = loads_json(raw, self.manifest_path)
        return data if isinstance(data, dict) else None

    def publish_head(self, head: Head, durable: bool) -> None:
        """The flip: atomically replace the head. Call only once the slot is complete (and
        durable, when ``durable``)."""
        with self.dir_fd() as dfd:
            fileio.write_atomic_at(dfd, MANIFEST_FILE, head.dumps(), durable=durable)

    def write_index(self, slot: str, index_bytes: bytes, durable: bool) -> None:
        with self.dir_fd(SLOTS_DIR, slot) as dfd:
            fileio.write_atomic_at(dfd, INDEX_FILE, index_bytes, durable=durable,
                                   sync_dir=False)

    # ---- slots -------------------------------------------------------------------------------
    def read_stamp(self, slot: str, absent: tuple[Any, Any] = (None, None)) -> tuple[Any, Any]:
        """(version, run_id) the slot's stamp names; version is "writing" while a writer is
        rewriting it; ``absent`` if the slot has no stamp file (a slot never written, a store
        made anew), and (None, None) if it cannot be read (an I/O error). FormatError if
        something other than a stamp stands in its place (a symlink, a FIFO, an oversized or
        garbled file): the store was tampered with, not reused."""
        try:
            found = self._slot_record(slot, SLOT_STAMP_FILE)
        except OSError:
            return None, None
        return absent if found is None else found

    def read_stamp_or_raise(self, slot: str) -> tuple[Any, Any]:
        """``read_stamp``, except that a stamp that cannot be read raises its ``OSError``
        (no permission, a failing mount, this process out of open files) instead of giving
        (None, None). FormatError as ``read_stamp``."""
        found = self._slot_record(slot, SLOT_STAMP_FILE)
        return (None, None) if found is None else found

    def write_stamp(self, slot: str, version: int | str, run_id: str | None, durable: bool,
                    sync_dir: bool = True) -> None:
        self._write_slot_record(slot, SLOT_STAMP_FILE, version, run_id, durable, sync_dir)

    def _slot_record(self, slot: str, name: str) -> tuple[Any, Any] | None:
        """(version, run_id) of a slot's small record ``name`` (None if absent; (None, None)
        if it is not a JSON object). Raises OSError, and FormatError for garbled content."""
        parts = (SLOTS_DIR, slot, name)
        raw = self.read_record(parts, MAX_STAMP_BYTES)
        if raw is None:
            return None
        data = loads_json(raw, os.path.join(self.root, *parts))
        if not isinstance(data, dict):
            return None, None
        return data.get("version"), data.get("run_id")

    def _write_slot_record(self, slot: str, name: str, version: int | str,
                           run_id: str | None, durable: bool, sync_dir: bool = True) -> None:
        with self.dir_fd(SLOTS_DIR, slot) as dfd:
            fileio.write_atomic_at(dfd, name,
                                   json.dumps({"version": version, "run_id": run_id}).encode(),
                                   durable=durable, sync_dir=sync_dir)

    def write_published(self, slot: str, version: int, run_id: str) -> None:
        """Note in the slot that its version was published (after the flip; not fsynced): a
        head restored from an older copy is then told from a writer that died before its
        flip (``numbering``). Removed with the slot's other files when the slot is reused."""
        self._write_slot_record(slot, PUBLISHED_FILE, version, run_id, durable=False)

    def read_published(self, slot: str) -> tuple[Any, Any]:
        """(version, run_id) of the slot's published note ((None, None) if absent or
        unreadable: then no version counts as published there)."""
        try:
            return self._slot_record(slot, PUBLISHED_FILE) or (None, None)
        except (OSError, DBSyncError):
            return None, None

    def sync_slot(self, slot: str) -> None:
        """fsync the slot directory (makes replaces and unlinks inside it durable)."""
        with self.dir_fd(SLOTS_DIR, slot) as dfd:
            os.fsync(dfd)

    def open_shard(self, slot: str, shard: int) -> int:
        """A read-only fd of one shard (regular file, no link followed)."""
        return self.open_regular((SLOTS_DIR, slot, shard_file(shard)))

    def open_shard_for_write(self, slot: str, shard: int, size: int) -> int:
        """An fd to write one shard of ``size`` bytes, reusing the file in place when its size
        is unchanged (keeps its blocks), else writing a new file in its place (preallocated).
        Anything but a regular file in its place (a symlink, a FIFO, a device) is removed,
        never opened. A file with other hard links (a deduplicating tool linked the two
        slots' identical shards, or a ``cp -al`` backup shares it) is replaced by a new file,
        never written into: the other names keep their bytes (a reader of the other slot
        among them)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        name = shard_file(shard)
        with self.dir_fd(SLOTS_DIR, slot) as dfd:
            _remove_unless_regular(dfd, name, self.slot_dir(slot))
            mode = fileio.file_mode_in(dfd)
            path = os.path.join(self.slot_dir(slot), name)

            def new_file() -> int:  # (in place of the file there, whose inode others keep)
                os.unlink(name, dir_fd=dfd)
                return os.open(name, flags | os.O_EXCL, mode, dir_fd=dfd)

            try:
                fd = os.open(name, flags, mode, dir_fd=dfd)
            except PermissionError:
                # another account's file (an earlier writer of the group, under another uid)
                # that this one may not write: replaced by a file of its own (the directory
                # is writable, or this raises naming the shard)
                try:
                    fd = new_file()
                except OSError as exc:
                    raise type(exc)(exc.errno, exc.strerror, path) from None
            try:
                first = os.fstat(fd)
                # Another size: a new file, never this one resized. A reader still mapping it
                # (frozen past its lease, say) keeps the old inode and is told by the slot's
                # stamp (LeaseExpiredError); a file shrunk under its mapping would kill it
                # with SIGBUS instead, without a word. Other hard links: their names keep
                # their bytes (a reader of the other slot among them).
                if 0 < first.st_size != size or first.st_nlink > 1:
                    os.close(fd)
                    fd = -1
                    if first.st_nlink > 1:
                        log.info("%s has %d hard links (a deduplicating tool, or a `cp -al` "
                                 "copy?): it is written as a new file, the other links keep "
                                 "their bytes", path, first.st_nlink - 1)
                    fd = new_file()
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._not_regular((SLOTS_DIR, slot, name), _kind(st.st_mode))
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)  # (only its owner may: another's file keeps its mode)
            fileio.preallocate(fd, size, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def slot_file_sizes(self, slot: str) -> dict[str, int]:
        """Name -> size of every regular file in a slot (for space estimates and cleanup)."""
        with self.dir_fd(SLOTS_DIR, slot) as dfd:
            return {e.name: e.stat(follow_symlinks=False).st_size for e in os.scandir(dfd)
                    if e.is_file(follow_symlinks=False)}

    def remove_slot_files(self, slot: str, keep: set[str] = frozenset()) -> int:
        """Unlink data files of a slot that are not in ``keep`` (shards, the index, files of
        older formats); returns the bytes freed. The stamp is always kept.

        An NFS client renames a file unlinked while one of its own processes still has it open
        or mapped to ``.nfsXXXX`` until that process lets go, and refuses to unlink that file
        (``EBUSY``): such files are left to the client (a slot's shard unmapped late by a
        reader on the trainer's host), and a file the filesystem says is busy is skipped."""
        freed = 0
        with self.dir_fd(SLOTS_DIR, slot) as dfd:
            for entry in list(os.scandir(dfd)):
                if (entry.name in keep or entry.name == SLOT_STAMP_FILE
                        or entry.name.startswith(NFS_SILLY_PREFIX)):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    continue
                if not _SLOT_FILE.fullmatch(entry.name):  # (not dbsync's: never removed)
                    log.warning("dbsync: %s is not a file dbsync writes; left where it is",
                                os.path.join(self.slot_dir(slot), entry.name))
                    continue
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                    os.unlink(entry.name, dir_fd=dfd)
                    freed += size
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        raise
                    log.info("dbsync: %s is in use (%s); left for its user to let go",
                             os.path.join(self.slot_dir(slot), entry.name), exc.strerror)
        return freed

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def remove_temp_files(self) -> None:
        """Remove temp files a killed writer left in ROOT and the slots (only the writer writes
        there). ``readers/`` is never touched: its temp files belong to live receivers."""
        for parts in ((), *((SLOTS_DIR, s) for s in SLOTS)):
            try:
                with self.dir_fd(*parts) as dfd:
                    for entry in list(os.scandir(dfd)):
                        if entry.name.startswith(".tmp-") and entry.is_file(
                                follow_symlinks=False):
                            try:
                                os.unlink(entry.name, dir_fd=dfd)
                            except FileNotFoundError:
                                pass
            except FileNotFoundError:
                continue

    # ---- writer lock -------------------------------------------------------------------------
    def lock_writer(self) -> int:
        """Take the writer lock (non-blocking). Returns the fd; pass it to ``unlock_writer``."""
        with self.dir_fd() as dfd:
            lock_mode = fileio.file_mode_in(dfd)
            try:
                try:
                    fd = os.open(WRITER_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW |
                                 os.O_NONBLOCK | os.O_CLOEXEC, lock_mode, dir_fd=dfd)
                except PermissionError:
                    # Another account's lock file (an earlier writer of a group-shared store):
                    # a lock needs no write access to its file. Not where ROOT itself cannot
                    # be written: the push could write nothing.
                    if not os.access(self.root, os.W_OK | os.X_OK):
                        raise
                    fd = os.open(WRITER_LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW |
                                 os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as exc:
                kind = {errno.ELOOP: "a symlink", errno.EISDIR: "a directory",
                        errno.ENXIO: "a socket or device"}.get(exc.errno)
                if kind is not None:
                    raise self._not_regular((WRITER_LOCK_FILE,), kind) from None
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self.full_error(exc.errno, f"its {WRITER_LOCK_FILE} cannot be "
                                          "created") from None
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise OSError(exc.errno, exc.strerror,
                                  os.path.join(self.root, WRITER_LOCK_FILE)) from None
                owner = "" if exc.errno == errno.EROFS else _owner_note(self.root)
                why = (f"{self.root} is not writable here ({exc.strerror}{owner}): a Sender "
                       "publishes only where the store is writable (readers work on read-only "
                       "views); publish from the "
                       "trainer's read-write mount, as a user who may write there")
                if exc.errno == errno.EROFS:
                    raise StoreReadOnlyError(why, exc.errno) from None
                raise DBSyncError(why) from None
        try:
            st = os.fstat(fd)
            mode = st.st_mode
            if not stat.S_ISREG(mode):
                raise self._not_regular((WRITER_LOCK_FILE,), _kind(mode))
            if stat.S_IMODE(mode) != lock_mode and st.st_uid == os.geteuid():
                with contextlib.suppress(OSError):  # (created under a umask such as 077)
                    os.fchmod(fd, lock_mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                    raise
                raise DBSyncError(
                    f"{self.root} does not support file locks ({exc.strerror}); on Lustre mount "
                    "with -o flock (or -o localflock for a single writer host), on NFS make "
                    "sure the lock service (NLM/lockd, or NFSv4) is running"
                ) from None
        except BlockingIOError:
            try:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            finally:
                os.close(fd)
            path = f"{self.root}/{WRITER_LOCK_FILE}"
            recorded = f" (it records {holder[:200]!r})" if holder else ""
            recorded += _lock_holder_note(holder)
            raise StoreBusyError(
                f"another writer holds {path}{recorded}; only one Sender may publish into a "
                "store at a time (close the other one — in a notebook, the Sender of an "
                "earlier cell: sender.close() — or use another root). If that process has "
                "exited, a process it started before dbsync could release the lock still "
                f"holds it (on its host: `fuser -v {path}` names it); stop it"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # (who holds it, for the message of a refused writer: informational only; on
            # a full filesystem the push itself says so, with what to do)
            os.ftruncate(fd, 0)
            os.write(fd, _lock_record().encode())
        except OSError as exc:
            log.info("could not record this writer in %s (%s)", WRITER_LOCK_FILE, exc)
        return fd

    @staticmethod
    def unlock_writer(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    # ---- reader leases -----------------------------------------------------------------------
    def lease_path(self, reader_id: str) -> str:
        return os.path.join(self.readers_dir, check_reader_id(reader_id) + ".json")

    def write_lease(self, reader_id: str, record: dict[str, Any]) -> None:
        """Replace a reader's lease atomically. Not fsynced: a lease matters only while its
        reader lives. Raises OSError (EROFS, EACCES, ENOSPC, ...) for the caller to handle."""
        name = check_reader_id(reader_id) + ".json"
        with self.dir_fd(READERS_DIR) as dfd:
            fileio.write_atomic_at(dfd, name, json.dumps(record).encode(), durable=False)

    def write_reader_file(self, name: str, data: bytes) -> None:
        """Replace a writer's note in ``readers/`` atomically (a name starting with '.', which
        no reader's lease has). Raises OSError for the caller to handle."""
        if not name.startswith(".") or "/" in name or name in (".", ".."):
            raise FormatError(f"not a note's name in readers/: {name!r}")
        with self.dir_fd(READERS_DIR) as dfd:
            fileio.write_atomic_at(dfd, name, data, durable=False)

    def remove_lease(self, reader_id: str) -> None:
        try:
            with self.dir_fd(READERS_DIR) as dfd:
                os.unlink(check_reader_id(reader_id) + ".json", dir_fd=dfd)
        except FileNotFoundError:
            pass

    def storage_time(self) -> float | None:
        """The store's own clock: the mtime of a probe file created in ``readers/`` now (on
        NFS the server sets it, so other hosts' clocks do not matter). None if this process
        cannot write there."""
        name = f".probe-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            with self.dir_fd(READERS_DIR) as dfd:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, FILE_MODE, dir_fd=dfd)
                try:
                    os.write(fd, b"\n")
                    return os.fstat(fd).st_mtime
                finally:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=dfd)
        except OSError:
            return None

    def reader_file_times(self) -> dict[str, float]:
        """Name -> mtime of every regular file in ``readers/`` (leases and temp files)."""
        times: dict[str, float] = {}
        try:
            with self.dir_fd(READERS_DIR) as dfd:
                for entry in os.scandir(dfd):
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            times[entry.name] = st.st_mtime
        except FileNotFoundError:
            pass
        return times

    def remove_reader_file(self, name: str) -> None:
        """Remove one file of ``readers/`` (a lease or a temp file; never a path elsewhere)."""
        if "/" in name or name in (".", ".."):
            raise FormatError(f"not a file name of readers/: {name!r}")
        with self.dir_fd(READERS_DIR) as dfd, contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)

    def read_lease(self, reader_id: str) -> dict[str, Any] | None:
        """One reader's lease record, or None if there is none (or it does not parse)."""
        return self._read_lease_file(check_reader_id(reader_id) + ".json")

    def _read_lease_file(self, name: str) -> dict[str, Any] | None:
        try:
            raw = self.read_small((READERS_DIR, name), MAX_LEASE_BYTES)
            record = None if raw is None else loads_json(raw, name)
        except (OSError, FormatError):
            return None  # removed, being replaced, or not a lease: the next look sees it
        return record if isinstance(record, dict) else None

    def read_leases(self, unreadable: dict[str, str] | None = None,
                    foreign: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
        """reader id -> lease record, for every readable lease (damaged ones are skipped).
        ``unreadable``: filled with reader id -> why, for each lease that exists but could not
        be read (an I/O error, ``ESTALE``: tried three times in ~0.1 s); without it, such
        leases are skipped as damaged ones are. A writer must not take "unreadable" for
        "gone": that reader may hold a slot. ``foreign``: filled with reader id -> why, for
        each file this process may not read whose mode says no reader wrote it (every lease
        is readable by all; see ``fileio.file_mode_in``): skipped, not counted unreadable."""
        leases: dict[str, dict[str, Any]] = {}
        try:
            with self.dir_fd(READERS_DIR) as dfd:
                names = [e.name for e in os.scandir(dfd)]
        except FileNotFoundError:
            return leases
        for name in names:
            if name.endswith(".json") and not name.startswith("."):
                if unreadable is None:
                    record = self._read_lease_file(name)
                else:
                    try:
                        record = self._read_lease_retrying(name)
                    except OSError as exc:
                        why = self._not_a_lease(name, exc)
                        if why is not None and foreign is not None:
                            foreign[name[: -len(".json")]] = why
                        else:
                            unreadable[name[: -len(".json")]] = exc.strerror or str(exc)
                        continue
                if record is not None:
                    leases[name[: -len(".json")]] = record
        return leases

    def _not_a_lease(self, name: str, exc: OSError) -> str | None:
        """Why ``readers/name``, which could not be read (``exc``), is no reader's lease; None
        where it may be one (an I/O error, or a mode that lets everyone read it)."""
        if exc.errno not in (errno.EACCES, errno.EPERM):
            return None
        try:
            with self.dir_fd(READERS_DIR) as dfd:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return None
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o004:
            return None  # (denied all the same: an ACL, a security label; maybe a lease)
        return (f"this process may not read it (mode {mode:04o}, owner uid {st.st_uid}), and "
                "every reader's lease is readable by all: no dbsync reader wrote it")

    def _read_lease_retrying(self, name: str) -> dict[str, Any] | None:
        """The lease ``name`` (None: removed meanwhile, or no lease); raises the ``OSError``
        of a third failed read (the pauses between: ``LEASE_READ_PAUSES``)."""
        for pause in (*LEASE_READ_PAUSES, None):
            try:
                raw = self.read_small((READERS_DIR, name), MAX_LEASE_BYTES)
                record = None if raw is None else loads_json(raw, name)
            except FileNotFoundError:
                return None  # removed meanwhile (a reader that closed)
            except FormatError:
                return None  # no lease (the monitor's look at it decides nothing)
            except OSError:
                if pause is None:
                    raise
                time.sleep(pause)
                continue
            return record if isinstance(record, dict) else None
        return None

    def why_lease_unwritable(self, reader_id: str) -> str:
        """Why this process may not write ``reader_id``'s lease (owners and modes), and how an
        operator lets it: for messages (looks at two inodes; no file is written)."""
        readers = self.readers_dir
        where = readers if os.path.isdir(readers) else self.root
        why = _owner_note(where).removeprefix("; ")
        try:
            mine = os.lstat(self.lease_path(reader_id))
            sticky = os.stat(where).st_mode & stat.S_ISVTX
        except OSError:
            mine, sticky = None, 0
        if mine is not None and mine.st_uid != os.geteuid() and sticky:
            why += (f"; its lease file {self.lease_path(reader_id)} belongs to uid "
                    f"{mine.st_uid} and {where} has the sticky bit: only that user (or the "
                    "directory's owner) may replace it. A receiver restarted as another user "
                    "under the same reader id? Give it a reader id of its own, or remove the file")
        return (f"{why}. To let receivers of other accounts lease, make {where} writable by "
                f"them: `chmod 1777 {where}` (each creates its own lease, none may remove "
                f"another's), or share a group (`chgrp -R GROUP {self.root}; chmod -R g+w "
                f"{self.root}; find {self.root} -type d -exec chmod g+s {{}} +`)")

    def mounted_read_only(self) -> bool:
        """Whether the store is on a read-only mount (True too if that cannot be told)."""
        try:
            return bool(os.statvfs(self.root).f_flag & os.ST_RDONLY)
        except OSError:
            return True

    def writable(self) -> bool:
        """Whether this process can write leases here (False on read-only mounts)."""
        try:
            if os.statvfs(self.root).f_flag & os.ST_RDONLY:
                return False
        except OSError:
            return False
        # (no readers directory yet: the first receiver creates it in the root)
        where = self.readers_dir if os.path.isdir(self.readers_dir) else self.root
        return os.access(where, os.W_OK | os.X_OK)


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


def root_problem(root: str) -> str | None:
    """Why this process cannot use ``root`` as an existing store directory (None if it can):
    missing, not a directory, a directory along the path it may not search, or a dead
    mount."""
    error = root_error(root)
    return None if error is None else str(error)


def root_error(root: str) -> StoreNotFoundError | None:
    """``root_problem`` as the error to raise: ``StoreUnreachableError`` (with its errno)
    where the directory is there but cannot be opened, ``StoreNotFoundError`` where it is
    missing or not a directory."""
    root = os.path.abspath(root)
    try:
        st = os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        return StoreNotFoundError(
            f"{root} does not exist or is not a directory; check the path and that the "
            "volume is mounted (only a Sender creates a store)")
    except OSError as exc:
        if exc.errno in UNREACHABLE_ERRNOS:
            return _unreachable(root, exc)
        return StoreNotFoundError(f"{root} cannot be reached ({exc.strerror or exc}); check "
                                  "the path and the mount")
    if not stat.S_ISDIR(st.st_mode):
        return StoreNotFoundError(
            f"{root} does not exist or is not a directory (it is {_kind(st.st_mode)}); give "
            "the path of the store directory")
    if not os.access(root, os.R_OK | os.X_OK):
        return _unreachable(root, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    return None


#: errors opening ROOT that make it ``StoreUnreachableError``: no permission, a dead or hung
#: mount (others, such as EMFILE, are raised as they are)
UNREACHABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTCONN, errno.ESTALE,
                                errno.EIO, errno.ETIMEDOUT, errno.EHOSTDOWN,
                                errno.EHOSTUNREACH})


def _unreachable(root: str, exc: OSError) -> StoreUnreachableError:
    """The error for a store directory there but not to be opened (``exc`` says why)."""
    if isinstance(exc, PermissionError):
        return StoreUnreachableError(
            f"{root}: permission denied to this process (uid {os.getuid()}) at "
            f"{_first_unreadable(root)}; every directory above the store must be searchable "
            "by this user (chmod o+x), and the store readable (chmod o+rx)", exc.errno)
    return StoreUnreachableError(
        f"{root} cannot be reached ({exc.strerror or exc}): its mount is dead or hung (a FUSE "
        "daemon or NFS server gone?); check the mount, then try again (a remounted store is "
        "read again)", exc.errno)


#: a read that failed with these failed in the store's disk or mount, not in its content
MOUNT_READ_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT,
                               errno.EHOSTDOWN, errno.EHOSTUNREACH})


#: why ``df`` can show space a push still cannot have
HELD_SPACE = (" (a file deleted while a process still has it open or mapped keeps its space "
              "until that process lets go: a reader that kept tensors of an older version "
              "does; `lsof +L1` lists such files)")


def _check_totals(index: Index, head: Head, source: str) -> None:
    """Raise ``FormatError`` unless ``index`` holds the number of tensors and bytes ``head``
    says (a writer records both from the same tensors; a forged index with tensors left out
    would otherwise pass verification as a smaller version)."""
    count, total = len(index.tensors), sum(t.nbytes for t in index.tensors)
    if (count, total) != (head.tensor_count, head.total_bytes):
        raise FormatError(
            f"{source} lists {count} tensor(s) of {total} bytes, but the head of version "
            f"{head.version} says {head.tensor_count} of {head.total_bytes}: the store is "
            "damaged; publish again from the trainer")


def mount_read_error(path: str, exc: BaseException, doing: str
                     ) -> StoreUnreachableError | None:
    """The ``StoreUnreachableError`` for a read of ``path`` that failed in the disk or mount
    (``MOUNT_READ_ERRNOS``: an NFS server's ``ESTALE``, a soft mount's or a dying disk's
    ``EIO``), else None. Such a failure says nothing of the version's bytes: it is not called
    damage, and is not recorded as a refusal."""
    if not isinstance(exc, OSError) or exc.errno not in MOUNT_READ_ERRNOS:
        return None
    return StoreUnreachableError(
        f"{path}: {exc.strerror or exc} while {doing}: the store's mount or disk failed this "
        "read (no checksum was compared). Check the mount, then try again; an error that "
        "persists on a local disk means that disk is failing", exc.errno)


def _first_unreadable(path: str) -> str:
    """The first directory from ``/`` down to ``path`` that this process may not search (or,
    for ``path`` itself, read)."""
    here = os.sep
    for part in [p for p in path.split(os.sep) if p]:
        if not os.access(here, os.X_OK):
            return here
        here = os.path.join(here, part)
    return here


def _make_parents(path: str) -> None:
    """Create the missing directories of ``path`` with explicit modes (0755: readers of other
    accounts must reach the store; the caller's umask, say 077, would shut them out; 2775
    inside a group-shared directory, see ``_mkdir``)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        mode = _dir_mode_in(os.path.dirname(directory))
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise  # (a file there: the caller says "a part of its path is a file")
            continue
        os.chmod(directory, mode)


def _lock_record() -> str:
    """What the writer lock's file says of its holder (for a refused writer's message only):
    '<host> <pid> boot=<boot id> pidns=<PID namespace> start=<start time>'. Containers that
    share a hostname (host networking) often share pids too (each trainer is pid 1 of its
    own namespace): the rest tells them apart."""
    me = host_identity()
    return (f"{me['host']} {os.getpid()} boot={me['boot_id']} pidns={me['pidns']} "
            f"start={own_start()}\n")


def parse_lock_record(text: str) -> dict[str, str] | None:
    """A lock record (``_lock_record``; before: '<host> <pid>') as {"host", "pid", and its
    ``key=value`` fields: "boot", "pidns", "start"}; None unless it names a plain pid."""
    fields = text.split()
    if len(fields) < 2 or not re.fullmatch(r"[1-9][0-9]{0,9}", fields[1]):
        return None
    extra = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
    return {**extra, "host": fields[0], "pid": fields[1]}


def _lock_holder_note(holder: str) -> str:
    """What a lock's record (``_lock_record``; before: '<host> <pid>') says of its holder
    from here: this very process, a stopped process of this host, a process of another PID
    namespace of this host, or nothing known."""
    record = parse_lock_record(holder)
    if record is None:
        return ""
    host, pid, extra = record["host"], record["pid"], record
    me = host_identity()
    if host != me["host"] or extra.get("boot", str(me["boot_id"])) != str(me["boot_id"]):
        return ""
    if extra.get("pidns", str(me["pidns"])) != str(me["pidns"]):
        return (f": process {pid} of another PID namespace (a container sharing this "
                "hostname), still running: stop that writer, or publish into another root")
    if extra.get("start", "None") not in ("None", str(process_start(pid))):
        return ""  # (that pid is another process now: the holder is elsewhere)
    if int(pid) == os.getpid():
        return (": this process itself (a Sender it made is still open, or its background "
                "push still publishing: close() that Sender first)")
    if process_state(pid) in (b"T", b"t"):
        return (f": process {pid} of this host, which is stopped (SIGSTOP, or a frozen "
                "cgroup): it publishes once thawed; thaw it to let it finish, or kill it")
    return ""


def _owner_note(path: str) -> str:
    """'; <path> belongs to uid U, group G, mode M; this process runs as uid V' (or '')."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return (f"; {path} belongs to uid {st.st_uid}, group {st.st_gid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}; this process runs as uid {os.geteuid()}")


def _dir_mode_in(parent: str) -> int:
    """The mode of a directory dbsync creates in ``parent``: 0755, or 2775 where ``parent``
    is group-shared (setgid and group-writable, e.g. a team's 2775 directory), so that
    another member of the group can continue the store (its slots, leases and lock). Modes
    of existing directories are never changed."""
    try:
        shared = fileio.group_shared(os.stat(parent).st_mode)
    except OSError:
        shared = False
    return DIR_MODE | fileio.GROUP_SHARED if shared else DIR_MODE


def _mkdir(path: str) -> None:
    mode = _dir_mode_in(os.path.dirname(path))
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) and not os.path.exists(path):
            raise StoreNotFoundError(
                f"{path} is a symlink to {os.readlink(path)!r}, which does not exist: create "
                "that directory first (a symlink naming the store is followed; dbsync creates "
                "no directory at the end of one)") from None
        if not stat.S_ISDIR(st.st_mode):
            links = ("; dbsync never follows links inside a store"
                     if stat.S_ISLNK(st.st_mode) else "")
            raise FormatError(
                f"{path} is {_kind(st.st_mode)}, not a directory{links}: give the path of a "
                "store directory (or move what is there out of the way)"
            ) from None
        return
    os.chmod(path, mode)  # mkdir's mode is filtered by the umask


def _remove_unless_regular(dir_fd: int, name: str, where: str) -> None:
    """Unlink ``name`` in ``dir_fd`` (a slot the writer is about to rewrite) if it is anything
    but a regular file; a directory there is refused (FormatError), never removed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        return
    path = os.path.join(where, name)
    if stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{path} is a directory, not a shard file; remove it and publish again")
    log.warning("%s is %s, not a regular file: removing it before writing the slot", path,
                _kind(st.st_mode))
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a file of an unknown kind"
