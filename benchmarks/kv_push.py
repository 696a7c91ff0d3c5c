"""Layer-wise KV push overlapped with prefill vs READ after prefill, in one cluster, one run.

One prefill node and one decode node (separate processes, local coordination). Both
nodes serve the API, and the API node decides how the KV moves: the prefill node's API
runs with cluster.layerwise_kv_push = true (ours: every layer is WRITTEN to the decode
node while the next layer computes, paper section 3), the decode node's API with false
(baseline: the decode node READs all of it after the prefill). Requests alternate
between the two APIs, one at a time, with fresh random prompts (no prefix hits), so
both paths share the machine's load alike.

Per mode it prints the medians of
  exposed_ms   KV-transfer time left after the prefill compute: ours, the push's tail
               (node counter push_exposed_s); baseline, the decode node's READ (read_s);
  ttst_ms      client-side time to the second token (the first decode token): prefill,
               KV hand-over and one decode step;
and the ratio ours / baseline, plus the push's overlap (1 - exposed / busy).

    python -m mooncaked.benchmarks.kv_push --tokens 1024 2048 --repeats 5 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call


def _status(cl: LocalCluster, nid: str) -> dict:
    return control_call(cl.control(nid), "node.status", timeout_s=10.0)["kv_transfer"]


async def _second_token_s(url: str, prompt: list[int], timeout_s: float) -> float:
    """Streams a 2-token completion; returns seconds until the second token arrived."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    got = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.post(f"{url}/v1/completions", data=orjson.dumps(body)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ev = orjson.loads(line[6:])
                    if ev["choices"] and ev["choices"][0]["text"]:
                        got += 1
                        if got == 2:
                            return time.monotonic() - t0
    raise RuntimeError("stream ended before the second token")


def run(tokens: list[int], repeats: int, timeout_s: float, work: Path) -> dict[str, Any]:
    """Starts the cluster, runs the interleaved requests, returns per-size medians."""
    settings = {"engine.kv_cache_bytes": 512 << 20, "store.dram_bytes": 64 << 20,
                "conductor.ttft_slo_s": float("inf"), "conductor.tbt_slo_s": float("inf"),
                "server.request_timeout_s": timeout_s}
    nodes = [NodeSpec("prefill", "p0", settings={"cluster.layerwise_kv_push": True}),
             NodeSpec("decode", "d0", settings={"cluster.layerwise_kv_push": False})]
    rng = random.Random(0)
    out: dict[str, Any] = {}
    with LocalCluster(work / "cluster", nodes, settings=settings, log_level="warning") as cl:
        urls = {"push": cl.api_url("p0"), "read": cl.api_url("d0")}
        for n in tokens:
            samples: dict[str, dict[str, list[float]]] = {m: {"exposed_ms": [], "ttst_ms": [],
                                                               "overlap": []} for m in urls}
            for i in range(repeats + 1):                      # the first round warms up
                for mode in (("push", "read") if i % 2 else ("read", "push")):
                    before_p, before_d = _status(cl, "p0"), _status(cl, "d0")
                    prompt = [rng.randrange(100, 40000) for _ in range(n)]
                    ttst = asyncio.run(_second_token_s(urls[mode], prompt, timeout_s))
                    p, d = _status(cl, "p0"), _status(cl, "d0")
                    if i == 0:
                        continue
                    s = samples[mode]
                    s["ttst_ms"].append(ttst * 1e3)
                    if mode == "push":
                        assert p["pushed"] - before_p["pushed"] == 1, (before_p, p)
                        busy = p["push_busy_s"] - before_p["push_busy_s"]
                        exposed = p["push_exposed_s"] - before_p["push_exposed_s"]
                        s["exposed_ms"].append(exposed * 1e3)
                        s["overlap"].append(1 - exposed / busy if busy > 0 else 0.0)
                    else:
                        assert d["read"] - before_d["read"] == 1, (before_d, d)
                        s["exposed_ms"].append((d["read_s"] - before_d["read_s"]) * 1e3)
            med = {m: {k: statistics.median(v) for k, v in s.items() if v}
                   for m, s in samples.items()}
            med["ratio_push_over_read"] = {
                k: med["push"][k] / med["read"][k] if med["read"].get(k) else None
                for k in ("exposed_ms", "ttst_ms")}
            kv_bytes = n * 30 * 2 * 3 * 64 * 4   # SmolLM2-135M, fp32 (for the reader)
            med["kv_mib"] = round(kv_bytes / 2**20, 1)
            out[str(n)] = med
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-kvpush-") as tmp:
        res = run(args.tokens, args.repeats, args.timeout, Path(tmp))
    if args.json:
        sys.stdout.write(orjson.dumps(res).decode() + "\n")
        return 0
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=f"KV hand-over, 1 prefill + 1 decode node, medians of {args.repeats}")
    for c in ("prompt tokens", "KV MiB", "measure", "layer-wise push", "READ after prefill",
              "ratio"):
        t.add_column(c, justify="right")
    for n, r in res.items():
        for k in ("exposed_ms", "ttst_ms"):
            ratio = r["ratio_push_over_read"][k]
            t.add_row(n, str(r["kv_mib"]), k, f"{r['push'][k]:.1f}", f"{r['read'][k]:.1f}",
                      "-" if ratio is None else f"{ratio:.3f}")
        t.add_row(n, "", "push overlap", f"{r['push']['overlap']:.3f}", "", "")
    Console().print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
