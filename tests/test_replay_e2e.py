"""End to end: `mooncake bench trace` against a real `mooncaked serve --role all` on loopback.

Replays the first requests of the shared conversation trace, scaled down so CPU prefill
stays short, one at a time (--concurrency-limit 1) so each request finds the blocks of
the ones before it: all of them start with hash id 0, so every request after the first
must report cached prompt tokens.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from mooncaked.replay.trace import shared_trace_path

TRACE = shared_trace_path() or Path("missing-conversation_trace.jsonl")
BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240.0  # model load on 2 shared cores
RUN_TIMEOUT_S = 300.0

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared conversation trace not present")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `mooncaked serve --role all` on a free loopback port; yields its URL."""
    tmp = tmp_path_factory.mktemp("replay_server")
    port = free_port()
    log = tmp / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "mooncaked"), "serve", "--role", "all", "--host", "127.0.0.1",
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {READY_TIMEOUT_S} s:\n{log_tail(log)}")
            time.sleep(0.2)  # poll interval, not synchronization: readiness is /health
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the group this fixture created
                proc.wait(timeout=10)


def bench(args, cwd):
    cp = subprocess.run([str(BIN / "mooncake"), "bench", "trace", *args, "--json",
                         "--no-progress"], capture_output=True, text=True, cwd=cwd,
                        timeout=RUN_TIMEOUT_S)
    assert cp.returncode == 0, cp.stderr[-3000:]
    return orjson.loads(cp.stdout.strip().splitlines()[-1])


def test_replay_conversation_prefix_hits(server, tmp_path):
    out = tmp_path / "out"
    summary = bench([str(TRACE), "--url", server, "--limit", "6", "--length-scale", "32",
                     "--time-scale", "0", "--concurrency-limit", "1", "--max-output-tokens", "4",
                     "--timeout", "120", "--out", str(out)], tmp_path)
    doc = orjson.loads((out / "replay.json").read_bytes())
    recs = doc["requests"]
    assert summary == doc["summary"]
    assert summary["requests"] == 6 and summary["completed"] == 6
    assert summary["rejected"] == 0 and summary["errors"] == 0
    for r in recs:
        assert r["ok"], r["error"]
        assert r["ttft_s"] > 0
        assert r["output_tokens"] == r["max_tokens"] == len(r["token_times_s"])  # ignore_eos
        assert r["prompt_tokens"] >= r["sent_prompt_tokens"] > 0
    # All six start with hash id 0 = one 16-token block at --length-scale 32 (one engine
    # block at block_size 16); run in order, so request 0 is cold and the rest hit it.
    assert recs[0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] >= 16 for r in recs[1:]), [r["cached_tokens"] for r in recs]
    assert summary["cache_hit_rate"] > 0
    assert (out / "ttft_cdf.png").exists() and (out / "tbt_cdf.png").exists()


def test_replay_text_input_over_chat(server, tmp_path):
    trace = tmp_path / "text.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 8, "output_length": 3, "hash_ids": [], '
        '"text_input": "Name a colour."}\n'
        '{"timestamp": 50, "input_length": 8, "output_length": 2, "hash_ids": [], '
        '"text_input": "Name a fruit."}\n')
    summary = bench([str(trace), "--url", server, "--text-api", "chat", "--timeout", "120",
                     "--out", str(tmp_path / "out")], tmp_path)
    assert summary["completed"] == 2 and summary["errors"] == 0
    assert summary["output_tokens"] == 5
    # The chat template wraps the short question in many more tokens than its words.
    assert summary["prompt_tokens"] > 2 * 4
    assert summary["ttft_mean_s"] > 0
