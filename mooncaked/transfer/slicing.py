"""Slicing: a request cut into slices that run concurrently on different paths.

Mooncake paper, section 3.2.3: a large request is split into slices and the slices
spread over the available paths (NIC pairs, connections), so one request uses them
all. Every transport slices through `run_sliced`; each slice picks its own path when
it starts (TCP: the least-loaded pipelined connection or an idle bulk connection; RDMA:
the next preferred NIC of the topology matrix), which is what spreads them.

Two ways of running the slices:

- tasks (bulk TCP, RDMA): one task per slice, `move(part, remote_offset)` each (with
  its retries); the first failure cancels the others and is raised;
- a pipeline (small TCP slices): every slice is queued on a connection first, then the
  answers are collected in order; no task per slice, which matters at tens of
  microseconds a slice. A slice whose path broke is retried (while no slice has failed
  for good); the first failure is raised once every answer is in.

A request of at most one slice runs `move` in the caller's task (the low-latency path).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Protocol

from .batch import TransferError

MoveSlice = Callable[[memoryview, int], Awaitable[None]]
"""move(part, remote_offset): moves one slice (retrying on other paths); raises TransferError."""


class Pipeline(Protocol):
    """A transport's pipelined slices of one request (see the module docstring)."""

    async def post(self, part: memoryview, remote_offset: int) -> Any:
        """Queues one slice on a path and returns a ticket for `finish` (no retry here)."""

    async def finish(self, ticket: Any, part: memoryview, remote_offset: int,
                     retry: bool) -> None:
        """Awaits the ticket's answer; when its path broke, retries the slice elsewhere if
        `retry`. Raises TransferError."""

    def abandon(self, ticket: Any) -> None:
        """Gives up a ticket still owed an answer (the request timed out or was cancelled):
        no late byte may touch `part` afterwards."""


def slice_offsets(nbytes: int, slice_size: int) -> range:
    """Byte offsets at which the slices of an `nbytes` request start: every `slice_size`
    bytes (the last slice may be shorter). Raises ValueError for slice_size < 1."""
    if slice_size < 1:
        raise ValueError(f"slice_size must be >= 1 byte, got {slice_size}")
    return range(0, nbytes, slice_size)


async def run_sliced(view: memoryview, remote_offset: int, slice_size: int, move: MoveSlice,
                     progress: Callable[[int], None], pipeline: Pipeline | None = None) -> None:
    """Moves `view` (to or from `remote_offset` of the remote segment, bytes) as slices of
    at most `slice_size` bytes; calls `progress(n)` with each slice's bytes once it moved.

    Raises: the first slice's TransferError. On cancellation (timeout, engine closed) no
    slice keeps touching `view`: tasks are cancelled, pipelined tickets abandoned.
    """
    if view.nbytes <= slice_size:
        await move(view, remote_offset)
        progress(view.nbytes)
        return
    offsets = slice_offsets(view.nbytes, slice_size)
    if pipeline is None:
        async def one(off: int) -> None:
            part = view[off:off + slice_size]
            await move(part, remote_offset + off)
            progress(part.nbytes)

        try:
            async with asyncio.TaskGroup() as tg:
                for off in offsets:
                    tg.create_task(one(off))
        except* TransferError as eg:
            raise eg.exceptions[0] from None
        return
    sent = []  # (part, remote offset, ticket)
    try:
        for off in offsets:
            part = view[off:off + slice_size]
            sent.append((part, remote_offset + off,
                         await pipeline.post(part, remote_offset + off)))
        error: TransferError | None = None
        for part, roff, ticket in sent:
            try:
                await pipeline.finish(ticket, part, roff, retry=error is None)
            except TransferError as e:
                error = error or e
                continue
            progress(part.nbytes)
        if error is not None:
            raise error
    except asyncio.CancelledError:
        for _, _, ticket in sent:
            pipeline.abandon(ticket)
        raise


__all__ = ["run_sliced", "slice_offsets", "Pipeline", "MoveSlice"]
