"""The ``dbsync`` weight-transfer backend for vLLM (worker side) and its registration.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every process it
starts (API server, engine core, workers); ``register`` is idempotent.

Worker side, per swap (driven by ``dbsync.vllm.controller``, never by a free-running thread):
``start_weight_update`` sets up vLLM's layerwise reload; ``update_weights({"root", "version"})``
opens the store with this worker's own reader lease, checks that the current version is the one
the controller verified, and hands the tensors to ``model.load_weights`` in manifest (layer)
order; ``finish_weight_update`` finalizes the layerwise reload.

Transport: ``init_weight_transfer_engine({"root", "transport"})`` with transport "auto" or
"broadcast" starts this worker's staging receiver (``dbsync.vllm.broadcast``): versions the
trainer broadcasts (``dbsync.nccl.BroadcastSender``) are staged in memory in the background, and
``update_weights`` applies the staged copy when it is exactly the requested version and matches
the manifest's checksums, else reads the filesystem as above. Which one it used is logged and,
when the update names a ``report`` directory on this host, written there as
``<rank>.json`` (``{"version", "source", "rank", "pid"}``) for the controller to read.

Hazards, stated plainly:
- Tensors are memory-mapped views of the slot files, and each tensor-parallel rank's weight
  loader copies out only its own shard: a weight split along its first dimension
  (column-parallel: q/k/v, gate/up, embeddings) touches only that rank's pages; one split along
  its second dimension (row-parallel: o_proj, down_proj) is strided and touches every page.
  So ranks read only what they need where the layout allows, with no second staging copy.
- If the apply fails before the first tensor was loaded, the layerwise reload is finalized here,
  which puts every layer's previous weights back: the model is exactly the previous version and
  the error says ``nothing applied``. If it fails after that, some layers hold the new version
  and some the old (or uninitialised memory): the error says ``partially applied`` and the
  caller must not serve until a complete version is applied.
- The worker verifies nothing by default (the controller verified checksums before pausing);
  pass ``"verify": true`` to check again inside the pause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..errors import DBSyncError
from ..fileio import write_atomic
from ..format import Head
from ..leases import default_reader_id
from ..receiver import Receiver
from .reads import Layout, OutsideWindowError, ReadGuard, ReadRecorder, layout_of
from .transport import TRANSPORTS

if TYPE_CHECKING:
    from .kernel_updates import TiedLayers
    from .staging import Staged, Stager

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

log = logging.getLogger(__name__)

BACKEND = "dbsync"
#: Markers at the start of an apply error's message. Errors cross vLLM's process boundary as
#: text, so the controller reads the outcome from these.
NOTHING_APPLIED = "[dbsync: nothing applied]"
PARTIALLY_APPLIED = "[dbsync: partially applied]"
#: Test hook: a file naming "VERSION N" lines; applying VERSION then fails after N tensors
#: (a failure midway, on a real engine), or, for "VERSION hold", waits (up to 60 s) while that
#: line stays in the file (an apply under way, for shutdown tests). Read at each update; unset
#: in production.
FAULTS_ENV = "DBSYNC_TEST_APPLY_FAULTS"

#: vLLM's loader warns once per tensor, on every swap, when a version's dtype is not the
#: model's (float32 published into a bfloat16 engine: hundreds of lines per swap)
_CAST_LOGGER = "vllm.model_executor.models.utils"
_CAST_MESSAGE = "Attempted to load weight %s with dtype %s into"


class _CastSummary(logging.Filter):
    """Drops vLLM's per-tensor dtype warnings during one apply, counting them."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and isinstance(record.msg, str) and (
                record.msg.startswith(_CAST_MESSAGE) and len(record.args or ()) == 3):
            _, source, target = record.args  # type: ignore[misc]
            key = (str(source).removeprefix("torch."), str(target).removeprefix("torch."))
            self.casts[key] = self.casts.get(key, 0) + 1
            return False
        return True

    def report(self) -> None:
        """One INFO line for the casts counted (then forgets them)."""
        casts, self.casts = self.casts, {}
        if casts:
            log.info("dbsync: cast %s to the model's dtype (the version was published in "
                     "another dtype)", ", ".join(f"{n} tensor(s) from {a} to {b}"
                                                 for (a, b), n in sorted(casts.items())))


@contextlib.contextmanager
def _casts_filtered(summary: _CastSummary) -> Iterator[None]:
    """vLLM's per-tensor dtype warnings counted into ``summary`` instead of logged."""
    logger = logging.getLogger(_CAST_LOGGER)
    logger.addFilter(summary)
    try:
        yield
    finally:
        logger.removeFilter(summary)


def _injected_failure(version: int) -> int | None:
    path = os.environ.get(FAULTS_ENV)
    if not path:
        return None
    deadline = time.monotonic() + 60
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.split() for line in f]
        except OSError:
            return None
        if [str(version), "hold"] not in lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for fields in lines:
        if len(fields) == 2 and fields[0] == str(version) and fields[1].isdigit():
            return int(fields[1])
    return None
#: In an apply error's message: the store moved on to a newer version (a normal race). vLLM's
#: own ERROR lines for such an error are turned into one INFO line (``_RaceFilter``).
SUPERSEDED = "[dbsync: superseded]"
#: vLLM loggers that report a failed worker/utility call with a traceback
_RPC_LOGGERS = ("vllm.v1.executor.multiproc_executor", "vllm.v1.engine.core")
#: the logger of vLLM's layerwise reload, and its per-layer "nothing loaded" warning
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOTHING_LOADED = "%s: Failed to load weights"


class _NothingLoadedFilter(logging.Filter):
    """vLLM's layerwise reload warns ``<layer>: Failed to load weights`` for every layer that
    received no tensor in an update, on every swap: a WARNING per swap per worker that
    alerting on warnings fires on. Two kinds of layer receive none by design, and their lines
    go to DEBUG under ``dbsync``: rotary embeddings, whose tables are computed, not stored (no
    checkpoint has them); and a layer that shares its weight with another (an LM head tied to
    the token embedding: checkpoints store the weight once, under the embedding's name), which
    dbsync prepares again after the update (``kernel_updates.TiedLayers``; its class name is
    in ``tied``). The warning for any other layer stays: a version that lacks a layer's
    weights is refused by the fit check before it is applied, so it would mean something."""

    #: class names of the tied layers that dbsync prepares again after an update
    tied: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg != _NOTHING_LOADED or len(args) != 1:
            return True
        layer = str(args[0])
        if "rotary" in layer.lower():
            log.debug("dbsync: vLLM reloaded %s with its computed tables (no checkpoint "
                      "tensors)", layer)
            return False
        if layer in self.tied:
            log.debug("dbsync: %s shares its weight with another layer and received none "
                      "itself; prepared again after the update", layer)
            return False
        return True

#: how long an apply waits for a broadcast of the requested version that is still arriving
STAGE_WAIT_SECONDS = 10.0

_register_lock = threading.Lock()


def register() -> None:
    """Register the ``dbsync`` weight-transfer backend with vLLM. Safe to call any number of
    times, from any process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with _register_lock:
        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(
                BACKEND, "dbsync.vllm.plugin", "DBSyncWeightTransferEngine")
            for name in _RPC_LOGGERS:
                logging.getLogger(name).addFilter(_RaceFilter())
            logging.getLogger(_RELOAD_LOGGER).addFilter(_NothingLoadedFilter())


_VERSION_IN = re.compile(r"version (\d+)")


class _RaceFilter(logging.Filter):
    """Shortens vLLM's ERROR tracebacks for failed applies (each ~100 lines, in the worker
    and in the engine core):
    - one that lost a normal race (``SUPERSEDED``) becomes one INFO line: the controller
      applies the newest version right after;
    - a failure seen before (the same kind, of the same version, as the same exception type:
      the controller retries a version that fails alike with backoff, for as long as it
      fails; counts and pids in the message may differ) becomes one WARNING line; its first
      traceback was logged whole.

    Hazard: it remembers failures per process, not per training run: a new run's version of
    the same number failing the same way gets one line, not a traceback."""

    #: distinct failures remembered (then forgotten, and logged whole once more)
    REMEMBERED = 64

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[str, str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        text = "" if exc is None else str(exc)
        if SUPERSEDED in text:
            level, line = logging.INFO, text.splitlines()[0]
        elif NOTHING_APPLIED in text or PARTIALLY_APPLIED in text:
            version = _VERSION_IN.search(text)
            key = (PARTIALLY_APPLIED if PARTIALLY_APPLIED in text else NOTHING_APPLIED,
                   version.group(1) if version else "", type(exc).__name__)
            if key not in self._seen:
                if len(self._seen) >= self.REMEMBERED:
                    self._seen.clear()
                self._seen.add(key)
                return True
            level, line = logging.WARNING, f"{text.splitlines()[0]} (again; its traceback was "
            line += "logged the first time)"
        else:
            return True
        record.msg, record.args = "dbsync: %s", (line,)
        record.levelno, record.levelname = level, logging.getLevelName(level)
        record.exc_info, record.exc_text = None, None
        return True


class ApplyError(DBSyncError):
    """Applying a version inside a worker failed. The message starts with
    ``NOTHING_APPLIED`` or ``PARTIALLY_APPLIED``."""


@dataclass
class DBSyncInitInfo(WeightTransferInitInfo):
    """Optional init handshake: nothing is required (each update names its store). With
    ``root`` and ``transport`` "auto"/"broadcast", this worker stages broadcast versions of that
    store (see ``dbsync.vllm.broadcast``); "filesystem" (the default) stops staging."""

    root: str | None = None
    transport: str = "filesystem"
    step_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"init_info.transport must be one of {TRANSPORTS}, "
                             f"not {self.transport!r}")
        if self.transport != "filesystem" and not self.root:
            raise ValueError(f"init_info.transport {self.transport!r} needs init_info.root")


@dataclass
class DBSyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: apply ``version`` from the store at ``root``."""

    root: str
    version: int
    verify: bool = False
    report: str | None = None
    #: the head record of ``version`` when it is no longer current (a rollback to the
    #: version served before, whose slot the controller holds)
    head: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ValueError("update_info.root must be a non-empty path")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or (
                self.version < 1):
            raise ValueError(f"update_info.version must be an integer >= 1, not {self.version!r}")


class DBSyncWeightTransferEngine(WeightTransferEngine[DBSyncInitInfo, DBSyncUpdateInfo]):
    """Reads one published version from a dbsync store into this worker's model."""

    init_info_cls = DBSyncInitInfo
    update_info_cls = DBSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig,
                 device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.applied_version: int | None = None
        #: "broadcast" or "filesystem": where the last applied version came from
        self.last_source: str | None = None
        self._stager: Stager | None = None
        #: the mode the update in progress reads under (a recorder, or the guard of staged
        #: windows), entered again for ``finish_weight_update``, where vLLM's layerwise reload
        #: replays deferred loads; and whether to keep what it recorded once the update ends
        self._reads: ReadRecorder | None = None
        self._casts = _CastSummary()  # (vLLM's dtype warnings of the apply under way)
        self._keep_recorded = False
        #: the layers that share a weight with another (``kernel_updates.TiedLayers``)
        self._tied: TiedLayers | None = None

    def init_transfer_engine(self, init_info: DBSyncInitInfo) -> None:
        if init_info.root is not None and not os.path.isdir(init_info.root):
            raise DBSyncError(f"{init_info.root} is not a directory on this worker's host")
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if init_info.transport != "filesystem":
            assert init_info.root is not None
            configure_logging()  # each apply says which source it used
            from .staging import Stager  # worker side only: loaded when staging starts

            self._stager = Stager(os.path.abspath(init_info.root), init_info.transport,
                                  device=_device_name(self.device),
                                  step_timeout=init_info.step_timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from .kernel_updates import TiedLayers, prepare_moe_updates  # (worker side)

        self._reads, self._keep_recorded = None, False
        self._casts.report()  # (an apply that never finished)
        if self._tied is None:  # the first update: the layers as the engine loaded them,
            prepare_moe_updates(self.model)  # the sharing of tied ones still intact
            self._tied = TiedLayers(self.model)
            _NothingLoadedFilter.tied.update(type(m).__name__ for m in self._tied.layers)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        reads, self._reads = self._reads, None
        keep, self._keep_recorded = self._keep_recorded, False
        unloaded = [] if self._tied is None else self._tied.unloaded()
        try:
            with reads if reads is not None else contextlib.nullcontext(), \
                    _casts_filtered(self._casts):
                finalize_layerwise_reload(self.model, self.model_config)
            if self._tied is not None:  # (the shared weight is back, new: prepare the layers
                self._tied.prepare_again(unloaded)  # that share it and received nothing)
        except BaseException as exc:
            self._check_windows(exc)
            raise
        finally:
            self._casts.report()
        if keep and reads is not None and self._stager is not None:
            self._stager.record(reads.windows())

    def _check_windows(self, exc: BaseException) -> None:
        """After a failed apply: if it read outside staged windows, stage whole versions."""
        outside = _find_cause(exc, OutsideWindowError)
        if outside is not None and self._stager is not None:
            self._stager.windows_failed(str(outside))

    def _staged(self, update_info: DBSyncUpdateInfo) -> Staged | None:
        """The broadcast copy of the requested version, if this worker holds one that matches
        the manifest's checksums."""
        stager = self._stager
        if stager is None or os.path.abspath(update_info.root) != stager.root:
            return None
        staged = stager.take(update_info.version, wait=STAGE_WAIT_SECONDS)
        if staged is None:
            return None
        problem = staged.matches(update_info.root)
        if problem is not None:
            stager.release(update_info.version)
            log.warning("dbsync: worker pid %d does not apply the broadcast copy of version %d "
                        "(%s); reading the filesystem", os.getpid(), update_info.version,
                        problem)
            return None
        return staged

    def receive_weights(self, update_info: DBSyncUpdateInfo) -> None:
        # A reader registration for this read only: the controller's own lease keeps the slot
        # for the whole swap, and only the controller reports the version as loaded (so
        # ``Sender.wait_for_receivers`` counts one receiver per engine).
        reader_id = default_reader_id("vllm-worker")
        receiver: Receiver | None = None
        loaded = 0
        source = "filesystem"

        fail_after = _injected_failure(update_info.version)

        def counted(pairs: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            for pair in pairs:
                if loaded == fail_after:
                    raise RuntimeError(f"injected failure after {loaded} tensor(s) "
                                       f"({FAULTS_ENV})")
                loaded += 1
                yield pair

        staged_bytes: int | None = None

        def recorder_for(layout: Callable[[], Layout]) -> ReadRecorder | None:
            """A recorder when the stager wants to know what this apply reads."""
            if self._stager is not None and self._stager.needs_recording(layout()):
                return ReadRecorder()
            return None

        def load(pairs: Iterable[tuple[str, torch.Tensor]], reads: ReadRecorder | None
                 ) -> None:
            """load_weights, under ``reads`` when given (kept for finish_weight_update)."""
            self._reads = reads
            with reads if reads is not None else contextlib.nullcontext(), \
                    _casts_filtered(self._casts):
                self.model.load_weights(counted(pairs))

        try:
            staged = None if update_info.head else self._staged(update_info)
            if staged is not None:
                source, staged_bytes = "broadcast", staged.nbytes
                with _no_mtp_check():
                    if staged.windowed is not None:
                        # windows of a layout not recorded yet hold whole tensors: record;
                        # windows holding everything need no guard
                        windows = staged.windowed.windows
                        reads = recorder_for(lambda: windows.layout) or (
                            None if windows.kept_bytes == windows.full_bytes
                            else ReadGuard(windows))
                        load(staged.windowed.tensors(reads), reads)
                    else:
                        assert staged.pairs is not None
                        pairs = staged.pairs
                        reads = recorder_for(lambda: layout_of(pairs))
                        load(pairs if reads is None else reads.tracked(pairs), reads)
            else:
                receiver = Receiver(update_info.root, reader_id=reader_id, verify=False)
                head = None if update_info.head is None else Head.loads(
                    update_info.head.encode(), "update_info.head")
                with receiver.open(head=head) as snap:
                    if snap.version != update_info.version:
                        raise DBSyncError(
                            f"{SUPERSEDED} the store at {update_info.root} now holds version "
                            f"{snap.version}, not the verified version {update_info.version}; "
                            "apply again")
                    if update_info.verify:
                        snap.verify()
                    with _no_mtp_check():
                        reads = recorder_for(lambda: tuple(
                            (e.name, e.torch_dtype, tuple(e.shape))
                            for e in snap.manifest.tensors))
                        tensors = snap.tensors()
                        load(tensors if reads is None else reads.tracked(tensors), reads)
                    snap.check_unchanged()
        except BaseException as exc:
            self._abandon()
            if self._stager is not None:  # a retry reads the filesystem
                self._stager.release(update_info.version)
                self._check_windows(exc)
            marker = PARTIALLY_APPLIED if loaded else NOTHING_APPLIED
            raise ApplyError(
                f"{marker} version {update_info.version} on worker pid {os.getpid()} "
                f"({loaded} tensor(s) loaded from the {source}): {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            if receiver is not None:
                receiver.close()
        if self._stager is not None:
            self._stager.release(update_info.version)
        # what a recorder saw is kept once finish_weight_update replayed the deferred loads
        self._keep_recorded = type(self._reads) is ReadRecorder
        self.applied_version, self.last_source = update_info.version, source
        log.info("dbsync: worker pid %d applied version %d from the %s", os.getpid(),
                 update_info.version, source)
        self._report(update_info, source, staged_bytes)

    def _report(self, update_info: DBSyncUpdateInfo, source: str,
                staged_bytes: int | None) -> None:
        """Tell the controller where the version came from and, from the broadcast, how many
        bytes this worker held staged for it (best effort: a report directory that is not on
        this host is skipped)."""
        if update_info.report is None or not os.path.isdir(update_info.report):
            return
        rank = _worker_rank()
        record = {"version": update_info.version, "source": source, "rank": rank,
                  "pid": os.getpid(), "staged_bytes": staged_bytes}
        try:
            write_atomic(os.path.join(update_info.report, f"{rank}.json"),
                         json.dumps(record).encode(), durable=False, sync_dir=False)
        except OSError:
            log.warning("dbsync: could not write the apply report into %s",
                        update_info.report, exc_info=True)

    def _abandon(self) -> None:
        """End the layerwise reload after a failure: layers that received nothing get their
        previous weights back."""
        try:
            self.finish_weight_update()
        except Exception:  # the original error matters more; the caller goes unhealthy
            log.exception("dbsync: could not finalize the layerwise reload after a failure")

    def shutdown(self) -> None:
        """Stop staging (each update registers and unregisters its own reader)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _find_cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``exc`` or the first exception of ``kind`` it was raised from or during."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def configure_logging() -> None:
    """Show dbsync's INFO lines in this process (vLLM configures only its own loggers), unless
    the ``dbsync`` logger already has a handler."""
    from ..logsetup import add_stderr_handler

    if add_stderr_handler():
        logging.getLogger("dbsync").setLevel(logging.INFO)


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:  # noqa: BLE001 - no distributed state: a single worker
        return 0


def _device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _no_mtp_check() -> Any:
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    return disable_mtp_completeness_check()
