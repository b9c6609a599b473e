"""``dbsync serve-vllm ROOT --model BASE --lora NAME [--max-loras N]``: serve BASE with LoRA
enabled and follow a store of adapter versions, served as model ``NAME``.

Each new version is prepared off the engine (verified, checked, materialised: see
``dbsync.vllm.lora``), loaded into the running engine with ``add_lora`` (one engine-core
utility call between two scheduler steps: generation is never paused) and then made the
target of model ``NAME`` (vLLM's OpenAI layer resolves a request's model name to a
``LoRARequest`` when the request arrives). Requests already running keep the ``LoRARequest``
they were admitted with and finish on that version. The last N versions stay loaded
(``--max-loras``, vLLM's ``max_loras`` and ``max_cpu_loras``); an older version is dropped
from the engine, and its directory deleted once its last request ends.

``GET /dbsync/status``: ``mode: "lora"``, ``name``, ``version`` (newest served; null before
the first), ``lora_int_id``, ``loaded_at``, ``kept`` (the loaded versions, each with its
requests ``in_flight``), ``retiring`` (versions dropped from the engine whose requests still
run), ``refused`` (the last refused version and why, until a newer one is
served), ``refusals``, ``published_version``, ``last_error`` (store errors, retried with
backoff), ``healthy`` (always true: the base weights are never touched), ``timings`` of the
last swap. Requests for ``NAME`` before a first version is served get vLLM's 404.

``GET /metrics`` (vLLM's own) carries the dbsync series of ``dbsync.vllm.metrics``: served and
published version, lag, swaps by outcome (refusals included), bytes applied, and the prepare
time as ``dbsync_read_verify_seconds``; ``dbsync_pause_seconds`` records 0 per swap.

Data parallelism (``-- --data-parallel-size N``): ``add_lora`` and ``remove_lora`` reach every
engine (vLLM's client sends engine calls to each).

Hazard: ``--transport``/``--pause-mode`` do not apply (adapters are read from the filesystem
and never pause generation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..errors import DBSyncError, NothingPublishedError, StoreNotFoundError
from ..store import Store
from ..watch import Watcher
from . import workdirs
from .http import (
    check_one_api_server,
    on_stop_signal,
    parse_server_args,
    remove_stop_callback,
    run_until_stopped,
    serve_app,
)
from .lora import AdapterRefusedError, AdapterVersion, AdapterVersions, expected_of
from .sdnotify import notify

log = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 16
_RETRY_MIN, _RETRY_MAX = 0.5, 30.0


class LoRAServing:
    """Applies each new adapter version of ``versions`` to ``engine`` (an ``AsyncLLM`` /
    ``EngineClient`` running on ``loop``) and points ``models.lora_requests[name]`` (vLLM's
    ``OpenAIServingModels``) at it. ``apply_latest`` blocks; call it from a thread other than
    the loop's. ``start_watching`` runs one thread that applies each version the store's
    watcher reports, and retries store errors with backoff."""

    def __init__(self, versions: AdapterVersions, engine: Any, loop: asyncio.AbstractEventLoop,
                 models: Any = None, poll_interval: float | None = None,
                 rpc_timeout: float = 120.0, metrics: Any = None):
        if metrics is None:
            from .metrics import default_metrics

            metrics = default_metrics()
        #: the dbsync series on vLLM's ``/metrics`` (no pause: ``dbsync_pause_seconds`` gets 0)
        self.metrics = metrics
        self.versions = versions
        metrics.watch_store(self.store_problem)
        self.engine = engine
        self.loop = loop
        self.models = models
        self.poll_interval = poll_interval
        self.rpc_timeout = rpc_timeout
        self.healthy = True
        self.last_error: str | None = None
        self.published_version: int | None = None
        self.timings: dict[str, float] = {}
        self._apply_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: Watcher | None = None

    # the attributes server.install_routes reads
    @property
    def state(self) -> LoRAServing:
        return self

    @property
    def version(self) -> int | None:
        cur = self.versions.current
        return None if cur is None else cur.version

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.rpc_timeout)

    def apply_latest(self) -> int | None:
        """Serve the store's current version (if new); return the newest served version.
        Raises ``AdapterRefusedError`` when it does not fit (the previous one keeps serving)
        and store errors as they come (recorded in ``last_error``)."""
        with self._apply_lock:
            t0 = time.perf_counter()
            try:
                prepared = self.versions.prepare()
            except AdapterRefusedError:
                self.last_error = None
                self.metrics.outcome("refused")
                raise
            except (DBSyncError, OSError) as exc:
                if not _nothing_yet(exc):
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    self.metrics.outcome("failed")
                raise
            if prepared is None:
                self.last_error = None
                return self.version
            t1 = time.perf_counter()
            try:
                self._run(self.engine.add_lora(prepared.request))
            except Exception as exc:  # noqa: BLE001 - vLLM's own refusal of this adapter
                self.metrics.outcome("refused")
                raise self.versions.refuse(prepared, _vllm_reason(exc)) from None
            t2 = time.perf_counter()
            self._run(self._point(prepared))
            for old in self.versions.commit(prepared):
                with contextlib.suppress(Exception):
                    self._run(self.engine.remove_lora(old.lora_int_id))
                self.versions.retire(old)
            self.last_error = None
            self.timings = {"prepare_s": t1 - t0, "add_lora_s": t2 - t1,
                            "total_s": time.perf_counter() - t0}
            self.metrics.applied(pause_s=0.0, read_verify_s=t1 - t0, nbytes=prepared.nbytes,
                                 source="filesystem")
            self.metrics.versions(prepared.version,
                                  max(prepared.version, self.published_version or 0))
            log.info("dbsync: serving adapter %s version %d (lora_int_id %d; prepared in "
                     "%.1f ms, loaded in %.1f ms)", self.versions.name, prepared.version,
                     prepared.lora_int_id, 1e3 * (t1 - t0), 1e3 * (t2 - t1))
            return prepared.version

    async def _point(self, prepared: AdapterVersion) -> None:
        if self.models is not None:
            self.models.lora_requests[self.versions.name] = prepared.request

    def list_by_name(self, models: Any) -> None:
        """Make ``models`` (vLLM's ``OpenAIServingModels``) name each adapter version by the
        name it is requested by (``NAME``), not by its version's request name (``NAME@v4#...``:
        internal, and unknown to clients once a newer version is served): in ``/v1/models``
        and in the ``model`` field of every completion, chat completion and response (the
        version that answered is in the ``x-dbsync-version`` header)."""
        original = models.show_available_models
        original_name = models.model_name

        def model_name(lora_request: Any = None) -> str:
            name = original_name(lora_request)
            return self.versions.name if self.versions.is_request_name(name) else name

        async def show_available_models() -> Any:
            listing = await original()
            named = {r.lora_name: key for key, r in models.lora_requests.items()}
            for card in listing.data:
                card.id = named.get(card.id, card.id)
            return listing

        models.show_available_models = show_available_models
        models.model_name = model_name
        self.models = models

    # ---- following the store ---------------------------------------------------------------
    def start_watching(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="dbsync-lora", daemon=True)
        self._thread.start()
        self._watcher = Watcher(self.versions.root, self._noticed,
                                poll_interval=self.poll_interval).start()

    def _noticed(self, version: int) -> None:
        self.published_version = version
        self.metrics.versions(self.version, version, self._other_run())
        self._wake.set()

    def _other_run(self) -> bool:
        """Whether the store's head is of another training run than the served version (a
        new run at the same path: its every version is unserved)."""
        current = self.versions.current
        if current is None:
            return False
        try:
            published = self.versions.published()
        except Exception:  # noqa: BLE001 - the head cannot be read now: no other run known
            return False
        return published is not None and published[0] != current.run_id

    def _follow(self) -> None:
        delay = _RETRY_MIN
        failing = False
        while not self._stop.is_set():
            # woken by the watcher; on failure, retried with backoff (never spins)
            self._wake.wait(delay if failing else 5.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.apply_latest()
                failing, delay = False, _RETRY_MIN
            except Exception as exc:  # noqa: BLE001 - recorded in status, retried
                if isinstance(exc, AdapterRefusedError) or _nothing_yet(exc):
                    failing = False  # refused versions are not retried; a new one wakes us
                    continue
                if not failing:
                    log.warning("dbsync: could not apply adapter version (%s); retrying", exc)
                self.last_error = f"{type(exc).__name__}: {exc}"
                failing, delay = True, min(delay * 2, _RETRY_MAX) if failing else _RETRY_MIN

    # ---- requests in flight ------------------------------------------------------------
    def wrap_generate(self, engine_client: Any) -> None:
        """Count the requests running on each adapter version, so a dropped version's
        directory stays until its last request ends; and label each HTTP request with the
        adapter version it ran on (``x-dbsync-version`` / ``dbsync_version``, see
        ``dbsync.vllm.versions``)."""
        from .versions import _current as current_request

        original = engine_client.generate
        versions = self.versions

        async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            request = kwargs.get("lora_request")
            adapter = None if request is None else versions.acquire_request(request)
            if adapter is not None and adapter.request is not request:
                kwargs["lora_request"] = adapter.request  # (its version was dropped meanwhile)
            # (the base model's own weights are labelled "default", as in full-weight mode;
            # an adapter not of this store is not labelled)
            label = "default" if request is None else (
                None if adapter is None else str(adapter.version))
            record = current_request.get() if label is not None else None
            if record is not None:
                record.active += 1
            try:
                async for out in original(*args, **kwargs):
                    if record is not None and getattr(out, "finished", False):
                        if label not in record.versions:
                            record.versions.append(label)
                        record.active -= 1  # before the caller turns it into the last chunk
                        record = None
                    yield out
            finally:
                if record is not None:
                    record.active -= 1
                if adapter is not None:
                    versions.release(adapter.lora_int_id)

        engine_client.generate = generate

    def status(self) -> dict[str, Any]:
        return {"mode": "lora", **self.versions.status(), "healthy": self.healthy,
                "published_version": self.published_version, "last_error": self.last_error,
                "timings": self.timings, "store_problem": self.store_problem()}

    def store_problem(self) -> str | None:
        """As ``SwapController.store_problem``: the store gone or the lease not written."""
        return self.versions.receiver.store_problem()

    @property
    def stopping(self) -> bool:
        """True once the server began shutting down (``stop_applying`` or ``stop``)."""
        return self._stop.is_set()

    def stop_applying(self) -> None:
        """Apply no new adapter version from now on: the server is shutting down (a stop
        signal). Never blocks; ``stop`` does the rest."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self.versions.close()


def _vllm_reason(exc: BaseException) -> str:
    text = str(exc)
    start = text.find("Worker failed with error '")
    if start >= 0:
        text = text[start + len("Worker failed with error '"):].split("', please check")[0]
    return text[:1000]


# ---- the server -----------------------------------------------------------------------------
def check_lora_args(name: str, max_loras: int, model: str, extra: Sequence[str]) -> None:
    if max_loras < 2:
        raise DBSyncError("--max-loras must be at least 2 (the newest version and the one "
                          "requests still running were admitted on); use the trainer's "
                          "staleness + 1 or more")
    if not name or "@" in name or "/" in name:
        raise DBSyncError(f"--lora {name!r}: the adapter's model name must be non-empty, "
                          "without '@' or '/'")
    if name == model or name == os.path.basename(os.path.normpath(model)):
        raise DBSyncError(f"--lora {name!r} must differ from the base model's name")
    for flag in ("--max-loras", "--max-cpu-loras", "--lora-modules"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise DBSyncError(f"with --lora, pass {flag} to serve-vllm itself (--max-loras) "
                              "or leave it out")


def serve_lora(root: str | os.PathLike[str], model: str, name: str, max_loras: int = 2,
               host: str | None = None, port: int = 8000, extra_args: Sequence[str] = (),
               poll_interval: float | None = None) -> None:
    """Run the LoRA server until it is stopped (see the module docstring)."""
    from ..serveargs import check_model
    from .server import _apply_defaults, _configure_logging, own_options

    check_model(model)
    extra = list(extra_args)
    check_lora_args(name, max_loras, model, extra)
    Store(root, create=False)  # a missing ROOT fails now, not after the engine started
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args

    args = parse_server_args(model, port, host, extra, "dbsync serve-vllm --lora",
                             own_options())
    check_one_api_server(args)
    args.enable_lora = True
    args.max_loras = max_loras
    args.max_cpu_loras = max_loras
    if not any(a == "--max-lora-rank" or a.startswith("--max-lora-rank=") for a in extra):
        args.max_lora_rank = DEFAULT_MAX_LORA_RANK
    configure_logging_from_args(args)
    _configure_logging()
    _apply_defaults(args, extra)
    validate_parsed_serve_args(args)
    with workdirs.private_engine_sockets():
        run_until_stopped(_serve(args, os.fspath(root), name, max_loras, poll_interval))


async def _serve(args: Any, root: str, name: str, max_loras: int,
                 poll_interval: float | None) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import setup_server

    from .server import _quiet_shutdown, install_routes

    listen_address, sock = setup_server(args, reuse_port=False)
    serving: LoRAServing | None = None
    try:
        async with build_async_engine_client(args) as engine_client:
            _quiet_shutdown(engine_client)
            vllm_config = engine_client.vllm_config
            versions = AdapterVersions(root, name, expected_of(vllm_config, args.model),
                                       max_rank=vllm_config.lora_config.max_lora_rank,
                                       keep=max_loras)
            serving = LoRAServing(versions, engine_client, asyncio.get_running_loop(),
                                  poll_interval=poll_interval)
            serving.wrap_generate(engine_client)
            supported_tasks = await engine_client.get_supported_tasks()
            app = build_app(args, supported_tasks, engine_client.model_config)
            install_routes(app, serving)  # type: ignore[arg-type]
            on_stop_signal(serving.stop_applying)  # (503 and no new adapter while draining)
            await init_app_state(engine_client, app.state, args, supported_tasks)
            serving.list_by_name(app.state.openai_serving_models)
            try:
                await asyncio.to_thread(serving.apply_latest)
            except (DBSyncError, OSError) as exc:  # (recorded; the follower retries
                if _nothing_yet(exc):  # what is not a refusal)
                    log.info("dbsync: no adapter published in %s yet; model %s is served "
                             "from the first one", root, name)
                elif not isinstance(exc, AdapterRefusedError):  # (a refusal is logged)
                    log.warning("dbsync: could not apply an adapter version at start (%s); "
                                "retrying", exc)
            serving.start_watching()
            served = ("no version yet" if serving.version is None
                      else f"version {serving.version}")
            log.info("dbsync: serving %s with adapter %s on %s (store %s, %s)", args.model,
                     name, listen_address, root, served)
            notify("READY=1", f"STATUS=serving adapter {name} ({served}) of {root} on "
                   f"{listen_address}")
            shutdown_task = await serve_app(app, sock, args)
            notify("STOPPING=1")
            # off the loop: the follower thread may be waiting for this loop
            await asyncio.to_thread(serving.stop)
        await shutdown_task
    finally:
        if serving is not None:
            serving.stop()
            remove_stop_callback(serving.stop_applying)
        sock.close()


def _nothing_yet(exc: BaseException) -> bool:
    """Nothing published yet (waited for quietly), as opposed to a store gone or unreachable
    (an error, recorded and retried)."""
    return isinstance(exc, NothingPublishedError) and not isinstance(exc, StoreNotFoundError)
