"""In-process use: training loops that own a ``vllm.LLM`` or an ``AsyncLLM``.

    llm = LLM(model=MODEL_DIR, **dbsync.vllm.engine_args())
    att = dbsync.vllm.attach(llm, ROOT)      # watcher + controller for this engine
    ...
    att.apply_latest()                       # between generate calls: serve the newest version

With an ``AsyncLLM`` (call ``attach`` from inside its event loop), every published version is
applied in the background with the engine's pause/resume around it (``pause_mode`` "keep",
"wait" or "abort");
``await att.apply_latest_async()`` applies on demand.

Transport (``attach(..., transport=)``): "auto" (default) stages versions that a
``dbsync.nccl.BroadcastSender`` broadcasts (NCCL on GPUs, gloo on CPU) in each worker and applies
them from memory, reading the filesystem otherwise; "broadcast" joins the sender's group as soon
as one appears; "filesystem" never joins. The swap itself is the same either way, and
``status()["source"]`` says where the last version came from.

Hazard: an offline ``LLM`` cannot be paused and its client is not thread-safe, so for it the
watcher only records new versions (``att.pending``, ``on_version``); the apply happens when the
caller calls ``apply_latest()`` between its own ``generate`` calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import DBSyncError
from ..serveargs import resolve_model_dir
from ..watch import Watcher
from .checkpoint import expected_from_checkpoint
from .controller import DEFAULT_DRAIN_TIMEOUT, SwapController
from .engine import AsyncEngineOps, LLMOps, check_backend

log = logging.getLogger(__name__)


def _is_async_engine(engine: Any) -> bool:
    return asyncio.iscoroutinefunction(getattr(engine, "pause_generation", None))


def _vllm_config(engine: Any) -> Any:
    if _is_async_engine(engine):
        return engine.vllm_config
    llm_engine = getattr(engine, "llm_engine", None)
    if llm_engine is None:
        raise DBSyncError(f"expected a vllm.LLM or AsyncLLM, got {type(engine).__name__}")
    return llm_engine.vllm_config


class Attachment:
    """A dbsync store attached to one engine. ``status()`` is the same JSON the server
    answers on ``/dbsync/status``."""

    def __init__(self, engine: Any, root: str | os.PathLike[str], *, model_dir: str | None,
                 verify: bool, poll_interval: float | None,
                 loop: asyncio.AbstractEventLoop | None, transport: str = "auto",
                 pause_mode: str = "keep", drain_timeout: float = DEFAULT_DRAIN_TIMEOUT):
        vllm_config = _vllm_config(engine)
        check_backend(vllm_config)
        model_config = vllm_config.model_config
        directory = resolve_model_dir(model_dir or model_config.model)
        expected, allow_missing = expected_from_checkpoint(directory, model_config.dtype)
        self.engine = engine
        self.is_async = _is_async_engine(engine)
        self._loop: asyncio.AbstractEventLoop | None = None
        if self.is_async:
            if loop is None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    raise DBSyncError(
                        "attach an AsyncLLM from inside its event loop, or pass loop="
                    ) from None
            self._loop = loop
            ops: Any = AsyncEngineOps(engine, loop)
        else:
            ops = LLMOps(engine)
        self.controller = SwapController(root, ops, expected, allow_missing, verify=verify,
                                         poll_interval=poll_interval,
                                         workers=vllm_config.parallel_config.world_size_across_dp,
                                         transport=transport, pause_mode=pause_mode,
                                         drain_timeout=drain_timeout)
        try:
            self._init_transport()
        except BaseException:
            self.controller.stop()  # releases the controller's reader lease
            raise
        self._watcher: Watcher | None = None
        self._on_version: Callable[[int], Any] | None = None

    def _init_transport(self) -> None:
        """Start the workers' staging now, so the trainer's next broadcast finds them. On an
        ``AsyncLLM``'s own loop this runs in a thread (the first apply waits for it)."""
        if self.controller.transport == "filesystem":
            return
        if self.is_async and self._on_engine_loop():
            threading.Thread(target=self._init_quietly, name="dbsync-init", daemon=True).start()
        else:
            self.controller.init_transport()

    def _init_quietly(self) -> None:
        try:
            self.controller.init_transport()
        except Exception:  # noqa: BLE001 - the first apply retries and reports it
            log.exception("dbsync: starting the %s transport failed; the first apply retries",
                          self.controller.transport)

    @property
    def version(self) -> int | None:
        """The version being served (None: the model's own checkpoint)."""
        return self.controller.version

    @property
    def pending(self) -> bool:
        """Whether a newer version than the one served has been seen in the store."""
        published = self.controller.state.published_version
        return published is not None and published != self.controller.version

    def status(self) -> dict[str, Any]:
        return self.controller.status()

    def apply_latest(self) -> int | None:
        """Apply the store's current version now (if not already served); return the version
        served. Raises ``IncompatibleWeightsError``/``DamagedVersionError`` on refusal (the
        previous version stays) and ``SwapError`` on a failed apply. For an ``AsyncLLM`` call
        this from a thread other than the engine's loop (or use ``apply_latest_async``)."""
        if self.is_async and self._on_engine_loop():
            raise DBSyncError(
                "apply_latest() would deadlock on the AsyncLLM's own event loop thread; use "
                "`await attachment.apply_latest_async()`"
            )
        return self.controller.apply_latest()

    def _on_engine_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def apply_latest_async(self) -> int | None:
        """``apply_latest`` for code running on the ``AsyncLLM``'s event loop."""
        return await asyncio.to_thread(self.controller.apply_latest)

    def watch(self, on_version: Callable[[int], Any] | None = None) -> Attachment:
        """Start the watcher. ``AsyncLLM``: applies each new version. ``LLM``: records it and
        calls ``on_version(version)`` (from the watcher thread); apply with ``apply_latest``."""
        self._on_version = on_version
        if self.is_async:
            self.controller.start_watching()
            if on_version is not None:
                log.warning("dbsync: on_version is only called for an offline LLM")
        elif self._watcher is None:
            self._watcher = Watcher(self.controller.root, self._noticed,
                                    poll_interval=self.controller.poll_interval).start()
        return self

    def _noticed(self, version: int) -> None:
        self.controller.state.published_version = version
        if self._on_version is not None:
            self._on_version(version)

    def detach(self) -> None:
        """Stop watching, stop the workers' staging (not from an ``AsyncLLM``'s own loop, where
        it would block: the workers then keep staging until the engine shuts down) and
        unregister the reader. The engine keeps the weights it has."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if not (self.is_async and self._on_engine_loop()):
            self.controller.stop_transport()
        self.controller.stop()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def attach(engine: Any, root: str | os.PathLike[str], *, watch: bool = True,
           model_dir: str | None = None, verify: bool = True,
           poll_interval: float | None = None, loop: asyncio.AbstractEventLoop | None = None,
           on_version: Callable[[int], Any] | None = None,
           transport: str = "auto", pause_mode: str = "keep",
           drain_timeout: float = DEFAULT_DRAIN_TIMEOUT, lora: str | None = None) -> Any:
    """Attach the dbsync store at ``root`` to ``engine`` (a ``vllm.LLM`` or ``AsyncLLM``
    created with ``**dbsync.vllm.engine_args()``). With ``watch`` a background watcher follows
    the store (see ``Attachment.watch``). ``model_dir``: the checkpoint the engine was started
    from, when ``model_config.model`` is not a local directory or cached hub id.
    ``transport``: "auto", "broadcast" or "filesystem" (see the module docstring).
    ``pause_mode`` (``AsyncLLM`` only): what happens to requests in flight during a swap:
    "keep" (held, finished on the new version), "wait" (drained first, at most
    ``drain_timeout`` seconds, then the rest kept) or "abort" (see
    ``dbsync.vllm.controller``).

    ``lora="NAME"``: ``root`` holds LoRA adapters; returns a ``dbsync.vllm.lora.LoRAAttachment``
    whose ``latest()`` is the ``LoRARequest`` of the newest version (the engine needs
    ``enable_lora=True``, not the dbsync backend; see docs/LORA.md)."""
    if lora is not None:
        from .lora import attach_lora

        return attach_lora(engine, root, lora, model_dir=model_dir, verify=verify)
    attachment = Attachment(engine, root, model_dir=model_dir, verify=verify,
                            poll_interval=poll_interval, loop=loop, transport=transport,
                            pause_mode=pause_mode, drain_timeout=drain_timeout)
    if watch:
        attachment.watch(on_version)
    return attachment


def apply_latest(engine: Any, root: str | os.PathLike[str], **kwargs: Any) -> int | None:
    """One-shot: apply the current version of ``root`` to ``engine`` (a ``vllm.LLM``) and
    return it. Keep an ``Attachment`` instead when applying repeatedly (only an attachment
    can take broadcasts: here the transport defaults to "filesystem")."""
    kwargs.setdefault("transport", "filesystem")
    with attach(engine, root, watch=False, **kwargs) as attachment:
        return attachment.apply_latest()
