"""One mooncaked process: builds the engine and the API from settings and owns their lifecycles.

`run_daemon(settings)` runs a uvloop event loop until SIGTERM or SIGINT, then shuts
down gracefully: stop accepting connections, report /health 503, give in-flight
requests a short grace period to finish, abort what is left (the engine frees
their KV blocks), stop the engine, exit 0.
"""

from __future__ import annotations

import asyncio
import signal

import uvloop
from aiohttp import web

from mooncaked.config import Settings
from mooncaked.log import get_logger, setup_logging

log = get_logger(__name__)

SHUTDOWN_GRACE_S = 5.0   # in-flight requests may finish within this; then they are aborted


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(settings: Settings) -> int:
    from mooncaked.api.server import SERVER_KEY, build_app  # noqa: PLC0415
    from mooncaked.engine.async_llm import AsyncLLM  # noqa: PLC0415
    from mooncaked.model.weights import ModelLoadError  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Loading takes seconds and blocks the loop; a signal meanwhile is handled right after.
    try:
        engine = AsyncLLM.from_settings(settings)
    except (ModelLoadError, OSError, ValueError) as e:
        log.error("model_load_failed", path=settings.model.path or "<bundled>", error=str(e))
        return 1
    await engine.start()
    runner: web.AppRunner | None = None
    try:
        if stop.is_set():
            return 0
        app = build_app(engine, request_timeout_s=settings.server.request_timeout_s)
        # handler_cancellation: a client that disconnects cancels its handler, which
        # closes the engine generator and aborts the request.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        site = web.TCPSite(runner, settings.server.host, settings.server.port)
        try:
            await site.start()
        except OSError as e:
            log.error("listen_failed", host=settings.server.host, port=settings.server.port,
                      error=str(e))
            return 1
        host, port = runner.addresses[0][:2]
        log.info("ready", url=_url(host, port), model=engine.model_name,
                 role=settings.node.role, max_model_len=engine.max_model_len)
        await stop.wait()
        log.info("shutting_down", grace_s=SHUTDOWN_GRACE_S)
        app[SERVER_KEY].begin_drain()
    finally:
        if runner is not None:
            await runner.cleanup()   # closes listeners, waits the grace period, cancels the rest
        await engine.stop()
    log.info("stopped")
    return 0


def run_daemon(settings: Settings) -> int:
    """Runs one node until SIGTERM/SIGINT; returns the process exit code.

    0 after a graceful shutdown; 1 if the model cannot be loaded or the API cannot
    listen (port in use, bad address); 2 for a role this build cannot run yet. Logs one `ready` event with
    the API's URL once it accepts requests.
    """
    setup_logging(settings.log.level, settings.log.format)
    if settings.node.role != "all":
        log.error("role_not_supported", role=settings.node.role,
                  reason="only --role all (every role in one process) is implemented")
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(settings))
