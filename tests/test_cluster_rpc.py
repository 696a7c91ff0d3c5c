"""Node-to-node control RPC: calls, remote errors, timeouts, dead peers.

In-process aiohttp servers on loopback ports picked by the OS, and a real peer process
(a ControlServer that reports each call's arrival) for the killed-mid-call case.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from aiohttp import web

from mooncaked.wire.errors import BadReply, NotConnected, PeerUnavailable, RpcError, RpcTimeout
from mooncaked.wire.rpc import ControlClient, ControlServer
from mooncaked.ports import free_port
from cluster_probe import ProbeProcess


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
            # The session default (60 s) and the handler (30 s) are far above the call's
            # 0.3 s, so the generous bound below tells them apart on a busy machine.
            async with ControlClient(timeout_s=60) as client:
                t0 = time.monotonic()
                with pytest.raises(RpcTimeout) as e:
                    await client.call(addr, "sleep", {"s": 30}, timeout_s=0.3)
                took = time.monotonic() - t0
                assert 0.3 <= took < 10, took
                assert e.value.peer == addr and e.value.method == "sleep"
                assert "no answer within 0.3 s" in str(e.value)
                deadline = time.monotonic() + 10        # the handler sees the cancellation
                while not server.cancelled and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert server.cancelled == [{"s": 30}]
                assert await client.call(addr, "sleep", {"s": 0.01}, timeout_s=2) == "slept"
                # only timeout_s bounds a call: no session-wide cap below it (aiohttp's
                # default of 300 s once cut prefill calls queued longer than that)
                assert client._s().timeout.total is None
        finally:
            await server.stop()
    asyncio.run(main())


def test_dead_peer_is_peer_unavailable_quickly():
    async def main():
        # a refused connection fails at once: a PeerUnavailable long before the 60 s
        # timeout (which would be an RpcTimeout)
        async with ControlClient(timeout_s=60) as client:
            with pytest.raises(PeerUnavailable) as e:
                await asyncio.wait_for(client.call(f"127.0.0.1:{free_port()}", "echo", {}), 10)
            assert "peer unavailable: ClientConnectorError" in str(e.value)
            assert isinstance(e.value.__cause__.os_error, ConnectionRefusedError)
            assert isinstance(e.value, NotConnected)       # it never saw the call
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


def test_a_stream_yields_json_lines_with_the_calls_token_and_errors():
    """ControlClient.stream: the JSON lines of a 200 answer without its keep-alives; an
    error status is an RpcError with the answer's object (a 429's refusal); a line that is
    not JSON a BadReply; silence past idle_s an RpcTimeout; a refused connection
    NotConnected and one that breaks mid-stream PeerUnavailable; aclose() cancels the
    peer's handler; every request carries the token."""
    seen: dict = {"auth": [], "cancelled": 0}

    async def stream(request):
        seen["auth"].append(request.headers.get("Authorization"))
        ask = await request.json()
        if ask["do"] == "refuse":
            return web.json_response({"error": "full", "reason": "tbt_slo",
                                      "retry_after_s": 2.5}, status=429)
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        await resp.write(b'{"n": 1}\n{}\n\n[2, "two"]\n')
        if ask["do"] == "bad":
            await resp.write(b"not json\n")
        elif ask["do"] in ("hang", "wait"):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen["cancelled"] += 1
                raise
        elif ask["do"] == "die":
            request.transport.close()          # the peer goes away mid-stream
            await asyncio.sleep(30)
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/internal/s", stream)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        addr = f"127.0.0.1:{port}"

        async def lines(do, idle_s=10.0, at=addr):
            got = []
            async for v in client.stream(at, "/internal/s", {"do": do}, total_s=20,
                                         idle_s=idle_s):
                got.append(v)
            return got
        try:
            async with ControlClient(timeout_s=5, token="s" * 20) as client:
                assert await lines("ok") == [{"n": 1}, [2, "two"]]
                assert seen["auth"] == ["Bearer " + "s" * 20]
                with pytest.raises(RpcError) as e:
                    await lines("refuse")
                assert (e.value.status, e.value.remote_message) == (429, "full")
                assert e.value.body["retry_after_s"] == 2.5 and e.value.peer == addr
                assert not isinstance(e.value, PeerUnavailable)
                with pytest.raises(BadReply, match="not JSON"):
                    await lines("bad")
                t0 = time.monotonic()
                with pytest.raises(RpcTimeout):
                    await lines("hang", idle_s=0.3)
                assert time.monotonic() - t0 < 10
                with pytest.raises(PeerUnavailable) as e:
                    await lines("die")
                assert not isinstance(e.value, NotConnected)
                with pytest.raises(NotConnected):
                    await lines("ok", at=f"127.0.0.1:{free_port()}")
                it = client.stream(addr, "/internal/s", {"do": "wait"}, total_s=20, idle_s=20)
                assert await it.__anext__() == {"n": 1}
                cancelled = seen["cancelled"]
                await it.aclose()                  # the client went away: the handler stops
                deadline = time.monotonic() + 10
                while seen["cancelled"] == cancelled and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert seen["cancelled"] == cancelled + 1
        finally:
            await runner.cleanup()
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


# A peer process: a ControlServer with whoami, fail and sleep; it prints {"event": "ready",
# "rpc": addr} when serving and {"event": "call_started", ...} as a sleep call arrives.
PEER_SCRIPT = """
import asyncio, sys, time
import orjson
from mooncaked.wire.rpc import ControlServer

def emit(event, **kw):
    sys.stdout.write(orjson.dumps({"event": event, "t": time.time(), **kw}).decode() + "\\n")
    sys.stdout.flush()

async def main():
    server = ControlServer()
    async def whoami(p):
        return "p1"
    async def fail(p):
        raise RuntimeError(f"asked to fail: {p}")
    async def sleep(p):
        emit("call_started", method="sleep")
        await asyncio.sleep(float(p["s"]))
        return "slept"
    for name, h in (("whoami", whoami), ("fail", fail), ("sleep", sleep)):
        server.add_handler(name, h)
    host, port = await server.start("127.0.0.1", 0)
    emit("ready", rpc=f"{host}:{port}")
    await asyncio.Event().wait()

asyncio.run(main())
"""


class SignallingPeer(ProbeProcess):
    """A peer process running PEER_SCRIPT, with ProbeProcess's event collection
    (wait_for), kill9 and stop."""

    def __init__(self):
        super().__init__("p1")
        self.cmd = [sys.executable, "-c", PEER_SCRIPT]


def test_peer_process_killed_mid_call():
    """A real peer process: calls work, then kill -9 while it handles a call (it said the
    call arrived) -> PeerUnavailable at once, not at the call's timeout."""
    with SignallingPeer() as peer:
        addr = peer.ready["rpc"]

        async def main():
            async with ControlClient(timeout_s=60) as client:
                assert await client.call(addr, "whoami") == "p1"
                with pytest.raises(RpcError) as e:
                    await client.call(addr, "fail", {"why": "test"})
                assert e.value.remote_type == "RuntimeError"
                call = asyncio.create_task(client.call(addr, "sleep", {"s": 600}, timeout_s=60))
                await asyncio.to_thread(peer.wait_for, "call_started", 30)
                assert not call.done()
                await asyncio.to_thread(peer.kill9)
                # detected at once (the connection dropped), not at the 60 s timeout
                with pytest.raises(PeerUnavailable):
                    await asyncio.wait_for(call, 15)
                with pytest.raises(PeerUnavailable):
                    await client.call(addr, "whoami", timeout_s=10)
        asyncio.run(main())
