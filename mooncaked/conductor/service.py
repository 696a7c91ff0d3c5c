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

`place(payload)` answers the `conductor.place` RPC: a placement (prefill node,
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
import os
import random
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncaked.config import Settings
from mooncaked.log import get_logger

from .cost_model import DECODE_TERMS, CostModel, PolyModel, TransferModel
from .index import BlockEvent, PrefixIndex
from .policy import Placement, PlacementRequest, PolicyConfig, Rejection, Snapshot, place

log = get_logger(__name__)

INFLIGHT_TTL_S = 3.0        # a placement not seen in the chosen node's reports by then is gone
REFIT_MIN_SAMPLES = 16      # prefill samples (run alone on their node) before a refit is tried
ERROR_WINDOW = 200          # TTFT prediction errors kept for `status()`
REPLICATE_COOLDOWN_S = 5.0  # a prefix is not copied again this soon (its events lag)
HITS_MAX = 100_000          # block keys whose reuse counts the conductor remembers (LRU)


def _refit(current: PolyModel, samples: Any, terms: Any, nonnegative: bool = False
           ) -> tuple[PolyModel, dict] | None:
    """A PolyModel fitted to (x1, x2, seconds) samples, with its provenance, when it beats
    `current` on them by 20% in mean relative error; else None. Never a fit that predicts
    <= 0 at the largest observed (x1, x2), nor (nonnegative) one with a negative
    coefficient: live samples move together (batch and context grow alike), so a fit can
    look good on them and still go negative elsewhere."""
    x1, x2, y = zip(*samples)
    try:
        new = PolyModel.fit(x1, x2, y, tuple(terms))
    except ValueError:
        return None
    if new(max(x1), max(x2)) <= 0 or (nonnegative and min(new.coef) < 0):
        return None

    def err(m) -> float:
        return statistics.fmean(abs(max(0.0, m(a, b)) - t) / t for a, b, t in samples)

    old_err, new_err = err(current), err(new)
    if new_err >= 0.8 * old_err:
        return None
    return new, {"samples": len(samples), "mean_rel_error": round(new_err, 4),
                 "previous_mean_rel_error": round(old_err, 4)}


class NotLeader(RuntimeError):
    """This node does not run the conductor (any more); ask the current leader."""


def state_dir(settings: Settings) -> Path:
    """The node's persistent state directory: node.state_dir, else $STATE_DIRECTORY (systemd's
    StateDirectory=), else ~/.local/state/mooncaked."""
    d = settings.node.state_dir or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(d or os.path.expanduser("~/.local/state/mooncaked"))


def cost_model_path(settings: Settings) -> Path:
    """Where `mooncaked profile` writes the cost model and the conductor reads it:
    conductor.cost_model, else <state dir>/cost_model.json."""
    return Path(settings.conductor.cost_model) if settings.conductor.cost_model \
        else state_dir(settings) / "cost_model.json"


def default_cost_model(kv_bytes_per_token: int) -> CostModel:
    """A rough cost model of the bundled 135M model on a small shared CPU (2 cores), for
    clusters that have not run `mooncaked profile` yet: prefill about 6 ms a new token,
    a decode step 40 ms plus 4 ms a sequence and 20 us a context token (one thread,
    fp32), loopback TCP at 1 GB/s."""
    return CostModel(
        prefill=PolyModel(((0, 0), (1, 0), (0, 1), (2, 0), (1, 1)), (0.05, 0.006, 1e-5, 0.0, 0.0)),
        decode=PolyModel(((0, 0), (1, 0), (0, 1)), (0.04, 0.004, 2e-5)),
        transfer=TransferModel(1e9, 0.002), kv_bytes_per_token=max(1, kv_bytes_per_token),
        name="default CPU estimate (run `mooncaked profile` to fit this hardware)",
        meta={"source": "default"})


def load_cost_model(settings: Settings, kv_bytes_per_token: int) -> CostModel:
    """The profiled cost model if its file exists and is valid, else `default_cost_model`
    (logged). Never raises for a missing or bad file: the conductor must come up."""
    path = cost_model_path(settings)
    if path.exists():
        try:
            model = CostModel.load(path)
            log.info("cost_model_loaded", path=str(path), name=model.name)
            return model
        except (OSError, ValueError) as e:
            log.error("cost_model_invalid", path=str(path), error=str(e))
    else:
        log.warning("cost_model_missing", path=str(path),
                    hint="run `mooncaked profile` on this hardware")
    return default_cost_model(kv_bytes_per_token)


@dataclass
class NodeView:
    """What the conductor knows of one node (from its member record and its reports)."""

    node_id: str
    role: str = ""
    control: str = ""
    api: str = ""
    info: dict = field(default_factory=dict)
    draining: bool = False
    reported_at: float = 0.0                 # monotonic seconds of the last report; 0: none
    # rid -> (new tokens, cached tokens)
    prefill_pending: dict[str, tuple[int, int]] = field(default_factory=dict)
    decode_rids: set[str] = field(default_factory=set)
    decode_batch: int = 0
    decode_context_tokens: int = 0
    free_kv_tokens: int = 0
    store_seq: int = -1                      # last store event seq applied (-1: no inventory yet)
    inflight_prefill: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    inflight_decode: dict[str, tuple[int, float]] = field(default_factory=dict)
    placed: int = 0                          # requests placed here (prefill or decode)


def _hexkeys(keys: Any) -> list[bytes]:
    if not isinstance(keys, list):
        raise ValueError("keys must be a list of hex strings")
    try:
        return [bytes.fromhex(k) for k in keys]
    except (TypeError, ValueError) as e:
        raise ValueError(f"keys must be hex strings: {e}") from None


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
        self.cost = cost
        self.index = PrefixIndex()
        self.nodes: dict[str, NodeView] = {}
        self.stale_s = max(3.0, 8 * settings.cluster.report_interval_s)
        self.rng = random.Random(0)
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.placed = 0
        self.rejected: dict[str, int] = {}
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)   # relative TTFT errors
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=256)  # (new, cached, s) alone
        self._new_samples = 0
        self.decode_errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # relative step errors
        self.decode_samples: deque[tuple[int, int, float]] = deque(maxlen=512)  # (batch, ctx, s)
        self._new_decode_samples = 0
        self.decode_refits = 0
        self.refits = 0
        self._predicted: dict[str, tuple[float, float]] = {}      # rid -> (ttft_s, monotonic)
        self._pulls: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        # hot-block replication (section 4.2): block key -> placements that reused it
        self.hits: OrderedDict[bytes, int] = OrderedDict()
        self._replicating: dict[bytes, float] = {}   # last key of a prefix -> copy ended (inf: running)
        self._replications: set[asyncio.Task] = set()
        self.replicated = {"started": 0, "blocks": 0, "failed": 0}

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
        log.info("conductor_started", node=self.node_id, nodes=sorted(self.nodes),
                 indexed_keys=len(self.index))

    async def stop(self) -> None:
        """Stops following membership; the index is dropped with the object."""
        tasks = [t for t in [self._task, *self._pulls.values(), *self._replications]
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
        return v

    def _schedule_pull(self, node_id: str) -> None:
        t = self._pulls.get(node_id)
        if t is None or t.done():
            self._pulls[node_id] = asyncio.create_task(self._pull(node_id))

    async def _pull(self, node_id: str) -> None:
        """Replaces the index's view of node_id by its store inventory."""
        v = self.nodes.get(node_id)
        if v is None or not v.control:
            return
        from mooncaked.store.types import Inventory  # noqa: PLC0415 - keep import light
        try:
            r = await self.client.call(v.control, "store.inventory", None,
                                       timeout_s=self.settings.cluster.rpc_timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead node is dropped by the membership watch
            log.warning("conductor_inventory_failed", node=node_id, error=str(e))
            return
        tiers = {tier: [bytes.fromhex(k) for k in keys] for tier, keys in r["tiers"].items()}
        self.index.load_inventory(Inventory(node_id, int(r["seq"]), tiers))
        v.store_seq = int(r["seq"])
        log.info("conductor_inventory", node=node_id, seq=v.store_seq,
                 blocks=self.index.blocks_on(node_id))

    # ------------------------------------------------------------------ reports

    async def report(self, payload: Any) -> dict:
        """Handler of `conductor.report`: one node's load, store events, finished prefills
        and timed decode steps.

        Payload: {"node", "role", "draining", "pending": {rid: [new, cached]}, "arrived":
        [rid], "decode": {"rids": [...], "batch", "context_tokens", "free_kv_tokens"},
        "store_seq", "events": [{"kind", "tier", "keys": [hex], "seq"}], "done": [{"rid",
        "seconds", "new", "cached", "alone"}], "decode_steps": [[batch size, context
        tokens, seconds]]}. Returns {"ok": true}.
        Raises: ValueError on a malformed payload.
        """
        if not isinstance(payload, dict) or not isinstance(payload.get("node"), str):
            raise ValueError("report needs {'node': <id>, ...}")
        nid = payload["node"]
        v = self.nodes.get(nid) or self._upsert(nid, {"role": payload.get("role", "")})
        now = time.monotonic()
        v.reported_at = now
        v.draining = bool(payload.get("draining", False)) or bool(v.info.get("draining", False))
        v.prefill_pending = {rid: (int(a), int(b))
                             for rid, (a, b) in (payload.get("pending") or {}).items()}
        dec = payload.get("decode") or {}
        v.decode_rids = set(dec.get("rids", ()))
        v.decode_batch = int(dec.get("batch", 0))
        v.decode_context_tokens = int(dec.get("context_tokens", 0))
        v.free_kv_tokens = int(dec.get("free_kv_tokens", 0))
        seen = set(payload.get("arrived") or ()) | v.prefill_pending.keys() | v.decode_rids
        # placements the node now counts itself, or that never reached it
        for rid in [r for r, e in v.inflight_prefill.items()
                    if r in seen or now - e[2] > INFLIGHT_TTL_S]:
            del v.inflight_prefill[rid]
        for rid in [r for r, e in v.inflight_decode.items()
                    if r in seen or now - e[1] > INFLIGHT_TTL_S]:
            del v.inflight_decode[rid]
        self._apply_events(v, payload.get("events") or [], int(payload.get("store_seq", -1)))
        for d in payload.get("done") or ():
            self._observe(d)
        for step in payload.get("decode_steps") or ():
            self._observe_step(*step)
        return {"ok": True}

    def _apply_events(self, v: NodeView, events: list, store_seq: int) -> None:
        if v.store_seq < 0:          # no inventory yet: the pull will cover these
            if v.info.get("store"):
                self._schedule_pull(v.node_id)
            return
        for e in events:
            seq = int(e["seq"])
            if seq <= v.store_seq:
                continue             # already in the inventory we loaded
            if seq != v.store_seq + 1:
                log.warning("conductor_event_gap", node=v.node_id, have=v.store_seq, got=seq)
                self._schedule_pull(v.node_id)
                return
            self.index.apply(v.node_id, [BlockEvent(e["kind"], k, e["tier"])
                                         for k in _hexkeys(e["keys"])])
            v.store_seq = seq
        if store_seq > v.store_seq:  # the node delivered events we never got (a lost report)
            log.warning("conductor_event_gap", node=v.node_id, have=v.store_seq, got=store_seq)
            self._schedule_pull(v.node_id)

    def _observe(self, d: dict) -> None:
        """Folds one finished prefill in: prediction error, and a refit sample if it ran alone."""
        pred = self._predicted.pop(d.get("rid"), None)
        seconds = float(d.get("seconds", 0.0))
        if pred is not None and seconds > 0:
            self.errors.append((pred[0] - seconds) / seconds)
        if d.get("alone") and seconds > 0 and self.settings.conductor.refit_cost_model:
            self.samples.append((int(d.get("new", 0)), int(d.get("cached", 0)), seconds))
            self._new_samples += 1
            if self._new_samples >= REFIT_MIN_SAMPLES:
                self._new_samples = 0
                self._maybe_refit()

    def _maybe_refit(self) -> None:
        """Refits the prefill polynomial from recent solo prefills when the samples span
        enough lengths and the refit predicts them better than the current model."""
        if self.cost is None:
            return
        lengths = {s[0] for s in self.samples}
        if len(lengths) < 4 or max(lengths) < 4 * max(1, min(lengths)):
            return
        new = _refit(self.cost.prefill, self.samples, ((0, 0), (1, 0), (0, 1), (1, 1)))
        if new is not None:
            model, info = new
            self.cost = dataclasses.replace(self.cost, prefill=model,
                                            meta={**self.cost.meta, "refit": info})
            self.refits += 1
            log.info("cost_model_refit", part="prefill", **info)

    def _observe_step(self, batch: int, context_tokens: int, seconds: float) -> None:
        """Folds one timed decode step in: prediction error, and a refit now and then."""
        if seconds <= 0 or batch < 1:
            return
        if self.cost is not None:
            pred = self.cost.decode_step_s(batch, context_tokens)
            self.decode_errors.append((pred - seconds) / seconds)
        if not self.settings.conductor.refit_cost_model:
            return
        self.decode_samples.append((int(batch), int(context_tokens), float(seconds)))
        self._new_decode_samples += 1
        if self._new_decode_samples >= 4 * REFIT_MIN_SAMPLES:
            self._new_decode_samples = 0
            self._maybe_refit_decode()

    def _maybe_refit_decode(self) -> None:
        """Refits the decode-step model (batch size, context tokens) from served steps when
        they span enough batch sizes and contexts and the refit predicts them better."""
        if self.cost is None:
            return
        batches = {s[0] for s in self.decode_samples}
        contexts = [s[1] for s in self.decode_samples]
        if len(batches) < 3 or max(contexts) < 2 * max(1, min(contexts)):
            return
        new = _refit(self.cost.decode, self.decode_samples, DECODE_TERMS, nonnegative=True)
        if new is not None:
            model, info = new
            self.cost = dataclasses.replace(self.cost, decode=model,
                                            meta={**self.cost.meta, "decode_refit": info})
            self.decode_refits += 1
            log.info("cost_model_refit", part="decode", **info)

    # ------------------------------------------------------------------ placement

    def _cost(self) -> CostModel:
        if self.cost is None:
            kvb = 0
            for v in self.nodes.values():
                m = v.info.get("model") or {}
                if m.get("block_bytes") and m.get("block_size"):
                    kvb = int(m["block_bytes"]) // int(m["block_size"])
                    break
            self.cost = load_cost_model(self.settings, kvb)
        return self.cost

    def _eligible(self, role: str, exclude: set[str], now: float) -> list[NodeView]:
        # A node is live while it reports. Right after a leader change nobody has reported to
        # this conductor yet: members (their leases are alive) count as live, with no load,
        # for one staleness period.
        warming = now - self._started_mono < self.stale_s
        return [v for v in self.nodes.values()
                if v.role == role and not v.draining and v.node_id not in exclude
                and (now - v.reported_at < self.stale_s if v.reported_at else warming)]

    async def place(self, payload: Any) -> dict:
        """Handler of `conductor.place`.

        Payload: {"rid", "keys": [hex block keys], "prompt_tokens", "max_new_tokens",
        "exclude": [node ids to avoid], "decode_only": bool}.
        Returns {"ok": true, "prefill": {node, control, api}, "decode": {...}, "fetch":
        {"source", "control", "keys": [hex]} | null, "prefix_tokens", "predicted_ttft_s",
        "predicted_tbt_s"} or {"ok": false, "reason", "retry_after_s", "predicted_ttft_s",
        "predicted_tbt_s"}.
        Raises: ValueError on a malformed payload.
        """
        if not isinstance(payload, dict):
            raise ValueError("place needs an object payload")
        keys = _hexkeys(payload.get("keys", []))
        n = int(payload.get("prompt_tokens", 0))
        max_new = int(payload.get("max_new_tokens", 0))
        rid = str(payload.get("rid", ""))
        exclude = set(payload.get("exclude") or ())
        decode_only = bool(payload.get("decode_only", False))
        now = time.monotonic()
        cost = self._cost()
        cs = self.settings.conductor
        pre = self._eligible("prefill", exclude, now)
        dec = self._eligible("decode", exclude, now)
        retry = cs.min_retry_after_s
        if (not pre and not decode_only) or not dec:
            reason = "no_decode_node" if pre or decode_only else "no_prefill_node"
            return self._reject(Rejection(reason, retry))
        bs = self._block_size(pre[0] if pre else dec[0])
        cfg = PolicyConfig(policy=cs.policy, block_size=bs,
                           cache_balance_threshold=cs.cache_balance_threshold,
                           ttft_slo_s=math.inf if decode_only else cs.ttft_slo_s,
                           tbt_slo_s=cs.tbt_slo_s, min_retry_after_s=retry)
        if decode_only:
            # The prefill already ran: only the decode side is chosen (the prefill side is a
            # placeholder with no queue, fully cached).
            snap_pre = (["-"], [0.0], [len(keys)])
        else:
            queue = [self._queue_s(v, cost) for v in pre]
            snap_pre = ([v.node_id for v in pre], queue,
                        self.index.match(keys, [v.node_id for v in pre]))
        dbatch, dctx, dfree = [], [], []
        for v in dec:
            infl = sum(t for t, _ in v.inflight_decode.values())
            dbatch.append(v.decode_batch + len(v.inflight_decode))
            dctx.append(v.decode_context_tokens + infl)
            free = v.free_kv_tokens if v.reported_at else \
                int((v.info.get("model") or {}).get("kv_capacity_tokens", 0))   # not reported yet
            dfree.append(free - infl)
        holders = [] if decode_only else [v.node_id for v in self._eligible("cache", set(), now)
                                          if v.control]
        snap = Snapshot(*snap_pre, decode_nodes=[v.node_id for v in dec], decode_batch=dbatch,
                        decode_context_tokens=dctx, decode_free_kv_tokens=dfree,
                        holder_nodes=holders, holder_prefix_blocks=self.index.match(keys, holders))
        result = place(PlacementRequest(keys, n, max_new), snap, cost, cfg, self.rng)
        if isinstance(result, Rejection):
            return self._reject(result)
        if not decode_only and keys:
            self._note_request(keys, now)
        return self._accept(rid, result, n, max_new, decode_only, now)

    # ------------------------------------------------------------------ hot-block replication

    def _note_request(self, keys: list[bytes], now: float) -> None:
        """Counts the requests for each block key; the longest prefix of keys requested
        conductor.hot_block_hits times and held by fewer than hot_block_replicas nodes
        is copied onto a cache node."""
        cs = self.settings.conductor
        if cs.hot_block_hits <= 0:
            return
        for k in keys:
            self.hits[k] = self.hits.get(k, 0) + 1
            self.hits.move_to_end(k)
        # leading keys are requested at least as often as later ones (a prefix)
        hot = 0
        while hot < len(keys) and self.hits[keys[hot]] >= cs.hot_block_hits:
            hot += 1
        while len(self.hits) > HITS_MAX:
            self.hits.popitem(last=False)
        keys = keys[:min(hot, self.index.longest(keys[:hot]))]   # hot and held somewhere
        if not keys:
            return
        last = keys[-1]
        started = self._replicating.get(last)
        if started is not None and now - started < REPLICATE_COOLDOWN_S:
            return                  # being copied, or copied and not yet in the index
        if self.index.replicas(last) >= cs.hot_block_replicas:
            return
        holders = self.index.holders(last)
        full = [h for h, m in zip(holders, self.index.match(keys, holders)) if m == len(keys)]
        sources = [self.nodes[h] for h in full if h in self.nodes and self.nodes[h].control]
        targets = [v for v in self._eligible("cache", set(), now)
                   if v.control and v.info.get("store") and v.node_id not in full]
        if not sources or not targets:
            return
        have = self.index.match(keys, [v.node_id for v in targets])
        j = have.index(max(have))             # the cache node missing the fewest blocks
        # a cache node as the source spares the prefill nodes' compute
        src = next((v for v in sources if v.role == "cache"), sources[0])
        self._replicating[last] = math.inf          # in flight
        if len(self._replicating) > 1000:
            self._replicating = {k: t for k, t in self._replicating.items()
                                 if now - t < REPLICATE_COOLDOWN_S}
        self.replicated["started"] += 1
        t = asyncio.get_running_loop().create_task(
            self._replicate(src, targets[j], keys[have[j]:], last))
        self._replications.add(t)
        t.add_done_callback(self._replications.discard)

    async def _replicate(self, src: NodeView, dst: NodeView, keys: list[bytes],
                         last: bytes) -> None:
        """dst's store fetches `keys` from src's (store.fetch); the index learns the new
        replicas from dst's store events in its next report."""
        timeout = self.settings.cluster.rpc_timeout_s + self.settings.transfer.request_timeout_s
        try:
            r = await self.client.call(dst.control, "store.fetch",
                                       {"source": src.control, "keys": [k.hex() for k in keys]},
                                       timeout_s=timeout)
            ok = sum(1 for x in r["results"] if x.get("status") == "stored")
            self.replicated["blocks"] += ok
            log.info("hot_blocks_replicated", source=src.node_id, target=dst.node_id,
                     blocks=len(keys), stored=ok)
        except Exception as e:  # noqa: BLE001 - a replica is an optimisation; log and go on
            self.replicated["failed"] += 1
            log.warning("hot_blocks_replication_failed", source=src.node_id,
                        target=dst.node_id, error=str(e))
        finally:
            self._replicating[last] = time.monotonic()   # the cooldown runs from here

    def _block_size(self, v: NodeView) -> int:
        m = v.info.get("model") or {}
        return int(m.get("block_size") or self.settings.engine.block_size)

    def _queue_s(self, v: NodeView, cost: CostModel) -> float:
        work = list(v.prefill_pending.values())
        work += [(a, b) for rid, (a, b, _) in v.inflight_prefill.items()
                 if rid not in v.prefill_pending]
        return sum(cost.prefill_s(a, b) for a, b in work)

    def _reject(self, r: Rejection) -> dict:
        self.rejected[r.reason] = self.rejected.get(r.reason, 0) + 1
        log.info("placement_rejected", reason=r.reason, retry_after_s=r.retry_after_s,
                 predicted_ttft_s=r.predicted_ttft_s, predicted_tbt_s=r.predicted_tbt_s)
        return {"ok": False, "reason": r.reason, "retry_after_s": r.retry_after_s,
                "predicted_ttft_s": None if math.isnan(r.predicted_ttft_s) else r.predicted_ttft_s,
                "predicted_tbt_s": None if math.isnan(r.predicted_tbt_s) else r.predicted_tbt_s}

    def _accept(self, rid: str, p: Placement, n: int, max_new: int, decode_only: bool,
                now: float) -> dict:
        dv = self.nodes[p.decode]
        pv = self.nodes.get(p.prefill) or NodeView("-")
        if not decode_only:
            pv.inflight_prefill[rid] = (n - p.prefix_tokens, p.prefix_tokens, now)
            pv.placed += 1
            self._predicted[rid] = (p.predicted_ttft_s, now)
            if len(self._predicted) > 10_000:          # placements that never reported back
                for old in [r for r, (_, t) in self._predicted.items() if now - t > 600]:
                    del self._predicted[old]
        dv.inflight_decode[rid] = (n + max_new, now)
        dv.placed += 1
        self.placed += 1
        fetch = None
        if p.fetch is not None and not decode_only:
            src = self.nodes.get(p.fetch.source)
            if src is not None and src.control:
                fetch = {"source": src.node_id, "control": src.control,
                         "keys": [k.hex() for k in p.fetch.keys]}
        return {"ok": True,
                "prefill": {"node": pv.node_id, "control": pv.control, "api": pv.api},
                "decode": {"node": dv.node_id, "control": dv.control, "api": dv.api},
                "fetch": fetch, "prefix_tokens": p.prefix_tokens,
                "local_prefix_tokens": min(p.local_prefix_blocks * self._block_size(pv), n),
                "predicted_ttft_s": p.predicted_ttft_s, "predicted_tbt_s": p.predicted_tbt_s}

    # ------------------------------------------------------------------ inspection

    def status(self) -> dict:
        """What `mooncake ctl` shows of the conductor: nodes' load, index size, cost model
        and its TTFT prediction error (signed relative error: > 0 over-predicts)."""
        now = time.monotonic()
        cost = self.cost
        errs, derrs = list(self.errors), list(self.decode_errors)
        nodes = {}
        for nid, v in sorted(self.nodes.items()):
            nodes[nid] = {
                "role": v.role, "draining": v.draining,
                "report_age_s": round(now - v.reported_at, 3) if v.reported_at else None,
                "prefill_pending": len(v.prefill_pending), "inflight": len(v.inflight_prefill)
                + len(v.inflight_decode),
                "queue_s": round(self._queue_s(v, cost), 4) if cost is not None else None,
                "decode_batch": v.decode_batch, "decode_context_tokens": v.decode_context_tokens,
                "free_kv_tokens": v.free_kv_tokens, "indexed_blocks": self.index.blocks_on(nid),
                "store_seq": v.store_seq, "placed": v.placed}
        return {
            "leader": self.node_id, "since": self.started_at, "placed": self.placed,
            "rejected": dict(self.rejected), "indexed_keys": len(self.index), "nodes": nodes,
            "policy": self.settings.conductor.policy,
            "slo": {"ttft_s": self.settings.conductor.ttft_slo_s,
                    "tbt_s": self.settings.conductor.tbt_slo_s},
            "cost_model": None if cost is None else {
                "name": cost.name, "source": cost.meta.get("source", ""), "refits": self.refits,
                "decode_refits": self.decode_refits, "meta": cost.meta},
            "replication": {**self.replicated, "in_flight": len(self._replications),
                            "hot_block_hits": self.settings.conductor.hot_block_hits,
                            "target_replicas": self.settings.conductor.hot_block_replicas},
            "ttft_prediction": _error_summary(errs),
            "decode_step_prediction": _error_summary(derrs),
        }


def _error_summary(errs: list[float]) -> dict:
    """Signed relative prediction errors -> {"samples", "median_rel_error",
    "median_abs_rel_error"} (> 0 over-predicts)."""
    return {"samples": len(errs),
            "median_rel_error": statistics.median(errs) if errs else None,
            "median_abs_rel_error": statistics.median(abs(e) for e in errs) if errs else None}


__all__ = ["ConductorService", "NodeView", "NotLeader", "cost_model_path", "default_cost_model",
           "load_cost_model", "state_dir"]
