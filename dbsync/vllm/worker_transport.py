"""The engine workers' transport, seen from the driver: starting and stopping their staging
receivers, and reading where each worker took a version from.

With transport "filesystem" there is nothing to start and every version comes from the
filesystem. With "auto" or "broadcast", ``start`` asks the workers (``ops.init``) to stage
the trainer's broadcasts; at each apply they write a small JSON report (source, staged bytes)
into a private directory of this process, which ``sources`` reads after the apply.

Hazard: workers on other hosts cannot write this host's report directory, so with multi-host
engines the source reflects the local workers only (None where no worker reported).
Driver side only: no ``torch.distributed``, no ``dbsync.nccl``, no worker-side module.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..errors import DBSyncError
from . import workdirs
from .transport import check_transport

log = logging.getLogger(__name__)

#: the prefix of the report directories (``workdirs`` sweeps those of dead processes)
REPORT_PREFIX = "dbsync-apply-"


class WorkerTransport:
    """Starts, stops and hears from the workers' transport for the store at ``root``."""

    def __init__(self, root: str, ops: Any, transport: str):
        self.root = root
        self.ops = ops
        self.transport = check_transport(transport)
        self._ready = transport == "filesystem"
        self._report_dir: str | None = None

    @property
    def staged(self) -> bool:
        """Whether the workers may take versions from a broadcast (not "filesystem")."""
        return self.transport != "filesystem"

    def start(self) -> None:
        """Start the workers' staging receivers, once. Blocks (an engine call)."""
        if self._ready:
            return
        init = getattr(self.ops, "init", None)
        if init is None:
            raise DBSyncError(f"transport {self.transport!r} needs engine ops with init(); "
                              "use LLMOps/AsyncEngineOps or transport='filesystem'")
        try:
            init({"root": self.root, "transport": self.transport})
        except Exception as exc:
            raise DBSyncError(
                f"the engine's workers could not start the {self.transport!r} transport "
                f"({type(exc).__name__}: {exc}); use transport='filesystem' or fix the "
                "cause") from exc
        self._ready = True
        log.info("dbsync: transport %s for %s", self.transport, self.root)

    def stop(self) -> None:
        """Stop the workers' staging (best effort: an engine already shut down is fine)."""
        if not self.staged or not self._ready:
            return
        self._ready = False
        init = getattr(self.ops, "init", None)
        try:
            if init is not None:
                init({"root": None, "transport": "filesystem"})
        except Exception as exc:  # noqa: BLE001 - the engine may be gone
            log.debug("dbsync: could not stop the workers' staging: %s", exc)

    def fresh_report_dir(self) -> str | None:
        """The directory the workers report into for the next apply, emptied (None with
        "filesystem": the source is the filesystem)."""
        if not self.staged:
            return None
        if self._report_dir is None:
            self._report_dir = workdirs.make(REPORT_PREFIX)
        for name in os.listdir(self._report_dir):
            if not name.startswith(workdirs.OWNER):
                os.unlink(os.path.join(self._report_dir, name))
        return self._report_dir

    def sources(self, version: int) -> tuple[str | None, dict[str, int] | None]:
        """Where the workers on this host took ``version`` from ("mixed" if they differ; None
        if none reported), and the bytes each held staged for it (None if none reported
        any). Reads the reports of the last ``fresh_report_dir``."""
        if not self.staged:
            return "filesystem", None
        assert self._report_dir is not None
        sources = set()
        staged: dict[str, int] = {}
        for name in os.listdir(self._report_dir):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self._report_dir, name), "rb") as f:
                    record = json.loads(f.read())
            except (OSError, ValueError):
                continue  # (a report being written, or garbled: that worker did not report)
            if isinstance(record, dict) and record.get("version") == version:
                sources.add(str(record.get("source")))
                if isinstance(record.get("staged_bytes"), int):
                    staged[str(record.get("rank"))] = record["staged_bytes"]
        source = "mixed" if len(sources) > 1 else (sources.pop() if sources else None)
        return source, staged or None

    def close(self) -> None:
        """Remove the report directory (the workers' staging is ``stop``'s)."""
        if self._report_dir is not None:
            workdirs.remove(self._report_dir)
            self._report_dir = None
