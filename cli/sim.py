"""`mooncake sim FILE`: simulate a cluster on a Mooncake-format trace (see mooncaked.sim)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import typer

from .main import app

_PAPER_FIG5 = {"random": 19.65, "load_balancing": 5.27, "local_cache_aware": 3.58,
               "global_cache_aware": 3.07}


def parse_tokens(text: str) -> float:
    """'inf', '3M', '500k', '3e6', '1G' -> tokens (float). Raises typer.BadParameter."""
    t = text.strip().lower()
    if t in ("inf", "unbounded", "infinity"):
        return math.inf
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(t[-1:], 1.0)
    try:
        v = float(t[:-1] if mult != 1.0 else t) * mult
    except ValueError as e:
        raise typer.BadParameter(f"not a token count: {text!r} (try 3M, 500k, inf)") from e
    if v < 0:
        raise typer.BadParameter(f"negative token count: {text!r}")
    return v


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


@app.command("sim")
def sim(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="Mooncake-format trace (.jsonl)."),
    policy: str = typer.Option("global_cache_aware", help="random | load_balancing | local_cache_aware | "
                               "global_cache_aware | cost_aware | coupled; comma-separated for "
                               "several, or 'all'."),
    prefill: int = typer.Option(10, help="Prefill instances (coupled: prefill + decode instances)."),
    decode: int = typer.Option(6, help="Decode instances."),
    cache_tokens: str = typer.Option("inf", help="Block cache per prefill instance, tokens "
                                     "(3M, 500k, inf)."),
    time_scale: float = typer.Option(1.0, help="Multiply arrival times (0.5 = twice the rate)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    cost_model: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                           help="Cost model JSON from `mooncaked profile` "
                                           "(default: the paper's LLaMA3-70B on 8xA800)."),
    bandwidth_gbps: float | None = typer.Option(None, help="Override the network bandwidth, Gbit/s."),
    decode_kv_tokens: str | None = typer.Option(None, help="KV room per decode instance, tokens "
                                                "(default: the paper setting's)."),
    limit: int | None = typer.Option(None, help="Only the first N requests."),
    output_tokens: int | None = typer.Option(None, help="Override every output length "
                                             "(1 = prefill only)."),
    threshold: float = typer.Option(1.5, help="Cache load balancing threshold (best/own prefix)."),
    ttft_slo: float = typer.Option(math.inf, help="Reject when predicted TTFT exceeds this, s."),
    tbt_slo: float = typer.Option(math.inf, help="Reject when predicted TBT exceeds this, s."),
    ttft_threshold: float = typer.Option(30.0, help="TTFT threshold of effective request "
                                         "capacity, s."),
    tbt_threshold: str = typer.Option("0.1,0.2,0.3", help="TBT thresholds of effective request "
                                      "capacity, s, comma-separated (the first is the headline)."),
    seed: int = typer.Option(0, help="Seed of the random policy."),
    fetch_rule: str = typer.Option("", help="threshold | cost: fetch-or-recompute rule (default: "
                                   "the policy's; cost_aware uses cost)."),
    prefill_order: str = typer.Option("", help="fcfs | spf: prefill queue order (default: the "
                                      "policy's; cost_aware uses spf)."),
    decode_rule: str = typer.Option("", help="step | kv_aware: decode placement (default: the "
                                    "policy's; cost_aware uses kv_aware)."),
    aging: float | None = typer.Option(None, help="spf starvation bound: a request waiting this "
                                       "long goes first, s (default: the policy's; 30, "
                                       "cost_aware inf: its bound is relative to FCFS, "
                                       "--fcfs-slack and --fcfs-slack-ratio)."),
    fcfs_slack: float | None = typer.Option(None, help="spf adaptive starvation bound: a request "
                                            "also goes first once it waited its FCFS wait at "
                                            "arrival plus this, s (default: the policy's; "
                                            "cost_aware uses 10; inf = --aging only)."),
    fcfs_slack_ratio: float | None = typer.Option(None, help="spf: the slack is at most this "
                                                  "times the FCFS wait the request saw on "
                                                  "arrival (default: the policy's; cost_aware "
                                                  "uses 1; inf = the fixed slack alone)."),
    spf_bound_rule: str = typer.Option("", help="wait | start: spf keeps the starvation bound on "
                                       "the wait (goes first once waited) or on the start (a "
                                       "shorter prefill runs only if it ends before every "
                                       "waiting bound); default: the policy's (cost_aware: "
                                       "start)."),
    pipeline_under_load_ttft: float = typer.Option(30.0, min=0.0, help="Elastic pipelines while "
                                                   "a prefill node has requests queued: only for a "
                                                   "request missing this TTFT on one node and "
                                                   "meeting it pipelined, s (inf: never; 0: off)."),
    cpp: int = typer.Option(1, min=1, help="Chunked pipeline parallelism: prefill nodes form groups "
                            "of this many pipeline stages (must divide --prefill; 1 = off)."),
    cpp_chunk_tokens: int = typer.Option(4096, min=1, help="Tokens per pipeline chunk (--cpp, "
                                         "--pipeline-stages)."),
    pipeline_stages: int = typer.Option(0, min=0, help="Elastic pipelines: run a request over up "
                                        "to this many idle prefill nodes when predicted faster "
                                        "(default: the policy's; cost_aware uses 4; 1 = off)."),
    plot_dir: Path | None = typer.Option(None, help="Write PNG figures here."),
    sweep: bool = typer.Option(False, "--sweep", help="Find each policy's highest arrival rate with "
                               "effective request capacity >= --target (first policy = baseline)."),
    target: float = typer.Option(0.9, help="Share of requests within thresholds, for --sweep."),
    scan_points: int = typer.Option(16, min=0, help="--sweep: rates scanned around the "
                                    "bisection's answer m, from m*(1-span/4) to m*(1+span), "
                                    "for the highest passing and conservative capacities."),
    scan_span: float = typer.Option(0.1, min=0.0, help="--sweep: the scan's width above m, as a "
                                    "fraction of m."),
    hit_curve: str | None = typer.Option(None, help="Hit rate vs capacity (Figure 9) at these "
                                         "capacities, e.g. 1M,3M,10M,50M,inf; simulates the given "
                                         "policies at each as well."),
) -> None:
    """Discrete-event simulation of N prefill + M decode instances replaying FILE: every
    policy side by side (default), --sweep for capacity, or --hit-curve for hit rates."""
    from rich.console import Console

    from mooncaked.conductor.cost_model import (
        CostModel,
        TransferModel,
        paper_cost_model,
    )
    from mooncaked.conductor.policy import PolicyConfig
    from mooncaked.sim.engine import SIM_POLICIES, SimConfig
    from mooncaked.sim.trace import load_trace

    console = Console(stderr=json_out)
    if not console.is_terminal:
        console.width = max(console.width, 160)
    policies = list(SIM_POLICIES) if policy == "all" else [p.strip() for p in policy.split(",")]
    for p in policies:
        if p not in SIM_POLICIES:
            raise typer.BadParameter(f"unknown policy {p!r}; choose from {', '.join(SIM_POLICIES)}")
    try:
        thresholds = tuple(float(x) for x in tbt_threshold.split(","))
        trace = load_trace(file, limit)
        cost = CostModel.load(cost_model) if cost_model else paper_cost_model()
        if bandwidth_gbps is not None:
            cost = dataclasses.replace(cost, transfer=TransferModel(bandwidth_gbps * 1e9 / 8,
                                                                    cost.transfer.latency_s))
        kw = {} if decode_kv_tokens is None else {"decode_kv_tokens": parse_tokens(decode_kv_tokens)}
        base = SimConfig(policy=policies[0], prefill=prefill, decode=decode,
                         cache_tokens=parse_tokens(cache_tokens), time_scale=time_scale,
                         cache_balance_threshold=threshold, ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
                         ttft_threshold_s=ttft_threshold, tbt_thresholds_s=thresholds,
                         output_tokens=output_tokens, seed=seed, fetch_rule=fetch_rule,
                         prefill_order=prefill_order, decode_rule=decode_rule, aging_s=aging,
                         cpp=cpp, cpp_chunk_tokens=cpp_chunk_tokens,
                         pipeline_stages=pipeline_stages, fcfs_slack_s=fcfs_slack,
                         pipeline_under_load_ttft_s=pipeline_under_load_ttft,
                         fcfs_slack_ratio=fcfs_slack_ratio, spf_bound_rule=spf_bound_rule, **kw)
        for p in policies:    # an unknown rule fails here, before any simulation
            if p != "coupled":
                dataclasses.replace(base, policy=p)
                PolicyConfig(policy=p, fetch_rule=fetch_rule, prefill_order=prefill_order,
                             decode_rule=decode_rule, aging_s=aging,
                             pipeline_stages=pipeline_stages, fcfs_slack_s=fcfs_slack,
                             fcfs_slack_ratio=fcfs_slack_ratio, spf_bound_rule=spf_bound_rule)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    run = _Run(trace, base, policies, thresholds, cost, console, json_out, plot_dir)
    if sweep:
        _sweep(run, target, scan_points, scan_span)
    elif hit_curve:
        _hit_curve(run, [parse_tokens(c) for c in hit_curve.split(",")])
    else:
        _compare(run, file.name, cache_tokens)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every mode of `mooncake sim` works from: the trace, the base SimConfig, the
    policies (the first is the baseline), TBT thresholds (s), the cost model, and where
    the output goes."""

    trace: list
    base: Any
    policies: list[str]
    thresholds: tuple[float, ...]
    cost: Any
    console: Any
    json_out: bool
    plot_dir: Path | None

    def emit_json(self, out: dict) -> None:
        print(json.dumps(_jsonable(out)))


def _sweep(run: _Run, target: float, scan_points: int = 16, scan_span: float = 0.1) -> None:
    """--sweep: each policy's highest arrival rate with effective request capacity >= target
    (the paper's Figure 7 measure), as a table or JSON: the bisection's answer, the highest
    sampled rate that passes, and the highest below which every sampled rate passes."""
    from rich.table import Table

    from mooncaked.sim import plots
    from mooncaked.sim.sweep import capacity_sweep

    def progress(p, mult, res):
        s = res.summary
        run.console.print(f"  {p} x{mult:.3f} ({s['arrival_rate_rps']:.2f} req/s): "
                          f"within thresholds {s['effective_request_capacity_by_tbt']}")
    out = capacity_sweep(run.trace, run.base, run.policies, run.thresholds, target, run.cost,
                         scan_points=scan_points, scan_span=scan_span,
                         on_run=None if run.json_out else progress)
    if run.plot_dir:
        out["plots"] = [str(plots.plot_capacity(out, run.plot_dir / "capacity.png"))]
    if run.json_out:
        run.emit_json(out)
        return
    table = Table(title=f"Highest arrival rate with >= {target:.0%} of requests within "
                        f"TTFT {run.base.ttft_threshold_s:g} s and TBT")
    table.add_column("policy")
    for t in run.thresholds:
        table.add_column(f"TBT {t * 1000:g} ms (req/s)", justify="right")
    ratios = out[f"ratio_vs_{run.policies[0]}"]
    for p, per in out["results"].items():
        table.add_row(p, *[f"{v['arrival_rate_rps']:.2f}  ({ratios[p][k]:.2f}x)"
                           for k, v in per.items()])
    run.console.print(table)
    t = Table(title="Capacity read from every sampled rate (bisection and scan; "
                    "highest passing / conservative = every lower sampled rate passes)")
    t.add_column("policy")
    for thr in run.thresholds:
        t.add_column(f"TBT {thr * 1000:g} ms (req/s)", justify="right")
    hp = out[f"ratio_highest_passing_vs_{run.policies[0]}"]
    cons = out[f"ratio_conservative_vs_{run.policies[0]}"]
    for p, per in out["results"].items():
        t.add_row(p, *[f"{v['highest_passing_rps']:.2f} ({hp[p][k]:.2f}x) / "
                       f"{v['conservative_rps']:.2f} ({cons[p][k]:.2f}x)" for k, v in per.items()])
    run.console.print(t)
    base = run.policies[0]
    for key, title in (("at_trace_rate", "at the trace's own rate"),
                       ("at_baseline_capacity", f"at {base}'s capacity (first threshold)")):
        rows = out.get(key) or {}
        if not rows:
            continue
        t = Table(title=f"TTFT and hit rate {title}: "
                        f"{next(iter(rows.values()))['arrival_rate_rps']:.2f} req/s")
        for c in ("policy", "TTFT mean (s)", "vs base", "TTFT p90 (s)", "TTFT max (s)",
                  "hit rate", "within thresholds"):
            t.add_column(c, justify="left" if c == "policy" else "right")
        for p, r in rows.items():
            t.add_row(p, f"{r['ttft_mean_s']:.2f}",
                      f"{r['ttft_mean_s'] / rows[base]['ttft_mean_s']:.2f}x",
                      f"{r['ttft_p90_s']:.2f}", f"{r['ttft_max_s']:.1f}",
                      f"{r['cache_hit_rate']:.3f}", f"{r['effective_request_capacity']:.3f}")
        run.console.print(t)


def _hit_curve(run: _Run, caps: list[float]) -> None:
    """--hit-curve: cache hit rate against cache capacity (the paper's Figure 9), one cache
    in arrival order and each policy per node."""
    from rich.table import Table

    from mooncaked.sim import plots
    from mooncaked.sim.engine import simulate
    from mooncaked.sim.hitrate import sequential_hit_rate

    base, policies = run.base, run.policies
    seq = [sequential_hit_rate(run.trace, c) for c in caps]
    sims = {p: [simulate(run.trace, dataclasses.replace(base, policy=p, cache_tokens=c), run.cost)
                .summary["cache_hit_rate"] for c in caps] for p in policies}
    out = {"capacities_tokens": caps, "sequential_hit_rate": seq, "simulated_hit_rate": sims,
           "unbounded_hit_rate": sequential_hit_rate(run.trace)}
    if run.plot_dir:
        finite = [i for i, c in enumerate(caps) if math.isfinite(c)]
        nodes = {p: base.prefill if p != "coupled" else base.prefill + base.decode
                 for p in policies}
        out["plots"] = [str(plots.plot_hit_rate_vs_capacity(
            [caps[i] for i in finite], [seq[i] for i in finite],
            run.plot_dir / "hit_rate_vs_capacity.png", unbounded=out["unbounded_hit_rate"],
            points={f"{p} ({nodes[p]} nodes, per node)": [(caps[i], sims[p][i]) for i in finite]
                    for p in policies}))]
    if run.json_out:
        run.emit_json(out)
        return
    table = Table(title="Cache hit rate vs capacity")
    table.add_column("capacity (tokens)", justify="right")
    table.add_column("one cache, in order", justify="right")
    for p in policies:
        table.add_column(f"{p} (per node)", justify="right")
    for i, c in enumerate(caps):
        table.add_row(f"{c:,.0f}" if math.isfinite(c) else "inf", f"{seq[i]:.3f}",
                      *[f"{sims[p][i]:.3f}" for p in policies])
    run.console.print(table)


def _compare(run: _Run, name: str, cache_tokens: str) -> None:
    """The default mode: every policy on the trace, side by side (TTFT, TBT, hit rate,
    effective request capacity), with figures in --plot-dir."""
    from rich.table import Table

    from mooncaked.sim import plots
    from mooncaked.sim.engine import config_dict, simulate

    base, policies, thresholds = run.base, run.policies, run.thresholds
    results = {p: simulate(run.trace, dataclasses.replace(base, policy=p), run.cost)
               for p in policies}
    summaries = {p: r.summary for p, r in results.items()}
    if run.plot_dir:
        d = run.plot_dir
        files = [plots.plot_distributions(results, d / "ttft_tbt_cdf.png", thresholds,
                                          base.ttft_threshold_s),
                 plots.plot_hit_windows(results, d / "hit_rate_over_time.png")]
        for p, r in results.items():
            if p in ("local_cache_aware", "global_cache_aware"):
                files.append(plots.plot_replicas(r, d / f"replicas_{p}.png", base.prefill))
        if set(_PAPER_FIG5) <= set(policies):
            files.append(plots.plot_ttft_bars({p: s["ttft_mean_s"] for p, s in summaries.items()},
                                              d / "ttft_by_policy.png", _PAPER_FIG5))
        for s in summaries.values():
            s["plots"] = [str(f) for f in files]
    if run.json_out:
        if len(policies) == 1:
            run.emit_json(dict(summaries[policies[0]],
                               config=config_dict(dataclasses.replace(base, policy=policies[0]))))
        else:
            run.emit_json({"config": config_dict(base), "runs": summaries})
        return
    table = Table(title=f"{name}: {len(run.trace)} requests, "
                        f"{summaries[policies[0]]['arrival_rate_rps']:.2f} req/s, "
                        f"cache {cache_tokens} tokens/node")
    cols = ["policy", "hit rate", "TTFT mean (s)", "TTFT p90 (s)", "TBT mean (ms)",
            *[f"ERC@{t * 1000:g}ms" for t in thresholds], "rejected", "prefill s/req", "fetches",
            "wall (s)"]
    for c in cols:
        table.add_column(c, justify="left" if c == "policy" else "right")
    for p, s in summaries.items():
        erc = s["effective_request_capacity_by_tbt"]
        table.add_row(p, f"{s['cache_hit_rate']:.3f}", f"{s['ttft_mean_s']:.2f}",
                      f"{s['ttft_p90_s']:.2f}", f"{s['tbt_mean_s'] * 1000:.1f}",
                      *[f"{erc[f'{t:g}']:.3f}" for t in thresholds], str(s["rejected"]),
                      f"{s['prefill_compute_s_per_request']:.3f}", str(s["fetches"]),
                      f"{s['sim_wall_s']:.1f}")
    run.console.print(table)
    if run.plot_dir:
        run.console.print(f"figures in {run.plot_dir}")


@app.command("gen-trace")
def gen_trace(
    out: Path = typer.Argument(..., dir_okay=False, help="Where to write the .jsonl trace."),
    seed: int = typer.Option(0, help="Seed: the same arguments give the same file."),
    duration: float = typer.Option(3600.0, help="Span of session starts, s."),
    session_rate: float = typer.Option(1.0, help="New sessions a second (Poisson)."),
    system_prompts: int = typer.Option(200, help="Shared system prompts (Zipf popularity)."),
    mean_turns: float = typer.Option(4.0, help="Mean turns of a session (geometric)."),
    think: float = typer.Option(60.0, help="Mean think time between turns, s."),
    input_median: float = typer.Option(1200.0, help="Median new user input a turn, tokens."),
) -> None:
    """Write a synthetic Mooncake-format trace: Poisson sessions over shared system prompts,
    multi-turn conversations (mooncaked.sim.gen); deterministic by seed."""
    from mooncaked.sim.gen import GenConfig, generate, iter_jsonl

    try:
        cfg = GenConfig(seed=seed, duration_s=duration, session_rate_rps=session_rate,
                        system_prompts=system_prompts, mean_turns=mean_turns, think_s=think,
                        input_median=input_median)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    records = generate(cfg)
    with open(out, "wb") as f:
        f.writelines(iter_jsonl(records))
    n = len(records)
    mean_in = sum(r["input_length"] for r in records) / max(1, n)
    span = records[-1]["timestamp"] / 1000 if records else 0.0
    typer.echo(f"{out}: {n} requests over {span:.0f} s, mean input {mean_in:.0f} tokens")
