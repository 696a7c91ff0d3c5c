"""TCP backend: the per-node data server, and client endpoints (one pooled connection each).

The data server serves READ and WRITE against registered segments only, within
each segment's bounds and with its access key (anything else is refused with a
reason and logged, never served), and hands RDMA control requests to the RDMA
backend. Wire format: protocol.py.

Server: one thread per connection with blocking sockets (kernel copies run with the
GIL released, on several cores at once). Client, two kinds of endpoint:

- TcpEndpoint (slices under engine.BULK_MIN_BYTES): an asyncio.BufferedProtocol on
  the event loop; requests are pipelined and the loop reads answers straight into
  the buffer `get_buffer` returns (the caller's READ buffer), so no coroutine wakes
  up per socket read and small transfers pay no thread hand-off;
- BlockingEndpoint (bulk slices): blocking calls from a worker thread, one slice at a
  time, so large transfers to one or many peers use several cores.

Either way payloads are never copied in Python: receives go straight into the
target memoryview, sends hand header + payload views to one vectored write.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import socket
import threading
import time
from typing import Awaitable, Callable

import orjson

from mooncaked.log import get_logger

from .protocol import (MAX_CONTROL_BYTES, MAX_REASON_BYTES, REQUEST, RESPONSE, Op,
                       ProtocolError, Status, pack_request, pack_response, tune_socket,
                       unpack_request, unpack_response)
from .segment import LocalSegment

log = get_logger(__name__)

_DRAIN_LIMIT = 256 << 20  # a refused WRITE's payload is drained up to this; beyond, hang up
_DRAIN_CHUNK = 1 << 20
_OPS = frozenset(int(o) for o in Op)


class Refused(Exception):
    """The peer's data server refused a request (status != OK); `status` and `reason` say why."""

    def __init__(self, status: int, reason: str):
        try:
            label = Status(status).name.lower()
        except ValueError:
            label = f"status {status}"
        super().__init__(f"{label}: {reason}")
        self.status, self.reason = status, reason


class ControlError(Exception):
    """Raised by a control handler to refuse a control request with a status and reason."""

    def __init__(self, status: Status, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


ControlHandler = Callable[[Op, LocalSegment, dict], Awaitable[dict]]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ---------------------------------------------------------------------------- server

MAX_SERVER_CONNECTIONS = 1024  # beyond this the server hangs up on new connections


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Blocking: fills `view`; False on EOF before the first byte. Raises ProtocolError on
    EOF mid-message, OSError from the socket."""
    pos, end = 0, view.nbytes
    while pos < end:
        n = sock.recv_into(view[pos:] if pos else view)
        if n == 0:
            if pos == 0:
                return False
            raise ProtocolError(f"connection closed after {pos} of {end} bytes")
        pos += n
    return True


def _send_all(sock: socket.socket, buffers: list) -> None:
    """Blocking scatter/gather send of every buffer (no joining copy)."""
    bufs = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers if len(b)]
    while bufs:
        n = sock.sendmsg(bufs)
        while n:
            if n >= bufs[0].nbytes:
                n -= bufs.pop(0).nbytes
            else:
                bufs[0] = bufs[0][n:]
                n = 0


class DataServer:
    """Serves this node's registered segments to peers over TCP.

    One thread per connection with blocking sockets: the kernel copies (recv_into straight
    into the segment, sendmsg straight from it) run with the GIL released, so several
    connections move bytes on several cores at once, and data serving does not wait on
    the event loop. Control requests (RDMA queue-pair setup) run on the loop.

    Args:
        host, port: listen address (port 0: chosen by the OS; see `port` after `start`).
        lookup: segment name -> LocalSegment or None (called from server threads).
        control: optional coroutine handling RDMA_CONNECT / RDMA_DISCONNECT.
        control_timeout_s: bound on one control request.
    """

    def __init__(self, host: str, port: int, lookup: Callable[[str], LocalSegment | None],
                 control: ControlHandler | None = None, control_timeout_s: float = 30.0):
        self.host, self.port = host, port
        self._lookup = lookup
        self.control = control
        self._control_timeout = control_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False
        self.refused = 0  # requests refused since start (exposed in stats)

    async def start(self) -> None:
        """Binds and listens. Raises OSError when the address cannot be bound."""
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(_family(self.host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune_socket(sock)  # accepted connections inherit the buffer sizes
            sock.setblocking(True)
            sock.bind((self.host, self.port))
            sock.listen(512)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._spawn(self._accept_loop, "transfer-accept")

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=self._run, args=(target, args), name=name, daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _run(self, target, args) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    async def close(self) -> None:
        """Stops accepting, drops every connection and waits for the server threads."""
        self._closing = True
        with self._lock:
            socks = list(self._conns)
            threads = list(self._threads)
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv/send
            except OSError:
                pass
        loop = asyncio.get_running_loop()
        for t in threads:
            await loop.run_in_executor(None, t.join, 5.0)
        if self._sock is not None:
            self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._closing:
                    return
                log.warning("data_server_accept_failed", error=str(e))
                time.sleep(0.05)  # e.g. EMFILE: back off rather than spin
                continue
            with self._lock:
                full = len(self._conns) >= MAX_SERVER_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full or self._closing:
                log.warning("data_server_connection_refused", peer=f"{peer[0]}:{peer[1]}",
                            reason="too many connections" if full else "closing")
                conn.close()
                continue
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve, f"transfer-conn-{peer[1]}", conn, f"{peer[0]}:{peer[1]}")

    def _serve(self, sock: socket.socket, peer: str) -> None:
        header = memoryview(bytearray(REQUEST.size))
        try:
            while _recv_into(sock, header):
                op, name_len, offset, length, key = unpack_request(header)
                raw = bytearray(name_len)
                _recv_into(sock, memoryview(raw))
                if not self._handle(sock, peer, op, bytes(raw), offset, length, key):
                    return
        except ProtocolError as e:
            log.warning("transfer_protocol_error", peer=peer, error=str(e))
        except OSError as e:
            if not self._closing:
                log.debug("data_connection_closed", peer=peer, error=str(e))
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _refuse(self, sock, peer: str, op: int, name: str, offset: int, length: int,
                status: Status, reason: str) -> None:
        self.refused += 1
        log.warning("transfer_refused", peer=peer, op=op, segment=name, offset=offset,
                    length=length, status=status.name.lower(), reason=reason)
        body = reason.encode()[:MAX_REASON_BYTES]
        _send_all(sock, [pack_response(status, len(body)), body])

    def _handle(self, sock, peer: str, op: int, raw: bytes, offset: int, length: int,
                key: bytes) -> bool:
        """Serves one request; returns False when the connection must be closed."""
        has_body = op != Op.READ
        try:
            name = raw.decode()
        except UnicodeDecodeError:
            name = raw.decode(errors="replace")
            return self._refuse_body(sock, peer, op, name, offset, length, Status.BAD_REQUEST,
                                     "segment name is not UTF-8")
        if op not in _OPS:
            # The body's framing is unknown for an unknown op: answer, then hang up.
            self._refuse(sock, peer, op, name, offset, length, Status.BAD_REQUEST,
                         f"unknown op {op}")
            return False
        seg = self._lookup(name)
        if seg is None:
            status, reason = Status.UNKNOWN_SEGMENT, f"unknown segment {name!r}"
        elif not hmac.compare_digest(key, seg.access_key):
            status, reason = Status.BAD_KEY, f"access key mismatch for segment {name!r}"
        elif op in (Op.READ, Op.WRITE) and offset + length > seg.length:
            status, reason = (Status.OUT_OF_BOUNDS,
                              f"[{offset}, {offset + length}) is out of bounds of segment "
                              f"{name!r} ({seg.length} bytes)")
        elif has_body and op != Op.WRITE and length > MAX_CONTROL_BYTES:
            status, reason = Status.BAD_REQUEST, f"control body of {length} bytes is too large"
        elif op in (Op.RDMA_CONNECT, Op.RDMA_DISCONNECT) and self.control is None:
            status, reason = Status.UNSUPPORTED, "RDMA is not enabled on this node"
        else:
            status, reason = Status.OK, ""
        if status is not Status.OK:
            return self._refuse_body(sock, peer, op, name, offset, length, status, reason)
        if op == Op.READ:
            _send_all(sock, [pack_response(Status.OK, length), seg.view[offset:offset + length]])
        elif op == Op.WRITE:
            _recv_into(sock, seg.view[offset:offset + length])  # straight into the segment
            _send_all(sock, [pack_response(Status.OK, 0)])
        else:
            body = bytearray(length)
            _recv_into(sock, memoryview(body))
            self._control_request(sock, peer, Op(op), seg, bytes(body), offset, length)
        return True

    def _refuse_body(self, sock, peer: str, op: int, name: str, offset: int, length: int,
                     status: Status, reason: str) -> bool:
        """Refuses after reading and discarding the request's body (WRITE payload, control
        JSON), so the connection stays in step; hangs up when the body is huge."""
        remaining = length if op != Op.READ else 0
        if remaining > _DRAIN_LIMIT:
            self._refuse(sock, peer, op, name, offset, length, status, reason)
            return False
        scratch = memoryview(bytearray(min(remaining, _DRAIN_CHUNK)))
        while remaining:
            n = min(remaining, scratch.nbytes)
            _recv_into(sock, scratch[:n])
            remaining -= n
        self._refuse(sock, peer, op, name, offset, length, status, reason)
        return True

    def _control_request(self, sock, peer: str, op: Op, seg: LocalSegment, body: bytes,
                         offset: int, length: int) -> None:
        try:
            request = orjson.loads(body)
            fut = asyncio.run_coroutine_threadsafe(self.control(op, seg, request), self._loop)
            reply = orjson.dumps(fut.result(self._control_timeout))
        except ControlError as e:
            self._refuse(sock, peer, op, seg.name, offset, length, e.status, e.reason)
        except orjson.JSONDecodeError as e:
            self._refuse(sock, peer, op, seg.name, offset, length, Status.BAD_REQUEST,
                         f"control body is not JSON: {e}")
        except Exception as e:  # noqa: BLE001 - a control bug must not kill the server
            log.error("control_request_failed", exc_info=True, peer=peer, op=int(op))
            self._refuse(sock, peer, op, seg.name, offset, length, Status.INTERNAL,
                         f"internal error: {e!r}")
        else:
            _send_all(sock, [pack_response(Status.OK, len(reply)), reply])


# ---------------------------------------------------------------------------- client


class _Reader(asyncio.BufferedProtocol):
    """Reads a stream as a sequence of "fill this view, then call that" steps."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._dst = memoryview(b"")
        self._pos = 0
        self._then: Callable[[], None] = lambda: None

    def expect(self, view: memoryview, then: Callable[[], None]) -> None:
        """Reads exactly `view.nbytes` bytes into `view`, then calls `then()`."""
        if view.nbytes == 0:
            then()
            return
        self._dst, self._pos, self._then = view, 0, then

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._dst.nbytes:  # every step sets the next one; bytes now are out of turn
            raise ProtocolError("data arrived while none was expected")
        return self._dst[self._pos:] if self._pos else self._dst

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._pos >= self._dst.nbytes:
            self._pos, self._dst = 0, memoryview(b"")
            try:
                self._then()
            except ProtocolError as e:
                self.protocol_error(e)

    def protocol_error(self, e: ProtocolError) -> None:
        log.warning("transfer_protocol_error", error=str(e))
        if self.transport is not None:
            self.transport.abort()


class _Pending:
    __slots__ = ("fut", "dst", "nbytes")

    def __init__(self, fut: asyncio.Future, dst: memoryview | None, nbytes: int):
        self.fut, self.dst, self.nbytes = fut, dst, nbytes


class _ClientConn(_Reader):
    """Client side of one connection: pipelined requests, answers matched in order."""

    def __init__(self, endpoint: "TcpEndpoint"):
        super().__init__()
        self.endpoint = endpoint
        self.pending: collections.deque[_Pending] = collections.deque()
        self._header = memoryview(bytearray(RESPONSE.size))
        self._status = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.expect(self._header, self._on_header)

    def connection_lost(self, exc) -> None:
        self.endpoint._lost(exc)
        err = ConnectionResetError(f"connection to {self.endpoint.host}:{self.endpoint.port} "
                                   f"lost: {exc or 'closed'}")
        while self.pending:
            p = self.pending.popleft()
            if not p.fut.done():
                p.fut.set_exception(err)

    def request(self, header: bytes, payload: memoryview | bytes | None,
                dst: memoryview | None, nbytes: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(fut, dst, nbytes))
        if payload is None:
            self.transport.write(header)
        else:
            self.transport.writelines([header, payload])
        return fut

    def _on_header(self) -> None:
        if not self.pending:
            raise ProtocolError("answer without a request")
        self._status, length = unpack_response(self._header)
        head = self.pending[0]
        if self._status != Status.OK:
            if length > MAX_REASON_BYTES:
                raise ProtocolError(f"refusal reason of {length} bytes")
            buf = memoryview(bytearray(length))
            self.expect(buf, lambda: self._finish(Refused(self._status,
                                                          bytes(buf).decode(errors="replace"))))
        elif head.dst is not None:
            if length != head.dst.nbytes:
                raise ProtocolError(f"READ answer of {length} bytes, expected {head.dst.nbytes}")
            self.expect(head.dst, lambda: self._finish(None))  # straight into the caller's buffer
        else:
            if length > MAX_CONTROL_BYTES:
                raise ProtocolError(f"answer of {length} bytes is too large")
            buf = memoryview(bytearray(length))
            self.expect(buf, lambda: self._finish(bytes(buf)))

    def _finish(self, result) -> None:
        p = self.pending.popleft()
        self.endpoint.load -= p.nbytes
        if not p.fut.done():
            if isinstance(result, Exception):
                p.fut.set_exception(result)
            else:
                p.fut.set_result(result)
        self.expect(self._header, self._on_header)


class TcpEndpoint:
    """One pooled client connection to a peer's data server, dialed on first use.

    Requests are pipelined: `submit` queues one on the connection and returns a future of
    its answer. `load` is the bytes in flight (used to pick the least-loaded path). When the
    connection breaks, every pending request fails with ConnectionError and `closed` becomes
    True; the pool then drops the endpoint.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.closed = False
        self.load = 0
        self._proto: _ClientConn | None = None
        self._dial: asyncio.Task | None = None

    @property
    def users(self) -> int:
        """Requests in flight (or a dial in progress): the pool never evicts a busy endpoint."""
        if self._proto is not None:
            return len(self._proto.pending)
        return 1 if self._dial is not None else 0

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(_family(self.host), socket.SOCK_STREAM)
        try:
            tune_socket(sock)
            await loop.sock_connect(sock, (self.host, self.port))
            _, proto = await loop.create_connection(lambda: _ClientConn(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        if self.closed:
            proto.transport.abort()
            raise ConnectionAbortedError("endpoint closed while dialing")
        self._proto = proto

    async def submit(self, op: Op, name: bytes, key: bytes, offset: int,
                     buf: memoryview | bytes) -> asyncio.Future:
        """Sends one request; returns the future of its answer (None for READ/WRITE, the JSON
        bytes for control ops). READ fills `buf`; WRITE sends `buf`; control sends `buf`.

        Raises (here or from the future): Refused; ConnectionError/OSError (dial failed or
        connection lost); ProtocolError.
        """
        if self._proto is None:
            if self.closed:
                raise ConnectionAbortedError("endpoint closed")
            if self._dial is None:
                self._dial = asyncio.get_running_loop().create_task(self._connect())
            dial = self._dial
            try:
                await asyncio.shield(dial)
            except (OSError, ConnectionError):
                self.closed = True
                raise
            finally:
                if dial.done():
                    self._dial = None
        if self.closed:
            raise ConnectionAbortedError("endpoint closed")
        n = len(buf)
        self.load += n
        if op == Op.READ:
            return self._proto.request(pack_request(op, name, offset, n, key), None, buf, n)
        return self._proto.request(pack_request(op, name, offset, n, key), buf, None, n)

    async def control(self, op: Op, name: bytes, key: bytes, body: dict) -> dict:
        """An RDMA control request; returns the peer's JSON answer. Raises as `submit`."""
        fut = await self.submit(op, name, key, 0, orjson.dumps(body))
        try:
            return orjson.loads(await fut)
        except asyncio.CancelledError:
            self.close("control request cancelled")
            raise

    def _lost(self, exc) -> None:
        self.closed = True

    def close(self, reason: str = "endpoint closed") -> None:
        """Drops the connection (the peer's server sees EOF and drops its side); pending
        requests fail with ConnectionError."""
        self.closed = True
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.abort()


class BlockingEndpoint:
    """A client connection driven by blocking calls from a worker thread (bulk slices).

    Bulk payloads move with the GIL released (sendmsg from, recv_into straight into the
    caller's buffer), so several of them use several cores at once, like the data server.
    One slice at a time; `call` runs in a worker thread, `close` may come from the loop.
    """

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout = host, port, timeout_s
        self.closed = False
        self.users = 0  # slices using it (the pool never evicts a busy endpoint)
        self._sock: socket.socket | None = None
        self._in_call = False

    def call(self, op: Op, name: bytes, key: bytes, offset: int, buf: memoryview) -> None:
        """Blocking READ (into `buf`) or WRITE (from `buf`); runs in a worker thread.

        Raises: Refused; OSError/ConnectionError/ProtocolError (the endpoint is then closed).
        """
        self._in_call = True
        try:
            if self.closed:
                raise ConnectionAbortedError("endpoint closed")
            if self._sock is None:
                sock = socket.socket(_family(self.host), socket.SOCK_STREAM)
                try:
                    tune_socket(sock)
                    sock.settimeout(self.timeout)  # bounds the dial only
                    sock.connect((self.host, self.port))
                    # Plain blocking I/O afterwards (a timeout would add a poll() before every
                    # call); a stuck call is woken by close() when its request times out.
                    sock.settimeout(None)
                except BaseException:
                    sock.close()
                    raise
                self._sock = sock
            sock = self._sock
            n = buf.nbytes
            header = pack_request(op, name, offset, n, key)
            _send_all(sock, [header] if op == Op.READ else [header, buf])
            answer = memoryview(bytearray(RESPONSE.size))
            if not _recv_into(sock, answer):
                raise ConnectionResetError(f"{self.host}:{self.port} closed the connection")
            status, length = unpack_response(answer)
            if status != Status.OK:
                if length > MAX_REASON_BYTES:
                    raise ProtocolError(f"refusal reason of {length} bytes")
                reason = bytearray(length)
                _recv_into(sock, memoryview(reason))
                raise Refused(status, reason.decode(errors="replace"))
            if op == Op.READ:
                if length != n:
                    raise ProtocolError(f"READ answer of {length} bytes, expected {n}")
                if not _recv_into(sock, buf):  # straight into the caller's buffer
                    raise ConnectionResetError(f"{self.host}:{self.port} closed the connection")
            elif length:
                raise ProtocolError(f"WRITE answer carries {length} bytes")
        except Refused:
            raise
        except BaseException:
            self.closed = True
            raise
        finally:
            self._in_call = False
            if self.closed and self._sock is not None:
                self._sock.close()
                self._sock = None

    def close(self, reason: str = "endpoint closed") -> None:
        """Drops the connection; a call blocked on it (in its thread) fails at once."""
        self.closed = True
        sock = self._sock
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv/send
        except OSError:
            pass
        if not self._in_call:
            self._sock = None
            sock.close()


__all__ = ["DataServer", "TcpEndpoint", "BlockingEndpoint", "Refused", "ControlError"]
