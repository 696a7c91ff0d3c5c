"""Values and errors of the KV store's API (Mooncake paper section 3.2.1).

An object of the store is one KV block: `block_bytes` bytes holding every
layer's K and V for `block_size` tokens, in the engine's page layout
(`kv_cache[block]` of `[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`), keyed by its block key (see `keys.py`). Objects are immutable:
a key fixes the bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

DRAM = "dram"
"""Tier name of the node's DRAM pool."""
SSD = "ssd"
"""Tier name of the node's SSD directory."""
TIERS = (DRAM, SSD)
NO_ROOM = "no room"
"""How a put's reason begins when the tiers lack capacity (not pinning, not an I/O error)."""


class StoreError(Exception):
    """Base class of the store's errors."""


class LeaseExpired(StoreError):
    """A lease ended (its TTL passed) before it was released or checked.

    Bytes read under it may belong to another block: the reader must discard them.
    """


class BlockPinned(StoreError):
    """The block is pinned or leased by a reader and cannot be removed now."""


class PutStatus(enum.Enum):
    """Outcome of storing one block."""

    STORED = "stored"
    """The block was written; `PutResult.tier` says where."""
    EXISTS = "exists"
    """The key was already held (objects are immutable, so nothing was written)."""
    FAILED = "failed"
    """Nothing was stored; `PutResult.reason` says why (full, disk full, permission...)."""


@dataclass(frozen=True)
class PutResult:
    """Outcome of one put: status, the tier that holds the block, a reason on failure."""

    status: PutStatus
    tier: str | None = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True when the store holds the block after the put (stored or already there)."""
        return self.status is not PutStatus.FAILED


@dataclass(frozen=True)
class Location:
    """Where a block lies in a node's DRAM pool, for a direct transfer-engine READ.

    `segment` is the name the pool was registered under with the transfer
    engine; `offset` and `length` are bytes within that segment.
    """

    segment: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoreEvent:
    """A batch of keys that were stored into or evicted from one tier of one node.

    Consumers (the conductor's global index) apply events in `seq` order; a gap
    in `seq` means events were dropped (a slow consumer) and the consumer must
    rebuild from `BlockStore.inventory()`.
    """

    kind: str  # "stored" | "evicted"
    tier: str  # DRAM | SSD
    keys: tuple[bytes, ...]
    node_id: str
    seq: int


@dataclass
class StoreMetrics:
    """Counters of one store (monotonic since start); blocks unless named otherwise."""

    hits: dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0})
    misses: int = 0
    puts: dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0})
    put_exists: int = 0
    put_failed: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {DRAM: 0, SSD: 0})
    demotions: int = 0  # DRAM -> SSD writes made to free DRAM
    persisted: int = 0  # DRAM blocks written through to SSD (durable copies; tiering.py)
    persist_failed: int = 0
    demote_failed: int = 0
    promotions: int = 0  # SSD -> DRAM copies on use
    corrupt: int = 0  # SSD blocks that failed their checksum/header check (served as misses)
    io_errors: int = 0  # SSD read/write errors other than corruption (ENOSPC, EACCES, ...)
    lease_expired: int = 0
    served: int = 0  # blocks handed to peers' READs (store.locate)

    def as_dict(self) -> dict:
        """Flat dict, e.g. {"hits_dram": 3, ...}."""
        out: dict = {}
        for name, value in vars(self).items():
            if isinstance(value, dict):
                out.update({f"{name}_{tier}": n for tier, n in value.items()})
            else:
                out[name] = value
        return out


@dataclass(frozen=True)
class Inventory:
    """Every key one node holds, per tier, as of event `seq` (see `StoreEvent`).

    A consumer rebuilding its index applies this, then only events with a
    larger `seq`.
    """

    node_id: str
    seq: int
    tiers: dict[str, list[bytes]]
