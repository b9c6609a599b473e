"""Fallback registration for environments where dbsync is importable but not installed (so the
``vllm.general_plugins`` entry point is absent): naming ``DBSyncWorkerExtension`` as vLLM's
``worker_extension_cls`` makes every worker import this module, which registers the backend.

The extension adds no methods to the worker. ``dbsync.vllm.engine_args`` sets it only when the
entry point is missing and no other extension is configured.
"""

from __future__ import annotations

from .plugin import register

register()


class DBSyncWorkerExtension:
    """Importing this class's module registers the ``dbsync`` backend in the worker."""

    __slots__ = ()
