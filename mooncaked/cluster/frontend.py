"""The API node's side of the disaggregated request path (architecture.md, "The life of one
request"; Mooncake paper, Figure 3).

`ClusterFrontend` stands where the single-process server has its AsyncLLM: the
OpenAI API (mooncaked/api/server.py) calls `generate(prompt_ids, params, rid,
cache_salt)` and gets RequestOutput deltas. Per request:

1. block keys of the prompt (the engine's salt: model id, block size, KV dtype,
   cache_salt), then `conductor.place` on the leader -> prefill node p, decode
   node d, blocks p should fetch and from where; or a rejection, answered as
   HTTP 429 with Retry-After (early rejection, paper section 4 step 4), or as 400
   slo_unattainable without one when even an idle cluster would break the TTFT SLO;
2. `node.prefill` on p (one control call, bounded by the request's time): p
   loads the prefix; when the request's turn to compute comes, p asks d to admit
   it (d's TBT check, `node.kv_reserve`; with the push, the same call reserves
   d's receive buffer), and d's refusal comes back as the API's 429 before
   anything was computed; then p prefills while staging the KV layer by layer
   (all blocks, the partial last one included) and, with
   cluster.layerwise_kv_push, WRITEs each layer into that buffer while computing
   the next layer (cluster/kv_push.py); it answers with the first token once
   every WRITE is done. If p is dead or draining, the request is placed again
   without it;
3. POST /internal/decode on d, read with the node's RPC client (`port.stream`,
   wire/rpc.py `ControlClient.stream`: the token, pool and errors of the control
   calls): d takes the pushed KV (or READs p's stage when the push did not happen
   or failed), admits the request with kv_import + first_token (no second TBT
   check for a request it admitted before the prefill), and streams JSON lines
   back: first a line with no token when the request's first step begins on d,
   then d's tokens. The first token goes to the client with d's first line, as
   SGLang's and vLLM's decode servers stream every token: the client's first gap
   is one decode step, not the hand-over (the TTFT includes it instead). It is
   sent once, by this node; d's text starts after `engine.stop.held_back` of the
   first token's text, exactly the part sent here with it. If d cannot be
   reached before it produced anything, the decode side is placed again without
   it (the new node READs p's stage and checks the request on arrival).

Failures end the request with a clear error naming the node, and nothing waits
without a bound: place calls use cluster.rpc_timeout_s, the prefill call the
request's remaining time, the decode stream cluster.stream_idle_timeout_s of
silence (d sends keep-alives). Closing the generator (client gone) closes the
HTTP calls, which cancels the handlers on p and d, whose engines then abort the
request and free its KV; the staged KV is released on p at once (or after
cluster.stage_ttl_s at the latest).

A stream outlives its decode node (`generate`): a decode node that dies or goes
silent mid-stream gets the request placed again without it, with the prompt plus
the tokens already streamed as the new prompt; the client sees no error and no
repeated or missing token. A prefill node that dies mid-prefill is re-placed too
(MAX_PLACEMENTS).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from mooncaked.api.errors import ApiError
from mooncaked.engine.detokenizer import IncrementalDetokenizer
from mooncaked.engine.stop import held_back
from mooncaked.engine.types import EngineStats, InvalidRequest, RequestOutput, SamplingParams
from mooncaked.log import get_logger
from mooncaked.measures import tbt_s
from mooncaked.store.keys import block_keys, make_salt

from mooncaked.wire.errors import (BadReply, NotConnected, NotLeader, PeerUnavailable, RpcError,
                                   RpcTimeout)
from mooncaked.wire.messages import (DecodeFailure, DecodeRequest, GenerateRequest, MessageError,
                                     NodeRef, OutputDelta, PlaceRejected, PlaceReply, PlaceRequest,
                                     PrefillReply, PrefillRequest, Release)
from mooncaked.model.weights import resolve_model_path

log = get_logger(__name__)

MAX_PLACEMENTS = 3          # prefill attempts per request (dead or draining nodes are skipped)
MAX_DECODE_DISPATCHES = 2   # decode nodes tried per request before the first decode output
MAX_RESUMES = 2             # re-placements of a request whose decode node died mid-stream
DEFAULT_MAX_MODEL_LEN = 2048


class FrontendPort(Protocol):
    """What the front end needs of its node (ClusterNode implements it)."""

    settings: Any
    tokenizer: Any
    leader_id: str | None
    members: dict                # node id -> coord_records.Member (its info has "role")

    def conductor_not_ready(self) -> str | None: ...
    def model_info(self) -> dict | None: ...
    def max_model_len(self) -> int | None: ...
    def engine_stats(self) -> EngineStats | None: ...
    async def place(self, req: PlaceRequest, timeout_s: float) -> PlaceReply | PlaceRejected: ...
    async def wait_leader_change(self, timeout_s: float) -> None: ...
    async def call_prefill(self, target: NodeRef, req: PrefillRequest, timeout_s: float
                           ) -> PrefillReply: ...
    def stream(self, target: NodeRef, path: str, payload: dict, total_s: float
               ) -> AsyncIterator[Any]: ...
    async def release(self, addr: str, msg: Release) -> None: ...
    def spawn(self, coro: Any) -> Any: ...
    def serving(self) -> contextlib.AbstractContextManager: ...
    def observed_ttft(self, rid: str, seconds: float) -> None: ...
    def observed_tbt(self, rid: str, seconds: float) -> None: ...


class Overloaded(ApiError):
    """An early rejection: HTTP 429 with Retry-After (whole seconds, rounded up) when the
    predicted TTFT or TBT breaks its SLO or a resource is short now (reason names it:
    "decode_full" the decode node's KV, "decode_receive_buffers_full" its receive
    buffers, "ttft_slo" the prefill queue); 503 with Retry-After when no prefill or
    decode node is available at all. The message gives the prediction that broke the
    SLO, or `detail` (the node and resource)."""

    def __init__(self, reason: str, retry_after_s: float, predicted_ttft_s: float | None = None,
                 predicted_tbt_s: float | None = None, detail: str | None = None):
        if reason.startswith("no_"):
            why = f"{detail} ({reason})" if detail else reason
            super().__init__(503, f"no node can serve this request now: {why}",
                             type="server_error", code="no_capacity")
        else:
            msg = f"the cluster cannot serve this request within its SLO now ({reason})"
            if reason == "ttft_slo" and predicted_ttft_s is not None:
                msg += f"; predicted TTFT {predicted_ttft_s:.2f} s"
            elif reason in ("tbt_slo", "decode_full") and predicted_tbt_s is not None:
                msg += f"; predicted TBT {predicted_tbt_s:.3f} s"
            if detail:
                msg += f"; {detail}"
            super().__init__(429, msg, type="rate_limit_error", code="overloaded")
        self.reason, self.retry_after_s = reason, retry_after_s
        self.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


class SloUnattainable(ApiError):
    """A request over the TTFT SLO even on an idle cluster (the conductor's reason
    "ttft_slo_unattainable", conductor/attainable.py): HTTP 400, code slo_unattainable,
    no Retry-After (OpenAI clients retry 429s; waiting cannot help this one). The message
    says why and the longest prompt that would pass."""

    def __init__(self, n: int, ttft_slo_s: float, predicted_ttft_s: float | None,
                 max_prompt_tokens: int | None):
        pred = f"predicted TTFT {predicted_ttft_s:.2f} s" if predicted_ttft_s is not None \
            else "its predicted TTFT is over it"
        fits = (f"the longest prompt that would meet it is {max_prompt_tokens} tokens"
                if max_prompt_tokens else "no prompt would meet it")
        super().__init__(400, f"this request cannot meet the TTFT SLO ({ttft_slo_s:g} s) even "
                              f"on an idle cluster: {n} prompt tokens, {pred}; {fits}. "
                              f"Retrying will not help: shorten the prompt.",
                         param="prompt", code="slo_unattainable")
        self.max_prompt_tokens = max_prompt_tokens


class ClusterFrontend:
    """The engine-shaped front of the cluster for the API server (see the module doc).

    Attributes used by the API: tokenizer, model_name, max_model_len, max_logprobs,
    generate(), abort(), stats().
    """

    def __init__(self, port: FrontendPort):
        self.port = port
        s = port.settings
        self.tokenizer = port.tokenizer
        self.request_timeout_s = s.server.request_timeout_s
        self._model_name = s.server.served_model_name

    # ------------------------------------------------------------------ engine-like surface

    @property
    def model_name(self) -> str:
        """Served model name: server.served_model_name, else the model file's stem."""
        if self._model_name:
            return self._model_name
        m = self.port.model_info()
        if m:
            return m["name"]
        return resolve_model_path(self.port.settings.model.path).stem

    @property
    def max_model_len(self) -> int:
        """Smallest context of the model nodes (tokens)."""
        return self.port.max_model_len() or DEFAULT_MAX_MODEL_LEN

    @property
    def max_logprobs(self) -> int:
        """Largest top_logprobs a request may ask for."""
        return self.port.settings.engine.max_logprobs

    def not_ready(self) -> str | None:
        """Why this node cannot serve a request end to end now, or None when it can: it
        must have joined, see a conductor (leader) and a prefill and a decode node (or a
        coupled one), and that conductor must say it would place a request now (its
        answer to this node's last report: it has their reports). api/health.py answers
        /health with it."""
        port = self.port
        if not port.members:
            return "this node has not joined the cluster yet"
        if port.leader_id is None:
            return "no conductor (leader) has been elected yet"
        roles = {m.info.get("role") for m in port.members.values()}
        missing = [r for r in ("prefill", "decode") if r not in roles]
        if missing and "all" not in roles:
            return f"no {' and no '.join(missing)} node has joined the cluster"
        # Joined is not enough: the conductor must have their reports, or it answers 503.
        return port.conductor_not_ready()

    def abort(self, request_id: str) -> None:
        """No-op: closing the `generate` iterator cancels the remote calls, which aborts the
        request on the prefill and decode nodes."""

    def stats(self) -> EngineStats:
        """This node's engine counters (zeros on a node without a model)."""
        return self.port.engine_stats() or EngineStats(0, 0, 0, 0, 0, 0, 0)

    # ------------------------------------------------------------------ the request path

    def block_keys(self, prompt: list[int], cache_salt: str | None) -> list[bytes]:
        """The prompt's block keys exactly as the model nodes' engines key them."""
        m = self.port.model_info()
        if m is None:
            raise ApiError(503, "no model node has joined the cluster yet", type="server_error",
                           code="service_unavailable")
        salt = make_salt(m["model_id"], int(m["block_size"]), m["kv_dtype"], cache_salt)
        return block_keys(prompt, int(m["block_size"]), salt)

    async def _place(self, req: PlaceRequest, deadline: float) -> PlaceReply:
        """conductor.place on the leader, waiting for a leader while there is none, at
        most cluster.placement_wait_s (and the request's `deadline`).
        Raises Overloaded, or ApiError 503 (with Retry-After when no conductor placed it)."""
        cs = self.port.settings.cluster
        timeout = cs.rpc_timeout_s
        # Without a conductor, wait a bounded while (an election takes about a lease
        # time), not the request's whole time: then 503 and Retry-After.
        wait_s = cs.placement_wait_s
        deadline = min(deadline, time.monotonic() + wait_s)
        last = "no conductor has been elected"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                err = ApiError(503, f"no conductor placed the request within {wait_s:g} s "
                               f"(cluster.placement_wait_s): {last}",
                               type="server_error", code="no_conductor")
                err.headers = {"Retry-After": str(max(1, math.ceil(cs.lease_ttl_s)))}
                raise err
            try:
                r = await self.port.place(req, min(remaining, timeout))
            except NotLeader as e:
                last = str(e)
            except (PeerUnavailable, RpcTimeout) as e:
                last = f"conductor {self.port.leader_id} unavailable: {e}"
            except RpcError as e:
                raise ApiError(500, f"placement failed: {e}", type="server_error") from e
            else:
                if isinstance(r, PlaceRejected) and r.reason == "ttft_slo_unattainable":
                    raise SloUnattainable(req.prompt_tokens,
                                          self.port.settings.conductor.ttft_slo_s,
                                          r.predicted_ttft_s, r.max_prompt_tokens)
                if isinstance(r, PlaceRejected):
                    raise Overloaded(r.reason, r.retry_after_s, r.predicted_ttft_s,
                                     r.predicted_tbt_s, r.detail)
                return r
            log.info("place_retry", reason=last)
            # The leader died or moved: wait (bounded) for the election to settle.
            await self.port.wait_leader_change(min(max(0.0, deadline - time.monotonic()), 1.0))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Runs one request through prefill node and decode node; yields output deltas.

        A stream outlives its decode node: when the decode node dies (its stream breaks
        or goes silent) the request is placed again without it, with the prompt plus
        every token already streamed as the new prompt (the prefix cache makes that
        prefill cheap), and the stream continues from the next token, at most
        MAX_RESUMES times. The text after a resume is detokenized here over the whole
        output (stop strings spanning the resume point still stop it). Greedy output
        equals an undisturbed run's, and so does seeded sampling's: the streamed tokens
        count as output (SamplingParams.output_offset) for the per-position seed, the
        penalties and a structured-output constraint.

        Raises: Overloaded (429) on an early rejection; InvalidRequest for a prompt or
        parameter a node refuses; ApiError 502/503/504 when the nodes fail or time out
        (with the node's id in the message).
        """
        n = len(prompt_token_ids)
        produced: list[int] = []       # output token ids the client has
        sent = 0                       # characters of text the client has
        exclude: tuple[str, ...] = ()
        det: IncrementalDetokenizer | None = None
        cached = 0
        for resume in range(MAX_RESUMES + 1):
            p = params
            if produced:
                # The streamed tokens are output, not prompt: seeded draws and penalties
                # continue at their positions (SamplingParams.output_offset).
                # (the prompt logprobs came with the first token: not again)
                p = dataclasses.replace(params, output_offset=params.output_offset + len(produced),
                                        prompt_logprobs=None)
                if params.max_tokens is not None:
                    p.max_tokens = params.max_tokens - len(produced)
                det = IncrementalDetokenizer(self.tokenizer, params.stop,
                                             params.include_stop_str_in_output)
                for t in produced:     # the text up to here; the client has `sent` chars
                    det.add(t)
                det.sent = min(sent, len(det.text))
            attempt = self._attempt(prompt_token_ids + produced, p, request_id, cache_salt,
                                    exclude)
            try:
                async with contextlib.aclosing(attempt):
                    async for out in attempt:
                        if resume == 0:
                            cached = out.num_cached_tokens
                        if det is not None:   # resumed: text over the whole output
                            out.new_text = "".join(det.add(t) for t in out.new_token_ids)
                            if det.stopped is not None:
                                out.finished, out.finish_reason = True, "stop"
                                out.stop_reason = det.stopped
                            elif out.finished:
                                out.new_text += det.flush()
                        produced.extend(out.new_token_ids)
                        sent += len(out.new_text)
                        out.num_prompt_tokens, out.num_cached_tokens = n, cached
                        out.num_output_tokens = len(produced)
                        yield out
                        if out.finished:
                            return
                return
            except _DecodeLost as e:
                if resume >= MAX_RESUMES:
                    raise ApiError(502, f"the stream broke ({e}) and the request was resumed "
                                        f"{MAX_RESUMES} times already", type="server_error",
                                   code="decode_failed") from e
                if e.node_failed:
                    exclude = (*exclude, e.node)
                log.warning("stream_resumed", request_id=request_id, node=e.node,
                            tokens=len(produced), reason=str(e))

    async def _attempt(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, cache_salt: str | None, exclude: tuple[str, ...]
                       ) -> AsyncIterator[RequestOutput]:
        """One placement, prefill and decode of the request; yields output deltas.
        Raises _DecodeLost when the decode node dies after the first token (see
        `generate`), and what `generate` raises."""
        port = self.port
        # A drained node's API keeps serving as a front end (placement avoids its engine);
        # at shutdown the API server itself refuses new requests.
        staged: tuple[str, Release] | None = None    # the prefill node's stage, to release
        unsent: RequestOutput | None = None          # the first token, held (see step 3)
        pushed: tuple[str, Release] | None = None    # the decode node's receive buffer
        # one info line at the end; the TTFT goes to the conductor (its overhead term)
        done = _RequestLine(request_id, len(prompt_token_ids), port.observed_ttft,
                            port.observed_tbt)
        with port.serving():
            try:
                deadline = time.monotonic() + self.request_timeout_s
                keys = self.block_keys(prompt_token_ids, cache_salt)
                n = len(prompt_token_ids)
                max_new = params.max_tokens if params.max_tokens is not None \
                    else max(0, self.max_model_len - n)
                can_continue = max_new > 1 and n + 1 < self.max_model_len
                place_req = PlaceRequest(request_id, tuple(keys), n, max_new, exclude=exclude)
                pre = pl = None
                replaced: list[str] = []     # why nodes refused this request (e.g. draining)
                for _ in range(MAX_PLACEMENTS):
                    try:
                        pl = await self._place(place_req, deadline)
                    except Overloaded as e:
                        # The conductor may not know yet why the nodes we excluded refused
                        # (a drain it has not heard of): say what they told us.
                        if replaced and e.reason.startswith("no_"):
                            raise Overloaded(e.reason, e.retry_after_s,
                                             detail="; ".join(replaced)) from e
                        raise
                    done.placed(pl)
                    if pl.prefill.node == pl.decode.node:      # a coupled node: all of it there
                        gen = self._coupled(pl, prompt_token_ids, params, request_id, cache_salt,
                                            deadline)
                        async with contextlib.aclosing(gen):
                            async for out in gen:
                                out.num_prompt_tokens = n
                                done.token(out.num_cached_tokens, len(out.new_token_ids),
                                           out.finished)
                                yield out
                        return
                    try:
                        pre = await self._prefill(pl, prompt_token_ids, params, request_id,
                                                  cache_salt, can_continue, deadline)
                        break
                    except _Replace as e:
                        log.warning("prefill_replaced", request_id=request_id,
                                    node=pl.prefill.node, reason=str(e))
                        replaced.append(e.reason)
                        # a receive buffer the failed node (or CPP stage 0) reserved on the
                        # decode node is freed now, not at its TTL
                        port.spawn(port.release(pl.decode.control,
                                                Release(request_id, pl.prefill.control)))
                        place_req = dataclasses.replace(
                            place_req, exclude=(*place_req.exclude, pl.prefill.node))
                if pre is None:
                    raise ApiError(503, f"no prefill node could run the request (tried "
                                        f"{', '.join(place_req.exclude)})", type="server_error",
                                   code="prefill_unavailable")
                if pre.kv is not None:
                    staged = (pl.prefill.control, Release(request_id))
                    if pre.kv.pushed:
                        # until the decode node admits, its receive buffer is ours to free
                        pushed = (pl.decode.control, Release(request_id, pl.prefill.control))
                first = pre.output
                cached = first.num_cached_tokens
                finished = pre.kv is None
                first_text = first.text if finished else held_back(first.text, params.stop)
                out = first.to_output(request_id, text=first_text)
                if not finished:
                    out.finished, out.finish_reason, out.stop_reason = False, None, None
                out.num_prompt_tokens, out.num_output_tokens = n, 1
                if finished:
                    done.token(cached, 1, finished)
                    yield out
                    return
                # The first token goes out when the decode node begins the request's first
                # step (its first line), as SGLang's and vLLM's decode servers stream every
                # token: the client's first gap is then one decode step, not the hand-over
                # (this call, the KV import, the wait for a step boundary).
                unsent = out
                # aclosing: when the client goes away, the decode stream closes now, not at GC.
                dec = self._decode(pl, pre, prompt_token_ids, params, request_id, cache_salt,
                                   place_req, deadline)
                async with contextlib.aclosing(dec):
                    async for out in dec:
                        staged = pushed = None       # the decode node admitted it: all released
                        if unsent is not None:
                            done.token(cached, 1, False)
                            yield unsent
                            unsent = None
                        if not out.new_token_ids and not out.finished:
                            continue                 # the start line: no token
                        out.num_prompt_tokens, out.num_cached_tokens = n, cached
                        done.token(cached, len(out.new_token_ids), out.finished)
                        yield out
            except _DecodeLost as e:
                if unsent is not None:    # the prefill's token stands: the resume follows it
                    done.token(cached, 1, False)
                    yield unsent
                if e.node_failed:        # the dead node's buffer; the stage expires (stage_ttl_s)
                    staged = pushed = None
                raise
            finally:
                done.log()
                for held in (staged, pushed):
                    if held is not None:
                        port.spawn(port.release(*held))

    async def _prefill(self, pl: PlaceReply, prompt: list[int], params: SamplingParams, rid: str,
                       cache_salt: str | None, can_continue: bool, deadline: float
                       ) -> PrefillReply:
        p = pl.prefill
        remaining = deadline - time.monotonic()
        push = can_continue and self.port.settings.cluster.layerwise_kv_push
        req = PrefillRequest(rid, tuple(prompt), params, cache_salt, pl.fetch, pl.prefix_tokens,
                             stage=can_continue, push_to=pl.decode.control if push else None,
                             ttl_s=remaining,
                             admit_at=pl.decode.control if can_continue else None)
        try:
            return await self.port.call_prefill(p, req, max(0.1, remaining))
        except PeerUnavailable as e:
            raise _Replace(f"prefill node {p.node} unavailable: {e}") from e
        except RpcTimeout as e:
            raise ApiError(504, f"prefill node {p.node} did not answer within the request's "
                                f"time", type="server_error", code="timeout") from e
        except RpcError as e:
            if e.remote_type in ("NodeDraining", "StageFailure"):   # StageFailure: a CPP group
                raise _Replace(str(e), e.remote_message or f"{p.node} is draining") from e
            if e.remote_type == "InvalidRequest":
                raise InvalidRequest(e.remote_message, e.remote_param) from e
            if e.remote_type == "DecodeRefused":      # d's TBT check, before p computed
                raise _refused(e.remote_detail or {}, pl.decode.node) from e
            if e.remote_type == "ReceiveBuffersFull":     # load on the decode node: say so
                raise Overloaded("decode_receive_buffers_full",
                                 self.port.settings.conductor.min_retry_after_s,
                                 detail=e.remote_message) from e
            raise ApiError(502, f"prefill on node {p.node} failed: {e}",
                           type="server_error", code="prefill_failed") from e
        except MessageError as e:
            raise ApiError(502, f"prefill node {p.node} sent a malformed reply: {e}",
                           type="server_error", code="bad_reply") from e

    async def _deltas(self, node: NodeRef, path: str, body: dict, deadline: float, who: str
                      ) -> AsyncIterator[OutputDelta]:
        """The OutputDelta lines of one node stream (`port.stream`, keep-alives skipped);
        `who` names the node's part in messages ("decode node").
        Raises: InvalidRequest (a failure line with status 400); ApiError 502 naming the
        node for another failure line or a malformed line, 500 for an engine error; the
        stream's RpcError for the caller to map (its status, a timeout, the peer gone)."""
        lines = self.port.stream(node, path, body, max(0.1, deadline - time.monotonic()))
        async with contextlib.aclosing(lines):
            async for raw in lines:
                failure, o = _stream_line(raw, node.node)
                if failure is not None:
                    if failure.status == 400:
                        raise InvalidRequest(failure.error, failure.param)
                    raise ApiError(502, f"{who} {node.node} failed: {failure.error}",
                                   type="server_error", code="decode_failed")
                if o.error:
                    raise ApiError(500, f"engine error on {who} {node.node}: {o.error}",
                                   type="server_error")
                yield o

    async def _coupled(self, pl: PlaceReply, prompt: list[int], params: SamplingParams,
                       rid: str, cache_salt: str | None, deadline: float
                       ) -> AsyncIterator[RequestOutput]:
        """The whole request on one coupled node (POST /internal/generate): its deltas.
        Raises: Overloaded when the node refuses (429); InvalidRequest; ApiError 502/504."""
        cs = self.port.settings.cluster
        node = pl.prefill
        body = GenerateRequest(rid, tuple(prompt), params, cache_salt).to_json()
        deltas = self._deltas(node, "/internal/generate", body, deadline, "coupled node")
        try:
            async with contextlib.aclosing(deltas):
                async for o in deltas:
                    yield o.to_output(rid)
                    if o.finished:
                        return
            raise ApiError(502, f"coupled node {node.node} ended the stream before the "
                                f"request finished", type="server_error", code="decode_failed")
        except BadReply as e:
            raise _bad_line(node.node, e) from e
        except RpcTimeout as e:
            raise ApiError(504, f"coupled node {node.node} sent nothing for "
                                f"{cs.stream_idle_timeout_s} s", type="server_error",
                           code="timeout") from e
        except RpcError as e:
            if e.status == 429:
                raise _refused(e.body, node.node) from e
            if e.status:
                raise ApiError(502 if e.status != 503 else 503, f"coupled node {node.node} "
                               f"refused the request (HTTP {e.status}): {e.remote_message}",
                               type="server_error", code="decode_failed") from e
            raise ApiError(502, f"coupled node {node.node} failed: {e}",
                           type="server_error", code="decode_failed") from e

    async def _decode(self, pl: PlaceReply, pre: PrefillReply, prompt: list[int],
                      params: SamplingParams, rid: str, cache_salt: str | None,
                      place_req: PlaceRequest, deadline: float
                      ) -> AsyncIterator[RequestOutput]:
        """The decode node's deltas (POST /internal/decode; the first token is not among
        them). Raises: _DecodeLost (resume), Overloaded (429), InvalidRequest, ApiError."""
        params = dataclasses.replace(params, prompt_logprobs=None)   # the prefill node's part
        body = DecodeRequest(rid, tuple(prompt), pre.output.ids[0], params, pre.kv,
                             pl.prefill.control, cache_salt).to_json()
        cs = self.port.settings.cluster
        d = pl.decode
        exclude = list(place_req.exclude)
        for attempt in range(MAX_DECODE_DISPATCHES):
            produced = False
            deltas = self._deltas(d, "/internal/decode", body, deadline, "decode node")
            try:
                async with contextlib.aclosing(deltas):
                    async for o in deltas:
                        produced = True
                        yield o.to_output(rid)
                        if o.finished:
                            return
                raise _DecodeLost(d.node, "it ended the stream before the request finished")
            except BadReply as e:
                raise _bad_line(d.node, e) from e
            except RpcTimeout as e:
                if time.monotonic() < deadline:   # silent past the idle timeout: hung or dead
                    raise _DecodeLost(d.node, f"it sent nothing for "
                                              f"{cs.stream_idle_timeout_s} s") from e
                raise ApiError(504, f"decode node {d.node} sent nothing for "
                                    f"{cs.stream_idle_timeout_s} s", type="server_error",
                               code="timeout") from e
            except RpcError as e:
                if isinstance(e, NotConnected):     # d never saw the request: try another
                    why = str(e)
                elif e.status == 429:
                    raise _refused(e.body, d.node) from e
                elif e.status == 503 and attempt + 1 < MAX_DECODE_DISPATCHES:
                    why = f"decode node {d.node} is draining"
                elif e.status == 502:
                    # It could not READ the staged KV (the prefill node died after its
                    # prefill, or the transfer failed): the client has the first token;
                    # resume from there, the decode node is fine.
                    raise _DecodeLost(d.node, f"it could not read the KV staged on "
                                              f"{pl.prefill.node}: {e.remote_message}",
                                      node_failed=False) from e
                elif e.status:
                    raise ApiError(502, f"decode node {d.node} refused the request "
                                        f"(HTTP {e.status}): {e.remote_message}",
                                   type="server_error", code="decode_failed") from e
                else:                       # the connection broke, before or after a line
                    raise _DecodeLost(d.node, str(e)) from e
                if produced or attempt + 1 >= MAX_DECODE_DISPATCHES:
                    raise ApiError(502, f"decode node {d.node} unavailable: {why}",
                                   type="server_error", code="decode_failed") from e
                log.warning("decode_replaced", request_id=rid, node=d.node, reason=why)
                if pre.kv.pushed:           # the new node READs the staged KV
                    self.port.spawn(self.port.release(d.control,
                                                      Release(rid, pl.prefill.control)))
                exclude.append(d.node)
                pl2 = await self._place(dataclasses.replace(place_req, exclude=tuple(exclude),
                                                            decode_only=True), deadline)
                d = pl2.decode


def _stream_line(raw: Any, node: str) -> tuple[DecodeFailure | None, OutputDelta | None]:
    """One line of a node's output stream (a JSON value): (its failure, None) or (None, its
    delta). Raises: ApiError 502 (code bad_reply) naming the node and the field when the
    line is not a message, never a 500."""
    try:
        failure = DecodeFailure.from_line(raw)
        return (failure, None) if failure is not None else (None, OutputDelta.from_json(raw))
    except MessageError as e:
        raise _bad_line(node, e) from e


def _bad_line(node: str, e: Exception) -> ApiError:
    """A line of a node's stream that is not JSON or not a message: 502, code bad_reply."""
    return ApiError(502, f"node {node} sent a malformed output line: {e}",
                    type="server_error", code="bad_reply")


class _RequestLine:
    """The `request_done` info line of one request (issue: one line per finished request):
    id, chosen prefill and decode nodes, prompt, cached and output tokens, TTFT and TBT
    (mean gap between output tokens after the first, seconds), as this API node saw them.
    `on_first(rid, ttft_s)` runs when the first token arrives; `on_tbt(rid, tbt_s)` when
    a request finished with two tokens or more, with its TBT as sent (measures.tbt_s)."""

    def __init__(self, rid: str, prompt_tokens: int,
                 on_first: Callable[[str, float], None] | None = None,
                 on_tbt: Callable[[str, float], None] | None = None):
        self.rid, self.prompt_tokens, self.on_first = rid, prompt_tokens, on_first
        self.on_tbt = on_tbt
        self.sent_at: list[float] = []      # when each token went out (monotonic)
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last = self.t0
        self.cached = self.output = 0
        self.prefill = self.decode = None
        self.finished = False

    def placed(self, pl: PlaceReply) -> None:
        self.prefill, self.decode = pl.prefill.node, pl.decode.node

    def token(self, cached: int, n: int, finished: bool) -> None:
        now = time.monotonic()
        if self.first is None and n:
            self.first = now
            if self.on_first is not None:
                self.on_first(self.rid, now - self.t0)
        self.last, self.cached, self.finished = now, cached, finished
        self.output += n
        self.sent_at += [now] * n

    def log(self) -> None:
        if self.finished and self.on_tbt is not None and len(self.sent_at) >= 2:
            self.on_tbt(self.rid, tbt_s(self.sent_at))
        ttft = None if self.first is None else round(self.first - self.t0, 4)
        tbt = round((self.last - self.first) / (self.output - 1), 4) \
            if self.first is not None and self.output > 1 else None
        log.info("request_done", request_id=self.rid, prefill=self.prefill, decode=self.decode,
                 prompt_tokens=self.prompt_tokens, cached_tokens=self.cached,
                 output_tokens=self.output, ttft_s=ttft, tbt_s=tbt,
                 status="finished" if self.finished else "aborted")


def _refused(body: dict, node: str) -> Overloaded:
    """A node's 429 (its TBT admission check, cluster/admission.py; `body` its refusal) as
    the API's 429."""
    log.info("node_refused", node=node, reason=body.get("reason"),
             predicted_tbt_s=body.get("predicted_tbt_s"))
    return Overloaded(str(body.get("reason") or "tbt_slo"), float(body.get("retry_after_s") or 1.0),
                      predicted_tbt_s=body.get("predicted_tbt_s"))


class _Replace(Exception):
    """The chosen node cannot take the request (dead, draining): place it again without it.
    `reason`: the short cause for a client ("p1 is draining"); defaults to the message."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


class _DecodeLost(Exception):
    """The decode stream broke (before or after the first token went out): `generate`
    resumes the request (prompt plus the tokens streamed) on a new placement.
    node_failed: the decode node died or hung (excluded from the new placement); False:
    the KV hand-over failed (the prefill node's stage could not be read), so any node may
    serve the rest."""

    def __init__(self, node: str, reason: str, node_failed: bool = True):
        super().__init__(f"decode node {node} lost: {reason}" if node_failed
                         else f"decode node {node}: {reason}")
        self.node, self.node_failed = node, node_failed


__all__ = ["ClusterFrontend", "FrontendPort", "Overloaded"]
