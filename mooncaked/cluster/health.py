"""When a cluster node answers /health 200: the one decision, in one function, so load
balancers and systemd see the same truth as the conductor.

A node is healthy while it can take part in serving: it has joined, it is not
draining (ctl drain or SIGTERM), its coordination session is alive and a conductor
is elected. Otherwise /health answers 503 with a `status` word and a `reason`
sentence naming the node.
"""

from __future__ import annotations

from typing import Any


def node_health(node: Any) -> tuple[int, dict]:
    """(HTTP status, body) of GET /health for a ClusterNode.

    Body: {"status": "ok" | "starting" | "draining" | "coordinator_unreachable" |
    "no_conductor", "node": id, "role": role, "leader": id | None, "reason": str (503 only)}.
    """
    body: dict = {"node": node.node_id, "role": node.role, "leader": node.leader_id}

    def bad(status: str, reason: str) -> tuple[int, dict]:
        return 503, {"status": status, **body, "reason": reason}

    if node.draining:
        return bad("draining", f"{node.node_id} is draining")
    if node.view is None or node.coord is None:
        return bad("starting", f"{node.node_id} has not joined the cluster yet")
    if not node.coord.session_alive:
        return bad("coordinator_unreachable",
                   f"{node.node_id} has no live session with the coordination store "
                   f"({node.settings.cluster.backend}); it cannot be placed or elect a conductor")
    if node.leader_id is None:
        return bad("no_conductor", "no conductor is elected; requests cannot be placed")
    return 200, {"status": "ok", **body}


__all__ = ["node_health"]
