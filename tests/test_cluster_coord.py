"""Coordination with both backends: metadata keys, leased membership, leader election.

Real processes (python -m mooncaked.cluster.probe) and, for the etcd backend, the run's
real etcd (conftest's session fixture; each test under a key prefix of its own; the
restart test starts its own). Lease TTL is 2 s,
heartbeat 0.5 s: a killed node must leave the view, and a killed leader be replaced,
within TTL + slack. "Not elected while another leads" is checked only once the candidate
is known to be campaigning (it has read the election and found the leader's key), over a
bounded observation window.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time

import pytest

from mooncaked.coord.coordinator import MemberEvent
from mooncaked.coord.factory import make_coordinator
from mooncaked.wire.errors import CoordinationError
from mooncaked.coord.etcd_server import EtcdServer, etcd_binary
from mooncaked.ports import free_port
from cluster_probe import ProbeProcess
from mooncaked.config import ClusterSettings, ConfigError

TTL = 2.0
HEARTBEAT = 0.5
SLACK = 3.0          # expiry granularity (etcd checks leases every 0.5 s) + poll + busy CPUs
POLL = 0.1           # the local backend's poll interval here
OBSERVE_S = 10 * POLL  # negative observations ("b is not elected") last this long

BACKENDS = ["local", "etcd"]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    """(settings, probe kwargs) for one backend; each test gets its own key space (the
    etcd one is the run's shared etcd, conftest)."""
    name = request.param
    prefix = f"/t/{request.node.name.replace('[', '_').replace(']', '')}-{os.getpid()}/"
    if name == "etcd":
        server = request.getfixturevalue("etcd")
        settings = ClusterSettings(backend="etcd", etcd_endpoints=[server.endpoint],
                                   key_prefix=prefix, lease_ttl_s=TTL,
                                   heartbeat_interval_s=HEARTBEAT, op_timeout_s=3.0)
        probe_kw = dict(backend="etcd", etcd=[server.endpoint])
    else:
        state = str(tmp_path / "coord")
        settings = ClusterSettings(backend="local", state_dir=state, key_prefix=prefix,
                                   lease_ttl_s=TTL, heartbeat_interval_s=HEARTBEAT,
                                   poll_interval_s=POLL, op_timeout_s=3.0)
        probe_kw = dict(backend="local", state_dir=state)
    return settings, probe_kw


@contextlib.contextmanager
def probes():
    """Collects ProbeProcess objects and always stops them."""
    started: list[ProbeProcess] = []

    def spawn(node_id: str, probe_kw: dict, prefix: str, **kw) -> ProbeProcess:
        p = ProbeProcess(node_id, ttl=TTL, heartbeat=HEARTBEAT, key_prefix=prefix,
                         **probe_kw, **kw)
        started.append(p)
        return p.start()
    try:
        yield spawn
    finally:
        for p in started:
            p.stop(5)


async def next_event(it, timeout_s: float, pred=lambda ev: True) -> MemberEvent:
    """The next event from async iterator `it` satisfying pred, within timeout_s."""
    async def find():
        async for ev in it:
            if pred(ev):
                return ev
    return await asyncio.wait_for(find(), timeout_s)


def run(coro):
    return asyncio.run(coro)


def campaign_waiting(coord) -> asyncio.Event:
    """An event set once `coord` campaigns and has found another node's leader key: from
    then on its campaign() waits for that key to go. Wraps coord._snapshots (the campaign
    loop asks for the next election snapshot only after finding the key there, or after
    losing a create race); a campaign that wins at once never sets it."""
    waiting = asyncio.Event()
    snapshots = coord._snapshots

    async def watched(prefix):
        async with contextlib.aclosing(snapshots(prefix)) as snaps:
            async for snap in snaps:
                yield snap
                if prefix.startswith(coord.prefix + "election/"):
                    waiting.set()
    coord._snapshots = watched
    return waiting


# ---------------------------------------------------------------------------- in-process


def test_metadata_keys_and_ephemeral_cleanup(backend):
    settings, _ = backend

    async def main():
        async with make_coordinator(settings) as a, make_coordinator(settings) as b:
            await a.put("segments/n1/dram", {"bytes": 1 << 30, "addr": "127.0.0.1:7000"})
            await a.put("nodes/n1", {"role": "prefill"}, ephemeral=True)
            assert await b.get("segments/n1/dram") == {"bytes": 1 << 30, "addr": "127.0.0.1:7000"}
            assert await b.get("nodes/missing") is None
            await b.put("segments/n2/dram", {"bytes": 5})
            assert await a.list("segments/") == {"segments/n1/dram": {"bytes": 1 << 30,
                                                                      "addr": "127.0.0.1:7000"},
                                                 "segments/n2/dram": {"bytes": 5}}
            assert await a.delete("segments/n2/dram") is True
            assert await a.delete("segments/n2/dram") is False
            with pytest.raises(ValueError):
                await a.put("/absolute", 1)
            with pytest.raises(ValueError):
                await a.put("k", {1, 2})           # a set is not JSON
            m = await a.register("n9", {"role": "cache"})
            assert (await b.members())["n9"] == m and m.incarnation == a.session_id
            await b.unregister("n9")               # not b's registration: left alone
            assert set(await b.members()) == {"n9"}
            await a.unregister("n9")
            assert await b.members() == {}
            with pytest.raises(ValueError):
                await a.register("bad/id", {})
            await a.close()                        # graceful: lease revoked, ephemerals gone now
            assert await b.get("nodes/n1") is None
            assert await b.get("segments/n1/dram") == {"bytes": 1 << 30, "addr": "127.0.0.1:7000"}
            await b.delete("segments/n1/dram")
    run(main())


def test_resign_hands_leadership_over_and_watch_leader_sees_it(backend):
    settings, _ = backend

    async def main():
        async with make_coordinator(settings) as a, make_coordinator(settings) as b:
            first_session = (await a.register("a", {})).incarnation
            lead_a = await asyncio.wait_for(a.campaign("a"), 5)
            assert lead_a.held and await b.leader() == "a"
            changes = b.watch_leader()
            assert await asyncio.wait_for(anext(changes), 5) == "a"
            waiting = campaign_waiting(b)
            b_task = asyncio.create_task(b.campaign("b"))
            await asyncio.wait_for(waiting.wait(), 5)     # b campaigns and has seen a's key
            done, _ = await asyncio.wait({b_task}, timeout=OBSERVE_S)
            assert not done                               # not elected while a leads
            assert await a.resign() is True
            assert lead_a.lost.is_set() and not lead_a.held
            lead_b = await asyncio.wait_for(b_task, 5)
            assert lead_b.held and lead_b.node_id == "b"
            # a's first lease lived on (its registration on that lease is still there, not a
            # re-registration): b took over through the resign, not through an expiry.
            assert (await b.members())["a"].incarnation == first_session == a.session_id
            seen = [await asyncio.wait_for(anext(changes), 5)]
            if seen[0] is None:
                seen.append(await asyncio.wait_for(anext(changes), 5))
            assert seen[-1] == "b"
            await changes.aclose()
            assert await a.leader() == "b"
            assert await a.resign() is False       # a no longer leads
    run(main())


def test_resign_after_a_cancelled_campaign_removes_a_key_it_won_unknowingly(backend):
    """Fault injection: the campaign's create reaches the store, but the campaign is
    cancelled before the reply (wraps coord._create to hang after the real write)."""
    settings, _ = backend

    async def main():
        async with make_coordinator(settings) as a, make_coordinator(settings) as b:
            await a.register("a", {})
            written, create = asyncio.Event(), a._create

            async def create_then_hang(key, raw, lease):
                ok = await create(key, raw, lease)
                written.set()
                await asyncio.Event().wait()          # the reply never comes back
                return ok
            a._create = create_then_hang
            task = asyncio.create_task(a.campaign("a"))
            await asyncio.wait_for(written.wait(), 5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert await b.leader() == "a"              # it won without learning it
            assert await a.resign() is True
            assert await b.leader() is None             # gone now, not at lease expiry
            assert await a.resign() is False
            lead_b = await asyncio.wait_for(b.campaign("b"), 5)
            assert lead_b.held and await a.leader() == "b"
    run(main())


def test_lost_lease_drops_leadership_and_reregisters(backend):
    """Fault injection: the session's lease vanishes under a live process."""
    settings, _ = backend

    async def main():
        async with make_coordinator(settings) as a, make_coordinator(settings) as obs:
            await a.register("n1", {"v": 1})
            lead = await asyncio.wait_for(a.campaign("n1"), 5)
            first = (await obs.members())["n1"].incarnation
            await a._revoke(a._lease)              # e.g. an operator revoked it, or it expired
            await asyncio.wait_for(lead.wait_lost(), TTL + SLACK)
            assert not lead.held

            async def reregistered():
                while True:
                    m = (await obs.members()).get("n1")
                    if m is not None and m.incarnation != first:
                        return m
                    await asyncio.sleep(0.05)
            m = await asyncio.wait_for(reregistered(), TTL + SLACK)
            assert m.info == {"v": 1} and m.incarnation == a.session_id
            # Not silently leader again: it must campaign, and then wins (nobody else runs).
            assert await obs.leader() is None
            lead2 = await asyncio.wait_for(a.campaign("n1"), 5)
            assert lead2.held and await obs.leader() == "n1"
    run(main())


def test_leader_cut_from_the_store_stands_down_before_another_can_lead(backend):
    """A leader whose keep-alives stop getting through (each one blocks until op_timeout_s,
    as on a partition: fault injected in its own _refresh) loses its leadership at its
    lease's local deadline less guard_margin_s, before the store expires the lease and
    lets another node win: no two leaders at once (issue 34)."""
    settings, _ = backend

    async def main():
        async with make_coordinator(settings) as a, make_coordinator(settings) as b:
            lead = await asyncio.wait_for(a.campaign("a"), 5)
            cut = asyncio.Event()
            refresh = a._refresh

            async def unreachable(lease):
                if cut.is_set():
                    await asyncio.sleep(3600)      # _op's op_timeout_s ends it
                return await refresh(lease)
            a._refresh = unreachable
            times: dict[str, float] = {}

            async def lost():
                await lead.wait_lost()
                times["lost"] = time.monotonic()

            async def won():
                await b.campaign("b")
                times["won"] = time.monotonic()
            watchers = [asyncio.create_task(lost()), asyncio.create_task(won())]
            await asyncio.sleep(HEARTBEAT * 2)      # b campaigns and waits for a's key
            deadline = a._deadline
            cut.set()
            await asyncio.wait_for(asyncio.gather(*watchers), TTL * 3 + SLACK)
            assert times["lost"] < times["won"], times
            # it stood down by its own deadline, not after the blocked keep-alive returned
            assert times["lost"] <= deadline + HEARTBEAT, (times, deadline)
            assert not lead.held
    run(main())


def test_local_backend_survives_corrupt_state_and_bounds_lock_waits(tmp_path):
    settings = ClusterSettings(backend="local", state_dir=str(tmp_path / "c"), op_timeout_s=0.3,
                               lease_ttl_s=2, heartbeat_interval_s=0.5)

    async def main():
        async with make_coordinator(settings) as c:
            await c.put("x", 1)
            (tmp_path / "c" / "coord.json").write_bytes(b'{"keys": {"tor')   # torn write
            assert await c.get("x") is None         # reported and read as empty, no crash
            await c.put("y", 2)
            assert await c.get("y") == 2
            fd = os.open(tmp_path / "c" / "coord.lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)      # another process stuck holding the lock
                # the lock wait is bounded (op_timeout_s 0.3 s): a CoordinationError, long
                # before this outer bound would raise TimeoutError instead
                with pytest.raises(CoordinationError, match="lock held"):
                    await asyncio.wait_for(c.put("z", 3), 10)
            finally:
                os.close(fd)
            await c.put("z", 3)
            assert await c.get("z") == 3
    run(main())
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    bad = ClusterSettings(backend="local", state_dir=str(tmp_path / "open"))
    with pytest.raises(CoordinationError, match="writable by other users"):
        run(make_coordinator(bad).start())


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        make_coordinator(ClusterSettings(lease_ttl_s=2, heartbeat_interval_s=1.5))
    with pytest.raises(ConfigError, match="etcd_endpoints"):
        make_coordinator(ClusterSettings(backend="etcd", etcd_endpoints=["ftp://h:1"]))
    with pytest.raises(ConfigError, match="etcd_endpoints"):
        make_coordinator(ClusterSettings(backend="etcd", etcd_endpoints=["https://h"]))


def test_etcd_endpoints_are_tried_in_order(etcd):
    dead = f"http://127.0.0.1:{free_port()}"
    settings = ClusterSettings(backend="etcd", op_timeout_s=1.0, key_prefix="/t/failover/",
                               etcd_endpoints=[dead, etcd.endpoint])

    async def main():
        async with make_coordinator(settings) as c:
            await c.put("k", {"v": 1})
            assert await c.get("k") == {"v": 1}
            assert c._describe() == "etcd:" + etcd.endpoint.removeprefix("http://")
            await c.delete("k")
    run(main())


def test_unreachable_etcd_is_a_clear_error_within_the_timeout():
    settings = ClusterSettings(backend="etcd", op_timeout_s=1.0,
                               etcd_endpoints=[f"http://127.0.0.1:{free_port()}"])
    # within op_timeout_s (1 s): a CoordinationError, not this outer bound's TimeoutError
    with pytest.raises(CoordinationError, match="127.0.0.1"):
        run(asyncio.wait_for(make_coordinator(settings).start(), 15))


# ---------------------------------------------------------------------------- processes


def test_member_leaves_view_after_kill9_within_ttl(backend):
    settings, probe_kw = backend

    async def main(spawn):
        async with make_coordinator(settings) as obs:
            events = obs.watch_members()
            node = spawn("n1", probe_kw, settings.key_prefix)
            ev = await next_event(events, 10, lambda e: e.member.node_id == "n1")
            assert ev.kind == "join" and ev.member.incarnation == node.ready["session"]
            assert ev.member.info["pid"] == node.proc.pid
            assert set(await obs.members()) == {"n1"}
            node.kill9()
            # gone within TTL + slack of the kill (its lease expired), or TimeoutError
            ev = await next_event(events, TTL + SLACK, lambda e: e.member.node_id == "n1")
            assert ev.kind == "leave"
            assert await obs.members() == {}
            await events.aclose()
    with probes() as spawn:
        run(main(spawn))


def test_leader_kill9_new_leader_within_seconds(backend):
    """The leader is a real process, killed with -9; two candidates (here, in-process, so
    their campaigning is observable) wait behind it, exactly one takes over within TTL +
    slack, and the other takes over once that one resigns."""
    settings, probe_kw = backend

    async def main(spawn):
        async with make_coordinator(settings) as obs, make_coordinator(settings) as b, \
                make_coordinator(settings) as c:
            # (in a thread: the in-process coordinators keep their heartbeats meanwhile)
            a = await asyncio.to_thread(spawn, "a", probe_kw, settings.key_prefix, campaign=True)
            await asyncio.to_thread(a.wait_for, "elected", 10, node="a")
            assert await obs.leader() == "a"
            candidates, first_session = {}, {}
            for coord, name in ((b, "b"), (c, "c")):
                first_session[name] = (await coord.register(name, {})).incarnation
                waiting = campaign_waiting(coord)
                candidates[asyncio.create_task(coord.campaign(name))] = (name, coord)
                await asyncio.wait_for(waiting.wait(), 5)  # campaigning, behind a's key
            done, _ = await asyncio.wait(candidates, timeout=OBSERVE_S)
            assert not done and await obs.leader() == "a"  # nobody else while a leads
            await asyncio.to_thread(a.kill9)
            done, pending = await asyncio.wait(candidates, timeout=TTL + SLACK,
                                               return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, f"{len(done)} new leaders within TTL + slack of the kill"
            (won,), (lost,) = done, pending
            winner, winner_coord = candidates[won]
            loser, _ = candidates[lost]
            assert won.result().held and await obs.leader() == winner
            done, _ = await asyncio.wait({lost}, timeout=OBSERVE_S)
            assert not done                                 # one leader at a time
            # The winner resigns: the loser takes over through that, not a lease expiry
            # (the winner's registration, on the same lease, outlives the handover).
            assert await winner_coord.resign() is True
            assert (await asyncio.wait_for(lost, 5)).held
            assert await obs.leader() == loser
            assert (await obs.members())[winner].incarnation == first_session[winner]
    with probes() as spawn:
        run(main(spawn))


def test_same_id_restart_rejoins_cleanly(backend):
    settings, probe_kw = backend

    async def main(spawn):
        async with make_coordinator(settings) as obs:
            events = obs.watch_members()
            old = spawn("n1", probe_kw, settings.key_prefix)
            await next_event(events, 10, lambda e: e.kind == "join")
            old.kill9()
            t_kill = time.monotonic()
            new = spawn("n1", probe_kw, settings.key_prefix)       # before the old lease ends
            new_inc = new.ready["session"]
            assert new_inc != old.ready["session"]
            ev = await next_event(events, 10, lambda e: e.member.incarnation == new_inc)
            assert ev.kind in ("rejoin", "join")   # "join" only if the old lease ended first
            # The old lease's expiry must not take the new registration down with it.
            seen: list[MemberEvent] = []

            async def observe():
                async for e in events:
                    seen.append(e)
            watcher = asyncio.create_task(observe())
            await asyncio.sleep(max(0.0, t_kill + TTL + SLACK - time.monotonic()))
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            assert [e for e in seen if e.kind == "leave"] == []
            members = await obs.members()
            assert members["n1"].incarnation == new_inc
            assert members["n1"].info["pid"] == new.proc.pid
    with probes() as spawn:
        run(main(spawn))


def test_etcd_restart_is_survived(tmp_path):
    """etcd goes away: calls fail with a clear error within op_timeout_s; it comes back on
    the same ports and data: the session (lease persisted by etcd) and watches resume."""
    if etcd_binary() is None:
        pytest.skip("etcd binary not installed (run mooncaked/coord/install_etcd.sh)")
    first = EtcdServer(tmp_path / "data").start()
    ports = (first.client_port, first.peer_port)
    again = EtcdServer(tmp_path / "data", client_port=ports[0], peer_port=ports[1])
    settings = ClusterSettings(backend="etcd", etcd_endpoints=[first.endpoint], lease_ttl_s=3,
                               heartbeat_interval_s=0.5, op_timeout_s=1.0)

    async def main():
        async with make_coordinator(settings) as c:
            await c.register("n1", {"v": 1})
            leaders = c.watch_leader()
            assert await asyncio.wait_for(anext(leaders), 5) is None
            first.stop()
            # fails within op_timeout_s (1 s): a CoordinationError, not the outer TimeoutError
            with pytest.raises(CoordinationError, match="etcd:127.0.0.1"):
                await asyncio.wait_for(c.put("k", 1), 10)
            again.start()
            await asyncio.wait_for(c.campaign("n1"), 15)     # the watch resumed by itself
            assert await asyncio.wait_for(anext(leaders), 10) == "n1"
            assert set(await c.members()) == {"n1"}
            await leaders.aclose()
    try:
        run(main())
    finally:
        first.stop()
        again.stop()
