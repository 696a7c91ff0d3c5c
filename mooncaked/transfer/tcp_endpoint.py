"""TCP client endpoints: one pooled connection to a peer's data server each.

Two kinds, both without Python-side copies of payloads:

- TcpEndpoint (slices under transport.BULK_MIN_BYTES, control requests): an
  asyncio.BufferedProtocol on the event loop; requests are pipelined and the loop reads
  answers straight into the buffer `get_buffer` returns (the caller's READ buffer), so
  no coroutine wakes up per socket read and small transfers pay no thread hand-off;
- BlockingEndpoint (bulk slices): blocking calls from a worker thread, one slice at a
  time, so large transfers to one or many peers use several cores (the GIL is released
  in the kernel copies).

Receives go straight into the target memoryview; sends hand header + payload views to
one vectored write. Wire format: protocol.py.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import Callable

import orjson

from mooncaked.log import get_logger

from .protocol import (MAX_CONTROL_BYTES, MAX_REASON_BYTES, RESPONSE, Op, ProtocolError, Refused,
                       Status, pack_request, recv_exactly, send_all, socket_family, tune_socket,
                       unpack_response)

log = get_logger(__name__)

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
        sock = socket.socket(socket_family(self.host), socket.SOCK_STREAM)
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
                sock = socket.socket(socket_family(self.host), socket.SOCK_STREAM)
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
            send_all(sock, [header] if op == Op.READ else [header, buf])
            answer = memoryview(bytearray(RESPONSE.size))
            if not recv_exactly(sock, answer):
                raise ConnectionResetError(f"{self.host}:{self.port} closed the connection")
            status, length = unpack_response(answer)
            if status != Status.OK:
                if length > MAX_REASON_BYTES:
                    raise ProtocolError(f"refusal reason of {length} bytes")
                reason = bytearray(length)
                recv_exactly(sock, memoryview(reason))
                raise Refused(status, reason.decode(errors="replace"))
            if op == Op.READ:
                if length != n:
                    raise ProtocolError(f"READ answer of {length} bytes, expected {n}")
                if not recv_exactly(sock, buf):  # straight into the caller's buffer
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


__all__ = ["TcpEndpoint", "BlockingEndpoint"]
