"""Node-to-node control RPC: calls, remote errors, timeouts, dead peers.

In-process aiohttp servers on loopback ports picked by the OS, and a real probe
process for the killed-mid-call case.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp import web

from mooncaked.cluster import (ControlClient, ControlServer, PeerUnavailable, RpcError,
                               RpcTimeout)
from mooncaked.cluster.etcd_server import free_port
from mooncaked.cluster.probe import ProbeProcess


def make_server() -> ControlServer:
    server = ControlServer(max_body_bytes=64 * 1024)
    server.cancelled = []

    async def echo(p):
        return {"got": p}

    async def sleep(p):
        try:
            await asyncio.sleep(p["s"])
        except asyncio.CancelledError:
            server.cancelled.append(p)             # the caller gave up: work stops too
            raise
        return "slept"

    async def boom(p):
        raise RuntimeError("disk on fire")

    async def bad_input(p):
        raise ValueError("node must be a string")

    server.add_handler("echo", echo)
    server.add_handler("sleep", sleep)
    server.add_handler("boom", boom)
    server.add_handler("bad_input", bad_input)
    return server


def test_call_roundtrip_and_remote_errors(tmp_path):
    async def main():
        server = make_server()
        host, port = await server.start("127.0.0.1", 0)
        addr = f"{host}:{port}"
        try:
            async with ControlClient(timeout_s=5) as client:
                payload = {"blocks": [1, 2, 3], "node": "p0", "x": 1.5, "none": None}
                assert await client.call(addr, "echo", payload) == {"got": payload}
                assert await client.call(f"http://{addr}", "echo") == {"got": None}

                with pytest.raises(RpcError) as e:
                    await client.call(addr, "boom", {})
                assert e.value.remote_type == "RuntimeError" and "disk on fire" in str(e.value)
                assert not isinstance(e.value, (PeerUnavailable, RpcTimeout))

                with pytest.raises(RpcError) as e:
                    await client.call(addr, "bad_input", {})
                assert e.value.remote_type == "ValueError" and "HTTP 400" in str(e.value)

                with pytest.raises(RpcError) as e:
                    await client.call(addr, "nope", {})
                assert e.value.remote_type == "UnknownMethod" and "echo" in str(e.value)

                with pytest.raises(RpcError, match="413"):     # over max_body_bytes
                    await client.call(addr, "echo", "x" * 100_000)

                with pytest.raises(ValueError):
                    await client.call(addr, "echo", {1, 2})
                # The server still answers after all that.
                assert await client.call(addr, "echo", 7) == {"got": 7}
        finally:
            await server.stop()
    asyncio.run(main())


def test_timeout_is_enforced_per_call():
    async def main():
        server = make_server()
        host, port = await server.start("127.0.0.1", 0)
        addr = f"{host}:{port}"
        try:
            async with ControlClient(timeout_s=5) as client:
                t0 = time.monotonic()
                with pytest.raises(RpcTimeout) as e:
                    await client.call(addr, "sleep", {"s": 3}, timeout_s=0.3)
                took = time.monotonic() - t0
                assert 0.25 < took < 1.5, took
                assert e.value.peer == addr and e.value.method == "sleep"
                for _ in range(100):                     # bounded: at most ~1 s
                    if server.cancelled:
                        break
                    await asyncio.sleep(0.01)
                assert server.cancelled == [{"s": 3}]
                assert await client.call(addr, "sleep", {"s": 0.01}, timeout_s=2) == "slept"
                # only timeout_s bounds a call: no session-wide cap below it (aiohttp's
                # default of 300 s once cut prefill calls queued longer than that)
                assert client._s().timeout.total is None
        finally:
            await server.stop()
    asyncio.run(main())


def test_dead_peer_is_peer_unavailable_quickly():
    async def main():
        async with ControlClient(timeout_s=5) as client:
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable) as e:
                await client.call(f"127.0.0.1:{free_port()}", "echo", {})
            assert time.monotonic() - t0 < 2.0
            assert "refused" in str(e.value).lower() or "connect" in str(e.value).lower()
    asyncio.run(main())


def test_routes_mount_on_an_existing_app():
    async def main():
        server = make_server()
        app = web.Application()

        async def health(request):
            return web.json_response({"ok": True})
        app.router.add_get("/health", health)
        app.add_routes(server.routes())                  # same port as the daemon's API
        sub = web.Application()
        sub.add_subapp("/control", make_server().subapp())
        runners = []
        try:
            addrs = []
            for a in (app, sub):
                runner = web.AppRunner(a)
                await runner.setup()
                runners.append(runner)
                port = free_port()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                addrs.append(f"127.0.0.1:{port}")
            async with ControlClient(timeout_s=5) as client:
                for addr in addrs:
                    assert await client.call(addr, "echo", [1]) == {"got": [1]}
        finally:
            for r in runners:
                await r.cleanup()
    asyncio.run(main())


def test_add_handler_rejects_bad_registrations():
    server = ControlServer()

    async def h(p):
        return p
    server.add_handler("ok.name-1", h)
    with pytest.raises(ValueError):
        server.add_handler("ok.name-1", h)
    with pytest.raises(ValueError):
        server.add_handler("bad/name", h)
    with pytest.raises(TypeError):
        server.add_handler("sync", lambda p: p)
    assert server.methods == ["ok.name-1"]


def test_peer_process_killed_mid_call(tmp_path):
    """A real peer process: calls work, then kill -9 during a call -> PeerUnavailable."""
    with ProbeProcess("p1", state_dir=str(tmp_path / "c"), rpc_port=0) as peer:
        addr = peer.ready["rpc"]

        async def main():
            async with ControlClient(timeout_s=5) as client:
                assert await client.call(addr, "whoami") == "p1"
                with pytest.raises(RpcError) as e:
                    await client.call(addr, "fail", {"why": "test"})
                assert e.value.remote_type == "RuntimeError"
                killer = threading.Timer(0.3, peer.kill9)
                killer.start()
                t0 = time.monotonic()
                try:
                    with pytest.raises(PeerUnavailable):
                        await client.call(addr, "sleep", {"s": 30}, timeout_s=10)
                finally:
                    killer.join()
                assert time.monotonic() - t0 < 3.0       # detected at once, not at the timeout
                with pytest.raises(PeerUnavailable):
                    await client.call(addr, "whoami", timeout_s=2)
        asyncio.run(main())
