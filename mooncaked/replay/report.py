"""Replay outputs on disk: one JSON file (config, summary, per-request records) and PNG CDFs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from .runner import RequestRecord

JSON_NAME = "replay.json"
TTFT_PNG = "ttft_cdf.png"
TBT_PNG = "tbt_cdf.png"


def write_json(out_dir: Path, config: dict[str, Any], summary: dict[str, Any],
               records: Sequence[RequestRecord]) -> Path:
    """Write {"config", "summary", "requests"} to out_dir/replay.json; returns its path.

    Raises OSError if the directory cannot be created or written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / JSON_NAME
    doc = {"config": config, "summary": summary, "requests": [r.to_dict() for r in records]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    tmp.replace(path)  # never leave a half-written file under the final name
    return path


def _cdf(ax: Any, values: Sequence[float], slos: Sequence[float], xlabel: str, title: str) -> None:
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post")
    for s in slos:
        ax.axvline(s, linestyle="--", linewidth=0.8, color="gray")
        ax.text(s, 0.02, f" {s:g} s", rotation=90, va="bottom", fontsize=8, color="gray")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of completed requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def write_plots(out_dir: Path, records: Sequence[RequestRecord], ttft_slo_s: float,
                tbt_slos_s: Sequence[float]) -> list[Path]:
    """Write the TTFT and TBT CDFs of completed requests as PNGs; returns the paths written.

    A plot with no values (nothing completed) is skipped. Uses matplotlib's Agg backend.
    """
    import matplotlib  # noqa: PLC0415  (optional dependency: only the plots need it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    done = [r for r in records if r.ok]
    for name, values, slos, label in (
        (TTFT_PNG, [r.ttft_s for r in done if r.ttft_s is not None], [ttft_slo_s], "TTFT (s)"),
        (TBT_PNG, [r.tbt_s for r in done if r.tbt_s is not None], list(tbt_slos_s),
         "TBT: mean of longest 10% inter-token gaps (s)"),
    ):
        if not values:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, values, slos, label, f"{label.split(':')[0].split(' (')[0]} CDF, "
                                      f"{len(values)} requests")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
