"""The transfer engine: one per process; segments, peers and the batch API over transports.

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

The engine keeps the segments (local and peers'), the batches and each request's
deadline; it hands every request on a peer's segment to its transport (transport.py:
RDMA when the host has a usable device, which falls back to TCP, else TCP), which
slices it over paths and retries broken ones; a request on a local segment is a memcpy
(local.py). Every request (slices and retries together) finishes within
transfer.request_timeout_s of its submission: a dead peer fails the batch with a clear
reason, and the engine stays usable.
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

from mooncaked.config import TransferSettings
from mooncaked.log import get_logger

from .bandwidth import BandwidthMeter
from .batch import (Batch, TransferError, TransferOp, TransferRequest, TransferState,
                    TransferStatus, UnknownSegmentError, _Entry)
from .local import copy_local
from .pool import EndpointPool
from .rdma import RdmaTransport, open_rdma
from .segment import (LocalSegment, PeerSegment, as_byte_view, buffer_address, check_location,
                      check_name, make_descriptor, parse_descriptor)
from .tcp import TcpTransport
from .topology import SYSFS_INFINIBAND
from .transport import Transport

log = get_logger(__name__)

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

    Attributes: `backend` ("rdma" or "tcp", after `start`), `rdma_unavailable_reason`
    (why RDMA is not used, "" otherwise), `bytes_moved` (bytes of completed requests),
    `bandwidth` (bandwidth.BandwidthMeter: what each peer path delivered to the requests
    this engine started, READs and WRITEs together, per peer node id).
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
        self._pool = EndpointPool(self.settings.max_endpoints)
        self._tcp: TcpTransport | None = None
        self._transport: Transport | None = None  # the preferred one; RDMA falls back to TCP
        self._transports: list[Transport] = []
        self._tasks: set[asyncio.Task] = set()
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._started = False
        self._closed = False
        self.bytes_moved = 0
        self.bandwidth = BandwidthMeter()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Opens the RDMA transport (when configured and possible) and the TCP one (its data
        server starts listening).

        Raises: RdmaUnavailable when transfer.require_rdma is set and RDMA is not usable
        (the reason says why, e.g. "no RDMA device found"); OSError when the data server's
        address cannot be bound; ValueError for a malformed nic_topology.
        """
        if self._started:
            return
        io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="transfer-io")
        tcp = TcpTransport(self.settings, self._pool, io, self._segments.get)
        rdma: RdmaTransport | None = None
        try:
            rdma, self.rdma_unavailable_reason = open_rdma(
                self.settings, self._pool, tcp, instance=self.instance, sysfs_root=self._sysfs_root)
            await tcp.start()
        except BaseException:
            if rdma is not None:
                await rdma.close()
            io.shutdown(wait=False)
            raise
        self._io, self._tcp = io, tcp
        self._transports = [rdma, tcp] if rdma is not None else [tcp]
        self._transport = self._transports[0]
        self.backend = self._transport.name
        self._started = True
        log.info("transfer_engine_started", node=self.node_id, backend=self.backend,
                 host=self.advertise_host, port=tcp.port)

    async def close(self) -> None:
        """Fails pending transfers ("engine closed"), stops the server, drops every endpoint."""
        if self._closed:
            return
        self._closed = True
        for t in self._transports:
            t.closing = True  # slices still running stop retrying
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.close_all()  # wakes bulk slices blocked in worker threads
        if self._io is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._io.shutdown, True)
        for t in reversed(self._transports):  # TCP (the data server) first, then RDMA
            await t.close()

    async def __aenter__(self) -> "TransferEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def advertise_host(self) -> str:
        """The address written into descriptors (transfer.advertise_host, else host)."""
        return self.settings.advertise_host or self.settings.host

    @property
    def port(self) -> int:
        """The data server's port (known after `start`; 0 before)."""
        return self._tcp.port if self._tcp is not None else 0

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
        for t in self._transports:
            t.register(seg)
        self._segments[name] = seg
        log.debug("segment_registered", segment=name, bytes=seg.length, location=location)
        return self.segment_descriptor(name)

    def unregister_segment(self, name: str) -> None:
        """Withdraws segment `name`: later peer requests for it are refused.

        Raises: UnknownSegmentError when no such local segment exists.
        """
        seg = self._segments.pop(name, None)
        if seg is None:
            raise UnknownSegmentError(f"no local segment {name!r}")
        for t in self._transports:
            t.unregister(seg)
        log.debug("segment_unregistered", segment=name)

    def segment_descriptor(self, name: str) -> dict:
        """The publishable descriptor (plain, JSON-safe dict) of local segment `name`:
        node, instance, host, port, length (bytes), location, access key, transports, RDMA
        NICs.

        Raises: UnknownSegmentError.
        """
        seg = self._segments.get(name)
        if seg is None:
            raise UnknownSegmentError(f"no local segment {name!r}")
        nics = [n for t in self._transports for n in t.segment_nics(seg)]
        return make_descriptor(seg, node=self.node_id, instance=self.instance,
                               host=self.advertise_host, port=self.port, nics=nics)

    def add_peer_segment(self, descriptor: dict) -> str:
        """Learns a peer's segment from its descriptor (replacing an older one of that name;
        when the peer restarted or moved, its stale paths are dropped). Returns the name.

        Raises: ValueError for a malformed descriptor or a name registered locally.
        """
        peer = parse_descriptor(descriptor)
        if peer.name in self._segments:
            raise ValueError(f"segment {peer.name!r} is registered in this engine")
        old = self._peers.get(peer.name)
        self._peers[peer.name] = peer
        if old is not None and (old.instance != peer.instance or old.address != peer.address):
            n = sum(t.drop_paths(old) for t in self._transports)
            if n:
                log.info("peer_paths_dropped", node=old.node, endpoints=n)
        return peer.name

    def peer_segment_names(self) -> list[str]:
        """The names of the peers' segments this engine knows (add_peer_segment), sorted."""
        return sorted(self._peers)

    def remove_peer_segment(self, name: str) -> None:
        """Forgets a peer's segment. Raises UnknownSegmentError."""
        if self._peers.pop(name, None) is None:
            raise UnknownSegmentError(f"no peer segment {name!r}")

    async def open_segment(self, name: str, *, refresh: bool = False) -> dict:
        """Looks segment `name` up (local, known peers, then the resolver) and returns
        {name, length (bytes), location, local, node}. With `refresh`, asks the resolver
        again.

        Raises: UnknownSegmentError when nobody knows the name; ValueError when the
        resolver's descriptor is malformed.
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
        """A new batch id holding at most `batch_size` requests (0: unbounded).

        Raises: ValueError for a negative batch_size.
        """
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
        for entry, target, view in batch.admit(requests, self._segments.get, self._target):
            task = loop.create_task(self._run(batch, entry, target, view))
            entry.task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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

        Entries fail on their own within transfer.request_timeout_s; `timeout` (seconds)
        bounds this wait only (asyncio.TimeoutError, the batch keeps running).
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
        runs = [self._run(batch, e, t, v) for e, t, v in batch.admit(requests, self._segments.get, self._target)]
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
        """Counters for the inspection API and benchmarks (bytes_moved in bytes)."""
        out = {"backend": self.backend, "rdma_nics": [], "segments": len(self._segments),
               "peer_segments": len(self._peers), "batches": len(self._batches),
               "inflight_requests": len(self._tasks), "endpoints": len(self._pool),
               "endpoints_made": self._pool.made, "endpoints_evicted": self._pool.evicted,
               "endpoints_dropped": self._pool.dropped, "slices_retried": 0,
               "bytes_moved": self.bytes_moved, "requests_refused_by_server": 0}
        for t in self._transports:
            for key, value in t.stats().items():
                out[key] += value
        return out

    # ------------------------------------------------------------------ execution

    def _target(self, name: str) -> LocalSegment | PeerSegment | None:
        return self._segments.get(name) or self._peers.get(name)

    async def _run(self, batch: Batch, entry: _Entry, target: LocalSegment | PeerSegment,
                   view: memoryview) -> None:
        req = entry.request
        read = req.op is TransferOp.READ
        timeout = self.settings.request_timeout_s
        t0 = time.monotonic()
        peer = None if isinstance(target, LocalSegment) else target.node
        if peer is not None:
            self.bandwidth.begin(peer, t0)
        try:
            async with asyncio.timeout(timeout):
                if isinstance(target, LocalSegment):
                    await copy_local(self._io, read, target, req.remote_offset, view)
                    entry.moved = view.nbytes
                else:
                    await self._transport.transfer(target, read, view, req.remote_offset,
                                                   entry.add_moved)
            self.bytes_moved += view.nbytes
            batch.finish(entry, TransferState.DONE)
        except TimeoutError:
            where = ("this node" if isinstance(target, LocalSegment)
                     else f"node {target.node} at {target.host}:{target.port}")
            batch.finish(entry, TransferState.FAILED,
                         f"timed out after {timeout:g} s ({req.op.value} of {view.nbytes} bytes, "
                         f"segment {req.segment!r} on {where})")
        except TransferError as e:
            batch.finish(entry, TransferState.FAILED, str(e))
        except asyncio.CancelledError:
            batch.finish(entry, TransferState.FAILED, "cancelled: transfer engine closed")
            raise
        except Exception as e:  # noqa: BLE001 - report, never lose the entry
            log.error("transfer_internal_error", exc_info=True, segment=req.segment)
            batch.finish(entry, TransferState.FAILED, f"internal error: {e!r}")
        finally:
            if peer is not None:
                self.bandwidth.end(peer, time.monotonic(),
                                   view.nbytes if entry.state is TransferState.DONE else 0)
            self._pool.trim()
            if entry.state is TransferState.FAILED:
                log.warning("transfer_failed", segment=req.segment, op=req.op.value,
                            bytes=view.nbytes, reason=entry.reason,
                            elapsed_s=round(time.monotonic() - t0, 4))


__all__ = ["TransferEngine", "IO_THREADS"]
