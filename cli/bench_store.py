"""`mooncake bench store`: KV store tiers vs memcpy / plain file I/O, and eviction hit rates."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("store")
def bench_store(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    block_sizes: str = typer.Option("16,64", help="Block sizes in tokens (SmolLM2 fp32 blocks)."),
    total_mb: int = typer.Option(64, help="MiB moved per case and repetition."),
    reps: int = typer.Option(5, min=1, help="Repetitions; the median is reported."),
    dir: str = typer.Option(None, help="Directory for the SSD cases (default: the temp dir)."),
    trace: str = typer.Option(None, help="Mooncake trace for the eviction study (default: the "
                                         "shared conversation trace beside the checkout, or "
                                         "in $MOONCAKE_TRACE_DIR); '' skips it."),
    capacities: str = typer.Option("1024,4096,16384,65536",
                                   help="Cache capacities of the eviction study, in blocks."),
) -> None:
    """DRAM and SSD put/get throughput next to memcpy and plain file I/O in the same run."""
    from mooncaked.benchmarks.store import main as run  # noqa: PLC0415
    from mooncaked.replay.trace import shared_trace_path  # noqa: PLC0415

    if trace is None:
        trace = str(shared_trace_path() or "")

    run(json_out=json_out, block_sizes=tuple(int(x) for x in block_sizes.split(",")),
        total_mb=total_mb, reps=reps, directory=dir, trace=trace or None,
        capacities=tuple(int(x) for x in capacities.split(",")))
