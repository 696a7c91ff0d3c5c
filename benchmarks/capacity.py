"""Effective request capacity: 1 prefill + 1 decode against 2 coupled nodes (issue 13).

`mooncake bench capacity TRACE` (or `python -m mooncaked.benchmarks.capacity TRACE`)
replays a slice of a Mooncake-format trace (lengths scaled as `bench trace` does) at a
sweep of arrival rates against

  pd:       a cache node (API front end, conductor) + 1 prefill + 1 decode node;
  coupled:  a cache node (API front end, conductor) + 2 coupled nodes (role all,
            cluster.coupled: chunked prefill and decode in one engine, vLLM-style),

one side after the other in the same run, on the same machine, with the same torch
threads per model node (`--threads`), the same KV cache size and the same SLOs, which
both conductors and every decode/coupled node enforce (early 429s).

The SLOs are multiples of unloaded times measured first on one `--role all` process
with the same threads: TTFT <= ttft_mult x (unloaded TTFT of the slice's median
prompt) and TBT <= tbt_mult x (unloaded decode step time). The paper's TBT of a
request is the mean of its longest 10% inter-token gaps (section 5).

Arrivals: the slice's requests in trace order at Poisson arrivals (fixed seed) of each
rate; each rate's requests carry their own cache salt, so a rate never hits another
rate's prefixes (within a rate the trace's shared prefixes hit as they would). Rates
are given in requests per second, or by default as fractions of the unloaded prefill
rate (1 / unloaded TTFT).

Admission (`--admission`, default both): capacity is measured as a cluster runs by default,
with both sides' conductors and decode/coupled nodes enforcing (a request predicted to
miss is refused early, so it does not hold the queue); then the pd side replays its rates
up to its capacity again (admission_audit) to tell which refusals were false and which
admitted requests missed. `--audit holdout` (the default) replays them enforcing but
admitting the predicted misses of `--holdout-share` of the requests, drawn by request id
(conductor.admission_holdout), which are judged near the load an enforcing cluster runs
at (the smaller the share, the nearer, and the fewer judged); `--audit shadow` admits
every predicted miss, so all are judged, but in a cluster that also serves what
enforcing turned away, busier than the one it audits. Either way the capacity run
bounds its own false rejections: at most its refusals (`false_rejection_share_at_most`,
target `pd_false_rejection_bound_le_5pct_up_to_capacity`).

Per rate and side: share within both SLOs (effective request capacity; rejected and
failed requests are misses), rejected and failed counts, TTFT and TBT p50/p90/p99,
output tokens/s, the longest inter-token gap, the decode nodes' median step time and
the gaps longer than 5x it. Then the highest rate with >= 90% within both SLOs per side
and their ratio (pd / coupled). `--json` prints one object (`results`, `capacity`,
`capacity_ratio`, `slo`, `config`); a PNG plots share-within-SLO against rate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from mooncaked.benchmarks.capacity_stats import (admission_figures, capacity_ratio_ci, met_slo,
                                                  refine_rate, share_ci)
from mooncaked.cluster.launcher import LocalCluster, NodeSpec, control_call
from mooncaked.ports import free_port
from mooncaked.measures import percentile
from mooncaked.replay.runner import ReplayConfig, RequestRecord, discover_server, replay
from mooncaked.replay.trace import TraceRequest, load_trace, shared_trace_path

SIDES = ("pd", "coupled")
PASS_SHARE = 0.9           # "capacity": the highest rate where this share meets both SLOs
STALL_FACTOR = 5.0         # a gap over this x the decode nodes' median step is a stall


def _gaps(r: RequestRecord) -> list[float]:
    return [b - a for a, b in itertools.pairwise(r.token_times_s)]


def _pct(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q), 4) if xs else None


def summarize_rate(records: list[RequestRecord], wall_s: float, ttft_slo: float, tbt_slo: float,
                   median_step_s: float | None) -> dict[str, Any]:
    """The per-(rate, side) figures from one replay (see the module doc)."""
    done = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tbts = [r.tbt_s for r in done if r.tbt_s is not None]
    within = sum(1 for r in done if r.ttft_s is not None and r.ttft_s <= ttft_slo
                 and (r.tbt_s is None or r.tbt_s <= tbt_slo))
    gaps = [g for r in done for g in _gaps(r)]
    out_tok = sum(r.output_tokens or 0 for r in done)
    starts = [r.sent_s for r in records if r.sent_s is not None]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (max(ends) - min(starts)) if starts and ends else wall_s
    stall = STALL_FACTOR * median_step_s if median_step_s else None
    return {
        "requests": len(records), "completed": len(done),
        "rejected": sum(1 for r in records if r.rejected),
        "failed": sum(1 for r in records if not r.ok and not r.rejected),
        "within_slo": within, "share_within_slo": round(within / len(records), 4) if records
        else None,
        "ttft_p50_s": _pct(ttfts, 50), "ttft_p90_s": _pct(ttfts, 90), "ttft_p99_s": _pct(ttfts, 99),
        "tbt_p50_s": _pct(tbts, 50), "tbt_p90_s": _pct(tbts, 90), "tbt_p99_s": _pct(tbts, 99),
        "output_tok_s": round(out_tok / duration, 3) if duration > 0 else None,
        "longest_gap_s": round(max(gaps), 4) if gaps else None,
        "median_step_s": round(median_step_s, 5) if median_step_s else None,
        "gaps_over_5x_step": sum(1 for g in gaps if g > stall) if stall else None,
        "duration_s": round(duration, 2),
        "errors": sorted({(r.error or "")[:160] for r in records if r.error and not r.rejected})[:3],
    }


def capacity(results: list[dict[str, Any]], side: str) -> float | None:
    """The highest rate (req/s) at which >= PASS_SHARE of `side`'s requests met both SLOs
    (None when none did)."""
    ok = [r["rate"] for r in results if r["side"] == side
          and (r["share_within_slo"] or 0) >= PASS_SHARE]
    return max(ok) if ok else None


# ---------------------------------------------------------------------------- processes


def _wait_health(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in {timeout_s} s")
        time.sleep(0.25)    # poll interval; readiness is /health


def _step_sum_count(url: str, kind: str = "decode") -> tuple[float, float]:
    """(sum, count) of mooncaked_engine_step_seconds{kind} from a node's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith(f'mooncaked_engine_step_seconds_sum{{kind="{kind}"}}'):
            s = float(line.split()[-1])
        elif line.startswith(f'mooncaked_engine_step_seconds_count{{kind="{kind}"}}'):
            c = float(line.split()[-1])
    return s, c


def _one(url: str, model: str, prompt: list[int], max_tokens: int, salt: str) -> float:
    """Sends one streamed request; returns its TTFT (s)."""
    body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                         "ignore_eos": True, "stream": True, "temperature": 0,
                         "cache_salt": salt})
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("calibration request returned no token")
    return ttft


def calibrate(args: argparse.Namespace, work: Path, prompt_tokens: int) -> dict[str, float]:
    """Unloaded TTFT of a prompt of `prompt_tokens` tokens and unloaded decode step time, on
    one `--role all` process with the benchmark's threads and KV size."""
    port = free_port()
    exe = Path(sys.executable).parent / "mooncaked"
    log = work / "calibrate.log"
    sets = [x for k, v in _engine_settings(args).items() for x in ("--set", f"{k}={v}")]
    with log.open("wb") as f:
        proc = subprocess.Popen([str(exe), "serve", "--role", "all", "--port", str(port),
                                 "--log-level", "warning", *sets], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc, log, 300)
        info = asyncio.run(discover_server(url))
        rng = random.Random(1)
        vocab = info["vocab_size"] or 49152
        ttfts, steps = [], []
        for i in range(3):            # the first warms up
            prompt = [rng.randrange(1000, vocab) for _ in range(prompt_tokens)]
            s0, c0 = _step_sum_count(url)
            ttfts.append(_one(url, info["model"], prompt, 16, f"calibrate-{i}"))
            s1, c1 = _step_sum_count(url)
            if c1 > c0:
                steps.append((s1 - s0) / (c1 - c0))
        return {"unloaded_ttft_s": statistics.median(ttfts[1:]),
                "unloaded_step_s": statistics.median(steps[1:] or steps)}
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"engine.kv_cache_bytes": args.kv_cache_bytes, "model.num_threads": args.threads,
            "server.request_timeout_s": args.timeout}


def _nodes(side: str) -> list[NodeSpec]:
    if side == "pd":
        return [NodeSpec("cache", "c0"), NodeSpec("prefill", "p0"), NodeSpec("decode", "d0")]
    return [NodeSpec("cache", "c0"), *(NodeSpec("all", f"a{i}", settings={"cluster.coupled": True})
                                       for i in range(2))]


def _median_step(cl: LocalCluster, side: str) -> float | None:
    """Median recent decode step (s) of the side's decode or coupled nodes (node.status)."""
    meds = []
    for nid in (["d0"] if side == "pd" else ["a0", "a1"]):
        try:
            st = control_call(cl.control(nid), "node.status", timeout_s=10)
        except (OSError, RuntimeError):
            continue
        p50 = st["stalls"]["step"]["decode"]["p50_s"]
        if p50:
            meds.append(p50)
    return statistics.median(meds) if meds else None


def _loop_stats(cl: LocalCluster) -> dict[str, Any]:
    """Per node: event-loop lag p99 / max and (front end) relay delay p50 / p99, seconds,
    over each node's recent window (node.status "stalls")."""
    out = {}
    for nid in cl.nodes:
        try:
            st = control_call(cl.control(nid), "node.status", timeout_s=10)["stalls"]
        except (OSError, RuntimeError, KeyError):
            continue
        lag, rel = st["loop_lag"], st["relay_delay"]
        out[nid] = {"loop_lag_p99_s": lag["p99_s"], "loop_lag_max_s": lag["max_s"]}
        if rel["count"]:
            out[nid].update(relay_p50_s=rel["p50_s"], relay_p99_s=rel["p99_s"])
    return out


def overrides(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> settings: each value read as a TOML value (false, 3,
    "x"), else taken as a string. Raises: ValueError for an item without '='."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def _ledgers(cl: LocalCluster, side: str, records: list[RequestRecord]
             ) -> dict[str, list[dict[str, Any]]]:
    """Request id (the API's X-Request-Id) -> the admission decisions every check made for
    it: the conductor's (on c0) and the decode or coupled nodes' (`admission.ledger`)."""
    ids = {f"{r.request_id}-0": r.request_id for r in records if r.request_id}
    out: dict[str, list[dict[str, Any]]] = {}
    for nid in ["c0", *(["d0"] if side == "pd" else ["a0", "a1"])]:
        try:
            led = control_call(cl.control(nid), "admission.ledger", {"rids": sorted(ids)},
                               timeout_s=10)
        except (OSError, RuntimeError):
            continue
        for part in ("conductor", "node_check"):
            for rid, d in ((led.get(part) or {}).get("decisions") or {}).items():
                out.setdefault(ids[rid], []).append({**d, "check": f"{nid}:{part}"})
    return out


def run_side(side: str, args: argparse.Namespace, work: Path, requests: list[TraceRequest],
             rates: list[float], slo: dict[str, float], log: Any,
             extra: dict[str, Any] | None = None, refine_steps: int = 0,
             prior: list[dict[str, Any]] | None = None, admission: str = "enforce",
             indices: list[int] | None = None, holdout: float = 0.0) -> list[dict[str, Any]]:
    """Starts one side, replays the slice at every rate, then at up to `refine_steps` rates
    that narrow its capacity (capacity_stats.refine_rate, over `prior` and these results),
    stops it; one result per rate, a refined one marked "refined".

    `extra`: settings for every node (the coupled side's token budget); `prior`: results
    already measured on this side (their count offsets the rate index, which seeds the
    arrivals and salts the cache, so a refined rate neither repeats a grid rate's arrivals
    nor hits its prefixes); `admission`: conductor.admission and conductor.node_admission
    (enforce or shadow); `holdout`: conductor.admission_holdout (enforcing, the share of
    predicted misses admitted as shadow); `indices`: each rate's index instead (an audit
    replays a rate's arrivals exactly)."""
    prior = list(prior or [])
    plan = list(zip(rates, indices or itertools.count(len(prior)), itertools.repeat(False)))
    settings = {**_engine_settings(args), "conductor.ttft_slo_s": slo["ttft_slo_s"],
                "conductor.tbt_slo_s": slo["tbt_slo_s"], "store.dram_bytes": args.kv_cache_bytes,
                "cluster.stream_idle_timeout_s": max(15.0, 3 * slo["ttft_slo_s"]),
                "conductor.admission": admission,
                "conductor.node_admission": admission,
                "conductor.admission_holdout": holdout, **(extra or {}),
                **overrides(args.overrides)}
    share = settings["conductor.admission_holdout"]        # a --set may have changed it
    label = f"{admission}, holdout {share}" if share and admission == "enforce" else admission
    nodes = _nodes(side)
    # die_with_parent: a benchmark killed mid-run takes its nodes with it
    cl = LocalCluster(work / side, nodes, settings=settings, log_level="warning",
                      die_with_parent=True)
    out = []
    try:
        cl.start_backend()
        cl.start_node("c0")                   # first: it leads (runs the conductor)
        cl.wait_ready(300, nodes=["c0"])
        for n in nodes[1:]:
            cl.start_node(n.node_id)
        cl.wait_ready(600)
        url = cl.api_url("c0")
        info = asyncio.run(discover_server(url))
        vocab = info["vocab_size"] or 49152
        # warm-up: one request through the whole path (not counted)
        _one(url, info["model"], [1000 + i for i in range(32)], 4, f"warmup-{side}")
        while True:
            if plan:
                rate, k, refined = plan.pop(0)
            else:
                rate = _next_refined_rate(side, prior + out) if refine_steps > 0 else None
                if rate is None:
                    break
                k, refine_steps, refined = len(prior) + len(out), refine_steps - 1, True
                log(f"{side:8s} refining its capacity at {rate:.4f} req/s")
            rng = random.Random(args.seed + k)
            t, timed = 0.0, []
            for r in requests:
                timed.append(dataclasses.replace(r, timestamp_ms=t * 1000.0))
                t += rng.expovariate(rate)
            cfg = ReplayConfig(url=url, model=info["model"], vocab_size=vocab,
                               length_scale=args.length_scale,
                               max_output_tokens=args.max_output_tokens,
                               timeout_s=args.timeout, cache_salt=f"rate-{k}")
            records, wall = asyncio.run(replay(cfg, timed))
            flags = [int(met_slo(r, slo["ttft_slo_s"], slo["tbt_slo_s"])) for r in records]
            ledgers = _ledgers(cl, side, records)
            res = {"rate": round(rate, 4), "side": side, "refined": refined, "index": k,
                   "admission_mode": label,
                   **summarize_rate(records, wall, slo["ttft_slo_s"], slo["tbt_slo_s"],
                                    _median_step(cl, side)),
                   "share_within_slo_ci": share_ci(flags, seed=args.seed + k),
                   "within_flags": flags,
                   "admission": admission_figures(records, ledgers,
                                                  slo["ttft_slo_s"], slo["tbt_slo_s"]),
                   "loop": _loop_stats(cl)}
            out.append(res)
            adm = res["admission"]
            log(f"{side:8s} rate {rate:.3f}/s ({label}): {res['share_within_slo']:.0%} "
                f"within SLO (90% CI {res['share_within_slo_ci']}), rejected {res['rejected']}, failed "
                f"{res['failed']}, TBT p90 {res['tbt_p90_s']}, longest gap "
                f"{res['longest_gap_s']}; admission: would reject {adm['would_reject']} "
                f"({adm['rejections_judged']} ran), false "
                f"rejections {adm['false_rejections']} (share {adm['false_rejection_share']}, "
                f"at most {adm['false_rejection_share_at_most']}), admitted misses "
                f"{adm['admitted_misses']}, TTFT/step prediction error "
                f"{adm['ttft_pred_mare']}/{adm['step_pred_mare']}")
            if args.records:
                with args.records.open("ab") as f:
                    for r in records:
                        f.write(orjson.dumps({"side": side, "rate": rate,
                                              "admission_mode": label, **r.to_dict(),
                                             "admission": ledgers.get(r.request_id or "", [])})
                                + b"\n")
    finally:
        cl.stop()
    return out


def write_plot(path: Path, results: list[dict[str, Any]], slo: dict[str, float]) -> None:
    """share-within-SLO against rate, one line per side (matplotlib, Agg)."""
    import matplotlib  # noqa: PLC0415  (optional dependency: only the plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"pd": "1 prefill + 1 decode", "coupled": "2 coupled (role all)"}
    for side in SIDES:
        rs = sorted((r for r in results if r["side"] == side), key=lambda r: r["rate"])
        if rs:
            ax.plot([r["rate"] for r in rs], [r["share_within_slo"] for r in rs], marker="o",
                    label=labels[side])
    ax.axhline(PASS_SHARE, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("share within TTFT and TBT SLOs")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"TTFT <= {slo['ttft_slo_s']:.2f} s, TBT <= {slo['tbt_slo_s']:.3f} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (shared by `mooncake bench capacity`)."""
    ap = argparse.ArgumentParser(prog="mooncake bench capacity",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, nargs="?", default=None,
                    help="one trace (default: the conversation trace; see --traces)")
    ap.add_argument("--traces", type=Path, nargs="*", default=None,
                    help="several traces, each swept and reported on its own (ratio, "
                         "interval, plot); the first is the top-level result")
    ap.add_argument("--offset", type=int, default=0, help="first request of the slice")
    ap.add_argument("--limit", type=int, default=60, help="requests in the slice (per rate)")
    ap.add_argument("--length-scale", type=float, default=32.0,
                    help="divide block, input and output lengths by this (as bench trace)")
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--rates", type=float, nargs="*", default=None,
                    help="arrival rates, requests/s (default: --rate-fractions of 1/unloaded TTFT)")
    ap.add_argument("--rate-fractions", type=float, nargs="*",
                    default=[0.25, 0.5, 1.0, 1.5, 2.0])
    ap.add_argument("--ttft-mult", type=float, default=10.0,
                    help="TTFT SLO = this x the unloaded TTFT of the slice's median prompt")
    ap.add_argument("--tbt-mult", type=float, default=5.0,
                    help="TBT SLO = this x the unloaded decode step time")
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (with --tbt-slo: skips "
                    "the calibration; then give --rates)")
    ap.add_argument("--tbt-slo", type=float, default=None, help="seconds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per model node")
    ap.add_argument("--kv-cache-bytes", type=int, default=128 << 20)
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", nargs="*", choices=SIDES, default=list(SIDES))
    ap.add_argument("--admission", choices=("both", "enforce", "shadow"), default="both",
                    help="conductor.admission and conductor.node_admission on both sides: "
                         "enforce (reject the predicted misses, as a cluster runs by default), "
                         "shadow (predict and record, admit all: false rejections and misses "
                         "are measured), or both: capacity with enforce, then pd again "
                         "(--audit) at its rates up to its capacity (admission_audit), which "
                         "the admission targets are judged on")
    ap.add_argument("--audit", choices=("shadow", "holdout"), default="holdout",
                    help="with --admission both, how pd is audited: holdout (enforce, but "
                         "admit the predicted misses of --holdout-share of the requests, "
                         "except a prompt over the TTFT SLO even on an idle cluster (400): "
                         "judged near the enforcing load, fewer of them) or shadow (admit "
                         "every predicted miss: all judged, in a busier cluster than an "
                         "enforcing one); default %(default)s")
    ap.add_argument("--holdout-share", type=float, default=0.25,
                    help="conductor.admission_holdout of the holdout audit, in (0, 1]; "
                         "default %(default)s")
    ap.add_argument("--refine", type=int, default=2,
                    help="steps of capacity refinement after the grid: each measures one more "
                         "rate per side, the geometric midpoint of its bracket (last pass, "
                         "first fail), half the lowest rate if it passed none, twice the "
                         "highest if it passed all; 0: the grid only")
    ap.add_argument("--coupled-chunks", type=int, nargs="*", default=[128, 512],
                    help="token budgets per step (engine.max_num_batched_tokens) tried on "
                         "the coupled side; the one with the highest capacity is reported")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="a setting for every node of both sides "
                    "(e.g. conductor.refit_cost_model=false); repeatable")
    ap.add_argument("--out", type=Path, default=Path("capacity-out"),
                    help="directory for capacity.json and the plots")
    ap.add_argument("--records", type=Path, default=None,
                    help="append every request's record here (JSON lines; with its "
                         "admission decisions)")
    ap.add_argument("--json", action="store_true")
    return ap


def _best_chunk(by_chunk: dict[int, list[dict[str, Any]]]) -> int:
    """The coupled side's token budget with the highest capacity, then the highest mean
    share within SLO over the rates (what a user tuning for the TBT SLO would pick)."""
    def score(chunk: int) -> tuple[float, float]:
        rs = by_chunk[chunk]
        return (capacity(rs, "coupled") or 0.0,
                statistics.fmean(r["share_within_slo"] or 0.0 for r in rs))
    return max(by_chunk, key=score)


def _all_within(rows: list[dict[str, Any]], share: str, bound: float = 0.05) -> bool | None:
    """Whether every row's admission `share` is within `bound`; None when no row measured
    it (no rows, or a share unknown because the check refused instead of shadowing)."""
    known = [r["admission"][share] for r in rows if r["admission"][share] is not None]
    return all(x <= bound for x in known) if known else None


def _next_refined_rate(side: str, results: list[dict[str, Any]]) -> float | None:
    """The next rate (req/s, 4 decimals) that narrows `side`'s capacity, or None when its
    bracket is narrow enough or the rate was measured already."""
    mine = {r["rate"]: r["share_within_slo"] or 0.0 for r in results if r["side"] == side}
    rate = refine_rate(mine, PASS_SHARE)
    return None if rate is None or round(rate, 4) in mine else round(rate, 4)


def run_trace(args: argparse.Namespace, trace: Path, work: Path, log: Any) -> dict[str, Any]:
    """Calibrates and runs both sides on one trace; returns its result object."""
    all_reqs = load_trace(trace, args.offset + args.limit)
    requests = all_reqs[args.offset:args.offset + args.limit]
    if not requests:
        raise ValueError(f"{trace}: the slice is empty")
    from mooncaked.replay.prompts import scale_length  # noqa: PLC0415

    median_in = int(statistics.median(scale_length(r.input_length, args.length_scale)
                                      for r in requests))
    if args.ttft_slo and args.tbt_slo:
        cal: dict[str, Any] = {"unloaded_ttft_s": None, "unloaded_step_s": None}
    else:
        cal = calibrate(args, work, median_in)
        log(f"{trace.name}: unloaded TTFT {cal['unloaded_ttft_s']:.3f} s ({median_in} tokens), "
            f"decode step {cal['unloaded_step_s'] * 1e3:.1f} ms")
    slo = {"ttft_slo_s": args.ttft_slo or args.ttft_mult * cal["unloaded_ttft_s"],
           "tbt_slo_s": args.tbt_slo or args.tbt_mult * cal["unloaded_step_s"], **cal,
           "median_prompt_tokens": median_in}
    rates = args.rates or [round(f / (cal["unloaded_ttft_s"] or 1.0), 4)
                           for f in args.rate_fractions]
    log(f"SLOs: TTFT <= {slo['ttft_slo_s']:.3f} s, TBT <= {slo['tbt_slo_s']:.4f} s; "
        f"rates {rates} req/s")
    results: list[dict[str, Any]] = []
    tuning: dict[str, Any] = {}
    mode = "shadow" if args.admission == "shadow" else "enforce"     # what capacity runs
    for side in args.sides:
        if side == "pd":
            results += run_side(side, args, work / trace.stem, requests, rates, slo, log,
                                refine_steps=args.refine, admission=mode)
            continue
        by_chunk = {}
        for chunk in args.coupled_chunks or [None]:
            extra = {"engine.max_num_batched_tokens": chunk} if chunk else {}
            log(f"coupled: token budget {chunk or 'default'}")
            by_chunk[chunk or 0] = run_side(side, args, work / f"{trace.stem}-{chunk}",
                                            requests, rates, slo, log, extra, admission=mode)
        best = _best_chunk(by_chunk)
        results += by_chunk[best]
        if args.refine and _next_refined_rate(side, by_chunk[best]) is not None:
            log(f"coupled: refining with the token budget {best or 'default'}")
            results += run_side(side, args, work / f"{trace.stem}-{best}-refined", requests,
                                [], slo, log, {"engine.max_num_batched_tokens": best}
                                if best else {}, refine_steps=args.refine,
                                prior=by_chunk[best], admission=mode)
        tuning = {"chosen_chunk_tokens": best or None,
                  "capacity_by_chunk": {str(c): capacity(rs, "coupled")
                                        for c, rs in by_chunk.items()},
                  "results_by_chunk": {str(c): rs for c, rs in by_chunk.items() if c != best}}
    measured = {s: [r["rate"] for r in results if r["side"] == s] for s in args.sides}
    cap = {s: capacity(results, s) for s in args.sides}
    ratio = (cap["pd"] / cap["coupled"]) if cap.get("pd") and cap.get("coupled") else None
    both = [r["rate"] for r in results if r["side"] == "pd"
            and (r["share_within_slo"] or 0) >= PASS_SHARE
            and any(c["rate"] == r["rate"] and (c["share_within_slo"] or 0) >= PASS_SHARE
                    for c in results if c["side"] == "coupled")]
    tbt_ok = all((p["tbt_p90_s"] or 0) <= (c["tbt_p90_s"] or 0)
                 for p in results if p["side"] == "pd" and p["rate"] in both
                 for c in results if c["side"] == "coupled" and c["rate"] == p["rate"]
                 ) if both else None        # no rate where both passed: nothing to compare
    upto = cap.get("pd") or 0
    # up to P/D's capacity: unmeasured (None) without a P/D side or a rate it passed
    stalls = sum(r["gaps_over_5x_step"] or 0 for r in results
                 if r["side"] == "pd" and r["rate"] <= upto) if upto else None
    pd_adm = [r for r in results if r["side"] == "pd" and r["rate"] <= (upto or min(rates))]
    audit: list[dict[str, Any]] = []
    enforced = pd_adm
    if args.admission == "both" and pd_adm:
        # enforcing, a rejected request cannot tell whether it would have met the SLOs: the
        # same arrivals again in shadow (or enforcing with a holdout) count the false
        # rejections and admitted misses
        log(f"pd: admission audit ({args.audit}) " + (
            "up to its capacity" if upto else "at the lowest rate (it passed none)"))
        again = run_side("pd", args, work / f"{trace.stem}-audit", requests,
                         [r["rate"] for r in pd_adm], slo, log,
                         admission="shadow" if args.audit == "shadow" else "enforce",
                         indices=[r["index"] for r in pd_adm],
                         holdout=args.holdout_share if args.audit == "holdout" else 0.0)
        pd_adm = audit = [{**a, "refined": r["refined"]} for a, r in zip(again, pd_adm)]
    # a side that still passes at the highest rate swept has at least that capacity
    censored = {s: cap.get(s) is not None and cap[s] >= max(measured[s]) for s in args.sides}
    ci = capacity_ratio_ci({(r["side"], r["rate"]): r["within_flags"] for r in results},
                           PASS_SHARE, seed=args.seed)
    return {"trace": str(trace), "slo": slo, "rates": rates,
            "refined_rates": {s: [r["rate"] for r in results if r["side"] == s and r["refined"]]
                              for s in args.sides},
            "results": results, "admission_audit": audit,
            "admission_mode": {"capacity": mode, "audit": audit[0]["admission_mode"]
                               if audit else None},
            "capacity": cap, "capacity_at_least": censored,
            "capacity_ratio": round(ratio, 3) if ratio else None,
            # coupled met the SLOs at no rate swept: its capacity is below the lowest rate
            "capacity_ratio_lower_bound": round(cap["pd"] / min(measured["coupled"]), 3)
            if cap.get("pd") and "coupled" in cap and cap["coupled"] is None else None,
            "capacity_ratio_ci": ci, "coupled_tuning": tuning,
            "targets": {"capacity_ratio_ge_1_2": bool(ratio and ratio >= 1.2),
                        "capacity_ratio_ci_low_gt_1": bool(ci and ci[0] > 1.0),
                        # None where not measured: no P/D side, or only refusals
                        "pd_false_rejections_le_5pct_up_to_capacity": _all_within(
                            pd_adm, "false_rejection_share"),
                        # the capacity run itself: every refusal counted false (a bound)
                        "pd_false_rejection_bound_le_5pct_up_to_capacity":
                            _all_within(enforced, "false_rejection_share_at_most")
                            if mode == "enforce" else None,
                        "pd_admitted_misses_le_5pct_up_to_capacity": _all_within(
                            pd_adm, "admitted_miss_share"),
                        "pd_gaps_over_5x_step_up_to_capacity": stalls,
                        "pd_tbt_p90_le_coupled_where_both_pass": tbt_ok,
                        "nothing_hangs": all(r["completed"] + r["rejected"] + r["failed"]
                                             == r["requests"] for r in results)}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs every trace (see the module doc); the first trace's figures are the top level,
    every trace's under "traces"."""
    t_start = time.monotonic()
    traces = list(args.traces or []) or [args.trace or shared_trace_path()]
    if args.trace and args.traces:
        traces = [args.trace, *traces]
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    per: dict[str, dict[str, Any]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        for trace in traces:
            res = run_trace(args, trace, Path(tmp), log)
            per[trace.stem] = res
            try:
                write_plot(args.out / f"capacity-{trace.stem}.png", res["results"], res["slo"])
            except ImportError:
                log("matplotlib missing: no plot")
            log(f"{trace.stem}: capacity {res['capacity']}, ratio {res['capacity_ratio']} "
                f"(90% CI {res['capacity_ratio_ci']})")
    first = per[traces[0].stem]
    out = {"config": {k: (str(v) if isinstance(v, Path) else
                          [str(x) for x in v] if isinstance(v, list) and v
                          and isinstance(v[0], Path) else v) for k, v in vars(args).items()},
           **{k: v for k, v in first.items() if k != "trace"},
           "traces": {name: {k: v for k, v in r.items() if k not in ("results",
                                                                     "admission_audit")}
                      for name, r in per.items()},
           "wall_s": round(time.monotonic() - t_start, 1)}
    (args.out / "capacity.json").write_bytes(orjson.dumps(
        {**out, "traces": {n: r for n, r in per.items()}}, option=orjson.OPT_INDENT_2))
    try:
        write_plot(args.out / "capacity.png", first["results"], first["slo"])
    except ImportError:
        pass
    return out


def render(out: dict[str, Any]) -> None:
    """A table per side (rich)."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    cols = ("rate", "side", "share_within_slo", "rejected", "failed", "ttft_p50_s", "ttft_p90_s",
            "tbt_p50_s", "tbt_p90_s", "output_tok_s", "longest_gap_s", "median_step_s",
            "gaps_over_5x_step")
    acols = ("would_reject", "rejections_judged", "false_rejections", "false_rejection_share",
             "false_rejection_share_at_most", "admitted_misses", "ttft_pred_mare",
             "step_pred_mare")
    t = Table(title=f"effective request capacity: TTFT <= {out['slo']['ttft_slo_s']:.2f} s, "
                    f"TBT <= {out['slo']['tbt_slo_s']:.3f} s")
    for c in (*cols, "share_ci", *acols):
        t.add_column(c, justify="right")

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    for r in sorted(out["results"] + out.get("admission_audit", []),
                    key=lambda r: (r["rate"], r["side"], r.get("admission_mode", ""))):
        row = {**r, "side": f"{r['side']} ({r.get('admission_mode', '-')})"}
        t.add_row(*(fmt(row.get(c)) for c in cols), fmt(r.get("share_within_slo_ci")),
                  *(fmt(r["admission"].get(c)) for c in acols))
    Console(width=260).print(t)
    print(f"capacity (req/s at >= 90% within SLO): {out['capacity']} (a lower bound where "
          f"{out['capacity_at_least']}); ratio pd/coupled {out['capacity_ratio']} (90% CI "
          f"{out['capacity_ratio_ci']}); coupled token budget "
          f"{out['coupled_tuning'].get('chosen_chunk_tokens')}; targets {out['targets']}; "
          f"{out['wall_s']} s")
    for name, tr in out["traces"].items():
        print(f"  {name}: capacity {tr['capacity']}, ratio {tr['capacity_ratio']} (90% CI "
              f"{tr['capacity_ratio_ci']}, lower bound {tr['capacity_ratio_lower_bound']})")


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses, before any node starts, what would fail later (argparse's one-line error,
    exit 2): a trace that is not a file, an empty slice, and both SLOs given without
    --rates (the default rates are fractions of the unloaded TTFT that the calibration
    measures, and both SLOs skip it)."""
    for t in [*(args.traces or []), *([args.trace] if args.trace else [])]:
        if not t.is_file():
            ap.error(f"{t}: no such trace file")
    if args.limit < 1:
        ap.error(f"--limit {args.limit}: the slice needs at least one request")
    if (args.admission == "both" and args.audit == "holdout"
            and not 0 < args.holdout_share <= 1):
        ap.error(f"--holdout-share {args.holdout_share}: a share in (0, 1]")
    if args.ttft_slo and args.tbt_slo and not args.rates:
        ap.error("--ttft-slo and --tbt-slo skip the calibration the default rates come "
                 "from (fractions of the unloaded TTFT): give --rates in requests/s")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)
    out = run(args)
    if args.json:
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
    else:
        render(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
