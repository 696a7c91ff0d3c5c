"""One node of a disaggregated cluster: its role, registration, conductor election and
internal RPC handlers (Mooncake paper, Figures 2 and 3; architecture.md, "The life of
one request").

Roles (settings.node.role):
  prefill  engine + store: runs `node.prefill` (prefill with max_tokens=1, the KV
           of every block, the partial last one included, staged layer by layer
           and pushed to the decode node as each layer is computed (kv_push.py);
           the stage stays registered as a transfer-engine segment; the full
           blocks go into the node's store, so the conductor's index learns them
           through store events).
  decode   engine + store: `node.kv_reserve` gives a prefill node a receive buffer
           for one request; POST /internal/decode takes the pushed KV (or READs
           the staged KV from the prefill node), admits the request with
           kv_import + first_token, and streams its output deltas back to the
           API node as JSON lines (keep-alive lines while it is quiet).
  cache    no model: a store that lends DRAM to the pool (created once a model node
           has published the block size), plus the API front end (tokenizer only).
Every node serves the public OpenAI API through `ClusterFrontend` (see
frontend.py), registers with the coordinator under a lease (addresses, role,
model geometry, its store's transfer-engine segment descriptor), campaigns in
the conductor election (the winner runs `ConductorService`), and reports its
load and store events to the leader every `cluster.report_interval_s`.

Control methods (ControlServer, JSON): node.prefill, node.kv_reserve, node.release,
node.status, node.drain; conductor.place, conductor.report, conductor.status (answered by the
leader, `NotLeader` elsewhere); store.* (StoreNode).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
from typing import Any

import orjson
from aiohttp import web

import mooncaked
from mooncaked import failpoints
from mooncaked.config import Settings
from mooncaked.conductor.service import ConductorService, NotLeader
from mooncaked.log import get_logger

from .coordinator import Coordinator, Member, make_coordinator
from .errors import ClusterError, CoordinationError
from .rpc import ControlClient, ControlServer

log = get_logger(__name__)

MAX_PENDING_REPORT_ITEMS = 2000   # arrived/done entries kept while the leader is unreachable


class NodeDraining(RuntimeError):
    """The node takes no new requests (drain or shutdown); place the request elsewhere."""


def _lp_json(lps: Any) -> list | None:
    if not lps:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in lps]


def output_json(out: Any) -> dict:
    """A RequestOutput delta as a compact JSON object (the internal decode stream's line)."""
    return {"ids": out.new_token_ids, "text": out.new_text, "lp": _lp_json(out.logprobs),
            "fin": out.finished, "fr": out.finish_reason, "sr": out.stop_reason,
            "n_out": out.num_output_tokens, "cached": out.num_cached_tokens,
            "error": out.error}


class ClusterNode:
    """The cluster side of one mooncaked process (see the module doc).

    Args:
        settings: full settings; `node.role` is prefill, decode or cache.
        engine: the AsyncLLM (prefill, decode) or None (cache).
        tokenizer: the model's tokenizer (the engine's, or loaded alone on a cache node).
    Use: `routes()` and `control` go into the aiohttp app before it listens; then
    `await start(api_url, control_addr)`; `await drain(timeout)` and `await stop()` at the end.
    """

    def __init__(self, settings: Settings, engine: Any | None, tokenizer: Any):
        self.settings = settings
        self.role = settings.node.role
        self.engine = engine
        self.tokenizer = tokenizer
        self.node_id = settings.node.id
        self.control = ControlServer(settings.cluster.rpc_max_body_bytes)
        self.client = ControlClient(settings.cluster.rpc_timeout_s,
                                    settings.cluster.rpc_max_body_bytes)
        # Prefill calls and decode streams last as long as a request: a separate pool.
        self.data_client = ControlClient(settings.cluster.rpc_timeout_s,
                                         settings.cluster.rpc_max_body_bytes, limit_per_host=0)
        self.coord: Coordinator | None = None
        self.transfer: Any = None
        self.store: Any = None
        self.store_node: Any = None
        self.conductor: ConductorService | None = None
        self.members: dict[str, Member] = {}
        self.leader_id: str | None = None
        self.leader_changed = asyncio.Event()
        self.draining = False
        self.api_url = ""
        self.control_addr = ""
        self.started = time.time()
        self.info: dict = {}
        self._tasks: list[asyncio.Task] = []
        self._events_q: asyncio.Queue | None = None
        # load and what happened since the last report
        self.prefill_reqs: dict[str, list] = {}     # rid -> [new, cached, alone]
        self.decode_reqs: dict[str, int] = {}       # rid -> context tokens
        self.frontend_runs = 0                      # requests this node's API is serving
        self._arrived: list[str] = []
        self._done: list[dict] = []
        self._stages: dict[str, tuple[str, Any, asyncio.TimerHandle]] = {}
        self._recvs: dict[str, tuple[str, Any, asyncio.TimerHandle, str]] = {}  # + owner
        # KV hand-over counters (node.status "kv_transfer"): prefill side pushes, decode
        # side receives (pushed) or READs (staged).
        self.kv_transfer = {"pushed": 0, "push_failed": 0, "staged_only": 0, "push_bytes": 0,
                            "push_busy_s": 0.0, "push_exposed_s": 0.0, "received_pushed": 0,
                            "read": 0, "read_bytes": 0, "read_s": 0.0, "fetches": 0,
                            "fetched_blocks": 0, "fetch_failed": 0}
        self._background: set[asyncio.Task] = set()
        from .frontend import ClusterFrontend  # noqa: PLC0415 - frontend imports node types
        self.frontend = ClusterFrontend(self)

    # ------------------------------------------------------------------ wiring

    def routes(self) -> list[web.RouteDef]:
        """The node's HTTP routes: the control RPC and the internal decode stream."""
        return [*self.control.routes(), web.post("/internal/decode", self._decode_route)]

    def model_info(self) -> dict | None:
        """Model geometry: this node's engine, else any model node's published record."""
        if self.engine is not None:
            return self.info.get("model") or self._own_model_info()
        for m in self.members.values():
            if m.info.get("model"):
                return m.info["model"]
        return None

    def _own_model_info(self) -> dict:
        e = self.engine.engine
        return {"name": e.model_name, "model_id": e.model_id, "block_size": e.block_size,
                "kv_dtype": str(e.dtype), "dtype": str(e.dtype).removeprefix("torch."),
                "max_model_len": e.max_model_len, "block_bytes": e.block_bytes,
                "max_logprobs": e.max_logprobs,
                "kv_capacity_tokens": e.block_manager.num_blocks * e.block_size,
                "kv_shape": [e.cfg.num_layers, 2, e.block_size, e.cfg.num_kv_heads,
                             e.cfg.head_dim]}

    def member(self, node_id: str) -> Member | None:
        """The member record of node_id in this node's view, or None."""
        return self.members.get(node_id)

    def leader_control(self) -> str | None:
        """Control address of the current conductor, or None while there is no leader."""
        if self.leader_id is None:
            return None
        if self.leader_id == self.node_id:
            return self.control_addr
        m = self.members.get(self.leader_id)
        return m.info.get("control") if m is not None else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self, api_url: str, control_addr: str) -> None:
        """Starts transfer engine and store, registers, campaigns, reports.

        Raises: CoordinationError when the coordinator cannot be reached; OSError when the
        transfer engine cannot listen.
        """
        from mooncaked.transfer import TransferEngine  # noqa: PLC0415

        self.api_url, self.control_addr = api_url, control_addr
        if not self.node_id:
            self.node_id = f"{socket.gethostname()}-{api_url.rsplit(':', 1)[-1]}"
        self.transfer = TransferEngine(self.settings.transfer, node_id=self.node_id)
        await self.transfer.start()
        if self.engine is not None:
            await self._start_store(self.engine.engine.block_bytes)
            self.engine.attach_store(self.store if self.role == "prefill" else None)
        for name, h in (("node.prefill", self._h_prefill), ("node.release", self._h_release),
                        ("node.status", self._h_status), ("node.drain", self._h_drain),
                        ("node.kv_reserve", self._h_kv_reserve),
                        ("conductor.place", self._h_place), ("conductor.report", self._h_report),
                        ("conductor.status", self._h_conductor_status)):
            self.control.add_handler(name, h)
        if failpoints.enabled():       # test processes only (MOONCAKED_FAILPOINTS set)
            failpoints.load_from_env()
            self.control.add_handler("debug.failpoint", self._h_failpoint)
            log.warning("failpoints_enabled", node=self.node_id)
        self.coord = make_coordinator(self.settings.cluster)
        await self.coord.start()
        self.info = self._info()
        await self.coord.register(self.node_id, self.info)
        self.members = await self.coord.members()
        self.leader_id = await self.coord.leader()
        for coro, name in ((self._watch_members(), "members"), (self._watch_leader(), "leader"),
                           (self._campaign_loop(), "campaign"), (self._report_loop(), "report")):
            self._tasks.append(asyncio.create_task(coro, name=f"node-{name}"))
        log.info("node_started", node=self.node_id, role=self.role, api=api_url,
                 control=control_addr, backend=self.settings.cluster.backend)

    async def _start_store(self, block_bytes: int) -> None:
        from mooncaked.store import BlockStore  # noqa: PLC0415
        from mooncaked.store.remote import StoreNode  # noqa: PLC0415

        self.store = await BlockStore.from_settings(self.settings, block_bytes,
                                                    self.node_id).start()
        self._events_q = self.store.subscribe()
        self.store_node = StoreNode(self.store, self.transfer, self.client, self.control_addr)
        self.store_node.start()
        self.store_node.add_handlers(self.control)

    def _info(self) -> dict:
        model = self._own_model_info() if self.engine is not None else None
        store = None
        if self.store is not None:
            store = {"segment": self.store_node.descriptor, "block_bytes": self.store.block_bytes,
                     "dram_bytes": self.store.dram.capacity_bytes}
        return {"role": self.role, "api": self.api_url, "control": self.control_addr,
                "version": mooncaked.__version__, "pid": os.getpid(),
                "host": socket.gethostname(), "started": self.started, "model": model,
                "store": store, "transfer": {"host": self.transfer.advertise_host,
                                             "port": self.transfer.port,
                                             "backend": self.transfer.backend},
                "draining": self.draining}

    async def _reregister(self) -> None:
        self.info = self._info()
        try:
            await self.coord.register(self.node_id, self.info)
        except ClusterError as e:
            log.warning("node_register_failed", error=str(e))

    async def drain(self, timeout_s: float) -> None:
        """Takes no new requests (the conductor stops placing here), then waits up to
        timeout_s for running ones (prefill, decode and this node's API requests)."""
        if not self.draining:
            self.draining = True
            log.info("node_draining", node=self.node_id, prefill=len(self.prefill_reqs),
                     decode=len(self.decode_reqs), frontend=self.frontend_runs)
            if self.coord is not None:
                await self._reregister()
                await self._report_once()
        deadline = time.monotonic() + timeout_s
        while (self.prefill_reqs or self.decode_reqs or self.frontend_runs) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)   # poll: requests finish on their own schedule

    async def stop(self) -> None:
        """Resigns, leaves the membership (lease revoked), stops store and transfer engine."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.conductor is not None:
            await self.conductor.stop()
            self.conductor = None
        for rid in list(self._stages):
            self._release_stage(rid)
        for rid in list(self._recvs):
            self._release_recv(rid)
        for t in list(self._background):
            t.cancel()
        if self.coord is not None:
            await self.coord.close()
        await self.client.close()
        await self.data_client.close()
        if self.store_node is not None:
            self.store_node.close()
        if self.transfer is not None:
            await self.transfer.close()
        if self.store is not None:
            await self.store.close()
        log.info("node_stopped", node=self.node_id)

    def spawn(self, coro) -> asyncio.Task:
        """Runs a fire-and-forget coroutine, keeping a reference until it ends."""
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    # ------------------------------------------------------------------ background loops

    async def _watch_members(self) -> None:
        while True:
            try:
                async for ev in self.coord.watch_members():
                    if ev.kind == "leave":
                        self.members.pop(ev.member.node_id, None)
                        log.info("node_left", node=ev.member.node_id)
                        continue
                    self.members[ev.member.node_id] = ev.member
                    if ev.kind in ("join", "rejoin"):
                        log.info("node_joined", node=ev.member.node_id,
                                 role=ev.member.info.get("role"), kind=ev.kind)
                    m = ev.member.info.get("model")
                    if self.role == "cache" and self.store is None and m:
                        await self._start_store(int(m["block_bytes"]))
                        await self._reregister()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep watching
                log.warning("node_members_watch_failed", error=repr(e))
                await asyncio.sleep(1.0)

    async def _watch_leader(self) -> None:
        while True:
            try:
                async for leader in self.coord.watch_leader():
                    if leader != self.leader_id:
                        log.info("leader_changed", leader=leader, previous=self.leader_id)
                    self.leader_id = leader
                    self.leader_changed.set()
                    self.leader_changed = asyncio.Event()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.warning("node_leader_watch_failed", error=repr(e))
                await asyncio.sleep(1.0)

    async def wait_leader_change(self, timeout_s: float) -> None:
        """Returns at the next change of leader, or after timeout_s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.leader_changed.wait(), timeout_s)

    async def _campaign_loop(self) -> None:
        while True:
            try:
                lead = await self.coord.campaign(self.node_id)
            except asyncio.CancelledError:
                raise
            except CoordinationError as e:
                log.warning("campaign_failed", error=str(e))
                await asyncio.sleep(self.settings.cluster.heartbeat_interval_s)
                continue
            service = ConductorService(self.node_id, self.coord, self.client, self.settings)
            try:
                await service.start()
                self.conductor = service
                self.leader_id = self.node_id
                await lead.wait_lost()
                log.warning("conductor_leadership_lost", node=self.node_id)
            finally:
                self.conductor = None
                await service.stop()

    def _report(self) -> dict:
        events = []
        while self._events_q is not None and not self._events_q.empty():
            for ev in self._events_q.get_nowait():
                events.append({"kind": ev.kind, "tier": ev.tier, "seq": ev.seq,
                               "keys": [k.hex() for k in ev.keys]})
        free = 0
        if self.engine is not None:
            st = self.engine.stats()
            free = (st.kv_blocks_total - st.kv_blocks_used) * self.engine.engine.block_size
        return {"node": self.node_id, "role": self.role, "draining": self.draining,
                "pending": {rid: v[:2] for rid, v in self.prefill_reqs.items()},
                "arrived": list(self._arrived),
                "decode": {"rids": list(self.decode_reqs), "batch": len(self.decode_reqs),
                           "context_tokens": sum(self.decode_reqs.values()),
                           "free_kv_tokens": free},
                "store_seq": self.store.events.seq if self.store is not None else -1,
                "events": events, "done": list(self._done),
                "decode_steps": self._decode_steps()}

    def _decode_steps(self) -> list[list]:
        """The engine's timed decode steps since the last report (decode nodes, at most 64)."""
        if self.engine is None or self.role != "decode":
            return []
        log_ = self.engine.engine.decode_steps
        steps = []
        while log_:
            steps.append(list(log_.popleft()))
        return steps[-64:]

    async def _report_once(self) -> None:
        payload = self._report()
        n_arrived, n_done = len(payload["arrived"]), len(payload["done"])
        try:
            if self.conductor is not None:
                await self.conductor.report(payload)
            else:
                addr = self.leader_control()
                if addr is None:
                    raise NotLeader("no leader yet")
                await self.client.call(addr, "conductor.report", payload)
        except (ClusterError, NotLeader) as e:
            # Lost events: the leader sees a gap in store_seq and pulls our inventory.
            log.debug("report_failed", error=str(e))
            del self._arrived[:-MAX_PENDING_REPORT_ITEMS]
            del self._done[:-MAX_PENDING_REPORT_ITEMS]
            return
        del self._arrived[:n_arrived]
        del self._done[:n_done]

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cluster.report_interval_s)
            try:
                await self._report_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never let reporting die
                log.error("report_error", exc_info=True, error=repr(e))

    # ------------------------------------------------------------------ conductor handlers

    def _leader(self) -> ConductorService:
        if self.conductor is None:
            raise NotLeader(f"{self.node_id} is not the conductor (leader: {self.leader_id})")
        return self.conductor

    async def _h_place(self, payload: Any) -> dict:
        return await self._leader().place(payload)

    async def _h_report(self, payload: Any) -> dict:
        return await self._leader().report(payload)

    async def _h_conductor_status(self, payload: Any) -> dict:
        return self._leader().status()

    # ------------------------------------------------------------------ node handlers

    async def _h_status(self, payload: Any) -> dict:
        eng = dataclasses.asdict(self.engine.stats()) if self.engine is not None else None
        return {"node": self.node_id, "role": self.role, "version": mooncaked.__version__,
                "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1),
                "draining": self.draining, "leader": self.leader_id,
                "conductor": self.conductor is not None, "api": self.api_url,
                "control": self.control_addr, "backend": self.settings.cluster.backend,
                "engine": eng, "store": self.store.stats() if self.store is not None else None,
                "transfer": self.transfer.stats() if self.transfer is not None else None,
                "requests": {"prefill": sorted(self.prefill_reqs),
                             "decode": sorted(self.decode_reqs),
                             "frontend": self.frontend_runs, "staged": len(self._stages),
                             "receiving": len(self._recvs)},
                "kv_transfer": {k: round(v, 6) if isinstance(v, float) else v
                                for k, v in self.kv_transfer.items()}}

    async def _h_failpoint(self, payload: Any) -> dict:
        """`debug.failpoint` (only with MOONCAKED_FAILPOINTS set): sets one failpoint.

        Payload: {"name", "action": "off" | "error" | "pause", "skip": int, "times": int |
        null}. Returns {"failpoints": failpoints.status()}.
        Raises: ValueError for a malformed payload or an unknown action.
        """
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ValueError("debug.failpoint needs {'name': <point>, 'action': ...}")
        failpoints.set_action(payload["name"], str(payload.get("action", "off")),
                              skip=int(payload.get("skip", 0)), times=payload.get("times"))
        return {"failpoints": failpoints.status()}

    async def _h_drain(self, payload: Any) -> dict:
        """`mooncake ctl drain`: no new requests; running ones finish (in the background)."""
        self.spawn(self.drain(self.settings.cluster.drain_timeout_s))
        return {"node": self.node_id, "draining": True, "prefill": len(self.prefill_reqs),
                "decode": len(self.decode_reqs)}

    async def _h_release(self, payload: Any) -> dict:
        if not isinstance(payload, dict) or not isinstance(payload.get("rid"), str):
            raise ValueError("release needs {'rid': <request id>}")
        rid, owner = payload["rid"], payload.get("owner")
        staged = self._release_stage(rid)
        received = self._release_recv(rid, owner) is not None
        return {"released": staged or received}

    def _release_stage(self, rid: str) -> bool:
        st = self._stages.pop(rid, None)
        if st is None:
            return False
        name, _, timer = st
        timer.cancel()
        with contextlib.suppress(Exception):
            self.transfer.unregister_segment(name)
        return True

    async def _h_prefill(self, p: Any) -> dict:
        """`node.prefill`: fetch the prefix blocks the conductor chose, prefill with
        max_tokens=1 while staging the KV layer by layer (LayerwiseKV), and, with a decode
        node to push to, WRITE each layer there as it is computed (kv_push.py).

        Payload: {"rid", "prompt": [ids], "params": SamplingParams fields, "cache_salt",
        "fetch": {"control", "keys": [hex]} | null, "prefix_tokens", "stage": bool,
        "push_to": decode node control address | null, "ttl_s": seconds the request has}.
        Returns {"output": first-token delta (output_json), "kv": {"descriptor", "shape"
        ([layers, blocks, 2, block_size, kv_heads, head_dim], layer-major), "dtype",
        "num_tokens", "pushed": bool, "push": PushStats dict | null} | null, "seconds"}.
        With "pushed" the decode node holds all of the KV; otherwise it READs the stage.
        Raises: NodeDraining; InvalidRequest (bad prompt or params); RuntimeError when the
        engine fails.
        """
        from mooncaked.engine.types import SamplingParams  # noqa: PLC0415

        if self.engine is None or self.role != "prefill":
            raise ValueError(f"{self.node_id} is a {self.role} node, not a prefill node")
        if self.draining:
            raise NodeDraining(f"{self.node_id} is draining")
        rid, prompt = str(p["rid"]), p["prompt"]
        params = SamplingParams(**p["params"])
        params.max_tokens = 1
        cached = int(p.get("prefix_tokens", 0))
        for other in self.prefill_reqs.values():
            other[2] = False                    # nobody ran alone while this one ran
        self.prefill_reqs[rid] = [len(prompt) - cached, cached, not self.prefill_reqs]
        self._arrived.append(rid)
        t0 = time.monotonic()
        kv_stream = pusher = None
        handed_over = False
        try:
            await failpoints.ahit("node.prefill")
            fetch = p.get("fetch")
            if fetch and self.store_node is not None:
                await self._fetch(fetch)
            if p.get("stage") and 0 < len(prompt) < self.engine.engine.max_model_len:
                kv_stream = self.engine.engine.layerwise_kv(len(prompt))
                if p.get("push_to"):
                    pusher = self._pusher(rid, kv_stream, p["push_to"], float(p.get("ttl_s", 0)))
                    kv_stream.on_layer = pusher.on_layer
                    pusher.start()
            final = None
            gen = self.engine.generate(prompt, params, rid, cache_salt=p.get("cache_salt"),
                                       kv_stream=kv_stream)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.error:
                        raise RuntimeError(f"engine error: {out.error}")
                    final = out
            compute_end = time.monotonic()
            seconds = compute_end - t0
            kv = None
            if kv_stream is not None and final.finish_reason == "length":
                push = await pusher.finish(compute_end) if pusher is not None else None
                kv = self._stage(rid, kv_stream)
                kv["pushed"] = bool(push is not None and push.ok)
                kv["push"] = push.as_dict() if push is not None else None
                handed_over = kv["pushed"]
                self._count_push(push)
                if push is not None:
                    log.debug("kv_pushed", request_id=rid, compute_s=round(seconds, 4),
                              **push.as_dict())
            new, _, alone = self.prefill_reqs[rid]
            self._done.append({"rid": rid, "seconds": seconds, "alone": alone,
                               "new": len(prompt) - final.num_cached_tokens,
                               "cached": final.num_cached_tokens})
            return {"output": output_json(final), "kv": kv, "seconds": seconds}
        finally:
            self.prefill_reqs.pop(rid, None)
            if pusher is not None:
                await pusher.aclose()
                if pusher.attempted and not handed_over:
                    self.spawn(self._release_remote(p["push_to"], rid, owner=self.control_addr))

    def _pusher(self, rid: str, kv_stream: Any, decode_control: str, ttl_s: float) -> Any:
        """A KVPusher whose reservation asks the decode node for a receive buffer."""
        from .kv_push import KVPusher  # noqa: PLC0415

        cs = self.settings.cluster
        shape = list(kv_stream.shape)

        async def reserve() -> dict:
            return await self.client.call(decode_control, "node.kv_reserve",
                                          {"rid": rid, "shape": shape, "owner": self.control_addr,
                                           "dtype": str(kv_stream.dtype).removeprefix("torch."),
                                           "ttl_s": ttl_s})

        return KVPusher(self.transfer, kv_stream, reserve,
                        cs.rpc_timeout_s + self.settings.transfer.request_timeout_s)

    def _count_push(self, push: Any) -> None:
        t = self.kv_transfer
        if push is None:
            t["staged_only"] += 1
            return
        t["pushed" if push.ok else "push_failed"] += 1
        t["push_bytes"] += push.bytes
        t["push_busy_s"] += push.busy_s
        t["push_exposed_s"] += push.exposed_s

    async def _fetch(self, fetch: dict) -> None:
        """Replicates prefix blocks from their holder into this node's store (section 4.2);
        the engine then loads them from the store. A failure only means recomputing."""
        keys = [bytes.fromhex(k) for k in fetch.get("keys", [])]
        if not keys or fetch.get("control") == self.control_addr:
            return
        t0 = time.monotonic()
        try:
            results = await asyncio.wait_for(
                self.store_node.fetch(fetch["control"], keys),
                self.settings.cluster.rpc_timeout_s + self.settings.transfer.request_timeout_s)
            ok = sum(r.ok for r in results)
            log.info("prefix_fetched", source=fetch.get("source"), blocks=len(keys), ok=ok,
                     seconds=round(time.monotonic() - t0, 4))
            self.kv_transfer["fetches"] += 1
            self.kv_transfer["fetched_blocks"] += ok
            if ok < len(keys):
                self.kv_transfer["fetch_failed"] += 1
        except (ClusterError, TimeoutError, OSError, ValueError) as e:
            log.warning("prefix_fetch_failed", source=fetch.get("source"), error=str(e))
            self.kv_transfer["fetches"] += 1
            self.kv_transfer["fetch_failed"] += 1

    def _stage(self, rid: str, kv_stream: Any) -> dict:
        """Registers the staged KV (layer-major) as segment "<node>/stage/<rid>" for a
        decode node's READ; freed by node.release or after cluster.stage_ttl_s."""
        blocks = kv_stream.stage
        name = f"{self.node_id}/stage/{rid}"
        desc = self.transfer.register_segment(name, blocks, "cpu:0")
        timer = asyncio.get_running_loop().call_later(self.settings.cluster.stage_ttl_s,
                                                      self._release_stage, rid)
        self._stages[rid] = (name, blocks, timer)
        return {"descriptor": desc, "shape": list(blocks.shape),
                "dtype": str(blocks.dtype).removeprefix("torch."),
                "num_tokens": kv_stream.num_tokens}

    # ------------------------------------------------------------------ decode: receive buffers

    async def _h_kv_reserve(self, p: Any) -> dict:
        """`node.kv_reserve` (decode nodes): a receive buffer for one request's layer-wise
        KV push, registered as segment "<node>/recv/<rid>"; only the caller gets its
        descriptor (access key). Freed when the request is admitted, by node.release from
        its owner, or after ttl_s from now (clamped to [cluster.stage_ttl_s,
        server.request_timeout_s]). A new reservation for the same rid (the request
        placed again on another prefill node) replaces the old one.

        Payload: {"rid", "owner": the prefill node's control address, "shape": [layers,
        blocks, 2, block_size, kv_heads, head_dim], "dtype", "ttl_s"}. Returns {"descriptor"}.
        Raises: NodeDraining; ValueError for another role, a wrong geometry, or when the
        receive buffers would exceed engine.kv_cache_bytes.
        """
        import torch  # noqa: PLC0415

        if self.engine is None or self.role != "decode":
            raise ValueError(f"{self.node_id} is a {self.role} node, not a decode node")
        if self.draining:
            raise NodeDraining(f"{self.node_id} is draining")
        failpoints.hit("node.kv_reserve")
        rid = str(p["rid"])
        e = self.engine.engine
        shape = [int(x) for x in p["shape"]]
        want = [e.cfg.num_layers, 2, e.block_size, e.cfg.num_kv_heads, e.cfg.head_dim]
        if len(shape) != 6 or shape[0] != want[0] or shape[2:] != want[1:] or shape[1] < 1 \
                or p.get("dtype") != str(e.dtype).removeprefix("torch."):
            raise ValueError(f"receive buffer {shape} {p.get('dtype')} does not match this "
                             f"engine ({want[0]}, n, {want[1:]}, {e.dtype})")
        self._release_recv(rid)            # an earlier attempt of this request
        nbytes = shape[1] * e.block_bytes
        held = sum(r[1].numel() * r[1].element_size() for r in self._recvs.values())
        if held + nbytes > self.settings.engine.kv_cache_bytes:
            raise ValueError(f"receive buffers full ({held} + {nbytes} bytes > "
                             f"engine.kv_cache_bytes)")
        buf = torch.empty(shape, dtype=e.dtype)
        name = f"{self.node_id}/recv/{rid}"
        desc = self.transfer.register_segment(name, buf, "cpu:0")
        ttl = min(max(float(p.get("ttl_s") or 0), self.settings.cluster.stage_ttl_s),
                  self.settings.server.request_timeout_s)
        timer = asyncio.get_running_loop().call_later(ttl, self._release_recv, rid)
        self._recvs[rid] = (name, buf, timer, str(p.get("owner") or ""))
        return {"descriptor": desc}

    def _release_recv(self, rid: str, owner: str | None = None) -> Any:
        """Withdraws rid's receive segment (only if `owner`, when given, reserved it);
        returns its buffer, or None."""
        r = self._recvs.get(rid)
        if r is None or (owner is not None and r[3] != owner):
            return None
        del self._recvs[rid]
        name, buf, timer, _ = r
        timer.cancel()
        with contextlib.suppress(Exception):
            self.transfer.unregister_segment(name)
        return buf

    # ------------------------------------------------------------------ decode route

    async def _decode_route(self, request: web.Request) -> web.StreamResponse:
        """POST /internal/decode: take the pushed KV (or READ the staged KV), admit, stream
        deltas as JSON lines.

        Body: {"rid", "prompt", "first_token", "params", "cache_salt", "kv": {descriptor,
        shape (layer-major), dtype, num_tokens, pushed}, "prefill": its control address}.
        The receive buffer is used only when "pushed" and that prefill node reserved it.
        Answers 503 while draining, 502 when the KV cannot be read; then 200 with one JSON object a line: output
        deltas (output_json), "{}" keep-alives every stream_idle_timeout_s / 3, or
        {"error", "status"} for a request the engine refuses or fails.
        """
        import torch  # noqa: PLC0415

        from mooncaked.engine.types import InvalidRequest, KVImport, SamplingParams  # noqa

        if self.engine is None or self.role != "decode":
            return web.json_response({"error": f"{self.node_id} is not a decode node"},
                                     status=400)
        if self.draining:
            return web.json_response({"error": f"{self.node_id} is draining"}, status=503)
        body = orjson.loads(await request.read())
        rid, kv = str(body["rid"]), body["kv"]
        t0 = time.monotonic()
        # The pushed buffer, complete: the prefill node answered only after every WRITE.
        # Any other buffer for rid (a push that failed part-way, another prefill node's
        # attempt) goes, and the KV is READ from the prefill node's stage instead.
        r = self._recvs.get(rid)
        pushed_here = bool(kv.get("pushed")) and r is not None and r[3] == body.get("prefill")
        buf = self._release_recv(rid)
        if not pushed_here:
            buf = None
        if buf is not None:
            self.kv_transfer["received_pushed"] += 1
        else:
            buf = torch.empty(kv["shape"], dtype=getattr(torch, kv["dtype"]))
            seg = self.transfer.add_peer_segment(kv["descriptor"])
            try:
                await asyncio.wait_for(self.transfer.read(seg, 0, buf),
                                       self.settings.transfer.request_timeout_s)
            except Exception as e:  # noqa: BLE001 - TransferError, timeout: never decode on partial KV
                log.warning("kv_read_failed", request_id=rid, error=str(e))
                return web.json_response({"error": f"KV transfer from the prefill node failed: "
                                                   f"{e}"}, status=502)
            finally:
                with contextlib.suppress(Exception):
                    self.transfer.remove_peer_segment(seg)
            t = self.kv_transfer
            t["read"] += 1
            t["read_bytes"] += buf.numel() * buf.element_size()
            t["read_s"] += time.monotonic() - t0
        read_s = time.monotonic() - t0
        self.spawn(self._release_remote(body.get("prefill"), rid))
        params = SamplingParams(**body["params"])
        prompt = body["prompt"]
        self.decode_reqs[rid] = len(prompt) + 1
        self._arrived.append(rid)
        log.debug("decode_admit", request_id=rid, kv_bytes=buf.numel() * buf.element_size(),
                  read_s=round(read_s, 4))
        q: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            gen = self.engine.generate(prompt, params, rid, cache_salt=body.get("cache_salt"),
                                       kv_import=KVImport(buf.permute(1, 0, 2, 3, 4, 5),
                                                          int(kv["num_tokens"])),
                                       first_token=int(body["first_token"]))
            try:
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        q.put_nowait(out)
                        if out.finished:
                            return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - handed to the stream
                q.put_nowait(e)

        task = asyncio.create_task(pump())
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/x-ndjson"})
        keepalive = self.settings.cluster.stream_idle_timeout_s / 3
        try:
            await resp.prepare(request)
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), keepalive)
                except TimeoutError:
                    await resp.write(b"{}\n")
                    continue
                if isinstance(item, Exception):
                    status = 400 if isinstance(item, InvalidRequest) else 500
                    await resp.write(orjson.dumps({"error": str(item), "status": status,
                                                   "param": getattr(item, "param", None)}) + b"\n")
                    break
                self.decode_reqs[rid] = self.decode_reqs.get(rid, 0) + len(item.new_token_ids)
                await resp.write(orjson.dumps(output_json(item)) + b"\n")
                if item.finished:
                    break
        except ConnectionResetError:
            log.info("decode_client_gone", request_id=rid)
        finally:
            task.cancel()    # closes the engine generator: the request is aborted, pages freed
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            self.decode_reqs.pop(rid, None)
        return resp

    async def _release_remote(self, addr: str | None, rid: str, owner: str | None = None) -> None:
        """Tells node addr that its staged KV of rid, or (with owner) the receive buffer
        that owner reserved for rid, may go (best effort)."""
        if not addr:
            return
        try:
            await self.client.call(addr, "node.release", {"rid": rid, "owner": owner})
        except ClusterError as e:
            log.debug("release_failed", request_id=rid, error=str(e))


__all__ = ["ClusterNode", "NodeDraining", "output_json"]
