"""`mooncake ctl`: inspect and operate a running cluster (status, nodes, cache, requests,
drain, undrain) over either coordination backend; rich tables, or --json for scripts."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import orjson
import typer

from .main import app

ctl_app = typer.Typer(help="Inspect and operate a running cluster (calls carry the cluster "
                           "token from cluster.token_file).", no_args_is_help=True)
app.add_typer(ctl_app, name="ctl")

_GLOBAL: dict[str, Any] = {}   # the ctl group's own options (--prefix, --token-file)


@ctl_app.callback()
def _group(prefix: Optional[str] = typer.Option(None, "--prefix", help="The cluster to talk to: "
                                                "its cluster.key_prefix (its name), e.g. "
                                                "/mooncaked/prod/; overrides the file."),
           token_file: Optional[Path] = typer.Option(None, "--token-file", help="The cluster's "
                                                     "token file (cluster.token_file); "
                                                     "overrides the file.")) -> None:
    """Inspect and operate a running cluster."""
    _GLOBAL.update(prefix=prefix, token_file=str(token_file) if token_file else None)


_CONFIG = typer.Option(None, "--config", "-c", help="TOML settings of the cluster (its \\[cluster] "
                       "section tells where the coordinator is); default: the running "
                       "`mooncake up` cluster's, if any.")
_BACKEND = typer.Option(None, help="local | etcd (overrides the file).")
_STATE = typer.Option(None, "--state-dir", help="Local backend's state directory.")
_ETCD = typer.Option(None, "--etcd", help="etcd client URL (repeatable).")
_JSON = typer.Option(False, "--json", help="Print one JSON object.")
_TIMEOUT = typer.Option(3.0, help="Timeout of each call to a node, seconds.")


def _cluster(config: Optional[Path], backend: Optional[str], state_dir: Optional[str],
             etcd: Optional[list[str]]):
    from mooncaked.cluster.launcher import default_ctl_config_path  # noqa: PLC0415
    from mooncaked.config import ConfigError, load_settings  # noqa: PLC0415

    if config is None and backend is None and default_ctl_config_path().exists():
        config = default_ctl_config_path()
    try:
        s = load_settings(config, {"cluster.backend": backend, "cluster.state_dir": state_dir,
                                   "cluster.etcd_endpoints": etcd or None,
                                   "cluster.key_prefix": _GLOBAL.get("prefix"),
                                   "cluster.token_file": _GLOBAL.get("token_file")})
    except ConfigError as e:
        typer.echo(f"mooncake ctl: configuration error: {e}", err=True)
        raise typer.Exit(2) from None
    return s.cluster


def _view(config, backend, state_dir, etcd, timeout) -> dict:
    from mooncaked.wire.errors import ClusterError  # noqa: PLC0415
    from mooncaked.cluster.admin import cluster_view  # noqa: PLC0415
    from mooncaked.config import ConfigError  # noqa: PLC0415

    cs = _cluster(config, backend, state_dir, etcd)
    try:
        v = asyncio.run(cluster_view(cs, timeout))
    except ClusterError as e:
        typer.echo(f"mooncake ctl: cannot reach the coordinator: {e}", err=True)
        raise typer.Exit(1) from None
    except ConfigError as e:
        typer.echo(f"mooncake ctl: configuration error: {e}", err=True)
        raise typer.Exit(2) from None
    if not v["nodes"]:
        where = (cs.state_dir or "the default state directory") if cs.backend == "local" \
            else ", ".join(cs.etcd_endpoints)
        typer.echo(f"mooncake ctl: no cluster found: no node is registered under "
                   f"{cs.key_prefix} ({cs.backend} backend, {where}); give -c FILE with the "
                   f"cluster's [cluster] settings", err=True)
        raise typer.Exit(1)
    return v


def _print_json(obj: Any) -> None:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2, default=str).decode() + "\n")


PIPED_WIDTH = 100_000  # columns of a piped table: wide enough never to wrap a row


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    # On a terminal the table fits its width (long cells fold); piped or redirected it takes
    # its natural width, one line per row, so URLs and ids are never split mid-word.
    piped = not sys.stdout.isatty()
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold", no_wrap=piped)
    for r in rows:
        t.add_row(*["-" if v is None else str(v) for v in r])
    Console(width=PIPED_WIDTH if piped else None).print(t)


def _health(n: dict) -> str:
    if "error" in n:
        return "[red]unreachable[/red]"
    if ((n["status"].get("cpp") or {}).get("stalled")):     # a CPP stage that takes nothing now
        return "[red]stalled[/red]"
    return "[yellow]draining[/yellow]" if n["status"].get("draining") else "[green]ok[/green]"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rate(bytes_per_s: float) -> str:
    """bytes/s as a link rate: '80 kbit/s', '943 Mbit/s', '1.20 Gbit/s'."""
    bits = bytes_per_s * 8
    if bits >= 1e9:
        return f"{bits / 1e9:.2f} Gbit/s"
    return f"{bits / 1e6:.0f} Mbit/s" if bits >= 1e6 else f"{bits / 1e3:.0f} kbit/s"


def _link_rate(links: dict | None) -> str | None:
    """A node's measured link rate: the median of its transfer engine's peer paths
    (conductor status `links`, bytes/s), None before it moved enough bytes to know."""
    if not links:
        return None
    rates = sorted(links.values())
    return _rate(rates[len(rates) // 2])


def _ms(s: dict | None, key: str) -> str | None:
    v = (s or {}).get(key)
    return None if v is None else f"{v * 1e3:.1f}"


def _stall_table(v: dict) -> None:
    """Per node: engine step time by kind, event-loop lag and relay delay (p50 / p99 / max
    in ms, from node.status "stalls")."""
    rows = []
    for nid, n in sorted(v["nodes"].items()):
        st = (n.get("status") or {}).get("stalls")
        if not st:
            continue
        for name, s in [*((f"step {k}", x) for k, x in st["step"].items()),
                        ("loop lag", st["loop_lag"]), ("relay delay", st["relay_delay"])]:
            if s.get("count"):
                rows.append([nid, name, s["count"], _ms(s, "p50_s"), _ms(s, "p99_s"),
                             _ms(s, "max_s")])
    if rows:
        _table("stalls (ms)", ["node", "measure", "count", "p50", "p99", "max"], rows)


def _group_table(v: dict) -> None:
    """CPP groups (cluster/cpp/cpp_node.py): each stage's node, its layers, weights, the
    requests it holds and the layer slices in its store (cluster/cpp/stage_prefix.py); a group
    missing a stage is marked incomplete (not placed on)."""
    rows, groups = [], {}
    for nid, n in v["nodes"].items():
        c = n["info"].get("cpp")
        if c:
            groups.setdefault(c["group"], []).append((c["stage"], nid, n))
    for g, members in sorted(groups.items()):
        members.sort(key=lambda t: t[0])
        stages = members[0][2]["info"]["cpp"]["stages"]
        complete = [s for s, _, _ in members] == list(range(stages))
        for s, nid, n in members:
            c, st = n["info"]["cpp"], (n.get("status") or {}).get("cpp") or {}
            lo, hi = c["layers"]
            rows.append([g, f"{s}/{stages}" + ("" if complete else " (incomplete)"), nid,
                         f"{lo}-{hi - 1} ({hi - lo} of {c.get('num_layers', '?')})",
                         _bytes(c.get("weight_bytes")), c.get("chunk_tokens"), _health(n),
                         len(st.get("requests", [])) if st else None,
                         (st.get("prefix") or {}).get("slices") if st else None])
    if rows:
        _table("CPP groups", ["group", "stage", "node", "layers", "weights", "chunk", "health",
                              "requests", "slices"], rows)


def _kernel_table(v: dict) -> None:
    """Per model node: its CPU (or GPU), ISA level, resolved dtype (model.dtype = auto resolves
    per CPU) and the kernel variants it runs (engine/kernel_paths.py)."""
    rows = []
    for nid, n in sorted(v["nodes"].items()):
        k = (n["info"].get("model") or {}).get("kernels")
        if k:
            dtype = k["dtype"] + (" (auto)" if k.get("requested_dtype") == "auto" else "")
            prefill = k["prefill_path"]
            if k.get("prompt_matmul", "float32") != k["dtype"]:   # bf16 / int8 prompt projections
                prefill += f" + {k['prompt_matmul']} matmuls"
            rows.append([nid, k["cpu"], k["isa"], dtype, k["weight_format"], k["decode_path"], prefill])
    if rows:
        _table("kernels", ["node", "cpu", "isa", "dtype", "weights", "decode", "prefill"], rows)


@ctl_app.command()
def status(config: Optional[Path] = _CONFIG, backend: Optional[str] = _BACKEND,
           state_dir: Optional[str] = _STATE, etcd: Optional[list[str]] = _ETCD,
           json_out: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """Leader, nodes, roles, health and versions; each model node's CPU, ISA, dtype and kernel
    variants; the conductor's counters and cost model."""
    v = _view(config, backend, state_dir, etcd, timeout)
    if json_out:
        _print_json(v)
        return
    rows = []
    seen = (v["conductor"].get("nodes") or {}) if isinstance(v["conductor"], dict) else {}
    for nid, n in sorted(v["nodes"].items()):
        info, st = n["info"], n.get("status") or {}
        rows.append([("* " if nid == v["leader"] else "") + nid, info.get("role"), _health(n),
                     info.get("version"), info.get("api"),
                     _link_rate((seen.get(nid) or {}).get("links")), info.get("pid"),
                     f"{st['uptime_s']:.0f} s" if st.get("uptime_s") is not None else None,
                     (info.get("model") or {}).get("name")])
    _table(f"cluster ({v['backend']} backend), leader: {v['leader'] or 'none'}",
           ["node", "role", "health", "version", "api", "link", "pid", "uptime", "model"], rows)
    _kernel_table(v)
    _node_admission_table(v)
    _group_table(v)
    _stall_table(v)
    _print_conductor(v["conductor"])


def _node_admission_table(v: dict) -> None:
    """Per decode (or coupled) node: its own TBT check (cluster/admission.py), which refuses
    a request before its prefill runs (429 decode_full at the client); the conductor's
    rejections are counted apart, below."""
    rows = []
    for nid, n in sorted(v["nodes"].items()):
        a = (n.get("status") or {}).get("admission")
        if not a:
            continue
        pred = (a.get("decode_step_prediction") or {}).get("median_abs_rel_error")
        if not a.get("active", True):    # no conductor.tbt_slo_s (or mode off): checks nothing
            rows.append([nid, f"{a['mode']}, inactive (no TBT SLO)" if a["mode"] != "off" else "off",
                         a["admitted"], a["rejected"], a["shadow_rejected"], "-", "-"])
            continue
        rows.append([nid, a["mode"], a["admitted"], a["rejected"], a["shadow_rejected"],
                     "yes" if a.get("calibrated") else "no (shadow until it is)", _rel(pred)])
    if rows:
        _table("node admission (TBT check on the decode side)",
               ["node", "mode", "admitted", "refused", "shadow-refused", "calibrated",
                "step error (median |rel|)"], rows)


def _finite(x: object) -> bool:
    """A number that bounds something (an SLO of inf, or null as JSON writes inf, does not)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def _cost_model_origin(cm: dict) -> str:
    """The cost model's name, where it came from and its source, each said once ("built-in
    default", not "default [default] from built-in default")."""
    name, source = cm.get("name") or "-", cm.get("source") or ""
    origin = (cm.get("meta") or {}).get("origin") or ""
    if origin == "built-in default":          # "default CPU estimate (built-in)"
        return origin if name == "default" else f"{name} (built-in)"
    text = origin if origin and name in origin else name + (f" from {origin}" if origin else "")
    return text + (f" [{source}]" if source and source not in text else "")


def _print_conductor(c: dict) -> None:
    """The conductor's part of `ctl status`: counters, cost model, calibration, admission,
    rejections, prediction errors (c: conductor.status, or {"error": ...})."""
    if "error" in c:
        typer.echo(f"conductor: {c['error']}")
        return
    cm = c.get("cost_model") or {}
    err = c.get("ttft_prediction") or {}
    med = err.get("median_abs_rel_error")
    derr = c.get("decode_step_prediction") or {}
    dmed = derr.get("median_abs_rel_error")
    rejected = f"rejected {sum(c['rejected'].values())}"
    rep = c.get("replication") or {}
    typer.echo(f"conductor on {c['leader']}: policy {c['policy']}, placed {c['placed']}, "
               f"{rejected}, indexed blocks {c['indexed_keys']}, hot-block copies "
               f"{rep.get('started', 0)} ({rep.get('blocks', 0)} blocks, "
               f"{rep.get('failed', 0)} failed)")
    bw = c.get("transfer_bandwidth") or {}
    if bw.get("used_bytes_per_s"):
        n = bw["measured_paths"]
        src = (f"median of {n} measured path{'' if n == 1 else 's'}" if n
               # the meter ignores busy periods under 256 KiB (latency, not bandwidth):
               # a small prompt's layer-wise push measures nothing
               else "no transfer large enough to measure yet")
        paths = bw.get("fetch_paths") or {}
        typer.echo(f"transfer bandwidth in the cost model: {_rate(bw['used_bytes_per_s'])} "
                   f"({src}; configured {_rate(bw['configured_bytes_per_s'])})"
                   + ("; fetches over a measured path at its rate: " + ", ".join(
                       f"{p} {_rate(r)}" for p, r in paths.items()) if paths else ""))
    typer.echo(f"cost model: {_cost_model_origin(cm)}, refits: "
               f"prefill {cm.get('refits', 0)}, decode {cm.get('decode_refits', 0)}")
    scale, seen = cm.get("scale") or {}, cm.get("observed_steps") or {}
    cal = cm.get("calibrated") or {}
    if scale:
        typer.echo("calibration: " + ", ".join(
            f"{k} x{scale[k]:.3g} from {seen.get(k, 0)} steps"
            f"{'' if cal.get(k) else ' (not calibrated yet: admission in shadow)'}"
            for k in ("prefill", "decode")))
    by = cm.get("calibrated_by") or {}
    if by:
        typer.echo("calibrated by: " + ", ".join(f"{k} {by.get(k) or '-'}"
                                                 for k in ("prefill", "decode")))
    if "tbt_factor" in cm:    # what the TBT check multiplies the predicted step by
        typer.echo(f"TBT factor: x{cm['tbt_factor']:.3g} from "
                   f"{cm.get('tbt_factor_from', '-')} ({cm.get('observed_tbts', 0)} "
                   f"observed TBTs in the last minute)")
    profiles = c.get("startup_profiles") or {}
    if profiles:
        typer.echo("startup profiles: " + "; ".join(
            f"{nid} {_profile_line(p)}" for nid, p in profiles.items()))
    adm = c.get("admission") or {}
    slo = c.get("slo") or {}
    if adm and not any(_finite(slo.get(k)) for k in ("ttft_s", "tbt_s")):
        # no SLO to check against (conductor.ttft_slo_s / tbt_slo_s unset): it admits all
        typer.echo(f"admission: {adm['mode']}, inactive (no TTFT or TBT SLO), admitted "
                   f"{adm['admitted']}")
    elif adm:
        typer.echo(f"admission: {adm['mode']}, admitted {adm['admitted']}, rejected "
                   f"{adm['rejected']}, shadow-rejected {adm['shadow_rejected']}"
                   + (" (" + ", ".join(f"{r} {n}" for r, n in
                                       adm["shadow_rejected_by_reason"].items()) + ")"
                      if adm["shadow_rejected"] else ""))
    if c["rejected"]:
        _table("rejections", ["reason", "count"],
               [[r, n] for r, n in sorted(c["rejected"].items(), key=lambda x: -x[1])])
    typer.echo(f"prediction error (median |rel|): TTFT "
               f"{'-' if med is None else f'{med:.1%}'} over {err.get('samples', 0)} requests, "
               f"decode step {'-' if dmed is None else f'{dmed:.1%}'} over "
               f"{derr.get('samples', 0)} steps, prefill step "
               f"{_rel((c.get('prefill_step_prediction') or {}).get('median_abs_rel_error'))} "
               f"over {(c.get('prefill_step_prediction') or {}).get('samples', 0)} steps")
    e2e = c.get("ttft_e2e_prediction") or {}
    if e2e.get("samples"):
        comp = c.get("ttft_e2e_prediction_compute_only") or {}
        typer.echo(f"TTFT as clients saw it (median |rel| over {e2e['samples']} requests): "
                   f"{_rel(e2e.get('median_abs_rel_error'))} with the overhead learned by "
                   f"each placement (now {c.get('ttft_overhead_s', 0):.3f} s), "
                   f"{_rel(comp.get('median_abs_rel_error'))} without any")


def _profile_line(p: dict) -> str:
    """One node's start-up profile (StartupProfile.summary) in words."""
    line = (f"{p['seconds']:.1f} s of {p['budget_s']:g} s, {p['prefill_steps']} prefill + "
            f"{p['decode_steps']} decode steps")
    if not p["complete"]:
        line += " (budget ended it)"
    if p.get("cached"):
        line += " (cached: an earlier start measured it)"
    elif p.get("contended"):
        line += f" (got {p['cpu_share']:.0%} of the CPU: contended, not cached)"
    return line


def _rel(x: float | None) -> str:
    """A relative error as a percentage, '-' for none."""
    return "-" if x is None else f"{x:.1%}"


@ctl_app.command()
def nodes(config: Optional[Path] = _CONFIG, backend: Optional[str] = _BACKEND,
          state_dir: Optional[str] = _STATE, etcd: Optional[list[str]] = _ETCD,
          json_out: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """Every registered node with its addresses (API, control, transfer) and registration."""
    v = _view(config, backend, state_dir, etcd, timeout)
    if json_out:
        _print_json({nid: {k: n[k] for k in ("info", "incarnation", "registered_at")}
                     for nid, n in v["nodes"].items()})
        return
    rows = []
    for nid, n in sorted(v["nodes"].items()):
        info = n["info"]
        tr = info.get("transfer") or {}
        seg = ((info.get("store") or {}).get("segment") or {}).get("name")
        rows.append([nid, info.get("role"), _health(n), info.get("api"), info.get("control"),
                     f"{tr.get('backend')}://{tr.get('host')}:{tr.get('port')}", seg,
                     time.strftime("%H:%M:%S", time.localtime(n["registered_at"])),
                     n["incarnation"][:8]])
    _table("nodes", ["node", "role", "health", "api", "control", "transfer", "store segment",
                     "registered", "incarnation"], rows)


@ctl_app.command()
def cache(config: Optional[Path] = _CONFIG, backend: Optional[str] = _BACKEND,
          state_dir: Optional[str] = _STATE, etcd: Optional[list[str]] = _ETCD,
          json_out: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """KV blocks and bytes per tier per node, store and prefix-cache hit rates."""
    v = _view(config, backend, state_dir, etcd, timeout)
    cnodes = (v["conductor"].get("nodes") or {}) if "error" not in v["conductor"] else {}
    out = {}
    for nid, n in sorted(v["nodes"].items()):
        st = n.get("status") or {}
        s, e = st.get("store") or {}, st.get("engine") or {}
        hits = s.get("hits_dram", 0) + s.get("hits_ssd", 0)
        out[nid] = {
            "role": n["info"].get("role"),
            "device_blocks": e.get("kv_blocks_used"), "device_capacity": e.get("kv_blocks_total"),
            "dram_blocks": s.get("dram_blocks"), "dram_bytes": s.get("dram_used_bytes"),
            "dram_capacity_bytes": s.get("dram_capacity_bytes"),
            "ssd_blocks": s.get("ssd_blocks"), "ssd_bytes": s.get("ssd_used_bytes"),
            "store_hit_rate": hits / (hits + s.get("misses", 0)) if hits + s.get("misses", 0)
            else None,
            # decode nodes admit prefilled prompts: they take no prefix lookups
            "prefix_hit_rate": (e["prefix_hit_tokens_total"] / e["prompt_tokens_total"])
            if e.get("prompt_tokens_total") and n["info"].get("role") != "decode" else None,
            "indexed_blocks": (cnodes.get(nid) or {}).get("indexed_blocks"),
            "error": n.get("error")}
    if json_out:
        _print_json(out)
        return
    rows = [[nid, o["role"], _health(v["nodes"][nid]),
             f"{o['device_blocks']}/{o['device_capacity']}" if o["device_capacity"] else None,
             None if o["dram_blocks"] is None else
             f"{o['dram_blocks']} ({_bytes(o['dram_bytes'])} of "
             f"{_bytes(o['dram_capacity_bytes'])})",
             None if o["ssd_blocks"] is None else f"{o['ssd_blocks']} ({_bytes(o['ssd_bytes'])})",
             None if o["store_hit_rate"] is None else f"{o['store_hit_rate']:.1%}",
             None if o["prefix_hit_rate"] is None else f"{o['prefix_hit_rate']:.1%}",
             o["indexed_blocks"]] for nid, o in out.items()]
    _table("KV cache", ["node", "role", "health", "device blocks", "DRAM blocks", "SSD blocks",
                        "store hit rate", "prefix hit rate", "conductor index"], rows)


@ctl_app.command()
def requests(config: Optional[Path] = _CONFIG, backend: Optional[str] = _BACKEND,
             state_dir: Optional[str] = _STATE, etcd: Optional[list[str]] = _ETCD,
             json_out: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """Running and queued requests per node (prefill, decode, API front end, staged KV)."""
    v = _view(config, backend, state_dir, etcd, timeout)
    cnodes = (v["conductor"].get("nodes") or {}) if "error" not in v["conductor"] else {}
    out = {}
    for nid, n in sorted(v["nodes"].items()):
        st = n.get("status") or {}
        r, e = st.get("requests") or {}, st.get("engine") or {}
        out[nid] = {"role": n["info"].get("role"), "prefill": r.get("prefill", []),
                    "decode": r.get("decode", []), "api": r.get("frontend"),
                    "staged": r.get("staged"), "engine_running": e.get("num_running"),
                    "engine_waiting": e.get("num_waiting"),
                    "queue_s": (cnodes.get(nid) or {}).get("queue_s"), "error": n.get("error")}
    if json_out:
        _print_json(out)
        return
    rows = [[nid, o["role"], _health(v["nodes"][nid]), len(o["prefill"]), len(o["decode"]),
             o["api"], o["staged"], o["engine_running"], o["engine_waiting"],
             None if o["queue_s"] is None else f"{o['queue_s']:.2f} s"] for nid, o in out.items()]
    _table("requests", ["node", "role", "health", "prefill", "decode", "api", "staged KV",
                        "engine running", "engine waiting", "predicted queue"], rows)


def _drain(node: str, config, backend, state_dir, etcd, json_out, timeout,
           method: str) -> dict:
    from mooncaked.wire.errors import ClusterError  # noqa: PLC0415
    from mooncaked.cluster.admin import drain_node  # noqa: PLC0415
    from mooncaked.config import ConfigError  # noqa: PLC0415

    try:
        r = asyncio.run(drain_node(_cluster(config, backend, state_dir, etcd), node, timeout,
                                   method))
    except KeyError as e:
        typer.echo(f"mooncake ctl: {e.args[0]}", err=True)
        raise typer.Exit(1) from None
    except ConfigError as e:
        typer.echo(f"mooncake ctl: configuration error: {e}", err=True)
        raise typer.Exit(2) from None
    except ClusterError as e:
        typer.echo(f"mooncake ctl: {e}", err=True)
        raise typer.Exit(1) from None
    if json_out:
        _print_json(r)
    return r


@ctl_app.command()
def drain(node: str = typer.Argument(..., help="Node id to drain."),
          config: Optional[Path] = _CONFIG, backend: Optional[str] = _BACKEND,
          state_dir: Optional[str] = _STATE, etcd: Optional[list[str]] = _ETCD,
          json_out: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """Take no new requests on NODE and let its running ones finish."""
    r = _drain(node, config, backend, state_dir, etcd, json_out, timeout, "node.drain")
    if not json_out:
        typer.echo(f"{node}: draining ({r['prefill']} prefill and {r['decode']} decode "
                   f"requests still running)")


@ctl_app.command()
def undrain(node: str = typer.Argument(..., help="Node id to take requests again."),
            config: Optional[Path] = _CONFIG, backend: Optional[str] = _BACKEND,
            state_dir: Optional[str] = _STATE, etcd: Optional[list[str]] = _ETCD,
            json_out: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """Let a drained NODE take requests (and stand for conductor) again."""
    _drain(node, config, backend, state_dir, etcd, json_out, timeout, "node.undrain")
    if not json_out:
        typer.echo(f"{node}: serving")
