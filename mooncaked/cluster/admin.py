"""What `mooncake ctl` asks a running cluster: membership and leader from the coordinator
(either backend), then each node's `node.status` and the leader's `conductor.status`
over the control RPC, every call bounded by a timeout and carrying the cluster token
(auth.py; ctl reads cluster.token_file, so its user must be able to read that file). A
node that does not answer is reported as unreachable, never waited for."""

from __future__ import annotations

import asyncio
from typing import Any

from mooncaked.config import ClusterSettings

from mooncaked.wire.auth import load_token
from mooncaked.coord.factory import make_coordinator
from mooncaked.wire.errors import ClusterError
from mooncaked.wire.rpc import ControlClient


async def cluster_view(settings: ClusterSettings, timeout_s: float = 3.0) -> dict[str, Any]:
    """Snapshot of the cluster: {"backend", "leader", "nodes": {id: {"info", "incarnation",
    "registered_at", "status" | "error"}}, "conductor": conductor.status or {"error"}}.

    Raises: CoordinationError when the coordination store cannot be reached; ConfigError
    when the cluster token cannot be read.
    """
    coord = make_coordinator(settings)
    await coord.start()
    try:
        members = await coord.members()
        leader = await coord.leader()
    finally:
        await coord.close()
    nodes: dict[str, dict] = {nid: {"info": m.info, "incarnation": m.incarnation,
                                    "registered_at": m.registered_at}
                              for nid, m in members.items()}
    if not nodes:
        return {"backend": settings.backend, "leader": leader, "nodes": {},
                "conductor": {"error": "no node is registered"}}
    token = load_token(settings)
    async with ControlClient(timeout_s, token=token) as client:
        async def status(nid: str) -> None:
            try:
                nodes[nid]["status"] = await client.call(nodes[nid]["info"].get("control", ""),
                                                         "node.status")
            except (ClusterError, ValueError) as e:
                nodes[nid]["error"] = str(e)

        await asyncio.gather(*(status(n) for n in nodes))
        conductor: dict = {"error": "no leader elected"}
        if leader in nodes:
            try:
                conductor = await client.call(nodes[leader]["info"]["control"], "conductor.status")
            except ClusterError as e:
                conductor = {"error": str(e)}
    return {"backend": settings.backend, "leader": leader, "nodes": nodes,
            "conductor": conductor}


async def drain_node(settings: ClusterSettings, node_id: str, timeout_s: float = 5.0,
                     method: str = "node.drain") -> dict:
    """Asks node_id to drain (no new requests; running ones finish), or with
    method="node.undrain" to take requests again.

    Raises: KeyError for an unknown node; ClusterError when it cannot be reached;
    ConfigError when the cluster token cannot be read.
    """
    token = load_token(settings)
    coord = make_coordinator(settings)
    await coord.start()
    try:
        members = await coord.members()
    finally:
        await coord.close()
    if node_id not in members:
        raise KeyError(f"no node {node_id!r} in the cluster (nodes: {', '.join(members) or '-'})")
    async with ControlClient(timeout_s, token=token) as client:
        return await client.call(members[node_id].info["control"], method)


__all__ = ["cluster_view", "drain_node"]
