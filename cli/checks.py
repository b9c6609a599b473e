"""Cheap health checks of a store's current version, for ``dbsync status``.

Only sizes and the slot stamp are checked (no byte is read): a flipped bit goes unnoticed
here; ``dbsync verify`` reads every byte. Hazard: a writer may publish while we look; the
check is repeated when the manifest changed underneath it, so a report of damage is about the
version it names.
"""

from __future__ import annotations

import os

from dbsync.format import Manifest
from dbsync.store import Store


def slot_problems(store: Store, manifest: Manifest) -> dict[str, str]:
    """tensor name (or ``slot <x>``) -> what is wrong, for ``manifest``'s slot."""
    problems: dict[str, str] = {}
    stamp = store.read_stamp(manifest.slot)
    if stamp != manifest.version:
        problems[f"slot {manifest.slot}"] = (
            f"stamp says {stamp!r}, the manifest says version {manifest.version}")
    for entry in manifest.tensors:
        path = store.tensor_path(manifest.slot, entry.file)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems[entry.name] = f"file {path} is missing"
            continue
        if size != entry.nbytes:
            problems[entry.name] = f"file {path} has {size} bytes, expected {entry.nbytes}"
    return problems


def current_problems(store: Store, attempts: int = 3) -> tuple[Manifest | None, dict[str, str]]:
    """(current manifest, its problems); retried while a writer flips the manifest meanwhile."""
    manifest = store.read_manifest()
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
