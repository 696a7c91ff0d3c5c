"""The TCP data protocol of the transfer engine, and zero-copy socket I/O for asyncio.

Wire format (all integers little-endian). On one connection the server handles
requests in order and answers each in order, so a client may pipeline several
requests and match the answers first-in, first-out.

Request: a 40-byte header, the segment name, then the body::

    u16 magic 0x434D ("MC")   u8 version (1)   u8 op
    u16 name_len              u16 flags (0)
    u64 offset                u64 length
    16B access key
    name_len bytes: segment name (UTF-8)
    body: WRITE -> `length` payload bytes; RDMA_CONNECT/RDMA_DISCONNECT -> `length` bytes of
          JSON; READ -> nothing

Response: a 16-byte header, then `length` bytes::

    u16 magic   u8 version   u8 status   u32 reserved (0)   u64 length
    status OK: READ -> the `length` bytes asked for; WRITE -> nothing (length 0);
               RDMA_* -> JSON
    status != OK: `length` bytes of UTF-8 reason; the connection stays usable.

READ and WRITE touch only [offset, offset + length) of a segment registered on the
server, and only when the key matches the segment's access key: anything else is
refused with a status and a reason, and logged. RDMA_CONNECT/RDMA_DISCONNECT are the
control channel that exchanges queue-pair attributes (they name a segment and carry
its key too, so only holders of a descriptor can make queue pairs).

Payloads never pass through a Python bytes object: receivers read straight into the
target memoryview (asyncio.BufferedProtocol, or `recv_exactly` on blocking sockets),
senders hand header + payload views to the transport's `writelines` (uvloop sends them
with one vectored write and keeps references, not copies, of what the socket cannot take
at once) or to `send_all` (one sendmsg).

Also here: the errors both ends share (`ProtocolError`, `Refused`, `ControlError`) and the
socket helpers of the data server and the blocking client.
"""

from __future__ import annotations

import enum
import socket
import struct

MAGIC = 0x434D
VERSION = 1
REQUEST = struct.Struct("<HBBHHQQ16s")
RESPONSE = struct.Struct("<HBBIQ")
MAX_CONTROL_BYTES = 1 << 20  # JSON bodies of control ops
MAX_REASON_BYTES = 4096


class Op(enum.IntEnum):
    """Request operations."""

    READ = 1
    WRITE = 2
    RDMA_CONNECT = 3
    RDMA_DISCONNECT = 4


class Status(enum.IntEnum):
    """Response statuses."""

    OK = 0
    UNKNOWN_SEGMENT = 1
    OUT_OF_BOUNDS = 2
    BAD_KEY = 3
    BAD_REQUEST = 4
    UNSUPPORTED = 5
    INTERNAL = 6


class ProtocolError(ConnectionError):
    """The peer sent bytes that are not this protocol (bad magic/version); drop the connection."""


def pack_request(op: Op, name: bytes, offset: int, length: int, key: bytes) -> bytes:
    """Request header followed by the segment name (one bytes object)."""
    return REQUEST.pack(MAGIC, VERSION, op, len(name), 0, offset, length, key) + name


def unpack_request(header: bytes | memoryview) -> tuple[int, int, int, int, bytes]:
    """(op, name_len, offset, length, key) of a request header. Raises ProtocolError."""
    magic, version, op, name_len, _flags, offset, length, key = REQUEST.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad request header (magic {magic:#x}, version {version})")
    return op, name_len, offset, length, key


def pack_response(status: Status, length: int) -> bytes:
    """Response header (16 bytes) announcing `length` bytes of answer."""
    return RESPONSE.pack(MAGIC, VERSION, status, 0, length)


def unpack_response(header: bytes | memoryview) -> tuple[int, int]:
    """(status, length) of a response header. Raises ProtocolError."""
    magic, version, status, _reserved, length = RESPONSE.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad response header (magic {magic:#x}, version {version})")
    return status, length


SOCKET_BUFFER_BYTES = 4 << 20  # send/receive buffers: a 1 MiB slice goes out in one sendmsg


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


def socket_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal (it holds a colon), else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tune_socket(sock: socket.socket, *, buffers: bool = True) -> None:
    """Non-blocking, no Nagle delay (requests are header + payload in one sendmsg), and
    large kernel buffers (SOCKET_BUFFER_BYTES each, set before connect/listen so the window
    scales to them; the kernel caps them at net.core.{r,w}mem_max). Raises OSError."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Blocking: fills `view` (view.nbytes bytes) straight from the socket; False on EOF
    before the first byte. Raises ProtocolError on EOF mid-message, OSError from the socket."""
    pos, end = 0, view.nbytes
    while pos < end:
        n = sock.recv_into(view[pos:] if pos else view)
        if n == 0:
            if pos == 0:
                return False
            raise ProtocolError(f"connection closed after {pos} of {end} bytes")
        pos += n
    return True


def send_all(sock: socket.socket, buffers: list) -> None:
    """Blocking scatter/gather send of every buffer (no joining copy). Raises OSError."""
    bufs = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers if len(b)]
    while bufs:
        n = sock.sendmsg(bufs)
        while n:
            if n >= bufs[0].nbytes:
                n -= bufs.pop(0).nbytes
            else:
                bufs[0] = bufs[0][n:]
                n = 0


__all__ = ["Op", "Status", "ProtocolError", "Refused", "ControlError", "REQUEST", "RESPONSE",
           "pack_request", "unpack_request", "pack_response", "unpack_response", "tune_socket",
           "socket_family", "recv_exactly", "send_all", "MAX_CONTROL_BYTES", "MAX_REASON_BYTES",
           "SOCKET_BUFFER_BYTES"]
