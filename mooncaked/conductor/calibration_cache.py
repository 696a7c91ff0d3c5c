"""The cost model a conductor calibrated while serving (conductor/refit.py), kept per
machine, model and dtype under the state dir, so the next start on the same hardware
predicts (and admits) with it at once instead of the built-in default.

The key is what makes a model's timings: the model nodes' CPU (`cpu` of their member
record's model info, /proc/cpuinfo's model name), the model id, its dtype and the torch
threads per node (`model.num_threads`). The file is
<state dir>/cost_models/calibrated-<blake2b of the key>.json, the key itself in the
model's meta. A profile (`mooncaked profile`, the coordinator key) or an operator's
`conductor.cost_model` file always wins over it; it only replaces the built-in default.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from mooncaked.log import get_logger

from .cost_model import CostModel

log = get_logger(__name__)

SOURCE = "calibrated"


def machine_key(model_info: dict[str, Any], threads: int) -> dict[str, Any] | None:
    """The key of a model node's timings, from its member record's model info; None when
    the record lacks the CPU or the model id (an older node)."""
    cpu, model = model_info.get("cpu"), model_info.get("model_id") or model_info.get("name")
    if not cpu or not model:
        return None
    return {"cpu": str(cpu), "model": str(model), "dtype": str(model_info.get("dtype", "")),
            "threads": int(threads)}


def cache_path(state_dir: Path, key: dict[str, Any]) -> Path:
    """Where the calibrated model of `key` lives under `state_dir`."""
    text = "|".join(f"{k}={key[k]}" for k in sorted(key))
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return state_dir / "cost_models" / f"calibrated-{digest}.json"


def save(state_dir: Path, key: dict[str, Any], model: CostModel) -> Path | None:
    """Writes `model` as the calibrated model of `key` (source "calibrated", the key in
    its meta); returns the path, None when it cannot be written (logged)."""
    path = cache_path(state_dir, key)
    meta = {**model.meta, "source": SOURCE, "machine_key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        CostModel(model.prefill, model.decode, model.transfer, model.kv_bytes_per_token,
                  f"calibrated on {key['cpu']} ({key['model']}, {key['dtype']}, "
                  f"{key['threads']} threads)", meta).save(path)
    except OSError as e:
        log.warning("calibrated_cost_model_unsaved", path=str(path), error=str(e))
        return None
    return path


def load(state_dir: Path, key: dict[str, Any]) -> CostModel | None:
    """The calibrated model of `key`, or None (no file, or an unreadable one: logged)."""
    path = cache_path(state_dir, key)
    if not path.exists():
        return None
    try:
        model = CostModel.load(path)
    except (OSError, ValueError) as e:
        log.warning("calibrated_cost_model_invalid", path=str(path), error=str(e))
        return None
    if model.meta.get("machine_key") != key:        # a hash collision, or a hand edit
        return None
    model.meta["origin"] = f"calibrated cache {path}"
    return model


__all__ = ["SOURCE", "cache_path", "load", "machine_key", "save"]
