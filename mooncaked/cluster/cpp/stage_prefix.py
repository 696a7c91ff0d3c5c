"""Prefix reuse of one CPP stage beyond its pages: its own store's layer slices, then the
layers' byte range of full blocks on another node (Mooncake section 3.3 with 3.2's store).

A block is layer-major ([num_layers, 2, block_size, kv_heads, head_dim]), so the layers
start..stop of a stage are one contiguous byte range of it, `[start * L, stop * L)` with
L = 2 * block_size * kv_heads * head_dim * dtype bytes, and exactly one page of the stage
(StageEngine pages are [stage_layers, 2, block_size, kv_heads, head_dim]). The block key is
unchanged; the stage's slice of it is its own store object under
`store.keys.slice_key(key, start, stop)`.

When a request arrives with its block keys, the stage has matched its pages
(StageEngine.match); `StagePrefix.extend` then continues the prefix
1. from its own store (slices it kept of earlier requests, DRAM or SSD), and
2. from the fetch source the conductor named (a prefill, cache or decode node whose
   store holds the full blocks): a ranged READ of only its layers' bytes of each block
   (StoreNode.get_ranges, under the holder's lease),
into new pages (StageEngine.append_blocks). Whatever the stage gets counts; the request
starts after the least prefix of any stage (pipeline_stage.py). After a request, `offload`
puts the slices of its full blocks the store lacks into the store, so they outlive the
pages (which the LRU reuses): copied from the pages into the store's slots in a thread,
the pages released after the copy. The store's events carry the slice keys to the conductor's
index, which computes a group's prefix from them (conductor/cpp_place.group_prefix).
Counters (`counts`) go into node.status as `cpp.prefix`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from mooncaked.log import get_logger
from mooncaked.store.keys import slice_key
from mooncaked.store.types import PutStatus

log = get_logger(__name__)


class StagePrefix:
    """A stage's prefix beyond its pages (see the module doc).

    Args:
        stage: the StageEngine (layers, page shape and dtype).
        num_layers: the whole model's layers (a full block's layer count).
        store_node: the stage node's StoreNode (its BlockStore holds blocks of the stage's
            page size, `stage.block_bytes`); READs from peers go through its transfer engine.
    Use from the event loop's thread (the store's rule).
    """

    def __init__(self, stage: Any, num_layers: int, store_node: Any):
        if store_node.store.block_bytes != stage.block_bytes:
            raise ValueError(f"the stage's store holds blocks of {store_node.store.block_bytes} "
                             f"bytes, its pages are {stage.block_bytes}")
        self.stage, self.node, self.store = stage, store_node, store_node.store
        self.start, self.stop = stage.layers.start, stage.layers.stop
        per_layer = stage.block_bytes // len(stage.layers)
        self.span = (self.start * per_layer, self.stop * per_layer)   # bytes of a full block
        self.full_block_bytes = num_layers * per_layer
        self.counts = {"requests": 0, "page_blocks": 0, "store_blocks": 0, "fetched_blocks": 0,
                       "fetched_bytes": 0, "fetch_failures": 0, "offloaded_blocks": 0}
        self._puts: set[asyncio.Task] = set()

    def key(self, key: bytes) -> bytes:
        """This stage's slice key of block `key`."""
        return slice_key(key, self.start, self.stop)

    def status(self) -> dict:
        """Counters and the slices held (node.status `cpp.prefix`)."""
        return {**self.counts, "slices": len(self.store.dram) + (len(self.store.ssd) if
                                                                 self.store.ssd is not None else 0),
                "layers": [self.start, self.stop], "span": list(self.span)}

    async def extend(self, rid: str, keys: list[bytes], own: int, fetch: dict | None) -> int:
        """Continues rid's prefix after the `own` blocks its pages matched: its store's
        slices, then `fetch` = {control, blocks} (the source's control address and the
        prefix length in blocks it holds) read by byte range. Returns the blocks this stage
        now holds of `keys`. Never raises: a failed load or fetch ends the prefix there."""
        self.counts["requests"] += 1
        self.counts["page_blocks"] += own
        n = own
        try:
            n += await self._from_store(rid, keys, n)
        except Exception as ex:  # noqa: BLE001 - a prefix miss, not a failed request
            log.warning("cpp_prefix_store_failed", request_id=rid, error=str(ex))
        upto = min(len(keys), int((fetch or {}).get("blocks") or 0))
        source = (fetch or {}).get("control")
        if source and n < upto:
            try:
                n += await self._from_source(rid, keys[n:upto], source)
            except Exception as ex:  # noqa: BLE001 - source gone, lease expired: recompute
                self.counts["fetch_failures"] += 1
                log.warning("cpp_prefix_fetch_failed", request_id=rid, source=source,
                            error=str(ex))
        return n

    def _buffer(self, n: int) -> torch.Tensor:
        return torch.empty((n, *self.stage.block_shape()), dtype=self.stage.dtype)

    async def _from_store(self, rid: str, keys: list[bytes], first: int) -> int:
        skeys = [self.key(k) for k in keys[first:]]
        m = self.store.longest_prefix(skeys)
        if not m:
            return 0
        buf = self._buffer(m)
        got = await self.store.get_many(skeys[:m], [buf[i] for i in range(m)])
        m = next((i for i, tier in enumerate(got) if tier is None), m)
        added = self.stage.append_blocks(rid, buf[:m]) if m else 0
        self.counts["store_blocks"] += added
        return added

    async def _from_source(self, rid: str, keys: list[bytes], source: str) -> int:
        buf = self._buffer(len(keys))
        ok = await self.node.get_ranges(source, keys, *self.span, [buf[i] for i in range(len(keys))])
        m = next((i for i, good in enumerate(ok) if not good), len(ok))
        added = self.stage.append_blocks(rid, buf[:m]) if m else 0
        self.counts["fetched_blocks"] += added
        self.counts["fetched_bytes"] += added * (self.span[1] - self.span[0])
        return added

    def offload(self, rid: str, release: Callable[[], Any]) -> bool:
        """Puts rid's full blocks' slices the store lacks into the store, copied from its
        pages straight into reserved store slots in a thread (BlockStore.put_from), and
        calls `release` (the pages' StageEngine.release) once the copy is done: the event
        loop never copies. Returns False, having done nothing, when there is nothing to
        put or no running loop (the caller releases at once). Never raises."""
        try:
            keys, pages = self.stage.finished_blocks(rid, lambda k: self.store.exists(self.key(k)))
            if not keys:
                return False
            task = asyncio.get_running_loop().create_task(self._put(rid, keys, pages, release))
            self.stage.release_soon(rid)     # a chunk short of pages waits for these
        except Exception as ex:  # noqa: BLE001 - no loop, bad request: release at once
            log.warning("cpp_prefix_offload_failed", request_id=rid, error=str(ex))
            return False
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)
        return True

    async def _put(self, rid: str, keys: list[bytes], pages: list[int],
                   release: Callable[[], Any]) -> None:
        page_of = {self.key(k): p for k, p in zip(keys, pages)}

        def copy(todo: list[bytes], views: list) -> None:
            for k, view in zip(todo, views):
                torch.from_numpy(view).copy_(self.stage.page_bytes(page_of[k]))

        async def fill(todo: list[bytes], views: list) -> list[str]:
            await asyncio.to_thread(copy, todo, views)
            return [""] * len(todo)
        try:
            results = await self.store.put_from(list(page_of), fill)
            self.counts["offloaded_blocks"] += sum(r.status is PutStatus.STORED for r in results)
        except Exception as ex:  # noqa: BLE001 - the pages stay cached; only the copy is lost
            log.warning("cpp_prefix_offload_failed", request_id=rid, error=str(ex))
        finally:
            release()


__all__ = ["StagePrefix"]
