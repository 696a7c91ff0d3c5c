"""Send a trace's requests at their timestamps to an OpenAI-compatible endpoint and record them.

One aiohttp session, every request a task on one event loop. Token-id prompts go to
`POST /v1/completions`; `text_input` prompts to `/v1/completions` or
`/v1/chat/completions`. Always streaming (SSE) with `stream_options.include_usage`, so
the last event carries `usage.prompt_tokens_details.cached_tokens` (OpenAI API spec).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from mooncaked.log import get_logger
from mooncaked.measures import tbt_s

from .prompts import DEFAULT_TOKEN_LOW, DEFAULT_VOCAB_SIZE, PromptBuilder
from .trace import TraceRequest

log = get_logger(__name__)


@dataclass
class ReplayConfig:
    """How to replay a trace.

    url: server root (e.g. http://127.0.0.1:8000; a trailing /v1 is accepted).
    model: model name sent in requests. time_scale: request i is sent at
    timestamp_ms * time_scale ms after the start (0 sends everything at once).
    length_scale, vocab_size, token_low: see PromptBuilder. concurrency_limit: most
    requests in flight (None: unbounded; queued requests are sent late and their
    `sent_s` says so). timeout_s: per-request total timeout, seconds. text_api:
    "completions" or "chat", the endpoint for `text_input` prompts. ignore_eos: ask the
    server to generate exactly max_tokens (a vLLM/SGLang extension). max_output_tokens:
    optional cap on each request's max_tokens. api_key: sent as a Bearer token if set.
    cache_salt: sent with every request when set (its blocks are cached apart from other
    salts: replays of the same trace do not hit each other's prefixes).
    """

    url: str
    model: str
    time_scale: float = 1.0
    length_scale: float = 1.0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    token_low: int = DEFAULT_TOKEN_LOW
    concurrency_limit: int | None = None
    timeout_s: float = 600.0
    text_api: str = "completions"
    ignore_eos: bool = True
    max_output_tokens: int | None = None
    api_key: str | None = None
    cache_salt: str | None = None

    def validate(self) -> None:
        """Raises ValueError naming the bad field."""
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {self.concurrency_limit}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.text_api not in ("completions", "chat"):
            raise ValueError(f"text_api must be 'completions' or 'chat', got {self.text_api!r}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; `*_s` offsets are from replay start.

    scheduled_s: when the trace says to send it; sent_s: when it was sent (later than
    scheduled_s only under a concurrency limit or an overloaded client loop).
    ttft_s: send to first token. token_times_s: arrival of each streamed token event,
    relative to sent_s (first token included). tbt_s: mean of the longest 10% of
    inter-token gaps (measures.tbt_s). prompt_tokens / output_tokens: from the server's
    usage when reported, else what was sent / counted. cached_tokens: usage's
    prompt_tokens_details.cached_tokens, None when the server does not report it.
    status: HTTP status (None if no response). rejected: refused for the SLOs
    (`is_slo_refusal`: HTTP 429, or 400 slo_unattainable). error: why it failed,
    None on success. retry_after: the 429's Retry-After header, recorded, not honoured.
    request_id: the server's X-Request-Id header, when it sends one (mooncaked does: its
    admission ledger is keyed by it, `bench capacity`).
    """

    index: int
    scheduled_s: float
    sent_prompt_tokens: int
    max_tokens: int
    sent_s: float | None = None
    end_s: float | None = None
    status: int | None = None
    ok: bool = False
    rejected: bool = False
    error: str | None = None
    retry_after: str | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    request_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


@dataclass
class ReplayProgress:
    """Live counters for a progress display (read them in the on_update callback)."""

    total: int
    sent: int = 0
    done: int = 0
    failed: int = 0
    rejected: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0

    @property
    def ttft_mean_s(self) -> float | None:
        """Mean TTFT of the completed requests so far, seconds."""
        return self.ttft_sum_s / self.ttft_count if self.ttft_count else None


def is_slo_refusal(status: int, body: bytes) -> bool:
    """Whether an answer refused the request for the SLOs (an early rejection, paper
    section 7, "Early Rejection"), not as a failure: HTTP 429 (overloaded now), or 400
    with code `slo_unattainable` (over the TTFT SLO even on an idle cluster, so no retry
    helps; cluster/frontend.py). `body`: the answer's bytes (an OpenAI-style error)."""
    if status == 429:
        return True
    if status != 400:
        return False
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") == "slo_unattainable"


def base_url(url: str) -> str:
    """Server root from a URL given with or without a trailing '/v1' or '/'."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover_server(url: str, api_key: str | None = None,
                          timeout_s: float = 30.0) -> dict[str, Any]:
    """Ask `GET /v1/models` for the served model: returns {"model": id, "vocab_size": int|None,
    "max_model_len": int|None} from the first entry.

    Raises RuntimeError with the URL and reason when the server cannot be reached, answers
    an error, or serves no model.
    """
    models_url = f"{base_url(url)}/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(models_url, headers=_headers(api_key)) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"GET {models_url}: HTTP {resp.status}: {body[:200]!r}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise RuntimeError(f"GET {models_url}: {type(e).__name__}: {e}") from None
    try:
        data = orjson.loads(body)["data"]
        first = data[0]
        model = first["id"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET {models_url}: no model listed in {body[:200]!r}") from None
    vocab = first.get("vocab_size")
    max_len = first.get("max_model_len")
    return {"model": model, "vocab_size": vocab if isinstance(vocab, int) else None,
            "max_model_len": max_len if isinstance(max_len, int) else None}


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """Yield the data of each server-sent event (WHATWG HTML "server-sent events").

    Lines starting with ':' are comments; 'data:' lines of one event are joined with
    newlines; a blank line ends the event; other fields (event, id, retry) are ignored
    since OpenAI streams use only data.
    """
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _chunk_text(choice: dict[str, Any]) -> str:
    # /v1/completions puts text in choice.text; chat puts it in choice.delta.content.
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(session: aiohttp.ClientSession, cfg: ReplayConfig, payload: dict[str, Any],
                       path: str, rec: RequestRecord, t0: float) -> None:
    """POST one streaming request and fill `rec` in place; never raises for request failures.

    A token event is a stream chunk with non-empty text (chat's opening role-only chunk is
    not a token). An SLO refusal (`is_slo_refusal`) sets rejected; any other failure (HTTP
    error, error event in the stream, timeout, connection loss, a stream that ends without
    a token) sets error.
    """
    url = f"{base_url(cfg.url)}{path}"
    start = time.perf_counter()
    rec.sent_s = start - t0
    times: list[float] = []
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=payload, headers=_headers(cfg.api_key),
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            rec.status = resp.status
            rec.request_id = resp.headers.get("X-Request-Id")
            if resp.status != 200:
                raw = await resp.read()
                body = raw[:300].decode("utf-8", "replace")
                if is_slo_refusal(resp.status, raw):
                    rec.rejected = True
                    rec.retry_after = resp.headers.get("Retry-After")
                rec.error = f"HTTP {resp.status}: {body}"
                return
            async for data in _sse_data(resp.content):
                now = time.perf_counter()
                if data == "[DONE]":
                    break
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    rec.error = f"bad stream event: {data[:200]!r}"
                    return
                if "error" in chunk and not chunk.get("choices"):
                    err = chunk["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if _chunk_text(choice):
                        times.append(now - start)
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
    except asyncio.TimeoutError:
        rec.error = f"timeout after {cfg.timeout_s} s"
    except (aiohttp.ClientError, UnicodeDecodeError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end_s = time.perf_counter() - t0
        rec.token_times_s = times
        if times:
            rec.ttft_s = times[0]
            rec.tbt_s = tbt_s(times)
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
        if rec.prompt_tokens is None:
            rec.prompt_tokens = rec.sent_prompt_tokens
        if rec.output_tokens is None:
            rec.output_tokens = len(times)
        if rec.error is None and not times:
            rec.error = "stream ended without a token"
        rec.ok = rec.error is None


def build_payload(cfg: ReplayConfig, builder: PromptBuilder,
                  req: TraceRequest) -> tuple[str, dict[str, Any], int, int]:
    """The (path, JSON body, prompt tokens sent, max_tokens) of one trace request.

    Token prompts are scaled by the builder; a text_input is sent as is (its length is
    counted by the server, so prompt tokens sent is 0 until usage reports it).
    """
    max_tokens = builder.output_length(req)
    if cfg.max_output_tokens is not None:
        max_tokens = min(max_tokens, cfg.max_output_tokens)
    body: dict[str, Any] = {
        "model": cfg.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.cache_salt is not None:
        body["cache_salt"] = cfg.cache_salt
    if req.text_input is not None:
        if cfg.text_api == "chat":
            body["messages"] = [{"role": "user", "content": req.text_input}]
            return "/v1/chat/completions", body, 0, max_tokens
        body["prompt"] = req.text_input
        return "/v1/completions", body, 0, max_tokens
    prompt = builder.prompt(req)
    body["prompt"] = prompt
    return "/v1/completions", body, len(prompt), max_tokens


async def replay(cfg: ReplayConfig, requests: list[TraceRequest],
                 on_update: Callable[[ReplayProgress], None] | None = None
                 ) -> tuple[list[RequestRecord], float]:
    """Replay `requests` (sorted by timestamp) against cfg.url; returns (records, wall seconds).

    Records are in trace order. Request i is sent at its timestamp_ms * time_scale after
    the start. `on_update` is called after every send and every completion.
    Raises ValueError for a bad config.
    """
    cfg.validate()
    builder = PromptBuilder(cfg.vocab_size, cfg.length_scale, cfg.token_low)
    progress = ReplayProgress(total=len(requests))
    records: list[RequestRecord] = []
    sem = asyncio.Semaphore(cfg.concurrency_limit) if cfg.concurrency_limit else None

    def notify() -> None:
        if on_update is not None:
            on_update(progress)

    async def one(path: str, payload: dict[str, Any], rec: RequestRecord) -> None:
        if sem is not None:
            await sem.acquire()
        try:
            progress.sent += 1
            notify()
            await send_request(session, cfg, payload, path, rec, t0)
        finally:
            if sem is not None:
                sem.release()
        progress.done += 1
        if rec.rejected:
            progress.rejected += 1
        elif not rec.ok:
            progress.failed += 1
        elif rec.ttft_s is not None:
            progress.ttft_sum_s += rec.ttft_s
            progress.ttft_count += 1
        notify()

    # limit=0: no connection cap, else aiohttp silently queues requests beyond 100.
    connector = aiohttp.TCPConnector(limit=0)
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        for req in requests:
            due = req.timestamp_ms / 1000.0 * cfg.time_scale
            # Build the prompt before sleeping, so its cost does not delay the send.
            path, payload, n_prompt, max_tokens = build_payload(cfg, builder, req)
            rec = RequestRecord(index=req.index, scheduled_s=due, sent_prompt_tokens=n_prompt,
                                max_tokens=max_tokens)
            records.append(rec)
            delay = due - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(path, payload, rec)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        wall = time.perf_counter() - t0
    log.info("replay_done", requests=len(records), wall_s=round(wall, 3),
             completed=sum(r.ok for r in records), rejected=progress.rejected,
             failed=progress.failed)
    return records, wall
