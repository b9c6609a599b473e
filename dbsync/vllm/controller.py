"""The swap controller: turns each published version into one complete, verified apply.

Per version: lease + check names/shapes/dtypes against the served model + verify checksums
(all BEFORE pausing, so the pause covers only the apply) -> pause(keep) -> start -> update ->
finish(weight_version=str(version)) -> reset the prefix cache -> resume. The controller drives
the engine through its public control methods (``EngineOps``); it never calls ``load_weights``
itself, and nothing runs inside the engine outside a paused update session.

Outcomes, stated plainly:
- refused: the version is damaged or does not fit the model. Nothing is paused or applied;
  ``last_error`` names the tensors and why; the log says so once per version; the previous
  version keeps being served.
- nothing applied: a worker failed before loading its first tensor (e.g. the store moved on to a
  newer version meanwhile). The previous version is intact; the controller tries the newest.
- partially applied: some layers may hold the new version. The engine stays PAUSED (held
  requests wait, new ones are refused by the server) and the controller immediately applies the
  newest complete version again; if that fails too, it reports unhealthy until a later version
  applies completely. It never resumes generation on a mix of versions.

Transport: with ``transport`` "auto" or "broadcast" the controller first asks the engine's
workers (``init_weight_transfer_engine``) to stage the trainer's broadcasts (see
``dbsync.vllm.broadcast``); everything above stays as it is, and each worker applies its staged
copy only when it is exactly the verified version with the manifest's checksums, else reads the
filesystem. ``status()["source"]`` (and ``timings.source``) says which: "broadcast",
"filesystem", "mixed" (workers differed) or None (no worker reported: workers on other hosts
cannot write the controller's report directory, so with multi-host engines the source reflects
the local workers only).

Hazards: ``apply_latest`` blocks for the whole read + verify + apply; call it from a thread,
never from the event loop that an ``AsyncLLM`` runs on (``AsyncEngineOps`` refuses that).
Greedy outputs of requests frozen across a swap (pause mode "keep") are generated partly by
the old and partly by the new version; vLLM records which in ``CompletionOutput.weight_versions``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..errors import (
    DamagedVersionError,
    DBSyncError,
    IncompatibleWeightsError,
    LeaseExpiredError,
    NothingPublishedError,
)
from ..receiver import Receiver
from ..watch import Watcher
from .broadcast import check_transport
from .plugin import NOTHING_APPLIED

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class SwapError(DBSyncError):
    """Applying a version to the engine failed. ``partial`` says whether the engine may hold a
    mix of versions (then it stays paused and reports unhealthy)."""

    def __init__(self, message: str, version: int, partial: bool):
        super().__init__(message)
        self.version = version
        self.partial = partial


class EngineOps(Protocol):
    """The engine control surface the controller needs. Each call blocks until done."""

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def start(self) -> None: ...
    def update(self, update_info: dict[str, Any]) -> None: ...
    def finish(self, weight_version: str) -> None: ...
    def reset_prefix_cache(self) -> None: ...
    # Optional: ``init(init_info)`` -> the engine's ``init_weight_transfer_engine`` (needed only
    # for the broadcast transports).


@dataclass
class SwapTimings:
    version: int
    read_verify_s: float = 0.0
    pause_s: float = 0.0
    apply_s: float = 0.0
    push_to_served_s: float | None = None
    source: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source,
                "read_verify_s": round(self.read_verify_s, 6),
                "pause_s": round(self.pause_s, 6), "apply_s": round(self.apply_s, 6),
                "push_to_served_s": None if self.push_to_served_s is None
                else round(self.push_to_served_s, 6)}


@dataclass
class SwapState:
    version: int | None = None
    loaded_at: float | None = None
    healthy: bool = True
    paused: bool = False
    applying: int | None = None
    published_version: int | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    last_error_version: int | None = None
    refused: set[int] = field(default_factory=set)
    swaps: int = 0
    last_swap: SwapTimings | None = None


class SwapController:
    """Applies the latest version of the store at ``root`` to one engine through ``ops``.

    ``expected``: name -> (shape, dtype) of what the served model accepts (see
    ``expected_from_checkpoint``); None skips the fit check (not recommended: an unfit
    version then fails inside the pause). ``allow_missing``: names that may be absent (e.g. a
    tied ``lm_head.weight``). ``verify``: check every checksum before pausing. ``workers``: the
    engine's worker count (tensor x pipeline parallel); with more than one, any failed apply
    is treated as partial. ``transport``: "filesystem" (default here), "auto" or "broadcast"
    (see the module docstring; ``ops`` must then have ``init``)."""

    def __init__(self, root: str | os.PathLike[str], ops: EngineOps,
                 expected: Expected | None, allow_missing: Iterable[str] = (),
                 verify: bool = True, reader_id: str | None = None,
                 poll_interval: float | None = None, workers: int = 1,
                 transport: str = "filesystem"):
        self.root = os.path.abspath(os.fspath(root))
        self.ops = ops
        self.transport = check_transport(transport)
        self._transport_ready = transport == "filesystem"
        self._report_dir: str | None = None
        self.expected = expected
        self.allow_missing = tuple(allow_missing)
        self.verify = verify
        self.poll_interval = poll_interval
        self.workers = workers
        self.receiver = Receiver(self.root, reader_id=reader_id, verify=verify,
                                 poll_interval=poll_interval)
        self.state = SwapState()
        self._lock = threading.RLock()
        self._watcher: Watcher | None = None

    # ---- public -------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def healthy(self) -> bool:
        return self.state.healthy

    def status(self) -> dict[str, Any]:
        """JSON-ready status: the version served (None = the model's own checkpoint), when it
        was loaded, health, the last error and the last swap's timings."""
        s = self.state
        return {
            "version": s.version,
            "loaded_at": s.loaded_at,
            "healthy": s.healthy,
            "paused": s.paused,
            "applying": s.applying,
            "published_version": s.published_version,
            "last_error": s.last_error,
            "last_error_at": s.last_error_at,
            "last_error_version": s.last_error_version,
            "refused_versions": sorted(s.refused),
            "swaps": s.swaps,
            "timings": None if s.last_swap is None else s.last_swap.as_dict(),
            "source": None if s.last_swap is None else s.last_swap.source,
            "transport": self.transport,
            "root": self.root,
            "watching": self._watcher is not None,
        }

    def apply_latest(self) -> int | None:
        """Apply the store's current version unless it is already served. Returns the version
        served afterwards. Raises ``IncompatibleWeightsError`` / ``DamagedVersionError`` when the
        version is refused (the previous one stays served) and ``SwapError`` when applying
        failed. Blocks; thread-safe (one apply at a time)."""
        with self._lock:
            self.init_transport()
            error: DBSyncError | None = None
            for _ in range(MAX_ATTEMPTS):
                try:
                    done = self._attempt()
                except SwapError as exc:
                    error = exc
                    if exc.partial or self._newer_than(exc.version):
                        continue  # roll forward to the newest complete version
                    raise
                except NothingPublishedError:
                    return self.state.version
                if done:
                    return self.state.version
            assert error is not None
            raise error

    def init_transport(self) -> None:
        """Start the workers' staging receivers (transport "auto"/"broadcast"); once, before
        the first apply. Blocks: call it from a thread, never from an ``AsyncLLM``'s loop."""
        with self._lock:
            if self._transport_ready:
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
            self._transport_ready = True
            log.info("dbsync: transport %s for %s", self.transport, self.root)

    def stop_transport(self) -> None:
        """Stop the workers' staging (best effort: an engine already shut down is fine)."""
        with self._lock:
            if self.transport == "filesystem" or not self._transport_ready:
                return
            self._transport_ready = False
            init = getattr(self.ops, "init", None)
            try:
                if init is not None:
                    init({"root": None, "transport": "filesystem"})
            except Exception as exc:  # noqa: BLE001 - the engine may be gone
                log.debug("dbsync: could not stop the workers' staging: %s", exc)

    def start_watching(self) -> Watcher:
        """Apply every version published from now on (and the current one) in a background
        thread. Errors are recorded in ``status()`` and logged once per version."""
        if self._watcher is None:
            self._watcher = Watcher(self.root, self._on_version,
                                    poll_interval=self.poll_interval).start()
        return self._watcher

    def stop(self) -> None:
        """Stop watching and release the reader registration. Does not touch the engine."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self.receiver.close()
        if self._report_dir is not None:
            shutil.rmtree(self._report_dir, ignore_errors=True)
            self._report_dir = None

    # ---- internals ----------------------------------------------------------------------
    def _on_version(self, version: int) -> None:
        self.state.published_version = version
        try:
            self.apply_latest()
        except SwapError:
            # Applying failed (a transient worker error, an expired lease): the watcher calls
            # back once per version, so let its next look at the store try this one again.
            if self._watcher is not None:
                self._watcher.last_version = self.state.version
        except DBSyncError:
            pass  # a refusal: recorded in the status and logged by the controller already

    def _newer_than(self, version: int) -> bool:
        try:
            latest = self.receiver.latest_version()
        except DBSyncError:
            return False
        return latest is not None and latest > version

    def _attempt(self) -> bool:
        """One try at the current version. True when nothing is left to do."""
        s = self.state
        with self.receiver.open() as snap:
            version = snap.version
            s.published_version = max(version, s.published_version or 0)
            if version == s.version and s.healthy:
                return True
            t0 = time.perf_counter()
            try:
                if self.expected is not None:  # manifest only: cheap, so first
                    snap.check_compatible(self.expected, self.allow_missing)
                if self.verify:
                    snap.verify()
            except (DamagedVersionError, IncompatibleWeightsError) as exc:
                self._refuse(version, exc)
                raise
            except LeaseExpiredError as exc:
                raise SwapError(f"version {version}: {exc}", version, partial=False) from exc
            timings = SwapTimings(version, read_verify_s=time.perf_counter() - t0)
            report = self._clear_reports()
            s.applying = version
            t_pause = time.perf_counter()
            started = False
            try:
                if not s.paused:
                    self.ops.pause()
                    s.paused = True
                t_apply = time.perf_counter()
                started = True
                self.ops.start()
                update: dict[str, Any] = {"root": self.root, "version": version}
                if report is not None:
                    update["report"] = report
                self.ops.update(update)
                self.ops.finish(str(version))
                timings.apply_s = time.perf_counter() - t_apply
                timings.source = self._read_reports(version)
                snap.check_unchanged()  # our lease kept the slot; this catches an expired one
                self.ops.reset_prefix_cache()
            except Exception as exc:
                s.applying = None
                # With several workers one may report "nothing applied" while another
                # applied everything: only a single worker's word is enough.
                partial = not s.healthy or (started and (
                    self.workers > 1 or NOTHING_APPLIED not in str(exc)))
                self._fail(version, exc, partial)
                raise SwapError(
                    f"applying version {version} failed "
                    f"({'engine may hold a mix; paused' if partial else 'nothing applied'}): "
                    f"{exc}", version, partial) from exc
            self._resume()
            timings.pause_s = time.perf_counter() - t_pause
            timings.push_to_served_s = time.time() - snap.manifest.created_at
            self.receiver.mark_loaded(version)
            s.version, s.loaded_at, s.healthy, s.applying = version, time.time(), True, None
            s.swaps += 1
            s.last_swap = timings
            s.last_error = None
            log.info("dbsync: serving version %d from the %s (pause %.1f ms, apply %.1f ms, "
                     "verify %.1f ms)", version, timings.source or "unreported source",
                     timings.pause_s * 1e3, timings.apply_s * 1e3, timings.read_verify_s * 1e3)
            return True

    def _clear_reports(self) -> str | None:
        """The directory the workers report their source into, emptied (broadcast transports
        only: with "filesystem" the source is the filesystem)."""
        if self.transport == "filesystem":
            return None
        if self._report_dir is None:
            self._report_dir = tempfile.mkdtemp(prefix="dbsync-apply-")
        for name in os.listdir(self._report_dir):
            os.unlink(os.path.join(self._report_dir, name))
        return self._report_dir

    def _read_reports(self, version: int) -> str | None:
        if self.transport == "filesystem":
            return "filesystem"
        assert self._report_dir is not None
        sources = set()
        for name in os.listdir(self._report_dir):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self._report_dir, name), "rb") as f:
                    record = json.loads(f.read())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and record.get("version") == version:
                sources.add(str(record.get("source")))
        if len(sources) > 1:
            return "mixed"
        return sources.pop() if sources else None

    def _resume(self) -> None:
        if self.state.paused:
            self.ops.resume()
            self.state.paused = False

    def _refuse(self, version: int, exc: DBSyncError) -> None:
        s = self.state
        self._record(version, f"version {version} refused: {exc}")
        if version not in s.refused:
            s.refused.add(version)
            log.error("dbsync: %s; still serving version %s", s.last_error, s.version)
        if s.paused and s.healthy:
            self._resume()

    def _fail(self, version: int, exc: BaseException, partial: bool) -> None:
        s = self.state
        if partial:
            s.healthy = False
            self._record(version, f"applying version {version} failed midway; the engine is "
                                  f"paused and unhealthy until a complete version is applied: "
                                  f"{exc}")
            log.error("dbsync: %s", s.last_error)
            return
        self._record(version, f"applying version {version} failed, nothing applied; still "
                              f"serving version {s.version}: {exc}")
        log.error("dbsync: %s", s.last_error)
        if s.healthy:
            try:
                self._resume()
            except Exception:
                log.exception("dbsync: resume failed")

    def _record(self, version: int, message: str) -> None:
        self.state.last_error = message
        self.state.last_error_at = time.time()
        self.state.last_error_version = version
