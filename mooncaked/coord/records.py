"""The records coordination keeps: members, membership events, leaderships, and the JSON
codec of their values (shared by the Coordinator and its membership and election parts)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from .coordinator import Coordinator

DEFAULT_ELECTION = "conductor"


@dataclass(frozen=True)
class Member:
    """One node in the membership view.

    Attributes:
        node_id: the node's configured id.
        info: what the node registered (addresses, role, version, ...): a JSON object.
        incarnation: id of the session that registered it; a node restarting with the
            same id gets a new incarnation.
        registered_at: unix time (seconds) of the registration.
    """

    node_id: str
    info: dict
    incarnation: str
    registered_at: float


@dataclass(frozen=True)
class MemberEvent:
    """A change in the membership view.

    kind: "join" (new id), "leave" (lease expired or unregistered), "rejoin" (same id,
    new incarnation: the node restarted) or "update" (same incarnation, new info).
    For "leave", `member` is the last record seen.
    """

    kind: str
    member: Member


@dataclass(eq=False)
class Leadership:
    """Proof that this process won an election.

    `lost` is set when leadership ends for any reason (resign, close, lease lost, the
    leader key changed under us); `held` is False from then on, and also as soon as
    the lease may have expired without a successful keep-alive (no split brain
    through a stalled heartbeat).
    """

    election: str
    node_id: str
    incarnation: str
    key: str
    raw: bytes
    _coord: "Coordinator"
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def held(self) -> bool:
        """True while this process is still the leader (lease alive and key ours)."""
        return not self.lost.is_set() and self._coord.session_alive \
            and self._coord.session_id == self.incarnation

    async def wait_lost(self) -> None:
        """Returns when leadership has ended."""
        await self.lost.wait()


def encode_value(value: Any) -> bytes:
    """A coordination value as stored (JSON bytes). Raises: ValueError if not JSON-encodable."""
    try:
        return orjson.dumps(value)
    except TypeError as e:
        raise ValueError(f"coordination values must be JSON-encodable: {e}") from e


def decode_value(raw: bytes) -> Any:
    """A stored coordination value (JSON bytes) back. Raises: orjson.JSONDecodeError."""
    return orjson.loads(raw)


def member_from(raw: bytes) -> Member | None:
    """The Member of a stored membership record, or None when it is malformed."""
    try:
        d = decode_value(raw)
        return Member(d["node_id"], d.get("info") or {}, d["incarnation"], d["registered_at"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None


def check_name(kind: str, name: str) -> None:
    """Raises ValueError unless `name` (a node id or election name) is a non-empty string
    without '/' or surrounding spaces."""
    if not name or "/" in name or name != name.strip():
        raise ValueError(f"{kind} must be a non-empty string without '/' or surrounding spaces, "
                         f"got {name!r}")


__all__ = ["DEFAULT_ELECTION", "Leadership", "Member", "MemberEvent", "check_name",
           "decode_value", "encode_value", "member_from"]
