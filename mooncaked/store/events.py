"""Batched block events (stored / evicted, per tier) for the conductor's global index.

The store calls `emit(kind, tier, key)` for every change; the batcher groups
consecutive changes of the same (kind, tier) into one `StoreEvent` and
delivers the pending list every `interval_s` or as soon as `max_keys` keys are
pending, whichever comes first. Order is kept: a key stored then evicted in
the same window appears in two events, stored first.

Subscribers are asyncio queues (`subscribe()`), each receiving lists of
events. A queue that is full drops the batch; the gap in `StoreEvent.seq`
tells its consumer to rebuild from `BlockStore.inventory()`.
"""

from __future__ import annotations

import asyncio

from mooncaked.log import get_logger

from .types import StoreEvent

log = get_logger(__name__)

STORED = "stored"
"""Event kind: keys written into a tier."""
EVICTED = "evicted"
"""Event kind: keys gone from a tier (evicted, demoted away, removed or found corrupt)."""


class EventBatcher:
    """Collects store events and flushes them to subscribers in batches.

    Args:
        node_id: stamped on every event.
        interval_s: longest time a change waits before delivery (seconds, > 0).
        max_keys: pending keys that trigger an immediate flush (>= 1).
    Must be used from one event loop's thread.
    """

    def __init__(self, node_id: str, interval_s: float = 0.05, max_keys: int = 1024):
        self.node_id = node_id
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._pending: list[tuple[str, str, list[bytes]]] = []
        self._n_pending = 0
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._queues: list[asyncio.Queue] = []
        self.dropped = 0  # batches dropped because a subscriber's queue was full

    @property
    def seq(self) -> int:
        """Sequence number of the last event delivered (0 before the first)."""
        return self._seq

    def subscribe(self, maxsize: int = 10_000) -> asyncio.Queue:
        """A new queue that receives every later flush as a `list[StoreEvent]`."""
        q: asyncio.Queue = asyncio.Queue(maxsize)
        self._queues.append(q)
        return q

    def emit(self, kind: str, tier: str, key: bytes) -> None:
        """Records one change; cheap (no I/O, no allocation of a new event unless the
        (kind, tier) differs from the previous change)."""
        if not self._queues:
            return
        if self._pending and self._pending[-1][0] == kind and self._pending[-1][1] == tier:
            self._pending[-1][2].append(key)
        else:
            self._pending.append((kind, tier, [key]))
        self._n_pending += 1
        if self._n_pending >= self.max_keys:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s, self.flush)

    def flush(self) -> None:
        """Delivers everything pending now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        batch = []
        for kind, tier, keys in self._pending:
            self._seq += 1
            batch.append(StoreEvent(kind, tier, tuple(keys), self.node_id, self._seq))
        self._pending, self._n_pending = [], 0
        for q in self._queues:
            try:
                q.put_nowait(batch)
            except asyncio.QueueFull:
                self.dropped += 1
                log.warning("store_events_dropped", events=len(batch), dropped_batches=self.dropped)
