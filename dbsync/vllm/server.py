"""``dbsync serve-vllm``: vLLM's OpenAI-compatible server that follows a dbsync store.

    python -m dbsync.vllm.server ROOT --model MODEL_DIR [--host H] [--port P]
        [--poll-interval S] [--transport auto|broadcast|filesystem]
        [--pause-mode keep|wait|abort] [--drain-timeout S] [-- any vLLM server args]

One process: vLLM's own app (built with vLLM's ``build_app``/``init_app_state``/``serve_http``,
so every vLLM option works) plus

- ``GET /dbsync/status`` on the same port: ``version`` (served, or null while serving the
  model directory's own weights), ``loaded_at``, ``healthy``, ``last_error``, ``timings`` of
  the last swap, and more (see ``SwapController.status``). No dev-mode route is enabled.
- before the port accepts requests, the store's current version is applied (a late joiner
  serves the current weights from its first request);
- a watcher that applies every later version (see ``dbsync.vllm.controller``);
- ``--transport`` (default "auto"): each worker stages the versions a
  ``dbsync.nccl.BroadcastSender`` broadcasts (NCCL on GPUs, gloo on CPU) and applies them from
  memory, else reads the filesystem; ``/dbsync/status`` shows ``source`` of the last swap.
  Without a ``ROOT/broadcast.json`` "auto" costs one ``stat`` per second per worker;
- while the engine is unhealthy (a failed apply may have left a mix of versions), inference
  routes and ``/health`` answer 503; requests already held by the pause finish once a
  complete version is applied;
- which version answered: ``x-dbsync-version`` / ``x-dbsync-versions`` response headers, and
  ``dbsync_version`` / ``dbsync_versions`` in the last streamed chunks (``dbsync.vllm.versions``);
- ``--pause-mode`` keep (default) | wait | abort: what happens to requests in flight during a
  swap (``dbsync.vllm.controller``);
- dbsync series on vLLM's ``/metrics`` (``dbsync.vllm.metrics``).

Defaults that differ from plain vLLM, each overridden by passing the vLLM option after ``--``:
on a CPU host the KV cache is ``min(1 GiB, a quarter of the available memory)`` (vLLM would
reserve 92% of the node's memory and refuse to start when less is free; ``VLLM_CPU_KVCACHE_SPACE``
and ``--gpu-memory-utilization`` are honoured) and the model runs eagerly (``--enforce-eager``;
compiling costs tens of seconds per start on a few cores: pass ``-O`` or
``--compilation-config`` to compile); ``--shutdown-timeout`` is 10 s (SIGTERM lets requests in
flight finish and stops the engine cleanly instead of killing it). A ``--model`` path that does
not exist fails at once instead of being tried as a Hugging Face hub id.

Data parallelism (``-- --data-parallel-size N``): one API server balances N engines, and every
swap pauses, updates and resumes all of them together (vLLM's client sends each engine call to
every engine), so no two engines serve different versions after a swap.

Hazard: one API server process only (``--api-server-count`` > 1, and data-parallel ranks
balanced outside it, are refused): the controller must own the only path to the engines.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import DBSyncError
from ..serveargs import check_model, resolve_model_dir
from ..store import root_problem
from . import workdirs
from .broadcast import TRANSPORTS, check_transport
from .checkpoint import expected_from_checkpoint
from .controller import DEFAULT_DRAIN_TIMEOUT, PAUSE_MODES, SwapController, check_pause_mode
from .engine import AsyncEngineOps, engine_args
from .http import (
    check_one_api_server,
    check_owned_options,
    on_stop_signal,
    parse_server_args,
    remove_stop_callback,
    run_until_stopped,
    serve_app,
)
from .plugin import configure_logging
from .sdnotify import notify
from .versions import VersionStamp, wrap_generate

log = logging.getLogger("dbsync.vllm.server")

STATUS_PATH = "/dbsync/status"
CPU_KV_CACHE_BYTES = 2**30
SHUTDOWN_TIMEOUT_S = 10
_GATED_PREFIXES = ("/v1/", "/health", "/generate", "/inference/", "/invocations", "/pooling",
                   "/classify", "/score", "/rerank")


def serve(root: str | os.PathLike[str], model: str, host: str | None = None,
          port: int = 8000, extra_args: Sequence[str] = (),
          poll_interval: float | None = None, transport: str = "auto",
          pause_mode: str = "keep", drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
          lora: str | None = None, max_loras: int = 2) -> None:
    """Run the server until it is stopped (SIGINT/SIGTERM). ``extra_args`` are vLLM server
    arguments (e.g. ``["--dtype", "bfloat16", "--max-model-len", "4096"]``). ``transport``:
    "auto", "broadcast" or "filesystem"; ``pause_mode``: "keep", "wait" (drain for at most
    ``drain_timeout`` seconds) or "abort" (see the module docstring). Raises ``DBSyncError``
    for arguments that cannot work with dbsync."""
    if lora is not None:  # a store of LoRA adapters, served as model ``lora``
        from .lora_server import serve_lora

        serve_lora(root, model, lora, max_loras, host=host, port=port, extra_args=extra_args,
                   poll_interval=poll_interval)
        return
    extra = list(extra_args)
    check_owned_options(extra)  # usage first, before any path is looked at
    check_transport(transport)
    check_pause_mode(pause_mode)
    check_model(model)
    problem = root_problem(root)  # before the engine's minute of start-up, not after it
    if problem is not None:
        raise DBSyncError(problem)
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args

    args = parse_server_args(model, port, host, extra, "dbsync serve-vllm", own_options())
    _add_dbsync_engine_args(args)
    configure_logging_from_args(args)
    _configure_logging()
    _apply_defaults(args, extra)
    validate_parsed_serve_args(args)
    with workdirs.private_engine_sockets():
        run_until_stopped(_serve(args, os.fspath(root), poll_interval, transport, pause_mode,
                                 drain_timeout))


def _given(extra: Sequence[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") or (f == "-O" and a.startswith("-O"))
               for a in extra for f in flags)


def _apply_defaults(args: argparse.Namespace, extra: Sequence[str]) -> None:
    """serve-vllm's defaults (see the module docstring), each only where the option was not
    given."""
    if not _given(extra, "--shutdown-timeout"):
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if (args.kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
            and not _given(extra, "--gpu-memory-utilization")):
        import psutil

        args.kv_cache_memory_bytes = min(CPU_KV_CACHE_BYTES,
                                         psutil.virtual_memory().available // 4)
        log.info("dbsync: CPU host: KV cache of %.2f GiB (pass --kv-cache-memory-bytes after "
                 "'--' to change it)", args.kv_cache_memory_bytes / 2**30)
    if not args.enforce_eager and not _given(extra, "-O", "--compilation-config", "-cc"):
        args.enforce_eager = True
        log.info("dbsync: CPU host: running the model eagerly (pass -O3 after '--' to "
                 "compile it)")


def _configure_logging() -> None:
    """Show dbsync's INFO lines (one per swap, one per refusal) next to vLLM's."""
    configure_logging()


def _add_dbsync_engine_args(args: argparse.Namespace) -> None:
    check_one_api_server(args)
    wanted = engine_args(worker_extension_cls=args.worker_extension_cls or None)
    current = args.weight_transfer_config
    backend = None if current is None else (
        current.get("backend") if isinstance(current, dict) else current.backend)
    if backend not in (None, "dbsync"):
        raise DBSyncError(f"--weight-transfer-config selects {backend!r}; serve-vllm needs "
                          "the dbsync backend (leave the option out)")
    args.weight_transfer_config = wanted["weight_transfer_config"]
    if "worker_extension_cls" in wanted:
        args.worker_extension_cls = wanted["worker_extension_cls"]


async def _serve(args: argparse.Namespace, root: str, poll_interval: float | None,
                 transport: str, pause_mode: str, drain_timeout: float) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(args, reuse_port=False)
    controller: SwapController | None = None
    try:
        async with build_async_engine_client(args) as engine_client:
            _quiet_shutdown(engine_client)
            wrap_generate(engine_client)
            model_config = engine_client.model_config
            expected, allow_missing = expected_from_checkpoint(
                resolve_model_dir(args.model), model_config.dtype)
            controller = SwapController(
                root, AsyncEngineOps(engine_client, asyncio.get_running_loop()), expected,
                allow_missing, poll_interval=poll_interval,
                workers=engine_client.vllm_config.parallel_config.world_size_across_dp,
                transport=transport, pause_mode=pause_mode, drain_timeout=drain_timeout)
            on_stop_signal(controller.stop_applying)  # (no swap while the server drains)
            supported_tasks = await engine_client.get_supported_tasks()
            app = build_app(args, supported_tasks, model_config)
            install_routes(app, controller)
            await init_app_state(engine_client, app.state, args, supported_tasks)
            # Start the workers' staging (broadcast transports), then, as a late joiner,
            # serve the current version from the first request on.
            try:
                await asyncio.to_thread(controller.init_transport)
            except DBSyncError as exc:
                raise DBSyncError(f"could not start the {transport} transport: {exc}") from exc
            try:
                await asyncio.to_thread(controller.apply_latest)
            except (DBSyncError, OSError):
                pass  # recorded and logged; the watcher retries what is not a refusal
            controller.start_watching()
            served = ("no version yet" if controller.version is None
                      else f"version {controller.version}")
            log.info("dbsync: serving %s on %s (store %s, %s)", args.model, listen_address,
                     root, served)
            notify("READY=1", f"STATUS=serving {served} of {root} on {listen_address}")
            shutdown_task = await serve_app(app, sock, args)
            notify("STOPPING=1")
            controller.stop_applying()  # (no swap holds the shutdown up)
            # (in a thread: a swap under way waits on this loop for its engine calls)
            await asyncio.to_thread(controller.stop)
        await shutdown_task
    finally:
        if controller is not None:
            controller.stop_applying()
            await asyncio.to_thread(controller.stop)
            remove_stop_callback(controller.stop_applying)
        sock.close()


def install_routes(app: Any, controller: SwapController) -> None:
    """Add ``GET /dbsync/status`` (ahead of every other route), the unhealthy gate and the
    version stamp (``dbsync.vllm.versions``)."""

    async def dbsync_status() -> dict[str, Any]:
        return controller.status()

    app.add_api_route(STATUS_PATH, dbsync_status, methods=["GET"], include_in_schema=True,
                      name="dbsync_status", summary="dbsync: the served version and health")
    routes = app.router.routes
    routes.insert(0, routes.pop())

    # The app's middleware stack may already be built (vLLM's bootstrap), so the gate wraps
    # the built stack as plain ASGI instead of going through add_middleware.
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    app.middleware_stack = VersionStamp(_UnhealthyGate(app.middleware_stack, controller))


def _quiet_shutdown(engine_client: Any) -> None:
    """A stop that the server asked for (SIGTERM, SIGINT) ends the engine's output loop, and
    any request still open, with ``EngineDeadError``, which vLLM logs as ERROR tracebacks: log
    one INFO line each instead, only once the engine client is being shut down."""
    original = engine_client.shutdown
    stopping = False

    def shutdown(*args: Any, **kwargs: Any) -> Any:
        nonlocal stopping
        stopping = True
        return original(*args, **kwargs)

    class _StoppedFilter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            exc = record.exc_info[1] if record.exc_info else None
            if stopping and type(exc).__name__ == "EngineDeadError":
                record.msg, record.args = "dbsync: the engine stopped (server shutdown)", ()
                record.levelno, record.levelname = logging.INFO, "INFO"
                record.exc_info, record.exc_text = None, None
            return True

    engine_client.shutdown = shutdown
    # (and each request a stopped engine ends: a stream cut short by the shutdown, such as
    # one held by a swap the stop abandoned, is said in one INFO line, not a traceback)
    for name in ("vllm.v1.engine.async_llm", "vllm.entrypoints.openai.completion.serving",
                 "vllm.entrypoints.openai.chat_completion.serving"):
        logging.getLogger(name).addFilter(_StoppedFilter())


class _UnhealthyGate:
    """503 for inference routes and /health while the engine may hold a mix of versions, and
    once the server is shutting down (SIGTERM: requests in flight finish, new ones are sent
    elsewhere by a load balancer that reads /health, instead of failing with 500)."""

    def __init__(self, inner: Any, controller: SwapController):
        self.inner = inner
        self.controller = controller

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        controller = self.controller
        if (scope["type"] == "http" and (controller.stopping or not controller.healthy)
                and scope["path"].startswith(_GATED_PREFIXES)):
            from fastapi.responses import JSONResponse

            message = ("dbsync: the server is shutting down; send requests to another "
                       "replica" if controller.stopping else
                       "dbsync: the engine is unhealthy until a complete version is applied: "
                       f"{controller.state.last_error}")
            response = JSONResponse(
                {"error": {"message": message, "type": "ServiceUnavailable", "code": 503}},
                status_code=503)
            await response(scope, receive, send)
            return
        await self.inner(scope, receive, send)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dbsync serve-vllm",
        description="Serve MODEL with vLLM's OpenAI-compatible server, hot-swapping every "
                    "version published in ROOT. Arguments after '--' go to vLLM.")
    parser.add_argument("root", help="the dbsync store to follow")
    parser.add_argument("--model", required=True,
                        help="the checkpoint vLLM starts from: its directory, or a hub id "
                             "already in the local Hugging Face cache")
    parser.add_argument("--host", default=None, help="bind address (default: all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--poll-interval", type=float, default=None,
                        help="seconds between manifest polls on network filesystems "
                             "(default 1.0; local filesystems use inotify)")
    parser.add_argument("--transport", choices=TRANSPORTS, default="auto",
                        help="how versions reach the workers: 'auto' (the trainer's broadcast "
                             "when ROOT/broadcast.json offers one this engine can join, else "
                             "the filesystem), 'broadcast' (join it as soon as it appears) or "
                             "'filesystem'")
    parser.add_argument("--pause-mode", choices=PAUSE_MODES, default="keep",
                        help="requests in flight during a swap: 'keep' (held, finished on the "
                             "new version), 'wait' (drain them first, at most --drain-timeout "
                             "seconds, then keep the rest) or 'abort'")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
                        help="seconds --pause-mode wait lets requests in flight finish "
                             f"(default {DEFAULT_DRAIN_TIMEOUT:g})")
    parser.add_argument("--lora", default=None, metavar="NAME",
                        help="ROOT holds LoRA adapters: serve MODEL with LoRA enabled and each "
                             "new adapter version as model NAME, without pausing generation "
                             "(docs/LORA.md)")
    parser.add_argument("--max-loras", type=int, default=2, metavar="N",
                        help="with --lora: adapter versions kept loaded (>= 2; the trainer's "
                             "staleness + 1 or more)")
    return parser


def own_options() -> list[str]:
    """serve-vllm's own long options (given after '--', vLLM would not know them)."""
    return [flag for flag in build_parser()._option_string_actions if flag.startswith("--")]


def main(argv: Sequence[str] | None = None) -> int:
    """``dbsync serve-vllm`` entry: ``argv`` as in the module docstring (without the program
    name). Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    opts = build_parser().parse_args(argv)
    for flag, value in (("--drain-timeout", opts.drain_timeout),
                        ("--poll-interval", opts.poll_interval)):
        if value is not None and not 0 < value < math.inf:  # (False for NaN)
            print(f"dbsync serve-vllm: {flag} must be a finite number of seconds > 0",
                  file=sys.stderr)
            return 2
    try:
        serve(opts.root, opts.model, host=opts.host, port=opts.port, extra_args=extra,
              poll_interval=opts.poll_interval, transport=opts.transport,
              pause_mode=opts.pause_mode, drain_timeout=opts.drain_timeout,
              lora=opts.lora, max_loras=opts.max_loras)
    except DBSyncError as exc:
        print(f"dbsync serve-vllm: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", None)  # (StopSignal: SIGTERM/SIGHUP at start-up)
        if signum is not None:
            print(f"dbsync serve-vllm: stopped by {exc} while starting; the engine was shut "
                  "down", file=sys.stderr)
        _exit_now(130 if signum is None else 128 + signum)
    except RuntimeError as exc:
        if "Engine core initialization failed" not in str(exc):
            raise
        print(f"dbsync serve-vllm: vLLM could not start the engine; its log above says why "
              f"(the first ERROR line), e.g. not enough memory for the KV cache: lower "
              f"--kv-cache-memory-bytes or --max-model-len after '--' ({exc})", file=sys.stderr)
        return 1
    _exit_now(0)
    return 0


def _exit_now(code: int) -> None:
    """Exit after a clean shutdown without the interpreter's teardown, where native
    extensions vLLM imports (triton's nanobind bindings) print pages of leak warnings about
    objects that are freed with the process anyway. Logs and streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
