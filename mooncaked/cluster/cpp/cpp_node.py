"""A prefill node that is one stage of a chunked-pipeline-parallel (CPP) group (Mooncake
section 3.3): the cluster side of `pipeline_stage.StageServer`.

A prefill node with `cpp.group` set loads only its layers (`StageEngine`, layers from
`split_layers(num_layers, cpp.stages, cpp.layer_weights)`; no full engine), runs its own KV
store of its layer slices (`attach_store`: blocks of the stage's page size, lent to the
pool like every node's store) and registers like any node, its record carrying `cpp` =
{group, stage, stages, layers, num_layers, block_bytes (a full block's), chunk_tokens,
hidden_bytes_per_token, weight_bytes}. The conductor sees a group once
every stage has joined (conductor/cpp_place.py) and places a request on the group by
naming stage 0 as the prefill node; the API node then calls `node.prefill` on stage 0
as on any prefill node. The StageServer's `cpp.*` handlers sit on the node's own control
server (cluster token), its hidden-state segment on the node's transfer engine, and each
stage finds the next one in the membership (group, stage + 1).

`node.prefill` on stage 0 (`CppStageWorker.handle`):
1. when the request's turn comes (a receive slot on every stage), reserves a receive
   buffer on the decode node (`node.kv_reserve`, the whole model's layer-major shape
   [num_layers, blocks, 2, block_size, kv_heads, head_dim]), owned by stage 0, and in the
   same call asks the decode node to admit the request (its TBT check, as a single prefill
   node asks it: a refusal is the API's 429 before any stage computed, and the decode
   node does not check the request again when it arrives); the buffer's descriptor
   travels down the chain as `kv_target`;
2. runs the prompt through the pipeline in `cpp.chunk_tokens` chunks; each stage WRITEs its
   own layers' KV of each chunk's blocks (one byte run per layer of that buffer) as soon as
   it computed the chunk, overlapped with its next chunk, so the one receive buffer takes
   layer ranges from every stage and the last stage's push adds little to TTFT;
3. answers `PrefillReply` with the first token (the last stage samples it with the
   request's SamplingParams) and `KVHandle.pushed` = True: the decode node admits from the
   buffer as from a single prefill node's push.

Faults: a stage that dies mid-request ends the request on stage 0 with `StageFailure`
(the hop named); stage 0 releases its part and the decode node's receive buffer at once,
and the other stages release theirs when their `cpp.hold` connection drops
(pipeline_stage.py). The API node re-places a request whose group failed (excluding the
group) on a single prefill node when one exists, else answers 503 naming the failure.
Stages after 0 refuse `node.prefill` (the conductor never names them).

Prefix reuse: each stage keeps its layers of a finished request's full blocks in its pages
under their block keys (StageEngine.match / release, LRU when pages run out) and puts
their slices into its store (store.keys.slice_key). Stage 0 sends the prompt's keys and
the placement's fetch source ({control, blocks}: a node whose store holds the full
blocks, the conductor's choice, conductor/cpp_place.group_prefix) down the chain with the
reservations; each stage matches its pages, then continues from its store's slices, then
READs only its layers' byte range of the source's full blocks (cluster/cpp/stage_prefix.py).
The least prefix of any stage is the request's cached prefix (every stage recomputes
from there), and the reply's num_cached_tokens says how much was reused.

Structured output: the last stage masks the first token's logits with the request's
grammar (a GrammarBackend over the node's tokenizer, as the engine's), and the decode node
replays that token in its own matcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from mooncaked.conductor.cpp_place import stage_info
from mooncaked.log import get_logger
from mooncaked.utils import cdiv

from mooncaked.wire.errors import DecodeRefused, RpcError
from mooncaked.wire.messages import (CppPrefill, KVHandle, KVReservation, KVReserved,
                                     OutputDelta, PrefillDone, PrefillReply, PrefillRequest,
                                     Release, logprob_from_json, params_to_json)
from mooncaked.cluster.node_state import NodeDraining, ReceiveBuffersFull, release_on
from .pipeline_stage import StageFailure, StageServer
from mooncaked.cluster.prefill_worker import PrefillLoad
from mooncaked.engine.stage import StageEngine, model_num_layers, split_layers
from mooncaked.model.weights import resolve_model_path
from mooncaked.engine.structured import GrammarBackend
from .stage_prefix import StagePrefix
from mooncaked.cluster.role import Handler, NodeContext, RoleStatus
from mooncaked.engine.detokenizer import IncrementalDetokenizer
from mooncaked.engine.stop import finish_reason
from mooncaked.engine.types import InvalidRequest

log = get_logger(__name__)

RECEIVE_SLOTS = 4   # requests in flight through one stage at once (hidden-state receive slots)


class CppStageWorker:
    """The prefill side of a stage node (see the module doc); stands where PrefillWorker
    stands on a plain prefill node (node.prefill, node.release, reports, status).

    Args:
        ctx: the node's NodeContext (cluster/role.py): settings, control server, transfer
            engine, clients, members, tokenizer and block keys (no engine: the stage loads
            its own layers in `start`).
    Implements role.RoleWorker (side "prefill").
    Use: `await start()` after the node's transfer engine started and before it
    registers (`info()` goes into the member record); `close()` at the end.
    Raises (start): ModelLoadError for a bad model; ValueError for a split that does not fit.
    """

    side = "prefill"

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        self.settings = ctx.settings
        self.cpp = ctx.settings.cpp
        self.requests: dict[str, PrefillLoad] = {}
        # stage 0 lets at most RECEIVE_SLOTS requests into the pipeline (every stage has
        # that many receive slots); the others wait here, reported as waiting
        self._admit = asyncio.Semaphore(RECEIVE_SLOTS)
        self._waiting: set[str] = set()
        self.stages: dict[str, Any] = {}        # no staged KV segments: the push is the path
        self.engine: Any = None                 # StageEngine
        self.server: StageServer | None = None
        self.prefix: Any = None                 # StagePrefix, once the node's store is attached

    async def start(self) -> None:
        """Loads this stage's layers (in a thread: seconds) and starts its StageServer."""

        s, cpp = self.settings, self.cpp
        path = resolve_model_path(s.model.path)
        layers = split_layers(model_num_layers(path), cpp.stages, cpp.layer_weights or None)[cpp.stage]
        threads = s.model.num_threads or 1
        self.engine = await asyncio.to_thread(
            StageEngine, path, layers, dtype=s.model.dtype, kv_cache_bytes=s.engine.kv_cache_bytes,
            block_size=s.engine.block_size, max_positions=cpp.max_tokens, num_threads=threads,
            device=s.model.device)
        n = self.ctx
        grammars = None
        if self.engine.is_last:
            tok = n.tokenizer
            grammars = GrammarBackend(tok.hf, self.engine.cfg.vocab_size, sorted(tok.eos_token_ids))
        self.server = StageServer(self.engine, n.node_id, None, max_tokens=cpp.max_tokens,
                                  slots=RECEIVE_SLOTS, idle_timeout_s=cpp.idle_timeout_s,
                                  rpc_timeout_s=s.cluster.rpc_timeout_s, transfer=n.transfer,
                                  control=n.control, client=n.data_client,
                                  next_resolver=self.next_stage, grammars=grammars)
        await self.server.start()
        log.info("cpp_stage_joined", node=n.node_id, group=cpp.group, stage=cpp.stage,
                 stages=cpp.stages, layers=f"{layers.start}:{layers.stop}",
                 weight_bytes=self.engine.weight_bytes)

    def attach_store(self, store_node: Any) -> None:
        """Gives the stage the node's StoreNode (a BlockStore of `engine.block_bytes`
        blocks: the stage's layer slices): its prefix continues from the store and from
        fetch sources, and finished slices go into it (cluster/cpp/stage_prefix.py)."""

        self.prefix = StagePrefix(self.engine, self.engine.cfg.num_layers, store_node)
        self.server.prefix = self.prefix

    def info(self) -> dict:
        """The member record's `cpp` entry."""
        e, cpp = self.engine, self.cpp
        return {"group": cpp.group, "stage": cpp.stage, "stages": cpp.stages,
                "layers": [e.layers.start, e.layers.stop], "num_layers": e.cfg.num_layers,
                "block_bytes": e.block_bytes * e.cfg.num_layers // len(e.layers),
                "chunk_tokens": cpp.chunk_tokens, "max_tokens": cpp.max_tokens,
                "hidden_bytes_per_token": e.hidden_size * e.dtype.itemsize,
                "weight_bytes": e.weight_bytes}

    def next_stage(self) -> str | None:
        """Control address of the next stage of this group, as the membership has it."""
        for m in self.ctx.members().values():
            c = stage_info(m.info)
            if c and c["group"] == self.cpp.group and c["stage"] == self.cpp.stage + 1:
                return m.info.get("control") or None
        return None

    def pending(self) -> dict[str, tuple[int, int]]:
        """rid -> (new, cached) tokens of the requests this group runs (stage 0 only)."""
        return {rid: (r.new, r.cached) for rid, r in self.requests.items()}

    def queued(self) -> tuple[str, ...]:
        """Prefills held back waiting for their turn (NodeReport.waiting): those waiting
        on stage 0 for one of the pipeline's RECEIVE_SLOTS."""
        return tuple(sorted(self._waiting))

    def stalled(self) -> str | None:
        """Why this stage cannot take a request now (StageServer.stalled), or None; the
        node reports it (NodeReport.stalled) and the conductor places no request on its
        group meanwhile."""
        return self.server.stalled()

    def handlers(self) -> dict[str, Handler]:
        """node.prefill (`handle`; its StageServer adds the cpp.* methods itself)."""
        return {"node.prefill": self.handle}

    def status(self) -> RoleStatus:
        """This stage's part of node.status: its `cpp` entry (`stage_status`)."""
        return RoleStatus(cpp=self.stage_status())

    def stage_status(self) -> dict:
        """This stage's layers, weights, pages and the requests it holds (node.status)."""
        e, srv = self.engine, self.server
        return {**self.info(), "requests": sorted(srv.reqs), "stage_pages": sorted(e.seqs),
                "free_blocks": e.num_free_blocks(), "free_slots": len(srv.free_slots),
                "next": srv.next_addr, "stalled": self.stalled(),
                "prefix": self.prefix.status() if self.prefix is not None else None}

    async def handle(self, payload: Any) -> dict:
        """`node.prefill` on stage 0: PrefillRequest -> PrefillReply through the pipeline.

        Raises: NodeDraining; MessageError for a malformed body; ValueError for an empty
        prompt or one over cpp.max_tokens; InvalidRequest (400) when it asks for prompt
        logprobs; StageFailure on a stage other than 0, when a
        stage fails or dies, or the decode node gives no receive buffer (the API node
        re-places it); ReceiveBuffersFull when the decode node's receive buffers are full
        (load: the API node answers 429 naming them); DecodeRefused (429) when the decode
        node's TBT check refuses the request (before any stage computed).
        """
        req = PrefillRequest.from_json(payload)
        ctx, e = self.ctx, self.engine
        if ctx.draining():
            raise NodeDraining(f"{ctx.node_id} is draining")
        if not e.is_first:     # StageFailure: the API node places the request again elsewhere
            raise StageFailure(f"{ctx.node_id} is stage {self.cpp.stage} of group "
                               f"{self.cpp.group}: requests enter at stage 0")
        rid, prompt = req.rid, list(req.prompt)
        if not prompt:
            raise ValueError("empty prompt")
        if req.params.prompt_logprobs is not None:   # the last stage samples one row only
            raise InvalidRequest("prompt logprobs (echo with logprobs, prompt_logprobs) are not "
                                 "supported on a CPP group", "prompt_logprobs")
        self.requests[rid] = PrefillLoad(len(prompt), 0, False)
        ctx.activity.arrived.append(rid)
        t0 = time.monotonic()
        self._waiting.add(rid)
        try:
            async with self._admit:      # a receive slot on every stage (FIFO among waiters)
                self._waiting.discard(rid)
                return await self._run(req, rid, prompt, t0)
        finally:
            self._waiting.discard(rid)
            self.requests.pop(rid, None)

    async def _run(self, req: PrefillRequest, rid: str, prompt: list[int], t0: float) -> dict:
        """`handle` once the request holds a place in the pipeline."""
        ctx, e = self.ctx, self.engine
        reserved = False
        try:
            kv_target = kv = None
            if req.stage and req.push_to:
                # from the ask on the decode node may hold a buffer and an admission for
                # rid, even when this handler is cancelled before the answer (the client left)
                reserved = True
                try:
                    desc = await self._reserve(rid, len(prompt), req)
                except DecodeRefused:
                    reserved = False             # refused: it holds nothing for rid
                    raise
                except (ReceiveBuffersFull, StageFailure):
                    # the decode node admits before it looks for a buffer: withdraw that
                    # admission now, not at its TTL (it counts in the node's TBT check)
                    reserved = req.admit_at is not None
                    raise
                kv_target = {"descriptor": desc}
            p = req.params
            greedy = p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 \
                and not p.presence_penalty and not p.frequency_penalty and p.structured is None
            keys = self._keys(prompt, req)
            msg = CppPrefill(rid, tuple(prompt), self.cpp.chunk_tokens, False, kv_target,
                             None if greedy else {"params": params_to_json(p), "prompt": prompt},
                             tuple(keys), self._fetch(req, keys))
            try:
                r = await self.server.prefill(msg)
            except StageFailure as ex:
                raise StageFailure(f"CPP group {self.cpp.group} failed ({self._names(str(ex))}): "
                                   f"{ex}") from ex
            seconds = time.monotonic() - t0
            token, cached = int(r["token_id"]), int(r.get("cached_tokens", 0))
            last = r["stages"][-1]
            out = dataclasses.replace(
                self._first_output(token, last.get("logprob"), bool(last.get("grammar_done")),
                                   req),
                num_cached_tokens=cached)
            if not out.finished and kv_target is not None:
                g = self._geometry(len(prompt))
                kv = KVHandle(kv_target["descriptor"], tuple(g), str(e.dtype).removeprefix("torch."),
                              len(prompt), True,
                              {"bytes": sum(s["kv_pushed_bytes"] for s in r["stages"]),
                               "stages": r["stages"]})
                reserved = False          # the decode node takes it over
            elif not out.finished:
                # the API node wants KV it would READ: a group has no stage segment
                out = dataclasses.replace(out, finished=True, finish_reason="length")
            ctx.activity.done.append(PrefillDone(    # per-stage chunk times: the conductor's
                rid, seconds, len(prompt) - cached, cached, False,     # GroupLearner
                tuple(tuple(float(c) for c in st.get("chunks", ())) for st in r["stages"])))
            log.info("cpp_prefill_done", request_id=rid, group=self.cpp.group, tokens=len(prompt),
                     cached_tokens=cached, seconds=round(seconds, 4),
                     stage_compute_s=[s["compute_s"] for s in r["stages"]])
            return PrefillReply(out, kv, seconds).to_json()
        finally:
            if reserved:
                ctx.spawn(release_on(ctx.client, req.push_to, Release(rid, ctx.control_addr)))

    def _keys(self, prompt: list[int], req: PrefillRequest) -> list[bytes]:
        """The prompt's block keys as the cluster computes them (frontend.block_keys: model
        id, block size, KV dtype, cache_salt), for the stages' prefix caches; none when the
        model nodes' block size differs from this stage's (no reuse then)."""
        m = self.ctx.model_info()
        if not m or int(m.get("block_size", 0)) != self.engine.block_size:
            return []
        return self.ctx.block_keys(prompt, req.cache_salt)

    @staticmethod
    def _fetch(req: PrefillRequest, keys: list[bytes]) -> dict | None:
        """The placement's fetch source as the stages take it: {control, blocks}, the
        source's control address and the prefix (blocks of `keys`) it holds up to the
        plan's last key; None without a plan or when its keys are not the prompt's."""
        plan = req.fetch
        if plan is None or not plan.keys or not plan.control:
            return None
        try:
            upto = keys.index(plan.keys[-1]) + 1
        except ValueError:
            return None
        return {"control": plan.control, "blocks": upto}

    def _names(self, text: str) -> str:
        """The group's stages named in `text` (by control address) as node ids, e.g.
        "the hop to stage 1 g0s1", so an error names the node, not only its address."""
        out = []
        for nid, m in self.ctx.members().items():
            c = stage_info(m.info)
            if c and c["group"] == self.cpp.group and m.info.get("control") and \
                    m.info["control"] in text and nid != self.ctx.node_id:
                out.append(f"the hop to stage {c['stage']} {nid}")
        return ", ".join(out) or f"at stage {self.cpp.stage} {self.ctx.node_id} or after"

    def _geometry(self, num_tokens: int) -> list[int]:
        """Layer-major shape of a request's KV for the whole model."""
        e = self.engine
        return [e.cfg.num_layers, cdiv(num_tokens, e.block_size), 2, e.block_size,
                e.cfg.num_kv_heads, e.cfg.head_dim]

    async def _reserve(self, rid: str, num_tokens: int, req: PrefillRequest) -> dict:
        """A receive buffer on the decode node for every stage's layers (owner: stage 0),
        and with `req.admit_at` the decode node's admission of the request in the same call
        (its TBT check, before any stage computes, as a single prefill node asks it).
        Raises DecodeRefused (429) when the TBT check refuses; ReceiveBuffersFull when
        its receive buffers are full; StageFailure when it gives no buffer otherwise."""
        ctx = self.ctx
        admit = num_tokens if req.admit_at is not None else 0
        ask = KVReservation(rid, ctx.control_addr, tuple(self._geometry(num_tokens)),
                            str(self.engine.dtype).removeprefix("torch."), req.ttl_s, admit)
        try:
            r = await ctx.client.call(req.push_to, "node.kv_reserve", ask.to_json())
        except RpcError as ex:
            if ex.remote_type == DecodeRefused.__name__:          # refused: nothing computed
                raise DecodeRefused(ex.remote_message, ex.remote_detail or {}) from ex
            if ex.remote_type == ReceiveBuffersFull.__name__:     # load: say so, no re-place
                raise ReceiveBuffersFull(ex.remote_message) from ex
            raise StageFailure(f"group {self.cpp.group}: the decode node gave no receive buffer: "
                               f"{ex}") from ex
        except Exception as ex:  # noqa: BLE001 - unreachable: the request is re-placed
            raise StageFailure(f"group {self.cpp.group}: the decode node gave no receive buffer: "
                               f"{ex}") from ex
        return KVReserved.from_json(r).descriptor

    def _first_output(self, token: int, logprob: list | None, grammar_done: bool,
                      req: PrefillRequest) -> OutputDelta:
        """The first token as the engine would emit it: its text (held back while a
        character is incomplete, as the decode node's detokenizer does), and whether it
        ends the request by the engine's own check (engine/stop.py: end of sequence, a stop
        token or string, a complete structured-output constraint as the last stage saw
        it, or no decode stage to continue on)."""

        p, tok = req.params, self.ctx.tokenizer
        detok = IncrementalDetokenizer(tok, p.stop, p.include_stop_str_in_output)
        text = detok.add(token)
        reason, stop_reason = finish_reason(token, p, tok.eos_token_ids, detok.stopped,
                                            grammar_done, 1, p.max_tokens if req.stage else 1)
        finished = reason is not None
        lps = None if logprob is None else (logprob_from_json(logprob, "stages[-1].logprob"),)
        return OutputDelta((token,), text, lps, finished, reason, stop_reason, 1, 0, None,
                           time.time())

    def release_held(self, msg: Release) -> bool:
        """`node.release`: frees msg.rid on this stage (`release_stage`)."""
        return self.release_stage(msg.rid)

    def release_stage(self, rid: str) -> bool:
        """`node.release`: frees rid on this stage if it still holds it."""
        if self.server is None or rid not in self.server.reqs:
            return False
        return self.server.release(rid, "asked")

    def close(self) -> None:
        """Stops the stage (at shutdown): its requests are released."""
        if self.server is not None:
            self.server.close()


__all__ = ["CppStageWorker", "RECEIVE_SLOTS"]
