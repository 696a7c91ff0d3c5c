"""Runs lm-evaluation-harness's mc_facts task (this folder) on models; prints JSON.

Usage: python run_mc_facts.py MODEL MODEL_ARGS [MODEL MODEL_ARGS ...] (lm-eval's names:
`local-completions` against a server, `hf` on transformers), each in turn in this one
process (lm-eval imports once). Run from the repository root, offline (HF_HUB_OFFLINE=1):
the task and its data are local files and the task index holds this folder only
(lm-eval's thousands of built-in tasks are not scanned). Prints, on the last line of
stdout, one JSON list with per model {"model", "acc", "acc_norm", "items": [{"doc_id",
"loglikelihoods": [one per choice]}]}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager


def evaluate(model: str, model_args: str) -> dict:
    """mc_facts with `model` (its lm-eval name) built from `model_args`: accuracies and
    each item's loglikelihoods (lm-eval's log_samples)."""
    t0 = time.monotonic()
    tasks = TaskManager(include_path=str(Path(__file__).parent), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["mc_facts"],
                                  task_manager=tasks, log_samples=True, batch_size=16,
                                  device="cpu")
    print(f"run_mc_facts: {model} took {time.monotonic() - t0:.1f} s", file=sys.stderr)
    res = out["results"]["mc_facts"]
    items = [{"doc_id": s["doc_id"], "loglikelihoods": [float(r[0][0]) for r in s["resps"]]}
             for s in sorted(out["samples"]["mc_facts"], key=lambda s: s["doc_id"])]
    return {"model": model, "acc": res["acc,none"], "acc_norm": res["acc_norm,none"],
            "items": items}


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps([evaluate(m, a) for m, a in zip(args[::2], args[1::2])]))
