"""`mooncaked`: the per-node daemon (serve, profile, config)."""

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
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16."),
    node_id: Optional[str] = typer.Option(None, "--node-id", help="Node id in the cluster."),
    log_level: Optional[str] = typer.Option(None, help="debug | info | warning | error."),
) -> None:
    """Run one node until SIGINT/SIGTERM. Flags override the config file."""
    from mooncaked.config import ConfigError, load_settings  # noqa: PLC0415

    overrides = {"node.role": role, "server.host": host, "server.port": port, "model.path": model,
                 "model.dtype": dtype, "node.id": node_id, "log.level": log_level}
    try:
        settings = load_settings(config, overrides)
    except ConfigError as e:
        typer.echo(f"mooncaked: configuration error: {e}", err=True)
        raise typer.Exit(2) from None
    from mooncaked.daemon import run_daemon  # noqa: PLC0415

    sys.exit(run_daemon(settings))


@app.command("config")
def config_cmd(example: bool = typer.Option(False, "--example", help="Print config.example.toml."),
               check: Optional[Path] = typer.Option(None, "--check", help="Validate a file.")) -> None:
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
    typer.echo(example_toml())


def main() -> None:
    """Console entry point of `mooncaked`."""
    app()
