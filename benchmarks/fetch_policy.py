"""Fetch or recompute by the measured bandwidth (issue 34): `mooncake bench trace --hosts
--link-rate 1gbit --link-rate 100mbit`.

For each link rate, one cluster per `conductor.fetch_policy` (adaptive: fetch when the
predicted transfer at the measured path rate plus the shorter prefill beats recomputing;
always; never), all three up at once, each a cluster of hosts on this machine
(cluster/hosts.py: every node in a network namespace of its own, every link shaped to the
rate by tc tbf):

  cache0    the API front end and the conductor (it starts first and leads); a large
            store, where the conductor replicates hot prefixes (conductor.hot_block_hits);
  prefill0  a small KV cache and a small store (`--prefill-kv-bytes`): it forgets a
            prefix soon after computing it, as one prefill node among many would find
            most prefixes elsewhere in the pool;
  decode0   keeps every finished request's prompt and output in its store
            (store.decode_offload), a fetch source for the next turn.

So a request's prefix is mostly held by cache0 or decode0 and not by prefill0: the prefill
node fetches it over its shaped link or recomputes it, as the policy decides. Each cluster
first serves `WARMUP` requests of its own (not counted: they calibrate the conductor's
prefill model and let the transfer engines measure the link, which the conductor places
with). Then every request of the inputs goes to the three clusters in turn, one request
in flight at a time, the order rotating per request (`interleaved`): the policies see the
same load of this shared machine, and TTFT is the decision's cost, not a queue.

Inputs (each replayed and reported on its own, and pooled per rate):
  - a subset of the shared conversation trace with shared prefixes: whole conversations
    (requests sharing their first two blocks), first appearance first, prompts at most
    `--max-input` trace tokens, until `--limit` requests;
  - the same kind of subset of a generated trace (mooncaked.sim.gen, `mooncake
    gen-trace`: Poisson sessions over shared system prompts, multi-turn), so the result
    does not rest on one trace.

Per rate, policy and input: TTFT mean and p90 (s), prefix tokens reused from the prefill
node's own cache, fetched and recomputed (recomputed = the reusable prefix, the longest
run of full blocks an earlier request of the input shared, less what was reused), their
shares, the bytes fetched, and the rate the conductor placed with. Per rate:
`adaptive_vs_best_fixed_ttft_mean` = adaptive's pooled TTFT mean / the better fixed
policy's (target <= 1.05), and the same for p90. `--json` prints one object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from mooncaked.config import Settings
from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call
from mooncaked.measures import percentile
from mooncaked.replay.prompts import PromptBuilder
from mooncaked.replay.runner import ReplayConfig, RequestRecord, discover_server, replay
from mooncaked.replay.trace import TraceRequest, load_trace, shared_trace_path
from mooncaked.sim.gen import GenConfig, generate

POLICIES = ("adaptive", "always", "never")
# requests per cluster before the measured ones (not counted), of lengths spread over
# WARMUP_TOKENS: two calibrations of the conductor's prefill model (refit.CALIBRATE_EVERY
# timed steps each) before the first measured placement, and the link measured
WARMUP = 16
WARMUP_TOKENS = (64, 1024)
GROUP_MAX = 8                    # a block shared by more requests is a system prompt's
TARGET = 1.05                    # adaptive's TTFT mean within 5% of the better fixed policy
# the generated input: a few minutes of sessions, shorter think times than a chat user's so
# that a session's turns fall inside the subset
GEN = GenConfig(seed=7, duration_s=900.0, session_rate_rps=0.05, system_prompts=20,
                mean_turns=4.0, think_s=20.0, input_median=2000.0)


def shared_prefix_subset(requests: list[TraceRequest], limit: int, max_input: int
                         ) -> list[TraceRequest]:
    """Whole conversations, in order of first appearance, until `limit` requests: a
    conversation is the requests whose first block shared by 2..GROUP_MAX requests (of
    those with prompts up to `max_input` trace tokens) is the same block;
    prompts longer than `max_input` trace tokens are left out. Sent turn by turn: every
    group's first request (in trace order), then every group's second, and so on."""
    kept = [r for r in requests if r.input_length <= max_input]
    counts = collections.Counter(h for r in kept for h in set(r.hash_ids))
    groups: dict[int, list[TraceRequest]] = collections.defaultdict(list)
    for r in kept:
        # its conversation: the first block it shares with a few others only (a system
        # prompt's blocks are shared by many)
        key = next((h for h in r.hash_ids if 2 <= counts[h] <= GROUP_MAX), None)
        if key is not None:
            groups[key].append(r)
    out: list[TraceRequest] = []
    for members in groups.values():
        if len(members) >= 2 and len(out) < limit:
            out += members[:limit - len(out)]
    # turn by turn: each group's first request, then each group's second, ...: in the
    # trace many other requests come between two turns of a conversation, so a prefill
    # node has served others (and may have evicted the prefix) when the next turn comes
    turn = {id(r): k for members in groups.values() for k, r in enumerate(members)}
    return sorted(out, key=lambda r: (turn[id(r)], r.timestamp_ms, r.index))


def generated_requests() -> list[TraceRequest]:
    """The generated trace (GEN) as TraceRequests."""
    return [TraceRequest(index=i, timestamp_ms=float(d["timestamp"]),
                         input_length=int(d["input_length"]),
                         output_length=int(d["output_length"]),
                         hash_ids=tuple(int(h) for h in d["hash_ids"]))
            for i, d in enumerate(generate(GEN))]


def reusable_tokens(prompts: list[list[int]], block_size: int) -> list[int]:
    """Per prompt, the tokens of its longest prefix of full blocks (block_size tokens, as
    the engine keys them) that an earlier prompt of the list also began with: what an
    unbounded cluster-wide cache could reuse. At most len(prompt) - 1 (the last token is
    always computed)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        full = (len(p) - 1) // block_size
        k = 0
        while k < full and tuple(p[:(k + 1) * block_size]) in seen:
            k += 1
        out.append(k * block_size)
        seen.update(tuple(p[:(j + 1) * block_size]) for j in range(len(p) // block_size))
    return out


def _nodes(args: argparse.Namespace) -> list[NodeSpec]:
    small = {"engine.kv_cache_bytes": args.prefill_kv_bytes,
             "store.dram_bytes": args.prefill_kv_bytes}
    return [NodeSpec("cache", "cache0", settings={"store.dram_bytes": args.pool_bytes}),
            NodeSpec("prefill", "prefill0", settings=small),
            NodeSpec("decode", "decode0", settings={"store.dram_bytes": args.pool_bytes})]


def _status(cl: LocalCluster, nid: str) -> dict:
    return control_call(cl.control(nid), "node.status", timeout_s=10)


def _warm_up(cl: LocalCluster, url: str, model: str, vocab: int, timeout_s: float) -> None:
    """WARMUP requests of their own (distinct prompts of lengths across WARMUP_TOKENS),
    then waits until the conductor places with a measured path rate.
    Raises: RuntimeError when one fails or no link is measured within 60 s."""
    rng = random.Random(1)
    warm = [TraceRequest(index=i, timestamp_ms=0.0, input_length=rng.randint(*WARMUP_TOKENS),
                         output_length=2, hash_ids=(10**9 + rng.randrange(10**9),))
            for i in range(WARMUP)]
    cfg = ReplayConfig(url=url, model=model, vocab_size=vocab, time_scale=0.0,
                       concurrency_limit=1, timeout_s=timeout_s, cache_salt="warmup")
    records, _ = asyncio.run(replay(cfg, warm))
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")
    deadline = time.monotonic() + 60
    while not ((cl.status() or {}).get("transfer_bandwidth") or {}).get("measured_paths"):
        if time.monotonic() > deadline:
            raise RuntimeError("no measured link after the warm-up (60 s)")
        time.sleep(0.5)             # poll interval; the nodes report every report_interval_s


async def interleaved(cfgs: dict[str, ReplayConfig], requests: list[TraceRequest]
                      ) -> dict[str, list[RequestRecord]]:
    """Each request sent to every cluster in turn (policy -> its replay config), one
    request in flight at a time, the order of the clusters rotating by one per request:
    the policies are compared under the same load of this shared machine, none always
    first. Returns policy -> its records in request order."""
    out: dict[str, list[RequestRecord]] = {p: [] for p in cfgs}
    order = list(cfgs)
    for k, r in enumerate(requests):
        for p in order[k % len(order):] + order[:k % len(order)]:
            records, _ = await replay(cfgs[p], [r])
            out[p] += records
    return out


def _figures(records: list[RequestRecord], reusable: list[int], fetched_blocks: int,
             block_size: int, block_bytes: int) -> dict[str, Any]:
    """TTFT and the prefix split of one replay (see the module doc)."""
    done = [r for r in records if r.ok and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in done]
    cached = sum(r.cached_tokens or 0 for r in done)
    fetched = fetched_blocks * block_size
    prefix = sum(reusable)
    recomputed = max(0, prefix - cached)
    share = (lambda x: round(x / prefix, 4) if prefix else None)
    return {"requests": len(records), "completed": len(done),
            "failed": len(records) - len(done),
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 4) if ttfts else None,
            "prompt_tokens": sum(r.prompt_tokens or r.sent_prompt_tokens for r in records),
            "reusable_prefix_tokens": prefix, "cached_tokens": cached,
            "local_prefix_tokens": max(0, cached - fetched), "fetched_tokens": fetched,
            "recomputed_prefix_tokens": recomputed,
            "fetched_share": share(fetched), "recomputed_share": share(recomputed),
            "local_share": share(max(0, cached - fetched)),
            "fetched_bytes": fetched_blocks * block_bytes,
            "errors": sorted({(r.error or "")[:160] for r in records if r.error})[:3],
            "_ttfts": ttfts}


def _cluster(args: argparse.Namespace, work: Path, rate: str, policy: str) -> LocalCluster:
    settings = {"conductor.fetch_policy": policy, "conductor.ttft_slo_s": float("inf"),
                "conductor.tbt_slo_s": float("inf"), "conductor.admission": "off",
                "conductor.node_admission": "off", "model.num_threads": args.threads,
                "engine.kv_cache_bytes": args.kv_bytes,
                "server.request_timeout_s": args.timeout, **args.settings}
    return LocalCluster(work / f"{rate}-{policy}", _nodes(args), settings=settings,
                        hosts=True, link_rate=rate, log_level="warning")


def run_rate(args: argparse.Namespace, work: Path, rate: str,
             inputs: dict[str, list[TraceRequest]], log: Any) -> list[dict[str, Any]]:
    """One cluster per policy at `rate`, all up at once: warm-up, then every input with
    its requests interleaved over the clusters (`interleaved`); one result per policy."""
    clusters = {p: _cluster(args, work, rate, p) for p in args.policies}
    try:
        for cl in clusters.values():
            cl.start_backend()
            cl.start_node("cache0")              # first: it leads (runs the conductor)
        for cl in clusters.values():
            cl.wait_ready(300, nodes=["cache0"])
            cl.start_node("prefill0")
            cl.start_node("decode0")
        for cl in clusters.values():
            cl.wait_ready(900)
        urls = {p: cl.api_url("cache0") for p, cl in clusters.items()}
        info = asyncio.run(discover_server(next(iter(urls.values()))))
        vocab = info["vocab_size"] or 49152
        bb = int(_status(clusters[args.policies[0]], "prefill0")["store"]["block_bytes"])
        bs = int(clusters[args.policies[0]].settings.get("engine.block_size",
                                                          Settings().engine.block_size))
        for p, cl in clusters.items():
            _warm_up(cl, urls[p], info["model"], vocab, args.timeout)
        out = {p: {"rate": rate, "policy": p, "inputs": {}} for p in clusters}
        for name, reqs in inputs.items():
            builder = PromptBuilder(vocab, args.length_scale)
            reusable = reusable_tokens([builder.prompt(r) for r in reqs], bs)
            before = {p: _status(cl, "prefill0")["kv_transfer"] for p, cl in clusters.items()}
            cfgs = {p: ReplayConfig(url=urls[p], model=info["model"], vocab_size=vocab,
                                    time_scale=0.0, length_scale=args.length_scale,
                                    max_output_tokens=args.max_output_tokens,
                                    timeout_s=args.timeout, cache_salt=name)
                    for p in clusters}
            records = asyncio.run(interleaved(cfgs, reqs))
            for p, cl in clusters.items():
                after = _status(cl, "prefill0")["kv_transfer"]
                fig = _figures(records[p], reusable,
                               after["fetched_blocks"] - before[p]["fetched_blocks"], bs, bb)
                fig["fetch_failed"] = after["fetch_failed"] - before[p]["fetch_failed"]
                out[p]["inputs"][name] = fig
                log(f"{rate:>8s} {p:8s} {name:10s}: TTFT mean {fig['ttft_mean_s']} s p90 "
                    f"{fig['ttft_p90_s']} s; prefix fetched {fig['fetched_share']} recomputed "
                    f"{fig['recomputed_share']} local {fig['local_share']}; "
                    f"{fig['fetched_bytes'] / 1e6:.1f} MB fetched; failed {fig['failed']}")
        for p, cl in clusters.items():
            bw = (cl.status() or {}).get("transfer_bandwidth") or {}
            out[p]["placed_with_bytes_per_s"] = bw.get("used_bytes_per_s")
            out[p]["measured_paths"] = bw.get("measured_paths")
        return list(out.values())
    finally:
        for cl in clusters.values():
            cl.stop()


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summarize_rate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures of one rate's runs (every input's requests together) and adaptive
    against the better fixed policy."""
    pooled: dict[str, dict[str, Any]] = {}
    for run in runs:
        figs = list(run["inputs"].values())
        ttfts = [t for f in figs for t in f["_ttfts"]]
        prefix = sum(f["reusable_prefix_tokens"] for f in figs)
        fetched = sum(f["fetched_tokens"] for f in figs)
        recomputed = sum(f["recomputed_prefix_tokens"] for f in figs)
        pooled[run["policy"]] = {
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 4) if ttfts else None,
            "fetched_share": round(fetched / prefix, 4) if prefix else None,
            "recomputed_share": round(recomputed / prefix, 4) if prefix else None,
            "fetched_bytes": sum(f["fetched_bytes"] for f in figs),
            "failed": sum(f["failed"] for f in figs)}
    out: dict[str, Any] = {"pooled": pooled}
    fixed = [p for p in ("always", "never") if p in pooled]
    if "adaptive" in pooled and fixed:
        for k in ("ttft_mean_s", "ttft_p90_s"):
            vals = [pooled[p][k] for p in fixed if pooled[p][k] is not None]
            out[f"adaptive_vs_best_fixed_{k.removesuffix('_s')}"] = _ratio(
                pooled["adaptive"][k], min(vals) if vals else None)
        r = out.get("adaptive_vs_best_fixed_ttft_mean")
        out["target_met"] = r is not None and r <= TARGET
    return out


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (`mooncake bench trace --hosts` passes its own)."""
    ap = argparse.ArgumentParser(prog="mooncake bench trace --hosts",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=None,
                    help="Mooncake-format trace (default: the shared conversation trace)")
    ap.add_argument("--link-rate", dest="rates", action="append", default=None,
                    help="tc rate of every link, repeatable (default: 1gbit and 100mbit)")
    ap.add_argument("--policies", nargs="*", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--limit", type=int, default=30, help="requests per input")
    ap.add_argument("--max-input", type=int, default=24000,
                    help="longest prompt kept, trace tokens (before --length-scale)")
    ap.add_argument("--window", type=int, default=3000,
                    help="the trace's first N requests the subset is taken from")
    ap.add_argument("--length-scale", type=float, default=16.0)
    ap.add_argument("--max-output-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per model node")
    ap.add_argument("--kv-bytes", type=int, default=256 << 20, help="decode node's KV cache")
    ap.add_argument("--prefill-kv-bytes", type=int, default=96 << 20,
                    help="the prefill node's KV cache and store (small: it forgets)")
    ap.add_argument("--pool-bytes", type=int, default=512 << 20,
                    help="the cache and decode nodes' stores")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, s")
    ap.add_argument("--no-generated", action="store_true",
                    help="replay the trace's subset only")
    ap.add_argument("--json", action="store_true")
    return ap


def run(args: argparse.Namespace, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every rate x policy (see the module doc); returns the result object."""
    t0 = time.monotonic()
    args.settings = dict(settings or {})
    rates = args.rates or ["1gbit", "100mbit"]
    trace = args.trace or shared_trace_path()
    if trace is None:
        raise ValueError("no trace given and the shared conversation trace is not found")
    inputs = {"trace": shared_prefix_subset(load_trace(trace, args.window), args.limit,
                                            args.max_input)}
    if not args.no_generated:
        inputs["generated"] = shared_prefix_subset(generated_requests(), args.limit,
                                                   args.max_input)
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp:
        for rate in rates:
            runs += run_rate(args, Path(tmp), rate, inputs, log)
    by_rate = {rate: {"runs": {r["policy"]: {k: v for k, v in r.items()
                                             if k not in ("rate", "policy")}
                               for r in runs if r["rate"] == rate},
                      **summarize_rate([r for r in runs if r["rate"] == rate])}
               for rate in rates}
    for rate in by_rate.values():                 # the raw TTFTs stay out of the output
        for run_ in rate["runs"].values():
            for fig in run_["inputs"].values():
                fig.pop("_ttfts", None)
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "inputs": {n: len(r) for n, r in inputs.items()}, "rates": by_rate,
            "target": TARGET, "wall_s": round(time.monotonic() - t0, 1)}


def render(out: dict[str, Any]) -> None:
    """One table: a row per rate, policy and input (rich), then adaptive's ratios."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title="fetch or recompute by the measured bandwidth (hosts, shaped links)")
    cols = ("rate", "policy", "input", "TTFT mean s", "TTFT p90 s", "fetched", "recomputed",
            "local", "MB fetched", "failed", "placed with MB/s")
    for c in cols:
        t.add_column(c, justify="right")
    fmt = (lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
    for rate, r in out["rates"].items():
        for policy, run_ in r["runs"].items():
            for name, f in run_["inputs"].items():
                bw = run_.get("placed_with_bytes_per_s")
                t.add_row(rate, policy, name, fmt(f["ttft_mean_s"]), fmt(f["ttft_p90_s"]),
                          fmt(f["fetched_share"]), fmt(f["recomputed_share"]),
                          fmt(f["local_share"]), f"{f['fetched_bytes'] / 1e6:.1f}",
                          str(f["failed"]), "-" if bw is None else f"{bw / 1e6:.1f}")
    Console(width=200).print(t)
    for rate, r in out["rates"].items():
        print(f"{rate}: adaptive / best fixed TTFT mean {r.get('adaptive_vs_best_fixed_ttft_mean')}"
              f", p90 {r.get('adaptive_vs_best_fixed_ttft_p90')} (target <= {out['target']}: "
              f"{r.get('target_met')}); pooled {r['pooled']}")
    print(f"{out['wall_s']} s")


def main(argv: list[str] | None = None, settings: dict[str, Any] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parser().parse_args(argv)
    out = run(args, settings)
    if args.json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
    else:
        render(out)
    return 0


__all__ = ["POLICIES", "generated_requests", "main", "reusable_tokens", "run",
           "shared_prefix_subset", "summarize_rate"]

if __name__ == "__main__":
    sys.exit(main())
