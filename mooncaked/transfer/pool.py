"""The endpoint pool: endpoints made on first use, capped, evicted by SIEVE.

An endpoint is one path to a peer: a TCP connection (key ("tcp", host, port,
path index)) or an RDMA queue pair (key ("rdma", peer instance, local NIC,
remote NIC)). Endpoints with users (slices holding or waiting for them) are
never evicted; an evicted or broken endpoint is closed, which the peer notices
(EOF on TCP; an explicit disconnect for RDMA), so it is dropped on both sides.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from mooncaked.log import get_logger

from .sieve import SieveCache

log = get_logger(__name__)


class EndpointPool:
    """Endpoints by key, at most `capacity` of them (SIEVE eviction).

    Endpoints must have `users` (int), `closed` (bool) and `close()`.
    """

    def __init__(self, capacity: int):
        self._cache: SieveCache[Hashable, Any] = SieveCache(capacity, lambda ep: ep.users == 0)
        self.made = 0
        self.evicted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The live endpoint for `key`, made with `make()` (unconnected) when absent or closed.

        The caller increments `users` before its first await and decrements it when done.
        """
        ep = self._cache.get(key)
        if ep is not None and not ep.closed:
            return ep
        if ep is not None:
            self._cache.pop(key)
        ep = make()
        self.made += 1
        for old_key, old in self._cache.put(key, ep):
            self.evicted += 1
            log.debug("endpoint_evicted", key=str(old_key))
            old.close()
        return ep

    def trim(self) -> None:
        """Evicts idle endpoints while the pool is over capacity (it grows past it only when
        every endpoint is busy)."""
        if len(self._cache) <= self._cache.capacity:
            return
        for key, ep in self._cache.trim():
            self.evicted += 1
            log.debug("endpoint_evicted", key=str(key))
            ep.close()

    def drop(self, key: Hashable, ep: Any) -> None:
        """Removes and closes `ep` (a broken endpoint) if it is still the one pooled at `key`."""
        if self._cache.get(key) is ep:
            self._cache.pop(key)
            self.dropped += 1
        ep.close()

    def drop_where(self, pred: Callable[[Hashable], bool], idle_only: bool = False) -> int:
        """Drops every endpoint whose key matches `pred` (e.g. all paths to a restarted peer);
        with `idle_only`, endpoints in use stay (they fail or finish on their own)."""
        n = 0
        for key, ep in self._cache.items():
            if pred(key) and not (idle_only and ep.users):
                self._cache.pop(key)
                ep.close()
                n += 1
        self.dropped += n
        return n

    def close_all(self) -> None:
        for key, ep in self._cache.items():
            self._cache.pop(key)
            ep.close()


__all__ = ["EndpointPool"]
