"""Local requests: a request on a segment registered in this same engine is a memcpy.

This is the `all` role on one machine (and any node reading its own store): no
transport, no socket. Copies of BULK_MIN_BYTES and more run in a worker thread
(numpy's copy releases the GIL for large arrays), so the event loop keeps running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np

from .segment import LocalSegment
from .transport import BULK_MIN_BYTES


def copy_bytes(read: bool, seg: LocalSegment, offset: int, view: memoryview) -> None:
    """READ (`read` True): copies seg[offset, offset + view.nbytes) into `view`; WRITE:
    copies `view` there. Offsets in bytes; the caller has checked the bounds."""
    region = seg.view[offset:offset + view.nbytes]
    dst, src = (view, region) if read else (region, view)
    # numpy's copy releases the GIL for large arrays (memoryview assignment does not).
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


async def copy_local(io: concurrent.futures.Executor, read: bool, seg: LocalSegment,
                     offset: int, view: memoryview) -> None:
    """`copy_bytes`, in a worker thread of `io` when the copy is large. On cancellation it
    waits for the copy to finish first: the buffer is never handed back mid-copy."""
    if view.nbytes < BULK_MIN_BYTES:
        copy_bytes(read, seg, offset, view)
        return
    job = io.submit(copy_bytes, read, seg, offset, view)
    try:
        await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        concurrent.futures.wait([job])
        raise


__all__ = ["copy_bytes", "copy_local"]
