"""`mooncake bench capacity TRACE`: effective request capacity, 1 prefill + 1 decode against
2 coupled nodes (mooncaked/benchmarks/capacity.py; options as `--help` there lists)."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("capacity", context_settings={"allow_extra_args": True,
                                                 "ignore_unknown_options": True,
                                                 "help_option_names": []})
def bench_capacity(ctx: typer.Context) -> None:
    """Replay a trace slice at a sweep of arrival rates against 1 prefill + 1 decode and
    `--coupled 2`; share within SLO, TTFT/TBT percentiles, capacity ratio (--help: options)."""
    from mooncaked.benchmarks.capacity import main  # noqa: PLC0415

    code = main(list(ctx.args))
    if code:
        raise typer.Exit(code)
