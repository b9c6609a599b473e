"""Where a new Sender's numbering continues in an existing store: the run id, the current
version and slot, read from the head, raised past any version of the same run that a reader
reports loaded or a slot's stamp names (a head restored from an older copy must not make two
contents share one version number). Reads only.

Hazards: a head of another format is continued from (its run id kept, its version numbered
on), with a warning naming the readers that cannot read the rewritten store; an unreadable
head starts a new run at version 1 (said at WARNING).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from .errors import DBSyncError, FormatError, UnsupportedFormatError
from .format import FORMAT_VERSION, MANIFEST_FILE, MAX_VERSION, SLOTS
from .status import printable
from .store import Store

log = logging.getLogger(__name__)


def _plausible_version(value: Any) -> bool:
    """Whether a version read from a lease, stamp or older head can be numbered on from (a
    damaged file may name anything)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_VERSION


def refuse_newer_format(root: str | os.PathLike[str]) -> None:
    """Raise ``UnsupportedFormatError`` if ``root`` holds a head written by a newer dbsync:
    rewriting it would hide its versions from newer readers. Reads only; an unreadable head
    is left to the Sender (it starts a new run)."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return
    try:
        raw = Store(root, create=False).read_raw_head_json() or {}
    except (OSError, FormatError):
        return
    found = raw.get("format_version")
    if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{os.path.join(os.path.abspath(root), MANIFEST_FILE)} (nothing was written)", found)


def continue_from_store(store: Store) -> tuple[str, int, str | None, tuple[str, int] | None]:
    """(run id, current version, current slot) to continue from, and (run id, version)
    of the head as read (None: no head, or one of another format or unreadable)."""
    head_path = os.path.join(store.root, MANIFEST_FILE)
    if os.path.isdir(head_path) and not os.path.islink(head_path):
        raise DBSyncError(f"{head_path} is a directory, where the store's head (a small "
                          "file) must be written; nothing was published. Remove it "
                          "(rm -r) and push again")
    try:
        head = store.read_head()
    except FormatError as exc:
        if not isinstance(exc, UnsupportedFormatError):
            log.warning("the head of %s is unreadable (%s); the next push starts a new run "
                        "at version 1", store.root, exc)
            return uuid.uuid4().hex, 0, None, None
        raw = store.read_raw_head_json() or {}
        version = raw.get("version") if _plausible_version(raw.get("version")) else 0
        slot = raw.get("slot") if raw.get("slot") in SLOTS else None
        run = raw.get("run_id")
        if not (isinstance(run, str) and len(run) == 32 and run.isalnum()):
            run = uuid.uuid4().hex  # (a format upgrade is no new run: its id is kept)
        stranded = _readers_of_other_formats(store)
        log.warning("%s holds format %s; the next push rewrites it in format %d and "
                    "continues from version %d. Readers of older releases cannot read it "
                    "from then on: upgrade them too%s", store.root,
                    printable(str(raw.get("format_version"))[:20]), FORMAT_VERSION,
                    version, "" if not stranded else
                    " (leases in readers/ now: " + ", ".join(stranded[:10]) +
                    (" ..." if len(stranded) > 10 else "") + ")")
        return run, version, slot, None
    if head is None:
        return uuid.uuid4().hex, 0, None, None
    return (head.run_id, _past_loaded(store, head.run_id, head.version, head.slot), head.slot,
            (head.run_id, head.version))


def _readers_of_other_formats(store: Store) -> list[str]:
    """Reader ids whose lease does not say they read this format (``reads_format``;
    receivers of releases before 0.3 do not say it)."""
    try:
        leases = store.read_leases({})
    except (OSError, DBSyncError):
        return []
    return sorted(printable(r) for r, lease in leases.items()
                  if lease.get("reads_format") != FORMAT_VERSION)


def _past_loaded(store: Store, run_id: str, version: int, slot: str) -> int:
    """``version``, or the highest version of run ``run_id`` that a reader reports loaded
    or, when the head's own slot was rewritten since (its stamp names another version), a
    slot's stamp names, if that is higher: the head was restored from an older copy, and
    numbering on from it would publish versions that readers take for ones they already
    have; or that the other slot notes it published (``Store.write_published``). (The other
    slot stamped ``version + 1`` alone, without that note, is a writer that died between its
    stamp and its flip: nobody saw that version, and the next push publishes that number.)"""
    seen: list[Any] = []
    reported: dict[str, int] = {}  # reader id -> the version its lease reports loaded
    try:
        leases = store.read_leases()
    except (OSError, FormatError):
        leases = {}
    for reader, lease in leases.items():
        loaded = lease.get("loaded_version")
        if lease.get("loaded_run_id") != run_id or loaded is None:
            continue
        if not _plausible_version(loaded):
            log.warning("%s: the lease of reader %s reports version %s loaded, which no "
                        "store can hold: ignored (a damaged lease file? remove %s)",
                        store.root, reader, str(loaded)[:40],
                        store.lease_path(reader))
            continue
        reported[reader] = loaded
    seen += reported.values()
    stamps = {}
    for name in SLOTS:
        try:
            stamps[name] = store.read_stamp(name)
        except (OSError, FormatError):
            stamps[name] = (None, None)
    if stamps[slot] != (version, run_id):
        for name, (stamped, stamp_run) in stamps.items():
            if stamp_run != run_id or stamped == "writing":
                continue
            if _plausible_version(stamped):
                seen.append(stamped)
            else:
                log.warning("%s: the stamp of slot %s names version %s, which no store can "
                            "hold: ignored (a damaged stamp; the next push into that slot "
                            "rewrites it)", store.root, name, str(stamped)[:40])
    else:  # (the other slot's newer version counts only if it was published, not just written)
        for name, (stamped, stamp_run) in stamps.items():
            if (name != slot and stamp_run == run_id and _plausible_version(stamped)
                    and stamped > version and store.read_published(name) == (stamped, run_id)):
                seen.append(stamped)
    highest = max(seen, default=version)
    if highest > version:
        by = sorted(r for r, v in reported.items() if v == highest)
        log.warning("%s went back to version %d of run %s, but version %d of that run was "
                    "%s there (its head was restored from an older copy?): the next push "
                    "is version %d", store.root, version, run_id, highest,
                    f"loaded by reader(s) {', '.join(by[:5])}" if by else "written",
                    highest + 1)
        return highest
    return version
