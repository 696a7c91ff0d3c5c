"""The coordination interface: metadata keys, leased membership and leader election.

One `Coordinator` per process. Backends (`local`, `etcd`) supply a handful of
primitives over a key-value store with leases (put/get/delete/list, create-if-
absent, delete-if-value, lease grant/refresh/revoke, prefix snapshots); the
membership and election logic is written once, here, on top of them, following
etcd's own recipes (a member key and a leader key bound to the holder's lease,
leader = whoever created the leader key; see etcd's `clientv3/concurrency`).

Sessions: `start()` grants this process a lease of `lease_ttl_s` seconds and a
heartbeat task refreshes it every `heartbeat_interval_s`. Keys written with
`ephemeral=True`, member records and leader keys are bound to that lease, so a
process that dies (kill -9 included) disappears from every view within about
`lease_ttl_s`. If the lease is lost while the process lives (a pause longer than
the TTL, a store outage), the heartbeat opens a new session, re-registers the
node and re-writes its ephemeral keys; leadership is not re-taken silently: the
`Leadership` object's `lost` event fires and the caller campaigns again.

Values are JSON (anything orjson encodes); keys are '/'-separated strings
relative to `key_prefix`. Layout under the prefix:
  members/<node_id>         Member record (ephemeral)
  election/<name>/leader    {"node_id", "incarnation", "since"} (ephemeral)
  anything else             caller metadata (node and segment descriptions, ...)
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import time
import uuid
from typing import Any, AsyncIterator


from ..config import ClusterSettings, ConfigError
from ..log import get_logger
from ..lograte import RateLimitedLog
from .election import ElectionMixin
from .membership import MembershipMixin
from .records import (DEFAULT_ELECTION, Leadership, Member, MemberEvent, decode_value,
                      encode_value)
from mooncaked.wire.errors import CoordinationError, SessionLost

log = get_logger(__name__)
# An outage fails these every heartbeat / poll: one line per kind per window, with a count.
_limited = RateLimitedLog(log)

class Coordinator(MembershipMixin, ElectionMixin, abc.ABC):
    """Cluster coordination: metadata, leased membership (coord/membership.py), leader
    election (coord/election.py), over a backend's primitives.

    Use as `async with make_coordinator(settings) as coord: ...` or call `start()` and
    `close()`. Operations raise `CoordinationError` when the store fails or does not
    answer within `op_timeout_s`, and `ValueError` for bad keys or values.
    """

    backend = "abstract"

    def __init__(self, settings: ClusterSettings):
        if settings.heartbeat_interval_s * 2 > settings.lease_ttl_s:
            raise ConfigError("<settings>", "cluster.heartbeat_interval_s",
                              f"{settings.heartbeat_interval_s} s must be at most half of "
                              f"cluster.lease_ttl_s ({settings.lease_ttl_s} s)")
        prefix = settings.key_prefix
        if not prefix.endswith("/"):
            prefix += "/"
        self.settings = settings
        self.prefix = prefix
        # etcd leases have whole-second TTLs; use the same rounded TTL everywhere.
        self.ttl_s = float(math.ceil(settings.lease_ttl_s))
        self._lease: Any = None
        self._session_id = ""
        self._deadline = 0.0                          # monotonic time the lease surely ends
        self._registered: dict[str, tuple[dict, float]] = {}   # node_id -> (info, registered_at)
        self._ephemeral: dict[str, bytes] = {}        # full key -> raw value, re-put on new session
        self._leading: dict[str, Leadership] = {}     # election -> leadership
        # election -> the leader value of a create whose outcome this process never saw
        # (the campaign was cancelled while it ran); resign() deletes it if it won
        self._unconfirmed: dict[str, bytes] = {}
        self._heartbeat: asyncio.Task | None = None
        self._guard: asyncio.Task | None = None
        # a leader stands down this long before its lease could end without a keep-alive
        self.guard_margin_s = self.ttl_s / 4
        self._session_lock = asyncio.Lock()
        self._closed = False

    # ------------------------------------------------------------------ backend primitives

    @abc.abstractmethod
    async def _open(self) -> None:
        """Connects to the store."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Releases the connection; must not raise."""

    @abc.abstractmethod
    async def _grant(self, ttl_s: float) -> Any:
        """Creates a lease of ttl_s seconds; returns its handle."""

    @abc.abstractmethod
    async def _refresh(self, lease: Any) -> bool:
        """Keeps the lease alive for another TTL; False if it has already expired."""

    @abc.abstractmethod
    async def _revoke(self, lease: Any) -> None:
        """Ends the lease now, deleting its keys."""

    @abc.abstractmethod
    async def _put(self, key: str, raw: bytes, lease: Any) -> None:
        """Writes key (bound to lease, or persistent when lease is None)."""

    @abc.abstractmethod
    async def _get(self, key: str) -> bytes | None:
        """Reads key; None when absent or its lease expired."""

    @abc.abstractmethod
    async def _delete(self, key: str) -> bool:
        """Deletes key; True if it existed."""

    @abc.abstractmethod
    async def _list(self, prefix: str) -> dict[str, bytes]:
        """Every live key under prefix (full keys)."""

    @abc.abstractmethod
    async def _create(self, key: str, raw: bytes, lease: Any) -> bool:
        """Writes key only if it does not exist (atomically); True if written."""

    @abc.abstractmethod
    async def _delete_if(self, key: str, raw: bytes) -> bool:
        """Deletes key only if its value is raw (atomically); True if deleted."""

    async def _snapshots(self, prefix: str) -> AsyncIterator[dict[str, bytes]]:
        """Yields the live keys under prefix now, then again after every change.

        Default: polls every `poll_interval_s` (the local backend); etcd overrides it with
        a native watch. A failed poll is logged and retried, never ends the stream.
        """
        last: dict[str, bytes] | None = None
        while True:
            try:
                snap = await self._list(prefix)
            except CoordinationError as e:
                _limited.warning(f"poll:{prefix}", "coord_watch_poll_failed", prefix=prefix,
                                  error=str(e))
                snap = None
            if snap is not None and snap != last:
                last = snap
                yield dict(snap)
            await asyncio.sleep(self.settings.poll_interval_s)

    def _describe(self) -> str:
        """Backend and location, for error messages."""
        return self.backend

    def _op_budget_s(self) -> float:
        """Outer bound of one store call, seconds (a backend may try several endpoints)."""
        return self.settings.op_timeout_s + 0.5

    # ------------------------------------------------------------------ helpers

    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key or key.startswith("/") or "//" in key:
            raise ValueError(f"coordination key must be a non-empty relative path like "
                             f"'segments/node1', got {key!r}")
        return self.prefix + key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix):]

    async def _op(self, coro, what: str):
        """Runs one store call with the op timeout, mapping failures to CoordinationError.

        The backends bound their own calls by op_timeout_s (gRPC deadline, lock wait) and
        report why; this outer bound, a little longer, only catches what they miss.
        """
        try:
            return await asyncio.wait_for(coro, self._op_budget_s())
        except CoordinationError:
            raise
        except asyncio.TimeoutError as e:
            raise CoordinationError(f"{self._describe()}: {what} timed out after "
                                    f"{self._op_budget_s():.1f} s") from e

    def _require_session(self) -> Any:
        if self._closed:
            raise CoordinationError(f"{self._describe()}: coordinator is closed")
        if self._lease is None:
            raise SessionLost(f"{self._describe()}: no live session (call start(), or the lease "
                              f"was lost and is being renewed)")
        return self._lease

    # ------------------------------------------------------------------ lifecycle

    @property
    def session_id(self) -> str:
        """Id of the current session (lease); changes when a new session is opened."""
        return self._session_id

    @property
    def session_alive(self) -> bool:
        """True while the lease has surely not expired (a keep-alive succeeded < TTL ago)."""
        return self._lease is not None and time.monotonic() < self._deadline

    async def start(self) -> "Coordinator":
        """Connects, opens a session (lease) and starts the heartbeat task.

        Raises: CoordinationError if the store is unreachable within op_timeout_s.
        """
        await self._op(self._open(), "connect")
        await self._new_session()
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="coord-heartbeat")
        self._guard = asyncio.create_task(self._guard_loop(), name="coord-lease-guard")
        log.info("coord_started", backend=self.backend, where=self._describe(),
                 session=self._session_id, lease_ttl_s=self.ttl_s)
        return self

    async def close(self) -> None:
        """Leaves the cluster: resigns, revokes the lease (member and ephemeral keys vanish
        at once instead of after the TTL), stops the heartbeat, disconnects. Never raises."""
        if self._closed:
            return
        self._closed = True
        for task in (self._heartbeat, self._guard):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for lead in list(self._leading.values()):
            lead.lost.set()
        self._leading.clear()
        if self._lease is not None:
            try:
                await asyncio.wait_for(self._revoke(self._lease), self.settings.op_timeout_s)
            except Exception as e:  # the lease then simply expires
                log.warning("coord_revoke_failed", error=str(e))
            self._lease = None
        await self._close()
        log.info("coord_closed", backend=self.backend, session=self._session_id)

    async def __aenter__(self) -> "Coordinator":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _new_session(self) -> None:
        async with self._session_lock:
            t0 = time.monotonic()
            lease = await self._op(self._grant(self.ttl_s), "lease grant")
            self._lease, self._deadline = lease, t0 + self.ttl_s
            self._session_id = uuid.uuid4().hex
            try:
                # Bring back what the previous session published.
                for node_id, (info, registered_at) in list(self._registered.items()):
                    await self._put_member(node_id, info, registered_at)
                for key, raw in list(self._ephemeral.items()):
                    await self._op(self._put(key, raw, lease), f"put {key}")
            except CoordinationError:
                self._lease = None            # half-restored: the next heartbeat starts over
                raise

    def _drop_leaderships(self, why: str) -> None:
        for name, lead in list(self._leading.items()):
            log.warning("coord_leadership_lost", election=name, node=lead.node_id, reason=why)
            lead.lost.set()
        self._leading.clear()

    async def _guard_loop(self) -> None:
        """A leader whose keep-alives fail stands down at its lease's local deadline less
        guard_margin_s, on a timer of its own: the failing keep-alive call itself may block
        for op_timeout_s past the moment the store expires the lease and lets another node
        lead, so the heartbeat alone would notice too late (two conductors placing at once,
        issue 34). The deadline counts from when the last successful keep-alive was *sent*,
        so it comes no later than the store's expiry. The session is abandoned with it (its
        leader key expires in the store; the heartbeat opens a new session)."""
        tick = self.settings.heartbeat_interval_s / 2
        while True:
            left = self._deadline - self.guard_margin_s - time.monotonic()
            if left > 0 or not self._leading or self._lease is None:
                await asyncio.sleep(min(max(left, 0.0), tick) or tick)
                continue
            log.warning("coord_lease_expiring", session=self._session_id,
                        lease_left_s=round(self._deadline - time.monotonic(), 3),
                        meaning="no keep-alive reached the store: standing down as leader "
                                "before another node can be elected")
            self._drop_leaderships("lease expiring without a keep-alive")
            self._lease = None

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self._heartbeat_once()
            except Exception as e:            # never let the heartbeat die
                log.error("coord_heartbeat_error", exc_info=True, error=repr(e))

    async def _heartbeat_once(self) -> None:
        """One keep-alive; opens a new session once the lease is surely gone."""
        t0 = time.monotonic()
        ok: bool | None = False
        if self._lease is not None:
            try:
                ok = await self._op(self._refresh(self._lease), "lease keep-alive")
            except CoordinationError as e:
                _limited.warning("heartbeat", "coord_heartbeat_failed", error=str(e),
                                 lease_left_s=round(self._deadline - time.monotonic(), 1))
                ok = None                     # unknown: retry until the deadline
        if ok:
            self._deadline = t0 + self.ttl_s
            await self._check_leaderships()
            return
        if ok is None and time.monotonic() < self._deadline:
            return
        if self._lease is not None:
            log.warning("coord_session_lost", session=self._session_id)
        self._drop_leaderships("lease expired")
        self._lease = None
        try:
            await self._new_session()
            log.info("coord_session_renewed", session=self._session_id,
                     nodes=list(self._registered))
        except CoordinationError as e:
            _limited.warning("renew", "coord_session_renew_failed", error=str(e),
                             meaning="the coordination store is unreachable: this node cannot "
                                     "be placed and no conductor can be elected until it is back")

    async def _check_leaderships(self) -> None:
        # The leader key may vanish without our lease ending (an operator deleted it).
        for name, lead in list(self._leading.items()):
            try:
                raw = await self._op(self._get(lead.key), f"get {lead.key}")
            except CoordinationError:
                continue
            if raw != lead.raw:
                self._leading.pop(name, None)
                log.warning("coord_leadership_lost", election=name, node=lead.node_id,
                            reason="leader key changed")
                lead.lost.set()

    # ------------------------------------------------------------------ metadata keys

    async def put(self, key: str, value: Any, *, ephemeral: bool = False) -> None:
        """Writes a JSON value under key (relative to key_prefix).

        ephemeral=True binds it to this process's lease: it disappears when the process
        dies or closes, and is re-written if the session is renewed.
        Raises: ValueError (bad key, not JSON-encodable), CoordinationError, SessionLost.
        """
        full, raw = self._key(key), encode_value(value)
        lease = self._require_session() if ephemeral else None
        await self._op(self._put(full, raw, lease), f"put {key}")
        if ephemeral:
            self._ephemeral[full] = raw
        else:
            self._ephemeral.pop(full, None)

    async def get(self, key: str) -> Any | None:
        """The JSON value under key, or None when absent. Raises: CoordinationError."""
        raw = await self._op(self._get(self._key(key)), f"get {key}")
        return None if raw is None else decode_value(raw)

    async def delete(self, key: str) -> bool:
        """Deletes key; True if it existed. Raises: CoordinationError."""
        full = self._key(key)
        self._ephemeral.pop(full, None)
        return await self._op(self._delete(full), f"delete {key}")

    async def list(self, prefix: str) -> dict[str, Any]:
        """{relative key: value} of every key starting with prefix (e.g. "segments/").

        Raises: CoordinationError.
        """
        full = self._key(prefix)
        raws = await self._op(self._list(full), f"list {prefix}")
        return {self._rel(k): decode_value(v) for k, v in sorted(raws.items())}

    async def watch(self, prefix: str) -> AsyncIterator[dict[str, Any]]:
        """Yields {relative key: value} under prefix now and after every change.

        Changes that happen close together may be merged into one snapshot. Store
        outages are logged and survived (the stream resumes with a fresh snapshot).
        Stop it by breaking out of the loop or cancelling the task.
        """
        full = self._key(prefix)
        async with contextlib.aclosing(self._snapshots(full)) as snaps:
            async for snap in snaps:
                yield {self._rel(k): decode_value(v) for k, v in sorted(snap.items())}

__all__ = ["Coordinator", "Member", "MemberEvent", "Leadership", "DEFAULT_ELECTION"]
