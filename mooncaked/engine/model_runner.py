"""Owns the paged KV cache: turns a scheduled step into model inputs, runs the forward
pass and samples; copies whole blocks in and out of the pages (KV import and export)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.sampling import SamplingRow, sample, score_tokens

from . import hugepages
from .cuda_graph import CudaGraphRunner, decode_inputs, graph_buckets
from .device_step import needs_host_sampling, upload, upload_step
from .scheduler_output import SchedulerOutput
from .sequence import Sequence
from .staging import scatter_from_host, staging_for
from .structured import apply_masks, start_masks
from .types import TokenLogprob

PROMPT_LOGPROB_ROWS = 256   # LM-head rows at a time for prompt logprobs: 256 x 49k fp32 = 50 MB


@dataclass(frozen=True)
class WarmUp:
    """What `ModelRunner.warm_up` did: `seconds` of wall time, `compiles` Numba compilations
    (0: every kernel came from Numba's disk cache, or none was needed)."""

    seconds: float
    compiles: int


def kv_cache_shape(model: LlamaModel, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (kernels/reference.py)."""
    c = model.cfg
    return (num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)


def block_bytes(model: LlamaModel, block_size: int) -> int:
    """Bytes of one KV block (every layer's K and V for block_size tokens)."""
    c = model.cfg
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * model.dtype.itemsize


class ModelRunner:
    """Owns the KV pages and runs one step of the model over them.

    The pages are `kv_cache` [num_blocks, num_layers, 2, block_size, num_kv_heads,
    head_dim], the model's dtype, on its device. Block copies use the model's kernel
    module (`model.ops`, from kernels.attention_ops): Triton on CUDA when available, the
    torch references otherwise, the same choice as the attention kernels.

    Args:
        model: the loaded LlamaModel.
        num_blocks, block_size: page count and tokens per page.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        self.ops = model.ops
        self.kv_cache = hugepages.zeros(kv_cache_shape(model, num_blocks, block_size),
                                        model.dtype, model.device)
        self.graphs: CudaGraphRunner | None = None  # enable_cuda_graphs

    def enable_cuda_graphs(self, max_batch: int, max_num_seqs: int, max_model_len: int) -> tuple[int, ...]:
        """Captures decode steps as CUDA graphs (engine/cuda_graph.py) on a CUDA model.

        Returns: the captured batch buckets; () when the model is not on CUDA or
        max_batch is 0 (every step then runs eagerly).
        """
        buckets = graph_buckets(max_batch, max_num_seqs)
        if self.model.device.type != "cuda" or not buckets:
            return ()
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = CudaGraphRunner(self.model, self.kv_cache, buckets, max_blocks)
        self.graphs.capture()
        return buckets

    @torch.inference_mode()
    def warm_up(self) -> WarmUp:
        """Runs the model's CPU kernels once, before the engine serves: a 2-token prefill
        and a 1-token decode with their LM heads, on scratch pages of one block (the real
        pages are not touched). A Numba kernel compiles on its first call in a process
        (the fused decode step: 20-30 s on a 2-core AMD EPYC with an empty cache) or loads
        from Numba's disk cache; without this the first request paid it after /health was
        already 200. The same forward and logits calls as `run`, so the same kernels and
        argument types. Nothing to do on CUDA (CUDA graphs' capture warms those up).

        Returns: a WarmUp (seconds, the Numba compilations it ran: 0 when every kernel
            came from the disk cache)."""
        if self.model.device.type != "cpu":
            return WarmUp(0.0, 0)
        from mooncaked.kernels.jit_watch import count_compiles  # noqa: PLC0415 - needs numba
        t0 = time.monotonic()
        m = self.model
        pages = torch.zeros(kv_cache_shape(m, 1, self.block_size), dtype=m.dtype)
        table = torch.zeros((1, 1), dtype=torch.int32)
        prefill = AttentionMetadata(slot_mapping=torch.tensor([0, 1]), num_decode_tokens=0,
                                    prefill_block_tables=table,
                                    prefill_cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
                                    prefill_context_lens=torch.tensor([2], dtype=torch.int32))
        decode = AttentionMetadata(slot_mapping=torch.tensor([2]), num_decode_tokens=1,
                                   decode_block_tables=table,
                                   decode_context_lens=torch.tensor([3], dtype=torch.int32))
        with count_compiles() as compiles:
            hidden = m.forward(torch.tensor([1, 2]), torch.tensor([0, 1]), prefill, pages)
            m.logits(hidden[-1:], 0)
            hidden = m.forward(torch.tensor([3]), torch.tensor([2]), decode, pages)
            m.logits(hidden, 1)
        return WarmUp(time.monotonic() - t0, compiles.count)

    def read_blocks(self, block_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Copies whole pages out: [n, num_layers, 2, block_size, num_kv_heads, head_dim],
        contiguous, the cache's dtype and device (the byte layout of a stored block).
        Raises: IndexError for an id outside the pool (Triton ops; torch's indexing raises
        its own)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.model.device)
        return self.ops.gather_blocks(self.kv_cache, ids)

    def read_blocks_to_host(self, block_ids: list[int] | tuple[int, ...]
                            ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copies whole pages into a new host buffer off the compute stream (engine/staging.py).

        Returns: (blocks [n, num_layers, 2, block_size, num_kv_heads, head_dim] on the host,
            pinned on CUDA; an event that completes when they landed, None on the CPU).
        """
        ids = upload(torch.tensor(block_ids, dtype=torch.long), self.model.device)
        return staging_for(self.model.device).gather_to_host(self.kv_cache, ids)

    def write_blocks(self, block_ids: list[int] | tuple[int, ...], blocks: torch.Tensor) -> None:
        """Copies whole blocks into the pages `block_ids` (n of them).

        blocks: [n, num_layers, 2, block_size, num_kv_heads, head_dim], any float dtype, CPU
        or device (moved and cast to the cache's first).
        """
        if self.model.device.type == "cuda":  # no host sync (the Triton copy checks ids on the device)
            scatter_from_host(self.kv_cache, block_ids, blocks)
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.model.device)
        src = blocks.to(device=self.model.device, dtype=self.model.dtype)
        self.ops.scatter_blocks(self.kv_cache, ids, src)

    @staticmethod
    def _tables(tables: list[list[int]]) -> torch.Tensor:
        """Block tables padded with 0 to the widest: int32 [len(tables), width]."""
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def prepare(self, sched: SchedulerOutput
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int | None]]:
        """Flat input ids int64 [T], positions int64 [T] and attention metadata for the T
        scheduled tokens, on the host (`run` uploads them), the row of each scheduled
        entry's last token, and the row of each entry's first prompt token in this step
        (None when it has none; its prompt rows follow it, in position order). Rows are
        indices into the T rows; both lists are in sched.scheduled's order.

        A token's row kind follows from its position alone, never from how the step is
        batched, so its numerics are the same on every path (batch size, P/D, resumption,
        prefix hits; LlamaModel.forward):
        - decode rows (first; meta.num_decode_tokens of them): every generated token
          (position >= Sequence.first_output_position), one row each, attending to its
          sequence's pages up to itself: the decodes' newest tokens, and the generated
          tokens a recompute after preemption replays (in position order, after its
          prompt part), or a resumed request's earlier output (params.output_offset).
          The fused CPU decode step runs these rows.
        - prefill rows: every prompt token, as chunks (one per sequence, in order), also a
          lone last prompt token whose prefix came from the cache (a "decode" entry of the
          scheduler), so a prompt's first token always takes the prefill path.
        """
        bs = self.block_size
        dec: list[tuple[Sequence, int]] = []              # (sequence, position)
        chunks: list[tuple[Sequence, int, int]] = []      # (sequence, start, end) of prompt
        last: list[tuple[bool, int]] = []                 # (decode row?, index in its kind)
        first_prompt: list[int | None] = []               # index among prefill rows
        n_prefill = 0
        for s in sched.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            mid = min(max(start, seq.first_output_position), end)  # prompt tokens end here
            first_prompt.append(n_prefill if mid > start else None)
            if mid > start:
                chunks.append((seq, start, mid))
                n_prefill += mid - start
            dec += [(seq, p) for p in range(mid, end)]
            last.append((True, len(dec) - 1) if end > mid else (False, n_prefill - 1))
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for seq, p in dec:
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        for seq, start, end in chunks:
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        dev = torch.device("cpu")
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decode_tokens=len(dec))
        if dec:
            meta.decode_block_tables = self._tables([seq.block_table for seq, _ in dec])
            meta.decode_context_lens = torch.tensor([p + 1 for _, p in dec], dtype=torch.int32, device=dev)
        if chunks:
            meta.prefill_block_tables = self._tables([seq.block_table for seq, _, _ in chunks])
            cu = [0]
            for _, start, end in chunks:
                cu.append(cu[-1] + end - start)
            meta.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor([end for _, _, end in chunks], dtype=torch.int32,
                                                     device=dev)
        last_rows = [i if is_dec else len(dec) + i for is_dec, i in last]
        prompt_rows = [None if i is None else len(dec) + i for i in first_prompt]
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta, last_rows, prompt_rows)

    def prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor,
                        prompt_rows: list[int | None]) -> dict[int, list[TokenLogprob]]:
        """Prompt logprobs of this step's prefill chunks that ask for them.

        A chunk's row at position p scores prompt token p + 1 (score_tokens), for the
        prompt tokens the sequence has not scored yet (a recompute after preemption
        repeats none). The rows go through the same LM head as a prefill's last row
        (`model.logits` with no decode rows: the dense head), PROMPT_LOGPROB_ROWS at a time.

        Args: sched: the step; hidden: [T, hidden] of the step's rows (prepare's layout);
            prompt_rows: the row of each entry's first prompt token (prepare).
        Returns: {index in sched.scheduled: TokenLogprob of prompt tokens, in order}.
        """
        out: dict[int, list[TokenLogprob]] = {}
        for i, s in enumerate(sched.scheduled):
            seq, start, row0 = s.seq, s.seq.num_computed_tokens, prompt_rows[i]
            k = seq.params.prompt_logprobs
            if k is None or seq.prompt_logprobs is None or row0 is None:
                continue
            first = max(start, len(seq.prompt_logprobs) - 1)     # position of the first new row
            # the step's prompt rows end where its generated (decode) rows begin
            last = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1,
                       max(start, seq.first_output_position))
            scored: list[TokenLogprob] = []
            for a in range(first, last, PROMPT_LOGPROB_ROWS):
                b = min(last, a + PROMPT_LOGPROB_ROWS)
                rows = hidden[row0 + a - start:row0 + b - start]
                logits = self.model.logits(rows, 0).float().cpu()
                scored += score_tokens(logits, seq.token_ids[a + 1:b + 1], k)
            if scored:
                out[i] = scored
        return out

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, after_layer: Callable[[int], None] | None = None
            ) -> tuple[dict[int, tuple[int, object]], dict[int, list[TokenLogprob]]]:
        """Runs one step over sched.scheduled (its KV loads must be applied already).
        `after_layer(i)` runs once layer i wrote this step's K/V (LlamaModel.forward).

        Returns: ({index in sched.scheduled: (sampled token id, TokenLogprob or None)} for
            the entries that reached their newest token, {index: prompt TokenLogprobs this
            step scored} for prefill chunks that asked for prompt logprobs).
        """
        batch = sched.scheduled
        dev = self.model.device
        input_ids, positions, meta, last_rows, prompt_rows = self.prepare(sched)
        # the sampled rows, decode rows first (prepare lays them out first): the LM head
        # takes a decode row's fused path and a prompt's last row the prefill path
        want = sorted((i for i, s in enumerate(batch) if s.samples), key=lambda i: last_rows[i])
        matchers = [batch[i].seq.grammar for i in want]
        # structured outputs: the masks are filled while the forward pass runs
        masks = (start_masks(matchers, self.model.cfg.vocab_size)
                 if any(m is not None for m in matchers) else None)
        step = decode_inputs(input_ids, positions, meta) if self.graphs and after_layer is None else None
        bucket = self.graphs.bucket(step) if step is not None else None
        if bucket is not None:
            hidden = self.graphs.run(step, bucket)
        else:
            input_ids, positions, meta = upload_step(input_ids, positions, meta, dev)
            hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, after_layer)
        scored = (self.prompt_logprobs(sched, hidden, prompt_rows)
                  if any(s.seq.prompt_logprobs is not None for s in sched.scheduled) else {})
        if not want:
            return {}, scored
        rows_at = [last_rows[i] for i in want]
        if rows_at != list(range(hidden.shape[0])):  # else every token samples (decodes)
            hidden = hidden[upload(torch.tensor(rows_at), dev)]
        nd = meta.num_decode_tokens
        logits = self.model.logits(hidden, sum(1 for r in rows_at if r < nd))
        rows = [SamplingRow(batch[i].seq.params, batch[i].seq.token_ids, batch[i].seq.num_prompt_tokens)
                for i in want]
        if logits.device.type != "cpu" and (masks is not None or needs_host_sampling(rows)):
            logits = logits.cpu()  # one copy down, then per-row sampling on the host
        if masks is not None:
            apply_masks(logits, masks.result())  # forbidden tokens -> -inf
        tokens, logprobs = sample(logits, rows)
        return {i: (tok, lp) for i, tok, lp in zip(want, tokens, logprobs)}, scored
