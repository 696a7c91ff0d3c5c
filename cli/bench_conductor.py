"""`mooncake bench conductor`: placement decision cost against a per-node linear scan."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("conductor")
def bench_conductor(json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
                    requests: int = typer.Option(3000, min=100, help="Placement decisions to time.")
                    ) -> None:
    """Median/p99 placement decision time, 64 prefill nodes and 1M indexed blocks, vs naive."""
    from mooncaked.benchmarks.conductor import main as run  # noqa: PLC0415

    run(json_out=json_out, requests=requests)
