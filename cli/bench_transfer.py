"""`mooncake bench transfer`: the transfer engine against plain sockets over loopback, or
over a shaped link between hosts (`--hosts --link-rate 1gbit`)."""

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
    hosts: bool = typer.Option(False, "--hosts", help="The peer in a host of its own (a "
                               "network namespace on a private bridge; needs root), reached "
                               "over its link instead of loopback."),
    link_rate: Optional[str] = typer.Option(None, help="With --hosts: shape the peer's link "
                                            "(tc tbf), e.g. 1gbit, 100mbit."),
) -> None:
    """Throughput and p50/p99 latency, ours vs plain sockets moving the same bytes."""
    if op not in ("write", "read"):
        raise typer.BadParameter("op must be write or read")
    from mooncaked.benchmarks.transfer import main as run  # noqa: PLC0415
    from mooncaked.cluster.hosts import HostsError, parse_rate, require_root  # noqa: PLC0415

    if link_rate and not hosts:
        raise typer.BadParameter("--link-rate needs --hosts")
    if hosts:
        try:
            require_root()
            if link_rate:
                parse_rate(link_rate)
        except (HostsError, ValueError) as e:
            typer.echo(f"mooncake bench transfer: {e}", err=True)
            raise typer.Exit(2) from None

    run(json_out=json_out, sizes=_sizes(sizes) if sizes else None,
        concurrency=[int(c) for c in concurrency.split(",")] if concurrency else None,
        duration=duration, op=op, connections=connections, slice_bytes=slice_bytes,
        rounds=rounds, link_rate=(link_rate or "100gbit") if hosts else None)
