"""`mooncake bench transfer`: the transfer engine against plain sockets over loopback."""

from __future__ import annotations

from typing import Optional

import typer

from .main import bench_app


def _sizes(text: str) -> list[int]:
    units = {"k": 1024, "m": 1024 * 1024, "g": 1024 ** 3}
    out = []
    for part in text.split(","):
        part = part.strip().lower().removesuffix("ib").removesuffix("b")
        mult = units.get(part[-1:], 1)
        out.append(int(part[:-1] if mult != 1 else part) * mult)
    return out


@bench_app.command("transfer")
def bench_transfer(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    sizes: Optional[str] = typer.Option(None, help="Transfer sizes, e.g. 16k,128k,1m,64m "
                                                   "(default 16 KiB .. 64 MiB)."),
    concurrency: Optional[str] = typer.Option(None, help="Concurrent streams, e.g. 1,4,16,64."),
    duration: float = typer.Option(0.5, help="Seconds per point and side (all rounds)."),
    rounds: int = typer.Option(5, help="Alternating rounds per point (median reported)."),
    op: str = typer.Option("write", help="write or read."),
    connections: Optional[int] = typer.Option(None, help="TCP connections per peer (ours)."),
    slice_bytes: Optional[int] = typer.Option(None, help="Slice size in bytes (ours)."),
) -> None:
    """Throughput and p50/p99 latency, ours vs plain sockets moving the same bytes."""
    if op not in ("write", "read"):
        raise typer.BadParameter("op must be write or read")
    from mooncaked.benchmarks.transfer import main as run  # noqa: PLC0415

    run(json_out=json_out, sizes=_sizes(sizes) if sizes else None,
        concurrency=[int(c) for c in concurrency.split(",")] if concurrency else None,
        duration=duration, op=op, connections=connections, slice_bytes=slice_bytes,
        rounds=rounds)
