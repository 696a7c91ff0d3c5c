"""`mooncaked`: the per-node daemon (serve, profile, warm, config)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="mooncaked: one serving node of a Mooncake-style cluster.",
                  no_args_is_help=True, add_completion=False)


@app.command()
def serve(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML settings file."),
    role: Optional[str] = typer.Option(None, help="prefill | decode | cache | all."),
    host: Optional[str] = typer.Option(None, help="API listen address (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="API port."),
    model: Optional[str] = typer.Option(None, help="GGUF file or safetensors directory."),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16 (auto: per CPU, "
                                        "model/numerics.py)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda[:N] (model, KV pages, sampling)."),
    load_format: Optional[str] = typer.Option(None, "--load-format", help="auto | dummy (--model is a "
                                              "config.json; random weights)."),
    node_id: Optional[str] = typer.Option(None, "--node-id", help="Node id in the cluster."),
    log_level: Optional[str] = typer.Option(None, help="debug | info | warning | error."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Any setting as KEY=VALUE, e.g. "
                                             "--set cluster.backend=etcd (repeatable; the value "
                                             "is read as TOML, else taken as a string)."),
) -> None:
    """Run one node until SIGINT/SIGTERM. Flags override the config file."""
    settings = _settings(config, {"node.role": role, "server.host": host, "server.port": port,
                                  "model.path": model, "model.dtype": dtype, "model.device": device,
                                  "model.load_format": load_format, "node.id": node_id,
                                  "log.level": log_level}, set_)
    from mooncaked.daemon import run_daemon  # noqa: PLC0415

    sys.exit(run_daemon(settings))


def _settings(config: Optional[Path], overrides: dict, pairs: Optional[list[str]]):
    """Settings from the file, the named flags and --set pairs; exits 2 on a bad value."""
    from mooncaked.config import ConfigError, load_settings, parse_set_pairs  # noqa: PLC0415

    try:
        overrides.update(parse_set_pairs(pairs))
        return load_settings(config, overrides)
    except ConfigError as e:
        typer.echo(f"mooncaked: configuration error: {e}", err=True)
        raise typer.Exit(2) from None
    except ValueError as e:
        typer.echo(f"mooncaked: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def profile(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML settings file."),
    out: Optional[Path] = typer.Option(None, help="Where to write the cost model (default: "
                                       "conductor.cost_model, else <state dir>/cost_model.json)."),
    quick: bool = typer.Option(False, help="A smaller grid (for slow machines)."),
    tiny: bool = typer.Option(False, help="The smallest grid that fits every term (seconds; "
                              "for smoke tests, too noisy for a real cost model)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Any setting as KEY=VALUE."),
    publish: Optional[bool] = typer.Option(None, "--publish/--no-publish", help="Store the model "
                                           "in the cluster's coordination backend, where every "
                                           "conductor reads it (default: when node.role is "
                                           "prefill, decode or cache)."),
) -> None:
    """Fit the conductor's cost models on this hardware (prefill, decode step, transfer)."""
    settings = _settings(config, {}, set_)
    from mooncaked.profile import ProfileGrid, run_profile  # noqa: PLC0415
    from mooncaked.log import setup_logging  # noqa: PLC0415

    setup_logging(settings.log.level, settings.log.format)
    if quick and tiny:
        typer.echo("mooncaked profile: --quick and --tiny exclude each other", err=True)
        raise typer.Exit(2)
    grid = ProfileGrid.tiny() if tiny else ProfileGrid.quick() if quick else None
    model, path = run_profile(settings, grid, out)
    pf, df = model.meta.get("prefill_fit", {}), model.meta.get("decode_fit", {})
    typer.echo(f"cost model written to {path}")
    if publish if publish is not None else settings.node.role != "all":
        import asyncio  # noqa: PLC0415

        from mooncaked.conductor.cost_store import COST_KEY  # noqa: PLC0415
        from mooncaked.conductor.cost_store import publish as publish_model  # noqa: PLC0415
        from mooncaked.coord.factory import make_coordinator  # noqa: PLC0415
        from mooncaked.wire.errors import ClusterError  # noqa: PLC0415

        async def publish_to_cluster() -> None:
            async with make_coordinator(settings.cluster) as coord:
                await publish_model(coord, model, str(path))

        try:
            asyncio.run(publish_to_cluster())
        except ClusterError as e:
            typer.echo(f"mooncaked profile: not published (the coordinator is unreachable: "
                       f"{e}); the file is written", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"  published as {settings.cluster.key_prefix}{COST_KEY} "
                   f"({settings.cluster.backend} backend): every conductor of the cluster uses it")
    typer.echo(f"  prefill: {pf.get('samples')} samples, max relative error "
               f"{pf.get('max_rel_error', float('nan')):.1%}")
    typer.echo(f"  decode:  {df.get('samples')} samples, max relative error "
               f"{df.get('max_rel_error', float('nan')):.1%}")
    typer.echo(f"  transfer: {model.transfer.bandwidth_bytes_per_s / 1e9:.2f} GB/s, latency "
               f"{model.transfer.latency_s * 1e3:.2f} ms")


@app.command()
def warm(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML settings file."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Any setting as KEY=VALUE."),
) -> None:
    """Load the configured model once and exit, leaving what a first `serve` would build
    in the caches: the tokenizer converted from the GGUF file (the load cache) and the CPU
    kernels compiled for this CPU (Numba's disk cache). scripts/setup.sh runs it, so the
    nodes of a first `mooncake up` do not each compile the kernels (31 s on a 2-core AMD
    EPYC Zen 3; 6 s once cached). Exits 1 when the model or the engine cannot be
    built, 2 for a bad setting."""
    import time  # noqa: PLC0415

    settings = _settings(config, {}, set_)
    from mooncaked.engine.llm_engine import LLMEngine  # noqa: PLC0415
    from mooncaked.log import setup_logging  # noqa: PLC0415
    from mooncaked.model.errors import ModelLoadError  # noqa: PLC0415

    # warnings stay on: a cache that cannot be written (load_cache_unwritable) is one
    setup_logging("warning", settings.log.format)
    t0 = time.monotonic()
    try:
        engine = LLMEngine(settings)
    except (ModelLoadError, OSError, ValueError) as e:
        typer.echo(f"mooncaked warm: cannot load the model: {e}", err=True)
        raise typer.Exit(1) from None
    except (RuntimeError, AssertionError) as e:    # torch's, e.g. model.device=cuda without CUDA
        typer.echo(f"mooncaked warm: cannot build the engine on model.device="
                   f"{settings.model.device!r}: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(1) from None
    paths, compiles = engine.kernel_paths, engine.kernels_warm.compiles
    typer.echo(f"mooncaked warm: {engine.model_name} ({engine.numerics.dtype}, decode "
               f"{paths.decode_path}, prefill {paths.prefill_path}) loaded in "
               f"{time.monotonic() - t0:.1f} s; {compiles} kernel compilations "
               f"({'all from the cache' if not compiles else 'now cached'})")


@app.command("config")
def config_cmd(example: bool = typer.Option(False, "--example", help="Print config.example.toml."),
               check: Optional[Path] = typer.Option(None, "--check", help="Validate a file: "
                                                    "every check `serve` runs on it (types, "
                                                    "ranges, cross-field rules).")) -> None:
    """Print the example configuration, or validate a file."""
    from mooncaked.config import ConfigError, example_toml, load_settings  # noqa: PLC0415

    if check is not None:
        try:
            load_settings(check)
        except ConfigError as e:
            typer.echo(f"{e}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{check}: ok")
        return
    typer.echo(example_toml(), nl=False)   # byte for byte config.example.toml (ends in \n)


@app.command()
def token(out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write it to this file "
                                             "(created with mode 0600; never overwritten) "
                                             "instead of printing it.")) -> None:
    """Make a new cluster token (the shared secret of cluster.token_file)."""
    from mooncaked.wire.auth import new_token, write_token_file  # noqa: PLC0415

    if out is None:
        typer.echo(new_token())
        return
    if out.exists():
        typer.echo(f"mooncaked token: {out} exists; not overwriting it", err=True)
        raise typer.Exit(1)
    write_token_file(out)
    typer.echo(f"cluster token written to {out} (mode 0600)")


def main() -> None:
    """Console entry point of `mooncaked`."""
    app()
