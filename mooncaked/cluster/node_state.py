"""State a node's role workers share with the node: KV hand-over counters, what happened
since the last report, and the draining error."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mooncaked.log import get_logger

from mooncaked.wire.errors import ClusterError
from mooncaked.wire.messages import PrefillDone, Release

log = get_logger(__name__)

MAX_PENDING_REPORT_ITEMS = 2000   # arrived/done entries kept while the leader is unreachable


class NodeDraining(RuntimeError):
    """The node takes no new requests (drain or shutdown); place the request elsewhere."""


class ReceiveBuffersFull(ValueError):
    """A decode node's receive buffers (engine.kv_cache_bytes of them) cannot hold one
    more request's pushed KV now: load, not a fault. Its class name crosses the control
    RPC (RpcError.remote_type), so the API answers 429 naming this resource, not a
    missing prefill node (issue 32, fault 8)."""


@dataclass
class KVTransferCounters:
    """How this node handed KV over (node.status "kv_transfer"; monotonic since start).

    Prefill side: pushed / push_failed (refused or failed part-way) / staged_only (no
    push asked), push_bytes, push_busy_s and push_exposed_s (seconds of WRITEs in flight,
    and of them after the compute ended); fetches of prefix blocks, fetched_blocks,
    fetch_failed. Decode side: received_pushed, read (READs of a stage), read_bytes,
    read_s.
    """

    pushed: int = 0
    push_failed: int = 0
    staged_only: int = 0
    push_bytes: int = 0
    push_busy_s: float = 0.0
    push_exposed_s: float = 0.0
    received_pushed: int = 0
    read: int = 0
    read_bytes: int = 0
    read_s: float = 0.0
    fetches: int = 0
    fetched_blocks: int = 0
    fetch_failed: int = 0

    def count_push(self, push: Any) -> None:
        """Adds one request's PushStats (None: the request was staged without a push)."""
        if push is None:
            self.staged_only += 1
            return
        if push.ok:
            self.pushed += 1
        else:
            self.push_failed += 1
        self.push_bytes += push.bytes
        self.push_busy_s += push.busy_s
        self.push_exposed_s += push.exposed_s

    def as_dict(self) -> dict:
        """The counters, seconds rounded to microseconds."""
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Activity:
    """What happened on the node since its last report to the conductor: requests that
    arrived (prefill or decode), finished prefills, and the TTFTs and TBTs its API front
    end observed ((rid, seconds): NodeReport.ttfts, NodeReport.tbts)."""

    arrived: list[str] = field(default_factory=list)
    done: list[PrefillDone] = field(default_factory=list)
    ttfts: list[tuple[str, float]] = field(default_factory=list)
    tbts: list[tuple[str, float]] = field(default_factory=list)

    def reported(self, n_arrived: int, n_done: int, n_ttfts: int = 0, n_tbts: int = 0) -> None:
        """Forgets the first entries, which the conductor has now."""
        del self.arrived[:n_arrived]
        del self.done[:n_done]
        del self.ttfts[:n_ttfts]
        del self.tbts[:n_tbts]

    def trim(self) -> None:
        """Bounds what is kept while the leader cannot be reached (its index heals from a
        store inventory; load comes with the next report)."""
        del self.arrived[:-MAX_PENDING_REPORT_ITEMS]
        del self.done[:-MAX_PENDING_REPORT_ITEMS]
        del self.ttfts[:-MAX_PENDING_REPORT_ITEMS]
        del self.tbts[:-MAX_PENDING_REPORT_ITEMS]


async def release_on(client: Any, addr: str | None, msg: Release) -> None:
    """Best-effort `node.release` on the node at control address addr (a failure is logged
    at debug level: the segment's TTL frees it anyway)."""
    if not addr:
        return
    try:
        await client.call(addr, "node.release", msg.to_json())
    except ClusterError as e:
        log.debug("release_failed", request_id=msg.rid, error=str(e))


__all__ = ["Activity", "KVTransferCounters", "MAX_PENDING_REPORT_ITEMS", "NodeDraining", "release_on"]
