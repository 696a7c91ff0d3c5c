"""Hot-block replication (Mooncake paper, section 4.2): the conductor counts the
requests for each block key; the longest prefix of a request's keys requested
conductor.hot_block_hits times and held by fewer than conductor.hot_block_replicas
nodes is copied onto a cache node (`store.fetch`: a transfer-engine READ under the
holder's lease). The index learns the new replicas from the cache node's store
events; a prefix is not copied again within REPLICATE_COOLDOWN_S.

With conductor.replication = "cost" the fixed count is replaced by `replication_worth`
(pure): copy when the prefix's observed reuse rate, expected to last
conductor.replication_horizon_s, saves more prefill time than the copy costs."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from mooncaked.wire.messages import hex_keys
from mooncaked.config import Settings
from mooncaked.log import get_logger

from .cost_model import CostModel
from .index import PrefixIndex
from .load import NodeView

log = get_logger(__name__)

REPLICATE_COOLDOWN_S = 5.0  # a prefix is not copied again this soon (its events lag)
HITS_MAX = 100_000          # block keys whose reuse counts the conductor remembers (LRU)


def replication_worth(uses: int, observed_s: float, horizon_s: float, recompute_s: float,
                      copy_s: float, replicas: int) -> bool:
    """Whether one more replica of a prefix is worth its copy (replication = "cost"; pure).

    Args:
        uses: requests that used the prefix so far (>= 1).
        observed_s: seconds since the first of them (the reuse rate is uses / observed_s;
            under 1 s counts as 1 s).
        horizon_s: how long that rate is expected to last, seconds.
        recompute_s: predicted prefill time of the prefix's tokens when not cached, s.
        copy_s: predicted transfer time of the prefix (the copy; a fetch from it costs as
            much), s.
        replicas: nodes holding it now (>= 1).
    Returns: True when expected uses over the horizon x (recompute_s - copy_s) / (replicas
        + 1), the prefill time saved by the share of uses the new copy serves (a fetch from
        it instead of a recompute), exceeds copy_s. A prefix that is cheaper to recompute
        than to move is never copied.
    """
    saved = recompute_s - copy_s
    if uses < 1 or saved <= 0:
        return False
    rate = uses / max(1.0, observed_s)
    return rate * horizon_s * saved / (max(1, replicas) + 1) > copy_s


class HotBlockReplicator:
    """Counts block-key reuse and copies hot prefixes onto cache nodes (see the module doc).

    Args: settings ([conductor] thresholds, RPC timeouts), the conductor's prefix index,
    a ControlClient. Attribute `replicated`: {"started", "blocks", "failed"} counts.
    """

    def __init__(self, settings: Settings, index: PrefixIndex, client: Any):
        self.settings, self.index, self.client = settings, index, client
        self.hits: OrderedDict[bytes, int] = OrderedDict()
        self.first_seen: dict[bytes, float] = {}     # key -> first request (cost rule)
        self._replicating: dict[bytes, float] = {}   # last key of a prefix -> copy ended (inf: running)
        self._replications: set[asyncio.Task] = set()
        self.replicated = {"started": 0, "blocks": 0, "failed": 0}

    def note_request(self, keys: list[bytes], now: float, nodes: Mapping[str, NodeView],
                     cache_nodes: Sequence[NodeView], cost: CostModel | None = None,
                     block_size: int = 0) -> None:
        """Counts the requests for each block key; the longest prefix of keys requested
        conductor.hot_block_hits times and held by fewer than hot_block_replicas nodes
        is copied onto the cache node (of `cache_nodes`, the live ones) missing the fewest.
        With replication = "cost" (and `cost`, `block_size` tokens a key given), the prefix
        reused at least twice is copied when `replication_worth` says so instead."""
        cs = self.settings.conductor
        if cs.hot_block_hits <= 0:
            return
        by_cost = cs.replication == "cost" and cost is not None and block_size > 0
        for k in keys:
            self.hits[k] = self.hits.get(k, 0) + 1
            self.hits.move_to_end(k)
            if by_cost:
                self.first_seen.setdefault(k, now)
        # leading keys are requested at least as often as later ones (a prefix)
        need = 2 if by_cost else cs.hot_block_hits
        hot = 0
        while hot < len(keys) and self.hits[keys[hot]] >= need:
            hot += 1
        while len(self.hits) > HITS_MAX:
            k, _ = self.hits.popitem(last=False)
            self.first_seen.pop(k, None)
        keys = keys[:min(hot, self.index.longest(keys[:hot]))]   # hot and held somewhere
        if not keys:
            return
        last = keys[-1]
        started = self._replicating.get(last)
        if started is not None and now - started < REPLICATE_COOLDOWN_S:
            return                  # being copied, or copied and not yet in the index
        replicas = self.index.replicas(last)
        if by_cost:
            tokens = len(keys) * block_size
            if not replication_worth(self.hits[last], now - self.first_seen.get(last, now),
                                     cs.replication_horizon_s, cost.prefill_s(tokens, 0),
                                     cost.transfer_s(tokens), replicas):
                return
        elif replicas >= cs.hot_block_replicas:
            return
        holders = self.index.holders(last)
        full = [h for h, m in zip(holders, self.index.match(keys, holders)) if m == len(keys)]
        sources = [nodes[h] for h in full if h in nodes and nodes[h].control]
        targets = [v for v in cache_nodes if v.control and v.info.get("store") and v.node_id not in full]
        if not sources or not targets:
            return
        have = self.index.match(keys, [v.node_id for v in targets])
        j = have.index(max(have))             # the cache node missing the fewest blocks
        # a cache node as the source spares the prefill nodes' compute
        src = next((v for v in sources if v.role == "cache"), sources[0])
        self._replicating[last] = math.inf          # in flight
        if len(self._replicating) > 1000:
            self._replicating = {k: t for k, t in self._replicating.items()
                                 if now - t < REPLICATE_COOLDOWN_S}
        self.replicated["started"] += 1
        t = asyncio.get_running_loop().create_task(
            self._replicate(src, targets[j], keys[have[j]:], last))
        self._replications.add(t)
        t.add_done_callback(self._replications.discard)

    async def _replicate(self, src: NodeView, dst: NodeView, keys: list[bytes],
                         last: bytes) -> None:
        """dst's store fetches `keys` from src's (store.fetch); the index learns the new
        replicas from dst's store events in its next report."""
        timeout = self.settings.cluster.rpc_timeout_s + self.settings.transfer.request_timeout_s
        try:
            r = await self.client.call(dst.control, "store.fetch",
                                       {"source": src.control, "keys": hex_keys(keys)},
                                       timeout_s=timeout)
            ok = sum(1 for x in r["results"] if x.get("status") == "stored")
            self.replicated["blocks"] += ok
            why = next((x.get("reason") for x in r["results"] if x.get("status") == "failed"),
                       None)
            log.info("hot_blocks_replicated", source=src.node_id, target=dst.node_id,
                     blocks=len(keys), stored=ok, **({"first_failure": why} if why else {}))
        except Exception as e:  # noqa: BLE001 - a replica is an optimisation; log and go on
            self.replicated["failed"] += 1
            log.warning("hot_blocks_replication_failed", source=src.node_id,
                        target=dst.node_id, error=str(e))
        finally:
            self._replicating[last] = time.monotonic()   # the cooldown runs from here

    def in_flight(self) -> int:
        """Copies running now."""
        return len(self._replications)

    async def stop(self) -> None:
        """Cancels the copies in flight. Never raises."""
        tasks = list(self._replications)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


__all__ = ["HITS_MAX", "REPLICATE_COOLDOWN_S", "HotBlockReplicator", "replication_worth"]
