"""Where the cost model comes from: the file `mooncaked profile` writes
(`cost_model_path`, `load_cost_model`, else `default_cost_model`) and the cluster-wide
copy in the coordination backend, under the key
`cost_model` of the cluster's key_prefix (persistent, not bound to a lease).

`mooncaked profile` on any model node publishes what it fitted there (and still writes
the file); the conductor, on whichever node leads, reads the key when it starts and
follows it (a watch), so a new profile takes effect at once, without a leader change.
Without the key the conductor falls back to the file (`conductor.cost_model`, else its
own state dir) and then to a rough default. `mooncake ctl status` shows where the model
in use came from (`cost_model.meta.origin`).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from mooncaked.config import Settings, state_dir
from mooncaked.log import get_logger

from .cost_model import CostModel, PolyModel, TransferModel

log = get_logger(__name__)

COST_KEY = "cost_model"


def cost_model_path(settings: Settings) -> Path:
    """Where `mooncaked profile` writes the cost model and the conductor reads it:
    conductor.cost_model, else <state dir>/cost_model.json."""
    return Path(settings.conductor.cost_model) if settings.conductor.cost_model \
        else state_dir(settings) / "cost_model.json"


def default_cost_model(kv_bytes_per_token: int) -> CostModel:
    """A rough cost model of the bundled 135M model on a small shared CPU (2 cores), for
    clusters that have not run `mooncaked profile` yet: prefill about 6 ms a new token,
    a decode step 40 ms plus 4 ms a sequence and 20 us a context token (one thread,
    fp32), loopback TCP at 1 GB/s."""
    return CostModel(
        prefill=PolyModel(((0, 0), (1, 0), (0, 1), (2, 0), (1, 1)), (0.05, 0.006, 1e-5, 0.0, 0.0)),
        decode=PolyModel(((0, 0), (1, 0), (0, 1)), (0.04, 0.004, 2e-5)),
        transfer=TransferModel(1e9, 0.002), kv_bytes_per_token=max(1, kv_bytes_per_token),
        name="default CPU estimate (run `mooncaked profile` to fit this hardware)",
        meta={"source": "default"})


def load_cost_model(settings: Settings, kv_bytes_per_token: int) -> CostModel:
    """The profiled cost model if its file exists and is valid, else `default_cost_model`
    (logged). Never raises for a missing or bad file: the conductor must come up."""
    path = cost_model_path(settings)
    if path.exists():
        try:
            model = CostModel.load(path)
            log.info("cost_model_loaded", path=str(path), name=model.name)
            return model
        except (OSError, ValueError) as e:
            log.error("cost_model_invalid", path=str(path), error=str(e))
    else:
        log.warning("cost_model_missing", path=str(path),
                    hint="run `mooncaked profile` on this hardware")
    return default_cost_model(kv_bytes_per_token)


def record(model: CostModel, path: str) -> dict:
    """The value stored under COST_KEY: the model and where it was fitted."""
    return {"model": model.to_dict(), "host": socket.gethostname(), "path": path,
            "at": time.time()}


def from_record(rec: Any) -> CostModel:
    """The CostModel of a stored record, its meta["origin"] naming host, file and time.
    Raises: ValueError for a malformed record."""
    if not isinstance(rec, dict) or "model" not in rec:
        raise ValueError("malformed cost_model record")
    model = CostModel.from_dict(rec["model"])
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.get("at", 0)))
    model.meta["origin"] = (f"coordinator key {COST_KEY} (profiled on {rec.get('host')}, "
                            f"file {rec.get('path')}, {when})")
    return model


async def publish(coord: Any, model: CostModel, path: str) -> None:
    """Stores model under COST_KEY through `coord`, a started coordinator
    (mooncaked.coord). Raises: CoordinationError when the backend cannot be reached."""
    await coord.put(COST_KEY, record(model, path))
    log.info("cost_model_published", key=COST_KEY)


async def load(coord: Any) -> CostModel | None:
    """The stored model, or None when there is none (or it is malformed: logged)."""
    rec = await coord.get(COST_KEY)
    if rec is None:
        return None
    try:
        return from_record(rec)
    except ValueError as e:
        log.error("cost_model_invalid", key=COST_KEY, error=str(e))
        return None


async def follow(coord: Any, on_model) -> None:
    """Calls on_model(CostModel) for the stored model now and after every change; runs
    until cancelled (outages are survived by the coordinator's watch)."""
    last = None
    async for snap in coord.watch(COST_KEY):
        rec = snap.get(COST_KEY)
        if rec is None or rec == last:
            continue
        last = rec
        try:
            on_model(from_record(rec))
        except ValueError as e:
            log.error("cost_model_invalid", key=COST_KEY, error=str(e))


__all__ = ["COST_KEY", "cost_model_path", "default_cost_model", "follow", "from_record", "load",
           "load_cost_model", "publish", "record"]
