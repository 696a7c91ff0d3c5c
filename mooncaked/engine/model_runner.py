"""Turns a scheduled step into model inputs, runs the forward pass and samples."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.sampling import SamplingRow, sample

from .scheduler import ScheduledSeq


def kv_cache_shape(model: LlamaModel, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (kernels/reference.py)."""
    c = model.cfg
    return (num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)


def block_bytes(model: LlamaModel, block_size: int) -> int:
    """Bytes of one KV block (every layer's K and V for block_size tokens)."""
    c = model.cfg
    return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * model.embed.element_size()


class ModelRunner:
    """Owns the KV pages and runs one step of the model over them.

    Args:
        model: the loaded LlamaModel.
        num_blocks, block_size: page count and tokens per page.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        self.kv_cache = torch.zeros(kv_cache_shape(model, num_blocks, block_size),
                                    dtype=model.dtype, device=model.device)

    def _block_tables(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        width = max(len(s.seq.block_table) for s in seqs)
        rows = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.model.device)

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids [T], positions [T] and attention metadata; decodes come first."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        num_decode = 0
        while num_decode < len(batch) and not batch[num_decode].seq.is_prefilling:
            num_decode += 1
        for s in batch:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        dev = self.model.device
        decodes, prefills = batch[:num_decode], batch[num_decode:]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 num_decode_tokens=num_decode)
        if decodes:
            meta.decode_block_tables = self._block_tables(decodes)
            meta.decode_context_lens = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes],
                                                    dtype=torch.int32, device=dev)
        if prefills:
            meta.prefill_block_tables = self._block_tables(prefills)
            cu = [0]
            for s in prefills:
                cu.append(cu[-1] + s.num_new_tokens)
            meta.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor(
                [s.seq.num_computed_tokens + s.num_new_tokens for s in prefills], dtype=torch.int32, device=dev)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], after_layer: Callable[[int], None] | None = None
            ) -> dict[int, tuple[int, object]]:
        """Runs one step. `batch` must list decodes before prefills (Scheduler.schedule does).
        `after_layer(i)` runs once layer i wrote this step's K/V (LlamaModel.forward).

        Returns: {index in batch: (sampled token id, TokenLogprob or None)} for the entries
            that reached their newest token.
        """
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, after_layer)
        want = [i for i, s in enumerate(batch) if s.samples]
        if not want:
            return {}
        ends, t = [], 0
        for s in batch:
            t += s.num_new_tokens
            ends.append(t - 1)
        logits = self.model.logits(hidden[[ends[i] for i in want]])
        rows = [SamplingRow(batch[i].seq.params, batch[i].seq.token_ids, batch[i].seq.num_prompt_tokens)
                for i in want]
        tokens, logprobs = sample(logits, rows)
        return {i: (tok, lp) for i, tok, lp in zip(want, tokens, logprobs)}
