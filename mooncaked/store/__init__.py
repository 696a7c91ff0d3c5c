"""mooncaked.store: the Mooncake Store (paper sections 3.2.1, 3.2.2).

A node's pool of KV blocks in DRAM and on SSD, keyed by block keys:

- keys.py: `block_keys`, `make_salt` (the chained block key; shared with the engine),
  `slice_key` (a pipeline stage's layer slice of a block)
- store.py: `BlockStore`, the local object API (put/get/exists/remove, batch forms,
  leases, inventory, stats): a facade over the modules below
- tiering.py: the tiers and the moves between them (demotion, promotion);
  writes.py: puts (one writer per key); leases.py: pins and leases
- dram.py / ssd.py: the two tiers, booked alike by slots.py's `SlotIndex` (key ->
  slot, free slots, eviction order from policy.py); events.py: batching
- buffers.py: byte views and key/buffer checks; types.py: results, locations,
  events and errors
- remote.py: the store across nodes; node.py: a stand-alone store node
"""

from .keys import KEY_BYTES, block_keys, make_salt, slice_key
from .leases import Lease
from .store import BlockStore
from .types import (DRAM, SSD, BlockPinned, Inventory, LeaseExpired, Location, PutResult,
                    PutStatus, StoreError, StoreEvent, StoreMetrics)

__all__ = ["KEY_BYTES", "block_keys", "make_salt", "slice_key", "DRAM", "SSD", "BlockPinned", "Inventory",
           "LeaseExpired", "Location", "PutResult", "PutStatus", "StoreError", "StoreEvent",
           "StoreMetrics", "BlockStore", "Lease"]
