"""A node's view of the cluster: who is a member, who leads, its own campaign for the
conductor's seat, and its reports to whoever leads (Mooncake paper, Figure 2; the
coordination backend is coord/coordinator.py).

`ClusterView` follows the coordinator's membership and leader watches, campaigns in
the election (the winner runs a `ConductorService` until it loses the lease), and
sends the node's `NodeReport` to the leader every cluster.report_interval_s (in
process when this node leads).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from mooncaked.conductor.service import ConductorService
from mooncaked.config import Settings
from mooncaked.log import get_logger
from mooncaked.lograte import RateLimitedLog

from mooncaked.coord.coordinator import Coordinator, Member
from mooncaked.wire.errors import ClusterError, CoordinationError, NotLeader
from mooncaked.wire.messages import NodeReport
from .node_state import Activity

log = get_logger(__name__)

_limited = RateLimitedLog(log)   # an outage fails these every second
STEP_DOWN_TIMEOUT_S = 3.0   # bound on each step of standing down (conductor stop, resign)


async def _bounded_stop(service: ConductorService) -> None:
    """Stops a conductor, waiting at most STEP_DOWN_TIMEOUT_S (a shutdown must end)."""
    task = asyncio.ensure_future(service.stop())
    done, _ = await asyncio.wait({task}, timeout=STEP_DOWN_TIMEOUT_S)
    if not done:
        task.cancel()
        log.warning("conductor_stop_timeout", timeout_s=STEP_DOWN_TIMEOUT_S)


class ClusterView:
    """Members, leader, election and reports of one node (see the module doc).

    Args:
        node_id, control_addr: this node's id and control address.
        coord: the started Coordinator, this node registered.
        client: ControlClient for reports to the leader.
        settings: [cluster] intervals; the conductor's settings.
        on_member: awaited for every member that joins or changes (e.g. a cache node
            starts its store once a model node publishes the block size).
        build_report: this node's NodeReport now.
        activity: what the reports carry since the last one (cleared once delivered).
    Call `await start()`, then `await stop()` (cancels the loops, stops the conductor).
    """

    def __init__(self, node_id: str, control_addr: str, coord: Coordinator, client: Any,
                 settings: Settings, on_member: Callable[[Member], Awaitable[None]],
                 build_report: Callable[[], NodeReport], activity: Activity):
        self.node_id, self.control_addr = node_id, control_addr
        self.coord, self.client, self.settings = coord, client, settings
        self._on_member, self._build_report, self._activity = on_member, build_report, activity
        self.members: dict[str, Member] = {}
        self.leader_id: str | None = None
        # (leader id, its not_ready() verdict) from the last report it acknowledged
        self.conductor_verdict: tuple[str | None, str | None] = (None, "no report sent yet")
        self.conductor: ConductorService | None = None
        self._leader_changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # A draining or stopping node does not stand for election (and resigns if it leads).
        self.standing = True
        self._campaign: asyncio.Task | None = None

    async def start(self) -> None:
        """Takes the current members and leader, then watches, campaigns and reports in
        the background. Raises: CoordinationError when the coordinator cannot answer."""
        self.members = await self.coord.members()
        self.leader_id = await self.coord.leader()
        for coro, name in ((self._watch_members(), "members"), (self._watch_leader(), "leader"),
                           (self._report_loop(), "report")):
            self._tasks.append(asyncio.create_task(coro, name=f"node-{name}"))
        if self.standing:
            self._campaign = asyncio.create_task(self._campaign_loop(), name="node-campaign")

    async def stand_down(self, timeout_s: float = STEP_DOWN_TIMEOUT_S) -> None:
        """Stops campaigning and, if this node leads, stops its conductor and resigns, so
        another node takes over at once (not after lease_ttl_s). Bounded by timeout_s per
        step; never raises."""
        self.standing = False
        task, self._campaign = self._campaign, None
        if task is not None:
            task.cancel()      # its finally stops the conductor (bounded)
            await asyncio.wait({task}, timeout=timeout_s)
        try:
            if await asyncio.wait_for(self.coord.resign(), timeout_s):
                log.info("conductor_resigned", node=self.node_id, reason="draining")
        except (ClusterError, TimeoutError) as e:
            log.warning("conductor_resign_failed", node=self.node_id, error=str(e) or repr(e))
        if self.leader_id == self.node_id:
            self.leader_id = None

    def stand_up(self) -> None:
        """Campaigns again (after an undrain)."""
        self.standing = True
        if self._campaign is None or self._campaign.done():
            self._campaign = asyncio.create_task(self._campaign_loop(), name="node-campaign")

    async def stop(self) -> None:
        """Stands down (resigns if leading), stops the loops. Never raises."""
        await self.stand_down()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.conductor is not None:
            await _bounded_stop(self.conductor)
            self.conductor = None

    def leader_control(self) -> str | None:
        """Control address of the current conductor, or None while there is no leader."""
        if self.leader_id is None:
            return None
        if self.leader_id == self.node_id:
            return self.control_addr
        m = self.members.get(self.leader_id)
        return m.info.get("control") if m is not None else None

    async def wait_leader_change(self, timeout_s: float) -> None:
        """Returns at the next change of leader, or after timeout_s."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._leader_changed.wait(), timeout_s)

    # ------------------------------------------------------------------ watches

    async def _watch_members(self) -> None:
        while True:
            try:
                async for ev in self.coord.watch_members():
                    if ev.kind == "leave":
                        self.members.pop(ev.member.node_id, None)
                        log.info("node_left", node=ev.member.node_id)
                        continue
                    self.members[ev.member.node_id] = ev.member
                    if ev.kind in ("join", "rejoin"):
                        log.info("node_joined", node=ev.member.node_id,
                                 role=ev.member.info.get("role"), kind=ev.kind)
                    await self._on_member(ev.member)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep watching
                _limited.warning("members", "node_members_watch_failed", error=repr(e))
                await asyncio.sleep(1.0)

    async def _watch_leader(self) -> None:
        while True:
            try:
                async for leader in self.coord.watch_leader():
                    if leader != self.leader_id:
                        log.info("leader_changed", leader=leader, previous=self.leader_id)
                    self.leader_id = leader
                    self._leader_changed.set()
                    self._leader_changed = asyncio.Event()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                _limited.warning("leader", "node_leader_watch_failed", error=repr(e))
                await asyncio.sleep(1.0)

    async def _campaign_loop(self) -> None:
        while self.standing:
            try:
                lead = await self.coord.campaign(self.node_id)
            except asyncio.CancelledError:
                raise
            except CoordinationError as e:
                _limited.warning("campaign", "campaign_failed", error=str(e))
                await asyncio.sleep(self.settings.cluster.heartbeat_interval_s)
                continue
            if not self.standing:      # stood down while the campaign call returned
                await self.coord.resign()
                return
            service = ConductorService(self.node_id, self.coord, self.client, self.settings)
            try:
                await service.start()
                self.conductor = service
                self.leader_id = self.node_id
                await lead.wait_lost()
                log.warning("conductor_leadership_lost", node=self.node_id)
            finally:
                self.conductor = None
                await _bounded_stop(service)

    # ------------------------------------------------------------------ reports

    async def report_once(self) -> None:
        """Sends one NodeReport to the leader. On failure the leader later sees a gap in
        store_seq and pulls the node's inventory; arrivals and finished prefills are kept
        (bounded) for the next report."""
        report = self._build_report()
        leader = self.leader_id
        try:
            if self.conductor is not None:
                await self.conductor.report(report)
                verdict = self.conductor.not_ready()
            else:
                addr = self.leader_control()
                if addr is None:
                    raise NotLeader("no leader yet")
                reply = await self.client.call(addr, "conductor.report", report.to_json())
                verdict = reply.get("not_ready") if isinstance(reply, dict) else None
                if not isinstance(verdict, (str, type(None))):
                    verdict = f"the conductor sent an unreadable verdict: {verdict!r}"
            self.conductor_verdict = (leader, verdict)
        except (ClusterError, NotLeader) as e:
            log.debug("report_failed", error=str(e))
            self._activity.trim()
            return
        self._activity.reported(len(report.arrived), len(report.done), len(report.ttfts),
                                len(report.tbts))

    def conductor_not_ready(self) -> str | None:
        """Why the current conductor would not place a request now (its answer to this
        node's last report), or None when it would. A verdict from an earlier leader, or
        none yet, is not trusted: the node is not ready until the current leader has
        answered one report."""
        if self.conductor is not None:
            return self.conductor.not_ready()
        leader, verdict = self.conductor_verdict
        if leader is None or leader != self.leader_id:
            return "the conductor has not answered a report from this node yet"
        return verdict

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cluster.report_interval_s)
            try:
                await self.report_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never let reporting die
                log.error("report_error", exc_info=True, error=repr(e))


__all__ = ["ClusterView"]
