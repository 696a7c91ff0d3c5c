"""`mooncake bench engine`: our engine against transformers' generate."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("engine")
def bench_engine(json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
                 dtype: str = typer.Option("float32", help="Weight dtype on both sides.")) -> None:
    """Decode at batch 1, 32 concurrent requests, and TTFT cold/warm, ours vs transformers."""
    from mooncaked.benchmarks.engine import main as run  # noqa: PLC0415

    run(json_out=json_out, dtype=dtype)
