"""Test helper: a real `mooncaked serve --role all` on a free loopback port, plus small
aiohttp-client helpers shared by the tests/test_api_*.py modules."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240.0   # model load on 2 shared cores (about 5-20 s when quiet)
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port the OS just handed out on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running server process: its URL, process handle and log file."""

    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@contextmanager
def run_server(tmp: Path, *extra: str):
    """Starts the server, waits (bounded) until GET /health answers 200, yields a Server;
    always stops it (SIGTERM, then SIGKILL of its process group)."""
    port = free_port()
    log = tmp / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "mooncaked"), "serve", "--role", "all", "--port", str(port), *extra],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s:\n"
                                   f"{server.log_tail()}")
            time.sleep(0.2)   # poll interval; readiness itself is /health answering
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)   # the group this helper created
                proc.wait(timeout=10)


async def post(session: aiohttp.ClientSession, url: str, body: dict | bytes) -> tuple[int, dict]:
    """POSTs JSON (or raw bytes); returns (status, decoded JSON body)."""
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
