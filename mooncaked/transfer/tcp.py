"""TCP transport: the data server plus sliced, pipelined or threaded client paths.

Always available (RDMA falls back to it, and carries its control channel on it). Per
peer, `connections_per_peer` paths of each kind, pooled in the engine's EndpointPool:

- ("tcp", host, port, i): pipelined TcpEndpoints on the event loop, for slices under
  BULK_MIN_BYTES and for control requests (path 0); a slice takes the least-loaded one
  (a path not yet connected counts as idle, so the first slices open all of them);
- ("bulk", host, port, i): BlockingEndpoints driven from the engine's worker threads,
  one slice each, at most `connections_per_peer` slices per peer at once.

A request is cut into `slice_size_bytes` slices (slicing.run_sliced): small slices are
pipelined, bulk ones run as tasks. A slice whose path broke (reset, EOF, protocol error)
drops that endpoint and the peer's other idle ones (a peer that died or restarted leaves
them all stale) and moves to another path, ATTEMPTS paths at most; a refusal is final.
A cancelled slice (timeout, close) closes the connection that still owes its answer, so
no late byte touches the caller's buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from functools import partial
from typing import Any, Callable

from mooncaked.config import TransferSettings
from mooncaked.log import get_logger

from .pool import EndpointPool
from .protocol import Op, ProtocolError, Refused
from .segment import LocalSegment, PeerSegment
from .slicing import run_sliced
from .tcp_endpoint import BlockingEndpoint, TcpEndpoint
from .tcp_server import ControlHandler, DataServer
from .transport import (ATTEMPTS, BULK_MIN_BYTES, Progress, Transport, refused,
                        unreachable)

log = get_logger(__name__)

_PATH_ERRORS = (OSError, ConnectionError, ProtocolError)  # a broken path: try another


class TcpTransport(Transport):
    """Moves slices over TCP connections to peers' data servers, and serves this node's
    segments to them.

    Args:
        settings: the `[transfer]` section (host/port of the server, connections_per_peer,
            slice_size_bytes, request_timeout_s).
        pool: the engine's endpoint pool.
        io: worker threads for bulk slices (owned by the engine).
        lookup: segment name -> LocalSegment or None (called from server threads).
    """

    name = "tcp"

    def __init__(self, settings: TransferSettings, pool: EndpointPool,
                 io: concurrent.futures.Executor, lookup: Callable[[str], LocalSegment | None]):
        super().__init__(pool, settings.slice_size_bytes)
        self._paths = settings.connections_per_peer
        self._timeout = settings.request_timeout_s
        self._io = io
        self._turn = itertools.count()
        self._bulk_slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self.server = DataServer(settings.host, settings.port, lookup,
                                 control_timeout_s=settings.request_timeout_s)

    def serve_control(self, handler: ControlHandler) -> None:
        """Hands RDMA_CONNECT/RDMA_DISCONNECT requests to `handler` (call before `start`)."""
        self.server.control = handler

    async def start(self) -> None:
        """Starts the data server. Raises OSError when its address cannot be bound."""
        await self.server.start()

    @property
    def port(self) -> int:
        """The data server's port (known after `start`)."""
        return self.server.port

    async def close(self) -> None:
        """Stops the data server (drops its connections, joins its threads)."""
        await self.server.close()

    def drop_paths(self, peer: PeerSegment) -> int:
        """Drops every pooled connection to `peer`'s address; returns how many."""
        return self.pool.drop_where(lambda k: k[0] in ("tcp", "bulk") and k[1:3] == peer.address)

    def stats(self) -> dict:
        """slices_retried and requests_refused_by_server (refusals by our data server)."""
        return {"slices_retried": self.slices_retried,
                "requests_refused_by_server": self.server.refused}

    async def transfer(self, peer: PeerSegment, read: bool, view: memoryview,
                       remote_offset: int, progress: Progress) -> None:
        """A request in slice_size_bytes slices: pipelined when they are small, else one
        bulk slice per task. Raises TransferError."""
        pipeline = _Pipelined(self, peer, read) if self.slice_size < BULK_MIN_BYTES else None
        await run_sliced(view, remote_offset, self.slice_size, partial(self.move_slice, peer, read),
                         progress, pipeline)


    async def control(self, peer: PeerSegment, op: Op, body: dict) -> dict:
        """One control request (RDMA queue-pair setup) over path 0 to `peer`; returns the
        peer's JSON answer. Raises Refused, ConnectionError/OSError, ProtocolError."""
        pkey = ("tcp", peer.host, peer.port, 0)
        ep = self.pool.get(pkey, lambda: TcpEndpoint(peer.host, peer.port))
        try:
            return await ep.control(op, peer.name.encode(), peer.access_key, body)
        except _PATH_ERRORS:
            self.pool.drop(pkey, ep)
            raise

    # ------------------------------------------------------------------ paths

    def _path(self, peer: PeerSegment) -> tuple[tuple, TcpEndpoint]:
        """The least-loaded of the peer's pipelined paths (ties rotate)."""
        n = self._paths
        start = next(self._turn)
        best: tuple[tuple, TcpEndpoint] | None = None
        for j in range(n):
            key = ("tcp", peer.host, peer.port, (start + j) % n)
            ep = self.pool.get(key, lambda: TcpEndpoint(peer.host, peer.port))
            if ep.load == 0:
                return key, ep
            if best is None or ep.load < best[1].load:
                best = (key, ep)
        return best

    def _path_failed(self, peer: PeerSegment, key: tuple, ep: Any, error: BaseException) -> None:
        self.slices_retried += 1
        self.pool.drop(key, ep)
        # The peer may have died or restarted: its other idle connections are stale too.
        self.pool.drop_where(lambda k: k[0] in ("tcp", "bulk") and k[1:3] == key[1:3],
                             idle_only=True)
        log.debug("tcp_path_failed", peer=f"{peer.host}:{peer.port}", path=key[3],
                  error=repr(error))

    # ------------------------------------------------------------------ slices

    async def move_slice(self, peer: PeerSegment, read: bool, part: memoryview,
                         remote_offset: int, attempts: int = ATTEMPTS,
                         last_error: BaseException | None = None) -> None:
        """One slice (bulk when >= BULK_MIN_BYTES) on the least-loaded path, retried on
        another when the path breaks, `attempts` paths in all (`last_error`: why an earlier
        path broke). Raises TransferError (refused, or unreachable)."""
        if part.nbytes >= BULK_MIN_BYTES:
            await self._bulk_slice(peer, read, part, remote_offset, attempts, last_error)
            return
        op = Op.READ if read else Op.WRITE
        for _ in range(attempts):
            self.check_open()
            pkey, ep = self._path(peer)
            fut = None
            try:
                fut = await ep.submit(op, peer.name.encode(), peer.access_key, remote_offset,
                                      part)
                await fut
                return
            except Refused as e:
                raise refused(peer, e) from None
            except _PATH_ERRORS as e:
                last_error = e
                self._path_failed(peer, pkey, ep, e)
            except asyncio.CancelledError:
                if fut is not None and not fut.done():
                    fut.cancel()
                    self.pool.drop(pkey, ep)  # its answer would still touch `part`
                raise
        raise unreachable(peer, last_error)

    async def _bulk_slice(self, peer: PeerSegment, read: bool, part: memoryview,
                          remote_offset: int, attempts: int = ATTEMPTS,
                          last_error: BaseException | None = None) -> None:
        """One bulk slice on an idle blocking connection, run in a worker thread; at most
        connections_per_peer at once per peer."""
        n = self._paths
        slots = self._bulk_slots.get(peer.address)
        if slots is None:
            slots = self._bulk_slots[peer.address] = asyncio.Semaphore(n)
        op = Op.READ if read else Op.WRITE
        name = peer.name.encode()
        async with slots:
            for _ in range(attempts):
                self.check_open()
                pkey, ep = None, None
                for i in range(n):  # the semaphore guarantees an idle path
                    pkey = ("bulk", peer.host, peer.port, i)
                    ep = self.pool.get(pkey, lambda: BlockingEndpoint(peer.host, peer.port,
                                                                      self._timeout))
                    if ep.users == 0:
                        break
                ep.users += 1
                job = self._io.submit(ep.call, op, name, peer.access_key, remote_offset, part)
                try:
                    await asyncio.wrap_future(job)
                    return
                except Refused as e:
                    raise refused(peer, e) from None
                except _PATH_ERRORS as e:
                    last_error = e
                    self._path_failed(peer, pkey, ep, e)
                except asyncio.CancelledError:
                    # Stop the thread before giving the caller's buffer back (it would
                    # otherwise keep reading into / sending from it).
                    ep.close("request cancelled")
                    concurrent.futures.wait([job], timeout=1.0)
                    self.pool.drop(pkey, ep)
                    raise
                finally:
                    ep.users -= 1
        raise unreachable(peer, last_error)


class _Pipelined:
    """The pipelined small slices of one request (slicing.Pipeline): each is queued on the
    least-loaded connection, then its answer awaited; a broken path's slice is retried."""

    __slots__ = ("tcp", "peer", "read")

    def __init__(self, tcp: TcpTransport, peer: PeerSegment, read: bool):
        self.tcp, self.peer, self.read = tcp, peer, read

    async def post(self, part: memoryview, remote_offset: int) -> tuple:
        """(path key, endpoint, answer future or the dial's error)."""
        peer = self.peer
        pkey, ep = self.tcp._path(peer)
        try:
            fut = await ep.submit(Op.READ if self.read else Op.WRITE, peer.name.encode(),
                                  peer.access_key, remote_offset, part)
        except (OSError, ConnectionError) as e:
            fut = e
        return pkey, ep, fut

    async def finish(self, ticket: tuple, part: memoryview, remote_offset: int,
                     retry: bool) -> None:
        """Awaits the answer; on a broken path, retries on ATTEMPTS - 1 other paths when
        `retry`. Raises TransferError."""
        pkey, ep, fut = ticket
        try:
            if isinstance(fut, BaseException):
                raise fut
            await fut
        except Refused as e:
            raise refused(self.peer, e) from None
        except _PATH_ERRORS as e:
            self.tcp._path_failed(self.peer, pkey, ep, e)
            if not retry:
                raise unreachable(self.peer, e) from None
            await self.tcp.move_slice(self.peer, self.read, part, remote_offset, ATTEMPTS - 1, e)

    def abandon(self, ticket: tuple) -> None:
        """Cancels an answer still owed and drops the connection that carries it."""
        pkey, ep, fut = ticket
        if isinstance(fut, asyncio.Future) and not fut.done():
            fut.cancel()
            self.tcp.pool.drop(pkey, ep)


__all__ = ["TcpTransport"]
