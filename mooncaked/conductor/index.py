"""The conductor's global prefix index: block key -> which nodes hold it, on which tier.

Fed by the store's batched block events ("stored" / "evicted", per node and tier);
rebuilt after a leader change by replaying every node's inventory as "stored" events.
A prefix match per node is a walk over the request's block keys until the first
key the node lacks (architecture.md, "Block keys"; Mooncake paper, section 4).

Representation: every node gets a bit; a key maps to an int bitmask of the nodes
holding it (any tier), plus one bitmask per tier. A match over all nodes at once is
then one dict lookup and one AND per key, not one set lookup per node and key:
O(keys + nodes) instead of O(keys * nodes).

Pure data structure: no I/O, no clock, no asyncio. Not thread-safe (the conductor
applies events and places requests from one task).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

STORED = "stored"
EVICTED = "evicted"
EVENT_KINDS = (STORED, EVICTED)


class BlockEvent(NamedTuple):
    """One store event: `kind` is "stored" or "evicted"; `key` a block key (any hashable:
    bytes from mooncaked.store, ints in traces); `tier` the store tier ("device", "dram",
    "ssd", ...)."""

    kind: str
    key: Hashable
    tier: str = "dram"


class PrefixIndex:
    """Global block index over nodes: key -> holders (bitmask of node bits) per tier."""

    def __init__(self) -> None:
        self._bit: dict[Hashable, int] = {}            # node id -> bit position
        self._nodes: list[Hashable | None] = []        # bit position -> node id (None: free)
        self._holders: dict[Hashable, int] = {}        # key -> mask of holders on any tier
        self._tiers: dict[str, dict[Hashable, int]] = {}  # tier -> key -> mask
        self._count: dict[Hashable, int] = {}          # node id -> blocks held (any tier)
        self._seq: dict[Hashable, int] = {}            # node id -> last store event seq applied

    # ------------------------------------------------------------------ nodes

    def add_node(self, node: Hashable) -> int:
        """Registers `node` (idempotent) and returns its bit position."""
        b = self._bit.get(node)
        if b is None:
            try:
                b = self._nodes.index(None)      # reuse a removed node's bit
                self._nodes[b] = node
            except ValueError:
                b = len(self._nodes)
                self._nodes.append(node)
            self._bit[node] = b
            self._count[node] = 0
        return b

    def nodes(self) -> list[Hashable]:
        """Registered node ids, in registration order (bit order)."""
        return [n for n in self._nodes if n is not None]

    def remove_node(self, node: Hashable) -> int:
        """Forgets every block of `node` (it died, or its inventory is about to be replayed).

        Returns the number of blocks dropped. O(indexed keys): meant for rare membership
        changes, not for the request path.
        """
        b = self._bit.pop(node, None)
        if b is None:
            return 0
        bit = 1 << b
        dropped = 0
        for masks in self._tiers.values():
            for key in [k for k, m in masks.items() if m & bit]:
                masks[key] &= ~bit
                if not masks[key]:
                    del masks[key]
        for key in [k for k, m in self._holders.items() if m & bit]:
            dropped += 1
            m = self._holders[key] & ~bit
            if m:
                self._holders[key] = m
            else:
                del self._holders[key]
        self._nodes[b] = None
        del self._count[node]
        self._seq.pop(node, None)
        return dropped

    # ------------------------------------------------------------------ events

    def apply(self, node: Hashable, events: Iterable[BlockEvent | tuple]) -> None:
        """Applies one node's batch of block events, in order.

        Args:
            node: the node that published the batch (registered on first sight).
            events: (kind, key, tier) tuples or BlockEvents; kind "stored" or "evicted".
        Raises: ValueError naming the first bad event; the batch is checked before any of it
            is applied, so a bad batch changes nothing.
        """
        batch = [e if isinstance(e, BlockEvent) else BlockEvent(*e) for e in events]
        for i, e in enumerate(batch):
            if e.kind not in EVENT_KINDS:
                raise ValueError(f"block event {i} from {node!r}: unknown kind {e.kind!r} "
                                 f"(expected one of {EVENT_KINDS})")
        bit = 1 << self.add_node(node)
        holders, tiers = self._holders, self._tiers
        count = self._count[node]
        for kind, key, tier in batch:
            masks = tiers.get(tier)
            if masks is None:
                masks = tiers[tier] = {}
            old = masks.get(key, 0)
            if kind == STORED:
                if old & bit:
                    continue
                masks[key] = old | bit
                h = holders.get(key, 0)
                if not h & bit:
                    holders[key] = h | bit
                    count += 1
            else:
                if not old & bit:
                    continue
                if old & ~bit:
                    masks[key] = old & ~bit
                else:
                    del masks[key]
                if not any(m.get(key, 0) & bit for m in tiers.values()):
                    h = holders[key] & ~bit
                    if h:
                        holders[key] = h
                    else:
                        del holders[key]
                    count -= 1
        self._count[node] = count

    def stored(self, node: Hashable, keys: Iterable[Hashable], tier: str = "dram") -> None:
        """Shorthand for `apply(node, [("stored", k, tier) for k in keys])`."""
        self.apply(node, [BlockEvent(STORED, k, tier) for k in keys])

    def evicted(self, node: Hashable, keys: Iterable[Hashable], tier: str = "dram") -> None:
        """Shorthand for `apply(node, [("evicted", k, tier) for k in keys])`."""
        self.apply(node, [BlockEvent(EVICTED, k, tier) for k in keys])

    def apply_store_events(self, batches: Iterable) -> set[Hashable]:
        """Applies the store's batched events (`mooncaked.store.StoreEvent`: kind, tier,
        keys, node_id, seq), in order.

        Events at or below a node's last applied seq are skipped (already covered by an
        inventory). Returns the nodes whose seq jumped (events were dropped): the caller
        must rebuild those from `BlockStore.inventory()` with `load_inventory`.
        Raises: ValueError on an unknown kind (nothing of that event is applied).
        """
        gaps: set[Hashable] = set()
        for ev in batches:
            node, seq = ev.node_id, ev.seq
            last = self._seq.get(node)
            if last is not None and seq <= last:
                continue
            if last is not None and seq != last + 1:
                gaps.add(node)
            self.apply(node, [BlockEvent(ev.kind, k, ev.tier) for k in ev.keys])
            self._seq[node] = seq
        return gaps

    def load_inventory(self, inventory) -> None:
        """Replaces what the index knows of one node by its inventory (`node_id`, `seq`,
        `tiers`: tier -> keys), e.g. after a leader change or an event gap."""
        node = inventory.node_id
        self.remove_node(node)
        self.add_node(node)
        for tier, keys in inventory.tiers.items():
            self.apply(node, [BlockEvent(STORED, k, tier) for k in keys])
        self._seq[node] = inventory.seq

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Number of distinct keys held by at least one node."""
        return len(self._holders)

    def blocks_on(self, node: Hashable) -> int:
        """Blocks (distinct keys, any tier) that `node` holds; 0 for an unknown node."""
        return self._count.get(node, 0)

    def holders(self, key: Hashable) -> list[Hashable]:
        """Node ids holding `key` on any tier (bit order)."""
        m = self._holders.get(key, 0)
        return [self._nodes[b] for b in _bits(m)]

    def replicas(self, key: Hashable) -> int:
        """Number of nodes holding `key` (the paper's Figure 11 counts these)."""
        return self._holders.get(key, 0).bit_count()

    def tiers(self, key: Hashable) -> dict[Hashable, list[str]]:
        """node id -> tiers on which it holds `key`."""
        out: dict[Hashable, list[str]] = {}
        for tier, masks in self._tiers.items():
            for b in _bits(masks.get(key, 0)):
                out.setdefault(self._nodes[b], []).append(tier)
        return out

    def match(self, keys: Sequence[Hashable], nodes: Sequence[Hashable]) -> list[int]:
        """Prefix match of `keys` on each of `nodes`, in blocks.

        Returns a list aligned with `nodes`: for each node, the number of leading keys of
        `keys` it holds (on any tier) before its first miss. Unknown nodes match 0.
        Cost: one dict lookup and a few int ops per key walked, plus O(len(nodes)).
        """
        bits = [self._bit.get(n, -1) for n in nodes]
        alive = 0
        for b in bits:
            if b >= 0:
                alive |= 1 << b
        depth_of: dict[int, int] = {}
        holders = self._holders
        depth = 0
        for key in keys:
            m = holders.get(key, 0) & alive
            if m != alive:
                dropped = alive & ~m
                while dropped:
                    low = dropped & -dropped
                    depth_of[low.bit_length() - 1] = depth
                    dropped ^= low
                alive = m
                if not alive:
                    break
            depth += 1
        return [depth if (b >= 0 and alive >> b & 1) else depth_of.get(b, 0) for b in bits]

    def longest(self, keys: Sequence[Hashable]) -> int:
        """Longest prefix of `keys` held by any single node, in blocks."""
        alive = -1
        depth = 0
        holders = self._holders
        for key in keys:
            alive &= holders.get(key, 0)
            if not alive:
                break
            depth += 1
        return depth


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
