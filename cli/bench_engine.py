"""`mooncake bench engine`: our engine against transformers' generate."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("engine")
def bench_engine(json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
                 dtype: str = typer.Option("auto", help="model.dtype of our side: auto (per CPU, "
                                                             "model/numerics.py), float32 or bfloat16; "
                                                             "transformers runs the resolved dtype."),
                 reps: int = typer.Option(3, min=1, help="Timed repetitions per case (medians)."),
                 threads: int = typer.Option(0, min=0, help="torch threads for both sides; 0 = torch's "
                                                            "default."),
                 quick: bool = typer.Option(False, "--quick", help="Toy sizes for every case (8 "
                                            "decode tokens, 4 concurrent requests, an 80-token "
                                            "TTFT prompt): a smoke run, not a measurement.")
                 ) -> None:
    """Decode at batch 1, 32 concurrent requests, and TTFT cold/warm, ours vs transformers."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise typer.BadParameter(f"dtype must be auto, float32 or bfloat16, not {dtype!r}",
                                 param_hint="--dtype")
    from mooncaked.benchmarks.engine import QUICK, main as run  # noqa: PLC0415

    run(json_out=json_out, dtype=dtype, reps=reps, threads=threads, **(QUICK if quick else {}))
