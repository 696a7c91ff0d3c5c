"""One way to be a role (issue 31): the `NodeContext` a node builds once and hands to its
role worker, and the `RoleWorker` protocol that the prefill, decode (and coupled) and CPP
stage workers implement.

A worker sees its node only through the context: its identity and settings, the engine,
the transfer engine and store, the two RPC clients, the counters it keeps for the node's
report, and a few read-only views of the cluster (members, model geometry, block keys).
The node sees a worker only through the protocol: the control handlers it serves, what it
reports to the conductor, what `node.status` shows, `node.release`, and `close`. So the
node never asks a worker what it is (no `hasattr`), and a worker never reaches into the
node (the shape of vLLM v1's worker/executor hand-over: one typed object each way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from mooncaked.config import Settings
from mooncaked.wire.messages import Release

from .node_state import Activity, KVTransferCounters

Handler = Callable[[Any], Awaitable[dict]]      # a control method: JSON payload -> JSON reply


def _never_draining() -> bool:
    return False


def _no_spawn(coro: Coroutine) -> Any:
    coro.close()          # a context without a node (unit tests): background work is dropped
    return None


def _no_members() -> dict:
    return {}


def _no_model() -> dict | None:
    return None


def _no_block_keys(prompt: list[int], cache_salt: str | None) -> list:
    raise RuntimeError("this NodeContext has no front end to compute block keys")


@dataclass
class NodeContext:
    """What a role worker may use of its node; `ClusterNode.start` builds it once, after
    the transfer engine (and, on model nodes, the store) started.

    Attributes:
        node_id: this node's id (node.id, or host-port).
        control_addr: this node's control address, "host:port".
        settings: the node's full Settings.
        engine: the node's AsyncLLM (prefill, decode, coupled), or None (CPP stage, cache).
        tokenizer: the model's tokenizer (mooncaked.model.tokenizer.Tokenizer), or None.
        transfer: the node's TransferEngine (segments, READ/WRITE), or None in unit tests.
        control: the node's ControlServer (a CPP stage adds its `cpp.*` handlers itself).
        client: ControlClient for short control calls (node.kv_reserve, node.release).
        data_client: ControlClient whose calls last as long as a request (its own pool).
        store_node: the node's StoreNode once its store started, else None (set by the
            node; a CPP stage's store starts after its worker, see `attach_store`).
        kv_transfer: the node's KV hand-over counters (node.status "kv_transfer").
        activity: requests arrived and done since the node's last report (NodeReport).
        draining: () -> True while the node takes no new requests.
        spawn: runs a fire-and-forget coroutine the node keeps and cancels at stop.
        members: () -> node id -> Member, the node's current view of the cluster.
        model_info: () -> the model geometry this node or a member published, or None.
        block_keys: (prompt token ids, cache_salt) -> the prompt's block keys, as the
            front end computes them (store/keys.py).
    Defaults make a context without a node (unit tests of one worker).
    """

    node_id: str
    control_addr: str
    settings: Settings
    engine: Any = None
    tokenizer: Any = None
    transfer: Any = None
    control: Any = None
    client: Any = None
    data_client: Any = None
    store_node: Any = None
    kv_transfer: KVTransferCounters = field(default_factory=KVTransferCounters)
    activity: Activity = field(default_factory=Activity)
    draining: Callable[[], bool] = _never_draining
    spawn: Callable[[Coroutine], asyncio.Task | None] = _no_spawn
    members: Callable[[], dict] = _no_members
    model_info: Callable[[], dict | None] = _no_model
    block_keys: Callable[[list[int], str | None], list] = _no_block_keys


@dataclass(frozen=True)
class RoleStatus:
    """A worker's part of `node.status` (the node adds what every role has).

    Attributes:
        staged: KV segments staged for decode nodes to READ (prefill).
        receiving: receive buffers reserved for pushed KV (decode).
        refused: requests this node's TBT check refused (decode, coupled).
        admission: the TBT check's status (decode, coupled), else None.
        cpp: the CPP stage's layers, pages and requests (CPP stage), else None.
    """

    staged: int = 0
    receiving: int = 0
    refused: int = 0
    admission: dict | None = None
    cpp: dict | None = None


class RoleWorker(Protocol):
    """What a node needs of its role's worker (PrefillWorker, DecodeWorker, CppStageWorker).

    Attributes:
        side: "prefill" or "decode": which side of the node's requests it runs (a coupled
            node's worker runs whole requests and counts as the decode side).
        requests: rid -> its load, for every request running here (drain waits for them).
    """

    side: str
    requests: dict[str, Any]

    def handlers(self) -> dict[str, Handler]:
        """The control methods this role serves (node.prefill, node.kv_reserve)."""
        ...

    def pending(self) -> dict[str, tuple[int, int]]:
        """rid -> (new, cached) prompt tokens of the prefills this node holds (NodeReport)."""
        ...

    def queued(self) -> tuple[str, ...]:
        """Ids of the prefills waiting for their turn here (NodeReport.waiting)."""
        ...

    def stalled(self) -> str | None:
        """Why this node cannot take a request now, or None (NodeReport.stalled)."""
        ...

    def info(self) -> dict | None:
        """The member record's `cpp` entry (a CPP stage), else None."""
        ...

    def status(self) -> RoleStatus:
        """This role's part of `node.status`."""
        ...

    def release_held(self, msg: Release) -> bool:
        """`node.release`: frees what this node holds for msg.rid (staged KV, a receive
        buffer reserved by msg.owner, a CPP stage's pages); True when something was."""
        ...

    def close(self) -> None:
        """Frees everything the worker holds (at the node's stop)."""
        ...


__all__ = ["Handler", "NodeContext", "RoleStatus", "RoleWorker"]
