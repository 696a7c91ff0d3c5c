"""`mooncake`: the operator's tool (ctl, bench, sim, up)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Operate a mooncaked cluster: inspect, measure, simulate, start.",
                  no_args_is_help=True, add_completion=False)
bench_app = typer.Typer(help="Measure a part against its baseline in one run.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _register() -> None:
    # Each module adds its own commands; keep them thin (parse, call mooncaked, render).
    from . import bench_engine  # noqa: F401

    for name in ("bench_kernels", "bench_transfer", "bench_store", "bench_trace",
                 "bench_conductor", "bench_capacity", "bench_cpp", "sim", "ctl", "up"):
        try:
            __import__(f"{__package__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}":
                raise


def main() -> None:
    """Console entry point of `mooncake`."""
    _register()
    app()
