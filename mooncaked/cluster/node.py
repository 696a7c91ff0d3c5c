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
  A prefill node with cpp.group is one CPP stage (cpp_node.py): its layers only, and a
  store of its layer slices of blocks (stage_prefix.py).
Every node serves the public OpenAI API through `ClusterFrontend` (see
frontend.py), registers with the coordinator under a lease (addresses, role,
model geometry, its store's transfer-engine segment descriptor), campaigns in
the conductor election (the winner runs `ConductorService`), and reports its
load and store events to the leader every `cluster.report_interval_s`.

Control methods (ControlServer, JSON; every call carries the cluster token, auth.py):
node.prefill, node.kv_reserve, node.release, node.status, node.drain, node.undrain;
conductor.place, conductor.report, conductor.status (answered by the
leader, `NotLeader` elsewhere); store.* (StoreNode).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

import mooncaked
from mooncaked import failpoints
from mooncaked.stall_metrics import node_metrics
from mooncaked.config import Settings
from mooncaked.conductor.service import ConductorService
from mooncaked.kernels.cpu_isa import cpu_name
from mooncaked.log import get_logger

from mooncaked.wire.auth import authorized, load_token
from mooncaked.coord.coordinator import Coordinator, Member
from mooncaked.coord.factory import make_coordinator
from .decode_worker import DecodeWorker
from mooncaked.wire.errors import ClusterError, NotLeader, RpcError
from .membership import ClusterView
from mooncaked.wire.messages import (DecodeLoad, NodeRef, NodeReport, PlaceRejected, PlaceReply,
                                     PlaceRequest, PrefillReply, PrefillRequest, Release,
                                     StoreEventMsg, place_result_from_json)
from .node_state import Activity, KVTransferCounters, NodeDraining
from .prefill_worker import PrefillWorker
from .role import Handler, NodeContext, RoleStatus, RoleWorker
from mooncaked.wire.rpc import ControlClient, ControlServer
from .frontend import ClusterFrontend
from mooncaked.transfer import TransferEngine
from mooncaked.cluster.cpp.cpp_node import CppStageWorker
from .throughput import log_throughput
from mooncaked.store import BlockStore
from mooncaked.store.remote import StoreNode

log = get_logger(__name__)

# the role methods every node answers: served by its role's worker, refused elsewhere
ROLE_METHODS = {"node.prefill": "prefill", "node.kv_reserve": "decode"}
DRAIN_STEP_S = 3.0   # bound on each coordinator/leader call of a drain (a shutdown must end)


async def _bounded(coro, what: str) -> None:
    """Awaits coro for at most DRAIN_STEP_S; logs and moves on when it takes longer."""
    try:
        await asyncio.wait_for(coro, DRAIN_STEP_S)
    except TimeoutError:
        log.warning("drain_step_timeout", step=what, timeout_s=DRAIN_STEP_S)


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
        # The cluster secret (auth.py): required on every control call and decode stream.
        self.token = load_token(settings.cluster, create=True)
        self.control = ControlServer(settings.cluster.rpc_max_body_bytes, token=self.token)
        self.client = ControlClient(settings.cluster.rpc_timeout_s,
                                    settings.cluster.rpc_max_body_bytes, token=self.token)
        # Prefill calls and decode streams last as long as a request: a separate pool.
        self.data_client = ControlClient(settings.cluster.rpc_timeout_s,
                                         settings.cluster.rpc_max_body_bytes, limit_per_host=0,
                                         token=self.token, limit=0)
        self.coord: Coordinator | None = None
        self.view: ClusterView | None = None       # members, leader, election, reports
        self.transfer: Any = None
        self.store: Any = None
        self.store_node: Any = None
        self.draining = False
        self.stopping = False          # a SIGTERM drain: final, never undrained
        self.api_url = ""
        self.control_addr = ""
        self.started = time.time()
        self.info: dict = {}
        self._events_q: asyncio.Queue | None = None
        # the role's worker (made in start(), once the transfer engine and store exist);
        # `decode` is the same worker on decode and coupled nodes, for what only they have
        # (the /internal/decode and /internal/generate streams, the TBT check, the load)
        self.worker: RoleWorker | None = None
        self.decode: DecodeWorker | None = None
        self.kv_transfer = KVTransferCounters()     # node.status "kv_transfer"
        self.activity = Activity()                  # since the last report
        self.frontend_runs = 0                      # requests this node's API is serving
        self._background: set[asyncio.Task] = set()
        self.frontend = ClusterFrontend(self)

    # ------------------------------------------------------------------ wiring

    def routes(self) -> list[web.RouteDef]:
        """The node's HTTP routes: the control RPC and the internal decode stream."""
        return [*self.control.routes(), web.post("/internal/decode", self._decode_route),
                web.post("/internal/generate", self._generate_route)]

    async def _generate_route(self, request: web.Request) -> web.StreamResponse:
        if not authorized(request.headers, self.token, request.remote, "internal/generate"):
            return web.json_response({"error": "this call needs the cluster token"}, status=401)
        if self.decode is None or self.role != "all":
            return web.json_response({"error": f"{self.node_id} is not a coupled node"},
                                     status=400)
        return await self.decode.generate_route(request)

    async def _decode_route(self, request: web.Request) -> web.StreamResponse:
        if not authorized(request.headers, self.token, request.remote, "internal/decode"):
            return web.json_response({"error": "this call needs the cluster token"}, status=401)
        if self.decode is None:
            return web.json_response({"error": f"{self.node_id} is not a decode node"},
                                     status=400)
        return await self.decode.route(request)

    def model_info(self) -> dict | None:
        """Model geometry: this node's engine, else any model node's published record."""
        if self.engine is not None:
            return self.info.get("model") or self._own_model_info()
        for m in self.members.values():
            if m.info.get("model"):
                return m.info["model"]
        return None

    def _own_model_info(self) -> dict:
        e, g = self.engine, self.engine.kv_geometry()
        return {"name": e.model_name, "model_id": e.model_id, "block_size": g.block_size,
                "kv_dtype": str(g.dtype), "dtype": g.dtype_name,
                "max_model_len": e.max_model_len, "block_bytes": g.block_bytes,
                "max_logprobs": e.max_logprobs,
                "kv_capacity_tokens": g.num_blocks * g.block_size,
                "cpu": cpu_name(),            # the calibrated cost model's key
                "kv_shape": [g.num_layers, 2, g.block_size, g.num_kv_heads, g.head_dim],
                "kernels": e.kernels(),
                # the conductor calibrates its cost model from these (engine/startup_profile.py)
                "startup_profile": (e.startup_profile.to_json()
                                    if e.startup_profile is not None else None)}

    @property
    def members(self) -> dict[str, Member]:
        """This node's view of the members (empty before start)."""
        return self.view.members if self.view is not None else {}

    def conductor_not_ready(self) -> str | None:
        """Why the conductor this node uses would not place a request now, or None
        (ClusterView.conductor_not_ready)."""
        return self.view.conductor_not_ready() if self.view is not None else "not joined yet"

    @property
    def leader_id(self) -> str | None:
        """The leader as this node last saw it, or None."""
        return self.view.leader_id if self.view is not None else None

    @property
    def conductor(self) -> ConductorService | None:
        """The conductor, while this node leads."""
        return self.view.conductor if self.view is not None else None

    def leader_control(self) -> str | None:
        """Control address of the current conductor, or None while there is no leader."""
        return self.view.leader_control() if self.view is not None else None

    async def wait_leader_change(self, timeout_s: float) -> None:
        """Returns at the next change of leader, or after timeout_s."""
        if self.view is not None:
            await self.view.wait_leader_change(timeout_s)

    # ------------------------------------------------------------------ the front end's port
    # What ClusterFrontend needs of the node (frontend.FrontendPort): placement, the
    # prefill call, releases, the leader's changes, load bookkeeping.

    def max_model_len(self) -> int | None:
        """Smallest context of the model nodes (tokens); None before any has joined."""
        lens = [m.info["model"]["max_model_len"] for m in self.members.values()
                if m.info.get("model")]
        if self.engine is not None:
            lens.append(self.engine.max_model_len)
        return min(lens) if lens else None

    def engine_stats(self) -> Any:
        """This node's EngineStats, or None on a node without a model."""
        return self.engine.stats() if self.engine is not None else None

    async def place(self, req: PlaceRequest, timeout_s: float) -> PlaceReply | PlaceRejected:
        """`conductor.place` on the leader (in-process when this node leads).

        Raises: NotLeader when no leader is known (or the callee is not it any more);
        PeerUnavailable or RpcTimeout when the leader cannot be reached; RpcError.
        """
        if self.conductor is not None:
            return await self.conductor.place(req)
        addr = self.leader_control()
        if addr is None:
            raise NotLeader("no conductor has been elected")
        try:
            r = await self.client.call(addr, "conductor.place", req.to_json(),
                                       timeout_s=timeout_s)
        except RpcError as e:
            if e.remote_type == "NotLeader":
                raise NotLeader(e.remote_message) from e
            raise
        return place_result_from_json(r)

    async def call_prefill(self, target: NodeRef, req: PrefillRequest, timeout_s: float
                           ) -> PrefillReply:
        """`node.prefill` on target (the long-lived data pool). Raises: as ControlClient.call
        (RpcError with remote_type "NodeDraining" or "InvalidRequest" among them)."""
        r = await self.data_client.call(target.control, "node.prefill", req.to_json(),
                                        timeout_s=timeout_s)
        return PrefillReply.from_json(r)

    def stream(self, target: NodeRef, path: str, payload: dict, total_s: float
               ) -> AsyncIterator[Any]:
        """The JSON lines of a stream route (/internal/decode, /internal/generate) on target,
        over the long-lived data pool (ControlClient.stream): connecting bounded by
        cluster.rpc_timeout_s, silence by cluster.stream_idle_timeout_s, all of it by
        total_s. Raises: as ControlClient.stream."""
        cs = self.settings.cluster
        return self.data_client.stream(target.control, path, payload, total_s=total_s,
                                       idle_s=cs.stream_idle_timeout_s,
                                       connect_s=cs.rpc_timeout_s)

    async def release(self, addr: str, msg: Release) -> None:
        """Best-effort `node.release` on addr (2 s bound; the TTLs free it otherwise)."""
        with contextlib.suppress(ClusterError):
            await self.client.call(addr, "node.release", msg.to_json(), timeout_s=2.0)

    def observed_ttft(self, rid: str, seconds: float) -> None:
        """The TTFT this node's API front end saw for rid (seconds), for the next report
        (NodeReport.ttfts: the conductor's TTFT overhead)."""
        self.activity.ttfts.append((rid, seconds))

    def observed_tbt(self, rid: str, seconds: float) -> None:
        """The TBT this node's API front end sent rid with (seconds, measures.tbt_s), for
        the next report (NodeReport.tbts: the conductor's TBT factor)."""
        self.activity.tbts.append((rid, seconds))

    @contextlib.contextmanager
    def serving(self):
        """Counts one request this node's API serves while the block runs (drain waits
        for them)."""
        self.frontend_runs += 1
        try:
            yield
        finally:
            self.frontend_runs -= 1

    # ------------------------------------------------------------------ lifecycle

    async def start(self, api_url: str, control_addr: str) -> None:
        """Starts transfer engine and store, registers, campaigns, reports.

        Raises: CoordinationError when the coordinator cannot be reached; OSError when the
        transfer engine cannot listen.
        """

        self.api_url, self.control_addr = api_url, control_addr
        if not self.node_id:
            self.node_id = f"{socket.gethostname()}-{api_url.rsplit(':', 1)[-1]}"
        self.transfer = TransferEngine(self.settings.transfer, node_id=self.node_id)
        await self.transfer.start()
        if self.engine is not None and self.role != "all":    # a coupled node: no store
            await self._start_store(self.engine.kv_geometry().block_bytes)
            offload = self.role == "prefill" or self.settings.store.decode_offload
            self.engine.attach_store(self.store if offload else None)
        ctx = self._context()
        if self.role == "prefill" and self.settings.cpp.group:    # a CPP stage (cpp_node.py)
            cpp = CppStageWorker(ctx)
            await cpp.start()
            # its own store of its layer slices, lent to the pool like every node's
            await self._start_store(cpp.engine.block_bytes)
            ctx.store_node = self.store_node
            cpp.attach_store(self.store_node)
            self.worker = cpp
        elif self.role == "prefill":
            self.worker = PrefillWorker(ctx)
        elif self.role in ("decode", "all"):    # all: a coupled node runs whole requests
            self.worker = self.decode = DecodeWorker(ctx)
        role_handlers = self.worker.handlers() if self.worker is not None else {}
        for name, side in ROLE_METHODS.items():    # refused where this role has none
            self.control.add_handler(name, role_handlers.get(name) or self._not_a(side))
        for name, h in (("node.release", self._h_release),
                        ("node.status", self._h_status), ("node.drain", self._h_drain),
                        ("node.undrain", self._h_undrain),
                        ("conductor.place", self._h_place), ("conductor.report", self._h_report),
                        ("conductor.status", self._h_conductor_status),
                        ("admission.ledger", self._h_admission_ledger)):
            self.control.add_handler(name, h)
        if failpoints.enabled():       # test processes only (MOONCAKED_FAILPOINTS set)
            failpoints.load_from_env()
            self.control.add_handler("debug.failpoint", failpoints.control_handler)
            log.warning("failpoints_enabled", node=self.node_id)
        self.coord = make_coordinator(self.settings.cluster)
        await self.coord.start()
        await self._claim_id()
        self.info = self._info()
        await self.coord.register(self.node_id, self.info)
        self.view = ClusterView(self.node_id, control_addr, self.coord, self.client,
                                self.settings, self._on_member, self._report, self.activity)
        await self.view.start()
        if self.engine is not None and self.settings.log.stats_interval_s > 0:
            self.spawn(log_throughput(self, self.settings.log.stats_interval_s))
        log.info("node_started", node=self.node_id, role=self.role, api=api_url,
                 control=control_addr, backend=self.settings.cluster.backend)

    def _context(self) -> NodeContext:
        """What this node's role worker may use of it (role.py), once its transfer engine
        and (on a model node) its store started."""
        return NodeContext(
            node_id=self.node_id, control_addr=self.control_addr, settings=self.settings,
            engine=self.engine, tokenizer=self.tokenizer, transfer=self.transfer,
            control=self.control, client=self.client, data_client=self.data_client,
            store_node=self.store_node, kv_transfer=self.kv_transfer, activity=self.activity,
            draining=lambda: self.draining, spawn=self.spawn, members=lambda: self.members,
            model_info=self.model_info, block_keys=self.frontend.block_keys)

    def _not_a(self, side: str) -> Handler:
        """A control handler for a role method this node's role does not serve."""
        async def refuse(payload: Any) -> dict:
            raise ValueError(f"{self.node_id} is a {self.role} node, not a {side} node")
        return refuse

    async def _claim_id(self) -> None:
        """Takes node.id for this process. A process that died without leaving (kill -9)
        holds it until its lease ends, so wait up to one lease TTL; a live holder keeps
        it, and this node refuses to join (ClusterError naming the holder)."""
        cs = self.settings.cluster
        me = {"pid": os.getpid(), "host": socket.gethostname(), "api": self.api_url}
        deadline = time.monotonic() + self.coord.ttl_s + 2 * cs.heartbeat_interval_s
        logged = False
        while (holder := await self.coord.claim_id(self.node_id, me)) is not None:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"node id {self.node_id!r} is in use by pid {holder.get('pid')} on "
                    f"{holder.get('host')} (API {holder.get('api')}), which holds its lease: "
                    f"give this process another node.id, or stop that one first")
            if not logged:
                log.info("node_id_busy", node=self.node_id, holder_pid=holder.get("pid"),
                         holder_host=holder.get("host"), wait_s=round(deadline
                                                                     - time.monotonic(), 1))
                logged = True
            await asyncio.sleep(min(1.0, cs.heartbeat_interval_s))

    async def _start_store(self, block_bytes: int) -> None:

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
                "draining": self.draining,
                "cpp": self.worker.info() if self.worker is not None else None}

    async def _reregister(self) -> None:
        self.info = self._info()
        try:
            await self.coord.register(self.node_id, self.info)
        except ClusterError as e:
            log.warning("node_register_failed", error=str(e))

    async def drain(self, timeout_s: float) -> None:
        """Takes no new requests (the conductor stops placing here), stops campaigning and
        resigns if it leads, then waits up to timeout_s for running ones (prefill, decode
        and this node's API requests). Each step that talks to the coordinator or the
        leader is bounded (DRAIN_STEP_S), so a drain ends during an outage too."""
        deadline = time.monotonic() + timeout_s
        if not self.draining:
            self.draining = True
            log.info("node_draining", node=self.node_id, prefill=self._running("prefill"),
                     decode=self._running("decode"), frontend=self.frontend_runs)
            # Stand down first: a campaign still running could otherwise win while the
            # re-registration and the report below are in flight (seen when every node
            # of a cluster got SIGTERM at once and the leader resigned).
            if self.view is not None:
                await self.view.stand_down()
            if self.coord is not None:
                await _bounded(self._reregister(), "reregister")
            if self.view is not None:
                await _bounded(self.view.report_once(), "report")
        while (self._running("prefill") or self._running("decode") or self.frontend_runs) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.05)   # poll: requests finish on their own schedule

    async def undrain(self) -> None:
        """Takes requests again and stands for election again (`mooncake ctl undrain`)."""
        if not self.draining:
            return
        self.draining = False
        log.info("node_undrained", node=self.node_id)
        if self.coord is not None:
            await _bounded(self._reregister(), "reregister")
        if self.view is not None:
            self.view.stand_up()
            await _bounded(self.view.report_once(), "report")

    async def stop(self) -> None:
        """Resigns, leaves the membership (lease revoked), stops store and transfer engine."""
        if self.view is not None:
            await self.view.stop()
        if self.worker is not None:
            self.worker.close()
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
            if self.engine is not None:
                await self.engine.wait_offloads()
            await self.store.close()
        log.info("node_stopped", node=self.node_id)

    def spawn(self, coro) -> asyncio.Task:
        """Runs a fire-and-forget coroutine, keeping a reference until it ends."""
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    def _running(self, side: str) -> list[str]:
        """Ids of the requests running on this node's prefill or decode side."""
        w = self.worker
        return sorted(w.requests) if w is not None and w.side == side else []

    def _report(self) -> NodeReport:
        events = []
        while self._events_q is not None and not self._events_q.empty():
            events += [StoreEventMsg(ev.kind, ev.tier, ev.seq, tuple(ev.keys))
                       for ev in self._events_q.get_nowait()]
        decode = DecodeLoad()
        if self.decode is not None:
            st, g = self.engine.stats(), self.engine.kv_geometry()
            rids, batch, context = self.decode.load()
            decode = DecodeLoad(tuple(rids), batch, context,
                                (st.kv_blocks_total - st.kv_blocks_used) * g.block_size)
        steps = tuple(self.engine.take_decode_steps()) if self.decode is not None else ()
        if self.decode is not None:
            self.decode.admission.observe(steps)
        return NodeReport(self.node_id, self.role, self.draining,
                          self.worker.pending() if self.worker is not None else {},
                          tuple(self.activity.arrived), decode,
                          self.store.events.seq if self.store is not None else -1,
                          tuple(events), tuple(self.activity.done), steps,
                          self.worker.queued() if self.worker is not None else (),
                          tuple(self.engine.take_prefill_steps())     # calibration
                          if self.engine is not None and self.role != "decode" else (),
                          {peer: e.bytes_per_s
                           for peer, e in self.transfer.bandwidth.estimates().items()},
                          (self.worker.stalled() or "") if self.worker is not None else "",
                          tuple(self.activity.ttfts), tuple(self.activity.tbts))

    async def _on_member(self, member: Member) -> None:
        """A cache node starts its store once a model node has published the block size."""
        m = member.info.get("model")
        mine = self.info.get("model") if self.engine is not None else None
        if m and mine and m.get("dtype") != mine.get("dtype"):
            # model.dtype = auto resolves per CPU (model/numerics.py): nodes on different CPU
            # kinds can differ, and then neither KV handovers nor block keys match
            log.warning("model_dtype_mismatch", member=member.node_id, member_dtype=m.get("dtype"),
                        dtype=mine.get("dtype"),
                        hint="set model.dtype explicitly (float32 or bfloat16) on every node")
        if self.role == "cache" and self.store is None and m:
            await self._start_store(int(m["block_bytes"]))
            await self._reregister()

    # ------------------------------------------------------------------ conductor handlers

    def _leader(self) -> ConductorService:
        if self.conductor is None:
            if self.leader_id == self.node_id:   # our leader key outlived our conductor
                raise NotLeader(f"{self.node_id} lost the conductor's seat (its lease ended, "
                                f"e.g. the coordination store is unreachable); an election is "
                                f"pending")
            raise NotLeader(f"{self.node_id} is not the conductor (leader: "
                            f"{self.leader_id or 'none elected'})")
        return self.conductor

    async def _h_place(self, payload: Any) -> dict:
        return (await self._leader().place(PlaceRequest.from_json(payload))).to_json()

    async def _h_report(self, payload: Any) -> dict:
        leader = self._leader()
        await leader.report(NodeReport.from_json(payload))
        return {"ok": True, "not_ready": leader.not_ready()}

    async def _h_conductor_status(self, payload: Any) -> dict:
        return self._leader().status()

    async def _h_admission_ledger(self, payload: Any) -> dict:
        """`admission.ledger` {"rids": [...] | absent}: this node's admission decisions by
        request id (conductor/admission_ledger.py): "conductor" when it leads, "node_check"
        for its decode or coupled TBT check; each null where it has none."""
        rids = payload.get("rids") if isinstance(payload, dict) else None
        if rids is not None and not (isinstance(rids, list)
                                     and all(isinstance(r, str) for r in rids)):
            raise ValueError("admission.ledger: rids must be a list of strings")
        return {"node": self.node_id,
                "conductor": self.conductor.admissions(rids) if self.conductor else None,
                "node_check": self.decode.admission.ledger_view(rids) if self.decode else None}

    # ------------------------------------------------------------------ node handlers

    async def _h_status(self, payload: Any) -> dict:
        eng = dataclasses.asdict(self.engine.stats()) if self.engine is not None else None
        role = self.worker.status() if self.worker is not None else RoleStatus()
        return {"node": self.node_id, "role": self.role, "version": mooncaked.__version__,
                "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1),
                "draining": self.draining, "leader": self.leader_id,
                "conductor": self.conductor is not None, "api": self.api_url,
                "control": self.control_addr, "backend": self.settings.cluster.backend,
                "engine": eng, "store": self.store.stats() if self.store is not None else None,
                "startup_profile": (self.engine.startup_profile.summary() if self.engine
                                    is not None and self.engine.startup_profile is not None
                                    else None),
                "transfer": self.transfer.stats() if self.transfer is not None else None,
                "requests": {"prefill": self._running("prefill"),
                             "decode": self._running("decode"),
                             "frontend": self.frontend_runs,
                             "staged": role.staged, "receiving": role.receiving,
                             "refused": role.refused},
                "admission": role.admission,
                "kv_transfer": self.kv_transfer.as_dict(),
                "cpp": role.cpp,
                "stalls": node_metrics().summary()}

    async def _h_drain(self, payload: Any) -> dict:
        """`mooncake ctl drain`: no new requests; running ones finish (in the background)."""
        self.spawn(self.drain(self.settings.cluster.drain_timeout_s))
        return {"node": self.node_id, "draining": True, "prefill": len(self._running("prefill")),
                "decode": len(self._running("decode"))}

    async def _h_undrain(self, payload: Any) -> dict:
        """`mooncake ctl undrain`: take requests again (a node stopping on SIGTERM refuses)."""
        if self.stopping:
            raise ValueError(f"{self.node_id} is shutting down; it cannot be undrained")
        await self.undrain()
        return {"node": self.node_id, "draining": self.draining}

    async def _h_release(self, payload: Any) -> dict:
        """`node.release` (messages.Release): rid's staged KV, or the receive buffer its
        owner reserved. Returns {"released": bool}."""
        msg = Release.from_json(payload)
        return {"released": self.worker is not None and self.worker.release_held(msg)}


__all__ = ["ClusterNode", "NodeDraining"]
