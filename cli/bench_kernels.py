"""`mooncake bench kernels`: Triton paged attention against torch SDPA (and FlashInfer) on one GPU."""

from __future__ import annotations

import typer

from .main import bench_app


@bench_app.command("kernels")
def bench_kernels(json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
                  dtype: str = typer.Option("bfloat16", help="bfloat16 or float16."),
                  block_size: int = typer.Option(16, help="Tokens per KV block."),
                  json_file: str = typer.Option("", help="Also write the JSON object to this file.")) -> None:
    """Decode (batch 1-64, context 1k-32k) and prefill attention: time, GB/s, TFLOP/s vs SDPA.

    Needs a CUDA GPU; exits with status 2 and a message otherwise.
    """
    from mooncaked.kernels.bench import main as run  # noqa: PLC0415

    argv = ["--dtype", dtype, "--block-size", str(block_size)] + (["--json"] if json_out else [])
    code = run(argv + (["--json-file", json_file] if json_file else []))
    if code:
        raise typer.Exit(code)
