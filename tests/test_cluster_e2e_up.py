"""`mooncake up` end to end: it starts cache, prefill and decode processes, serves chat
requests on --port through the prefill/decode path (the prefill node pushes each request's
KV layer by layer into the decode node, as `mooncake ctl status --json` counts), and
SIGTERM stops every node it started (each drains and logs `stopped`) before it exits 0.

The nodes run in their own sessions, so killing `up` does not kill them: the cleanup stops
`up` with a bounded wait, then SIGKILLs every process whose command line names the
cluster's work dir (the nodes run `mooncaked serve --config <work>/<node>.toml`), so no
node outlives the test even when `up` hangs or dies first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import orjson

from mooncaked.ports import free_port

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 300.0
UP_STOP_TIMEOUT_S = 60.0   # `up` drains its nodes (30 s at most) and SIGKILLs stragglers
REQUESTS = 2


def _alive(pid: int) -> bool:
    """Whether pid is a process that has not finished exiting (neither gone nor a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def processes_naming(path: Path) -> list[int]:
    """Pids of live processes (zombies excluded) other than this one whose command line has
    an argument containing `path`."""
    needle = os.fsencode(str(path))
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue                       # gone meanwhile, or not ours to read
        if any(needle in a for a in args) and _alive(int(entry.name)):
            out.append(int(entry.name))
    return out


def stop_up_and_nodes(proc: subprocess.Popen, work: Path,
                      up_timeout_s: float = UP_STOP_TIMEOUT_S) -> list[int]:
    """Stops a `mooncake up` started in its own session and every process naming its work
    dir; returns the pids still alive afterwards (none, unless something is unkillable).

    SIGTERM to `up` (it stops its nodes), at most up_timeout_s for it to exit, else SIGKILL
    to its process group; then SIGKILL to the process group of each process whose command
    line still names `work` (the nodes, in their own sessions), waiting at most 10 s until
    none is left and every one killed has finished exiting (an exiting process's command
    line reads empty before it is gone).
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(up_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)    # the session the test created
            proc.wait(10)
    killed: set[int] = set()
    deadline = time.monotonic() + 10.0
    while True:
        found = processes_naming(work)
        left = sorted(set(found) | {p for p in killed if _alive(p)})
        if not left or time.monotonic() > deadline:
            return left
        for pid in found:
            try:
                pgid = os.getpgid(pid)
                if pgid == pid and pgid != os.getpgrp():
                    os.killpg(pgid, signal.SIGKILL)    # a node: its own session and group
                else:
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)   # poll interval while the kernel tears the processes down


def kv_transfer_counters(env: dict[str, str]) -> dict[str, dict]:
    """Each node's `kv_transfer` counters from `mooncake ctl status --json` (no -c: the
    settings `up` left at $XDG_RUNTIME_DIR/mooncake/up.toml)."""
    cp = subprocess.run([str(BIN / "mooncake"), "ctl", "status", "--json", "--timeout", "10"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert cp.returncode == 0, cp.stderr[-3000:]
    view = orjson.loads(cp.stdout)
    assert set(view["nodes"]) == {"cache0", "prefill0", "decode0"}, view["nodes"]
    for nid, n in view["nodes"].items():
        assert "status" in n, f"{nid}: {n.get('error')}"
    return {nid: n["status"]["kv_transfer"] for nid, n in view["nodes"].items()}


def test_mooncake_up_serves_through_pd_and_stops_everything(tmp_path):
    port = free_port()
    work = tmp_path / "up"
    # `up` leaves its ctl settings under $XDG_RUNTIME_DIR: a private one for this test.
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    proc = subprocess.Popen([str(BIN / "mooncake"), "up", "--port", str(port), "--workdir",
                             str(work), "--set", "engine.kv_cache_bytes=67108864",
                             "--set", "store.dram_bytes=67108864"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
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
        before = kv_transfer_counters(env)
        for color in ("a color", "a fruit")[:REQUESTS]:
            body = {"messages": [{"role": "user", "content": f"Name {color}."}],
                    "max_tokens": 6, "temperature": 0.0}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                         data=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = orjson.loads(r.read())
            assert reply["choices"][0]["message"]["content"]
            assert reply["usage"]["completion_tokens"] >= 1
        after = kv_transfer_counters(env)

        def delta(node: str, key: str) -> float:
            return after[node][key] - before[node][key]

        # Every request's KV went layer by layer from prefill0 into decode0's receive buffer:
        # no push failed, none fell back to the decode node READing the prefill stage.
        assert delta("prefill0", "pushed") == REQUESTS, (before, after)
        assert delta("decode0", "received_pushed") == REQUESTS, (before, after)
        assert delta("prefill0", "push_bytes") > 0
        for node in ("prefill0", "decode0"):
            for key in ("push_failed", "staged_only", "read"):
                assert delta(node, key) == 0, (node, key, before, after)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        reader.join(10)
        assert "stopped" in "".join(lines).splitlines()[-1]
        logs = sorted(work.glob("*.log"))
        assert [p.stem for p in logs] == ["cache0", "decode0", "prefill0"]
        for p in logs:
            assert '"event":"stopped"' in p.read_text().replace(" ", ""), p.name
        assert not (tmp_path / "run" / "mooncake" / "up.toml").exists()  # `up` forgot it
    finally:
        left = stop_up_and_nodes(proc, work)
    assert left == [], f"processes naming {work} survived: {left}"
