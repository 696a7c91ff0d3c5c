"""Pins and leases: how readers keep the blocks they read in place (paper section 3.2.1).

- A pin is held by this process while it copies a block (an SSD read in
  flight, a block being demoted); pins are counted per key.
- A lease is a set of pins with a deadline, for readers that read the DRAM
  pool directly (a peer through the transfer engine, the engine copying into
  device pages). A timer on the event loop ends it at its deadline; releasing
  or checking it afterwards raises `LeaseExpired`: the bytes read under it may
  belong to another block.

A pinned or leased block is never evicted, demoted, moved or removed: the
tiers ask `Pins.can_evict`. Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable

from mooncaked.log import get_logger

from .types import LeaseExpired

log = get_logger(__name__)

HELD, RELEASED, EXPIRED = "held", "released", "expired"


class Pins:
    """Counted pins on block keys: a key is pinned while its count is above zero."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[bytes, int] = {}

    def pin(self, key: bytes) -> None:
        """Adds one pin on `key`."""
        self._count[key] = self._count.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        """Removes one pin from `key`. Raises: KeyError if `key` is not pinned."""
        n = self._count[key] - 1
        if n:
            self._count[key] = n
        else:
            del self._count[key]

    def can_evict(self, key: bytes) -> bool:
        """True unless `key` is pinned (the tiers' eviction predicate)."""
        return key not in self._count

    def __contains__(self, key: bytes) -> bool:
        return key in self._count

    def __len__(self) -> int:
        """Keys pinned (blocks)."""
        return len(self._count)


class Lease:
    """Blocks pinned for a reader until `deadline` (event loop clock, seconds).

    Attributes: `id`, `keys` (the blocks pinned), `deadline`, `state`
    ("held", "released" or "expired"). Obtain from `BlockStore.lease()` or
    `locate_many()`; end with `BlockStore.release()`.
    """

    __slots__ = ("id", "keys", "deadline", "state", "_timer")

    def __init__(self, lease_id: int, keys: tuple[bytes, ...], deadline: float):
        self.id, self.keys, self.deadline = lease_id, keys, deadline
        self.state = HELD
        self._timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"Lease(id={self.id}, keys={len(self.keys)}, state={self.state})"


class LeaseTable:
    """The held leases by id; each pins its keys in `pins` until it ends.

    Args:
        pins: the pins the leases hold (shared with the tiers' other readers).
        default_ttl_s: lease length in seconds when a caller gives none (> 0).
        on_expire: called with each lease that ends by timeout (e.g. to count it).
    """

    def __init__(self, pins: Pins, default_ttl_s: float,
                 on_expire: Callable[[Lease], None] | None = None):
        self.pins = pins
        self.default_ttl_s = default_ttl_s
        self._on_expire = on_expire
        self._ids = itertools.count(1)
        self._held: dict[int, Lease] = {}

    def __len__(self) -> int:
        """Leases held."""
        return len(self._held)

    def ttl(self, ttl_s: float | None) -> float:
        """`ttl_s`, or the default when None, in seconds.
        Raises: ValueError if it is not > 0."""
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        return ttl

    def grant(self, keys: Iterable[bytes], ttl_s: float | None = None) -> Lease:
        """A new lease pinning `keys` (as given: the caller picks the held ones) for
        `ttl_s` seconds (default `default_ttl_s`). Needs a running event loop.
        Raises: ValueError for a ttl that is not > 0."""
        ttl = self.ttl(ttl_s)
        loop = asyncio.get_running_loop()
        lease = Lease(next(self._ids), tuple(keys), loop.time() + ttl)
        for k in lease.keys:
            self.pins.pin(k)
        lease._timer = loop.call_at(lease.deadline, self._end, lease, EXPIRED)
        self._held[lease.id] = lease
        return lease

    def get(self, lease_id: int) -> Lease | None:
        """The held lease with this id, or None (released, expired or never made)."""
        return self._held.get(lease_id)

    def check(self, lease: Lease) -> None:
        """Raises LeaseExpired if the lease's deadline has passed (even if its timer has
        not fired yet, e.g. on a busy loop); ends it then."""
        if lease.state == HELD and asyncio.get_running_loop().time() >= lease.deadline:
            self._end(lease, EXPIRED)
        if lease.state == EXPIRED:
            raise LeaseExpired(f"lease {lease.id} on {len(lease.keys)} blocks expired")

    def release(self, lease: Lease) -> None:
        """Ends a lease and unpins its keys. Releasing twice is a no-op.
        Raises: LeaseExpired if it ended by timeout first (bytes read under it must
            be discarded)."""
        self.check(lease)
        self._end(lease, RELEASED)

    def release_all(self) -> None:
        """Ends every held lease as released (at shutdown)."""
        for lease in list(self._held.values()):
            self._end(lease, RELEASED)

    def _end(self, lease: Lease, state: str) -> None:
        if lease.state != HELD:
            return
        if lease._timer is not None:
            lease._timer.cancel()
        lease.state = state
        self._held.pop(lease.id, None)
        for k in lease.keys:
            self.pins.unpin(k)
        if state == EXPIRED:
            if self._on_expire is not None:
                self._on_expire(lease)
            log.warning("store_lease_expired", lease=lease.id, blocks=len(lease.keys))
