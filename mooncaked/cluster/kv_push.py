"""Pushing a prefill's KV to the decode node layer by layer, overlapped with compute.

Mooncake paper, section 3 (Figure 3) and section 4 step 2: the prefill node
streams each layer's KV to the decode node while it computes the next layer, so
that little transfer time is left once the prefill ends. Here:

- when the request leaves the prefill queue (so a request waiting there holds
  no decode memory), before it computes, the prefill node asks the decode node
  to admit it and reserve a receive buffer (`node.kv_reserve`,
  prefill_worker.py): a transfer-engine segment in the same layer-major layout
  as the prefill node's LayerwiseKV stage, whose descriptor (with its access
  key) only this prefill node is given; the pusher's `reserve` hands it over;
- the prefill engine calls `KVPusher.on_layer` from its thread after each layer
  of each step; the pusher WRITEs that layer's blocks to the same offsets of the
  receive buffer from the event loop, in order (a partial block sent again by a
  later step always lands after the earlier copy);
- after the prefill, `finish` waits for the queued writes and reports how much
  of the transfer the compute hid (`PushStats`).

A failed write is not fatal to the request: the decode node then READs the
staged KV from the prefill node instead, so it never decodes on partial KV.

The same pusher carries a CPP stage's KV (cluster/cpp/pipeline_stage.py): there
the source is each chunk's own layer-major copy of the stage's layers, queued
with `push_runs` (byte runs at their offsets in the receive buffer) instead of
`on_layer`, and a failed write fails the request (the stage checks `finish`'s
stats), since no staged copy exists to READ instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import asdict, dataclass
from collections.abc import Awaitable, Callable
from typing import Any

from mooncaked import failpoints
from mooncaked.log import get_logger

log = get_logger(__name__)


@dataclass
class PushStats:
    """What one request's layer-wise push cost and how much of it the compute hid.

    bytes: bytes written; writes: WRITE requests (adjacent layer ranges are merged);
    busy_s: seconds a write was in flight; exposed_s: seconds from the end of the
    prefill compute to the last write's completion (what the push adds to TTFT);
    overlap: fraction of busy_s that ran during the compute, 1 - exposed_s / busy_s
    (1.0 = fully hidden); ok: every write succeeded; error: the first failure.
    """

    bytes: int = 0
    writes: int = 0
    busy_s: float = 0.0
    exposed_s: float = 0.0
    overlap: float = 0.0
    ok: bool = True
    error: str | None = None

    def as_dict(self) -> dict:
        """JSON-safe dict (seconds rounded to microseconds)."""
        d = asdict(self)
        for k in ("busy_s", "exposed_s", "overlap"):
            d[k] = round(d[k], 6)
        return d


class KVPusher:
    """WRITEs KV byte runs to a peer's receive segment, in the order they were queued.

    Args:
        transfer: this node's TransferEngine.
        stage: the LayerwiseKV whose `stage` tensor is the source of `on_layer`'s ranges;
            the receive buffer has the same shape, so every range is written at its own
            byte offset. None when only `push_runs` is used (a CPP stage).
        reserve: coroutine function returning {"descriptor": ...} of the receive segment
            (node.kv_reserve; a CPP stage returns the one it was given); called once,
            before the first write. Its failure means no push (the decode node READs
            instead).
        timeout_s: bound on the reservation and on each WRITE.
    Attributes: attempted (a reservation was asked for: the decode node may hold a buffer),
        stats (PushStats).
    Use: `start()` on the event loop; queue with `on_layer` (as the LayerwiseKV callback,
    from the engine thread) or `push_runs` (on the loop); `await finish(compute_end)` after
    the compute; `aclose()` in every case.
    """

    def __init__(self, transfer: Any, stage: Any | None, reserve: Callable[[], Awaitable[dict]],
                 timeout_s: float):
        self.transfer = transfer
        self.kv = stage
        self.reserve = reserve
        self.segment: str | None = None
        self.attempted = False          # a reservation was asked for (release it if unused)
        self.timeout_s = timeout_s
        self.stats = PushStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        # (destination start byte, end byte, source tensor, source start byte, ready event)
        self._items: deque[tuple] = deque()
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task | None = None
        self._last_end = 0.0

    def start(self) -> None:
        """Starts the sender on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._send(), name="kv-push")

    def on_layer(self, layer: int, lo: int, hi: int, ready: Any) -> None:
        """LayerCallback: queues blocks [lo, hi) of `layer` (engine thread, thread-safe)."""
        start = self.kv.layer_offset(layer, lo)
        item = (start, self.kv.layer_offset(layer, hi), self.kv.stage, start, ready)
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:        # the loop is closing (shutdown): nobody will send it
            pass

    def push_runs(self, src: Any, runs: list[tuple[int, int, int]]) -> None:
        """Queues byte runs of `src` (a host tensor kept alive by the queue until written),
        each (destination offset, source offset, length) in bytes. Event loop only."""
        for dst, off, length in runs:
            self._put((dst, dst + length, src, off, None))

    def _put(self, item: tuple | None) -> None:
        if item is None:
            self._closed = True
        else:
            self._items.append(item)
        self._wake.set()

    async def _send(self) -> None:
        while True:
            if not self._items:
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            start, end, src, off, ready = self._items.popleft()
            # Coalesce what queued up meanwhile and continues this byte run on both sides (a
            # one-chunk prefill's layers are adjacent): fewer, larger WRITEs when the sender
            # lags.
            while self._items and self._items[0][0] == end and self._items[0][2] is src \
                    and self._items[0][3] == off + (end - start):
                _, end, _, _, nxt_ready = self._items.popleft()
                ready = nxt_ready or ready
            if self.segment is None and self.stats.ok:
                await self._connect()
            if not self.stats.ok:
                continue                        # the decode node will READ instead
            if ready is not None:
                await asyncio.to_thread(ready.synchronize)
            t0 = time.monotonic()
            try:
                failpoints.hit("kv_push.write")
                # the stage exists: the engine allocated it before its first on_layer
                await asyncio.wait_for(self.transfer.write(self.segment, start, src,
                                                           end - start, off), self.timeout_s)
                self.stats.bytes += end - start
                self.stats.writes += 1
            except Exception as e:  # noqa: BLE001 - TransferError, timeout: fall back to READ
                self.stats.ok, self.stats.error = False, f"{type(e).__name__}: {e}"
                log.warning("kv_push_failed", segment=self.segment, error=self.stats.error)
            self._last_end = time.monotonic()
            self.stats.busy_s += self._last_end - t0

    async def _connect(self) -> None:
        self.attempted = True
        try:
            desc = await asyncio.wait_for(self.reserve(), self.timeout_s)
            self.segment = self.transfer.add_peer_segment(desc["descriptor"])
        except Exception as e:  # noqa: BLE001 - refused, unreachable, full: fall back to READ
            self.stats.ok, self.stats.error = False, f"reserve: {type(e).__name__}: {e}"
            log.info("kv_push_unavailable", error=self.stats.error)

    async def finish(self, compute_end: float) -> PushStats:
        """Waits (bounded by timeout_s) for every queued write; fills exposed_s and overlap.

        compute_end: time.monotonic() when the prefill's last step ended.
        Returns the PushStats (ok False with the reason when a write failed or timed out).
        """
        self._put(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.timeout_s)
        except TimeoutError:
            self.cancel()
            self.stats.ok, self.stats.error = False, f"push not done within {self.timeout_s} s"
        except Exception as e:  # noqa: BLE001 - the sender failed: the decode node READs
            self.stats.ok, self.stats.error = False, f"{type(e).__name__}: {e}"
        s = self.stats
        s.exposed_s = max(0.0, self._last_end - compute_end) if s.writes else 0.0
        s.overlap = max(0.0, 1.0 - s.exposed_s / s.busy_s) if s.busy_s > 0 else 0.0
        return s

    def cancel(self) -> None:
        """Stops sending (the request was abandoned)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def aclose(self) -> None:
        """Cancels and waits for the sender to stop; forgets the peer segment."""
        self.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.segment is not None:
            with contextlib.suppress(Exception):
                self.transfer.remove_peer_segment(self.segment)
            self.segment = None


__all__ = ["KVPusher", "PushStats"]
