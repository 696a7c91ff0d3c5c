"""The OpenAI-compatible HTTP API (aiohttp) in front of an EngineClient (engine_client.py:
an AsyncLLM in one process, a ClusterFrontend on a cluster node).

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming over SSE
and not), GET /v1/models, GET /v1/models/{model}, GET /health (readiness), GET /livez
(liveness), GET /metrics, and vLLM's POST /tokenize and /detokenize.
Response and chunk shapes follow the OpenAI API reference; `usage` carries
`prompt_tokens_details.cached_tokens` (prompt tokens served from the prefix
cache). Every error, including unknown routes (404), wrong methods (405) and
oversized bodies (413), is answered with OpenAI's error body; an unexpected
failure is a 500 with an error body and the server keeps serving.

Each choice of a request is one engine request. When the client goes away the
handler is cancelled (aiohttp's handler_cancellation, which the daemon turns
on) or its next write fails; either way the engine generators are closed and
the requests aborted, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import web

from mooncaked.engine.types import InvalidRequest, RequestOutput, SamplingParams, TokenLogprob
from mooncaked.log import get_logger

from . import sse
from .engine_client import EngineClient
from .health import health_status, livez_status
from .logprobs import (TextOffset, chat_logprobs, completion_logprobs, echo_logprobs,
                       prompt_logprobs_field)
from .metrics import ApiMetrics
from mooncaked.stall_metrics import attach as attach_node_metrics, node_metrics
from .errors import ApiError, error_body
from .protocol import (GenerationRequest, Prompt, check_model, parse_chat,
                       parse_completion, parse_json, token_ids)
from .structured import ToolStream, chat_message

log = get_logger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024   # a 128k-token prompt as a JSON id list is about 1 MB
SERVER_KEY: web.AppKey["ApiServer"] = web.AppKey("mooncaked_api", object)  # type: ignore[arg-type]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)


# ---------------------------------------------------------------------------- one choice


@dataclasses.dataclass
class _Choice:
    """What one choice (one engine request) has produced so far."""

    index: int
    prompt: Prompt
    request_id: str
    params: SamplingParams
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)
    counted_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None   # with the first output

    def add(self, out: RequestOutput, now: float) -> None:
        """Folds one engine delta in. A delta with k tokens (outputs coalesced while the
        API was busy) spreads their arrival times evenly since the previous token, so
        per-token latency is not skewed by zero gaps."""
        k = len(out.new_token_ids)
        if k:
            prev = self.token_times[-1] if self.token_times else now
            self.token_times.extend(prev + (now - prev) * (j + 1) / k for j in range(k))
        self.text.append(out.new_text)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.counted_tokens += k
        # the engine's running total when it gives one, else what the deltas carried
        self.num_output_tokens = max(out.num_output_tokens, self.counted_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


class _Run:
    """The engine requests behind one API request, their outputs merged into one stream.

    Each choice is pumped by its own task into one queue, so n > 1 and prompt batches
    interleave as the engine produces them. `close()` must be awaited (finally): it
    cancels the pumps (closing the engine generators, which aborts their requests),
    aborts anything unfinished, and records metrics.
    """

    def __init__(self, engine: EngineClient, req: GenerationRequest, request_id: str,
                 arrival_s: float, metrics: ApiMetrics):
        self.engine, self.req, self.arrival_s, self.metrics = engine, req, arrival_s, metrics
        self.choices: list[_Choice] = []
        for p_idx, prompt in enumerate(req.prompts):
            for i in range(req.n):
                params = dataclasses.replace(req.params, stop=list(req.params.stop),
                                             stop_token_ids=list(req.params.stop_token_ids))
                if params.seed is not None:
                    params.seed += i          # n choices differ, yet stay reproducible
                idx = p_idx * req.n + i
                self.choices.append(_Choice(idx, prompt, f"{request_id}-{idx}", params))
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(c)) for c in self.choices]

    async def _pump(self, c: _Choice) -> None:
        gen = self.engine.generate(c.prompt.token_ids, c.params, c.request_id,
                                   cache_salt=self.req.cache_salt)
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    self._queue.put_nowait((c, out, None))
                    if out.finished:
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it
            self._queue.put_nowait((c, None, e))

    async def outputs(self) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Yields (choice, delta) until every choice has finished.

        Raises: InvalidRequest from the engine (before any output of that choice),
            ApiError 500 for an engine failure.
        """
        pending = len(self.choices)
        while pending:
            c, out, err = await self._queue.get()
            if err is not None:
                c.finish_reason = "error"
                if isinstance(err, (InvalidRequest, ApiError)):
                    raise err
                log.error("engine_error", request_id=c.request_id, error=repr(err))
                raise ApiError(500, f"engine error: {err}", type="server_error") from err
            if out.error:
                c.finish_reason = "error"
                log.error("engine_error", request_id=c.request_id, error=out.error)
                raise ApiError(500, f"engine error: {out.error}", type="server_error")
            c.add(out, time.monotonic())
            yield c, out
            if out.finished:
                pending -= 1

    async def close(self) -> None:
        """Stops what still runs, aborts unfinished engine requests, records metrics."""
        for t in self._tasks:
            if not t.done():
                t.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            # A client that goes away can cancel the handler here too, after its
            # ConnectionResetError: the aborts and the metrics must not be skipped.
            self._settle()

    def _settle(self) -> None:
        """Aborts the unfinished engine requests and records each choice's metrics."""
        for c in self.choices:
            if not c.finished:
                with contextlib.suppress(Exception):
                    self.engine.abort(c.request_id)
            self.metrics.observe_request(self.arrival_s, c.token_times,
                                         c.finish_reason or "abort", c.num_output_tokens)
        n = self.req.n
        for i, prompt in enumerate(self.req.prompts):  # once per prompt, as in usage()
            if any(c.token_times for c in self.choices[i * n:(i + 1) * n]):
                self.metrics.observe_prompt(len(prompt.token_ids))

    def usage(self) -> dict:
        """OpenAI `usage`; the prompt counts once per prompt, not once per choice."""
        n = self.req.n
        prompt_tokens = sum(len(p.token_ids) for p in self.req.prompts)
        cached = sum(self.choices[i * n].num_cached_tokens for i in range(len(self.req.prompts)))
        # echo with max_tokens 0: the one token run is not answered, so not counted
        completion = 0 if self.req.echo_only else sum(c.num_output_tokens for c in self.choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------------------- the server


class ApiServer:
    """HTTP handlers over one engine.

    Args:
        engine: the EngineClient to serve (tokenizer, model_name, max_model_len,
            max_logprobs, generate, abort, stats): an AsyncLLM or a ClusterFrontend.
        request_timeout_s: upper bound on one request's generation, seconds.
    """

    def __init__(self, engine: EngineClient, request_timeout_s: float = 600.0,
                 client_max_size: int = MAX_BODY_BYTES):
        self.engine = engine
        self.client_max_size = client_max_size
        self.request_timeout_s = request_timeout_s
        self.metrics = ApiMetrics(engine.stats)
        self.draining = False
        self.created = int(time.time())
        # A cluster node's health decision (cluster/health.py): () -> (status, body).
        self.health_check: Callable[[], tuple[int, dict]] | None = None

    def begin_drain(self) -> None:
        """Refuses new generation requests (503) and reports /health as 503."""
        self.draining = True

    # ------------------------------------------------------------------ small routes

    async def health(self, request: web.Request) -> web.Response:
        """GET /health (readiness): 200 {"status": "ok"} when this node can serve a request
        end to end, else 503 with a JSON reason. A cluster node's own state comes first
        (cluster/health.py: draining, coordinator outage, no conductor), then whether its
        engine can serve (api/health.py: the front end needs live prefill and decode nodes)."""
        node_body: dict | None = None
        if self.health_check is not None:
            status, node_body = self.health_check()
            if status != 200:
                return json_response(node_body, status=status)
        status, body = health_status(self.engine, self.draining)
        if status == 200 and node_body is not None:
            body = node_body
        return json_response(body, status=status)

    async def livez(self, request: web.Request) -> web.Response:
        """GET /livez (liveness): 200 as soon as the process serves HTTP."""
        status, body = livez_status()
        return json_response(body, status=status)

    def _model_card(self) -> dict:
        return {"id": self.engine.model_name, "object": "model", "created": self.created,
                "owned_by": "mooncaked", "max_model_len": self.engine.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model."""
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the model card, or 404 model_not_found."""
        name = request.match_info["model"]
        if name != self.engine.model_name:
            raise ApiError(404, f"The model '{name}' does not exist", param="model",
                           code="model_not_found")
        return json_response(self._model_card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize (vLLM's): {"prompt": str} or {"messages": [...]} -> token ids."""
        body = parse_json(await request.read())
        check_model(body, self.engine)
        if "messages" in body:
            req = parse_chat({"messages": body["messages"], "max_tokens": 1}, self.engine)
            ids = req.prompts[0].token_ids
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ApiError(400, "'prompt' must be a string", param="prompt")
            ids = self.engine.tokenizer.encode(prompt)
        return json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize (vLLM's): {"tokens": [int]} -> {"prompt": str}."""
        body = parse_json(await request.read())
        check_model(body, self.engine)
        ids = token_ids(body.get("tokens"), "tokens", self.engine.tokenizer.vocab_size)
        return json_response({"prompt": self.engine.tokenizer.decode(ids)})

    async def metrics_route(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text exposition."""
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (OpenAI "Completions")."""
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (OpenAI "Chat Completions")."""
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival = time.monotonic()
        if self.draining:
            raise ApiError(503, "the server is shutting down", type="server_error",
                           code="service_unavailable")
        body = parse_json(await request.read())
        req = (parse_chat if kind == "chat" else parse_completion)(body, self.engine)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        request[REQUEST_ID_KEY] = rid       # an error reply names it too (_errors)
        log.debug("request", request_id=rid, kind=kind, prompts=len(req.prompts), n=req.n,
                  stream=req.stream, prompt_tokens=sum(len(p.token_ids) for p in req.prompts),
                  user=req.user)
        run = _Run(self.engine, req, rid, arrival, self.metrics)
        try:
            if req.stream:
                return await self._stream(request, req, run, rid)
            return await self._complete(req, run, rid)
        finally:
            await run.close()

    def _base(self, req: GenerationRequest, rid: str, created: int, chunk: bool) -> dict:
        if req.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": req.model}

    async def _complete(self, req: GenerationRequest, run: _Run, rid: str) -> web.Response:
        created = int(time.time())
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async for _ in run.outputs():
                    pass
        except TimeoutError:
            raise ApiError(504, f"the request did not finish within {self.request_timeout_s} s",
                           type="server_error", code="timeout") from None
        tok = self.engine.tokenizer
        choices = []
        for c in run.choices:
            text = "".join(c.text)
            if req.kind == "chat":
                lp = (chat_logprobs(c.logprobs, tok, req.tokens_as_ids)
                      if req.logprobs is not None else None)
                message, finish = {"role": "assistant", "content": text}, c.finish_reason
                if req.tools is not None and req.tools.parses_calls:   # api/structured.py
                    message, finish = chat_message(req.tools, text, c.finish_reason)
                choices.append({"index": c.index, "message": message,
                                "logprobs": lp, "finish_reason": finish,
                                "stop_reason": c.stop_reason})
            else:
                echo = c.prompt.text if req.echo else ""
                lp = (self._completion_logprobs(req, c, c.logprobs, TextOffset(), True)
                      if req.logprobs is not None else None)
                choice = {"index": c.index, "text": echo + ("" if req.echo_only else text),
                          "logprobs": lp,
                          "finish_reason": "length" if req.echo_only else c.finish_reason,
                          "stop_reason": None if req.echo_only else c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(req, c)
                choices.append(choice)
        body = {**self._base(req, rid, created, chunk=False), "choices": choices,
                "usage": run.usage()}
        if req.kind == "chat" and req.prompt_logprobs is not None:   # vLLM: per response
            body["prompt_logprobs"] = self._prompt_logprobs(req, run.choices[0])
        return json_response(body, headers={"X-Request-Id": rid})

    def _prompt_logprobs(self, req: GenerationRequest, c: _Choice) -> list | None:
        """vLLM's prompt_logprobs field of choice c (None when none came back)."""
        if c.prompt_logprobs is None:
            return None
        return prompt_logprobs_field(c.prompt_logprobs, self.engine.tokenizer, req.tokens_as_ids)

    def _completion_logprobs(self, req: GenerationRequest, c: _Choice,
                             lps: list[TokenLogprob] | None, offset: TextOffset,
                             with_prompt: bool) -> dict:
        """A completion choice's logprobs: with echo (and `with_prompt`: the part that
        carries the prompt) the prompt's scored tokens first (echo_logprobs), then the
        output's (none for echo with max_tokens 0). `offset` is the choice's."""
        tok, as_ids = self.engine.tokenizer, req.tokens_as_ids
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if req.echo and with_prompt and c.prompt_logprobs is not None:
            out = echo_logprobs(c.prompt.token_ids, c.prompt_logprobs, req.logprobs or 0,
                                tok, offset, as_ids)
        if lps and not req.echo_only:
            for key, values in completion_logprobs(lps, tok, offset, as_ids).items():
                out[key] += values
        return out

    async def _stream(self, request: web.Request, req: GenerationRequest, run: _Run,
                      rid: str) -> web.StreamResponse:
        created = int(time.time())
        outputs = run.outputs()
        base = self._base(req, rid, created, chunk=True)
        if req.include_usage:
            base["usage"] = None        # OpenAI: every chunk has usage null but the last
        tok = self.engine.tokenizer
        offsets = {c.index: TextOffset() for c in run.choices}
        relayed = node_metrics().observe_relay
        echo_pending = {c.index: req.echo for c in run.choices}
        tool_streams = ({c.index: ToolStream(req.tools) for c in run.choices}
                        if req.tools is not None and req.tools.parses_calls else None)

        def chunk(c: _Choice, out: RequestOutput) -> bytes | None:
            lps = out.logprobs if req.logprobs is not None and out.logprobs else None
            if req.echo_only:              # echo with max_tokens 0: the prompt alone
                out.new_text, lps = "", None
            done = out.finished
            if not (out.new_text or lps or done or echo_pending[c.index]
                    or (req.prompt_logprobs is not None and out.prompt_logprobs)):
                return None           # text held back (possible stop string): nothing to send
            finish = ("length" if req.echo_only else c.finish_reason) if done else None
            if req.kind == "chat":
                delta = {"content": out.new_text} if out.new_text else {}
                if tool_streams is not None:        # tool call chunks (api/structured.py)
                    delta, finish = tool_streams[c.index].delta(out.new_text, finish)
                    if not (delta or lps or done):
                        return None
                choice = {"index": c.index, "delta": delta,
                          "logprobs": chat_logprobs(lps, tok, req.tokens_as_ids) if lps else None}
            else:
                text = out.new_text
                with_prompt = echo_pending[c.index]
                if with_prompt:
                    text, echo_pending[c.index] = c.prompt.text + text, False
                lp = None
                if req.logprobs is not None and (lps or (with_prompt and c.prompt_logprobs)):
                    lp = self._completion_logprobs(req, c, lps, offsets[c.index], with_prompt)
                choice = {"index": c.index, "text": text, "logprobs": lp}
                if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(req, c)
            choice["finish_reason"] = finish
            if done:
                choice["stop_reason"] = c.stop_reason
            if req.kind == "chat" and req.prompt_logprobs is not None and out.prompt_logprobs:
                return sse.event({**base, "choices": [choice],
                                  "prompt_logprobs": self._prompt_logprobs(req, c)})
            return sse.event({**base, "choices": [choice]})

        resp: web.StreamResponse | None = None
        try:
            async with asyncio.timeout(self.request_timeout_s):
                # Wait for the first delta before sending headers, so a request the engine
                # refuses (InvalidRequest) still gets its 4xx status.
                first = await anext(outputs)
                resp = await sse.open_stream(request, {"X-Request-Id": rid})
                if req.kind == "chat":
                    for c in run.choices:
                        opening = (tool_streams[c.index].opening() if tool_streams is not None
                                   else {"role": "assistant", "content": ""})
                        await resp.write(sse.event({**base, "choices": [{
                            "index": c.index, "delta": opening,
                            "logprobs": None, "finish_reason": None}]}))
                frame = chunk(*first)
                if frame:
                    await resp.write(frame)
                    relayed(first[1].emitted_s)
                async for c, out in outputs:
                    frame = chunk(c, out)
                    if frame:
                        await resp.write(frame)
                        relayed(out.emitted_s)
                if req.include_usage:
                    await resp.write(sse.event({**base, "choices": [], "usage": run.usage()}))
                await resp.write(sse.DONE)
        except ConnectionResetError:
            log.info("client_disconnected", request_id=rid)
            request[CLIENT_CLOSED_KEY] = True      # counted as 499 though 200 went out
            if resp is None:
                resp = web.Response(status=CLIENT_CLOSED)
        except Exception as e:
            if resp is None:                       # headers not sent: a normal error reply
                if isinstance(e, TimeoutError):
                    raise ApiError(504, f"no output within {self.request_timeout_s} s",
                                   type="server_error", code="timeout") from None
                raise
            # Headers are out: report the error in the stream, as vLLM does, then end it.
            if isinstance(e, ApiError):
                err = e.body()
            elif isinstance(e, InvalidRequest):
                err = error_body(str(e), param=e.param)
            elif isinstance(e, TimeoutError):
                err = error_body(f"the request did not finish within {self.request_timeout_s} s",
                                 "server_error", code="timeout")
            else:
                log.error("stream_failed", exc_info=True, request_id=rid)
                err = error_body(f"internal error: {type(e).__name__}", "server_error")
            with contextlib.suppress(ConnectionResetError):
                await resp.write(sse.event(err))
                await resp.write(sse.DONE)
        finally:
            await outputs.aclose()
        return resp


# ---------------------------------------------------------------------------- the app


# nginx's "client closed request": the status http_requests_total counts for a request
# whose client went away (its engine requests count as finish_reason "abort").
CLIENT_CLOSED = 499
CLIENT_CLOSED_KEY = "mooncaked.client_closed"
REQUEST_ID_KEY = "mooncaked.request_id"


def _route_label(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    if info.http_exception is not None or route is None:
        return "unmatched"
    return route.resource.canonical if route.resource is not None else "unmatched"


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turns every failure into OpenAI's error body (with the X-Request-Id of a generation
    request that had one) and counts requests by route/status."""
    server: ApiServer = request.app[SERVER_KEY]
    try:
        resp = await handler(request)
    except ApiError as e:
        # e.g. 429 with Retry-After from the cluster's early rejection
        resp = json_response(e.body(), status=e.status, headers=getattr(e, "headers", None))
    except InvalidRequest as e:
        resp = json_response(error_body(str(e), param=e.param), status=400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _http_error(request, e)
    except asyncio.CancelledError:
        # The client went away (handler_cancellation): counted once, as 499.
        server.metrics.http.labels(_route_label(request), str(CLIENT_CLOSED)).inc()
        raise
    except Exception as e:  # noqa: BLE001 - a bug must not take the server down
        log.error("request_failed", exc_info=True, path=request.path, error=repr(e))
        resp = json_response(error_body(f"internal error: {type(e).__name__}", "server_error"),
                             status=500)
    rid = request.get(REQUEST_ID_KEY)
    if rid and resp.status >= 400 and not resp.prepared:
        # a refusal (429) names the request as a reply does, so a client or benchmark can
        # find its admission decisions (`admission.ledger`) and log lines
        resp.headers.setdefault("X-Request-Id", rid)
    status = CLIENT_CLOSED if request.get(CLIENT_CLOSED_KEY) else resp.status
    server.metrics.http.labels(_route_label(request), str(status)).inc()
    return resp


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    if e.status == 404:
        msg, code = f"Invalid URL ({request.method} {request.path})", "not_found"
    elif e.status == 405:
        msg, code = f"Method {request.method} is not allowed on {request.path}", \
            "method_not_allowed"
    elif e.status == 413:
        msg, code = (f"request body is larger than {request.app[SERVER_KEY].client_max_size} bytes",
                     "request_too_large")
    else:
        msg, code = e.reason, None
    headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
    return json_response(error_body(msg, "invalid_request_error", None, code), status=e.status,
                         headers=headers)


def build_app(engine: EngineClient, *, request_timeout_s: float = 600.0,
              client_max_size: int = MAX_BODY_BYTES) -> web.Application:
    """The aiohttp application serving the OpenAI API over `engine`.

    Args:
        engine: an EngineClient: an AsyncLLM (already started, or started by the caller
            before serving) or a cluster node's ClusterFrontend.
        request_timeout_s: upper bound on one request's generation, seconds.
        client_max_size: largest request body accepted, bytes (larger: 413).
    Returns: the app; `app[SERVER_KEY]` is its ApiServer (for begin_drain()).
    """
    server = ApiServer(engine, request_timeout_s, client_max_size)
    app = web.Application(client_max_size=client_max_size, middlewares=[_errors])
    app[SERVER_KEY] = server
    attach_node_metrics(app, server.metrics.registry)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model}", server.model)
    app.router.add_get("/health", server.health)
    app.router.add_get("/livez", server.livez)
    app.router.add_get("/metrics", server.metrics_route)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)
    return app
