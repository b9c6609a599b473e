"""Cheap health checks of a store's current version, for ``dbsync status``.

Only sizes and the slot stamp are checked (no byte is read): a flipped bit goes unnoticed
here; ``dbsync verify`` reads every byte. Hazard: a writer may publish while we look; the
check is repeated when the manifest changed underneath it, so a report of damage is about the
version it names.
"""

from __future__ import annotations

import os

from dbsync.errors import FormatError, StoreUnreachableError, UnsupportedFormatError
from dbsync.format import INDEX_FILE, Manifest, shard_file
from dbsync.store import Store


def slot_problems(store: Store, manifest: Manifest) -> dict[str, str]:
    """shard file (or ``slot <x>``) -> what is wrong, for ``manifest``'s slot."""
    problems: dict[str, str] = {}
    stamp = store.read_stamp(manifest.slot)
    if stamp == (None, None):  # unreadable: a permission or mount failure is no damage
        _raise_if_unreachable(store, manifest.slot)
    if stamp != (manifest.version, manifest.run_id):
        problems[f"slot {manifest.slot}"] = (
            f"stamp says {stamp[0]!r}, the head says version {manifest.version}")
    for i, nbytes in enumerate(manifest.shards):
        where = f"{store.slot_dir(manifest.slot)}/{shard_file(i)}"
        try:
            fd = store.open_shard(manifest.slot, i)
        except FileNotFoundError:
            problems[shard_file(i)] = f"{where} is missing"
            continue
        except FormatError as exc:
            problems[shard_file(i)] = str(exc)
            continue
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != nbytes:
            problems[shard_file(i)] = f"{where} has {size} bytes, expected {nbytes}"
    return problems


def _raise_if_unreachable(store: Store, slot: str) -> None:
    """Raise ``StoreUnreachableError`` where ``slot``'s stamp cannot be read by this process
    (no permission, a failing mount): the operator is to fix access, not publish again."""
    try:
        store.read_stamp_or_raise(slot)
    except StoreUnreachableError:
        raise
    except (OSError, FormatError):
        pass  # (damage, or gone: reported as the stamp's problem)


def current_problems(store: Store, attempts: int = 3) -> tuple[Manifest | None, dict[str, str]]:
    """(current manifest, its problems); retried while a writer flips the manifest meanwhile.
    A head that reads well whose slot's index does not (missing, garbled, of another version)
    is a problem of that version, not an error: the rest of the status is still shown."""
    try:
        manifest = store.read_manifest()
    except UnsupportedFormatError:
        raise
    except FormatError as exc:
        head = store.read_head()  # (raises as the manifest did where the head is the fault)
        if head is None:
            raise
        return None, {f"slots/{head.slot}/{INDEX_FILE}": str(exc)}
    problems: dict[str, str] = {}
    for _ in range(attempts):
        if manifest is None:
            return None, {}
        problems = slot_problems(store, manifest)
        again = store.read_manifest()
        if again is not None and again.version == manifest.version:
            return manifest, problems
        manifest = again
    return manifest, problems
