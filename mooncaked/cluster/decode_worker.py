"""The decode side of a node: admissions and receive buffers for pushed KV
(`node.kv_reserve`) and the internal decode stream (POST /internal/decode;
architecture.md step 4).

A prefill node asks this node to admit a request (the TBT check, cluster/admission.py)
when the request's turn to compute comes, before it computes: a refusal (DecodeRefused,
429) costs no prefill. With the push on, the same call reserves the request's receive
buffer; only that prefill node gets the buffer's access key. An admission counts as
load for the next checks until its /internal/decode arrives (which does not check
again), its prefill node releases it, or cluster.stage_ttl_s passes. When the API node then asks this node
to decode the request (a `DecodeRequest`), the node takes the pushed buffer if the
push completed, else READs the prefill node's stage in one batch (all of it or
nothing: it never decodes on partial KV), admits the request with kv_import +
first_token, and streams `OutputDelta` lines back ("{}" keep-alives while quiet; a
`DecodeFailure` line ends a request the engine refuses or fails). The lines carry only
the tokens sampled here: the API node sent the first token, with the part of its text
`engine.stop.held_back` allows, and the engine's text starts after that part.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from mooncaked import failpoints
from mooncaked.conductor.refit import STARTUP_PROFILE
from mooncaked.log import get_logger

from .admission import DecodeAdmission, still_decoding
from mooncaked.wire.errors import DecodeRefused
from mooncaked.wire.messages import (DecodeFailure, DecodeRequest, GenerateRequest, KVReservation,
                                     KVReserved, MessageError, OutputDelta, Release)
from .node_state import NodeDraining, ReceiveBuffersFull, release_on
from .role import Handler, NodeContext, RoleStatus
from mooncaked.engine.types import KVImport
from mooncaked.engine.types import InvalidRequest

log = get_logger(__name__)


@dataclass(frozen=True)
class Admission:
    """A request admitted before its prefill (`node.kv_reserve` with admit_tokens): its
    prefill node's control address, prompt tokens, and until when it holds (monotonic s)."""

    owner: str
    tokens: int
    until: float
    at: float = 0.0              # admitted when (monotonic s)


@dataclass
class ReceiveBuffer:
    """A reserved buffer for one request's pushed KV: transfer segment `segment` over
    `buf` (layer-major), owned by the prefill node at control address `owner`, withdrawn
    when `timer` fires."""

    segment: str
    buf: Any                          # torch.Tensor
    timer: asyncio.TimerHandle
    owner: str

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()


class DecodeWorker:
    """Receive buffers and the decode stream of a decode node (see the module doc).

    Args:
        ctx: the node's NodeContext (role.py): engine (the AsyncLLM), transfer engine,
            client, counters and activity (no store: a decode node takes KV only from
            prefill nodes).
    Implements role.RoleWorker (side "decode"; on a coupled node it runs whole requests).
    """

    side = "decode"

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        self.node_id, self.settings = ctx.node_id, ctx.settings
        self.engine, self.transfer, self.client = ctx.engine, ctx.transfer, ctx.client
        self.counters, self.activity = ctx.kv_transfer, ctx.activity
        self.requests: dict[str, int] = {}            # rid -> context tokens
        self.tokens_left: dict[str, int] = {}         # rid -> output tokens it may still make
        self.buffers: dict[str, ReceiveBuffer] = {}
        # (rid, owner) released before its reservation arrived -> until when (monotonic s):
        # a prefill node that gave up on a request while its node.kv_reserve was still in
        # flight releases first; the late reservation must not then hold memory until its TTL.
        self._released_early: dict[tuple[str, str], float] = {}
        self.admitted: dict[str, Admission] = {}      # rid -> admitted, not yet arrived
        self.tokens_out = 0        # output tokens streamed (the throughput line)
        g = self.engine.kv_geometry()
        self.admission = DecodeAdmission(self.settings, g.block_bytes // max(1, g.block_size))
        if self.engine.startup_profile is not None:    # calibrated before the first request
            self.admission.observe(self.engine.startup_profile.decode_steps, STARTUP_PROFILE)
        self.prompts: dict[str, tuple[int, int]] = {}   # coupled: rid -> (new, cached) queued

    # ------------------------------------------------------------------ receive buffers

    async def reserve(self, payload: Any) -> dict:
        """`node.kv_reserve`: KVReservation -> KVReserved. With admit_tokens, first the TBT
        check (`admit`). Then, unless the shape is empty (an admission only: KVReserved
        with an empty descriptor), a receive buffer registered as segment
        "<node>/recv/<rid>"; only the caller gets its descriptor (access key). Freed
        when the request is admitted, by node.release from its owner, or after ttl_s from
        now (clamped to [cluster.stage_ttl_s, server.request_timeout_s]). A new reservation
        for the same rid (the request placed again on another prefill node) replaces the
        old one.
        Raises: NodeDraining; DecodeRefused (429) when the TBT check refuses; ValueError
        for a wrong geometry, or when the receive buffers would exceed
        engine.kv_cache_bytes.
        """
        import torch  # noqa: PLC0415

        ask = KVReservation.from_json(payload)
        if self.ctx.draining():
            raise NodeDraining(f"{self.node_id} is draining")
        failpoints.hit("node.kv_reserve")
        if ask.admit_tokens:
            self.admit(ask.rid, ask.owner, ask.admit_tokens)
        if not ask.shape:
            return KVReserved({}).to_json()
        g = self.engine.kv_geometry()
        want = g.layer_major_shape(ask.shape[1] if len(ask.shape) == 6 else 0)
        if list(ask.shape) != want or ask.shape[1] < 1 or ask.dtype != g.dtype_name:
            raise ValueError(f"receive buffer {list(ask.shape)} {ask.dtype} does not match this "
                             f"engine ({g.num_layers}, n, {want[2:]}, {g.dtype})")
        now = time.monotonic()
        self._released_early = {k: t for k, t in self._released_early.items() if t > now}
        if (ask.rid, ask.owner) in self._released_early:
            raise ValueError(f"request {ask.rid} was released by its prefill node before this "
                             f"reservation arrived")
        self.release(ask.rid)                # an earlier attempt of this request
        nbytes = ask.shape[1] * g.block_bytes
        held = sum(r.nbytes for r in self.buffers.values())
        if held + nbytes > self.settings.engine.kv_cache_bytes:
            raise ReceiveBuffersFull(f"decode node {self.node_id}: receive buffers full "
                                     f"({held} + {nbytes} bytes > engine.kv_cache_bytes)")
        buf = torch.empty(list(ask.shape), dtype=g.dtype)
        name = f"{self.node_id}/recv/{ask.rid}"
        desc = self.transfer.register_segment(name, buf, "cpu:0")
        ttl = min(max(ask.ttl_s, self.settings.cluster.stage_ttl_s),
                  self.settings.server.request_timeout_s)
        timer = asyncio.get_running_loop().call_later(ttl, self.release, ask.rid)
        self.buffers[ask.rid] = ReceiveBuffer(name, buf, timer, ask.owner)
        return KVReserved(desc).to_json()

    def admit(self, rid: str, owner: str, tokens: int) -> None:
        """Admits rid (`tokens` prompt tokens, prefilled by `owner`) before its prefill: the
        TBT check over the running requests and the ones admitted before theirs arrived.
        The admission holds until rid's /internal/decode, a release by owner, or
        cluster.stage_ttl_s (the staged KV's own bound). Raises: DecodeRefused."""
        now = time.monotonic()
        self.admitted = {r: a for r, a in self.admitted.items() if a.until > now and r != rid}
        refusal = self._check(rid, tokens, self.admission.starts_in_s(tokens))
        if refusal is not None:
            raise DecodeRefused(refusal["error"], refusal)
        self.admitted[rid] = Admission(owner, tokens, now + self.settings.cluster.stage_ttl_s, now)

    def release(self, rid: str, owner: str | None = None) -> Any:
        """Withdraws rid's receive segment and admission (only if `owner`, when given, holds
        them); returns its buffer, or None. A release by `owner` that finds no buffer refuses
        that owner's reservation of rid for cluster.stage_ttl_s (it may still be in flight)."""
        a = self.admitted.get(rid)
        if a is not None and owner is not None and a.owner == owner:
            del self.admitted[rid]
        r = self.buffers.get(rid)
        if r is None and owner:
            self._released_early[(rid, owner)] = (time.monotonic()
                                                  + self.settings.cluster.stage_ttl_s)
        if r is None or (owner is not None and r.owner != owner):
            return None
        del self.buffers[rid]
        r.timer.cancel()
        with contextlib.suppress(Exception):
            self.transfer.unregister_segment(r.segment)
        return r.buf

    # ------------------------------------------------------------------ decode stream

    async def _kv_for(self, req: DecodeRequest) -> Any:
        """The request's KV (layer-major tensor): the pushed buffer, complete (the prefill
        node answered only after every WRITE), or a READ of the prefill node's stage.
        Any other buffer for rid (a push that failed part-way, another prefill node's
        attempt) goes. Raises: whatever the READ raises, or TimeoutError."""
        import torch  # noqa: PLC0415

        kv = req.kv
        r = self.buffers.get(req.rid)
        pushed_here = kv.pushed and r is not None and r.owner == req.prefill
        buf = self.release(req.rid)
        if pushed_here and buf is not None:
            self.counters.received_pushed += 1
            return buf
        await failpoints.ahit("decode.kv_read")    # tests: hold the READ (kill its source)
        t0 = time.monotonic()
        buf = torch.empty(list(kv.shape), dtype=getattr(torch, kv.dtype))
        seg = self.transfer.add_peer_segment(kv.descriptor)
        try:
            await asyncio.wait_for(self.transfer.read(seg, 0, buf),
                                   self.settings.transfer.request_timeout_s)
        finally:
            with contextlib.suppress(Exception):
                self.transfer.remove_peer_segment(seg)
        c = self.counters
        c.read += 1
        c.read_bytes += buf.numel() * buf.element_size()
        c.read_s += time.monotonic() - t0
        return buf

    async def route(self, request: web.Request) -> web.StreamResponse:
        """POST /internal/decode: DecodeRequest -> 200 with one JSON object a line:
        OutputDelta lines (the first with no token, when the request's first step
        begins: the API node sends the client the first token then), "{}" keep-alives
        every stream_idle_timeout_s / 3, or a DecodeFailure line. Answers 503 while
        draining, 400 for a malformed body, 502 when the KV cannot be read.
        """

        if self.ctx.draining():
            return web.json_response({"error": f"{self.node_id} is draining"}, status=503)
        try:
            req = DecodeRequest.from_json(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, MessageError) as e:
            return web.json_response({"error": f"bad decode request: {e}"}, status=400)
        rid = req.rid
        admitted = self.admitted.pop(rid, None)
        if admitted is None or admitted.owner != req.prefill:   # not admitted before its prefill
            refused = self._refuse(rid, len(req.prompt))     # as the conductor predicts it
            if refused is not None:
                return refused
        else:
            self.admission.observe_start(admitted.tokens, time.monotonic() - admitted.at)
        t0 = time.monotonic()
        try:
            buf = await self._kv_for(req)
        except Exception as e:  # noqa: BLE001 - TransferError, timeout: never decode on partial KV
            log.warning("kv_read_failed", request_id=rid, error=str(e))
            return web.json_response({"error": f"KV transfer from the prefill node failed: "
                                               f"{e}"}, status=502)
        self.ctx.spawn(release_on(self.client, req.prefill, Release(rid)))
        prompt = list(req.prompt)
        self.requests[rid] = len(prompt) + 1
        if req.params.max_tokens is not None:
            self.tokens_left[rid] = req.params.max_tokens - 1   # its first token came along
        self.activity.arrived.append(rid)
        log.debug("decode_admit", request_id=rid, kv_bytes=buf.numel() * buf.element_size(),
                  read_s=round(time.monotonic() - t0, 4))
        gen = self.engine.generate(prompt, req.params, rid, cache_salt=req.cache_salt,
                                   kv_import=KVImport(buf.permute(1, 0, 2, 3, 4, 5),
                                                      req.kv.num_tokens),
                                   first_token=req.first_token)
        return await self._stream(request, rid, gen)

    def _check(self, rid: str, tokens: int, starts_in_s: float = 0.0) -> dict | None:
        """The TBT admission check (cluster/admission.py) of rid with `tokens` prompt tokens
        over the running requests still decoding when rid is predicted to start,
        `starts_in_s` seconds from now (`still_decoding`; 0: a request here to decode, or
        a coupled node's), and the other admitted ones: None, or the refusal."""
        _, now_batch, now_context = self.load()
        batch, context = still_decoding(
            [(c, self.tokens_left.get(r)) for r, c in self.requests.items()],
            self.admission.step_s(now_batch, now_context), starts_in_s)
        waiting = [a for r, a in self.admitted.items() if r != rid and r not in self.requests]
        batch += len(waiting)
        context += sum(a.tokens + 1 for a in waiting)
        refusal = self.admission.check(batch, context, tokens, rid)
        if refusal is not None:
            log.info("decode_refused", request_id=rid, reason=refusal["reason"],
                     predicted_tbt_s=round(refusal["predicted_tbt_s"], 4), batch=batch)
        return refusal

    def _refuse(self, rid: str, tokens: int) -> web.Response | None:
        """The TBT admission check at /internal/decode (a request not admitted before its
        prefill) or /internal/generate: a 429 with Retry-After and the reason when this
        node's predicted step time with the request breaks the SLO."""
        refusal = self._check(rid, tokens)
        if refusal is None:
            return None
        return web.json_response(refusal, status=429, headers={
            "Retry-After": str(max(1, math.ceil(refusal["retry_after_s"])))})

    async def generate_route(self, request: web.Request) -> web.StreamResponse:
        """POST /internal/generate on a coupled node: GenerateRequest -> the stream of
        `route` (OutputDelta lines, keep-alives, a DecodeFailure line); 429 when the TBT
        admission check refuses, 503 while draining, 400 for a malformed body."""
        if self.ctx.draining():
            return web.json_response({"error": f"{self.node_id} is draining"}, status=503)
        try:
            req = GenerateRequest.from_json(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, MessageError) as e:
            return web.json_response({"error": f"bad generate request: {e}"}, status=400)
        rid, prompt = req.rid, list(req.prompt)
        refused = self._refuse(rid, len(prompt))
        if refused is not None:
            return refused
        self.requests[rid] = len(prompt)
        self.prompts[rid] = (len(prompt), 0)
        self.activity.arrived.append(rid)
        gen = self.engine.generate(prompt, req.params, rid, cache_salt=req.cache_salt)
        return await self._stream(request, rid, gen)

    def pending(self) -> dict[str, tuple[int, int]]:
        """Coupled node: rid -> (new, cached) tokens of prompts not yet prefilled (the
        report's prefill queue)."""
        return dict(self.prompts)

    async def _stream(self, request: web.Request, rid: str, gen: Any) -> web.StreamResponse:
        """Streams the engine generator's deltas as JSON lines (see `route`)."""

        q: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
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
        # when each token left (a continuation's start line stands for its first token,
        # which the API node sends with it): the request's TBT for the admission check
        sent_at: list[float] = []
        try:
            await resp.prepare(request)
            done = False
            while not done:
                try:
                    item = await asyncio.wait_for(q.get(), keepalive)
                except TimeoutError:
                    await resp.write(b"{}\n")
                    continue
                # Every delta queued meanwhile goes out in one write (one syscall, one
                # wake-up of the API node) rather than one write per token.
                items = [item]
                while not q.empty():
                    items.append(q.get_nowait())
                lines = []
                now = time.monotonic()
                for item in items:
                    if isinstance(item, Exception):
                        status = 400 if isinstance(item, InvalidRequest) else 500
                        failure = DecodeFailure(str(item), status, getattr(item, "param", None))
                        lines.append(orjson.dumps(failure.to_json()))
                        done = True
                        break
                    self.requests[rid] = self.requests.get(rid, 0) + len(item.new_token_ids)
                    if rid in self.tokens_left:
                        self.tokens_left[rid] -= len(item.new_token_ids)
                    self.tokens_out += len(item.new_token_ids)    # throughput.py
                    self.prompts.pop(rid, None)
                    if item.new_token_ids or not sent_at:     # a token, or the start line
                        sent_at += [now] * max(1, len(item.new_token_ids))
                    lines.append(orjson.dumps(OutputDelta.of(item).to_json()))
                    if item.finished:
                        done = True
                        break
                await resp.write(b"\n".join(lines) + b"\n")
                if done and getattr(item, "finish_reason", None) in ("stop", "length"):
                    self.admission.observe_tbt(rid, sent_at)
        except ConnectionResetError:
            log.info("decode_client_gone", request_id=rid)
        finally:
            task.cancel()    # closes the engine generator: the request is aborted, pages freed
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            self.requests.pop(rid, None)
            self.tokens_left.pop(rid, None)
            self.prompts.pop(rid, None)
        return resp

    def handlers(self) -> dict[str, Handler]:
        """node.kv_reserve (`reserve`)."""
        return {"node.kv_reserve": self.reserve}

    def queued(self) -> tuple[str, ...]:
        """(): a decode node holds no prefill waiting for its turn."""
        return ()

    def stalled(self) -> str | None:
        """None (its TBT check refuses what it cannot take: `admission`)."""
        return None

    def info(self) -> dict | None:
        """None: no role entry in the member record."""
        return None

    def status(self) -> RoleStatus:
        """Receive buffers reserved, and the TBT check's refusals and status."""
        return RoleStatus(receiving=len(self.buffers), refused=self.admission.refused,
                          admission=self.admission.status())

    def release_held(self, msg: Release) -> bool:
        """`node.release`: withdraws the receive buffer msg.owner reserved for msg.rid."""
        return self.release(msg.rid, msg.owner) is not None

    def load(self) -> tuple[list[str], int, int]:
        """(running request ids, their count, KV tokens they hold)."""
        return list(self.requests), len(self.requests), sum(self.requests.values())

    def close(self) -> None:
        """Withdraws every receive buffer (at shutdown)."""
        for rid in list(self.buffers):
            self.release(rid)


__all__ = ["Admission", "DecodeWorker", "ReceiveBuffer"]
