"""`mooncake up`: a local cluster (prefill, decode and cache nodes as separate processes)
in the foreground; Ctrl-C or SIGTERM stops everything it started."""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer

from .main import app


@app.command("up")
def up(
    port: int = typer.Option(8000, help="Port of the public API (served by the first cache node; "
                             "by the first prefill node when --cache 0)."),
    backend: str = typer.Option("local", help="Coordination: local (a state directory) or etcd "
                                "(starts its own etcd on loopback)."),
    prefill: int = typer.Option(1, min=1, help="Prefill nodes."),
    decode: int = typer.Option(1, min=1, help="Decode nodes."),
    cache: int = typer.Option(1, min=0, help="Cache nodes (store + API front end, no model)."),
    coupled: int = typer.Option(0, min=0, help="Instead of prefill and decode nodes, N coupled "
                                "nodes of role all (prefill and decode in one engine, "
                                "vLLM-style) under the same conductor and front end."),
    cpp: int = typer.Option(0, min=0, help="Chunked pipeline parallelism: the prefill nodes "
                            "form groups of N stages, each holding 1/N of the layers "
                            "(--prefill 2 --cpp 2: one group of two stages; a remainder stays "
                            "single prefill nodes)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML settings every node "
                                          "starts from."),
    workdir: Optional[Path] = typer.Option(None, help="Configs, logs and state (default: a "
                                           "temporary directory, removed at exit except "
                                           "its node logs)."),
    rm_logs: bool = typer.Option(False, "--rm-logs", help="With the default work directory, "
                                 "also delete the node logs at exit (by default they are "
                                 "kept and their directory printed)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="KEY=VALUE for every node "
                                             "(repeatable)."),
    hosts: bool = typer.Option(False, "--hosts", help="Each node (and etcd) in a host of its "
                               "own: a network namespace with its own address on a private "
                               "bridge, binding and advertising it as on a real host "
                               "(needs root)."),
    link_rate: Optional[str] = typer.Option(None, help="With --hosts: shape every host's link "
                                            "to this rate (tc tbf), e.g. 1gbit, 100mbit."),
    timeout: float = typer.Option(600.0, help="Seconds to wait for the cluster to be ready."),
    log_level: str = typer.Option("info", help="Log level of the nodes (their logs are files "
                                  "in the work directory)."),
) -> None:
    """Start a local cluster and serve until Ctrl-C / SIGTERM."""
    from mooncaked.cluster.hosts import HostsError, parse_rate, require_root  # noqa: PLC0415
    from mooncaked.cluster.launcher import ClusterStartError, LocalCluster, cluster_specs  # noqa

    if backend not in ("local", "etcd"):
        typer.echo("mooncake up: --backend must be local or etcd", err=True)
        raise typer.Exit(2)
    from mooncaked.config import parse_set_pairs  # noqa: PLC0415

    try:
        extra = parse_set_pairs(set_)
    except ValueError as e:
        typer.echo(f"mooncake up: {e}", err=True)
        raise typer.Exit(2) from None
    try:
        nodes = cluster_specs(cache, prefill, decode, coupled, port, cpp)
    except ValueError as e:
        typer.echo(f"mooncake up: {e}", err=True)
        raise typer.Exit(2) from None
    if link_rate and not hosts:
        typer.echo("mooncake up: --link-rate needs --hosts", err=True)
        raise typer.Exit(2)
    if link_rate:
        try:
            parse_rate(link_rate)
        except ValueError as e:
            typer.echo(f"mooncake up: {e}", err=True)
            raise typer.Exit(2) from None
    if hosts:
        try:
            require_root()
        except HostsError as e:
            typer.echo(f"mooncake up: {e}", err=True)
            raise typer.Exit(2) from None
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="mooncake-up-")) if own else workdir
    # die_with_parent: if `mooncake up` is killed (even kill -9), its nodes and etcd get
    # SIGTERM from the kernel and drain and exit on their own.
    cluster = LocalCluster(work, nodes, backend=backend, settings=extra, base_config=config,
                           log_level=log_level, die_with_parent=True, hosts=hosts,
                           link_rate=link_rate)

    def _terminate(signum, frame):  # SIGTERM: the same clean stop as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    front = nodes[0].node_id
    try:
        typer.echo(f"starting {len(nodes)} nodes ({backend} backend); logs in {work}")
        cluster.start(timeout)
        if cluster.hosts is not None:
            typer.echo(f"hosts: one network namespace per node on bridge {cluster.hosts.bridge} "
                       f"({cluster.hosts.subnet}, this host {cluster.hosts.gateway}), links "
                       f"{link_rate or 'unshaped'}")
        ctl = cluster.write_ctl_config(also_default=True)
        typer.echo(f"ready: {cluster.api_url(front)}/v1  (OpenAI API, model "
                   f"{_model(cluster, front)})")
        for n in nodes:
            stage = (f" (group {n.settings['cpp.group']}, stage {n.settings['cpp.stage']})"
                     if "cpp.group" in n.settings else "")
            typer.echo(f"  {n.node_id:10s} {n.role:8s} {cluster.api_url(n.node_id)}  "
                       f"log {cluster.log_path(n.node_id)}{stage}")
        typer.echo("every node above serves the same API; a node that dies is not restarted. "
                   "A new conductor is elected if the leader dies; requests need at least one "
                   "live prefill and one live decode node (add more with --prefill/--decode "
                   "to survive the loss of one)")
        typer.echo(f"inspect: mooncake ctl status -c {ctl}")
        typer.echo("Ctrl-C stops the cluster.")
        dead: set[str] = set()
        while True:
            time.sleep(1.0)
            for nid, proc in cluster.procs.items():
                if proc.poll() is not None and nid not in dead:
                    dead.add(nid)
                    typer.echo(f"node {nid} exited with {proc.returncode}; see "
                               f"{cluster.log_path(nid)}", err=True)
    except (ClusterStartError, HostsError) as e:
        typer.echo(f"mooncake up: {e}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("stopping...")
    finally:
        cluster.stop()
        _forget_default_ctl_config(work)
        if own:
            kept = clean_workdir(work, keep_logs=not rm_logs)
            if kept:
                typer.echo(f"node logs kept in {work} ({len(kept)} files; --rm-logs "
                           "deletes them at exit)")
    typer.echo("stopped")


def clean_workdir(work: Path, keep_logs: bool) -> list[Path]:
    """Deletes a temporary work directory at exit: all of it, or (`keep_logs`) all but
    its top-level `*.log` files (each node's log), so a run that went wrong can still
    be read after the cluster stopped. Returns the files kept."""
    if not keep_logs:
        shutil.rmtree(work, ignore_errors=True)
        return []
    kept = []
    for entry in work.iterdir() if work.is_dir() else []:
        if entry.is_file() and entry.suffix == ".log" and entry.stat().st_size:
            kept.append(entry)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if not kept:
        shutil.rmtree(work, ignore_errors=True)
    return sorted(kept)


def _forget_default_ctl_config(work: Path) -> None:
    """Removes the well-known ctl settings if they still point at this cluster."""
    from mooncaked.cluster.launcher import default_ctl_config_path  # noqa: PLC0415

    default, mine = default_ctl_config_path(), work / "cluster.toml"
    try:
        if default.exists() and mine.exists() and default.read_bytes() == mine.read_bytes():
            default.unlink()
    except OSError:
        pass


def _model(cluster, node_id: str) -> str:
    import orjson  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"{cluster.api_url(node_id)}/v1/models", timeout=5) as r:
            return orjson.loads(r.read())["data"][0]["id"]
    except (OSError, KeyError, IndexError, ValueError):
        return "?"
