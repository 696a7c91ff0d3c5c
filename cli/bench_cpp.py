"""`mooncake bench cpp`: a 2-stage prefill pipeline's TTFT against one prefill node."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("cpp")
def bench_cpp(json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
              reps: int = typer.Option(3, min=1, help="Timed repetitions per prompt length (medians)."),
              chunk_tokens: int = typer.Option(512, min=1, help="Tokens per pipeline chunk."),
              prompts: str = typer.Option("1024,2048,4096,7168", help="Prompt lengths, tokens, "
                                          "comma-separated (at most 8000)."),
              cluster: bool = typer.Option(False, "--cluster", help="Through a real local "
                                           "cluster: a 2-stage CPP group vs a single prefill "
                                           "node, TTFT at the client (benchmarks/cpp_cluster.py).")
              ) -> None:
    """TTFT of 2 pipeline stages (1 torch thread each) vs one prefill node (1 thread)."""
    try:
        lengths = tuple(int(x) for x in prompts.split(","))
    except ValueError:
        raise typer.BadParameter(f"not a list of integers: {prompts!r}", param_hint="--prompts") from None
    if not lengths or any(not 0 < n <= 8000 for n in lengths):
        raise typer.BadParameter("prompt lengths must be 1..8000", param_hint="--prompts")
    if cluster:
        from mooncaked.benchmarks.cpp_cluster import main as run_cluster  # noqa: PLC0415

        run_cluster(json_out=json_out, reps=reps, chunk_tokens=chunk_tokens, prompts=lengths)
        return
    from mooncaked.benchmarks.cpp import main as run  # noqa: PLC0415

    run(json_out=json_out, reps=reps, chunk_tokens=chunk_tokens, prompts=lengths)
