"""Command-line apps (typer): `mooncaked` and `mooncake`."""
