"""The swap controller: turns each published version into one complete, verified apply.

Per version: lease + check names and shapes against the served model + verify checksums
(all BEFORE pausing, so the pause covers only the apply) -> pause (``pause_mode``) -> start ->
update -> finish(weight_version=str(version)) -> reset the prefix cache -> resume. Floating-point
tensors may come in any of float16/bfloat16/float32/float64: the model's weight loaders cast
them to the served dtype, as when vLLM loads a float32 checkpoint into a bfloat16 model; every
other dtype must match.

Pause modes (what happens to requests in flight when a version is applied):
- "keep" (default): they are frozen, their KV cache is recomputed with the new weights and they
  finish on the new version. Their tokens come from two versions; vLLM records which in
  ``CompletionOutput.weight_versions`` (``serve-vllm`` reports it per response).
- "wait": new requests are queued and the engine runs until the requests in flight finish, at
  most ``drain_timeout`` seconds; then it applies. No response mixes versions, but the swap
  waits for the longest request. When the drain times out, the rest is held as with "keep"
  (``timings.pause_mode`` says "keep" for that swap).
- "abort": requests in flight are aborted (their clients get what was generated so far, with
  ``finish_reason`` "abort"). The controller drives
the engine through its public control methods (``EngineOps``); it never calls ``load_weights``
itself, and nothing runs inside the engine outside a paused update session.

Transient errors: an ``OSError`` (``ESTALE``, ``EIO``, ...) while opening or reading a version, or
an apply that failed with nothing applied, does not mark the version seen. The watcher keeps
trying the store's newest version with backoff (0.2 s doubling to 5 s) until it is served or
superseded; meanwhile ``status()`` shows ``retrying: true`` and the error in ``last_error``.

Outcomes, stated plainly:
- refused: the version is damaged or does not fit the model. Nothing is paused or applied;
  ``last_error`` names the tensors and why; the log says so once per version; the previous
  version keeps being served.
- nothing applied: a worker failed before loading its first tensor (e.g. the store moved on to a
  newer version meanwhile). The previous version is intact; the controller tries the newest.
- partially applied: some layers may hold the new version. The engine stays PAUSED (held
  requests wait, new ones are refused by the server) and the controller immediately applies the
  newest complete version again. If that fails too, it rolls back: the version served before
  is applied again from its slot, which the controller holds (leased) for as long as it serves
  that version, and generation resumes on it (``last_error`` and the ``rolled_back`` metric say
  so; the failed version is reported to the trainer as refused and not retried until a newer
  one is published). Only if the rollback fails too does it report unhealthy until a later
  version applies completely. It never resumes generation on a mix of versions.
- refusals and failed applies are written into this engine's lease (``refused``), so
  ``Sender.wait_for_receivers`` and ``dbsync push --wait-for`` fail fast naming the engine.

Hazard of the rollback hold: the writer cannot reuse the slot of the version an engine serves
until that engine has applied a newer one, so a push can wait for the slowest engine's swap
(a dead engine costs at most its lease timeout). Receivers on read-only views hold nothing and
cannot roll back.

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

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import (
    DamagedVersionError,
    DBSyncError,
    IncompatibleWeightsError,
    InvalidArgumentError,
    LeaseExpiredError,
    NothingPublishedError,
    StoreNotFoundError,
    check_seconds,
)
from ..receiver import Receiver, Snapshot
from ..watch import Watcher
from .plugin import NOTHING_APPLIED, SUPERSEDED
from .worker_transport import WorkerTransport

if TYPE_CHECKING:
    from .metrics import SwapMetrics

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
PAUSE_MODES = ("keep", "wait", "abort")
DEFAULT_DRAIN_TIMEOUT = 30.0
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
#: dtypes a published tensor may have whatever the served dtype: the weight loaders cast them
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def _served(version: int | None) -> str:
    """What the engine serves, said: a version of the store, or the model's own checkpoint."""
    if version is None:
        return "the model's own checkpoint (no version of the store applied yet)"
    return f"version {version}"


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise DBSyncError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
    return mode


def fit_expected(expected: Expected, published: Mapping[str, torch.dtype]) -> Expected:
    """``expected`` with each floating dtype replaced by the published one where both are in
    ``CASTABLE`` (only names and shapes must then match)."""
    out = {}
    for name, (shape, dtype) in expected.items():
        got = published.get(name)
        out[name] = (shape, got if dtype in CASTABLE and got in CASTABLE else dtype)
    return out


class RolledBackError(DBSyncError):
    """Applying a version failed midway and the engine was rolled back to the version it served
    before (which it serves again). The failed version is not retried until a newer one."""

    def __init__(self, message: str, version: int, served: int):
        super().__init__(message)
        self.version = version
        self.served = served


class SwapError(DBSyncError):
    """Applying a version to the engine failed. ``partial`` says whether the engine may hold a
    mix of versions (then it stays paused and reports unhealthy)."""

    def __init__(self, message: str, version: int, partial: bool,
                 run_id: str | None = None):
        super().__init__(message)
        self.version = version
        self.partial = partial
        self.run_id = run_id  # (of the version that failed)


class EngineOps(Protocol):
    """The engine control surface the controller needs. Each call blocks until done."""

    def pause(self, mode: str, drain_timeout: float) -> str:
        """Pause generation in ``mode`` (see ``PAUSE_MODES``); return the mode that took
        effect ("keep" when a "wait" drain timed out)."""
        ...

    def resume(self) -> None: ...
    def start(self) -> None: ...
    def update(self, update_info: dict[str, Any]) -> None: ...
    def finish(self, weight_version: str) -> None: ...
    def drop_stale_caches(self) -> None:
        """Drop what the engine computed with the old weights: cached prefixes (requests
        held through the swap are preempted to recompute), and a multimodal model's cached
        encoder outputs."""
        ...
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
    pause_mode: str | None = None
    nbytes: int = 0
    #: worker rank -> bytes it held staged for this version (broadcast applies only)
    staged_bytes: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "source": self.source,
                "pause_mode": self.pause_mode, "bytes": self.nbytes,
                "staged_bytes": self.staged_bytes,
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
    retrying: bool = False
    retries: int = 0


class SwapController:
    """Applies the latest version of the store at ``root`` to one engine through ``ops``.

    ``expected``: name -> (shape, dtype) of what the served model accepts (see
    ``expected_from_checkpoint``); None skips the fit check (not recommended: an unfit
    version then fails inside the pause). ``allow_missing``: names that may be absent (e.g. a
    tied ``lm_head.weight``). ``verify``: check every checksum before pausing. ``workers``: the
    engine's worker count (tensor x pipeline parallel); with more than one, any failed apply
    is treated as partial. ``transport``: "filesystem" (default here), "auto" or "broadcast"
    (see the module docstring; ``ops`` must then have ``init``). ``pause_mode``: "keep", "wait"
    or "abort", with ``drain_timeout`` seconds for "wait" (see the module docstring).
    ``metrics``: where swaps are counted (default: ``metrics.default_metrics()``, the series
    vLLM's ``/metrics`` serves)."""

    def __init__(self, root: str | os.PathLike[str], ops: EngineOps,
                 expected: Expected | None, allow_missing: Iterable[str] = (),
                 verify: bool = True, reader_id: str | None = None,
                 poll_interval: float | None = None, workers: int = 1,
                 transport: str = "filesystem", pause_mode: str = "keep",
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
                 metrics: SwapMetrics | None = None):
        self.root = os.path.abspath(os.fspath(root))
        self.ops = ops
        self.pause_mode = check_pause_mode(pause_mode)
        if not check_seconds(drain_timeout, "drain_timeout"):
            raise InvalidArgumentError(f"drain_timeout must be > 0 seconds, not {drain_timeout}")
        self.drain_timeout = drain_timeout
        if metrics is None:
            from .metrics import default_metrics

            metrics = default_metrics()
        self.metrics = metrics
        self._worker_transport = WorkerTransport(self.root, ops, transport)
        self.expected = expected
        self.allow_missing = tuple(allow_missing)
        self.verify = verify
        self.poll_interval = poll_interval
        self.workers = workers
        self.receiver = Receiver(self.root, reader_id=reader_id, verify=verify,
                                 poll_interval=poll_interval)
        self.state = SwapState()
        #: the snapshot of the version served, held (its slot leased) for a rollback
        self._served: Snapshot | None = None
        self._served_run: str | None = None
        #: the run of ``state.published_version`` (None: not known yet)
        self._published_run: str | None = None
        self._rolled_back: set[tuple[int, str | None]] = set()
        #: why the last apply could not read the store, while it retries (None: it reads)
        self._read_problem: str | None = None
        #: (version, error) of the apply failures logged at ERROR (repeats go to DEBUG)
        self._failures_logged: set[tuple[int, str]] = set()
        self._lock = threading.RLock()
        self._watcher: Watcher | None = None
        self._stopping = threading.Event()
        self.metrics.watch_store(self.store_problem)
        self.metrics.watch_engine(self.state)

    # ---- public -------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def transport(self) -> str:
        """The workers' transport as given: "filesystem", "auto" or "broadcast"."""
        return self._worker_transport.transport

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
            "retrying": s.retrying,
            "retries": s.retries,
            "pause_mode": self.pause_mode,
            "swaps": s.swaps,
            "timings": None if s.last_swap is None else s.last_swap.as_dict(),
            "source": None if s.last_swap is None else s.last_swap.source,
            "transport": self.transport,
            "root": self.root,
            "run_id": self._served_run,
            "watching": self._watcher is not None,
            "store_problem": self.store_problem(),
        }

    def store_problem(self) -> str | None:
        """What keeps this server from following the store (``Receiver.store_problem``: its
        directory gone, its lease not written; or its manifest unreadable, as the watcher last
        found it), or None. The served version stays served. Touches no file."""
        problem = self.receiver.store_problem()
        watcher = self._watcher
        if problem is None and watcher is not None and (
                unreadable := watcher.read_problem) is not None:
            problem = f"the store's manifest cannot be read ({unreadable})"
        if problem is None and watcher is not None:
            problem = watcher.rewound
        if problem is None and self._read_problem is not None:  # (an apply retrying a read)
            problem = self._read_problem
        return None if problem is None else f"{problem}; still serving {_served(self.version)}"

    def apply_latest(self) -> int | None:
        """Apply the store's current version unless it is already served. Returns the version
        served afterwards. Raises ``IncompatibleWeightsError`` / ``DamagedVersionError`` when the
        version is refused (the previous one stays served), ``SwapError`` when applying
        failed and ``OSError`` when the store could not be read (try again). Blocks;
        thread-safe (one apply at a time)."""
        with self._lock:
            self.init_transport()
            error: DBSyncError | None = None
            try:
                for attempt in range(MAX_ATTEMPTS):
                    if self._stopping.is_set() and error is not None:
                        break  # (shutting down: no other try)
                    try:
                        done = self._attempt()
                    except SwapError as exc:
                        error = exc
                        if exc.partial and attempt >= 1 and self._served is not None:
                            self._roll_back(exc)  # raises RolledBackError, or the failure
                            # (both reported to the trainer there: only the outcome is)
                        if exc.partial or SUPERSEDED in str(exc) or self._newer_than(
                                exc.version):
                            continue  # roll forward to the newest complete version
                        raise
                    except StoreNotFoundError:
                        raise  # the store went away (removed, unmounted): an error, retried
                    except NothingPublishedError:
                        return self.state.version
                    if done:
                        return self.state.version
            except RolledBackError:
                raise
            except BaseException:  # (a later try failed otherwise: a read, the store gone)
                self._report_unhealthy(error)
                raise
            assert error is not None
            self._report_unhealthy(error)
            raise error

    def init_transport(self) -> None:
        """Start the workers' staging receivers (transport "auto"/"broadcast"); once, before
        the first apply. Blocks: call it from a thread, never from an ``AsyncLLM``'s loop."""
        with self._lock:
            self._worker_transport.start()

    def stop_transport(self) -> None:
        """Stop the workers' staging (best effort: an engine already shut down is fine)."""
        with self._lock:
            self._worker_transport.stop()

    def start_watching(self) -> Watcher:
        """Apply every version published from now on (and the current one) in a background
        thread. Errors are recorded in ``status()`` and logged once per version; transient
        ones are retried with backoff (see the module docstring)."""
        if self._watcher is None:
            self._stopping.clear()
            self._watcher = Watcher(self.root, self._on_version,
                                    poll_interval=self.poll_interval).start()
        return self._watcher

    @property
    def stopping(self) -> bool:
        """True once the server began shutting down (``stop_applying``)."""
        return self._stopping.is_set()

    def stop_applying(self) -> None:
        """Start no swap from now on, and abandon the engine calls of one under way
        (``ops.close()``, where the ops have it): the server is shutting down. Never blocks;
        ``stop`` does the rest."""
        self._stopping.set()  # ends a retry wait at once
        close = getattr(self.ops, "close", None)
        if close is not None:
            close()

    def stop(self) -> None:
        """Stop watching and release the reader registration. Does not touch the engine: a
        swap under way finishes first (the watcher is joined). A server shutting down calls
        ``stop_applying`` before this, so that no swap holds it up."""
        self._stopping.set()  # ends a retry wait at once
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._release_served()
        self.receiver.close()
        self._worker_transport.close()

    # ---- internals ----------------------------------------------------------------------
    def _on_version(self, version: int) -> None:
        self._published(version)
        self._follow()

    def _other_run(self) -> bool:
        """Whether the newest published version is of another run than the served one."""
        return (self._published_run is not None and self._served_run is not None
                and self._published_run != self._served_run)

    def _published(self, version: int, run_id: str | None = None) -> None:
        """Record the newest version seen published: numbers of another run (a new training
        run at the same path starts again at 1) replace the old run's, never add to its lag.
        ``run_id`` None: the watcher's notice, which names no run (a number lower than the
        last one is a new run's)."""
        s = self.state
        with self._lock:
            if run_id is None:
                new_run = version < (s.published_version or 0)
            else:
                new_run = self._published_run not in (None, run_id)
            s.published_version = version if new_run else max(version,
                                                              s.published_version or 0)
            if run_id is not None or new_run:
                self._published_run = run_id
            if new_run:  # (refusals name versions of the run they were made in)
                s.refused.clear()
            self.metrics.versions(s.version, s.published_version, self._other_run())

    def _follow(self) -> None:
        """Apply the newest version; on a transient failure try again with backoff until it
        (or a newer one) is served, it is refused, or the controller stops."""
        s = self.state
        delay = RETRY_MIN_S
        while not self._stopping.is_set():
            try:
                self.apply_latest()
            except (IncompatibleWeightsError, DamagedVersionError, RolledBackError):
                break  # a refusal or a rollback: recorded in the status and logged already
            except (OSError, DBSyncError) as exc:
                if self._stopping.is_set():  # (said by _fail, where it was an apply)
                    log.debug("dbsync: stopping; %s", exc)
                    break
                if not isinstance(exc, SwapError):  # a SwapError is recorded by _fail
                    self._read_failed(exc, delay)
                s.retrying = True
                s.retries += 1
                if self._stopping.wait(delay):
                    break
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            break
        s.retrying = False
        self._read_problem = None

    def _read_failed(self, exc: OSError | DBSyncError, delay: float) -> None:
        s = self.state
        version = s.published_version
        first = s.last_error_version != (version or 0) or not (s.last_error or "").startswith(
            "reading")
        self._record(version or 0, f"reading version {version} from {self.root} failed "
                                   f"({type(exc).__name__}: {exc}); still serving "
                                   f"{_served(s.version)}, retrying")
        self.metrics.outcome("failed")
        self._read_problem = f"reading the store failed ({type(exc).__name__}: {exc})"
        if first:
            log.warning("dbsync: %s (first retry in %.1f s)", s.last_error, delay)
        else:
            log.debug("dbsync: %s", s.last_error)

    def _newer_than(self, version: int) -> bool:
        try:
            latest = self.receiver.latest_version()
        except DBSyncError:
            return False
        return latest is not None and latest > version

    def _attempt(self) -> bool:
        """One try at the current version. True when nothing is left to do."""
        try:
            snap = self.receiver.open()
        except DamagedVersionError as exc:  # (its current slot's stamp is damaged)
            if exc.version is not None:
                self._published(exc.version, None)
                self._refuse(exc.version, exc)
            raise
        try:
            return self._attempt_on(snap)
        finally:
            if snap is not self._served:
                snap.close()

    def _attempt_on(self, snap: Snapshot) -> bool:
        s = self.state
        version = snap.version
        self._published(version, snap.run_id)
        if version == s.version and snap.run_id == self._served_run and s.healthy:
            return True
        if (version, snap.run_id) in self._rolled_back and s.healthy:
            return True  # rolled back from already: wait for a newer version
        t0 = time.perf_counter()
        try:
            if snap.manifest.kind != "weights":
                raise IncompatibleWeightsError(
                    f"{self.root} holds {snap.manifest.kind} versions (LoRA), not full weights: "
                    "serve them with `dbsync serve-vllm ROOT --model BASE --lora NAME` (or "
                    "attach(llm, ROOT, lora=NAME))")
            if self.expected is not None:  # manifest only: cheap, so first
                published = {e.name: e.torch_dtype for e in snap.manifest.tensors}
                snap.check_compatible(fit_expected(self.expected, published),
                                      self.allow_missing)
            if self.verify:
                snap.verify()
        except (DamagedVersionError, IncompatibleWeightsError) as exc:
            self._refuse(version, exc)
            raise
        except LeaseExpiredError as exc:
            log.info("dbsync: version %d was replaced while it was verified (%s); trying "
                     "the newest", version, exc)
            raise SwapError(f"version {version}: {exc}", version, partial=False) from exc
        timings = SwapTimings(version, read_verify_s=time.perf_counter() - t0,
                              nbytes=snap.manifest.total_bytes)
        report = self._worker_transport.fresh_report_dir()
        s.applying = version
        t_pause = time.perf_counter()
        started = False
        try:
            if not s.paused:
                timings.pause_mode = self.ops.pause(self.pause_mode, self.drain_timeout)
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
            timings.source, timings.staged_bytes = self._worker_transport.sources(version)
            snap.check_unchanged()  # our lease kept the slot; this catches an expired one
            self.ops.drop_stale_caches()
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
                f"{exc}", version, partial, snap.run_id) from exc
        self._resume()
        timings.pause_s = time.perf_counter() - t_pause
        timings.push_to_served_s = time.time() - snap.manifest.created_at
        self.receiver.mark_loaded(version, snap.run_id)
        self._keep_served(snap)
        s.version, s.loaded_at, s.healthy, s.applying = version, time.time(), True, None
        s.swaps += 1
        s.last_swap = timings
        s.last_error = s.last_error_version = s.last_error_at = None
        self._failures_logged.clear()
        self.metrics.applied(pause_s=timings.pause_s, read_verify_s=timings.read_verify_s,
                             nbytes=timings.nbytes, source=timings.source)
        self.metrics.versions(s.version, s.published_version, self._other_run())
        log.info("dbsync: serving version %d from the %s (pause %.1f ms, apply %.1f ms, "
                 "verify %.1f ms)", version, timings.source or "unreported source",
                 timings.pause_s * 1e3, timings.apply_s * 1e3, timings.read_verify_s * 1e3)
        return True

    def _resume(self) -> None:
        if self.state.paused:
            self.ops.resume()
            self.state.paused = False

    def _keep_served(self, snap: Snapshot) -> None:
        """Hold the snapshot of the version now served (leased: its slot stays intact for a
        rollback) and release the one served before."""
        old, self._served = self._served, (snap if snap.leased else None)
        self._served_run = snap.run_id
        if old is not None and old is not snap:
            old.close()

    def _release_served(self) -> None:
        old, self._served = self._served, None
        if old is not None:
            old.close()

    def _roll_back(self, failure: SwapError) -> None:
        """Apply the held, previously served version again after ``failure`` left the engine
        with a mix (paused). Raises ``RolledBackError`` when it is served again; re-raises
        ``failure`` (unhealthy) if the rollback fails too."""
        s, held = self.state, self._served
        assert held is not None
        try:
            held.check_unchanged()
            if self.verify:  # (held since it was served: damaged meanwhile, it would be
                # served as that version; read with preadv: a shard cut short is an error,
                # never a SIGBUS of this process)
                held.verify(by_reading=True)
            self.ops.start()
            self.ops.update({"root": self.root, "version": held.version,
                             "head": held.manifest.head.dumps().decode()})
            self.ops.finish(str(held.version))
            self.ops.drop_stale_caches()
            self._resume()
        except Exception as exc:
            log.error("dbsync: rolling back to version %d failed too (%s); the engine stays "
                      "paused and unhealthy until a complete version is applied", held.version,
                      exc)
            self._release_served()
            self._report_refusal(failure.version, s.last_error or str(failure))
            raise failure from exc
        s.healthy, s.applying = True, None
        s.version, s.loaded_at = held.version, time.time()
        # (the failed version's own run: a new run's version must be recognised as rolled
        # back from, not retried, pausing the engine each time)
        self._rolled_back.add((failure.version, failure.run_id))
        self._record(failure.version,
                     f"applying version {failure.version} failed midway ({failure}); rolled "
                     f"back to version {held.version}, which is served again")
        self.metrics.outcome("rolled_back")
        self.metrics.versions(s.version, s.published_version, self._other_run())
        self._report_refusal(failure.version, s.last_error or str(failure))
        log.error("dbsync: %s", s.last_error)
        # The trainer must be able to reuse this slot for its next version: stop holding it.
        self._release_served()
        raise RolledBackError(s.last_error or str(failure), failure.version, held.version)

    def _report_unhealthy(self, error: DBSyncError | None) -> None:
        """Tell the trainer of a version that failed midway and left the engine unhealthy
        (not of one the next try mended, or a rollback replaced: only the outcome)."""
        if (isinstance(error, SwapError) and error.partial and not self.state.healthy
                and not self._stopping.is_set()):
            self._report_refusal(error.version, self.state.last_error or str(error))

    def _report_refusal(self, version: int, reason: str) -> None:
        try:
            self.receiver.report_refusal(version, reason)
        except (OSError, DBSyncError) as exc:
            log.warning("dbsync: could not record the refusal of version %d in the store: %s",
                        version, exc)

    def _refuse(self, version: int, exc: DBSyncError) -> None:
        s = self.state
        first = version not in s.refused
        s.refused.add(version)  # before the error is visible: status readers see both
        self._record(version, f"version {version} refused: {exc}")
        if first:
            self.metrics.outcome("refused")
            log.error("dbsync: %s; still serving %s", s.last_error, _served(s.version))
        if s.paused and s.healthy:
            self._resume()
        self._report_refusal(version, str(exc))
        self._release_served()  # the trainer may need this slot for a version that fits

    def _fail(self, version: int, exc: BaseException, partial: bool) -> None:
        s = self.state
        if self._stopping.is_set():  # shutting down: not a failure to alert on, nor refusal
            self._record(version, f"stopping; version {version} was not applied ({exc})")
            log.info("dbsync: stopping; version %d was not applied (%s)", version, exc)
            return
        superseded = not partial and (SUPERSEDED in str(exc) or self._newer_than(version))
        # (a normal race, the store moving on during the apply, is no failure to alert on)
        self.metrics.outcome("superseded" if superseded else "failed")
        if partial:
            s.healthy = False
            self._record(version, f"applying version {version} failed midway; the engine is "
                                  f"paused and unhealthy until a complete version is applied: "
                                  f"{exc}")
            self._log_failure(version, exc)
            return
        self._record(version, f"applying version {version} failed, nothing applied; still "
                              f"serving {_served(s.version)}: {exc}")
        if superseded:
            log.info("dbsync: version %d was superseded while it was applied; applying the "
                     "newest", version)
        else:
            self._log_failure(version, exc)
        if s.healthy:
            try:
                self._resume()
            except Exception:
                log.exception("dbsync: resume failed")

    def _log_failure(self, version: int, exc: BaseException) -> None:
        """ERROR the first time a version fails this way; DEBUG when its retries fail alike
        (``status()`` and the failed-outcome counter show every one)."""
        key = (version, str(exc)[:500])
        if key in self._failures_logged:
            log.debug("dbsync: again: %s", self.state.last_error)
            return
        if len(self._failures_logged) >= 64:
            self._failures_logged.clear()
        self._failures_logged.add(key)
        log.error("dbsync: %s", self.state.last_error)

    def _record(self, version: int, message: str) -> None:
        self.state.last_error = message
        self.state.last_error_at = time.time()
        self.state.last_error_version = version
