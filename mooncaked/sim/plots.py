"""PNG figures of simulator results (matplotlib, Agg backend: no display needed).

Each function writes one PNG and returns its path. Figure numbers are the Mooncake
paper's (FAST'25).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .engine import SimResult  # noqa: E402


def _cdf(ax, values: np.ndarray, label: str) -> None:
    v = np.sort(np.asarray(values, dtype=np.float64))
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def plot_distributions(results: Mapping[str, SimResult], path: str | Path,
                       tbt_thresholds_s: Sequence[float] = (0.1, 0.2, 0.3),
                       ttft_threshold_s: float = 30.0) -> Path:
    """TTFT and TBT CDFs, one line per run (keys of `results` label the lines)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        _cdf(a1, r.ttft_s, name)
        if len(r.tbt_s) and r.tbt_s.max() > 0:      # prefill-only runs have no TBT
            _cdf(a2, r.tbt_s * 1000, name)
    a1.axvline(ttft_threshold_s, color="grey", ls=":", lw=1)
    for t in tbt_thresholds_s:
        a2.axvline(t * 1000, color="grey", ls=":", lw=1)
    a1.set(xscale="log", xlabel="TTFT (s)", ylabel="share of requests", title="TTFT")
    a2.set(xscale="log", xlabel="TBT, mean of the longest 10% gaps (ms)", title="TBT")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_ttft_bars(ttft_mean_s: Mapping[str, float], path: str | Path,
                   paper: Mapping[str, float] | None = None) -> Path:
    """Average TTFT per policy, ours next to the paper's (Figure 5)."""
    names = list(ttft_mean_s)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.38 if paper else 0.6
    ax.bar(x - (w / 2 if paper else 0), [ttft_mean_s[n] for n in names], w, label="simulated")
    if paper:
        ax.bar(x + w / 2, [paper.get(n, np.nan) for n in names], w, label="paper (Figure 5)")
    ax.set_xticks(x, [n.replace("_", "\n") for n in names])
    ax.set(ylabel="average TTFT (s)", title="Average TTFT by prefill placement policy")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_hit_rate_vs_capacity(capacities_tokens: Sequence[float], hit_rates: Sequence[float],
                              path: str | Path, unbounded: float | None = None,
                              points: Mapping[str, Sequence[tuple[float, float]]] | None = None
                              ) -> Path:
    """Hit rate against cache capacity (Figure 9); `points` adds labelled simulated points
    (capacity per node, hit rate)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(capacities_tokens, hit_rates, marker="o", label="one LRU cache, requests in order")
    if unbounded is not None:
        ax.axhline(unbounded, color="grey", ls="--", lw=1, label=f"unbounded: {unbounded:.3f}")
    for name, pts in (points or {}).items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="s", ls="--", label=name)
    ax.set(xscale="log", xlabel="cache capacity (tokens)", ylabel="cache hit rate",
           title="Prefix cache hit rate vs capacity (conversation trace)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_replicas(result: SimResult, path: str | Path, nodes: int | None = None) -> Path:
    """Replica count of the keys ranked 10th, 100th, ... by use, over time (Figure 11)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for rank, series in sorted(result.replicas.items()):
        if series:
            t, c = zip(*series)
            ax.plot(np.asarray(t) / 60, c, label=f"key ranked {rank}")
    if nodes:
        ax.axhline(nodes, color="grey", ls=":", lw=1, label=f"{nodes} prefill nodes")
    ax.set(xlabel="time (min)", ylabel="replicas (prefill nodes holding the key)",
           title=f"Replicas of hot keys over time ({result.summary['policy']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_hit_windows(results: Mapping[str, SimResult], path: str | Path) -> Path:
    """Hit rate over time per run (Figure 10's global vs local comparison)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        if r.hit_windows:
            t, h = zip(*r.hit_windows)
            ax.plot(np.asarray(t) / 60, h, marker=".", label=name)
    ax.set(xlabel="time (min)", ylabel="cache hit rate", title="Cache hit rate over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_capacity(sweep: dict, path: str | Path) -> Path:
    """Highest arrival rate at the target share, per policy and TBT threshold (Figure 1)."""
    res = sweep["results"]
    policies = list(res)
    thrs = list(next(iter(res.values())))
    x = np.arange(len(thrs))
    w = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(policies):
        ax.bar(x + (i - (len(policies) - 1) / 2) * w,
               [res[p][t]["arrival_rate_rps"] for t in thrs], w, label=p)
    ax.set_xticks(x, [f"TBT {float(t) * 1000:g} ms" for t in thrs])
    ax.set(ylabel="arrival rate (req/s)",
           title=f"Effective request capacity (>= {sweep['target']:.0%} within TTFT "
                 f"{sweep['ttft_threshold_s']:g} s and TBT)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
