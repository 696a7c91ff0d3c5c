"""The store across nodes (Mooncake paper 3.2.2): read, copy and move blocks between pools.

Each node's DRAM pool is registered with the transfer engine as one segment.
KV bytes only ever travel by transfer-engine READs, and always into memory of
the node doing the read: a peer never writes into another node's pool, so a
late or buggy writer can never overwrite a block someone else is serving.
Small control messages (which keys, where, leases) go over the cluster's
control RPC (`ControlServer` / `ControlClient`, JSON; keys as hex strings).

Reading blocks held by node H (what a prefill node does on a remote prefix hit):
  1. `store.locate` on H: H brings the blocks into DRAM if they are on SSD,
     leases them (pinned, so their slots are not reused) and answers
     (segment, offset, length) per key, the lease id and its transfer engine's
     instance; the reader learns H's segment descriptor once (`store.describe`) and
     again when a locate names another segment or instance (H restarted at the same
     control address: a new data port and access key);
  2. the reader READs them through the transfer engine, in one batch, directly
     into its destination (engine pages, or slots of its own pool);
  3. `store.release` on H: if the lease had expired first, the bytes read may
     belong to other blocks, so the reader discards them (never returns them).

Reading a byte range of blocks (`get_ranges`, what a CPP stage does: it needs only its
layers' bytes `[start, stop)` of a full block, cluster/cpp/stage_prefix.py): the same steps,
with `range` in `store.locate`; H checks the range lies within its blocks and answers
each location narrowed to it, so the reader is granted, and READs, only those bytes of
each leased block. A range outside the block is refused (ValueError); a key H does not
hold gets no lease and is not read.

Storing blocks on node D ("put against another node's pool"), replicating
blocks from S to D, or moving them: D runs `store.fetch` with S as the source,
i.e. steps 1-3 with D as the reader and its own pool slots as the destination
(`BlockStore.put_from`). A move is a fetch followed by `store.remove` on S.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mooncaked import failpoints
from mooncaked.wire.errors import ClusterError
from mooncaked.wire.rpc import ControlClient, ControlServer
from mooncaked.wire.messages import MessageError, hex_keys, unhex_keys
from mooncaked.log import get_logger
from mooncaked.transfer import TransferEngine, TransferOp, TransferRequest

from .store import BlockStore, as_u8
from .types import BlockPinned, LeaseExpired, PutResult, PutStatus

log = get_logger(__name__)

PREFIX = "store."


def _unhex(payload: Any, field: str = "keys") -> list[bytes]:
    """The hex block keys of payload[field]. Raises: ValueError (MessageError) otherwise."""
    if not isinstance(payload, dict):
        raise MessageError("payload must be a JSON object")
    return list(unhex_keys(payload.get(field), field))


def _result_json(r: PutResult) -> dict:
    return {"status": r.status.value, "tier": r.tier, "reason": r.reason}


def _result_from_json(d: dict) -> PutResult:
    return PutResult(PutStatus(d["status"]), d.get("tier"), d.get("reason", ""))


class StoreNode:
    """This node's `BlockStore`, reachable by peers and able to reach theirs.

    Args:
        store: the local store (started).
        engine: the process's transfer engine (started); the store's DRAM pool is
            registered on it as segment `store.dram.segment` by `start()`.
        control: client for peers' control servers.
        address: "host:port" of this node's control server (peers fetch from it).
    Server side: `add_handlers(server)` registers the `store.*` control methods.
    Client side: `query`, `get_many`, `get_ranges`, `fetch`, `put_many`, `copy`, `move`, each
    taking a peer's control address.
    """

    def __init__(self, store: BlockStore, engine: TransferEngine, control: ControlClient,
                 address: str = ""):
        self.store = store
        self.engine = engine
        self.control = control
        self.address = address
        self.descriptor: dict | None = None
        # addr -> (segment, block_bytes, instance): the instance changes on every start of
        # the peer's transfer engine (its data port and access key with it)
        self._peers: dict[str, tuple[str, int, str]] = {}
        self.remote_reads_discarded = 0  # READs thrown away because their lease expired

    def start(self) -> dict:
        """Registers the DRAM pool with the transfer engine; returns its descriptor."""
        if self.descriptor is None:
            self.descriptor = self.engine.register_segment(self.store.dram.segment,
                                                           self.store.dram.buffer, "cpu:0")
        return self.descriptor

    def close(self) -> None:
        """Withdraws the pool's segment (later peer reads are refused)."""
        if self.descriptor is not None:
            self.engine.unregister_segment(self.store.dram.segment)
            self.descriptor = None

    # ------------------------------------------------------------------ server side

    def add_handlers(self, server: ControlServer) -> None:
        """Registers store.describe, query, locate, release, fetch, remove, inventory."""
        for name in ("describe", "query", "locate", "release", "fetch", "remove", "inventory"):
            server.add_handler(PREFIX + name, getattr(self, "_h_" + name))

    async def _h_describe(self, payload: Any) -> dict:
        return {"node": self.store.node_id, "block_bytes": self.store.block_bytes,
                "segment": self.start()}

    async def _h_query(self, payload: Any) -> dict:
        keys = _unhex(payload)
        return {"tiers": [self.store.tier_of(k) for k in keys],
                "prefix": self.store.longest_prefix(keys)}

    async def _h_locate(self, payload: Any) -> dict:
        failpoints.hit("store.locate")
        keys = _unhex(payload)
        ttl = payload.get("ttl_s")
        a, b = self._range(payload.get("range"))
        locs, lease = await self.store.locate_many(keys, None if ttl is None else float(ttl))
        self.store.metrics.served += sum(loc is not None for loc in locs)
        return {"lease": lease.id, "segment": self.store.dram.segment,
                "instance": self.start()["instance"],
                "locations": [None if loc is None else [loc.offset + a, b - a] for loc in locs]}

    def _range(self, span: Any) -> tuple[int, int]:
        """The byte range [a, b) of each block a locate grants: all of it without `span`.
        Raises: ValueError for a range that is not 0 <= a < b <= block_bytes."""
        if span is None:
            return 0, self.store.block_bytes
        if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)
                and 0 <= span[0] < span[1] <= self.store.block_bytes):
            raise ValueError(f"range must be [start, stop) bytes within a block of "
                             f"{self.store.block_bytes} bytes, got {span!r}")
        return span[0], span[1]

    async def _h_release(self, payload: Any) -> dict:
        if not isinstance(payload, dict) or not isinstance(payload.get("lease"), int):
            raise ValueError("payload must be {'lease': <int>}")
        lease = self.store.lease_by_id(payload["lease"])
        if lease is None:  # expired (or unknown): the reader must discard its bytes
            return {"expired": True}
        try:
            self.store.release(lease)
        except Exception:  # LeaseExpired: the deadline passed before this release
            return {"expired": True}
        return {"expired": False}

    async def _h_fetch(self, payload: Any) -> dict:
        keys = _unhex(payload)
        source = payload.get("source")
        if not isinstance(source, str) or not source:
            raise ValueError("fetch needs 'source': the control address of the holder")
        results = await self.fetch(source, keys)
        return {"results": [_result_json(r) for r in results]}

    async def _h_remove(self, payload: Any) -> dict:
        out = []
        for key in _unhex(payload):
            try:
                out.append("removed" if await self.store.remove(key) else "absent")
            except BlockPinned:
                out.append("pinned")
        return {"results": out}

    async def _h_inventory(self, payload: Any) -> dict:
        inv = self.store.inventory()
        return {"node": inv.node_id, "seq": inv.seq,
                "tiers": {tier: hex_keys(keys) for tier, keys in inv.tiers.items()}}

    # ------------------------------------------------------------------ client side

    async def _segment_of(self, addr: str, same_blocks: bool = True) -> str:
        """The DRAM segment of the node at `addr`, learnt once (store.describe). With
        `same_blocks`, raises ValueError when its blocks differ in size from this node's
        (a ranged read takes part of a block of any size)."""
        return (await self._peer_of(addr, same_blocks))[0]

    async def _peer_of(self, addr: str, same_blocks: bool = True) -> tuple[str, int, str]:
        """(segment, block_bytes, transfer-engine instance) of the node at `addr`, learnt
        once (store.describe); raises as `_segment_of`."""
        known = self._peers.get(addr)
        if known is None:
            d = await self.control.call(addr, PREFIX + "describe")
            name = self.engine.add_peer_segment(d["segment"])
            known = self._peers[addr] = (name, d["block_bytes"], d["segment"]["instance"])
        if same_blocks and known[1] != self.store.block_bytes:
            raise ValueError(f"peer {addr} stores blocks of {known[1]} bytes, "
                             f"this node {self.store.block_bytes}")
        return known

    async def query(self, addr: str, keys: Sequence[bytes]) -> tuple[list[str | None], int]:
        """Which tier of node `addr` holds each key, and its longest held prefix of `keys`."""
        r = await self.control.call(addr, PREFIX + "query", {"keys": hex_keys(keys)})
        return r["tiers"], r["prefix"]

    async def _read_remote(self, addr: str, keys: Sequence[bytes], views: Sequence[Any],
                           ttl_s: float | None, span: tuple[int, int] | None = None) -> list[str]:
        """Steps 1-3 of the module doc: per key "" if `views[i]` now holds block keys[i]
        (with `span`, bytes [start, stop) of it), else the reason. Never returns bytes read
        under an expired lease."""
        segment, _, seen = await self._peer_of(addr, span is None)
        payload: dict = {"keys": hex_keys(keys)}
        if ttl_s is not None:
            payload["ttl_s"] = ttl_s
        if span is not None:
            payload["range"] = list(span)
        loc = await self.control.call(addr, PREFIX + "locate", payload)
        instance = loc.get("instance", seen)     # absent from an older peer: the name decides
        if loc["segment"] != segment or instance != seen:
            # the peer restarted since it was described (at the same control address): under
            # another segment name, or the same name on a new transfer engine, whose data
            # port and access key the learnt descriptor does not have. Describe it again.
            if self._peers.get(addr, (None, 0, None))[2] == seen:
                self._peers.pop(addr, None)      # (unless a concurrent read did already)
            segment, _, seen = await self._peer_of(addr, span is None)
            if loc["segment"] != segment or instance != seen:
                # restarted again between the locate and the describe: the lease was the
                # old process's, so read nothing (and release nothing: the id is not ours)
                return [f"{addr} restarted during the read"] * len(keys)
        reasons = ["not held by " + addr] * len(keys)
        reqs, idx = [], []
        for i, (where, view) in enumerate(zip(loc["locations"], views)):
            if where is not None:
                offset, length = where
                if length != view.nbytes:    # the holder answered another range: read nothing
                    reasons[i] = f"{addr} located {length} bytes, {view.nbytes} asked"
                    continue
                reqs.append(TransferRequest(TransferOp.READ, loc["segment"], offset, view, 0,
                                            length))
                idx.append(i)
        statuses = []
        try:
            if reqs:
                statuses = await self.engine.transfer(reqs, check=False)
        finally:
            rel = await self.control.call(addr, PREFIX + "release", {"lease": loc["lease"]})
        if rel["expired"]:
            self.remote_reads_discarded += len(reqs)
            log.warning("remote_read_lease_expired", peer=addr, blocks=len(reqs))
            for i in idx:
                reasons[i] = "lease expired before the read finished"
            return reasons
        for i, st in zip(idx, statuses):
            reasons[i] = "" if st.done else f"transfer failed: {st.reason}"
        return reasons

    async def get_many(self, addr: str, keys: Sequence[bytes], dsts: Sequence[Any],
                       ttl_s: float | None = None) -> list[bool]:
        """Reads blocks held by node `addr` into `dsts` (block_bytes each, writable; e.g.
        engine pages). True per block read under a valid lease; a False entry's
        buffer may hold garbage. Raises: ValueError for bad buffers; RpcError,
        PeerUnavailable or RpcTimeout when the peer's control channel fails."""
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} buffers")
        views = []
        for d in dsts:
            v = as_u8(d, writable=True)
            if v.nbytes != self.store.block_bytes:
                raise ValueError(f"a block is {self.store.block_bytes} bytes, got {v.nbytes}")
            views.append(v)
        reasons = await self._read_remote(addr, keys, views, ttl_s)
        return [not r for r in reasons]

    async def get_ranges(self, addr: str, keys: Sequence[bytes], start: int, stop: int,
                         dsts: Sequence[Any], ttl_s: float | None = None) -> list[bool]:
        """Reads bytes [start, stop) of each block keys[i] held by node `addr` into dsts[i]
        (stop - start bytes each, writable): a CPP stage's layers of full blocks
        (cluster/cpp/stage_prefix.py). Only those bytes are located, leased and READ. True per
        block read under a valid lease; a False entry's buffer may hold garbage.
        Raises: ValueError for bad buffers or range; RpcError when the holder refuses the
            range (outside its blocks); PeerUnavailable or RpcTimeout when its control
            channel fails."""
        if len(keys) != len(dsts):
            raise ValueError(f"{len(keys)} keys but {len(dsts)} buffers")
        if not 0 <= start < stop:
            raise ValueError(f"byte range must be 0 <= start < stop, got [{start}, {stop})")
        views = []
        for d in dsts:
            v = as_u8(d, writable=True)
            if v.nbytes != stop - start:
                raise ValueError(f"a range of {stop - start} bytes needs buffers of that size, "
                                 f"got {v.nbytes}")
            views.append(v)
        reasons = await self._read_remote(addr, keys, views, ttl_s, (start, stop))
        return [not r for r in reasons]

    async def fetch(self, addr: str, keys: Sequence[bytes], ttl_s: float | None = None
                    ) -> list[PutResult]:
        """Copies blocks held by node `addr` into this node's store (a replica): READ
        straight into reserved slots of this pool. One PutResult per key (EXISTS if
        held here already; FAILED with the reason if `addr` lacks it, the transfer
        failed or its lease expired)."""
        async def fill(todo: list[bytes], views: list[np.ndarray]) -> list[str]:
            return await self._read_remote(addr, todo, views, ttl_s)
        return await self.store.put_from(keys, fill)

    async def put_many(self, addr: str, keys: Sequence[bytes], srcs: Sequence[Any]
                       ) -> list[PutResult]:
        """Stores blocks on node `addr`: puts them here, then has `addr` fetch them from
        this node. One PutResult per key, as `addr` reports it (FAILED here if this
        node could not hold the block in DRAM for the transfer).
        Raises: ValueError if this node has no control address (`address`)."""
        if not self.address:
            raise ValueError("StoreNode.address is needed for peers to fetch from this node")
        local = await self.store.put_many(keys, srcs)
        # Pin them: a block sitting on SSD is promoted by locate; a lease keeps all of
        # them here until the peer has read them.
        lease = self.store.lease(keys)
        try:
            sendable = [k for k, r in zip(keys, local) if r.ok]
            remote = await self.copy(self.address, addr, sendable) if sendable else []
        finally:
            try:
                self.store.release(lease)
            except LeaseExpired:  # only kept the blocks here; the peer's own lease guarded its read
                pass
        by_key = dict(zip(sendable, remote))
        return [by_key.get(k, r) for k, r in zip(keys, local)]

    async def copy(self, src: str, dst: str, keys: Sequence[bytes]) -> list[PutResult]:
        """Replicates blocks from node `src` to node `dst` (dst reads from src); what the
        conductor calls to add replicas of hot blocks. One PutResult per key, from dst."""
        r = await self.control.call(dst, PREFIX + "fetch", {"source": src, "keys": hex_keys(keys)})
        return [_result_from_json(d) for d in r["results"]]

    async def move(self, src: str, dst: str, keys: Sequence[bytes]) -> list[PutResult]:
        """Copies blocks from `src` to `dst`, then removes from `src` those that `dst`
        now holds (blocks pinned at `src` stay there as extra replicas)."""
        results = await self.copy(src, dst, keys)
        done = [k for k, r in zip(keys, results) if r.ok]
        if done:
            try:
                await self.control.call(src, PREFIX + "remove", {"keys": hex_keys(done)})
            except ClusterError as e:
                log.warning("move_remove_failed", src=src, blocks=len(done), error=str(e))
        return results
