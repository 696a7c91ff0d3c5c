"""The suite's shared test harness: one bounded wait, one set of HTTP helpers, free ports,
and the processes a whole test run shares (tests/conftest.py makes them session fixtures).

- `wait_until(pred, timeout_s, what)`: polls pred until it is truthy, bounded, and fails
  naming what it waited for (and, when given, what `state()` shows then).
- `http(method, url, body)` / `post(url, body)` (synchronous, urllib) and the aiohttp
  helpers `apost`, `stream`, `metrics` for tests that run an event loop; `node_status`
  is one control RPC `node.status` to a LocalCluster node.
- `run_server(tmp, *args)`: a real `mooncaked serve --role all` on a free loopback port
  (waits, bounded, for /health 200; always stops it). conftest's `default_server` is one
  of these with default settings for the whole run: the API and replay modules share it.
- `run_etcd(tmp)`: one single-member etcd on free loopback ports; conftest's `etcd`
  session fixture is the one etcd of the run, and `etcd_prefix(name)` gives each user a
  key prefix of its own, so that clusters and coordinators sharing it never see each
  other's keys.

Every process started here is stopped in a finally (also when the test fails):
SIGTERM, then SIGKILL of the process group it was started in.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from mooncaked.coord.etcd_server import EtcdServer, etcd_binary
from mooncaked.cluster.launcher import control_call
from mooncaked.pdeathsig import die_with_parent
from mooncaked.ports import free_port
from mooncaked.wire.messages import NodeReport, PlaceRequest

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240.0   # model load on 2 shared cores (about 5-20 s when quiet)
STOP_TIMEOUT_S = 30.0
POLL_S = 0.1              # poll interval of wait_until

T = TypeVar("T")

__all__ = ["BIN", "CONSTRAINED_LOGPROBS", "READY_TIMEOUT_S", "Server", "apost", "etcd_binary", "etcd_prefix", "free_port",
           "healthy", "http", "logprob_values", "metrics", "node_status", "post", "run_etcd", "run_server",
           "stop_process", "stream", "wait_until"]


def wait_until(pred: Callable[[], T], timeout_s: float, what: str,
               state: Callable[[], Any] | None = None, interval_s: float = POLL_S) -> T:
    """pred()'s first truthy value, polled every interval_s for at most timeout_s seconds.

    Raises: AssertionError "timed out after {timeout_s} s waiting for {what}" (with
    "; now: {state()}" when state is given) once the time is up.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}"
                                 + (f"; now: {state()}" if state is not None else ""))
        time.sleep(interval_s)   # poll interval; the condition is what pred() reads


def _json(raw: bytes) -> Any:
    """Decoded JSON body ({} for an empty one; {"raw": text} when it is not JSON)."""
    try:
        return orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        return {"raw": raw.decode(errors="replace")}


def http(method: str, url: str, body: dict | bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60.0
         ) -> tuple[int, Any, dict[str, str]]:
    """One synchronous request: (status, decoded JSON body, response headers). HTTP error
    statuses are answers too, returned, not raised. Raises: OSError when the server
    cannot be reached or does not answer within timeout seconds."""
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _json(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, _json(e.read()), dict(e.headers)


def post(url: str, body: dict | bytes, timeout: float = 120.0) -> tuple[int, Any, dict[str, str]]:
    """POST url with a JSON body: (status, decoded JSON body, headers); see `http`."""
    return http("POST", url, body, timeout=timeout)


def healthy(url: str) -> bool:
    """True when GET {url}/health answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def node_status(cluster: Any, node_id: str) -> dict:
    """The `node.status` control RPC of a LocalCluster node (5 s timeout).
    Raises: OSError when unreachable; RuntimeError with the remote error."""
    return control_call(cluster.control(node_id), "node.status", timeout_s=5.0)


# ------------------------------------------------------------------- aiohttp helpers


async def apost(session: aiohttp.ClientSession, url: str, body: dict | bytes) -> tuple[int, dict]:
    """POSTs JSON (or raw bytes) on an aiohttp session; returns (status, decoded JSON body)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, orjson.loads(await r.read())


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> list:
    """POSTs a streaming request; returns the decoded `data:` events, "[DONE]" as a str.

    Asserts the SSE framing: status 200, text/event-stream, only `data:` lines and blank
    separators.
    """
    events: list = []
    async with session.post(url, data=orjson.dumps(body)) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """GET /metrics parsed with prometheus_client's parser: {"name{k=v,...}": value}."""
    async with session.get(f"{base}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ------------------------------------------------------------------- processes


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then (after timeout_s) SIGKILL of the process group proc leads (it was
    started with start_new_session=True); reaps it. Never raises for a gone process."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # the group the starter created
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


@dataclass
class Server:
    """A running server process: its URL, process handle and log file."""

    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 3000) -> str:
        """The last n characters of the server's log ("" before it exists)."""
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@contextmanager
def run_server(tmp: Path, *extra: str) -> Iterator[Server]:
    """Starts `mooncaked serve --role all --port P *extra` (P free, cwd and log in tmp),
    waits (at most READY_TIMEOUT_S) until GET /health answers 200, yields a Server;
    always stops it (SIGTERM, then SIGKILL of its process group).
    Raises: RuntimeError with the log tail when it exits or is not ready in time."""
    port = free_port()
    log = tmp / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "mooncaked"), "serve", "--role", "all", "--port", str(port), *extra],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
            preexec_fn=die_with_parent())   # a killed pytest leaves no server behind
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            return healthy(server.url)
        try:
            wait_until(ready, READY_TIMEOUT_S, "the server's /health", interval_s=0.2)
        except AssertionError as e:
            raise RuntimeError(f"{e}:\n{server.log_tail()}") from None
        yield server
    finally:
        stop_process(proc)


@contextmanager
def run_etcd(data_dir: Path) -> Iterator[Any]:
    """A single-member etcd on free loopback ports with its data in data_dir (the
    project's EtcdServer); yields it (its `.endpoint` is the client URL); always stops it.
    Raises: CoordinationError when etcd is missing or does not start."""
    server = EtcdServer(data_dir).start()
    try:
        yield server
    finally:
        server.stop()


def etcd_prefix(name: str) -> str:
    """A key prefix no other user of the shared etcd has: /t-{name}-{random}/."""
    return f"/t-{name}-{uuid.uuid4().hex[:12]}/"
# Constrained requests with logprobs (issue 32, fault 1). The choice ones force a
# grammar-masked alternative (logprob -inf) into the top logprobs: after "yes" only the
# end of output is allowed.
CONSTRAINED_LOGPROBS = {
    "completions-choice": {"prompt": "Is the sky blue? Answer:", "max_tokens": 6,
                           "temperature": 0, "logprobs": 3,
                           "structured_outputs": {"choice": ["yes", "no"]}},
    "chat-choice": {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                    "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "a", "schema": {"enum": ["yes", "no"]}}}},
    "completions-json": {"prompt": "Make a person as JSON:", "max_tokens": 10,
                         "temperature": 0, "logprobs": 2,
                         "response_format": {"type": "json_object"}},
}


def logprob_values(body: dict) -> list[float]:
    """Every logprob number of a completions or chat response, token by token (each
    sampled token's, then its top alternatives'; all choices). Asserts each one is a JSON number (the OpenAI schema
    has no null, NaN or infinity there)."""
    vals: list = []
    for c in body["choices"]:
        lp = c["logprobs"]
        if "content" in lp:                                    # chat
            for e in lp["content"]:
                vals += [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]
        else:                                                  # completions
            for v, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
                vals += [v, *top.values()]
    assert vals and all(isinstance(v, float) and -9999.0 <= v <= 0.0 for v in vals), vals
    return vals


def report(svc: Any, node: str, role: str, **kw) -> None:
    """Hands a ConductorService `svc` one NodeReport from `node` (idle unless `kw` says
    otherwise), through the wire form as a node's report arrives."""
    payload = {"node": node, "role": role, "pending": {}, "arrived": [],
               "decode": {"rids": [], "batch": 0, "context_tokens": 0, "free_kv_tokens": 10_000}}
    payload.update(kw)
    asyncio.run(svc.report(NodeReport.from_json(payload)))


def place(svc: Any, rid: str, n: int = 100) -> dict:
    """`conductor.place` on `svc` for a request of n prompt tokens and 10 new ones, no
    block keys: the reply's (or rejection's) wire form."""
    req = PlaceRequest.from_json({"rid": rid, "keys": [], "prompt_tokens": n,
                                  "max_new_tokens": 10})
    return asyncio.run(svc.place(req)).to_json()
