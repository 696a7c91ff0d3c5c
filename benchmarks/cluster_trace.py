"""Disaggregated (1 prefill + 1 decode node) vs one `--role all` process on a trace replay.

The issue's benchmark: the first 200 requests of the conversation trace with lengths
divided by 16, replayed (time-compressed as needed) with `mooncaked.replay` through

  ours:      a cluster of one prefill and one decode node (local coordination; the
             prefill node's API is the front end), conductor SLOs at infinity so that
             nothing is rejected;
  baseline:  one `mooncaked serve --role all` process on the same machine,

one after the other in the same run. Prints TTFT (mean, p50, p90) and TBT (the paper's
per-request TBT: mean of the longest 10% of its gaps; mean and p90 over requests) for
both and their ratio; `--json` prints one JSON object.

    python -m mooncaked.benchmarks.cluster_trace --limit 200 --time-scale 1.0

On a small shared CPU use --limit and --max-output-tokens to keep it short: both sides
share the same cores, so disaggregation cannot win there (prefill and decode nodes
compete for two cores and the KV crosses loopback TCP); the figures show the overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from mooncaked.cluster.launcher import LocalCluster, NodeSpec
from mooncaked.ports import free_port
from mooncaked.replay.runner import ReplayConfig, discover_server, replay
from mooncaked.replay.summary import summarize
from mooncaked.replay.trace import load_trace
from mooncaked.replay.trace import shared_trace_path

TRACE = shared_trace_path()
KEYS = ("completed", "rejected", "errors", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
        "tbt_mean_s", "tbt_p90_s", "cache_hit_rate", "output_throughput_tok_s", "duration_s")


def _replay(url: str, args: argparse.Namespace, side: str = "") -> dict[str, Any]:
    requests = load_trace(args.trace, args.limit)

    async def run():
        info = await discover_server(url)
        cfg = ReplayConfig(url=url, model=info["model"], vocab_size=info["vocab_size"] or 49152,
                           time_scale=args.time_scale, length_scale=args.length_scale,
                           max_output_tokens=args.max_output_tokens, timeout_s=args.timeout,
                           concurrency_limit=args.concurrency_limit)
        return await replay(cfg, requests)

    records, wall = asyncio.run(run())
    out = summarize(records, wall)
    # why requests failed, most common first (an error's text up to its first digit run
    # varies per request only in ids and times)
    reasons = Counter(r.error[:120] for r in records if r.error)
    out["error_reasons"] = reasons.most_common(5)
    if args.records:
        # one JSON line per request: when it was sent and each token's arrival, for
        # finding stalls (seconds; token times relative to the send)
        with args.records.open("ab") as f:
            for r in records:
                f.write(orjson.dumps({"side": side, "index": r.index, "sent_s": r.sent_s,
                                      "ttft_s": r.ttft_s, "tbt_s": r.tbt_s,
                                      "token_times_s": r.token_times_s, "error": r.error})
                        + b"\n")
    return out


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"engine.kv_cache_bytes": args.kv_cache_bytes, "server.request_timeout_s": args.timeout}


def run_cluster(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Replays through a 1 prefill + 1 decode cluster; returns the summary."""
    # No admission control on either side: SLOs at infinity also turn off the decode-room
    # rejection, so the decode node queues what does not fit, as the single process does.
    settings = {**_engine_settings(args), "conductor.ttft_slo_s": float("inf"),
                "conductor.tbt_slo_s": float("inf"), "store.dram_bytes": args.kv_cache_bytes}
    with LocalCluster(work / "cluster", [NodeSpec("prefill", "p0"), NodeSpec("decode", "d0")],
                      settings=settings, log_level="warning") as cl:
        return _replay(cl.api_url("p0"), args, "disaggregated_1p1d")


def run_single(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Replays through one `--role all` process; returns the summary."""
    port = free_port()
    exe = Path(sys.executable).parent / "mooncaked"
    sets = [x for k, v in _engine_settings(args).items() for x in ("--set", f"{k}={v}")]
    with (work / "all.log").open("wb") as log:
        proc = subprocess.Popen([str(exe), "serve", "--role", "all", "--port", str(port),
                                 "--log-level", "warning", *sets], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"role all exited: {(work / 'all.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("role all not ready in 300 s")
            time.sleep(0.2)
        return _replay(url, args, "single_all")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--length-scale", type=float, default=16.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-output-tokens", type=int, default=None)
    ap.add_argument("--concurrency-limit", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 * 1024 * 1024)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--records", type=Path, default=None,
                    help="append every request's token arrival times here (JSON lines)")
    ap.add_argument("--only", choices=("cluster", "single"), default=None,
                    help="run one side only (the other's figures print as missing)")
    args = ap.parse_args(argv)
    empty = dict.fromkeys(KEYS)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        work = Path(tmp)
        ours = run_cluster(args, work) if args.only != "single" else empty
        base = run_single(args, work) if args.only != "cluster" else empty
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "disaggregated_1p1d": {k: ours[k] for k in KEYS},
              "single_all": {k: base[k] for k in KEYS},
              "ratio_1p1d_over_all": {k: _ratio(ours[k], base[k]) for k in KEYS},
              "error_reasons": {"disaggregated_1p1d": ours.get("error_reasons"),
                                "single_all": base.get("error_reasons")}}
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
        return 0
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=f"trace replay: {args.trace.name}, first {args.limit} requests, lengths / "
                    f"{args.length_scale:g}, time x {args.time_scale:g}")
    for c in ("measure", "1 prefill + 1 decode", "one role=all", "ratio"):
        t.add_column(c, justify="right")
    for k in KEYS:
        a, b, r = ours[k], base[k], result["ratio_1p1d_over_all"][k]
        fmt = (lambda x: "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x))
        t.add_row(k, fmt(a), fmt(b), "-" if r is None else f"{r:.2f}")
    Console().print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
