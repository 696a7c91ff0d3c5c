"""Leader election on top of a Coordinator's backend primitives (etcd's recipe: the
leader key is created only if absent, bound to the winner's lease): campaign, resign,
the current leader and a watch of its changes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from ..log import get_logger
from .records import DEFAULT_ELECTION, Leadership, check_name, decode_value, encode_value
from mooncaked.wire.errors import CoordinationError

log = get_logger("mooncaked.coord.coordinator")


class ElectionMixin:
    """The election part of `Coordinator` (which provides the session, `_op`, `_key` and
    the backend primitives these methods use)."""

    def _leader_key(self, election: str) -> str:
        check_name("election", election)
        return self._key(f"election/{election}/leader")

    async def campaign(self, node_id: str, election: str = DEFAULT_ELECTION) -> Leadership:
        """Waits until this process is the leader of `election`, then returns the Leadership.

        At most one leader at a time: the leader key is created only if absent, bound to
        the winner's lease. When the leader dies its lease expires and a waiting
        candidate takes over within about lease_ttl_s. Cancel the call to stop
        campaigning. Calling it while already leader returns the held Leadership.
        Raises: CoordinationError, SessionLost (no live session).
        """
        check_name("node_id", node_id)
        key = self._leader_key(election)
        held = self._leading.get(election)
        if held is not None and held.held:
            return held
        async with contextlib.aclosing(self._snapshots(key[: -len("leader")])) as snaps:
            async for snap in snaps:
                if key in snap:
                    continue                      # someone leads; wait for the key to go
                lease = self._require_session()
                raw = encode_value({"node_id": node_id, "incarnation": self._session_id,
                              "since": time.time()})
                self._unconfirmed[election] = raw
                won = await self._op(self._create(key, raw, lease), f"campaign {election}")
                self._unconfirmed.pop(election, None)
                if won:
                    lead = Leadership(election, node_id, self._session_id, key, raw, self)
                    self._leading[election] = lead
                    log.info("coord_elected", election=election, node=node_id,
                             session=self._session_id)
                    return lead
        raise CoordinationError(f"{self._describe()}: watch of {key} ended")  # pragma: no cover

    async def resign(self, election: str = DEFAULT_ELECTION) -> bool:
        """Gives up leadership of `election` if held; True if this process was leader.

        A campaign cancelled while its create was in flight may have won without knowing
        it; resign deletes that leader key too (only if it still holds this process's
        value), so the election does not wait for the lease to expire.
        Raises: CoordinationError."""
        key = self._leader_key(election)
        lead = self._leading.pop(election, None)
        if lead is None:
            raw = self._unconfirmed.pop(election, None)
            if raw is None:
                return False
            won = await self._op(self._delete_if(key, raw), f"resign {election}")
            if won:
                log.info("coord_resigned", election=election, unconfirmed=True)
            return won
        lead.lost.set()
        await self._op(self._delete_if(key, lead.raw), f"resign {election}")
        log.info("coord_resigned", election=election, node=lead.node_id)
        return True

    async def leader(self, election: str = DEFAULT_ELECTION) -> str | None:
        """Node id of the current leader of `election`, or None. Raises: CoordinationError."""
        key = self._leader_key(election)
        raw = await self._op(self._get(key), f"get {key}")
        return None if raw is None else decode_value(raw)["node_id"]

    async def watch_leader(self, election: str = DEFAULT_ELECTION) -> AsyncIterator[str | None]:
        """Yields the current leader's node id (None: no leader), then each change."""
        key = self._leader_key(election)
        last: Any = object()
        async with contextlib.aclosing(self._snapshots(key[: -len("leader")])) as snaps:
            async for snap in snaps:
                raw = snap.get(key)
                cur = None if raw is None else decode_value(raw)["node_id"]
                if cur != last:
                    last = cur
                    yield cur


__all__ = ["ElectionMixin"]
