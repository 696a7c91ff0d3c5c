"""`mooncake up` end to end: it starts cache, prefill and decode processes, serves a chat
request on --port through the prefill/decode path, and SIGTERM stops every node it
started (each drains and logs `stopped`) before it exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import orjson

from mooncaked.cluster.launcher import free_port

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 300.0


def test_mooncake_up_serves_and_stops_everything(tmp_path):
    port = free_port()
    work = tmp_path / "up"
    proc = subprocess.Popen([str(BIN / "mooncake"), "up", "--port", str(port), "--workdir",
                             str(work), "--set", "engine.kv_cache_bytes=67108864",
                             "--set", "store.dram_bytes=67108864"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(READY_TIMEOUT_S), "".join(lines)[-3000:]
        out = "".join(lines)
        assert f"ready: http://127.0.0.1:{port}/v1" in out
        body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
                "temperature": 0.0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = orjson.loads(r.read())
        assert reply["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        reader.join(10)
        assert "stopped" in "".join(lines).splitlines()[-1]
        logs = sorted(work.glob("*.log"))
        assert [p.stem for p in logs] == ["cache0", "decode0", "prefill0"]
        for p in logs:
            assert '"event":"stopped"' in p.read_text().replace(" ", ""), p.name
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)      # `up` stops its nodes (own sessions) first
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)   # the group this test created
                proc.wait(10)
