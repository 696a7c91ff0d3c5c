"""KV pages out of GPU memory: pinned host staging on a separate CUDA stream.

The hand-over paths (the layer-wise push, the READ fallback that reads the same
stage, and store offload) move K/V from the device pages to peers and the store
through host memory: the transfer engine's TCP transport and the store's DRAM tier
address host bytes. A copy on the compute stream would queue behind (and delay) the
next layer's kernels, and a blocking copy would stall the engine thread, so:

- the pages are gathered into a contiguous device buffer on the compute stream (a
  device-to-device copy, microseconds; ordered before any later kernel that writes
  those pages, so a page freed and reused right after is safe), and the device-to-host
  copy of that buffer runs on a *copy stream* of its own, which first waits for the
  compute stream's work so far and then overlaps with the compute that follows (the
  next layer, the next step);
- the destination is page-locked (pinned) host memory, so the copy is a DMA that
  neither blocks the host nor goes through a bounce buffer;
- the caller gets a `torch.cuda.Event` recorded after the copy and waits on it where
  the bytes are needed (kv_push.py awaits it in a worker thread before its WRITE; the
  store offload before its put), never in the engine's step.

On the CPU (the dev machine, the tests) the same calls run: the copy is synchronous,
the event is None and pinning is skipped (it needs a CUDA driver), so the path is
exercised with CPU tensors standing in for the GPU's.
"""

from __future__ import annotations

import functools

import torch
from .device_step import upload


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor for staging: pinned when CUDA is available, else pageable."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class HostStaging:
    """Copies from device pages into host staging buffers, off the compute stream.

    Args:
        device: the pages' device. CUDA: a copy stream is created on it; anything else:
            copies are plain synchronous copies.
    Attributes:
        stream: the copy stream (CUDA), else None.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def gather(self, pages: torch.Tensor, block_ids: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event | None:
        """dst <- pages[block_ids] (rows along dim 0), without blocking the host on CUDA.

        Args:
            pages: a device tensor whose dim 0 is the page index: the KV cache
                [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] or one layer's
                view of it `kv_cache[:, layer]` [num_blocks, 2, block_size, kv_heads, head_dim].
            block_ids: int64 [n] page ids, on pages' device.
            dst: host tensor [n, *pages.shape[1:]], pages' dtype (pinned on CUDA, see
                host_buffer); may be a view of a larger stage.
        Returns: on CUDA an event that completes when dst holds the bytes (the gather is
            queued on the current stream, the device-to-host copy on the copy stream after
            everything queued so far); None on the CPU, where dst is written on return.
        Raises: ValueError when dst's shape or dtype does not match.
        """
        want = (int(block_ids.shape[0]), *pages.shape[1:])
        if tuple(dst.shape) != want or dst.dtype != pages.dtype:
            raise ValueError(f"staging buffer {tuple(dst.shape)} {dst.dtype} does not match "
                             f"{want} {pages.dtype}")
        if self.stream is None:
            torch.index_select(pages, 0, block_ids, out=dst)
            return None
        # The gather runs on the compute stream, so it reads the pages before any later kernel
        # writes them (a freed page reused by the next step, the next token of a partial
        # block); it is a device-to-device copy of a few MB, microseconds. Only the slow
        # device-to-host leg runs on the copy stream, overlapped with what follows.
        rows = pages.index_select(0, block_ids)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # rows belongs to the compute stream's allocator: not reused until the copy ran.
        rows.record_stream(self.stream)
        return done

    def gather_to_host(self, pages: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A new host buffer holding pages[block_ids], and its ready event (see `gather`)."""
        dst = host_buffer((int(block_ids.shape[0]), *pages.shape[1:]), pages.dtype)
        return dst, self.gather(pages, block_ids, dst)


def scatter_from_host(pages: torch.Tensor, block_ids: list[int] | tuple[int, ...], blocks: torch.Tensor) -> None:
    """pages[block_ids] <- blocks, the way into device pages (a KV import, a store load),
    with no host sync: ids are checked on the host, blocks go up through pinned memory
    without blocking and land with one index_copy_ on the current stream.

    Args:
        pages: the KV cache [num_blocks, ...] (any device).
        block_ids: n page ids, each in [0, num_blocks).
        blocks: [n, *pages.shape[1:]], any float dtype (cast to the pages'), host or device.
    Raises: IndexError for an id outside the pool; ValueError for a shape mismatch.
    """

    n = pages.shape[0]
    bad = [b for b in block_ids if not 0 <= b < n]
    if bad:
        raise IndexError(f"block ids {bad[:4]} outside a pool of {n} blocks")
    if tuple(blocks.shape) != (len(block_ids), *pages.shape[1:]):
        raise ValueError(f"blocks {tuple(blocks.shape)} do not match {len(block_ids)} blocks of "
                         f"{tuple(pages.shape[1:])}")
    ids = upload(torch.tensor(block_ids, dtype=torch.long), pages.device)
    pages.index_copy_(0, ids, upload(blocks, pages.device).to(pages.dtype))


@functools.cache
def staging_for(device: torch.device) -> HostStaging:
    """The process's HostStaging of a device (one copy stream per device)."""
    return HostStaging(device)


def wait_ready(ready: torch.cuda.Event | None) -> None:
    """Blocks until a staging copy completed (no-op for None, the CPU's synchronous copy).
    Call it off the engine thread, e.g. `await asyncio.to_thread(wait_ready, ready)`."""
    if ready is not None:
        ready.synchronize()


__all__ = ["HostStaging", "host_buffer", "scatter_from_host", "staging_for", "wait_ready"]
