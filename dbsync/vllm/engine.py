"""Engine adapters (``EngineOps``) for ``vllm.LLM`` and ``AsyncLLM``, and the engine arguments
that enable the ``dbsync`` backend.

Hazards:
- ``LLMOps`` cannot pause: an offline ``LLM`` generates only inside the caller's own
  ``generate`` calls, so swaps must happen between them, on the caller's thread or with the
  caller guaranteeing that no ``generate`` runs meanwhile (vLLM's offline client is not
  thread-safe).
- ``AsyncEngineOps`` runs each call on the engine's event loop and blocks the calling thread
  until it is done; calling it from that loop's own thread would deadlock, so it refuses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from importlib.metadata import entry_points
from typing import Any

from ..errors import DBSyncError
from .plugin import BACKEND, register

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm.general_plugins"
WORKER_EXTENSION = "dbsync.vllm.worker_ext.DBSyncWorkerExtension"
DEFAULT_RPC_TIMEOUT = 600.0


def entry_point_installed() -> bool:
    """Whether vLLM workers will load ``register`` through the ``vllm.general_plugins`` entry
    point (dbsync installed, and not excluded by ``VLLM_PLUGINS``)."""
    import os

    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and BACKEND not in {p.strip() for p in allowed.split(",")}:
        return False
    return BACKEND in names


def engine_args(worker_extension_cls: str | None = None) -> dict[str, Any]:
    """Keyword arguments to add to ``vllm.LLM(...)`` / ``AsyncEngineArgs(...)`` so the engine
    can receive dbsync versions. Where the entry point is not installed, workers register the
    backend through ``worker_extension_cls`` instead (only if no other extension is set)."""
    register()
    kwargs: dict[str, Any] = {"weight_transfer_config": {"backend": BACKEND}}
    if not entry_point_installed():
        if worker_extension_cls not in (None, "", WORKER_EXTENSION):
            raise DBSyncError(
                "the dbsync vllm.general_plugins entry point is not installed (or VLLM_PLUGINS "
                f"excludes it) and worker_extension_cls is already {worker_extension_cls!r}; "
                "install dbsync (pip install -e .) so workers register the backend"
            )
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs


def init_request(init_info: dict[str, Any]) -> Any:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    return WeightTransferInitRequest(init_info=init_info)


def check_backend(vllm_config: Any) -> None:
    wt = getattr(vllm_config, "weight_transfer_config", None)
    backend = None if wt is None else wt.backend
    if backend != BACKEND:
        raise DBSyncError(
            f"this engine's weight transfer backend is {backend!r}, not {BACKEND!r}; create it "
            "with **dbsync.vllm.engine_args() (or --weight-transfer-config "
            "'{\"backend\": \"dbsync\"}')"
        )


def _is_multimodal(engine: Any) -> bool:
    """Whether ``engine`` (a ``vllm.LLM`` or an ``EngineClient``) serves a multimodal model,
    whose encoder cache keeps the outputs of its vision (or audio) encoder by input: after a
    swap they were computed with the old weights. vLLM's own update path (a pause with
    ``clear_cache=True``) drops them; dbsync pauses without it (it would drop the KV of
    requests held through the swap) and drops what is stale itself."""
    config = getattr(engine, "model_config", None)
    return bool(getattr(config, "is_multimodal_model", False))


class LLMOps:
    """``EngineOps`` for an offline ``vllm.LLM``. ``pause``/``resume`` do nothing (see the
    module hazards)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def pause(self, mode: str = "keep", drain_timeout: float = 0.0) -> str:
        return mode  # nothing runs between the caller's generate calls

    def resume(self) -> None:
        pass

    def start(self) -> None:
        self.llm.start_weight_update()

    def update(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish(self, weight_version: str) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def drop_stale_caches(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise DBSyncError("vLLM could not reset the prefix cache after the swap")
        if _is_multimodal(self.llm):
            self.llm.llm_engine.reset_encoder_cache()


class EngineClosed(DBSyncError):
    """An engine call refused or abandoned because the server is shutting down."""


def _log_abort_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.info("dbsync: could not abort the requests held by the abandoned swap (%s); they "
                 "end with the engine", future.exception())


def _log_core_abort_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("dbsync: the engine core did not take the abort of the held requests (%s); "
                  "it is shutting down, and their clients have their answer already",
                  future.exception())


class AsyncEngineOps:
    """``EngineOps`` for an ``AsyncLLM`` (or any vLLM ``EngineClient``) running on ``loop``."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop,
                 timeout: float = DEFAULT_RPC_TIMEOUT):
        self.engine = engine
        self.loop = loop
        self.timeout = timeout
        self._lock = threading.Lock()
        self._closed = False
        self._pending: set[concurrent.futures.Future[Any]] = set()
        #: generation paused by ``pause`` and not resumed since (requests may be held)
        self._paused = False

    def close(self) -> None:
        """Refuse engine calls from now on and abandon those under way (they raise
        ``EngineClosed`` at once): the server is shutting down, and a call waiting on the
        engine's loop must not hold up the stop, nor the loop wait for the call. Requests held
        by a swap's pause are aborted (their clients get an answer that says so, and the
        server's shutdown need not wait for them: a paused engine would never finish them);
        generation is never resumed on weights a swap may have left half applied."""
        with self._lock:
            held = self._paused and not self._closed  # (aborted once, by the first close)
            self._closed = True
            pending = list(self._pending)
        for future in pending:
            future.cancel()  # (and the coroutine on the loop is cancelled in turn)
        if not held or self.loop.is_closed():
            return
        if getattr(getattr(self.engine, "output_processor", None), "request_states",
                   None) is None:  # (an engine client of another kind: ask its core)
            aborted = asyncio.run_coroutine_threadsafe(self._pause_coro("abort"), self.loop)
            aborted.add_done_callback(_log_abort_failure)
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # (the stop signal's callback: on the engine's loop)
            self._abort_held_now()
        else:
            self.loop.call_soon_threadsafe(self._abort_held_now)

    def _abort_held_now(self) -> None:
        """On the engine's loop: end every request in flight (those the swap's pause holds)
        with finish_reason "abort" in the front end at once, so their clients get their answer
        whatever the engine core is doing: a stop signal starts the core's shutdown right
        after this, and a core shutting down refuses calls (the held requests' clients then
        waited for the server's grace period and got a 500 or a cut stream). The core is
        then asked to drop them too."""
        processor = self.engine.output_processor
        try:
            ids = processor.abort_requests(list(processor.request_states), internal=True)
        except Exception as exc:  # noqa: BLE001 - the server must still stop
            log.warning("dbsync: could not end the requests held by the abandoned swap (%s); "
                        "they end with the engine", exc)
            return
        if not ids:
            return
        log.info("dbsync: the stop ended %d request(s) held by the swap (finish_reason "
                 "\"abort\")", len(ids))
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "abort_requests_async"):
            asyncio.ensure_future(core.abort_requests_async(ids), loop=self.loop
                                  ).add_done_callback(_log_core_abort_failure)

    def _run(self, coro: Any) -> Any:
        if self.loop.is_closed():
            coro.close()
            raise DBSyncError("the engine's event loop is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise DBSyncError(
                "dbsync must not apply a version from the engine's own event loop thread (it "
                "would deadlock); use `await attachment.apply_latest_async()`"
            )
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineClosed("the server is shutting down: no more engine calls")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._pending.add(future)
        try:
            return future.result(self.timeout)
        except concurrent.futures.CancelledError:
            raise EngineClosed("the server is shutting down: the engine call was abandoned"
                               ) from None
        finally:
            with self._lock:
                self._pending.discard(future)

    def init(self, init_info: dict[str, Any]) -> None:
        self._run(self.engine.init_weight_transfer_engine(init_request(init_info)))

    def pause(self, mode: str = "keep", drain_timeout: float = 30.0) -> str:
        """Pause in ``mode``; "wait" drains for at most ``drain_timeout`` seconds, then holds
        the rest ("keep"). Returns the mode that took effect."""
        with self._lock:
            self._paused = True  # (from the call on: a pause the stop abandons may still
            # take effect on the engine)
        try:
            if mode == "wait":
                try:
                    self._run(asyncio.wait_for(self._pause_coro("wait"), drain_timeout))
                    return "wait"
                except TimeoutError:
                    log.info("dbsync: requests in flight did not finish within %.1f s; "
                             "holding the rest for the swap (pause mode keep)", drain_timeout)
            self._run(self._pause_coro("abort" if mode == "abort" else "keep"))
            return "abort" if mode == "abort" else "keep"
        except EngineClosed:
            raise
        except BaseException:
            with self._lock:
                self._paused = False  # (a pause the engine refused holds nothing)
            raise

    def _pause_coro(self, mode: str) -> Any:
        # AsyncLLM.pause_generation is pause_scheduler_async plus a 20 ms settle sleep (vLLM
        # says it is not needed for correctness); skip the sleep where the core is reachable.
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "pause_scheduler_async"):
            return core.pause_scheduler_async(mode=mode, clear_cache=False)
        return self.engine.pause_generation(mode=mode, clear_cache=False)

    def resume(self) -> None:
        self._run(self.engine.resume_generation())
        with self._lock:
            self._paused = False

    def start(self) -> None:
        self._run(self.engine.start_weight_update())

    def update(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info)))

    def finish(self, weight_version: str) -> None:
        self._run(self.engine.finish_weight_update(weight_version=weight_version))

    def drop_stale_caches(self) -> None:
        # Requests frozen by pause(keep) hold KV computed with the old weights: preempt them so
        # they recompute with the new ones (a preempted request holds no encoder output), and
        # drop every cached prefix.
        if not self._run(self.engine.reset_prefix_cache(reset_running_requests=True)):
            raise DBSyncError("vLLM could not reset the prefix cache after the swap")
        if _is_multimodal(self.engine):
            self._run(self.engine.reset_encoder_cache())
