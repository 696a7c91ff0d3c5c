"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step of a large model at small batch is bound by launch overhead on the
host: 32 layers of about a dozen kernels each, launched one by one from Python,
take longer than the GPU needs to run them. Capturing the step once as a CUDA graph
and replaying it launches the whole step at once (as vLLM and SGLang do).

A graph has fixed shapes and fixed addresses, so:
- batches are padded up to the nearest *bucket* (1, 2, 4, then multiples of 8, as
  vLLM's capture sizes), one graph per bucket; a batch above the largest bucket, a
  step with prefill tokens, or one that streams K/V layer by layer runs eagerly;
- the inputs live in static device buffers that the graphs read: each step copies its
  (padded) host inputs into them, from pinned memory, without waiting for the GPU;
- block tables are padded to the widest table the context length allows
  (`max_blocks`), so the decode kernel's split plan, which follows the table width, is
  fixed at capture.

Padded rows write no K/V (slot -1, which write_kv skips), attend to one token of page 0
(context length 1: a finite, ignored output) and their hidden states are dropped.

`graph_buckets`, `bucket_for` and `pad_decode` are pure functions over host tensors
(tested on the CPU); `CudaGraphRunner` captures and replays (CUDA only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mooncaked.model.llama import AttentionMetadata, LlamaModel

# Buckets below 8 cover the latency-critical small batches exactly; above, multiples of
# 8 bound the padding to 7 rows (vLLM's default capture sizes follow the same rule).
SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8


def graph_buckets(max_batch: int, max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to min(max_batch,
    max_num_seqs), which is itself always a bucket (so every batch the scheduler can
    form up to the cap has a graph).

    Args: max_batch: the engine.cuda_graph_max_batch setting (0: no graphs);
        max_num_seqs: the scheduler's cap on running sequences.
    Returns: ascending bucket sizes; () when max_batch or max_num_seqs is 0.
    """
    cap = min(max_batch, max_num_seqs)
    if cap <= 0:
        return ()
    sizes = {b for b in SMALL_BUCKETS if b <= cap}
    sizes.update(range(BUCKET_STEP, cap + 1, BUCKET_STEP))
    sizes.add(cap)
    return tuple(sorted(sizes))


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `num_seqs` sequences; None when num_seqs < 1 or
    above the largest bucket (the step then runs eagerly)."""
    if num_seqs < 1:
        return None
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step's inputs on the host, one row per sequence.

    input_ids, positions, slot_mapping: int64 [n]; block_tables: int32 [n, width];
    context_lens: int32 [n] (tokens including the new one).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    @property
    def num_seqs(self) -> int:
        """Rows (sequences) of the step."""
        return int(self.input_ids.shape[0])


def pad_decode(inp: DecodeInputs, bucket: int, max_blocks: int) -> DecodeInputs:
    """Pads a decode step to `bucket` rows and its block tables to `max_blocks` columns.

    Padded rows: token 0, position 0, slot -1 (no K/V write), a block table of zeros and
    context length 1 (one token of page 0: finite and ignored). Extra table columns are 0
    (never read: each row reads only its context length).

    Returns: a DecodeInputs of bucket rows, same dtypes, CPU.
    Raises: ValueError when the step has more rows than `bucket` or a table wider than
        `max_blocks`.
    """
    n, width = inp.num_seqs, int(inp.block_tables.shape[1])
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit a bucket of {bucket}")
    if width > max_blocks:
        raise ValueError(f"block tables of {width} blocks exceed the captured width {max_blocks}")
    pad = bucket - n

    def rows(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, torch.full((pad,), fill, dtype=t.dtype)]) if pad else t

    tables = torch.zeros((bucket, max_blocks), dtype=torch.int32)
    tables[:n, :width] = inp.block_tables
    return DecodeInputs(rows(inp.input_ids, 0), rows(inp.positions, 0), rows(inp.slot_mapping, -1),
                        tables, rows(inp.context_lens, 1))


def decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> DecodeInputs | None:
    """The step as DecodeInputs when it is decode-only (one token per sequence), else None."""
    n = int(input_ids.shape[0])
    if n == 0 or meta.num_decode_tokens != n or meta.decode_block_tables is None:
        return None
    return DecodeInputs(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                        meta.decode_context_lens)


class CudaGraphRunner:
    """Captures the model's decode step per bucket and replays it.

    Args:
        model: the LlamaModel (on a CUDA device; its ops must not sync the host, as the
            Triton ops do not).
        kv_cache: the engine's pages (their address is baked into the graphs).
        buckets: graph_buckets(...), ascending, non-empty.
        max_blocks: block-table width of the graphs: ceil(max_model_len / block_size).
    Raises: ValueError for empty buckets or a non-CUDA model.
    """

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, buckets: tuple[int, ...], max_blocks: int):
        if not buckets:
            raise ValueError("no CUDA graph buckets")
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not {model.device}")
        self.model, self.kv_cache = model, kv_cache
        self.buckets, self.max_blocks = tuple(buckets), int(max_blocks)
        top, dev = self.buckets[-1], model.device
        # Static inputs, read by every graph (bucket b uses the first b rows), and their
        # pinned host twins: one int64 [3, top] (ids, positions, slots) and one int32
        # [top * max_blocks + top] (tables, then context lengths), so a step is two copies.
        self._i64 = torch.zeros((3, top), dtype=torch.int64, device=dev)
        self._i32 = torch.zeros((top * max_blocks + top,), dtype=torch.int32, device=dev)
        self._i64_host = torch.zeros_like(self._i64, device="cpu").pin_memory()
        self._i32_host = torch.zeros_like(self._i32, device="cpu").pin_memory()
        self._copied = torch.cuda.Event()       # the host buffers may be rewritten once it completed
        self._copied.record()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        top = self.buckets[-1]
        tables = self._i32[: top * self.max_blocks].view(top, self.max_blocks)[:b]
        lens = self._i32[top * self.max_blocks:][:b]
        meta = AttentionMetadata(slot_mapping=self._i64[2, :b], num_decode_tokens=b,
                                 decode_block_tables=tables, decode_context_lens=lens)
        return self._i64[0, :b], self._i64[1, :b], meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per bucket, largest first, in one shared memory pool.

        Each bucket runs eagerly once first (Triton compiles and picks its launch configs
        outside the capture). The static inputs are padding rows (slot -1), so capture
        writes no K/V.
        """
        self._i64[2].fill_(-1)
        self._i32[self.buckets[-1] * self.max_blocks:].fill_(1)
        pool = None
        for b in reversed(self.buckets):
            ids, pos, meta = self._views(b)
            self.model.forward(ids, pos, meta, self.kv_cache)      # warm-up (compile)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.model.forward(ids, pos, meta, self.kv_cache)
            pool = g.pool()
            self._graphs[b], self._outputs[b] = g, out
        torch.cuda.synchronize()

    def bucket(self, inp: DecodeInputs | None) -> int | None:
        """The bucket that replays this step, or None (not decode-only, too many rows, a
        table wider than the graphs')."""
        if inp is None or int(inp.block_tables.shape[1]) > self.max_blocks:
            return None
        return bucket_for(inp.num_seqs, self.buckets)

    @torch.inference_mode()
    def run(self, inp: DecodeInputs, bucket: int) -> torch.Tensor:
        """Replays bucket's graph on the step's host inputs.

        Returns: hidden states [inp.num_seqs, hidden] (a view of the graph's static
        output, valid until the next replay), the model's dtype.
        """
        p = pad_decode(inp, bucket, self.max_blocks)
        top = self.buckets[-1]
        self._copied.synchronize()  # the previous step's copies are long done: no wait in practice
        self._i64_host[0, :bucket] = p.input_ids
        self._i64_host[1, :bucket] = p.positions
        self._i64_host[2, :bucket] = p.slot_mapping
        tables = self._i32_host[: top * self.max_blocks].view(top, self.max_blocks)
        tables[:bucket] = p.block_tables
        self._i32_host[top * self.max_blocks:][:bucket] = p.context_lens
        for row in range(3):  # each row's first `bucket` entries are one contiguous run
            self._i64[row, :bucket].copy_(self._i64_host[row, :bucket], non_blocking=True)
        n_tab = bucket * self.max_blocks
        self._i32[:n_tab].copy_(self._i32_host[:n_tab], non_blocking=True)
        lens = slice(top * self.max_blocks, top * self.max_blocks + bucket)
        self._i32[lens].copy_(self._i32_host[lens], non_blocking=True)
        self._copied.record()
        self._graphs[bucket].replay()
        self.replays += 1
        return self._outputs[bucket][: inp.num_seqs]


__all__ = [
    "BUCKET_STEP",
    "SMALL_BUCKETS",
    "CudaGraphRunner",
    "DecodeInputs",
    "bucket_for",
    "decode_inputs",
    "graph_buckets",
    "pad_decode",
]
