"""A shutdown that always ends (issue 19, blocker 1): SIGTERM to every node of a live
cluster at once, at start-up and while serving, ends every node with exit code 0 within
drain_timeout_s plus the slack; no node campaigns (or wins) while it drains; a second
SIGTERM ends a node at once (128 + 15). And children started with die_with_parent go
when their parent is killed with SIGKILL (what `mooncake up` relies on).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import orjson
import pytest
from cluster_harness import wait_until

from mooncaked.cluster.launcher import LocalCluster, NodeSpec
from mooncaked.daemon import SHUTDOWN_SLACK_S

READY_TIMEOUT_S = 300.0
DRAIN_S = 20.0                      # long enough that a running request holds a drain
BOUND_S = DRAIN_S + SHUTDOWN_SLACK_S + 10.0   # + process exit on a loaded machine
NODES = ("c1", "p1", "d1")          # a cache, a prefill and a decode node
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def events(cl: LocalCluster, nid: str, since: int = 0) -> list[dict]:
    """The node's JSON log events from byte offset `since`."""
    raw = cl.log_path(nid).read_bytes()[since:]
    out = []
    for line in raw.splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out


def reap(cl: LocalCluster, nids, bound_s: float) -> dict[str, tuple[int, float]]:
    """{node: (exit code, seconds to exit)} waiting at most bound_s each (from now)."""
    t0, out = time.monotonic(), {}
    for nid in nids:
        try:
            rc = cl.procs[nid].wait(max(0.1, bound_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            rc = None
        out[nid] = (rc, time.monotonic() - t0)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shutdown")
    settings = {"cluster.lease_ttl_s": 2.0, "cluster.heartbeat_interval_s": 0.5,
                "cluster.poll_interval_s": 0.1, "cluster.drain_timeout_s": DRAIN_S,
                "engine.kv_cache_bytes": 32 << 20, "store.dram_bytes": 32 << 20,
                "server.request_timeout_s": 120.0}
    cl = LocalCluster(tmp / "c", [NodeSpec(("cache" if n[0] == "c" else
                                            "prefill" if n[0] == "p" else "decode"), n)
                                  for n in NODES], settings=settings)
    cl.start_backend()
    try:
        yield cl
    finally:
        cl.stop(10)


def test_sigterm_to_every_node_at_startup_and_while_serving(cluster):
    # --- at start-up: each node gets SIGTERM as soon as it has logged its first event
    # (its handlers are installed first; the model may still be loading, the join not done)
    for nid in NODES:
        cluster.start_node(nid)
    pending = set(NODES)

    def signal_started() -> bool:
        for nid in list(pending):
            if cluster.log_path(nid).exists() and b'{"ts"' in cluster.log_path(nid).read_bytes():
                cluster.procs[nid].send_signal(signal.SIGTERM)
                pending.discard(nid)
        return not pending
    wait_until(signal_started, 120, "every node's first log line")
    got = reap(cluster, NODES, BOUND_S)
    assert all(rc == 0 for rc, _ in got.values()), got

    # --- while serving: a long request runs, then SIGTERM to all four at once
    offsets = {n: cluster.log_path(n).stat().st_size for n in NODES}
    for nid in NODES:
        cluster.start_node(nid)
    cluster.wait_ready(READY_TIMEOUT_S)
    result: dict = {}

    def long_request():
        req = urllib.request.Request(
            f"{cluster.api_url('c1')}/v1/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=orjson.dumps({"model": MODEL, "prompt": "Count to a thousand:", "stream": True,
                               "max_tokens": 600, "ignore_eos": True, "temperature": 0}))
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for _ in r:
                    result["first"] = True
        except urllib.error.HTTPError as e:
            result["error"] = f"{e}: {e.read()[:300]!r}"
        except Exception as e:  # noqa: BLE001 - the node it runs on is killed below
            result.setdefault("error", repr(e))

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    wait_until(lambda: result.get("first") or result.get("error"), 120, "the first token")
    assert "error" not in result, result
    result.clear()
    for nid in NODES:
        cluster.procs[nid].send_signal(signal.SIGTERM)
    # d1 decodes the long request, so its drain would wait DRAIN_S: a second SIGTERM ends it
    wait_until(lambda: any(e.get("event") == "node_draining"
                           for e in events(cluster, "d1", offsets["d1"])), 30, "d1 draining")
    t_second = time.monotonic()
    cluster.procs["d1"].send_signal(signal.SIGTERM)
    rc_d1 = cluster.procs["d1"].wait(10)
    assert rc_d1 == 128 + signal.SIGTERM and time.monotonic() - t_second < 10
    got = reap(cluster, [n for n in NODES if n != "d1"], BOUND_S)
    assert all(rc == 0 for rc, _ in got.values()), got
    t.join(30)
    # no node campaigned or won while draining, and the leader resigned
    for nid in NODES:
        evs = events(cluster, nid, offsets[nid])
        names = [e.get("event") for e in evs]
        assert "node_draining" in names, (nid, names[-20:])
        after = names[names.index("node_draining"):]
        assert "coord_elected" not in after and "conductor_started" not in after, (nid, after)
    leaders = [n for n in NODES if "coord_elected" in
               [e.get("event") for e in events(cluster, n, offsets[n])]]
    assert leaders, "someone led while serving"
    assert any(e.get("event") in ("coord_resigned", "conductor_resigned")
               for n in leaders for e in events(cluster, n, offsets[n])
               if n != "d1"), leaders


def test_children_die_with_their_parent(tmp_path):
    """A parent that starts a child with die_with_parent and is then SIGKILLed leaves no
    child behind (the kernel sends the child SIGTERM)."""
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from mooncaked.pdeathsig import die_with_parent
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                     preexec_fn=die_with_parent())
open({str(pidfile)!r}, "w").write(str(p.pid))
time.sleep(300)
"""], start_new_session=True)
    try:
        child = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 60,
                               "the child's pid"))
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        def gone() -> bool:
            try:
                with open(f"/proc/{child}/stat", "rb") as f:
                    return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
            except OSError:
                return True
        wait_until(gone, 10, "the orphan to go")
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(10)


def test_a_failed_start_whose_cleanup_hangs_exits_with_its_own_code():
    """A start-up step failed and the cleanup after it blocks (here: the main thread
    sleeps): the watchdog ends the process with the failure's code (3), not 70 and not
    never, and says why on stderr."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", """
import time
from mooncaked.shutdown import Shutdown
Shutdown(60).bound_failed_start(3, 1.0)
time.sleep(60)
"""], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr
    assert "cleanup after a failed start did not finish within 1 s" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 30
