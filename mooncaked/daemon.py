"""One mooncaked process: builds the node for its role from settings and owns the lifecycles.

`run_daemon(settings)` runs a uvloop event loop until SIGTERM or SIGINT.

Role `all` (the single-machine default) is one process with engine, KV store (as
`[store]` configures it) and API and no coordinator: on a signal it stops accepting connections, reports /health 503,
gives in-flight requests a short grace period, aborts what is left (the engine
frees their KV blocks), stops the engine and exits 0.

Roles `prefill`, `decode` and `cache` (and `all` with `cluster.coupled`: a coupled
node that prefills and decodes in one engine) form a cluster (mooncaked/cluster/node.py):
the node registers with the coordinator, campaigns for the conductor, serves the
OpenAI API through the cluster front end on the API port, and its control plane
(control RPC under /control/, the decode stream under /internal/, both requiring
the cluster token) on a separate listener, cluster.rpc_host:rpc_port; the public
port serves no control route. On a signal it drains (no new requests are placed
on it; it stops campaigning and resigns if it leads; running ones finish within
cluster.drain_timeout_s), leaves the cluster and exits 0.

Shutdown always ends (shutdown.py): from the first SIGTERM/SIGINT, in any state
(start-up included), the process exits within the drain timeout plus
SHUTDOWN_SLACK_S; a second SIGTERM/SIGINT exits at once.

Under systemd (Type=notify) the daemon sends READY=1 once it serves and
STOPPING=1 when it begins to drain (sd_notify through the `sdnotify` package;
a no-op without $NOTIFY_SOCKET).
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Callable
from typing import TypeVar

import uvloop
from aiohttp import web

from mooncaked.config import ConfigError, Settings
from mooncaked.log import get_logger, setup_logging
from mooncaked.shutdown import Shutdown, ShutdownRequested
from mooncaked.api.server import SERVER_KEY, build_app
from mooncaked.engine.async_llm import AsyncLLM
from mooncaked.engine.startup_profile import KINDS as STARTUP_KINDS
from mooncaked.engine.startup_profile import cached_startup_profile
from mooncaked.model.weights import ModelLoadError
from mooncaked.store import BlockStore, StoreError
from mooncaked.wire.errors import ClusterError
from mooncaked.cluster.health import node_health
from mooncaked.cluster.node import ClusterNode
from mooncaked.cluster.node_metrics import label_registry
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import resolve_model_path
from mooncaked.roles import unused_settings

T = TypeVar("T")

log = get_logger(__name__)

SHUTDOWN_GRACE_S = 5.0   # in-flight requests may finish within this; then they are aborted
# Beyond the drain: resign, leave (lease revoke), close listeners, store and engine. Each of
# those steps is bounded by a few seconds; past this the watchdog ends the process.
SHUTDOWN_SLACK_S = 15.0


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _advertise(host: str) -> str:
    """The address peers dial for a listen address (a wildcard advertises the host name)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def _addr(host: str, port: int) -> str:
    """"host:port" (IPv6 in brackets) of a listen address, as peers dial it."""
    host = _advertise(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _notify(state: str) -> None:
    """sd_notify(3) to systemd; silently nothing when not started by systemd."""
    try:
        import sdnotify  # noqa: PLC0415
    except ImportError:
        return
    sdnotify.SystemdNotifier().notify(state)


async def _listen(app: web.Application, host: str, port: int) -> web.AppRunner | None:
    """Starts serving app on host:port; None (logged) when it cannot listen."""
    # handler_cancellation: a client that disconnects cancels its handler, which
    # closes the engine generator (or the remote calls) and aborts the request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        log.error("listen_failed", host=host, port=port, error=str(e))
        await runner.cleanup()
        return None
    return runner


def _freeze_startup_heap() -> int:
    """Takes every object alive once the node has started (the model, tokenizer, modules
    and profile: about 300,000 on the bundled model) out of the garbage collector's scans,
    as vLLM v1 and SGLang do after their start-up (gc.freeze). A full collection scanned
    them all: 140 ms on a 2-core AMD EPYC Zen 4, a stall of some 20 decode steps whenever
    one ran while serving. Returns how many objects were frozen (they are never freed,
    and none of them is garbage: a collection runs first)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _build(settings: Settings, build: Callable[[], T]) -> T | None:
    """build() (the engine, or a front end's tokenizer), or None after logging why the
    model did not load (model_load_failed: a missing or corrupt file, a bad setting such
    as model.device=cuda on a CPU-only torch)."""
    try:
        return build()
    except (ModelLoadError, OSError, ValueError) as e:
        log.error("model_load_failed", path=settings.model.path or "<bundled>", error=str(e))
    return None


async def _serve(settings: Settings, stop: Shutdown) -> int:

    stop.bind()
    # Loading takes seconds and blocks the loop; a signal meanwhile is handled right after.
    engine = _build(settings, lambda: AsyncLLM.from_settings(settings))
    if engine is None:
        return 1
    # The node's KV store, as configured: finished requests' blocks (prompt and output)
    # go to DRAM and, with store.ssd_bytes, to the SSD tier, which outlives a restart.
    store = None
    if settings.store.dram_bytes or settings.store.ssd_bytes:
        try:
            store = await BlockStore.from_settings(
                settings, engine.kv_geometry().block_bytes, "local").start()
        except (StoreError, OSError, ValueError) as e:
            log.error("store_start_failed", error=str(e))
            return 1
        engine.attach_store(store)
    await engine.start()
    runner: web.AppRunner | None = None
    try:
        if stop.requested:
            return 0
        app = build_app(engine, request_timeout_s=settings.server.request_timeout_s)
        runner = await _listen(app, settings.server.host, settings.server.port)
        if runner is None:
            return 1
        host, port = runner.addresses[0][:2]
        frozen = _freeze_startup_heap()
        log.info("ready", url=_url(host, port), model=engine.model_name,
                 role=settings.node.role, max_model_len=engine.max_model_len,
                 gc_frozen_objects=frozen)
        _notify("READY=1")
        await stop.wait()
        _notify("STOPPING=1")
        log.info("shutting_down", grace_s=SHUTDOWN_GRACE_S)
        app[SERVER_KEY].begin_drain()
    finally:
        if runner is not None:
            await runner.cleanup()   # closes listeners, waits the grace period, cancels the rest
        await engine.stop()
        if store is not None:
            await store.close()      # persists DRAM blocks to the SSD tier (tiering.py)
    log.info("stopped")
    return 0


async def _serve_cluster(settings: Settings, stop: Shutdown) -> int:
    """A prefill, decode or cache node (see the module doc)."""

    stop.bind()
    role = settings.node.role
    engine = None
    # all: a coupled node (cluster.coupled); a CPP stage (cpp.group) loads only its
    # layers itself (cluster/cpp/cpp_node.py), so it starts like a cache node here
    if role in ("prefill", "decode", "all") and not (role == "prefill" and settings.cpp.group):
        engine = _build(settings, lambda: AsyncLLM.from_settings(settings))
        if engine is None:
            return 1
        tokenizer = engine.tokenizer
    else:   # cache, CPP stage: the API front end needs the tokenizer only
        tokenizer = _build(settings, lambda: Tokenizer(resolve_model_path(settings.model.path),
                                                       []))
        if tokenizer is None:
            return 1
    if (engine is not None and settings.engine.startup_profile_s > 0
            and settings.conductor.refit_cost_model):
        # before the node registers (so before /health is 200): the cost model's first
        # timed steps (engine/startup_profile.py), in a thread so a signal is still seen;
        # with conductor.refit_cost_model false the model stays as loaded: nothing to fit
        kinds = {"prefill": ("prefill",), "decode": ("decode",)}.get(role, STARTUP_KINDS)
        profile = await asyncio.to_thread(cached_startup_profile, engine.engine,
                                          settings.engine.startup_profile_s, kinds)
        log.info("startup_profile", role=role, **profile.summary())
    if engine is not None:
        await engine.start()
    try:
        node = ClusterNode(settings, engine, tokenizer)
    except ConfigError as e:
        log.error("config_error", error=str(e))
        if engine is not None:
            await engine.stop()
        return 2
    runners: list[web.AppRunner] = []
    app = None

    def failed(code: int) -> int:
        # the cleanup below (leaving the coordinator, the listeners, the engine) is bounded:
        # a start that failed exits with its own code, never hangs
        stop.bound_failed_start(code, SHUTDOWN_SLACK_S)
        return code

    try:
        if stop.requested:
            return 0
        cs = settings.cluster
        app = build_app(node.frontend, request_timeout_s=settings.server.request_timeout_s)
        app[SERVER_KEY].health_check = lambda: node_health(node)
        label_registry(app[SERVER_KEY].metrics, node)   # node/role on every series
        runner = await _listen(app, settings.server.host, settings.server.port)
        if runner is None:
            return failed(1)
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        # The control plane listens apart from the public API (never on its port).
        capp = web.Application(client_max_size=cs.rpc_max_body_bytes)
        capp.add_routes(node.routes())
        crunner = await _listen(capp, cs.rpc_host, cs.rpc_port)
        if crunner is None:
            return failed(1)
        runners.append(crunner)
        control = _addr(cs.rpc_host, crunner.addresses[0][1])
        try:
            await stop.race(node.start(_url(_advertise(settings.server.host), port), control),
                            "cluster join")
        except ShutdownRequested:
            log.info("shutting_down", node=node.node_id, during="cluster join")
            return 0
        except ConfigError as e:          # e.g. an etcd certificate file that cannot be read
            log.error("config_error", error=str(e))
            return failed(2)
        except (ClusterError, OSError) as e:
            log.error("cluster_join_failed", backend=cs.backend, error=str(e))
            return failed(1)
        frozen = _freeze_startup_heap()
        log.info("ready", url=_url(host, port), node=node.node_id, role=role,
                 control=control, model=node.frontend.model_name, gc_frozen_objects=frozen)
        _notify("READY=1")
        await stop.wait()
        _notify("STOPPING=1")
        log.info("shutting_down", node=node.node_id, drain_timeout_s=cs.drain_timeout_s)
        node.stopping = True
        app[SERVER_KEY].begin_drain()
        await node.drain(cs.drain_timeout_s)
    finally:
        await node.stop()
        for r in reversed(runners):
            await r.cleanup()
        if engine is not None:
            await engine.stop()
    log.info("stopped")
    return 0


def run_daemon(settings: Settings) -> int:
    """Runs one node until SIGTERM/SIGINT; returns the process exit code.

    0 after a graceful shutdown; 70 when the graceful stop overran its bound (the
    watchdog ended it); 128+N after a second signal N; 2 for a configuration error the
    node finds at start (a missing cluster token);
    1 if the model cannot be loaded, the API cannot listen
    (port in use, bad address) or a cluster node cannot reach its coordinator. Logs one
    `ready` event with the API's URL once it accepts requests.
    """
    cluster = settings.node.role != "all" or settings.cluster.coupled
    bound = (settings.cluster.drain_timeout_s if cluster else SHUTDOWN_GRACE_S) \
        + SHUTDOWN_SLACK_S
    # Installed before anything is logged or loaded, so a signal during start-up counts.
    stop = Shutdown(bound).install()
    setup_logging(settings.log.level, settings.log.format)
    unused = unused_settings(settings)
    if unused:
        log.warning("settings_unused", role=settings.node.role, keys=unused,
                    reason=f"the {settings.node.role} role does not read these settings")
    main = _serve_cluster(settings, stop) if cluster else _serve(settings, stop)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
