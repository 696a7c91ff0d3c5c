"""The transfer engine: one per process; segments, peers, and the batch API over TCP or RDMA.

After the Mooncake paper, section 3.2.3 and its Listing 1::

    engine = TransferEngine(settings.transfer, node_id="node-a")
    await engine.start()
    desc = engine.register_segment("node-a/dram", pool_tensor)   # publish `desc`
    engine.add_peer_segment(desc_of_node_b)                      # handed over by the cluster
    bid = engine.allocate_batch_id(len(requests))
    engine.submit_transfer(bid, [TransferRequest(TransferOp.READ, "node-b/dram", off, buf), ...])
    statuses = await engine.wait_batch(bid)    # or poll engine.get_transfer_status(bid)
    engine.free_batch_id(bid)

or, for one request, `await engine.read("node-b/dram", off, buf)` / `engine.write(...)`.

A request is cut into slices (transfer.slice_size_bytes on TCP,
transfer.rdma_slice_size_bytes on RDMA) that run concurrently on different paths
(TCP connections, or NIC pairs chosen from the topology matrix). A slice whose path
breaks is retried on another path (RDMA falls back to TCP last); a refusal by the
peer is final. Every request (slices and retries together) finishes within
transfer.request_timeout_s of its submission: a dead peer fails the batch with a
clear reason, and the engine stays usable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import secrets
import socket
import time
from typing import Any, Awaitable, Callable

import numpy as np

from mooncaked.config import TransferSettings
from mooncaked.log import get_logger

from .batch import (Batch, TransferError, TransferOp, TransferRequest, TransferState,
                    TransferStatus, UnknownSegmentError, _Entry)
from .pool import EndpointPool
from .protocol import Op, ProtocolError
from .rdma import RdmaAccessError, RdmaBackend, RdmaEndpoint, RdmaPathError, RdmaUnavailable
from .segment import (LocalSegment, PeerSegment, as_byte_view, buffer_address, check_location,
                      check_name, make_descriptor, parse_descriptor)
from .tcp import BlockingEndpoint, DataServer, Refused, TcpEndpoint
from .topology import SYSFS_INFINIBAND

log = get_logger(__name__)

ATTEMPTS = 3  # paths tried per slice before its request fails (RDMA then also tries TCP)
BULK_MIN_BYTES = 256 * 1024  # TCP slices this large move in worker threads (GIL released)
IO_THREADS = 64  # worker threads for bulk TCP slices and large local copies, all peers together

Resolver = Callable[[str], Awaitable[dict | None]]


class TransferEngine:
    """Moves bytes between this process's buffers and named segments on peers (or locally).

    Args:
        settings: the `[transfer]` config section (defaults when None).
        node_id: this node's id, written into descriptors (default "<hostname>-<pid>").
        resolver: optional coroutine name -> descriptor dict (or None), used by
            `open_segment` for names not yet known (the cluster's metadata lookup).
        sysfs_root: where to look for RDMA NICs' NUMA nodes (tests point it elsewhere).
    """

    def __init__(self, settings: TransferSettings | None = None, *, node_id: str = "",
                 resolver: Resolver | None = None, sysfs_root: str = SYSFS_INFINIBAND):
        self.settings = settings or TransferSettings()
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
        self.instance = secrets.token_hex(8)  # changes on every start of a process
        self.backend = "tcp"
        self.rdma_unavailable_reason = ""
        self._resolver = resolver
        self._sysfs_root = sysfs_root
        self._segments: dict[str, LocalSegment] = {}
        self._peers: dict[str, PeerSegment] = {}
        self._batches: dict[int, Batch] = {}
        self._batch_ids = itertools.count(1)
        self._turn = itertools.count()
        self._pool = EndpointPool(self.settings.max_endpoints)
        self._server: DataServer | None = None
        self._rdma: RdmaBackend | None = None
        self._tasks: set[asyncio.Task] = set()
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._bulk_slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._started = False
        self._closed = False
        self.bytes_moved = 0
        self.slices_retried = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Opens the RDMA backend (when configured and possible) and starts the data server.

        Raises: RdmaUnavailable when transfer.require_rdma is set and RDMA is not usable
        (the reason says why, e.g. "no RDMA device found"); OSError when the data server's
        address cannot be bound; ValueError for a malformed nic_topology.
        """
        if self._started:
            return
        s = self.settings
        if s.backend != "tcp":
            try:
                self._rdma = RdmaBackend.open(gid_index=s.rdma_gid_index,
                                              nic_topology=s.nic_topology,
                                              max_endpoints=s.max_endpoints,
                                              sysfs_root=self._sysfs_root)
                self.backend = "rdma"
            except RdmaUnavailable as e:
                self.rdma_unavailable_reason = str(e)
                if s.require_rdma:
                    raise
                emit = log.warning if s.backend == "rdma" else log.info
                emit("rdma_unavailable", reason=str(e), using="tcp")
        elif s.require_rdma:
            raise RdmaUnavailable("transfer.require_rdma is set but transfer.backend is 'tcp'")
        control = self._rdma.handle_control if self._rdma is not None else None
        self._server = DataServer(s.host, s.port, self._segments.get, control,
                                  control_timeout_s=s.request_timeout_s)
        try:
            await self._server.start()
        except BaseException:
            if self._rdma is not None:
                self._rdma.close()
            raise
        self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS,
                                                         thread_name_prefix="transfer-io")
        self._started = True
        log.info("transfer_engine_started", node=self.node_id, backend=self.backend,
                 host=self.advertise_host, port=self._server.port)

    async def close(self) -> None:
        """Fails pending transfers ("engine closed"), stops the server, drops every endpoint."""
        if self._closed:
            return
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.close_all()  # wakes bulk slices blocked in worker threads
        if self._io is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._io.shutdown, True)
        if self._server is not None:
            await self._server.close()
        if self._rdma is not None:
            for seg in self._segments.values():
                self._rdma.unregister(seg)
            self._rdma.close()

    async def __aenter__(self) -> "TransferEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def advertise_host(self) -> str:
        return self.settings.advertise_host or self.settings.host

    @property
    def port(self) -> int:
        """The data server's port (known after `start`)."""
        return self._server.port if self._server is not None else 0

    def _check_started(self) -> None:
        if not self._started or self._closed:
            raise RuntimeError("transfer engine is not running (call `await engine.start()`)")

    # ------------------------------------------------------------------ segments

    def register_segment(self, name: str, buffer: Any, location: str = "cpu:0") -> dict:
        """Registers local memory as segment `name`, readable and writable by peers that
        hold its descriptor, and returns that descriptor (see `segment_descriptor`).

        Args:
            name: cluster-unique segment name (e.g. "<node>/dram"), at most 255 UTF-8 bytes.
            buffer: writable host memory exposing the buffer protocol (bytearray, memoryview,
                numpy array, mmap, contiguous CPU torch tensor of any dtype). It must stay
                alive and unmoved while registered; the engine keeps a view of it.
            location: its memory location, "cpu:N" (NUMA node) or "cuda:N" (picks NICs).
        Raises: RuntimeError before `start`; ValueError for a taken name, bad location or
            read-only buffer; TypeError for objects without host memory.
        """
        self._check_started()
        check_name(name)
        check_location(location)
        if name in self._segments:
            raise ValueError(f"segment {name!r} is already registered")
        view = as_byte_view(buffer, writable=True)
        seg = LocalSegment(name, view, location, address=buffer_address(view))
        if self._rdma is not None:
            self._rdma.register(seg)
        self._segments[name] = seg
        log.info("segment_registered", segment=name, bytes=seg.length, location=location)
        return self.segment_descriptor(name)

    def unregister_segment(self, name: str) -> None:
        """Withdraws segment `name`: later peer requests for it are refused.

        Raises: UnknownSegmentError when no such local segment exists.
        """
        seg = self._segments.pop(name, None)
        if seg is None:
            raise UnknownSegmentError(f"no local segment {name!r}")
        if self._rdma is not None:
            self._rdma.unregister(seg)
        log.info("segment_unregistered", segment=name)

    def segment_descriptor(self, name: str) -> dict:
        """The publishable descriptor (plain, JSON-safe dict) of local segment `name`:
        node, instance, host, port, length, location, access key, transports, RDMA NICs.

        Raises: UnknownSegmentError.
        """
        seg = self._segments.get(name)
        if seg is None:
            raise UnknownSegmentError(f"no local segment {name!r}")
        nics = self._rdma.nic_descriptors(seg) if self._rdma is not None else None
        return make_descriptor(seg, node=self.node_id, instance=self.instance,
                               host=self.advertise_host, port=self.port, nics=nics)

    def local_segments(self) -> list[str]:
        return list(self._segments)

    def add_peer_segment(self, descriptor: dict) -> str:
        """Learns a peer's segment from its descriptor (replacing an older one of that name;
        when the peer restarted, its stale connections are dropped). Returns the name.

        Raises: ValueError for a malformed descriptor or a name registered locally.
        """
        peer = parse_descriptor(descriptor)
        if peer.name in self._segments:
            raise ValueError(f"segment {peer.name!r} is registered in this engine")
        old = self._peers.get(peer.name)
        self._peers[peer.name] = peer
        if old is not None and (old.instance != peer.instance or old.address != peer.address):
            self._drop_paths(old)
        return peer.name

    def remove_peer_segment(self, name: str) -> None:
        """Forgets a peer's segment. Raises UnknownSegmentError."""
        if self._peers.pop(name, None) is None:
            raise UnknownSegmentError(f"no peer segment {name!r}")

    async def open_segment(self, name: str, *, refresh: bool = False) -> dict:
        """Looks segment `name` up (local, known peers, then the resolver) and returns
        {name, length, location, local, node}. With `refresh`, asks the resolver again.

        Raises: UnknownSegmentError when nobody knows the name.
        """
        if name in self._segments:
            seg = self._segments[name]
            return {"name": name, "length": seg.length, "location": seg.location, "local": True,
                    "node": self.node_id}
        if (refresh or name not in self._peers) and self._resolver is not None:
            desc = await self._resolver(name)
            if desc is not None:
                self.add_peer_segment(desc)
        peer = self._peers.get(name)
        if peer is None:
            raise UnknownSegmentError(f"unknown segment {name!r}")
        return {"name": name, "length": peer.length, "location": peer.location, "local": False,
                "node": peer.node}

    # ------------------------------------------------------------------ batch API

    def allocate_batch_id(self, batch_size: int = 0) -> int:
        """A new batch id holding at most `batch_size` requests (0: unbounded)."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        bid = next(self._batch_ids)
        self._batches[bid] = Batch(bid, batch_size)
        return bid

    def submit_transfer(self, batch_id: int, requests: list[TransferRequest]) -> None:
        """Starts `requests` in batch `batch_id`; returns at once (they run on the loop).

        Every request is checked first, so either all are submitted or none: a malformed one
        (bad op, negative offset, a local range past its buffer, a read-only READ target)
        raises ValueError/TypeError. A request naming an unknown segment, or a range past the
        segment's published length, is submitted but fails at once with a reason.
        Raises: KeyError for an unknown batch id; ValueError past the batch's capacity;
            RuntimeError when the engine is not running.
        """
        self._check_started()
        batch = self._batch(batch_id)
        if batch.capacity and len(batch.entries) + len(requests) > batch.capacity:
            raise ValueError(f"batch {batch_id} holds at most {batch.capacity} requests "
                             f"({len(batch.entries)} already submitted)")
        loop = asyncio.get_running_loop()
        for entry, target, view in self._admit(batch, requests):
            task = loop.create_task(self._run(batch, entry, target, view))
            entry.task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _admit(self, batch: Batch, requests: list[TransferRequest]
               ) -> list[tuple[_Entry, LocalSegment | PeerSegment, memoryview]]:
        """Validates every request (all or none), adds them to `batch`, finishes those that
        fail at once or are empty, and returns the ones to run."""
        prepared = [self._prepare(r) for r in requests]
        runs = []
        for req, view in prepared:
            entry = _Entry(req)
            batch.add(entry)
            target = self._segments.get(req.segment) or self._peers.get(req.segment)
            if target is None:
                batch.finish(entry, TransferState.FAILED,
                             f"unknown segment {req.segment!r} (add_peer_segment or open_segment "
                             "first)")
            elif req.remote_offset + view.nbytes > target.length:
                batch.finish(entry, TransferState.FAILED,
                             f"[{req.remote_offset}, {req.remote_offset + view.nbytes}) is out of "
                             f"bounds of segment {req.segment!r} ({target.length} bytes)")
            elif view.nbytes == 0:
                batch.finish(entry, TransferState.DONE)
            else:
                runs.append((entry, target, view))
        return runs

    def get_transfer_status(self, batch_id: int, index: int | None = None
                            ) -> list[TransferStatus] | TransferStatus:
        """Status of every entry of the batch (or of entry `index`), in submission order.

        Raises: KeyError for an unknown batch id; IndexError for a bad index.
        """
        batch = self._batch(batch_id)
        if index is not None:
            return batch.entries[index].status()
        return batch.statuses()

    async def wait_batch(self, batch_id: int, timeout: float | None = None
                         ) -> list[TransferStatus]:
        """Waits until no entry of the batch is pending; returns every entry's status.

        Entries fail on their own within transfer.request_timeout_s; `timeout` bounds this
        wait only (asyncio.TimeoutError, the batch keeps running).
        Raises: KeyError for an unknown batch id.
        """
        batch = self._batch(batch_id)
        await asyncio.wait_for(batch.done.wait(), timeout)
        return batch.statuses()

    def free_batch_id(self, batch_id: int) -> None:
        """Releases a finished batch id.

        Raises: KeyError for an unknown id; RuntimeError while entries are still pending.
        """
        batch = self._batch(batch_id)
        if batch.pending:
            raise RuntimeError(f"batch {batch_id} has {batch.pending} pending transfers; "
                               "await wait_batch first")
        del self._batches[batch_id]

    def _batch(self, batch_id: int) -> Batch:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise KeyError(f"unknown batch id {batch_id}") from None

    # ------------------------------------------------------------------ conveniences

    async def transfer(self, requests: list[TransferRequest], *, check: bool = True
                       ) -> list[TransferStatus]:
        """Runs `requests` as one batch in the calling task and returns their statuses.

        Raises: TransferError listing the failed entries (when `check`), plus what
        `submit_transfer` raises.
        """
        # Runs in the caller's task (no batch id, no extra task): the lowest-latency path.
        self._check_started()
        batch = Batch(0, 0)
        runs = [self._run(batch, e, t, v) for e, t, v in self._admit(batch, requests)]
        if len(runs) == 1:
            await runs[0]
        elif runs:
            await asyncio.gather(*runs)
        statuses = batch.statuses()
        if check:
            failed = [(i, s) for i, s in enumerate(statuses) if s.failed]
            if failed:
                detail = "; ".join(f"#{i}: {s.reason}" for i, s in failed[:5])
                raise TransferError(f"{len(failed)} of {len(statuses)} transfers failed: {detail}",
                                    statuses)
        return statuses

    async def read(self, segment: str, remote_offset: int, dst: Any, length: int | None = None,
                   dst_offset: int = 0) -> None:
        """READ `length` bytes (default: the rest of `dst`) at `remote_offset` of `segment`
        into writable buffer `dst` at `dst_offset`. Raises TransferError with the reason."""
        await self.transfer([TransferRequest(TransferOp.READ, segment, remote_offset, dst,
                                             dst_offset, length)])

    async def write(self, segment: str, remote_offset: int, src: Any, length: int | None = None,
                    src_offset: int = 0) -> None:
        """WRITE `length` bytes (default: the rest of `src`) of `src` from `src_offset` to
        `remote_offset` of `segment`. Raises TransferError with the reason."""
        await self.transfer([TransferRequest(TransferOp.WRITE, segment, remote_offset, src,
                                             src_offset, length)])

    def stats(self) -> dict:
        """Counters for the inspection API and benchmarks."""
        return {"backend": self.backend,
                "rdma_nics": list(self._rdma.nics) if self._rdma is not None else [],
                "segments": len(self._segments),
                "peer_segments": len(self._peers), "batches": len(self._batches),
                "inflight_requests": len(self._tasks), "endpoints": len(self._pool),
                "endpoints_made": self._pool.made, "endpoints_evicted": self._pool.evicted,
                "endpoints_dropped": self._pool.dropped, "slices_retried": self.slices_retried,
                "bytes_moved": self.bytes_moved,
                "requests_refused_by_server": self._server.refused if self._server else 0}

    # ------------------------------------------------------------------ execution

    def _prepare(self, req: TransferRequest) -> tuple[TransferRequest, memoryview]:
        """Validates a request and returns it with the local byte view it moves."""
        if not isinstance(req, TransferRequest):
            raise TypeError(f"expected TransferRequest, got {type(req).__name__}")
        if not isinstance(req.op, TransferOp):
            raise ValueError(f"op must be TransferOp.READ or TransferOp.WRITE, got {req.op!r}")
        if not isinstance(req.segment, str):
            raise TypeError(f"segment must be a name (str), got {type(req.segment).__name__}")
        for field_name in ("remote_offset", "local_offset"):
            v = getattr(req, field_name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{field_name} must be an int >= 0, got {v!r}")
        local = req.local
        if isinstance(local, str):
            seg = self._segments.get(local)
            if seg is None:
                raise ValueError(f"local buffer names no registered segment: {local!r}")
            whole = seg.view
        else:
            whole = as_byte_view(local, writable=req.op is TransferOp.READ)
        length = whole.nbytes - req.local_offset if req.length is None else req.length
        if not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an int >= 0, got {length!r}")
        if req.local_offset + length > whole.nbytes:
            raise ValueError(f"local range [{req.local_offset}, {req.local_offset + length}) "
                             f"exceeds the local buffer ({whole.nbytes} bytes)")
        return req, whole[req.local_offset:req.local_offset + length]

    async def _run(self, batch: Batch, entry: _Entry, target: LocalSegment | PeerSegment,
                   view: memoryview) -> None:
        req = entry.request
        timeout = self.settings.request_timeout_s
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                if isinstance(target, LocalSegment):
                    await self._local(req, target, view)
                    entry.moved = view.nbytes
                else:
                    await self._remote(entry, target, view)
            self.bytes_moved += view.nbytes
            batch.finish(entry, TransferState.DONE)
        except TimeoutError:
            batch.finish(entry, TransferState.FAILED,
                         f"timed out after {timeout:g} s ({req.op.value} of {view.nbytes} bytes, "
                         f"segment {req.segment!r} on {self._where(target)})")
        except TransferError as e:
            batch.finish(entry, TransferState.FAILED, str(e))
        except asyncio.CancelledError:
            batch.finish(entry, TransferState.FAILED, "cancelled: transfer engine closed")
            raise
        except Exception as e:  # noqa: BLE001 - report, never lose the entry
            log.error("transfer_internal_error", exc_info=True, segment=req.segment)
            batch.finish(entry, TransferState.FAILED, f"internal error: {e!r}")
        finally:
            self._pool.trim()
            if entry.state is TransferState.FAILED:
                log.warning("transfer_failed", segment=req.segment, op=req.op.value,
                            bytes=view.nbytes, reason=entry.reason,
                            elapsed_s=round(time.monotonic() - t0, 4))

    @staticmethod
    def _where(target: LocalSegment | PeerSegment) -> str:
        if isinstance(target, LocalSegment):
            return "this node"
        return f"node {target.node} at {target.host}:{target.port}"

    @staticmethod
    def _local_copy(req: TransferRequest, seg: LocalSegment, view: memoryview) -> None:
        region = seg.view[req.remote_offset:req.remote_offset + view.nbytes]
        dst, src = (view, region) if req.op is TransferOp.READ else (region, view)
        # numpy's copy releases the GIL for large arrays (memoryview assignment does not).
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))

    async def _local(self, req: TransferRequest, seg: LocalSegment, view: memoryview) -> None:
        """A request on a segment of this engine: a memcpy (in a worker thread when large,
        so the loop keeps running)."""
        if view.nbytes < BULK_MIN_BYTES:
            self._local_copy(req, seg, view)
            return
        job = self._io.submit(self._local_copy, req, seg, view)
        try:
            await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            concurrent.futures.wait([job])  # never hand the buffer back mid-copy
            raise

    async def _remote(self, entry: _Entry, peer: PeerSegment, view: memoryview) -> None:
        req = entry.request
        read = req.op is TransferOp.READ
        local = self._rdma_local(peer, view)
        if local is None:
            await self._tcp_request(entry, peer, read, view, req.remote_offset)
            return
        size = self.settings.rdma_slice_size_bytes
        if view.nbytes <= size:
            await self._rdma_slice(peer, read, local, view, req.remote_offset)
            entry.moved = view.nbytes
            return

        async def one(off: int) -> None:
            part = view[off:off + size]
            await self._rdma_slice(peer, read, local, part, req.remote_offset + off)
            entry.moved += part.nbytes

        try:
            async with asyncio.TaskGroup() as tg:
                for off in range(0, view.nbytes, size):
                    tg.create_task(one(off))
        except* TransferError as eg:
            raise eg.exceptions[0] from None

    # TCP -----------------------------------------------------------------

    def _tcp_path(self, peer: PeerSegment) -> tuple[tuple, TcpEndpoint]:
        """The least-loaded of the peer's TCP paths (a path not yet connected counts as
        idle, so the first slices open all of them); ties rotate."""
        n = self.settings.connections_per_peer
        start = next(self._turn)
        best: tuple[tuple, TcpEndpoint] | None = None
        for j in range(n):
            key = ("tcp", peer.host, peer.port, (start + j) % n)
            ep = self._pool.get(key, lambda: TcpEndpoint(peer.host, peer.port))
            if ep.load == 0:
                return key, ep
            if best is None or ep.load < best[1].load:
                best = (key, ep)
        return best

    def _path_failed(self, peer: PeerSegment, key: tuple, ep: TcpEndpoint | BlockingEndpoint,
                     error: BaseException) -> None:
        self.slices_retried += 1
        self._pool.drop(key, ep)
        # The peer may have died or restarted: its other idle connections are stale too.
        self._pool.drop_where(lambda k: k[0] in ("tcp", "bulk") and k[1:3] == key[1:3],
                              idle_only=True)
        log.debug("tcp_path_failed", peer=f"{peer.host}:{peer.port}", path=key[3],
                  error=repr(error))

    def _refused(self, peer: PeerSegment, e: Refused) -> TransferError:
        return TransferError(f"refused by node {peer.node} at {peer.host}:{peer.port}: {e}")

    async def _tcp_request(self, entry: _Entry, peer: PeerSegment, read: bool,
                           view: memoryview, remote_offset: int) -> None:
        """Slices the request over the peer's TCP paths (pipelined), then retries each slice
        whose path broke on another path. Raises TransferError."""
        size = self.settings.slice_size_bytes
        if view.nbytes <= size:
            await self._tcp_slice(peer, read, view, remote_offset)
            entry.moved = view.nbytes
            return
        if size >= BULK_MIN_BYTES:
            # Bulk slices: each runs (with retries) in a worker thread, several at once.
            async def one(off: int) -> None:
                part = view[off:off + size]
                await self._bulk_slice(peer, read, part, remote_offset + off)
                entry.moved += part.nbytes

            try:
                async with asyncio.TaskGroup() as tg:
                    for off in range(0, view.nbytes, size):
                        tg.create_task(one(off))
            except* TransferError as eg:
                raise eg.exceptions[0] from None
            return
        op = Op.READ if read else Op.WRITE
        name, key = peer.name.encode(), peer.access_key
        sent = []  # (offset, part, path key, endpoint, future or the dial error)
        try:
            for off in range(0, view.nbytes, size):
                part = view[off:off + size]
                pkey, ep = self._tcp_path(peer)
                try:
                    fut = await ep.submit(op, name, key, remote_offset + off, part)
                except (OSError, ConnectionError) as e:
                    fut = e
                sent.append((off, part, pkey, ep, fut))
            error: TransferError | None = None
            for off, part, pkey, ep, fut in sent:
                try:
                    if isinstance(fut, BaseException):
                        raise fut
                    await fut
                except Refused as e:
                    error = error or self._refused(peer, e)
                    continue
                except (OSError, ConnectionError, ProtocolError) as e:
                    self._path_failed(peer, pkey, ep, e)
                    if error is not None:
                        continue
                    try:
                        await self._tcp_slice(peer, read, part, remote_offset + off,
                                              ATTEMPTS - 1, e)
                    except TransferError as te:
                        error = te
                        continue
                entry.moved += part.nbytes
            if error is not None:
                raise error
        except asyncio.CancelledError:
            # Timed out or closed: the answers still owed would land in (or read from) the
            # caller's buffer later, so drop the connections that carry them.
            for _, _, pkey, ep, fut in sent:
                if isinstance(fut, asyncio.Future) and not fut.done():
                    fut.cancel()
                    self._pool.drop(pkey, ep)
            raise

    async def _tcp_slice(self, peer: PeerSegment, read: bool, part: memoryview,
                         remote_offset: int, attempts: int = ATTEMPTS,
                         last_error: BaseException | None = None) -> None:
        """One slice on the least-loaded path, retried on another when the path breaks.

        Raises: TransferError (refused, or unreachable after `attempts` paths).
        """
        if part.nbytes >= BULK_MIN_BYTES:
            await self._bulk_slice(peer, read, part, remote_offset, attempts, last_error)
            return
        op = Op.READ if read else Op.WRITE
        for _ in range(attempts):
            if self._closed:
                raise TransferError("transfer engine closed")
            pkey, ep = self._tcp_path(peer)
            fut = None
            try:
                fut = await ep.submit(op, peer.name.encode(), peer.access_key, remote_offset,
                                      part)
                await fut
                return
            except Refused as e:
                raise self._refused(peer, e) from None
            except (OSError, ConnectionError, ProtocolError) as e:
                last_error = e
                self._path_failed(peer, pkey, ep, e)
            except asyncio.CancelledError:
                if fut is not None and not fut.done():
                    fut.cancel()
                    self._pool.drop(pkey, ep)  # its answer would still touch `part`
                raise
        raise TransferError(f"node {peer.node} at {peer.host}:{peer.port} is unreachable "
                            f"(segment {peer.name!r}): {last_error!r}")

    async def _bulk_slice(self, peer: PeerSegment, read: bool, part: memoryview,
                          remote_offset: int, attempts: int = ATTEMPTS,
                          last_error: BaseException | None = None) -> None:
        """One bulk slice on an idle blocking connection, run in a worker thread; at most
        connections_per_peer at once per peer. Raises TransferError."""
        n = self.settings.connections_per_peer
        slots = self._bulk_slots.get(peer.address)
        if slots is None:
            slots = self._bulk_slots[peer.address] = asyncio.Semaphore(n)
        op = Op.READ if read else Op.WRITE
        name = peer.name.encode()
        timeout = self.settings.request_timeout_s
        async with slots:
            for _ in range(attempts):
                if self._closed:
                    raise TransferError("transfer engine closed")
                pkey, ep = None, None
                for i in range(n):  # the semaphore guarantees an idle path
                    pkey = ("bulk", peer.host, peer.port, i)
                    ep = self._pool.get(pkey, lambda: BlockingEndpoint(peer.host, peer.port,
                                                                       timeout))
                    if ep.users == 0:
                        break
                ep.users += 1
                job = self._io.submit(ep.call, op, name, peer.access_key, remote_offset, part)
                try:
                    await asyncio.wrap_future(job)
                    return
                except Refused as e:
                    raise self._refused(peer, e) from None
                except (OSError, ConnectionError, ProtocolError) as e:
                    last_error = e
                    self._path_failed(peer, pkey, ep, e)
                except asyncio.CancelledError:
                    # Stop the thread before giving the caller's buffer back (it would
                    # otherwise keep reading into / sending from it).
                    ep.close("request cancelled")
                    concurrent.futures.wait([job], timeout=1.0)
                    self._pool.drop(pkey, ep)
                    raise
                finally:
                    ep.users -= 1
        raise TransferError(f"node {peer.node} at {peer.host}:{peer.port} is unreachable "
                            f"(segment {peer.name!r}): {last_error!r}")

    def _drop_paths(self, peer: PeerSegment) -> None:
        n = self._pool.drop_where(lambda k: (k[0] in ("tcp", "bulk") and k[1:3] == peer.address)
                                  or (k[0] == "rdma" and k[1] == peer.instance))
        if n:
            log.info("peer_paths_dropped", node=peer.node, endpoints=n)

    # RDMA ----------------------------------------------------------------

    def _rdma_local(self, peer: PeerSegment, view: memoryview) -> LocalSegment | None:
        """The registered local segment holding `view` when the RDMA path applies, else None."""
        if self._rdma is None or not peer.nics or view.nbytes == 0:
            return None
        addr = buffer_address(view)
        for seg in self._segments.values():
            if seg.rdma and seg.contains(addr, view.nbytes):
                return seg
        return None

    async def _control(self, peer: PeerSegment, op: Op, body: dict) -> dict:
        """One RDMA control request over TCP path 0 to `peer`."""
        pkey = ("tcp", peer.host, peer.port, 0)
        ep = self._pool.get(pkey, lambda: TcpEndpoint(peer.host, peer.port))
        try:
            return await ep.control(op, peer.name.encode(), peer.access_key, body)
        except (OSError, ConnectionError, ProtocolError):
            self._pool.drop(pkey, ep)
            raise

    async def _rdma_slice(self, peer: PeerSegment, read: bool, local: LocalSegment,
                          part: memoryview, remote_offset: int) -> None:
        rdma = self._rdma
        laddr = buffer_address(part)
        local_nics = rdma.topology.paths(local.location)
        turn = next(self._turn)
        for attempt, nic_name in enumerate(local_nics[:ATTEMPTS]):
            if self._closed:
                raise TransferError("transfer engine closed")
            remote = peer.nics[(turn + attempt) % len(peer.nics)]
            pkey = ("rdma", peer.instance, nic_name, remote.name)
            ep = self._pool.get(pkey, lambda nic=rdma.nics[nic_name], rn=remote: RdmaEndpoint(
                nic, peer, rn, self._control, self.instance))
            ep.users += 1
            try:
                await ep.ensure_connected()
                await ep.transfer(read, laddr, local.rdma[nic_name].lkey, part.nbytes,
                                  peer.rdma_addr + remote_offset, remote.rkey)
                return
            except RdmaAccessError as e:
                self._pool.drop(pkey, ep)
                raise TransferError(f"refused by node {peer.node} ({remote.name}): {e}") from None
            except Refused as e:
                raise TransferError(f"refused by node {peer.node} at {peer.host}:{peer.port}: "
                                    f"{e}") from None
            except (RdmaPathError, OSError, ConnectionError, ProtocolError,
                    rdma.pv.errors.PyverbsError) as e:
                self.slices_retried += 1
                self._pool.drop(pkey, ep)
                log.warning("rdma_path_failed", nic=nic_name, remote_nic=remote.name,
                            node=peer.node, error=str(e))
            finally:
                ep.users -= 1
        log.warning("rdma_paths_exhausted_using_tcp", node=peer.node)
        await self._tcp_slice(peer, read, part, remote_offset)


__all__ = ["TransferEngine", "ATTEMPTS"]
