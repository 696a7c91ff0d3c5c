"""The live conductor: Mooncake's Algorithm 1 (`policy.place`) fed with live cluster state.

One node runs it at a time: whichever holds the coordination election (see
mooncaked/cluster/node.py). It keeps

- the global prefix index (`PrefixIndex`): every node's store inventory is
  pulled (`store.inventory` RPC) when the service starts, i.e. after every
  leader change, and when a node joins; afterwards each node pushes its store
  events in its periodic report. A gap in a node's event sequence (a lost
  report) triggers a fresh inventory pull for that node;
- a view of every node's load, from the same reports (pushed every
  `cluster.report_interval_s`): prefill work pending (new and cached tokens per
  request), decode batch size, context tokens and free KV room, draining flag;
- placements made since the last report of the chosen nodes ("in flight"), so
  a burst of requests between two reports does not all land on the same node;
- the cost model (`mooncaked profile` output, or a rough CPU default), whose
  TTFT predictions are compared with what the prefill nodes report, and whose
  prefill polynomial is refitted from requests that ran alone on their node;
  likewise its decode-step predictions against the decode nodes' timed steps,
  from which the decode model is refitted.

`place(PlaceRequest)` answers the `conductor.place` RPC: a placement (prefill node,
decode node, blocks to fetch and from where, predictions) or a rejection with
a Retry-After (the paper's early rejection, section 4 step 4 and section 7).
Nodes that stopped reporting (dead, hung) are left out after `stale_s`, which
is shorter than the coordination lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncaked.wire.messages import (FetchPlan, NodeRef, NodeReport, PlaceRejected, PlaceReply,
                                     PlaceRequest, StoreEventMsg, unhex_keys)
from mooncaked.config import Settings, state_dir
from mooncaked.engine.types import StartupProfile
from mooncaked.log import get_logger
from mooncaked.store.keys import slice_key
from mooncaked.store.types import Inventory

from . import calibration_cache, cost_store
from .admission_ledger import ADMIT, REJECT, AdmissionLedger, Decision, decide, in_holdout
from .attainable import longest_attainable, unattainable
from .cost_model import CostModel, step_with_request_s, with_measured_bandwidth
from .index import BlockEvent, PrefixIndex
from .cpp_place import (Group, GroupLearner, group_chunk_prediction, place_with_groups,
                        split_groups, stalled_groups, usable_groups)
from .load import (INFLIGHT_TTL_S, InflightPrefill, NodeView, apply_load, decode_load_during,
                   inflight_decode,
                   queue_s, queued_work)
from .refit import STARTUP_PROFILE, CostModelRefitter
from .replication import HotBlockReplicator
from .policy import (Placement, PlacementRequest, PolicyConfig, QueuedWork, Rejection, Snapshot,
                     place)

log = get_logger(__name__)

CALIBRATION_SAVE_S = 30.0      # the calibrated model is written at most this often


class ConductorService:
    """The conductor of a running cluster (see the module doc).

    Args:
        node_id: the node running it (the election's winner).
        coord: the started Coordinator (membership view).
        client: ControlClient for inventory pulls.
        settings: full settings ([conductor] SLOs and policy, [cluster] intervals).
        cost: the cost model; None loads it lazily once the model's KV size is known.
    Call `await start()`, then serve `place`/`report`/`status`; `await stop()` on
    leadership loss. Methods run on the event loop's thread.
    """

    def __init__(self, node_id: str, coord: Any, client: Any, settings: Settings,
                 cost: CostModel | None = None):
        self.node_id = node_id
        self.coord = coord
        self.client = client
        self.settings = settings
        self.model = CostModelRefitter(settings, cost)
        self.index = PrefixIndex()
        self.replicator = HotBlockReplicator(settings, self.index, client)
        self.nodes: dict[str, NodeView] = {}
        self.stale_s = max(3.0, 8 * settings.cluster.report_interval_s)
        self.rng = random.Random(0)
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.placed = 0
        self.rejected: dict[str, int] = {}
        self.admission = AdmissionLedger()   # verdicts by request id (conductor.admission)
        self.cpp_learner = GroupLearner()    # CPP groups: per-stage chunk times and overhead
        self._pulls: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self._cost_task: asyncio.Task | None = None
        self._saved_at = -math.inf           # the calibrated model's last save (monotonic)
        self._saved_version = 0
        self._profiled: dict[str, Any] = {}    # node -> `started` of the profile taken
        self.profiles: dict[str, dict] = {}    # node -> its start-up profile's summary

    # the parts tests and `ctl` read
    @property
    def cost(self) -> CostModel | None:
        """The cost model in use (None until it is loaded)."""
        return self.model.cost

    @property
    def refits(self) -> int:
        return self.model.refits

    @property
    def decode_refits(self) -> int:
        return self.model.decode_refits

    @property
    def replicated(self) -> dict:
        return self.replicator.replicated

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Takes the current membership, pulls every node's inventory (bounded by the RPC
        timeout), then follows membership changes in the background."""
        try:
            members = await self.coord.members()
        except Exception as e:  # noqa: BLE001 - the watch below retries
            log.warning("conductor_members_failed", error=str(e))
            members = {}
        for m in members.values():
            self._upsert(m.node_id, m.info)
        pulls = [self._pull(nid) for nid, v in self.nodes.items() if v.info.get("store")]
        if pulls:
            await asyncio.gather(*pulls, return_exceptions=True)
        self._task = asyncio.create_task(self._watch(), name="conductor-members")
        self._cost_task = asyncio.create_task(cost_store.follow(self.coord, self._set_cost),
                                              name="conductor-cost-model")
        log.info("conductor_started", node=self.node_id, nodes=sorted(self.nodes),
                 indexed_keys=len(self.index))

    async def stop(self) -> None:
        """Stops following membership; the index is dropped with the object."""
        await self.replicator.stop()
        tasks = [t for t in [self._task, self._cost_task, *self._pulls.values()]
                 if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        log.info("conductor_stopped", node=self.node_id)

    async def _watch(self) -> None:
        async for ev in self.coord.watch_members():
            m = ev.member
            if ev.kind == "leave":
                self.nodes.pop(m.node_id, None)
                dropped = self.index.remove_node(m.node_id)
                log.info("conductor_node_left", node=m.node_id, blocks_dropped=dropped)
                continue
            old = self.nodes.get(m.node_id)
            had_store = bool(old and old.info.get("store"))
            if ev.kind == "rejoin" and old is not None:
                self.index.remove_node(m.node_id)     # a restarted node: forget its old blocks
                old.store_seq = -1
                had_store = False
            self._upsert(m.node_id, m.info)
            if m.info.get("store") and (not had_store or ev.kind in ("join", "rejoin")):
                self._schedule_pull(m.node_id)

    def _upsert(self, node_id: str, info: dict) -> NodeView:
        v = self.nodes.get(node_id)
        if v is None:
            v = self.nodes[node_id] = NodeView(node_id)
        v.info = dict(info)
        v.role = str(info.get("role", ""))
        v.control = str(info.get("control", ""))
        v.api = str(info.get("api", ""))
        v.draining = bool(info.get("draining", False))
        self._take_startup_profile(v)
        return v

    def _take_startup_profile(self, v: NodeView) -> None:
        """Feeds a model node's start-up profile (its member record's
        model.startup_profile: engine/startup_profile.py) to the cost model as timed steps,
        once per node process (its record's `started`): the model is calibrated from them
        before that node serves a request (a placement on it needs this record first)."""
        raw = (v.info.get("model") or {}).get("startup_profile")
        started = v.info.get("started")
        if not raw or self._profiled.get(v.node_id) == started:
            return
        self._profiled[v.node_id] = started
        try:
            profile = StartupProfile.from_json(raw)
        except ValueError as e:
            log.warning("startup_profile_invalid", node=v.node_id, error=str(e))
            return
        self.profiles[v.node_id] = profile.summary()
        self._cost()
        for step in profile.prefill_steps:
            self.model.observe_prefill_step(*step, source=STARTUP_PROFILE)
        for step in profile.decode_steps:
            self.model.observe_step(*step, source=STARTUP_PROFILE)
        self.model.fit_decode_profile(profile.decode_steps)
        log.info("startup_profile_taken", node=v.node_id, **profile.summary(),
                 calibrated={k: self.model.calibrated(k) for k in ("prefill", "decode")},
                 scale=self.model.scale)

    def _schedule_pull(self, node_id: str) -> None:
        t = self._pulls.get(node_id)
        if t is None or t.done():
            self._pulls[node_id] = asyncio.create_task(self._pull(node_id))

    async def _pull(self, node_id: str) -> None:
        """Replaces the index's view of node_id by its store inventory."""
        v = self.nodes.get(node_id)
        if v is None or not v.control:
            return
        try:
            r = await self.client.call(v.control, "store.inventory", None,
                                       timeout_s=self.settings.cluster.rpc_timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead node is dropped by the membership watch
            log.warning("conductor_inventory_failed", node=node_id, error=str(e))
            return
        tiers = {tier: list(unhex_keys(keys, "tiers")) for tier, keys in r["tiers"].items()}
        self.index.load_inventory(Inventory(node_id, int(r["seq"]), tiers))
        v.store_seq = int(r["seq"])
        log.info("conductor_inventory", node=node_id, seq=v.store_seq,
                 blocks=self.index.blocks_on(node_id))

    # ------------------------------------------------------------------ reports

    async def report(self, r: NodeReport) -> None:
        """Handler of `conductor.report`: one node's load, store events, finished prefills
        and timed decode steps (messages.NodeReport)."""
        v = self.nodes.get(r.node) or self._upsert(r.node, {"role": r.role})
        apply_load(v, r, time.monotonic())
        self._apply_events(v, r.events, r.store_seq)
        for d in r.done:
            self.model.observe_prefill(d)
            if self.settings.conductor.refit_cost_model:   # false: predictions stay fixed
                self.cpp_learner.observe(d.rid, d.seconds, d.cached, d.stages)
        if self.model.cost is None and (r.decode_steps or r.prefill_steps):
            self._cost()      # a model node reports steps: its record has the model's KV size
        for step in r.decode_steps:
            self.model.observe_step(*step)
        for step in r.prefill_steps:
            self.model.observe_prefill_step(*step)
        for rid, seconds in r.ttfts:          # what the API nodes saw: the TTFT overhead
            self.model.observe_ttft(rid, seconds)
        for rid, seconds in r.tbts:           # and the TBT factor
            self.model.observe_tbt(rid, seconds)
        self._save_calibration(time.monotonic())

    def _machine_key(self) -> dict | None:
        """calibration_cache.machine_key of the first model node that published one."""
        for v in self.nodes.values():
            key = calibration_cache.machine_key(v.info.get("model") or {},
                                                self.settings.model.num_threads)
            if key is not None:
                return key
        return None

    def _save_calibration(self, now: float) -> None:
        """Keeps a calibrated built-in default (or a cached calibration, refined) under the
        state dir for the next start on this hardware (calibration_cache.py): once both
        parts are calibrated, at most every CALIBRATION_SAVE_S, when it changed."""
        m, cost = self.model, self.model.cost
        if cost is None or cost.meta.get("source") not in ("default", calibration_cache.SOURCE):
            return
        version = m.calibrations + m.refits + m.decode_refits
        if (version == self._saved_version or now - self._saved_at < CALIBRATION_SAVE_S
                or min(m.observed.values()) < max(1, self.settings.conductor.admission_warmup)):
            return
        key = self._machine_key()
        if key is None:
            return
        self._saved_at, self._saved_version = now, version
        path = calibration_cache.save(state_dir(self.settings), key, cost)
        if path is not None:
            log.info("calibrated_cost_model_saved", path=str(path), **m.scale)

    def _apply_events(self, v: NodeView, events: Sequence[StoreEventMsg], store_seq: int
                      ) -> None:
        if v.store_seq < 0:          # no inventory yet: the pull will cover these
            if v.info.get("store"):
                self._schedule_pull(v.node_id)
            return
        for e in events:
            seq = e.seq
            if seq <= v.store_seq:
                continue             # already in the inventory we loaded
            if seq != v.store_seq + 1:
                log.warning("conductor_event_gap", node=v.node_id, have=v.store_seq, got=seq)
                self._schedule_pull(v.node_id)
                return
            self.index.apply(v.node_id, [BlockEvent(e.kind, k, e.tier) for k in e.keys])
            v.store_seq = seq
        if store_seq > v.store_seq:  # the node delivered events we never got (a lost report)
            log.warning("conductor_event_gap", node=v.node_id, have=v.store_seq, got=store_seq)
            self._schedule_pull(v.node_id)

    # ------------------------------------------------------------------ placement

    def _set_cost(self, model: CostModel) -> None:
        """The cluster-wide cost model (cost_store.py) replaces the one in use."""
        log.info("cost_model_loaded", origin=model.meta.get("origin"), name=model.name)
        self.model.cost = model

    def _cost(self) -> CostModel:
        if self.model.cost is None:
            kvb = 0
            for v in self.nodes.values():
                m = v.info.get("model") or {}
                if m.get("block_bytes") and m.get("block_size"):
                    kvb = int(m["block_bytes"]) // int(m["block_size"])
                    break
            self.model.cost = cost_store.load_cost_model(self.settings, kvb)
            key = self._machine_key()
            if self.model.cost.meta.get("source") == "default" and key is not None:
                cached = calibration_cache.load(state_dir(self.settings), key)
                if cached is not None:          # this hardware's calibration, not a guess
                    log.info("cost_model_loaded", origin=cached.meta["origin"],
                             name=cached.name)
                    self.model.cost = cached
            self.model.cost.meta.setdefault(
                "origin", f"file {cost_store.cost_model_path(self.settings)}"
                if self.model.cost.meta.get("source") != "default" else "built-in default")
        return self.model.cost

    def link_rates(self) -> list[float]:
        """Every peer path's measured bandwidth (bytes/s) the nodes reported; their median
        is the cost model's transfer rate (`with_measured_bandwidth`), which a fetch over a
        path not measured is predicted with. None with conductor.refit_cost_model false:
        a fixed cost model keeps its own transfer rate too, so placement is reproducible
        (measured rates swing with the machine's load)."""
        if not self.settings.conductor.refit_cost_model:
            return []
        return [r for v in self.nodes.values() for r in v.links.values()]

    def path_rates(self) -> dict[tuple[str, str], float]:
        """The measured node paths as (peer, node) -> bytes/s: what `node`'s transfer
        engine measured on the transfers it made with `peer` (NodeReport.links), taken as
        the rate of bytes moving from `peer` to `node` (Snapshot.path_bytes_per_s).

        Which direction that is: a node meters the transfers it starts, READs (bytes
        peer -> node) and WRITEs (node -> peer) alike, per peer. A prefill node READs the
        prefix blocks it fetches from a holder (`store.fetch`, bytes holder -> prefill:
        the direction a fetch decision needs) and WRITEs its layer-wise KV push to the
        decode node (prefill -> decode); a decode node READs a prefill node's staged KV
        when the push did not deliver it (prefill -> decode); a replica's destination
        READs from its source (hot-block copies). So (s, i) for a prefill node i is i's
        fetches from s, mixed with i's pushes to s when s is also a decode node i pushes
        to (the same link the other way; shaped both ways alike under `--hosts`).
        Empty with conductor.refit_cost_model false (see `link_rates`)."""
        if not self.settings.conductor.refit_cost_model:
            return {}
        return {(peer, nid): r for nid, v in self.nodes.items() for peer, r in v.links.items()}

    def fetch_path_rates(self) -> dict[tuple[str, str], float]:
        """The measured paths a fetch decision reads: `path_rates` into prefill nodes
        (source, prefill node) -> bytes/s."""
        return {(s, d): r for (s, d), r in self.path_rates().items()
                if d in self.nodes and self.nodes[d].role == "prefill"}

    def not_ready(self) -> str | None:
        """Why a request sent now would not be placed, or None when it would: this
        conductor has a live report from a prefill node (or a complete CPP group) and one
        from a decode node, or one from a coupled node (role all). The API nodes' /health
        follows it (issue 32: ready means ready)."""
        now = time.monotonic()

        def reported(role: str) -> list[NodeView]:
            return [v for v in self._eligible(role, set(), now) if v.reported_at]
        pre, groups = split_groups(reported("prefill"))
        groups = usable_groups(groups)       # a stalled group takes no request now
        if (pre or groups) and reported("decode"):
            return None
        if any(v.control for v in reported("all")):
            return None
        missing = [r for r, ok in (("prefill", pre or groups), ("decode", reported("decode")))
                   if not ok]
        return (f"the conductor ({self.node_id}) has no report from a "
                f"{' or a '.join(missing)} node yet")

    def _eligible(self, role: str, exclude: set[str], now: float) -> list[NodeView]:
        # A node is live while it reports. Right after a leader change nobody has reported to
        # this conductor yet: members (their leases are alive) count as live, with no load,
        # for one staleness period.
        warming = now - self._started_mono < self.stale_s
        return [v for v in self.nodes.values()
                if v.role == role and not v.draining and v.node_id not in exclude
                and (now - v.reported_at < self.stale_s if v.reported_at else warming)]

    async def place(self, req: PlaceRequest) -> PlaceReply | PlaceRejected:
        """Handler of `conductor.place` (messages.PlaceRequest): the prefill and decode
        nodes, the blocks to fetch and from where, or an early rejection. With
        `decode_only`, a decode node for a request whose prefill already ran."""
        keys = list(req.keys)
        n, max_new, rid = req.prompt_tokens, req.max_new_tokens, req.rid
        exclude = set(req.exclude)
        decode_only = req.decode_only
        now = time.monotonic()
        cost = with_measured_bandwidth(self._cost(), self.link_rates())
        cs = self.settings.conductor
        pre = self._eligible("prefill", exclude, now)
        pre, groups = split_groups(pre)      # CPP stages are placed as groups (cpp_place.py)
        groups = usable_groups(groups)       # not on a stalled group (slots held, hung)
        dec = self._eligible("decode", exclude, now)
        retry = cs.min_retry_after_s
        if not pre and not groups and not dec and not decode_only:
            # v.control: a node known only from a report (its member record gone, e.g. its
            # lease expired while it stalled) cannot be reached until it registers again.
            coupled = [v for v in self._eligible("all", exclude, now) if v.control]
            if coupled:
                return self._place_coupled(req, coupled, cost, now)
        if (not pre and not groups and not decode_only) or not dec:
            reason = "no_decode_node" if pre or groups or decode_only else "no_prefill_node"
            role = "decode" if pre or groups or decode_only else "prefill"
            drained = sorted(v.node_id for v in self.nodes.values()
                             if v.role == role and v.draining)
            detail = (f"{', '.join(drained)} {'is' if len(drained) == 1 else 'are'} draining"
                      if drained else f"no {role} node has joined or reported")
            return dataclasses.replace(self._reject(Rejection(reason, retry)), detail=detail)
        bs = self._block_size(pre[0] if pre else dec[0])
        checks = cs.admission != "off"
        cfg = PolicyConfig(policy=cs.policy, block_size=bs,
                           cache_balance_threshold=cs.cache_balance_threshold,
                           # predicted TTFT + the learned overhead vs the SLO
                           ttft_slo_s=math.inf if decode_only or not checks
                           else self._ttft_budget_s(),
                           # predicted step x tbt_factor (the tail of the gaps) vs the SLO
                           tbt_slo_s=cs.tbt_slo_s / self.model.tbt_factor() if checks
                           else math.inf,
                           min_retry_after_s=retry,
                           fetch_rule=cs.fetch_rule, decode_rule=cs.decode_rule,
                           fetch_policy=cs.fetch_policy,
                           # the order the prefill nodes run (cluster/prefill_queue.py); no
                           # elastic pipelines: live CPP groups are fixed (issue 14)
                           prefill_order=cs.prefill_order,
                           aging_s=cs.prefill_aging_s if cs.prefill_aging_s >= 0 else None,
                           fcfs_slack_s=(cs.prefill_fcfs_slack_s
                                         if cs.prefill_fcfs_slack_s >= 0 else None),
                           fcfs_slack_ratio=(cs.prefill_fcfs_slack_ratio
                                             if cs.prefill_fcfs_slack_ratio >= 0 else None),
                           spf_bound_rule=cs.prefill_bound_rule,
                           pipeline_stages=1)
        queued: list = []
        queue: list[float] = []
        if decode_only:
            # The prefill already ran: only the decode side is chosen (the prefill side is a
            # placeholder with no queue, fully cached).
            snap_pre = (["-"], [0.0], [len(keys)])
        else:
            queue = [queue_s(v, cost, now) for v in pre]
            snap_pre = ([v.node_id for v in pre], queue,
                        self.index.match(keys, [v.node_id for v in pre]))
            if cfg.prefill_order == "spf":    # the wait under the order the nodes run
                queued = [QueuedWork.of(queued_work(v, cost)) for v in pre]
        # The request decodes from its first token (at the soonest after the shortest prefill
        # queue and its own prefill) for max_new steps: the placements in flight to a
        # decode node count in its batch and KV only when they decode then too, and the
        # batch decoding now only until it is predicted to finish (load.decode_load_during).
        start = now + (min(queue) if queue else 0.0)
        dbatch, dctx, dfree = [], [], []
        first = start + (0.0 if decode_only else cost.prefill_s(n, 0))
        for v in dec:
            end = first + max_new * cost.decode_step_s(v.decode_batch + 1,
                                                       v.decode_context_tokens + n)
            b, c, infl = decode_load_during(v, first, end, now, rid)
            dbatch.append(b)
            dctx.append(c)
            free = v.free_kv_tokens if v.reported_at else \
                int((v.info.get("model") or {}).get("kv_capacity_tokens", 0))   # not reported yet
            dfree.append(free - infl)
        # Fetch sources besides the prefill nodes: cache nodes, then decode nodes (their
        # stores hold finished requests' prompt + output, store.decode_offload: the next
        # turn of a conversation). Cache nodes first: on a tie one of them serves the fetch.
        holders = [] if decode_only else [
            v.node_id for role in ("cache", "decode") for v in self._eligible(role, set(), now)
            if v.control and (role == "cache" or v.info.get("store"))]
        snap = Snapshot(*snap_pre, decode_nodes=[v.node_id for v in dec], decode_batch=dbatch,
                        decode_context_tokens=dctx, decode_free_kv_tokens=dfree,
                        holder_nodes=holders, holder_prefix_blocks=self.index.match(keys, holders),
                        prefill_queued_s=queued, path_bytes_per_s=self.path_rates())
        preq = PlacementRequest(keys, n, max_new)
        stage_prefix = {g.name: self._stage_prefix(g, keys) for g in groups}

        def placement(c: PolicyConfig, r: PlacementRequest = preq, s: Snapshot = snap,
                      queue=queue_s) -> Placement | Rejection | None:
            out = place(r, s, cost, c, self.rng) if pre or decode_only else None
            if groups and not decode_only:
                out = place_with_groups(out, groups, r, s, cost, c, self.rng,
                                        cs.cpp_min_tokens, queue, self.cpp_learner,
                                        stage_prefix)
            return out

        result = placement(cfg)
        miss = result if isinstance(result, Rejection) else None
        if miss is not None:
            def idle(r: PlacementRequest, s: Snapshot) -> Placement | Rejection | None:
                return placement(dataclasses.replace(cfg, tbt_slo_s=math.inf), r, s,
                                 lambda v, c: 0.0)

            def hopeless() -> bool:    # over the TTFT SLO even with every queue empty
                return miss.reason == "ttft_slo" and unattainable(idle, preq, snap)
            if self._verdict(rid, miss, decode_only, hopeless) == REJECT:
                if hopeless():         # retrying cannot help
                    return self._unattainable(miss, longest_attainable(idle, preq, snap, bs))
                return self._reject(miss)
            # shadow (or a model not calibrated yet): the placement without the SLO checks
            result = placement(dataclasses.replace(cfg, ttft_slo_s=math.inf,
                                                   tbt_slo_s=math.inf))
        elif not decode_only:
            self._record(rid, ADMIT, "", result)
        if groups and not decode_only:
            for g in groups:
                if isinstance(result, Placement) and result.prefill == g.head.node_id:
                    self.cpp_learner.predicted(rid, g.name, *group_chunk_prediction(cost, g, n))
        if not decode_only and keys and self.settings.conductor.hot_block_hits > 0:
            self.replicator.note_request(keys, now, self.nodes,
                                         self._eligible("cache", set(), now), cost, bs)
        return self._accept(rid, result, n, max_new, decode_only, now)

    def _stage_prefix(self, g: Group, keys: list[bytes]) -> tuple[int, ...]:
        """Each stage's own prefix of `keys` in blocks: its layer slices (store/keys.py
        slice_key) in the index, from its store's events (cluster/cpp/stage_prefix.py)."""
        out = []
        for v, (a, b) in zip(g.stages, g.layers):
            if not keys or b <= a:
                out.append(0)
                continue
            out.append(self.index.match([slice_key(k, a, b) for k in keys], [v.node_id])[0])
        return tuple(out) if len(out) == len(g.stages) else (0,) * len(g.stages)

    def _place_coupled(self, req: PlaceRequest, nodes: list[NodeView], cost: CostModel,
                       now: float) -> PlaceReply | PlaceRejected:
        """Coupled nodes (role all, cluster.coupled: prefill and decode in one engine), as
        the simulator's coupled baseline places them: the node with the least queued
        prefill work (policy ``load_balancing``, no decode side), which then decodes too.
        The same SLO checks: TTFT by `place`, TBT as a decode node's (step time of that
        node with the request, `step_with_request_s`)."""
        keys, n, max_new = list(req.keys), req.prompt_tokens, req.max_new_tokens
        cs = self.settings.conductor
        cfg = PolicyConfig(policy="load_balancing", block_size=self._block_size(nodes[0]),
                           ttft_slo_s=self._ttft_budget_s(), tbt_slo_s=cs.tbt_slo_s,
                           min_retry_after_s=cs.min_retry_after_s)
        ids = [v.node_id for v in nodes]
        snap = Snapshot(ids, [queue_s(v, cost, now) for v in nodes], self.index.match(keys, ids))
        preq = PlacementRequest(keys, n, max_new)
        result = place(preq, snap, cost, cfg, self.rng)
        if isinstance(result, Rejection):
            def idle(r: PlacementRequest, s: Snapshot) -> Placement | Rejection:
                return place(r, s, cost, cfg, self.rng)

            def hopeless() -> bool:   # over the TTFT SLO even with every queue empty
                return result.reason == "ttft_slo" and unattainable(idle, preq, snap)
            if cs.admission == "off" or self._verdict(req.rid, result, False,
                                                      hopeless) == REJECT:
                if hopeless():                    # retrying cannot help when idle too
                    return self._unattainable(result, longest_attainable(
                        idle, preq, snap, cfg.block_size))
                return self._reject(result)   # off: the TTFT SLO is inf, nothing is rejected
            result = place(preq, snap, cost, dataclasses.replace(cfg, ttft_slo_s=math.inf),
                           self.rng)
            miss = True
        else:
            miss = False
        v = self.nodes[result.prefill]
        start = now + result.predicted_ttft_s
        b, c, _ = decode_load_during(v, start, start + max_new * cost.decode_step_s(
            v.decode_batch + 1, v.decode_context_tokens + n), now, req.rid)
        tbt = step_with_request_s(cost, b, c, n)
        result = dataclasses.replace(result, decode=result.prefill, predicted_tbt_s=tbt)
        if tbt * self.model.tbt_factor() > cs.tbt_slo_s and cs.admission != "off" and not miss:
            over = Rejection("tbt_slo", cs.min_retry_after_s, result.predicted_ttft_s, tbt)
            if self._verdict(req.rid, over, False) == REJECT:
                return self._reject(over)
        elif not miss:
            self._record(req.rid, ADMIT, "", result)
        return self._accept(req.rid, result, n, max_new, False, now)

    def _ttft_budget_s(self) -> float:
        """The TTFT SLO less the learned per-request overhead (refit.ttft_overhead_s: time
        outside the modelled steps), what the modelled TTFT must stay under (> 0)."""
        return max(1e-3, self.settings.conductor.ttft_slo_s - self.model.ttft_overhead_s())

    def _e2e_ttft(self, predicted_ttft_s: float) -> float:
        """A modelled TTFT (seconds) plus the learned overhead: the TTFT a client is
        predicted to see (what the ledger, replies and rejections say; NaN stays NaN)."""
        return predicted_ttft_s + self.model.ttft_overhead_s()

    def _verdict(self, rid: str, miss: Rejection, decode_only: bool,
                 hopeless: Callable[[], bool] | None = None) -> str:
        """What `conductor.admission` makes of a predicted miss (admission_ledger.decide):
        REJECT, or SHADOW (recorded; the request is placed without the SLO checks; also a
        request in the holdout, `conductor.admission_holdout`). A TTFT miss needs a
        calibrated prefill model, a TBT or KV-room miss a calibrated decode model
        (`CostModelRefitter.calibrated`). `hopeless()`: whether the miss holds on an idle
        cluster too (attainable.py); such a request is not held out, as no load explains
        its rejection and admitting it would hold a prefill node for seconds."""
        kind = "prefill" if miss.reason == "ttft_slo" else "decode"
        calibrated = self.model.calibrated(kind)
        cs = self.settings.conductor
        drawn = bool(cs.admission == "enforce" and calibrated
                     and in_holdout(cs.admission_holdout, rid)
                     and not (hopeless is not None and hopeless()))
        verdict = decide(cs.admission, miss.reason, calibrated, drawn)
        if verdict != REJECT:
            log.info("placement_shadow_rejected", request_id=rid, reason=miss.reason,
                     calibrated=calibrated, held_out=drawn,
                     predicted_ttft_s=miss.predicted_ttft_s,
                     predicted_tbt_s=miss.predicted_tbt_s)
        if not decode_only:
            self.admission.record(rid, Decision(verdict, miss.reason,
                                                self._e2e_ttft(miss.predicted_ttft_s),
                                                miss.predicted_tbt_s, calibrated, drawn))
        return verdict

    def _record(self, rid: str, verdict: str, reason: str, p: Any) -> None:
        """Records an admitted placement's predictions (seconds) under rid."""
        if isinstance(p, Placement):
            self.admission.record(rid, Decision(verdict, reason,
                                                self._e2e_ttft(p.predicted_ttft_s),
                                                p.predicted_tbt_s, True))

    def admissions(self, rids: list[str] | None = None) -> dict[str, Any]:
        """`conductor.admissions`: the ledger's decisions for `rids` (all it holds when
        None) and its counts (admission_ledger.AdmissionLedger)."""
        return {"mode": self.settings.conductor.admission,
                "holdout_share": self.settings.conductor.admission_holdout,
                **self.admission.status(), "decisions": self.admission.entries(rids)}

    def _block_size(self, v: NodeView) -> int:
        m = v.info.get("model") or {}
        return int(m.get("block_size") or self.settings.engine.block_size)

    def _reject(self, r: Rejection) -> PlaceRejected:
        # what the client is told is what was set against the SLOs: the TTFT with the
        # learned overhead, and for a TBT rejection the step x the TBT factor
        r = dataclasses.replace(r, predicted_ttft_s=self._e2e_ttft(r.predicted_ttft_s))
        if r.reason == "tbt_slo":
            r = dataclasses.replace(r, predicted_tbt_s=r.predicted_tbt_s * self.model.tbt_factor())
        self.rejected[r.reason] = self.rejected.get(r.reason, 0) + 1
        log.info("placement_rejected", reason=r.reason, retry_after_s=r.retry_after_s,
                 predicted_ttft_s=r.predicted_ttft_s, predicted_tbt_s=r.predicted_tbt_s)
        return PlaceRejected(r.reason, r.retry_after_s,
                             None if math.isnan(r.predicted_ttft_s) else r.predicted_ttft_s,
                             None if math.isnan(r.predicted_tbt_s) else r.predicted_tbt_s)

    def _unattainable(self, r: Rejection, max_prompt_tokens: int) -> PlaceRejected:
        """A TTFT rejection that no wait can cure (conductor/attainable.py): reason
        "ttft_slo_unattainable", the longest prompt that would meet the SLO when idle."""
        rej = self._reject(dataclasses.replace(r, reason="ttft_slo_unattainable"))
        return dataclasses.replace(rej, max_prompt_tokens=max_prompt_tokens)

    def _accept(self, rid: str, p: Placement, n: int, max_new: int, decode_only: bool,
                now: float) -> PlaceReply:
        dv = self.nodes[p.decode]
        pv = self.nodes.get(p.prefill) or NodeView("-")
        if not decode_only:
            pv.inflight_prefill[rid] = InflightPrefill(n - p.prefix_tokens, p.prefix_tokens, now)
            pv.placed += 1
            self.model.predicted(rid, p.predicted_ttft_s, now)
        self.model.predicted_tbt(rid, p.predicted_tbt_s, now)
        dv.inflight_decode[rid] = inflight_decode(n + max_new, now, p.predicted_ttft_s,
                                                  max_new * p.predicted_tbt_s)
        dv.placed += 1
        self.placed += 1
        fetch = None
        if p.fetch is not None and not decode_only:
            src = self.nodes.get(p.fetch.source)
            if src is not None and src.control:
                fetch = FetchPlan(src.node_id, src.control, tuple(p.fetch.keys))
        return PlaceReply(NodeRef(pv.node_id, pv.control, pv.api),
                          NodeRef(dv.node_id, dv.control, dv.api), fetch, p.prefix_tokens,
                          min(p.local_prefix_blocks * self._block_size(pv), n),
                          self._e2e_ttft(p.predicted_ttft_s), p.predicted_tbt_s)

    # ------------------------------------------------------------------ inspection

    def _groups_status(self) -> dict:
        """CPP groups as placement sees them: complete ones (stage nodes in order), the
        stalled ones among them (group -> {stage: why}; not placed on) and what was learned."""
        groups = split_groups([v for v in self.nodes.values() if v.role == "prefill"])[1]
        return {"complete": {g.name: [v.node_id for v in g.stages] for g in groups},
                "stalled": stalled_groups(groups), "learned": self.cpp_learner.status()}

    def status(self) -> dict:
        """What `mooncake ctl` shows of the conductor: nodes' load, index size, cost model
        and its TTFT prediction error (signed relative error: > 0 over-predicts)."""
        now = time.monotonic()
        cost = self.cost
        nodes = {}
        for nid, v in sorted(self.nodes.items()):
            nodes[nid] = {
                "role": v.role, "draining": v.draining,
                "report_age_s": round(now - v.reported_at, 3) if v.reported_at else None,
                "prefill_pending": len(v.prefill_pending), "inflight": len(v.inflight_prefill)
                + len(v.inflight_decode),
                "queue_s": round(queue_s(v, cost), 4) if cost is not None else None,
                "decode_batch": v.decode_batch, "decode_context_tokens": v.decode_context_tokens,
                "free_kv_tokens": v.free_kv_tokens, "indexed_blocks": self.index.blocks_on(nid),
                "store_seq": v.store_seq, "placed": v.placed, "stalled": v.stalled or None,
                "links": {p: round(r) for p, r in sorted(v.links.items())}}
        return {
            "leader": self.node_id, "since": self.started_at, "placed": self.placed,
            "rejected": dict(self.rejected), "indexed_keys": len(self.index), "nodes": nodes,
            "admission": {"mode": self.settings.conductor.admission,
                          "warmup_steps": self.settings.conductor.admission_warmup,
                          "holdout_share": self.settings.conductor.admission_holdout,
                          **self.admission.status()},
            "policy": self.settings.conductor.policy,
            # a fetch over a measured path into a prefill node is predicted at that path's
            # rate (fetch_paths, "source->prefill node": bytes/s); any other transfer at
            # used_bytes_per_s, the median of the measured paths (else the configured rate)
            "transfer_bandwidth": {
                "configured_bytes_per_s": cost.transfer.bandwidth_bytes_per_s if cost else None,
                "used_bytes_per_s": (with_measured_bandwidth(cost, self.link_rates())
                                     .transfer.bandwidth_bytes_per_s if cost else None),
                "measured_paths": len(self.link_rates()),
                "fetch_paths": {f"{s}->{d}": round(r)
                                for (s, d), r in sorted(self.fetch_path_rates().items())}},
            "cpp_groups": self._groups_status(),
            # each model node's start-up profile (seconds, steps) the cost model took
            "startup_profiles": dict(sorted(self.profiles.items())),
            "slo": {"ttft_s": self.settings.conductor.ttft_slo_s,
                    "tbt_s": self.settings.conductor.tbt_slo_s},
            "replication": {**self.replicated, "in_flight": self.replicator.in_flight(),
                            "hot_block_hits": self.settings.conductor.hot_block_hits,
                            "target_replicas": self.settings.conductor.hot_block_replicas},
            **self.model.status(),
        }


__all__ = ["ConductorService", "INFLIGHT_TTL_S", "NodeView"]
