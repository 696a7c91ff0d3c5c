"""Node-to-node control RPC: aiohttp routes on the server, an aiohttp client with a
timeout on every call, orjson bodies.

Wire format (HTTP/1.1):

    POST /control/<method>         body: JSON payload (any JSON value)
    200 {"ok": true,  "result": <JSON>}
    4xx/5xx {"ok": false, "error": {"type": "<exception class>", "message": "...",
                                    "param": "<parameter at fault>" | null}}

A stream route (the decode node's POST /internal/decode, a coupled node's
/internal/generate) answers 200 with one JSON value a line ("{}" a keep-alive while
it is quiet), or an error status with a JSON object ({"error": "<message>", ...});
`ControlClient.stream` reads it with the same pool, token and errors as a call.

Control messages are small and latency-bound (placement requests, QP/segment
descriptions, drain commands, inventories); KV bytes never travel here, they go
through the transfer engine.

Server side, either mount the routes on the daemon's own aiohttp app
(`app.add_routes(server.routes())`, or `app.add_subapp("/control", server.subapp())`)
or give the control plane its own port (`await server.start(host, port)`).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import AsyncIterator
from typing import Any, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from ..log import get_logger
from ..lograte import RateLimitedLog
from .auth import auth_headers, authorized
from .errors import BadReply, NotConnected, PeerUnavailable, RpcError, RpcTimeout

log = get_logger(__name__)
_limited = RateLimitedLog(log)

Handler = Callable[[Any], Awaitable[Any]]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024     # of a stream route's error answer that is read
KEEPALIVE = b"{}"                    # a stream's keep-alive line, never handed to the caller


def _json_response(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _error(status: int, type_: str, message: str, param: str | None = None,
           detail: dict | None = None) -> web.Response:
    err = {"type": type_, "message": message, "param": param}
    if detail is not None:
        err["detail"] = detail
    return _json_response({"ok": False, "error": err}, status)


class ControlServer:
    """Named async handlers served at POST /control/<name>.

    A handler is `async def handler(payload) -> result`, payload and result being JSON
    values. A handler that raises answers HTTP 500 with the exception's class and
    message (the client raises RpcError with `remote_type` set), or the exception's
    `http_status` with its `detail` dict (DecodeRefused: 429 and the refusal, the
    client's RpcError.remote_detail); ValueError and TypeError answer 400 (bad input). Unknown names answer 404. With a token, a call
    without it (Authorization: Bearer <token>) answers 401 and is logged (auth.py).
    """

    def __init__(self, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, token: str | None = None):
        self._handlers: dict[str, Handler] = {}
        self.token = token     # the cluster secret every call must carry (auth.py); None: none
        self.max_body_bytes = max_body_bytes
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] | None = None

    def add_handler(self, name: str, handler: Handler) -> None:
        """Registers handler under name (letters, digits, '_', '-', '.').

        Raises: ValueError for a bad or duplicate name, TypeError if handler is not async.
        """
        if not name or not all(c.isalnum() or c in "_-." for c in name):
            raise ValueError(f"control method name must be [A-Za-z0-9_.-]+, got {name!r}")
        if name in self._handlers:
            raise ValueError(f"control method {name!r} is already registered")
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(f"control handler {name!r} must be an async function")
        self._handlers[name] = handler

    @property
    def methods(self) -> list[str]:
        """Registered method names."""
        return sorted(self._handlers)

    async def _dispatch(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not authorized(request.headers, self.token, request.remote, name):
            return _error(401, "Unauthorized", "this call needs the cluster token "
                                               "(cluster.token_file)")
        handler = self._handlers.get(name)
        if handler is None:
            return _error(404, "UnknownMethod", f"no control method {name!r} "
                                                f"(known: {', '.join(self.methods)})")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            return _error(413, "PayloadTooLarge", str(e))
        try:
            payload = orjson.loads(body) if body else None
        except orjson.JSONDecodeError as e:
            return _error(400, "BadRequest", f"body is not JSON: {e}")
        try:
            result = await handler(payload)
        except (ValueError, TypeError) as e:
            return _error(400, type(e).__name__, str(e), getattr(e, "param", None))
        except Exception as e:
            status = getattr(e, "http_status", 500)
            if status < 500:
                # an answer by design (DecodeRefused 429, NodeDraining...), not a failure
                log.info("control_handler_refused", method=name, error=type(e).__name__,
                         status=status)
            else:
                # NotLeader answers every report while there is no conductor: one line a window.
                _limited.warning(f"{name}:{type(e).__name__}", "control_handler_failed",
                                 method=name, error=repr(e))
            return _error(status, type(e).__name__, str(e),
                          getattr(e, "param", None), getattr(e, "detail", None))
        try:
            return _json_response({"ok": True, "result": result})
        except TypeError as e:
            return _error(500, "BadResult", f"handler result is not JSON-encodable: {e}")

    def routes(self, prefix: str = "/control") -> list[web.RouteDef]:
        """Route definitions to add to an existing app: `app.add_routes(server.routes())`.

        The app's client_max_size bounds request bodies there.
        """
        return [web.post(prefix + "/{name}", self._dispatch)]

    def subapp(self) -> web.Application:
        """A sub-application to mount: `app.add_subapp("/control", server.subapp())`."""
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes(self.routes(prefix=""))
        return app

    def app(self) -> web.Application:
        """A standalone application serving /control/<name>."""
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes(self.routes())
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serves on its own port (0: the OS picks one); returns the bound (host, port).

        Raises: OSError if the address cannot be bound.
        """
        # Bind the socket ourselves so that port 0 tells us which port the OS chose.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        # A caller that timed out or went away cancels its handler; stop() waits at most
        # 2 s for handlers still running.
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                     shutdown_timeout=2.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.address = sock.getsockname()[:2]
        log.info("control_server_started", host=self.address[0], port=self.address[1])
        return self.address

    async def stop(self) -> None:
        """Stops serving (own-port mode). Never raises."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _base(addr: str) -> str:
    return (addr if "://" in addr else f"http://{addr}").rstrip("/")


def _url(addr: str, method: str) -> str:
    return f"{_base(addr)}/control/{method}"


def _error_body(raw: bytes) -> tuple[dict, str, str, str | None]:
    """(the JSON object, error type, message, param) of an error answer: a control call's
    {"ok": false, "error": {...}} or a stream route's {"error": "<message>", ...}; a body
    that is not a JSON object gives ({}, "", its first 500 characters, None)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        return {}, "", raw[:500].decode(errors="replace"), None
    err = body.get("error")
    if isinstance(err, dict):
        return body, str(err.get("type", "")), str(err.get("message", "")), err.get("param")
    return body, str(body.get("type", "")), str(err if err is not None else body), None


class ControlClient:
    """Calls peers' control methods. One per process; reuses pooled connections.

    `await client.call("127.0.0.1:9100", "drain", {"node": "p0"}, timeout_s=2.0)`.
    With a token, every call carries it (the cluster secret, auth.py).
    Close it with `await client.close()` (or `async with ControlClient() as client`).
    """

    def __init__(self, timeout_s: float = 5.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 limit_per_host: int = 16, token: str | None = None, limit: int = 100):
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", **auth_headers(token)}
        self.max_body_bytes = max_body_bytes
        self._limit_per_host, self._limit = limit_per_host, limit    # 0: no limit
        self._session: aiohttp.ClientSession | None = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No session-wide timeout: each call is bounded by its own timeout_s (aiohttp's
            # default 300 s total would cut a prefill call that queued longer than that).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit,
                                               limit_per_host=self._limit_per_host),
                timeout=aiohttp.ClientTimeout(total=None),
                json_serialize=lambda o: orjson.dumps(o).decode())
        return self._session

    async def call(self, addr: str, method: str, payload: Any = None,
                   timeout_s: float | None = None) -> Any:
        """Calls `method` on the peer at addr ("host:port" or "http://host:port").

        Args:
            payload: any JSON value.
            timeout_s: bound on the whole call (connect, send, handler, reply), seconds;
                None means the client's default.
        Returns: the handler's JSON result.
        Raises:
            PeerUnavailable: connection refused/reset, or the peer died mid-call.
            RpcTimeout: no complete answer within timeout_s.
            RpcError: the handler raised (`remote_type` names its exception), the method is
                unknown, or the reply is malformed.
            ValueError: payload is not JSON-encodable.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            body = orjson.dumps(payload)
        except TypeError as e:
            raise ValueError(f"control payload for {method!r} is not JSON-encodable: {e}") from e
        url = _url(addr, method)
        where = dict(peer=addr, method=method)
        try:
            async with asyncio.timeout(timeout):
                async with self._s().post(url, data=body, headers=self._headers) as resp:
                    raw = await resp.content.read(self.max_body_bytes + 1)
                    status = resp.status
        except TimeoutError as e:
            raise RpcTimeout(f"{method} on {addr}: no answer within {timeout} s", **where) from e
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise _unavailable(e, f"{method} on {addr}", where) from e
        except aiohttp.ClientError as e:
            raise RpcError(f"{method} on {addr}: {type(e).__name__}: {e}", **where) from e
        if len(raw) > self.max_body_bytes:
            raise BadReply(f"{method} on {addr}: reply larger than {self.max_body_bytes} bytes",
                           **where)
        try:
            reply = orjson.loads(raw)
            ok = reply["ok"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as e:
            raise BadReply(f"{method} on {addr}: malformed reply (HTTP {status}): "
                           f"{raw[:200]!r}", **where) from e
        if ok:
            return reply.get("result")
        err = reply.get("error") or {}
        raise RpcError(f"{method} on {addr}: {err.get('type', 'Error')}: "
                       f"{err.get('message', '')} (HTTP {status})",
                       remote_type=err.get("type", ""), remote_message=err.get("message", ""),
                       remote_param=err.get("param"), status=status,
                       remote_detail=err.get("detail"), **where)

    async def stream(self, addr: str, path: str, payload: Any = None, *, total_s: float,
                     idle_s: float, connect_s: float | None = None) -> AsyncIterator[Any]:
        """POSTs payload to the stream route `path` ("/internal/decode") of the peer at addr
        and yields each JSON value of its 200 answer, one a line, as it arrives; the
        keep-alive lines ("{}") are read and not yielded. Closing the iterator (aclose)
        closes the connection, which cancels the peer's handler. Same pool and token as
        `call`.

        Args:
            total_s: bound on the whole stream, seconds.
            idle_s: bound on the silence between two lines (keep-alives count), seconds.
            connect_s: bound on opening the connection; None means the client's timeout_s.
        Raises (from the iteration; before the first value when the peer refuses):
            NotConnected: no connection could be opened (the peer never saw the request).
            PeerUnavailable: the connection broke (the peer died before or mid-stream).
            RpcTimeout: nothing for idle_s, or the stream outlasted total_s (or connect_s).
            RpcError: an answer other than 200; `status`, `remote_message` (its "error")
                and `body` (its JSON object, a 429's refusal) say what.
            BadReply: a line that is not JSON, or longer than the reader's line limit.
            ValueError: payload is not JSON-encodable.
        """
        try:
            body = orjson.dumps(payload)
        except TypeError as e:
            raise ValueError(f"stream payload for {path!r} is not JSON-encodable: {e}") from e
        what = f"{path} on {addr}"
        where = dict(peer=addr, method=path)
        timeout = aiohttp.ClientTimeout(
            total=total_s, sock_connect=self.timeout_s if connect_s is None else connect_s,
            sock_read=idle_s)
        try:
            async with self._s().post(_base(addr) + path, data=body, headers=self._headers,
                                      timeout=timeout) as resp:
                if resp.status != 200:
                    obj, type_, message, param = _error_body(
                        await resp.content.read(MAX_ERROR_BODY_BYTES))
                    raise RpcError(f"{what}: HTTP {resp.status}: {message}", status=resp.status,
                                   remote_type=type_, remote_message=message,
                                   remote_param=param, body=obj, **where)
                async for line in resp.content:
                    line = line.strip()
                    if not line or line == KEEPALIVE:
                        continue
                    try:
                        value = orjson.loads(line)
                    except orjson.JSONDecodeError as e:
                        raise BadReply(f"{what}: a line is not JSON ({e}): {line[:200]!r}",
                                       status=200, **where) from e
                    yield value
        except TimeoutError as e:    # aiohttp's ServerTimeoutError (idle, connect) too
            raise RpcTimeout(f"{what}: nothing within {idle_s} s (or the stream outlasted "
                             f"{total_s:.1f} s)", **where) from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise _unavailable(e, what, where) from e
        except ValueError as e:      # StreamReader: "Line is too long"
            raise BadReply(f"{what}: {e}", status=200, **where) from e
        except aiohttp.ClientError as e:
            raise RpcError(f"{what}: {type(e).__name__}: {e}", **where) from e

    async def close(self) -> None:
        """Closes pooled connections. Never raises."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "ControlClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _unavailable(e: Exception, what: str, where: dict) -> PeerUnavailable:
    """A transport failure as PeerUnavailable: NotConnected when the connection could not
    be opened (refused, unreachable), else the peer died or reset mid-call."""
    cls = NotConnected if isinstance(e, aiohttp.ClientConnectorError) else PeerUnavailable
    return cls(f"{what}: peer unavailable: {type(e).__name__}: {e}", **where)


__all__ = ["ControlServer", "ControlClient", "Handler"]
