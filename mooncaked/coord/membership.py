"""Leased membership on top of a Coordinator's backend primitives (etcd's recipe: one
member key per node, bound to its session's lease): register, unregister, the current
members and a watch of joins, leaves, rejoins and updates."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from ..log import get_logger
from .records import Member, MemberEvent, check_name, decode_value, encode_value, member_from

log = get_logger("mooncaked.coord.coordinator")


class MembershipMixin:
    """The membership part of `Coordinator` (which provides the session, `_op`, `_key`
    and the backend primitives these methods use)."""

    async def _put_member(self, node_id: str, info: dict, registered_at: float) -> None:
        record = {"node_id": node_id, "info": info, "incarnation": self._session_id,
                  "registered_at": registered_at}
        await self._op(self._put(self._key(f"members/{node_id}"), encode_value(record), self._lease),
                       f"register {node_id}")

    async def register(self, node_id: str, info: dict) -> Member:
        """Joins the membership view as node_id with info, bound to this session's lease.

        Calling it again updates info. A node restarting with the same id simply
        registers again: its new record (new incarnation) replaces the old one.
        Raises: ValueError (bad id, info not a JSON object), CoordinationError, SessionLost.
        """
        check_name("node_id", node_id)
        if not isinstance(info, dict):
            raise ValueError(f"member info must be a dict, got {type(info).__name__}")
        encode_value(info)
        self._require_session()
        registered_at = self._registered.get(node_id, (None, time.time()))[1]
        self._registered[node_id] = (info, registered_at)
        await self._put_member(node_id, info, registered_at)
        log.info("coord_registered", node=node_id, session=self._session_id)
        return Member(node_id, info, self._session_id, registered_at)

    async def claim_id(self, node_id: str, holder: dict) -> dict | None:
        """Claims node_id for this session (create-if-absent of `ids/<node_id>`, bound to
        the lease): None when claimed (or already ours), else the holder's record of the
        process that holds it. Two processes can never hold one id at once.
        Raises: CoordinationError, SessionLost."""
        check_name("node_id", node_id)
        key = self._key(f"ids/{node_id}")
        raw = encode_value({**holder, "session": self._session_id})
        lease = self._require_session()
        if key in self._ephemeral or await self._op(self._create(key, raw, lease),
                                                    f"claim {node_id}"):
            self._ephemeral[key] = raw
            return None
        got = await self._op(self._get(key), f"get {key}")
        return decode_value(got) if got is not None else {}

    async def unregister(self, node_id: str) -> None:
        """Leaves the membership view now (instead of at lease expiry)."""
        self._registered.pop(node_id, None)
        key = self._key(f"members/{node_id}")
        raw = await self._op(self._get(key), f"get {key}")
        member = member_from(raw) if raw is not None else None
        # Only our own record: never evict a newer incarnation of the same id.
        if member is not None and member.incarnation == self._session_id:
            await self._op(self._delete_if(key, raw), f"unregister {node_id}")

    async def members(self) -> dict[str, Member]:
        """{node_id: Member} of every node whose lease is alive. Raises: CoordinationError."""
        raws = await self._op(self._list(self._key("members/")), "list members")
        out = {}
        for raw in raws.values():
            m = member_from(raw)
            if m is not None:
                out[m.node_id] = m
        return dict(sorted(out.items()))

    async def watch_members(self) -> AsyncIterator[MemberEvent]:
        """Yields a "join" for every current member, then every change (MemberEvent).

        A node that stops heartbeating produces "leave" within about lease_ttl_s (plus
        poll_interval_s on the local backend).
        """
        known: dict[str, Member] = {}
        async with contextlib.aclosing(self._snapshots(self._key("members/"))) as snaps:
            async for snap in snaps:
                now: dict[str, Member] = {}
                for raw in snap.values():
                    m = member_from(raw)
                    if m is not None:
                        now[m.node_id] = m
                for node_id, m in known.items():
                    if node_id not in now:
                        yield MemberEvent("leave", m)
                for node_id, m in now.items():
                    old = known.get(node_id)
                    if old is None:
                        yield MemberEvent("join", m)
                    elif old.incarnation != m.incarnation:
                        yield MemberEvent("rejoin", m)
                    elif old != m:
                        yield MemberEvent("update", m)
                known = now


__all__ = ["MembershipMixin"]
