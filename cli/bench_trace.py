"""`mooncake bench trace FILE --url URL`: replay a Mooncake-format trace against an endpoint;
`mooncake bench trace --hosts --link-rate 1gbit --link-rate 100mbit`: fetch or recompute by
the measured bandwidth, on clusters of hosts with shaped links (benchmarks/fetch_policy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .main import bench_app


@bench_app.command("trace")
def bench_trace(
    file: Optional[Path] = typer.Argument(None, help="Trace file (Mooncake JSONL format); with "
                                          "--hosts the shared conversation trace by default."),
    url: Optional[str] = typer.Option(None, "--url", help="OpenAI-compatible server, e.g. "
                                      "http://127.0.0.1:8000 (required without --hosts)."),
    hosts: bool = typer.Option(False, "--hosts", help="Instead of --url: for each --link-rate and "
                               "each fetch policy (adaptive, always, never), a cluster of hosts "
                               "(network namespaces, shaped links; needs root) replays a subset "
                               "of the trace with shared prefixes and a generated one: TTFT, "
                               "prefix tokens fetched vs recomputed, bytes moved."),
    link_rate: Optional[list[str]] = typer.Option(None, "--link-rate", help="With --hosts: tc "
                                                  "rate of every link, repeatable (default "
                                                  "1gbit and 100mbit)."),
    fetch_policy: Optional[list[str]] = typer.Option(None, "--fetch-policy", help="With --hosts: "
                                                     "the policies compared, repeatable "
                                                     "(default adaptive, always, never)."),
    time_scale: float = typer.Option(1.0, help="Request i is sent at timestamp*time_scale (0: all at once)."),
    length_scale: Optional[float] = typer.Option(None, help="Divide block (512), input and output "
                                                 "lengths by this (default 1; 16 with --hosts)."),
    limit: Optional[int] = typer.Option(None, help="Replay only the first N requests (with "
                                        "--hosts: N requests per input, default 30)."),
    model: Optional[str] = typer.Option(None, help="Model name (default: first of GET /v1/models)."),
    vocab_size: Optional[int] = typer.Option(None, help="Token ids drawn below this "
                                             "(default: server's vocab_size, else 49152)."),
    token_low: int = typer.Option(1000, help="Lowest token id drawn (avoids special tokens)."),
    ttft_slo: float = typer.Option(30.0, help="TTFT threshold for effective request capacity, s."),
    tbt_slo: Optional[list[float]] = typer.Option(None, help="TBT threshold(s), s; repeat the "
                                                  "option for several (default 0.1 0.2 0.3)."),
    out: Optional[Path] = typer.Option(Path("replay-out"), help="Directory for replay.json and PNG CDFs."),
    concurrency_limit: Optional[int] = typer.Option(None, help="Most requests in flight (default: no cap)."),
    timeout: float = typer.Option(600.0, help="Per-request timeout, s."),
    text_api: str = typer.Option("completions", help="Endpoint for text_input prompts: completions | chat."),
    max_output_tokens: Optional[int] = typer.Option(None, help="Cap every request's max_tokens."),
    ignore_eos: bool = typer.Option(True, help="Send ignore_eos so outputs have the trace's length."),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY", help="Bearer token, if needed."),
    progress: bool = typer.Option(True, help="Live progress display on stderr."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Replay a trace: TTFT, TBT, cache hits and effective request capacity (Mooncake, section 5);
    with --hosts, fetch or recompute by the measured bandwidth at each --link-rate."""
    if hosts:
        raise typer.Exit(_hosts(file, link_rate, fetch_policy, limit, length_scale,
                                max_output_tokens, timeout, url, json_out, concurrency_limit))
    if file is None or url is None:
        raise typer.BadParameter("a trace FILE and --url are needed (or --hosts)")
    from mooncaked.replay.bench import run_bench_trace  # noqa: PLC0415

    code = run_bench_trace(
        file=file, url=url, time_scale=time_scale, length_scale=length_scale or 1.0, limit=limit,
        model=model, vocab_size=vocab_size, token_low=token_low, ttft_slo=ttft_slo,
        tbt_slos=tuple(tbt_slo) if tbt_slo else (0.1, 0.2, 0.3), out=out,
        concurrency_limit=concurrency_limit, timeout=timeout, text_api=text_api,
        max_output_tokens=max_output_tokens, ignore_eos=ignore_eos, api_key=api_key,
        show_progress=progress, json_out=json_out)
    if code:
        raise typer.Exit(code)


def _hosts(file: Optional[Path], rates: Optional[list[str]], policies: Optional[list[str]],
           limit: Optional[int], length_scale: Optional[float],
           max_output_tokens: Optional[int], timeout: float,
           url: Optional[str], json_out: bool, concurrency_limit: Optional[int] = None) -> int:
    """`bench trace --hosts`: checks root and the rates, runs benchmarks/fetch_policy.py;
    returns the exit code (2: bad input or not root)."""
    from mooncaked.benchmarks.fetch_policy import POLICIES, main  # noqa: PLC0415
    from mooncaked.cluster.hosts import HostsError, parse_rate, require_root  # noqa: PLC0415

    try:
        if url:
            raise ValueError("--hosts starts its own clusters: drop --url")
        if concurrency_limit is not None:
            raise ValueError("--hosts sends one request at a time, interleaved over the "
                             "policies' clusters: drop --concurrency-limit")
        require_root()
        for r in rates or []:
            parse_rate(r)
        for p in policies or []:
            if p not in POLICIES:
                raise ValueError(f"--fetch-policy {p!r}: one of {', '.join(POLICIES)}")
    except (HostsError, ValueError) as e:
        typer.echo(f"mooncake bench trace: {e}", err=True)
        return 2
    argv = [f"--link-rate={r}" for r in rates or []]
    if policies:
        argv += ["--policies", *policies]
    for flag, value in (("--trace", file), ("--limit", limit), ("--length-scale", length_scale),
                        ("--max-output-tokens", max_output_tokens)):
        if value is not None:
            argv.append(f"{flag}={value}")
    argv.append(f"--timeout={timeout}")
    if json_out:
        argv.append("--json")
    return main(argv)
