"""vLLM's OpenAI server, as both ``serve-vllm`` modes (full weights, LoRA) run it: one place
for parsing vLLM's own server arguments and for serving the built app on its socket."""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..errors import DBSyncError
from ..serveargs import OWNED_OPTIONS, check_owned_options

log = logging.getLogger(__name__)


def parse_server_args(model: str, port: int, host: str | None, extra: Sequence[str],
                      description: str, own_options: Sequence[str] = OWNED_OPTIONS) -> Any:
    """vLLM's parsed server arguments for ``model`` on ``host:port`` plus ``extra``. A bad
    option raises ``DBSyncError`` in one paragraph; one of ``own_options`` (serve-vllm's)
    among ``extra`` is named as such."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    check_owned_options(extra)
    argv = ["--model", model, "--port", str(port), *extra]
    if host is not None:
        argv += ["--host", host]
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description=description))

    def error(message: str) -> NoReturn:  # (argparse's own prints its whole usage: pages)
        raise DBSyncError(_usage_error(message, parser, own_options))

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def check_one_api_server(args: Any) -> None:
    """Refuse the vLLM options that would give the engines another path than this server's:
    more API server processes, and data-parallel ranks balanced outside it. (Data parallelism
    balanced by this server, ``--data-parallel-size N``, is served: each engine call reaches
    every engine.)"""
    if (getattr(args, "api_server_count", None) or 1) > 1:
        raise DBSyncError("serve-vllm runs one API server (the one path to its engines, which "
                          "it pauses for each swap); remove --api-server-count")
    if getattr(args, "data_parallel_rank", None) is not None or getattr(
            args, "data_parallel_external_lb", False) or getattr(
            args, "data_parallel_hybrid_lb", False):
        raise DBSyncError("serve-vllm balances its data-parallel engines itself (one API "
                          "server for all of them, each engine swapped in the same pause); "
                          "remove --data-parallel-rank / --data-parallel-external-lb / "
                          "--data-parallel-hybrid-lb, or run one serve-vllm per engine with "
                          "--data-parallel-size 1")


def _usage_error(message: str, parser: Any, own_options: Sequence[str]) -> str:
    """One paragraph for a bad vLLM option: what argparse said, and for each unknown option
    whether it is serve-vllm's own (given after '--') or what it may be a typo of."""
    hints = []
    if message.startswith("unrecognized arguments:"):
        known = [flag for flag in parser._option_string_actions if flag.startswith("--")]
        for arg in message.partition(":")[2].split():
            flag = arg.partition("=")[0]
            if not flag.startswith("--"):
                continue
            if flag in own_options:
                hints.append(f"{flag} is an option of serve-vllm itself: give it before '--'")
                continue
            close = difflib.get_close_matches(flag, [*own_options, *known], n=1)
            hints.append(f"{flag}: did you mean {close[0]}?" if close
                         else f"{flag} is neither a serve-vllm nor a vLLM server option")
    return (message + "".join(f"; {h}" for h in hints) + " (serve-vllm's options come before "
            "'--': dbsync serve-vllm --help; vLLM's after it: vllm serve --help)")


#: seconds the HTTP server waits, once the engine stopped, for requests still open before it
#: cuts them short (their clients see the connection close)
HTTP_GRACE_S = 5.0


class _CutShortFilter(logging.Filter):
    """uvicorn's ERROR line for requests cut short at shutdown, said as a WARNING: at a stop
    during a swap, the requests the swap held are expected to end that way."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError) and "graceful shutdown" in str(exc):
            return False  # (each such request's traceback: the WARNING below said it)
        if "timeout graceful shutdown exceeded" in str(record.msg):
            record.msg = ("dbsync: %s request(s) still open %.0f s after the engine stopped "
                          "(held by a swap the shutdown abandoned?) were cut short")
            record.args = (*(record.args or ("some",))[:1], HTTP_GRACE_S)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


async def serve_app(app: Any, sock: Any, args: Any) -> asyncio.Task:
    """Start serving ``app`` on ``sock`` with the options in ``args`` (vLLM's parsed server
    arguments). Returns vLLM's shutdown task: await it after the server stopped."""
    from vllm import envs
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    # A request the engine can no longer finish (held by a swap abandoned at shutdown, on an
    # engine that stopped) would keep the HTTP server waiting for its connection forever.
    uvicorn_kwargs: dict[str, Any] = {"timeout_graceful_shutdown": HTTP_GRACE_S}
    if (log_config := get_uvicorn_log_config(args)) is not None:
        uvicorn_kwargs["log_config"] = log_config
    logging.getLogger("uvicorn.error").addFilter(_CutShortFilter())
    return await serve_http(
        app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh,
        host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        h11_max_header_count=args.h11_max_header_count, **uvicorn_kwargs)


#: called (on the server's loop) as soon as a stop signal arrives, before vLLM's own handler
_ON_STOP_SIGNAL: list[Callable[[], None]] = []


def on_stop_signal(callback: Callable[[], None]) -> None:
    """Have ``callback`` called as soon as SIGINT or SIGTERM reaches the server (it must not
    block: it runs on the server's event loop), e.g. so that no swap starts while the server
    drains its requests and shuts the engine down."""
    _ON_STOP_SIGNAL.append(callback)


def remove_stop_callback(callback: Callable[[], None]) -> None:
    """Undo ``on_stop_signal(callback)`` (a server stopped; another may start in-process)."""
    with contextlib.suppress(ValueError):
        _ON_STOP_SIGNAL.remove(callback)


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP while the server was starting (before vLLM's own handlers were in
    place): the start-up was cancelled as Ctrl-C cancels it, and the engine's processes
    already started were stopped on the way out instead of being left running."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: stop signals the server handles from its start (SIGINT is asyncio's own)
_STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def run_until_stopped(main: Any) -> None:
    """Run the server coroutine ``main`` on uvloop until it returns. Raises
    ``KeyboardInterrupt`` after a clean stop that Ctrl-C (SIGINT) asked for: vLLM's handlers
    stop on SIGINT and SIGTERM alike, and an interrupted server must still exit 130.

    Before vLLM's handlers are in place (the engine loading, tens of seconds), SIGTERM and
    SIGHUP cancel ``main`` as Ctrl-C does (its ``finally`` blocks stop the engine), and then
    raise ``StopSignal``: their default action killed this process alone and left the
    engine's processes running (on a GPU, holding its memory). This holds also where the
    process was started with SIGINT ignored (a shell script's background job, many batch
    schedulers), where asyncio leaves Ctrl-C ignored. Once serving, SIGHUP stops the server
    as SIGTERM does."""
    import uvloop

    stops: list[int] = []
    early: list[int] = []
    # Signals this process was started ignoring stay ignored (``nohup`` ignores SIGHUP).
    # Handlers can only be set from the main thread: elsewhere the signals keep what they did.
    in_main = threading.current_thread() is threading.main_thread()
    ignored = {s for s in (signal.SIGINT, *_STARTUP_SIGNALS)
               if in_main and signal.getsignal(s) is signal.SIG_IGN}
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []

    async def tracked() -> Any:
        task = asyncio.current_task()
        assert task is not None
        running.append((asyncio.get_running_loop(), task))
        return await main

    class Loop(uvloop.Loop):  # type: ignore[misc, name-defined]
        def add_signal_handler(self, sig: int, callback: Any, *args: Any) -> None:
            def noted(*given: Any) -> None:
                stops.append(sig)
                for stopping in _ON_STOP_SIGNAL:
                    try:
                        stopping()
                    except Exception:  # noqa: BLE001 - the server must still stop
                        log.exception("dbsync: a stop callback failed")
                callback(*given)

            super().add_signal_handler(sig, noted, *args)
            if sig == signal.SIGTERM and signal.SIGHUP not in ignored:
                super().add_signal_handler(signal.SIGHUP, noted, *args)  # (as SIGTERM)

    def as_ctrl_c(signum: int, frame: Any) -> None:
        """Cancel the start-up as asyncio's own Ctrl-C handler does (not by raising SIGINT:
        a process started with SIGINT ignored would ignore that too)."""
        early.append(signum)
        if not running:
            raise KeyboardInterrupt  # (the loop has not started: nothing to stop yet)
        loop, task = running[0]
        if len(early) == 1 and not task.done():
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)  # (wakes the loop)

    previous: dict[int, Any] = {}
    try:
        if in_main:
            for signum in _STARTUP_SIGNALS:
                if signum not in ignored:
                    previous[signum] = signal.signal(signum, as_ctrl_c)
        uvloop.run(tracked(), loop_factory=Loop)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if early:
            raise StopSignal(early[0]) from None
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if early:
        raise StopSignal(early[0])
    if signal.SIGINT in stops:
        raise KeyboardInterrupt
