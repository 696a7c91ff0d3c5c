"""Layer-wise export of one request's K/V while it prefills.

The Mooncake paper (section 3, Figure 3 "layer-wise prefill"; section 4 step 2)
overlaps moving a prefill's KV with computing it: as soon as layer l has written
its K/V for the tokens of this step, that layer's blocks can leave while the model
computes layer l + 1. `LayerwiseKV` is the engine's half of that: a staging
buffer in layer-major layout that the forward pass fills one layer at a time,
calling `on_layer` after each, so a transfer (cluster/kv_push.py) can send the
layer at once. Layer-major means one layer's consecutive blocks are one
contiguous byte run, so each layer of a step is a single WRITE.

The staging buffer doubles as the request's exported KV: after the last prefill
step it holds every block of the prompt (the partial last one included); a
decode node that did not receive the push READs it from there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mooncaked.utils import cdiv

from .device_step import upload
from .staging import staging_for

# on_layer(layer, block_lo, block_hi, ready): blocks [block_lo, block_hi) of `layer` are
# in stage[layer, block_lo:block_hi] once `ready` (a torch.cuda.Event, or None on the
# CPU where the copy is synchronous) has completed. Called from the engine's thread.
LayerCallback = Callable[[int, int, int, "torch.cuda.Event | None"], None]


class LayerwiseKV:
    """A request's K/V blocks, staged layer by layer as the engine computes them.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: geometry; num_blocks =
            ceil(prompt tokens / block_size).
        dtype: the engine's KV dtype (torch.float32 or torch.bfloat16).
        on_layer: called after each layer's copy (see LayerCallback), or None.
        pin_memory: page-lock the staging buffer (CUDA engines: asynchronous device-to-host
            copies).
    Attributes:
        shape: (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim); dtype.
        stage: a tensor of that shape and dtype, CPU, contiguous, allocated by the first
            step (in the engine's thread, so a request waiting in the queue holds no
            memory). Layer l, block b starts at byte (l * num_blocks + b) * layer_block_bytes.
        layer_block_bytes: bytes of one block of one layer (K and V).
        num_final_blocks: leading blocks whose K/V is complete in `stage` for every layer
            (the engine advances it after each step).
        num_tokens: tokens whose K/V has been staged so far.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, on_layer: LayerCallback | None = None,
                 pin_memory: bool = False):
        if num_blocks < 1:
            raise ValueError("a layer-wise export needs at least one block")
        self.shape = (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.stage: torch.Tensor | None = None
        self.block_size = block_size
        self.on_layer = on_layer
        self.layer_block_bytes = (2 * block_size * num_kv_heads * head_dim
                                  * torch.empty((), dtype=dtype).element_size())
        self.num_final_blocks = 0
        self.num_tokens = 0
        # the current step's range: blocks [lo, hi) and their page ids
        self._lo = self._hi = 0
        self._ids: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks of the staged prompt (tokens / block_size, rounded up)."""
        return self.shape[1]

    def layer_offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) in `stage`."""
        return (layer * self.num_blocks + block) * self.layer_block_bytes

    def begin_step(self, block_table: list[int], end_token: int, device: torch.device) -> None:
        """Plans the copies of one step that computes the request's tokens up to end_token.

        Blocks from `num_final_blocks` (earlier ones are already staged) up to the block
        holding token end_token - 1 are copied for every layer: prefix-cached and imported
        blocks on the first step, this step's blocks after that (a partial block again).
        Raises: ValueError when end_token exceeds the staged prompt.
        """
        hi = cdiv(end_token, self.block_size)
        if hi > self.num_blocks:
            raise ValueError(f"step reaches token {end_token}; the export holds "
                             f"{self.num_blocks} blocks")
        if self.stage is None:
            self.stage = torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pin_memory)
        self._lo, self._hi = self.num_final_blocks, hi
        self._ids = upload(torch.tensor(block_table[self._lo:hi], dtype=torch.long), torch.device(device))
        self.num_tokens = max(self.num_tokens, end_token)

    def copy_layer(self, kv_cache: torch.Tensor, layer: int) -> None:
        """Copies this step's blocks of `layer` out of the pages, then calls on_layer.

        kv_cache: the engine's pages [num_blocks, num_layers, 2, block_size, kv_heads,
        head_dim]. Runs in the engine's thread, right after the layer wrote its K/V.
        """
        if self._ids is None or self._hi <= self._lo:
            return
        dst = self.stage[layer, self._lo:self._hi]
        src = kv_cache[:, layer]
        # On CUDA: on the copy stream into the pinned stage, overlapped with the next
        # layer's compute (engine/staging.py); on the CPU a plain copy (ready is None).
        ready = staging_for(kv_cache.device).gather(src, self._ids, dst)
        if self.on_layer is not None:
            self.on_layer(layer, self._lo, self._hi, ready)

    def end_step(self) -> None:
        """After the step: blocks before the one holding the next token are final."""
        self.num_final_blocks = self.num_tokens // self.block_size
        self._ids = None


__all__ = ["LayerCallback", "LayerwiseKV"]
