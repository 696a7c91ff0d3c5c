"""Liveness and readiness of an API node: the one place that decides what /health says.

- `/livez`: 200 as soon as the process serves HTTP (a liveness probe: restart the
  process only when this fails).
- `/health`: readiness. 200 {"status": "ok"} only when this node can serve a
  request end to end; else 503 {"status": ..., "reason": ...} saying why. A
  load balancer or client waits for it before sending traffic.

The engine decides what "end to end" takes: an engine client may define
`not_ready() -> str | None` (a reason, or None when it can serve). The
single-process AsyncLLM is ready once it listens (the model loads first); the
cluster front end (cluster/frontend.py) needs a conductor and live prefill and
decode nodes. `health_status` is the whole decision, so that new conditions
(draining, a coordinator outage) are added here, in order.
"""

from __future__ import annotations

from typing import Any


def health_status(engine: Any, draining: bool) -> tuple[int, dict]:
    """(HTTP status, JSON body) of GET /health for `engine` (an EngineClient) on a
    server that is `draining` (shutting down)."""
    if draining:
        return 503, {"status": "draining", "reason": "the server is shutting down"}
    not_ready = getattr(engine, "not_ready", None)
    reason = not_ready() if not_ready is not None else None
    if reason:
        return 503, {"status": "not_ready", "reason": reason}
    return 200, {"status": "ok"}


def livez_status() -> tuple[int, dict]:
    """(HTTP status, JSON body) of GET /livez: the process is up and serving HTTP."""
    return 200, {"status": "alive"}
