"""Serving a built vLLM app on its socket, the way vLLM's own server does (one place for the
uvicorn options both ``serve-vllm`` modes pass through unchanged)."""

from __future__ import annotations

import asyncio
from typing import Any


async def serve_app(app: Any, sock: Any, args: Any) -> asyncio.Task:
    """Start serving ``app`` on ``sock`` with the options in ``args`` (vLLM's parsed server
    arguments). Returns vLLM's shutdown task: await it after the server stopped."""
    from vllm import envs
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    uvicorn_kwargs: dict[str, Any] = {}
    if (log_config := get_uvicorn_log_config(args)) is not None:
        uvicorn_kwargs["log_config"] = log_config
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
