"""TCP data server: serves this node's registered segments to peers (wire format: protocol.py).

It serves READ and WRITE against registered segments only, within each segment's
bounds and with its access key; anything else is refused with a status and a reason
and logged (`transfer_refused`), never served. A refused WRITE's payload is read and
dropped so the connection stays in step; a byte stream that is not this protocol is
dropped. RDMA control requests (queue-pair setup) go to the handler the RDMA transport
installs.

One thread per connection with blocking sockets: the kernel copies (recv_into straight
into the segment, sendmsg straight from it) run with the GIL released, so several
connections move bytes on several cores at once, and data serving never waits on the
event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
import time
from typing import Awaitable, Callable

import orjson

from mooncaked.log import get_logger

from .protocol import (MAX_CONTROL_BYTES, MAX_REASON_BYTES, REQUEST, ControlError, Op,
                       ProtocolError, Status, pack_response, recv_exactly, send_all,
                       socket_family, tune_socket, unpack_request)
from .segment import LocalSegment

log = get_logger(__name__)

_DRAIN_LIMIT = 256 << 20  # a refused WRITE's payload is drained up to this; beyond, hang up
_DRAIN_CHUNK = 1 << 20
_OPS = frozenset(int(o) for o in Op)

ControlHandler = Callable[[Op, LocalSegment, dict], Awaitable[dict]]
"""A coroutine answering one control request: (op, segment, JSON body) -> JSON reply;
raises ControlError to refuse it."""

MAX_SERVER_CONNECTIONS = 1024  # beyond this the server hangs up on new connections


class DataServer:
    """Serves this node's registered segments to peers over TCP.

    One thread per connection with blocking sockets: the kernel copies (recv_into straight
    into the segment, sendmsg straight from it) run with the GIL released, so several
    connections move bytes on several cores at once, and data serving does not wait on
    the event loop. Control requests (RDMA queue-pair setup) run on the loop.

    Args:
        host, port: listen address (port 0: chosen by the OS; see `port` after `start`).
        lookup: segment name -> LocalSegment or None (called from server threads).
        control: optional coroutine handling RDMA_CONNECT / RDMA_DISCONNECT (without
            one, those are refused as UNSUPPORTED); may also be set before `start`.
        control_timeout_s: bound on one control request, seconds.
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
        sock = socket.socket(socket_family(self.host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune_socket(sock)  # accepted connections inherit the buffer sizes
            sock.setblocking(True)
            sock.bind((self.host, self.port))
            sock.listen(512)
        except OSError as e:
            sock.close()
            # name the setting: "[Errno 98] Address already in use" alone does not say which
            raise OSError(e.errno, f"transfer engine data server cannot listen on "
                                   f"{self.host}:{self.port} (transfer.host/transfer.port): "
                                   f"{e.strerror}") from e
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
            while recv_exactly(sock, header):
                op, name_len, offset, length, key = unpack_request(header)
                raw = bytearray(name_len)
                recv_exactly(sock, memoryview(raw))
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
        send_all(sock, [pack_response(status, len(body)), body])

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
            send_all(sock, [pack_response(Status.OK, length), seg.view[offset:offset + length]])
        elif op == Op.WRITE:
            recv_exactly(sock, seg.view[offset:offset + length])  # straight into the segment
            send_all(sock, [pack_response(Status.OK, 0)])
        else:
            body = bytearray(length)
            recv_exactly(sock, memoryview(body))
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
            recv_exactly(sock, scratch[:n])
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
            send_all(sock, [pack_response(Status.OK, len(reply)), reply])


__all__ = ["DataServer", "ControlHandler", "MAX_SERVER_CONNECTIONS"]
