"""`mooncake bench cpp --cluster`: TTFT through a real cluster, a 2-stage CPP group against a
single prefill node, in the same run (issue 14).

One local cluster (LocalCluster, loopback): g0s0 and g0s1 (one CPP group, `cpp.chunk_tokens`),
prefill0 (a single prefill node) and decode0 (whose API is asked), every node one torch
thread; decode0 starts first, so it leads the conductor election throughout. For each
prompt length, each repetition sends the same random-token prompt (a fresh cache salt, so
nothing is cached) once with prefill0 drained (the conductor's only choice is the group)
and once with the group drained (`node.drain` on stage 0: only prefill0), streaming, and
times the first token at the client. Which node prefilled is checked from the conductor's
`placed` counters. Unlike `mooncake bench cpp` (stage processes against an in-process
engine) this includes placement, the decode node's receive buffer and the first token's
trip through the decode node, i.e. what a client sees.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import orjson

from mooncaked.benchmarks.cpp import _prompt
from mooncaked.cluster.launcher import LocalCluster, cluster_specs, control_call

READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0
WAIT_S = 60.0


def _wait(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)   # poll interval


def _ttft(cl: LocalCluster, ids: list[int], model: str) -> tuple[float, str]:
    """(seconds to the first streamed token, the greedy text of 2 tokens)."""
    body = orjson.dumps({"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0,
                         "stream": True, "cache_salt": uuid.uuid4().hex})
    req = urllib.request.Request(f"{cl.api_url('decode0')}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0, first, text = time.perf_counter(), None, ""
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            if first is None:
                first = time.perf_counter() - t0
            text += orjson.loads(line[6:])["choices"][0]["text"]
    if first is None:
        raise RuntimeError("no token streamed")
    return first, text


def run(prompts: tuple[int, ...], reps: int, chunk_tokens: int) -> dict:
    """The measurements (see the module doc); `results` as `mooncake bench cpp`'s."""
    work = Path(tempfile.mkdtemp(prefix="bench-cpp-cluster-"))
    settings = {"conductor.refit_cost_model": False, "conductor.cpp_min_tokens": 1,
                "model.num_threads": 1, "engine.kv_cache_bytes": 512 << 20,
                "store.dram_bytes": 64 << 20, "cpp.chunk_tokens": chunk_tokens,
                "cpp.max_tokens": max(prompts) + 64, "server.request_timeout_s": REQUEST_TIMEOUT_S}
    cl = LocalCluster(work, cluster_specs(cache=0, prefill=3, decode=1, cpp=2), settings=settings)
    results = []
    try:
        cl.start_backend()
        cl.start_node("decode0")              # first: it wins the election and keeps it
        cl.wait_ready(READY_TIMEOUT_S, nodes=["decode0"])
        for node in ("g0s0", "g0s1", "prefill0"):
            cl.start_node(node)
        cl.wait_ready(READY_TIMEOUT_S)
        with urllib.request.urlopen(f"{cl.api_url('decode0')}/v1/models", timeout=10) as r:
            model = orjson.loads(r.read())["data"][0]["id"]

        def placed() -> dict:
            return {k: v["placed"] for k, v in (cl.status() or {"nodes": {}})["nodes"].items()}

        def draining(node: str, want: bool) -> None:
            control_call(cl.control(node), "node.drain" if want else "node.undrain")
            _wait(lambda: (cl.status() or {}).get("nodes", {}).get(node, {}).get("draining") is want,
                  f"{node} draining={want}")

        def once(ids: list[int], node: str) -> tuple[float, str]:
            before = placed()
            t, text = _ttft(cl, ids, model)
            after = placed()
            if after.get(node, 0) - before.get(node, 0) != 1:
                raise RuntimeError(f"the request was not prefilled on {node}: {before} -> {after}")
            return t, text

        _ttft(cl, _prompt(300, 1), model)          # warm-up: first request paths
        draining("prefill0", True)
        try:
            _ttft(cl, _prompt(300, 2), model)      # ... and the group's
        finally:
            draining("prefill0", False)
        for n in prompts:
            ids = _prompt(n, n)
            ours, single, equal = [], [], True
            for _ in range(reps):
                for node, other, out in (("g0s0", "prefill0", ours), ("prefill0", "g0s0", single)):
                    draining(other, True)
                    try:
                        t, text = once(ids, node)
                    finally:
                        draining(other, False)
                    out.append(t)
                    if node == "g0s0":
                        a = text
                    else:
                        b = text
                equal = equal and a == b
            o, s = statistics.median(ours), statistics.median(single)
            results.append({"prompt_tokens": n, "ours_s": round(o, 4), "single_s": round(s, 4),
                            "ratio": round(o / s, 4), "tokens_equal": equal,
                            "ours_samples": [round(x, 4) for x in ours],
                            "single_samples": [round(x, 4) for x in single]})
            print(f"cpp cluster bench: {orjson.dumps(results[-1]).decode()} "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        cl.stop()
    return {"benchmark": "cpp_cluster", "chunk_tokens": chunk_tokens, "reps": reps,
            "loadavg_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(),
            "results": results,
            "target_met": all(r["ratio"] <= 0.6 for r in results if r["prompt_tokens"] >= 4096)}


def main(json_out: bool = False, reps: int = 3, chunk_tokens: int = 512,
         prompts: tuple[int, ...] = (1024, 2048, 4096, 7168)) -> dict:
    """Runs the benchmark and prints a table or one JSON object; returns the result dict."""
    res = run(tuple(prompts), reps, chunk_tokens)
    if json_out:
        print(orjson.dumps(res).decode())
        return res
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=f"CPP through the cluster: 2-stage group vs one prefill node, TTFT at the "
                    f"client (chunk {chunk_tokens} tokens, median of {reps}; load "
                    f"{res['loadavg_1m']} on {res['cpu_count']} CPUs)")
    for c in ("prompt tokens", "group TTFT s", "single TTFT s", "group / single", "same tokens"):
        t.add_column(c, justify="right")
    for r in res["results"]:
        t.add_row(str(r["prompt_tokens"]), f"{r['ours_s']:.3f}", f"{r['single_s']:.3f}",
                  f"{r['ratio']:.3f}", "yes" if r["tokens_equal"] else "NO")
    Console().print(t)
    return res
