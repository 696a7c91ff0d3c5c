"""`mooncake bench trace`: discovery, live progress, replay, summary table, files.

The typer command in cli/bench_trace.py only parses options and calls run_bench_trace.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mooncaked.log import get_logger

from .prompts import DEFAULT_VOCAB_SIZE, PromptBuilder
from .report import write_json, write_plots
from .runner import ReplayConfig, ReplayProgress, RequestRecord, discover_server, replay
from .summary import summarize
from .trace import TraceError, TraceRequest, load_trace

log = get_logger(__name__)


def _fmt(x: Any, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def summary_table(summary: dict[str, Any], title: str) -> Table:
    """A rich table of a replay summary (see summarize for the keys)."""
    t = Table(title=title, show_header=True)
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [
        ("requests", summary["requests"]), ("completed", summary["completed"]),
        ("rejected (429)", summary["rejected"]), ("errors", summary["errors"]),
        ("TTFT mean", _fmt(summary["ttft_mean_s"], " s")),
        ("TTFT p50", _fmt(summary["ttft_p50_s"], " s")),
        ("TTFT p90", _fmt(summary["ttft_p90_s"], " s")),
        ("TTFT p99", _fmt(summary["ttft_p99_s"], " s")),
        ("TBT mean", _fmt(summary["tbt_mean_s"], " s", 4)),
        ("TBT p90", _fmt(summary["tbt_p90_s"], " s", 4)),
        ("cache hit rate", _fmt(summary["cache_hit_rate"])),
        ("prompt / cached / output tokens",
         f"{summary['prompt_tokens']} / {summary['cached_tokens']} / {summary['output_tokens']}"),
        ("output throughput", _fmt(summary["output_throughput_tok_s"], " tok/s", 1)),
        ("input throughput", _fmt(summary["input_throughput_tok_s"], " tok/s", 1)),
        ("duration", _fmt(summary["duration_s"], " s", 2)),
    ]
    for slo, share in summary["effective_request_capacity"].items():
        rows.append((f"effective capacity (TTFT<={summary['ttft_slo_s']:g} s, TBT<={slo} s)",
                     _fmt(share)))
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def count_too_long(cfg: ReplayConfig, requests: Sequence[TraceRequest],
                   max_model_len: int | None) -> int:
    """How many token-id requests need more than max_model_len tokens (prompt + max_tokens).

    text_input requests are not counted (their length is known only to the server's
    tokenizer); 0 when max_model_len is unknown.
    """
    if not max_model_len:
        return 0
    b = PromptBuilder(cfg.vocab_size, cfg.length_scale, cfg.token_low)
    cap = cfg.max_output_tokens or float("inf")
    return sum(1 for r in requests if r.text_input is None
               and b.input_length(r) + min(b.output_length(r), cap) > max_model_len)


async def _run(cfg_args: dict[str, Any], requests: list, show_progress: bool,
               console: Console) -> tuple[ReplayConfig, list[RequestRecord], float]:
    info = await discover_server(cfg_args["url"], cfg_args["api_key"])
    model = cfg_args.pop("model") or info["model"]
    vocab = cfg_args.pop("vocab_size") or info["vocab_size"] or DEFAULT_VOCAB_SIZE
    cfg = ReplayConfig(model=model, vocab_size=vocab, **cfg_args)
    cfg.validate()
    log.info("replay_start", url=cfg.url, model=model, vocab_size=vocab,
             requests=len(requests), time_scale=cfg.time_scale, length_scale=cfg.length_scale)
    too_long = count_too_long(cfg, requests, info["max_model_len"])
    if too_long:
        console.print(f"[yellow]bench trace: {too_long} of {len(requests)} requests exceed the "
                      f"server's max_model_len {info['max_model_len']} (prompt + max_tokens) and "
                      "will likely fail; raise --length-scale or cap --max-output-tokens")
    if not show_progress:
        records, wall = await replay(cfg, requests)
        return cfg, records, wall
    cols = (TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"))
    with Progress(*cols, console=console, refresh_per_second=4) as bar:
        task = bar.add_task("replay", total=len(requests), stats="")

        def update(p: ReplayProgress) -> None:
            ttft = f"{p.ttft_mean_s:.3f} s" if p.ttft_mean_s is not None else "-"
            bar.update(task, completed=p.done,
                       stats=f"sent {p.sent} done {p.done} failed {p.failed} "
                             f"rejected {p.rejected} TTFT mean {ttft}")

        records, wall = await replay(cfg, requests, on_update=update)
    return cfg, records, wall


def run_bench_trace(*, file: Path, url: str, time_scale: float, length_scale: float,
                    limit: int | None, model: str | None, vocab_size: int | None, token_low: int,
                    ttft_slo: float, tbt_slos: Sequence[float], out: Path | None,
                    concurrency_limit: int | None, timeout: float, text_api: str,
                    max_output_tokens: int | None, ignore_eos: bool, api_key: str | None,
                    show_progress: bool, json_out: bool) -> int:
    """Run one replay end to end; returns the process exit code (0 ok, 2 bad input/server).

    Prints a rich summary table (or, with json_out, the summary as one JSON object on
    stdout), writes out/replay.json and the PNG CDFs when `out` is set.
    """
    err = Console(stderr=True)
    try:
        requests = load_trace(file, limit)
    except (TraceError, ValueError) as e:
        err.print(f"[red]bench trace: {e}")
        return 2
    cfg_args = dict(url=url, model=model, vocab_size=vocab_size, time_scale=time_scale,
                    length_scale=length_scale, token_low=token_low,
                    concurrency_limit=concurrency_limit, timeout_s=timeout, text_api=text_api,
                    ignore_eos=ignore_eos, max_output_tokens=max_output_tokens, api_key=api_key)
    try:
        import uvloop  # noqa: PLC0415

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        cfg, records, wall = runner(_run(cfg_args, requests, show_progress, err))
    except (RuntimeError, ValueError) as e:
        err.print(f"[red]bench trace: {e}")
        return 2
    summary = summarize(records, wall, ttft_slo, tbt_slos)
    if out is not None:
        config = {k: v for k, v in vars(cfg).items() if k != "api_key"}
        config.update(trace=str(file), limit=limit, ttft_slo_s=ttft_slo, tbt_slos_s=list(tbt_slos))
        path = write_json(out, config, summary, records)
        plots = write_plots(out, records, ttft_slo, tbt_slos)
        summary_files = [str(path)] + [str(p) for p in plots]
    else:
        summary_files = []
    if json_out:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        Console().print(summary_table(summary, f"trace replay: {file.name} -> {cfg.url} ({cfg.model})"))
        for f in summary_files:
            Console().print(f"wrote {f}")
    return 0
