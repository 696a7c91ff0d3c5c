"""The cluster-wide cost model: one copy in the coordination backend, under the key
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
from typing import Any

from mooncaked.log import get_logger

from .cost_model import CostModel

log = get_logger(__name__)

COST_KEY = "cost_model"


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


async def publish(cluster_settings: Any, model: CostModel, path: str) -> None:
    """Stores model under COST_KEY in the cluster's coordination backend.
    Raises: CoordinationError when it cannot be reached."""
    from mooncaked.coord.factory import make_coordinator  # noqa: PLC0415

    async with make_coordinator(cluster_settings) as coord:
        await coord.put(COST_KEY, record(model, path))
    log.info("cost_model_published", key=COST_KEY, backend=cluster_settings.backend)


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


__all__ = ["COST_KEY", "follow", "from_record", "load", "publish", "record"]
