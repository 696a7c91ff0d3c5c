"""The prefill side of a node: `node.prefill`, the staged KV, the layer-wise push and
prefix fetches (Mooncake paper, section 3 and 4.2; architecture.md step 3).

Per request (a `PrefillRequest`): copy the prefix blocks the conductor planned from
their holder into this node's store (a failure only means recomputing); when its turn
to compute comes, ask the decode node to admit it (`admit_at`: `node.kv_reserve` with
the prompt's tokens, and the receive buffer in the same call when pushing), so that
the decode node's refusal (DecodeRefused, 429) comes before any compute; prefill
with max_tokens=1 while the engine stages every block's KV layer by layer
(`LayerwiseKV`; the partial last block included) and, with a decode node to push
to, WRITE each layer into the receive buffer it reserved there as soon as the
layer is computed (kv_push.py). The stage stays registered as transfer-engine
segment "<node>/stage/<rid>" for a decode node's READ until `node.release` or
cluster.stage_ttl_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from mooncaked import failpoints
from mooncaked.conductor.cost_store import load_cost_model
from mooncaked.log import get_logger

from mooncaked.wire.errors import ClusterError, DecodeRefused, RpcError
from .kv_push import KVPusher
from mooncaked.wire.messages import (FetchPlan, KVHandle, KVReservation, KVReserved, OutputDelta,
                                     PrefillDone, PrefillReply, PrefillRequest, Release)
from .node_state import NodeDraining, release_on
from .role import Handler, NodeContext, RoleStatus
from .prefill_queue import (
                            PrefillQueue,
                            resolve_aging,
                            resolve_bound_rule,
                            resolve_fcfs_slack,
                            resolve_fcfs_slack_ratio,
                            resolve_order,
                            )

log = get_logger(__name__)


@dataclass
class PrefillLoad:
    """A request on this prefill node: tokens to compute and already cached, and whether
    it has run alone so far (only solo prefills are refit samples)."""

    new: int
    cached: int
    alone: bool


@dataclass
class StagedKV:
    """A request's staged KV, registered as transfer segment `segment` until `timer` fires."""

    segment: str
    blocks: Any                       # torch.Tensor, layer-major
    timer: asyncio.TimerHandle


class PrefillWorker:
    """Runs `node.prefill` on a prefill node (see the module doc).

    Args:
        ctx: the node's NodeContext (role.py): engine (the AsyncLLM), transfer engine,
            store_node (fetch target, or None), clients, counters and activity.
    Implements role.RoleWorker (side "prefill").
    """

    side = "prefill"

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        self.node_id, self.control_addr, self.settings = ctx.node_id, ctx.control_addr, ctx.settings
        self.engine, self.transfer, self.client = ctx.engine, ctx.transfer, ctx.client
        self.counters, self.activity = ctx.kv_transfer, ctx.activity
        self.requests: dict[str, PrefillLoad] = {}
        self.waiting: set[str] = set()     # rids not computing yet: fetching or in the queue
        self.stages: dict[str, StagedKV] = {}
        cs = ctx.settings.conductor    # the run order of waiting prefills (cluster/prefill_queue.py)
        self.queue = PrefillQueue(resolve_order(cs.policy, cs.prefill_order),
                                  resolve_aging(cs.policy, cs.prefill_aging_s),
                                  resolve_fcfs_slack(cs.policy, cs.prefill_fcfs_slack_s),
                                  fcfs_slack_ratio=resolve_fcfs_slack_ratio(
                                      cs.policy, cs.prefill_fcfs_slack_ratio),
                                  bound_rule=resolve_bound_rule(cs.policy, cs.prefill_bound_rule))
        self._cost = None

    def pending(self) -> dict[str, tuple[int, int]]:
        """rid -> (new, cached) tokens of every prefill on this node (for the report)."""
        return {rid: (r.new, r.cached) for rid, r in self.requests.items()}

    def handlers(self) -> dict[str, Handler]:
        """node.prefill (`handle`)."""
        return {"node.prefill": self.handle}

    def stalled(self) -> str | None:
        """None: a prefill node takes requests while it runs (its queue orders them)."""
        return None

    def info(self) -> dict | None:
        """None: no role entry in the member record."""
        return None

    def status(self) -> RoleStatus:
        """The KV segments staged for decode nodes to READ."""
        return RoleStatus(staged=len(self.stages))

    def release_held(self, msg: Release) -> bool:
        """`node.release`: withdraws msg.rid's staged KV (`release_stage`)."""
        return self.release_stage(msg.rid)

    def queued(self) -> tuple[str, ...]:
        """Ids of the prefills on this node that wait for their turn (fetching their prefix
        or held back by the spf queue), for the report: the conductor predicts a new
        request's wait under the node's run order from them (`load.queued_work`)."""
        return tuple(sorted(self.waiting))

    async def handle(self, payload: Any) -> dict:
        """`node.prefill`: PrefillRequest -> PrefillReply (see the module doc). With
        `kv.pushed` the decode node holds all of the KV; otherwise it READs the stage.
        Raises: NodeDraining; MessageError (400) for a malformed body; InvalidRequest (bad
        prompt or params); DecodeRefused (429) when the decode node does not admit the
        request (nothing computed); RuntimeError when the engine fails.
        """
        req = PrefillRequest.from_json(payload)
        if self.ctx.draining():
            raise NodeDraining(f"{self.node_id} is draining")
        rid, prompt = req.rid, list(req.prompt)
        params = dataclasses.replace(req.params, max_tokens=1)
        for other in self.requests.values():
            other.alone = False                  # nobody ran alone while this one ran
        self.requests[rid] = PrefillLoad(len(prompt) - req.prefix_tokens, req.prefix_tokens,
                                         not self.requests)
        self.activity.arrived.append(rid)
        t0 = time.monotonic()
        kv_stream = pusher = None
        handed_over = held = replied = False
        asked: str | None = None    # the decode node asked to admit rid or to reserve its buffer
        self.waiting.add(rid)
        try:
            await failpoints.ahit("node.prefill")
            if req.fetch is not None and self.ctx.store_node is not None:
                await self._fetch(req.fetch)
            held = await self.queue.acquire(self._predict(len(prompt) - req.prefix_tokens,
                                                          req.prefix_tokens))
            self.waiting.discard(rid)
            if req.stage and 0 < len(prompt) < self.engine.max_model_len:
                kv_stream = self.engine.layerwise_kv(len(prompt))
            pushing = kv_stream is not None and req.push_to is not None
            reserved: Any = None
            if req.admit_at is not None or pushing:
                # the decode node admits (or refuses) the request before it computes here.
                # From the ask on it may hold an admission and a buffer for rid, even when
                # this handler is cancelled before the answer arrives (the client left)
                asked = req.push_to if pushing else req.admit_at
                try:
                    reserved = await self._reserve(rid, len(prompt),
                                                   kv_stream if pushing else None, asked,
                                                   req.ttl_s, req.admit_at is not None)
                except DecodeRefused:
                    asked = None                 # refused: it holds nothing for rid
                    raise
            if pushing:
                pusher = self._pusher(kv_stream, reserved)
                kv_stream.on_layer = pusher.on_layer
                pusher.start()
            final = None
            gen = self.engine.generate(prompt, params, rid, cache_salt=req.cache_salt,
                                       kv_stream=kv_stream)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.error:
                        raise RuntimeError(f"engine error: {out.error}")
                    final = out
            compute_end = time.monotonic()
            if held:
                held = False
                self.queue.release()
            seconds = compute_end - t0
            kv = None
            if kv_stream is not None and final.finish_reason == "length":
                push = await pusher.finish(compute_end) if pusher is not None else None
                handed_over = bool(push is not None and push.ok)
                kv = self._stage(rid, kv_stream, handed_over,
                                 push.as_dict() if push is not None else None)
                self.counters.count_push(push)
                if push is not None:
                    log.debug("kv_pushed", request_id=rid, compute_s=round(seconds, 4),
                              **push.as_dict())
            self.activity.done.append(PrefillDone(rid, seconds, len(prompt) - final.num_cached_tokens,
                                                  final.num_cached_tokens,
                                                  self.requests[rid].alone))
            reply = PrefillReply(OutputDelta.of(final), kv, seconds).to_json()
            replied = True
            return reply
        finally:
            if held:
                self.queue.release()
            self.waiting.discard(rid)
            self.requests.pop(rid, None)
            # what the decode node holds for rid goes, unless it takes it over: a request
            # that fails or is cancelled after the ask (its admission, its buffer), or a
            # push that was not handed over (the decode node READs the stage instead)
            unused_buffer = pusher is not None and pusher.attempted and not handed_over
            try:
                if pusher is not None:
                    await pusher.aclose()
            finally:
                if asked is not None and (unused_buffer or not replied):
                    self.ctx.spawn(release_on(self.client, asked,
                                              Release(rid, self.control_addr)))

    def _predict(self, new: int, cached: int) -> float:
        """Predicted prefill seconds, the spf queue's key: the cost model the conductor
        places with (the profiled file, else the default), loaded on first use."""
        if self.queue.order == "fcfs":
            return 0.0
        if self._cost is None:
            g = self.engine.kv_geometry()
            self._cost = load_cost_model(self.settings, g.block_bytes // max(1, g.block_size))
        return self._cost.prefill_s(new, cached)

    async def _reserve(self, rid: str, tokens: int, kv_stream: Any, decode_control: str,
                       ttl_s: float, admit: bool) -> dict | Exception:
        """`node.kv_reserve` on the decode node before the prefill computes: its admission
        of the request (with `admit`: `tokens` prompt tokens) and, with a kv_stream, the
        receive buffer for the push. Returns {"descriptor": ...} ({} without a buffer), or
        the exception that kept the push from a buffer (the decode node then READs, and
        checks the request when it arrives).
        Raises: DecodeRefused when the decode node refuses the request."""
        shape, dtype = ((), "") if kv_stream is None else (
            tuple(kv_stream.shape), str(kv_stream.dtype).removeprefix("torch."))
        ask = KVReservation(rid, self.control_addr, shape, dtype, ttl_s, tokens if admit else 0)
        try:
            r = await self.client.call(decode_control, "node.kv_reserve", ask.to_json())
            await failpoints.ahit("prefill.kv_reserved")   # tests: cancel before the answer
            return {"descriptor": KVReserved.from_json(r).descriptor}
        except RpcError as e:
            if e.remote_type == "DecodeRefused":
                raise DecodeRefused(e.remote_message, e.remote_detail or {}) from e
            return e
        except (ClusterError, ValueError) as e:    # ValueError: a malformed KVReserved
            return e

    def _pusher(self, kv_stream: Any, reserved: dict | Exception) -> KVPusher:
        """A KVPusher onto the receive buffer `_reserve` got (an exception: no push, the
        decode node READs)."""

        async def reserve() -> dict:
            if isinstance(reserved, Exception):
                raise reserved
            return reserved

        pusher = KVPusher(self.transfer, kv_stream, reserve,
                          self.settings.cluster.rpc_timeout_s
                          + self.settings.transfer.request_timeout_s)
        pusher.attempted = not isinstance(reserved, Exception)   # a buffer to release if unused
        return pusher

    async def _fetch(self, fetch: FetchPlan) -> None:
        """Replicates prefix blocks from their holder into this node's store (section 4.2);
        the engine then loads them from the store. A failure only means recomputing."""
        if not fetch.keys or fetch.control == self.control_addr:
            return
        t0 = time.monotonic()
        c = self.counters
        c.fetches += 1
        try:
            results = await asyncio.wait_for(
                self.ctx.store_node.fetch(fetch.control, fetch.keys),
                self.settings.cluster.rpc_timeout_s + self.settings.transfer.request_timeout_s)
            ok = sum(r.ok for r in results)
            log.info("prefix_fetched", source=fetch.source, blocks=len(fetch.keys), ok=ok,
                     seconds=round(time.monotonic() - t0, 4))
            c.fetched_blocks += ok
            c.fetch_failed += ok < len(fetch.keys)
        except (ClusterError, TimeoutError, OSError, ValueError) as e:
            log.warning("prefix_fetch_failed", source=fetch.source, error=str(e))
            c.fetch_failed += 1

    def _stage(self, rid: str, kv_stream: Any, pushed: bool, push: dict | None) -> KVHandle:
        """Registers the staged KV (layer-major) as segment "<node>/stage/<rid>" for a
        decode node's READ; freed by node.release or after cluster.stage_ttl_s."""
        blocks = kv_stream.stage
        name = f"{self.node_id}/stage/{rid}"
        desc = self.transfer.register_segment(name, blocks, "cpu:0")
        timer = asyncio.get_running_loop().call_later(self.settings.cluster.stage_ttl_s,
                                                      self.release_stage, rid)
        self.stages[rid] = StagedKV(name, blocks, timer)
        return KVHandle(desc, tuple(blocks.shape), str(blocks.dtype).removeprefix("torch."),
                        kv_stream.num_tokens, pushed, push)

    def release_stage(self, rid: str) -> bool:
        """Withdraws rid's stage segment; False when there was none."""
        st = self.stages.pop(rid, None)
        if st is None:
            return False
        st.timer.cancel()
        with contextlib.suppress(Exception):
            self.transfer.unregister_segment(st.segment)
        return True

    def close(self) -> None:
        """Withdraws every stage (at shutdown)."""
        for rid in list(self.stages):
            self.release_stage(rid)


__all__ = ["PrefillLoad", "PrefillWorker", "StagedKV"]
