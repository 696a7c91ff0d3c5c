"""`mooncake bench trace FILE --url URL`: replay a Mooncake-format trace against an endpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .main import bench_app


@bench_app.command("trace")
def bench_trace(
    file: Path = typer.Argument(..., help="Trace file (Mooncake JSONL format)."),
    url: str = typer.Option(..., "--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000."),
    time_scale: float = typer.Option(1.0, help="Request i is sent at timestamp*time_scale (0: all at once)."),
    length_scale: float = typer.Option(1.0, help="Divide block (512), input and output lengths by this."),
    limit: Optional[int] = typer.Option(None, help="Replay only the first N requests."),
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
    """Replay a trace: TTFT, TBT, cache hits and effective request capacity (Mooncake, section 5)."""
    from mooncaked.replay.bench import run_bench_trace  # noqa: PLC0415

    code = run_bench_trace(
        file=file, url=url, time_scale=time_scale, length_scale=length_scale, limit=limit,
        model=model, vocab_size=vocab_size, token_low=token_low, ttft_slo=ttft_slo,
        tbt_slos=tuple(tbt_slo) if tbt_slo else (0.1, 0.2, 0.3), out=out,
        concurrency_limit=concurrency_limit, timeout=timeout, text_api=text_api,
        max_output_tokens=max_output_tokens, ignore_eos=ignore_eos, api_key=api_key,
        show_progress=progress, json_out=json_out)
    if code:
        raise typer.Exit(code)
