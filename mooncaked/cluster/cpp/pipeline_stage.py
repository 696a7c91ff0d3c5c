"""A pipeline stage server: one StageEngine behind control RPCs, chunks flowing stage to
stage over the transfer engine (chunked pipeline parallelism, Mooncake section 3.3).

Protocol (every call a ControlServer method; hidden states never travel over RPC; the
bodies are wire/messages.py's CppPrefill, CppReserve, CppChunk and CppRequestRef):

    caller -> stage 0    cpp.prefill {request_id, token_ids, chunk_tokens, keep, kv_target,
                                      sampling, keys, fetch}
                         -> {token_id, num_tokens, cached_tokens, stages: [{node, layers,
                             compute_s, chunks, kv_pushed_bytes, kv_push_wait_s,
                             logprob and grammar_done (last)}...]}: per stage, compute_s its compute seconds,
                            chunks each chunk's compute seconds in order, kv_pushed_bytes
                            the bytes its KV push wrote, kv_push_wait_s the seconds its
                            answer waited for that push after its part was done
    stage k -> stage k+1 cpp.reserve {request_id, num_tokens, kv_target, sampling, keys, fetch}
                         -> {descriptor, offset, cached_blocks}: a receive slot of
                            num_tokens rows of [hidden_size] in the stage dtype, in segment
                            "<name>/hidden"; with `keys` (the prompt's block keys, hex) the
                            stage matches its prefix cache and reserves down the chain at
                            once, answering the least match of it and every later stage;
                            with a StagePrefix (`prefix`: the stage's own store) a stage
                            continues its match from its store's slices and from
                            `fetch` = {control, blocks}, a node holding the full blocks
                            (cluster/cpp/stage_prefix.py); its finished blocks' slices go
                            into its store when it releases the request
    stage k  WRITE       hidden rows [start, end) of a chunk -> that slot (transfer engine)
    stage k -> stage k+1 cpp.hold {request_id}: open for the request's life on stage k+1;
                         if stage k dies, the connection drops, the handler is cancelled
                         and stage k+1 releases the request at once (and stage k learns of
                         a dead stage k+1 the same way, without waiting for a chunk)
    stage k -> stage k+1 cpp.chunk {request_id, start, end, last}
                         not last: ack at once (the chunk is queued);
                         last: the downstream result once the last stage has the token
    anyone -> any stage  cpp.release {request_id} -> {released: bool}
    anyone -> any stage  cpp.status -> {node, layers, requests, free_blocks, ...}
    operator -> stage    cpp.configure {next}: re-points the stage at a (restarted) next stage

Stage k's worker computes chunk i+1 while chunk i's WRITE and notification to stage k+1
are in flight (a send task per chunk, chained so a request's chunks arrive in order).
A request that fails on any stage (a dead peer, no pages) is released on this stage and
its error goes back up the chain; a request whose upstream stage dies is released when
its `cpp.hold` connection drops, and a request nobody holds or touches for
`idle_timeout_s` by a sweep (the backstop; a held one that gets no chunk for
HELD_IDLE_FACTOR idle timeouts too), so nothing is held afterwards. A request
whose caller goes away (a cancelled cpp.prefill or last cpp.chunk) is released with
its hold on the next stage dropped, so every later stage frees it at once.

KV push (optional `kv_target` = {descriptor}: a receive segment in the decode node's
layer-major layout [num_layers, num_blocks, 2, block_size, kv_heads, head_dim], num_blocks
= ceil(prompt tokens / block_size)): as soon as a stage has computed a chunk, its compute
thread gathers the chunk's blocks of its own layers (layer-major, one copy) and the
request's KVPusher (cluster/kv_push.py, the prefill nodes' pusher) WRITEs them, one byte
run per layer (layer l, blocks lo..hi-1: offset (l * num_blocks + lo) * L, L = one layer
of one block's bytes), while the stage computes the next chunk. The pusher writes in the
order runs were queued, so a block that a chunk ended in the middle of (chunk sizes that
are not a multiple of the block size) is sent again, complete, by the next chunk's push
and lands after the earlier copy; the first chunk's push also carries the cached prefix
blocks the stage matched. A stage answers only after its pusher is done
(`kv_push_wait_s`: how long that wait was), so the receive buffer takes layer ranges from
several senders and is complete when the token comes back. A failed push fails the
request (StageFailure) when the stage answers.

Greedy only: the last stage returns the argmax token of the last prompt position
(the bench's and tests' contract; a cluster prefill node would sample with the request's
SamplingParams here).

In the cluster a stage runs inside a prefill node (cpp_node.py); `bench cpp` and the CPP
tests run bare stages, one per process (benchmarks/stage_process.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from dataclasses import dataclass, field

import torch

from mooncaked.config import TransferSettings
from mooncaked.engine.stage import StageEngine
from mooncaked.cluster.kv_push import KVPusher
from mooncaked.log import get_logger
from mooncaked.transfer.engine import TransferEngine

from mooncaked.wire.errors import PeerUnavailable, RpcError
from mooncaked.wire.rpc import ControlClient, ControlServer
from mooncaked.model.sampling import SamplingRow, sample
from mooncaked.wire.messages import (CppChunk, CppPrefill, CppRequestRef, CppReserve,
                                     logprob_to_json, params_from_json)
from mooncaked.engine.structured import grammar_accept, grammar_finished, mask_logits

log = get_logger(__name__)

SWEEP_INTERVAL_S = 0.5  # how often idle requests are looked for (well under idle_timeout_s)
HELD_IDLE_FACTOR = 6    # a held request without a chunk for 6 idle timeouts is given up
SLOT_WAIT_S = 10.0      # cpp.reserve waits this long for a receive slot before failing


class StageFailure(RuntimeError):
    """A request failed on this stage or downstream (message says which and why)."""


@dataclass
class _Req:
    total: int = 0                       # prompt tokens
    slot: int | None = None              # this stage's receive slot (not the first stage)
    next_offset: int | None = None       # the next stage's slot offset, bytes
    next_segment: str = ""
    send: asyncio.Task | None = None     # the newest send task (chained)
    result: asyncio.Future | None = None
    compute_s: float = 0.0
    touched: float = field(default_factory=time.monotonic)
    keep: bool = False
    waiting: bool = False                # a caller awaits the result (never swept)
    kv_target: dict | None = None        # {descriptor} of a layer-major receive buffer
    pusher: KVPusher | None = None       # WRITEs this stage's layers into kv_target
    held: bool = False                   # the upstream stage holds a cpp.hold call open
    hold: asyncio.Task | None = None     # our cpp.hold call on the next stage
    sampling: dict | None = None         # {params, prompt} for the last stage's pick; None: greedy
    fetch: dict | None = None            # {control, blocks}: full blocks of the prefix elsewhere
    chunks: list[float] = field(default_factory=list)   # each chunk's compute seconds, in order
    pushed_blocks: int = 0               # full blocks whose KV a push already carries


class StageServer:
    """Serves one pipeline stage.

    Args:
        stage: the StageEngine (its layer range decides first/last).
        name: this node's name (segment "<name>/hidden").
        next_addr: control address "host:port" of the next stage; None on the last stage.
        max_tokens: longest prompt, tokens (size of one receive slot).
        slots: requests that may be in flight through this stage at once.
        idle_timeout_s: a request untouched this long is released (a dead peer upstream);
            one its upstream stage holds (cpp.hold) after max(HELD_IDLE_FACTOR *
            idle_timeout_s, rpc_timeout_s) without a chunk.
        rpc_timeout_s: bound on each call to the next stage (the last chunk's call waits
            for the whole downstream prefill, so it gets max(rpc_timeout_s, 600)).
        transfer, control, client: a cluster node's started TransferEngine, ControlServer
            and ControlClient to share (cluster/cpp/cpp_node.py); None: the server makes and
            owns its own (a stand-alone stage process).
        next_resolver: returns the next stage's control address as the cluster sees it now
            (None while unknown); asked before each request leaves this stage.
        grammars: the last stage's GrammarBackend (engine/structured.py) for requests with
            structured output; None: such a request fails with StageFailure.
    """

    def __init__(self, stage: StageEngine, name: str, next_addr: str | None, max_tokens: int = 8192,
                 slots: int = 2, idle_timeout_s: float = 5.0, rpc_timeout_s: float = 30.0,
                 transfer_settings: TransferSettings | None = None, *, transfer=None, control=None,
                 client=None, next_resolver=None, grammars=None):
        if next_resolver is None and (next_addr is None) != stage.is_last:
            raise ValueError("exactly the last stage has no next stage")
        self.stage, self.name, self.next_addr = stage, name, next_addr
        self.next_resolver = None if stage.is_last else next_resolver
        self.grammars = grammars
        self.max_tokens, self.idle_timeout_s, self.rpc_timeout_s = max_tokens, idle_timeout_s, rpc_timeout_s
        # a held request untouched this long is given up (the sweep): well past the longest
        # an upstream stage takes between two chunks of a live request (its queue of other
        # requests' chunks included)
        self.held_timeout_s = max(HELD_IDLE_FACTOR * idle_timeout_s, rpc_timeout_s)
        self._own = transfer is None
        self.transfer = transfer if transfer is not None else TransferEngine(transfer_settings, node_id=name)
        self.control = control if control is not None else ControlServer()
        self.client = client if client is not None else ControlClient(timeout_s=rpc_timeout_s)
        self.reqs: dict[str, _Req] = {}
        self.free_slots = list(range(slots))
        self._slot_freed = asyncio.Event()        # set whenever a receive slot is freed
        self._progress = time.monotonic()         # last chunk computed or slot freed (stalled())
        self._computing_since: float | None = None   # the worker's chunk in the executor
        # the request whose chunk the compute thread runs: its pages are the thread's until
        # the chunk returns, so a release meanwhile leaves them to the worker (_free_pages)
        self._computing_rid: str | None = None
        self.row_bytes = stage.hidden_size * stage.dtype.itemsize
        self.hidden = None if stage.is_first else torch.zeros((slots, max_tokens, stage.hidden_size),
                                                              dtype=stage.dtype)
        self.segment = f"{name}/hidden"
        self._queue: asyncio.Queue = asyncio.Queue()
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._tasks: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()   # pushers of released requests, closing
        self.address = ""
        self.prefix = None   # StagePrefix (cluster/cpp/stage_prefix.py): the stage's own store
        for method in ("prefill", "reserve", "hold", "chunk", "release", "status", "configure"):
            self.control.add_handler(f"cpp.{method}", getattr(self, f"_on_{method}"))

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts the transfer engine, the receive segment, the worker and the control
        server; returns the control address "host:port". With a shared (cluster node's)
        transfer engine and control server, only the segment and the worker start; returns
        ""."""
        if self._own:
            await self.transfer.start()
        if self.hidden is not None:
            self.transfer.register_segment(self.segment, self.hidden)
        self._tasks = [asyncio.create_task(self._worker()), asyncio.create_task(self._sweep())]
        if not self._own:
            return ""
        h, p = await self.control.start(host, port)
        self.address = f"{h}:{p}"
        log.info("cpp_stage_started", node=self.name, layers=f"{self.stage.layers.start}:"
                 f"{self.stage.layers.stop}", control=self.address, next=self.next_addr)
        return self.address

    async def stop(self) -> None:
        """Stops serving and frees everything. Never raises."""
        for t in self._tasks:
            t.cancel()
        for rid in list(self.reqs):
            self._release(rid, "stopping")
        if self._own:
            await self.control.stop()
            await self.client.close()
            await self.transfer.close()
        elif self.hidden is not None:
            with contextlib.suppress(Exception):
                self.transfer.unregister_segment(self.segment)
        self._compute.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Synchronous stop of a StageServer that shares a cluster node's transfer engine
        and control server (the node closes those): cancels the worker, releases every
        request, withdraws the receive segment. Never raises."""
        for t in self._tasks:
            t.cancel()
        for rid in list(self.reqs):
            self._release(rid, "stopping")
        if self.hidden is not None:
            with contextlib.suppress(Exception):
                self.transfer.unregister_segment(self.segment)
        self._compute.shutdown(wait=False, cancel_futures=True)

    # -- requests

    def stalled(self, now: float | None = None) -> str | None:
        """Why this stage cannot take a request now, or None when it can (issue 32: a
        wedged group must not look healthy, and placement avoids it).

        Stalled: every receive slot is taken and nothing moved (no chunk computed, no slot
        freed) for idle_timeout_s (slots leaked, or the stages after it stuck), or one
        chunk has been computing for held_timeout_s (a hung stage). Monotonic seconds.
        """
        now = time.monotonic() if now is None else now
        since = self._computing_since
        if since is not None and now - since > self.held_timeout_s:
            return f"{self.name}: one chunk has been computing for {now - since:.0f} s"
        quiet = now - self._progress
        if self.hidden is not None and not self.free_slots and quiet > self.idle_timeout_s:
            held = sum(1 for r in self.reqs.values() if r.slot is not None)
            return (f"{self.name}: no free receive slot ({held} held) and no progress "
                    f"for {quiet:.0f} s")
        return None

    def release(self, rid: str, why: str = "asked") -> bool:
        """Frees rid on this stage (its slot, pages; the next stage through the dropped
        hold); False when it held nothing of it."""
        return self._release(rid, why)

    def _release(self, rid: str, why: str = "done") -> bool:
        req = self.reqs.pop(rid, None)
        if req is None:
            return self._free_pages(rid)
        if req.slot is not None:
            self.free_slots.append(req.slot)
            self._slot_freed.set()
            self._progress = time.monotonic()
        if req.hold is not None and why != "done":
            req.hold.cancel()  # drops the connection: the next stage releases too
        if req.pusher is not None:      # done: its writes finished before the answer
            self._close_pusher(req.pusher)
        if req.send is not None and why != "done":
            req.send.cancel()  # the chain of sends (a cpp.reserve in flight among them)
        if req.result is not None and not req.result.done():
            req.result.set_exception(StageFailure(f"{self.name}: request {rid} released ({why})"))
        self._free_pages(rid)
        log.info("cpp_request_released", node=self.name, request_id=rid, reason=why)
        return True

    def _free_pages(self, rid: str) -> bool:
        """StageEngine.release; with a StagePrefix, once the finished blocks' slices the
        stage's store lacks are copied into it (in the background: a few ms). While rid's
        chunk computes, nothing here: the worker frees them when the chunk returns (freeing
        them now would race the compute thread, which makes or extends rid's pages)."""
        if rid == self._computing_rid:
            return True
        if self.prefix is not None and self.prefix.offload(rid, lambda: self.stage.release(rid)):
            return True
        return self.stage.release(rid)

    async def _match(self, rid: str, req: _Req, keys: list[bytes]) -> int:
        """The blocks of `keys` this stage holds for rid: its pages (StageEngine.match),
        then with a StagePrefix its store's slices and the fetch source's full blocks."""
        own = self.stage.match(rid, keys)
        if self.prefix is not None:
            own = await self.prefix.extend(rid, keys, own, req.fetch)
            req.touched = time.monotonic()
        return own

    async def _match_all(self, rid: str, req: _Req, keys: list[bytes]) -> int:
        """The least match of this stage and every later one (cpp.reserve down the chain),
        the stages loading or fetching their prefixes at the same time."""
        if self.stage.is_last:
            return await self._match(rid, req, keys)
        mine = asyncio.ensure_future(self._match(rid, req, keys))
        try:
            down = await self._reserve_next(rid, req, keys)
        finally:
            own = await mine
        return min(own, down)

    def _new(self, rid: str, total: int, keep: bool) -> _Req:
        if rid in self.reqs:
            raise ValueError(f"request {rid} is already on stage {self.name}")
        if not 0 < total <= self.max_tokens:
            raise ValueError(f"num_tokens must be 1..{self.max_tokens}, got {total}")
        req = _Req(total=total, keep=keep)
        req.result = asyncio.get_running_loop().create_future()
        req.result.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
        self.reqs[rid] = req
        return req

    async def prefill(self, msg: CppPrefill) -> dict:
        """`cpp.prefill` called in-process (a cluster node's stage 0): same answer."""
        return await self._prefill(msg)

    async def _on_prefill(self, body: dict) -> dict:
        return await self._prefill(CppPrefill.from_json(body))

    async def _prefill(self, msg: CppPrefill) -> dict:
        if not self.stage.is_first:
            raise ValueError(f"{self.name} is not the first stage")
        rid, ids, chunk, keys = msg.request_id, list(msg.token_ids), msg.chunk_tokens, list(msg.keys)
        if chunk < 1:
            raise ValueError("chunk_tokens must be >= 1")
        req = self._new(rid, len(ids), msg.keep)
        req.kv_target, req.sampling, req.fetch = msg.kv_target, msg.sampling, msg.fetch
        req.waiting = True
        try:
            start = 0
            if keys:   # the blocks every stage holds need no compute: start after them
                held = await self._match_all(rid, req, keys)
                start = min(held, (len(ids) - 1) // self.stage.block_size) * self.stage.block_size
            tokens = torch.tensor(ids, dtype=torch.long)
            for s in range(start, len(ids), chunk):
                e = min(s + chunk, len(ids))
                self._queue.put_nowait((rid, s, e, e == len(ids), tokens[s:e]))
            return {**await req.result, "cached_tokens": start}
        finally:
            if not req.keep:
                # cancelled (the client went away) or failed: the next stages go too (the
                # dropped cpp.hold), not only this one (issue 32, fault 4)
                self._release(rid, _ending(req))

    async def _on_reserve(self, body: dict) -> dict:
        if self.hidden is None:
            raise ValueError(f"{self.name} is the first stage: it takes tokens, not hidden states")
        msg = CppReserve.from_json(body)
        rid, n = msg.request_id, msg.num_tokens
        # Stage 0 admits at most `slots` requests, but a finished request's slot here may
        # be freed just after stage 0 admitted the next one: wait a little for it.
        deadline = time.monotonic() + SLOT_WAIT_S
        while not self.free_slots:
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise StageFailure(f"{self.name}: no free receive slot within {SLOT_WAIT_S:g} s") from None
        keys = list(msg.keys)
        req = self._new(rid, n, msg.keep)
        req.kv_target, req.sampling, req.fetch = msg.kv_target, msg.sampling, msg.fetch
        req.slot = self.free_slots.pop()
        cached = None
        if keys:    # match here, then down the chain: the answer is the least any stage holds
            try:
                cached = await self._match_all(rid, req, keys)
            except Exception:
                self._release(rid, "reserve failed")
                raise
        return {"descriptor": self.transfer.segment_descriptor(self.segment),
                "offset": req.slot * self.max_tokens * self.row_bytes, "cached_blocks": cached}

    async def _on_hold(self, body: dict) -> dict:
        rid = CppRequestRef.from_json(body).request_id
        req = self.reqs.get(rid)
        if req is None:
            raise StageFailure(f"{self.name}: no reservation for request {rid}")
        req.held = True
        try:
            await asyncio.shield(req.result)
        except asyncio.CancelledError:
            if self.reqs.get(rid) is req and not req.result.done():
                self._release(rid, "upstream gone")
            raise
        except Exception:  # noqa: BLE001 - the failure travels on the chunk path
            return {"done": False}
        return {"done": True}

    async def _on_chunk(self, body: dict) -> dict:
        msg = CppChunk.from_json(body)
        rid = msg.request_id
        req = self.reqs.get(rid)
        if req is None or req.slot is None:
            raise StageFailure(f"{self.name}: no reservation for request {rid}")
        s, e, last = msg.start, msg.end, msg.last
        if not 0 <= s < e <= req.total:
            raise ValueError(f"chunk {s}:{e} outside 0:{req.total}")
        req.touched = time.monotonic()
        self._queue.put_nowait((rid, s, e, last, self.hidden[req.slot, s:e]))
        if not last:
            return {"queued": True}
        req.waiting = True  # a dead caller cancels this handler, which releases the request
        try:
            return await req.result
        finally:
            if not req.keep:
                self._release(rid, _ending(req))

    async def _on_release(self, body: dict) -> dict:
        return {"released": self._release(CppRequestRef.from_json(body).request_id, "asked")}

    async def _on_configure(self, body: dict) -> dict:
        nxt = body.get("next")
        if self.stage.is_last or not isinstance(nxt, str) or not nxt:
            raise ValueError("only a stage that has a next stage takes a new next address")
        self.next_addr = nxt
        return {"next": nxt}

    async def _on_status(self, _body) -> dict:
        st = self.stage
        return {"node": self.name, "layers": [st.layers.start, st.layers.stop], "first": st.is_first,
                "last": st.is_last, "next": self.next_addr, "requests": sorted(self.reqs),
                "held": sorted(r for r, q in self.reqs.items() if q.held),
                "stage_pages": sorted(st.seqs), "free_blocks": st.num_free_blocks(),
                "free_slots": len(self.free_slots), "weight_bytes": st.weight_bytes,
                "peer_segments": self.transfer.peer_segment_names(),
                "stalled": self.stalled(),
                "prefix": self.prefix.status() if self.prefix is not None else None}

    # -- the worker: compute chunk after chunk, hand each result to a send task

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            rid, s, e, last, inputs = await self._queue.get()
            req = self.reqs.get(rid)
            if req is None or req.result.done():
                continue  # released or failed meanwhile
            want_logits = last and self.stage.is_last
            bs = self.stage.block_size
            blocks = None if req.kv_target is None else (req.pushed_blocks, -(-e // bs))
            self._computing_since, self._computing_rid = time.monotonic(), rid
            try:
                out, seconds, kv = await loop.run_in_executor(self._compute, self._run_chunk, rid, s,
                                                              inputs, want_logits, blocks)
            except Exception as ex:  # noqa: BLE001 - out of pages, out-of-order chunk: fail the request
                self._fail(rid, StageFailure(f"{self.name}: chunk {s}:{e} of {rid}: {ex}"))
                continue
            finally:
                self._computing_since = self._computing_rid = None
                self._progress = time.monotonic()
                if self.reqs.get(rid) is not req:
                    # released while its chunk computed (a client gone, a failure): the
                    # pages the chunk made or kept are freed now, or they leak
                    self._free_pages(rid)
            if self.reqs.get(rid) is not req:
                continue  # released while this chunk computed: nothing goes downstream
            req.compute_s += seconds
            req.chunks.append(seconds)
            req.touched = time.monotonic()
            if kv is not None:      # this chunk's KV leaves now, while the next chunk computes
                req.pushed_blocks = e // bs
                self._push_kv(req, blocks[0], kv)
            me = {"node": self.name, "layers": [self.stage.layers.start, self.stage.layers.stop],
                  "compute_s": round(req.compute_s, 6), "chunks": [round(c, 6) for c in req.chunks],
                  "kv_pushed_bytes": 0, "kv_push_wait_s": 0.0}
            if self.stage.is_last:
                if want_logits:
                    try:
                        token, logprob, grammar_done = self._pick(req, out)
                    except Exception as ex:  # noqa: BLE001 - bad sampling parameters
                        self._fail(rid, StageFailure(f"{self.name}: sampling {rid}: {ex}"))
                        continue
                    me["logprob"] = logprob
                    me["grammar_done"] = grammar_done
                    req.send = asyncio.create_task(self._finish_last(req, token, me))
                continue
            req.send = asyncio.create_task(self._send(rid, req, req.send, s, e, last, out, me))

    def _pick(self, req: _Req, logits: torch.Tensor) -> tuple[int, list | None, bool]:
        """The first output token from the last prompt position's fp32 logits [vocab]:
        argmax without `sampling`, else the engine's sampler (model/sampling.py) with the
        request's SamplingParams over its prompt, after masking what its structured-output
        constraint forbids (a matcher replayed over the prompt's last `output_offset`
        tokens, as LLMEngine does). Returns (token, [token, logprob, top] or None when no
        logprobs were asked for, whether the constraint is complete after the token:
        engine/stop.py stops the request then). Raises: ValueError without a grammar backend for a
        structured request; InvalidRequest when the earlier tokens break its constraint."""
        if req.sampling is None:
            return int(torch.argmax(logits)), None, False

        params = params_from_json(req.sampling["params"])
        prompt = list(req.sampling.get("prompt") or [])
        row = logits.float().unsqueeze(0).clone()
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("this stage has no grammar backend for structured output")
            earlier = prompt[len(prompt) - params.output_offset:] if params.output_offset else []
            matcher = self.grammars.matcher(params.structured, earlier)
            mask_logits(row, [matcher])
        tokens, lps = sample(row, [SamplingRow(params, prompt, len(prompt))])
        lp = lps[0]
        done = params.structured is not None and grammar_accept(matcher, tokens[0]) \
            and grammar_finished(matcher)
        return tokens[0], None if lp is None else logprob_to_json(lp), done

    def _run_chunk(self, rid: str, s: int, inputs: torch.Tensor, want_logits: bool,
                   blocks: tuple[int, int] | None) -> tuple[torch.Tensor, float, torch.Tensor | None]:
        """In the compute thread: StageEngine.run_chunk, timed, then (with `blocks` = (lo, hi))
        the chunk's KV blocks lo..hi-1 of this stage's layers, layer-major on the host, for
        its push. Returns (output, compute seconds, KV [stage_layers, hi - lo, 2, bs, h, d]
        or None)."""
        t0 = time.perf_counter()
        out = self.stage.run_chunk(rid, s, inputs, want_logits)
        seconds = time.perf_counter() - t0
        kv = None
        if blocks is not None:
            kv = self.stage.read_kv_layer_major(rid, *blocks).cpu()
        return out, seconds, kv

    async def _await_push(self, req: _Req, me: dict) -> None:
        """Waits for the request's pusher to write everything queued; records the wait and
        the bytes in `me`. Raises StageFailure when a write failed or timed out."""
        t0 = time.perf_counter()
        if req.pusher is not None:
            stats = await req.pusher.finish(time.monotonic())
            me["kv_pushed_bytes"] = stats.bytes
            if not stats.ok:
                raise StageFailure(f"{self.name}: {stats.error}")
        me["kv_push_wait_s"] = round(time.perf_counter() - t0, 6)

    async def _finish_last(self, req: _Req, token: int, me: dict) -> None:
        try:
            await self._await_push(req, me)
        except Exception as ex:  # noqa: BLE001 - reported as the request's failure
            self._fail_req(req, StageFailure(f"{self.name}: KV push failed: {ex}"))
            return
        if not req.result.done():
            req.result.set_result({"token_id": token, "num_tokens": req.total, "stages": [me]})

    def _push_kv(self, req: _Req, lo: int, kv: torch.Tensor) -> None:
        """Queues one chunk's KV of this stage's layers on the request's pusher (made on the
        first chunk): kv = [stage_layers, nb, 2, bs, h, d] for blocks lo..lo+nb-1, written
        into kv_target's layer-major buffer [num_layers, num_blocks, ...] as one byte run
        per layer (adjacent runs merged, so a one-chunk prompt is one WRITE)."""
        if req.pusher is None:
            target = req.kv_target

            async def reserved() -> dict:     # reserved upstream: the caller named it
                return target
            req.pusher = KVPusher(self.transfer, None, reserved, self.rpc_timeout_s)
            req.pusher.start()
        n, nb = kv.shape[0], kv.shape[1]
        block_layer = kv[0, 0].numel() * kv.element_size()       # one layer of one block
        per_layer = -(-req.total // self.stage.block_size) * block_layer
        runs: list[list[int]] = []                                # [dst, src, length]
        for j in range(n):
            dst = (self.stage.layers.start + j) * per_layer + lo * block_layer
            src, length = j * nb * block_layer, nb * block_layer
            if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
                runs[-1][2] += length
            else:
                runs.append([dst, src, length])
        req.pusher.push_runs(kv, [tuple(r) for r in runs])

    def _close_pusher(self, pusher: KVPusher) -> None:
        """Stops a released request's pusher and forgets its peer segment, in the
        background (closing waits for a write in flight to end)."""
        pusher.cancel()
        try:
            task = asyncio.get_running_loop().create_task(pusher.aclose())
        except RuntimeError:            # no loop (a synchronous close): cancelled is enough
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _hold(self, rid: str, req: _Req) -> None:
        """Keeps cpp.hold open on the next stage for the request's life; a dead next stage
        ends the request here at once."""
        try:
            await self.client.call(self.next_addr, "cpp.hold", CppRequestRef(rid).to_json(),
                                   timeout_s=24 * 3600.0)
        except PeerUnavailable as ex:  # the next stage died: end the request now
            self._fail(rid, StageFailure(f"{self.name} -> {self.next_addr}: {ex}"))
        except RpcError:
            pass  # the next stage's own errors come back on the chunk path

    def _fail_req(self, req: _Req, err: Exception) -> None:
        if not req.result.done():
            req.result.set_exception(err)

    def _fail(self, rid: str, err: Exception) -> None:
        req = self.reqs.get(rid)
        if req is not None and not req.result.done():
            req.result.set_exception(err)
        log.warning("cpp_request_failed", node=self.name, request_id=rid, error=str(err))

    async def _send(self, rid: str, req: _Req, prev: asyncio.Task | None, s: int, e: int, last: bool,
                    hidden: torch.Tensor, me: dict) -> None:
        try:
            if prev is not None:
                await prev
            if req.result.done():
                return
            if req.next_offset is None:
                await self._reserve_next(rid, req)
            await self.transfer.write(req.next_segment, req.next_offset + s * self.row_bytes,
                                      hidden.contiguous())
            body = CppChunk(rid, s, e, last).to_json()
            timeout = max(self.rpc_timeout_s, 600.0) if last else self.rpc_timeout_s
            r = await self.client.call(self.next_addr, "cpp.chunk", body, timeout_s=timeout)
            req.touched = time.monotonic()
            if last:
                await self._await_push(req, me)  # long done, usually: it ran while later stages computed
            if last and not req.result.done():
                r["stages"] = [me, *r["stages"]]
                req.result.set_result(r)
        except Exception as ex:  # noqa: BLE001 - dead or failing next stage: the request ends here
            self._fail(rid, StageFailure(f"{self.name} -> {self.next_addr}: {ex}"))

    async def _reserve_next(self, rid: str, req: _Req, keys: list[bytes] | None = None) -> int:
        """`cpp.reserve` on the next stage (a slot for rid's hidden states, and with `keys`
        its prefix match down the chain); starts holding it. Returns the blocks every later
        stage holds of `keys` (0 without keys). Raises StageFailure, RpcError."""
        if self.next_resolver is not None:
            self.next_addr = self.next_resolver() or self.next_addr
        if not self.next_addr:
            raise StageFailure(f"{self.name}: the next stage has not joined")
        body = CppReserve(rid, req.total, req.keep, req.kv_target, req.sampling,
                          tuple(keys or ()), req.fetch).to_json()
        try:
            try:
                r = await self.client.call(self.next_addr, "cpp.reserve", body)
            except PeerUnavailable:
                # A pooled connection to a next stage that was restarted (same address) fails
                # once; the reservation never reached the new process, so asking again is safe.
                r = await self.client.call(self.next_addr, "cpp.reserve", body)
        except asyncio.CancelledError:
            # released here (its client gone) while the reservation was in flight: the next
            # stage may hold it already, and no cpp.hold would ever end it there
            task = asyncio.create_task(self._release_next(rid, self.next_addr))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            raise
        if self.reqs.get(rid) is not req:
            # released here while the reservation was in flight: nobody would hold it there
            # (the leak of issue 32, fault 4), so release it on the next stage now
            await self._release_next(rid, self.next_addr)
            raise StageFailure(f"{self.name}: request {rid} was released during its reservation")
        req.next_segment = self.transfer.add_peer_segment(r["descriptor"])
        req.next_offset = int(r["offset"])
        req.hold = asyncio.create_task(self._hold(rid, req))
        return int(r.get("cached_blocks") or 0)

    async def _release_next(self, rid: str, addr: str) -> None:
        """Best-effort cpp.release of rid on the next stage at `addr` (bounded by the
        client's timeout); never raises."""
        with contextlib.suppress(Exception):
            await self.client.call(addr, "cpp.release", CppRequestRef(rid).to_json())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now = time.monotonic()
            for rid, req in list(self.reqs.items()):
                if req.waiting or (req.keep and req.result.done()):
                    continue
                # A held request waits on its upstream stage, which sends a chunk at least
                # every held_timeout_s while it lives; past that its holder is gone even if
                # the hold connection never dropped: give it up (bounded, issue 32 fault 4).
                if now - req.touched > (self.held_timeout_s if req.held else self.idle_timeout_s):
                    self._release(rid, "held idle" if req.held else "idle")


def _ending(req: _Req) -> str:
    """Why a request's handler releases it: "done" once its result is in (the next stage
    released it too), else "aborted" (its hold on the next stage is dropped). A handler
    cancelled while it awaits the result cancels that future too (asyncio cancels what a
    task awaits), so a cancelled result is an abort, not a result: the next stages must
    go at once, not after HELD_IDLE_FACTOR idle timeouts (measured 12 s a request)."""
    r = req.result
    return "done" if r is not None and r.done() and not r.cancelled() else "aborted"
