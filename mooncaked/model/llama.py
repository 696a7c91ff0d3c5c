"""Our Llama forward pass over a paged KV cache (not transformers' modeling code).

One call runs a flat batch of T tokens: the first `num_decode_tokens` are decode
rows (generated tokens, one row each, each attending to its sequence's pages up to
itself: the decodes' newest tokens and a recompute's replayed ones), the rest are
prefill chunks of prompt tokens of variable length (each possibly after a cached
prefix). Linear layers run on all T tokens at once; attention splits into the paged
decode and paged prefill kernels (mooncaked.kernels). With the fused CPU decode step
built, the decode rows run it instead (model/fused.py) and the prefill rows the per-op
path, so a token's numerics depend on whether it is a prompt or a generated token,
never on the batch.

Architecture: embedding, pre-norm blocks of RMSNorm -> grouped-query
attention with rotary embedding -> residual, RMSNorm -> SwiGLU MLP ->
residual, final RMSNorm, LM head (tied or not). Q and K projections are in
interleaved rotary layout (see weights.py), so rotary is a complex multiply.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from . import fused, quant
from .weights import ModelConfig, ModelLoadError


# Fewest rows a dense matmul of a model with the fused step runs (LlamaModel._linear): at
# least this many, a row's result does not depend on the others (measured from 4 up, AMD
# EPYC, torch's fp32 CPU matmul; 16 leaves room for other CPUs' small-matrix kernels).
MIN_GEMM_ROWS = 16


@dataclass
class AttentionMetadata:
    """Where each token of a step reads and writes KV (shapes for T tokens in the step).

    slot_mapping: int64 [T], page slot (block_id * block_size + offset) of each token's K/V.
    num_decode_tokens: the first this-many tokens are decode rows, each with its own
        block table and context length (several rows of one sequence when a recompute
        replays its generated tokens; each row's K/V is written before any row attends).
    decode_block_tables: int32 [num_decodes, max_blocks]; decode_context_lens: int32 [num_decodes]
        (the row's position + 1).
    prefill_block_tables: int32 [num_prefills, max_blocks]; prefill_cu_seqlens_q: int32
        [num_prefills + 1]; prefill_context_lens: int32 [num_prefills] (cached + new tokens).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None


def rope_inv_freq(cfg: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary inverse frequencies, fp32 [head_dim / 2], with the config's rope scaling.

    Supports no scaling, "linear", "llama3" (Llama 3.1; transformers'
    `_compute_llama3_parameters`) and GGUF's precomputed `rope_freqs` factors.
    Raises: ModelLoadError for other scaling types.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope_freqs is not None:
        return (inv / rope_freqs.double()).float()
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in (None, "default", "none"):
        pass
    elif kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    else:
        raise ModelLoadError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    return inv.float()


class LlamaModel:
    """Weights and forward pass of a Llama-family decoder.

    Norms live in `dtype` on `device`; q/k/v and gate/up projections are fused into
    one matrix each so a layer runs four matmuls. Projections and the LM head are
    quant.Linear objects: dense `dtype` matrices, or with `weight_format` "auto"/"int8"
    and bf16 on the CPU, weight-only int4/int8 (model/quant.py).

    Args:
        tensors: from load_weights (fp32 tensors, or QuantizedWeights with keep_quantized).
        weight_format: "dequantized" (default), "auto" (keep the file's Q4/Q8 blocks) or "int8".
        dense_above: quantized weights also keep a dense copy for steps of more than this
            many tokens; None keeps none.

    `fused_decode_max_batch` > 0 also builds the fused CPU decode step
    (kernels/cpu_fused_decode.py: every layer and the LM head over the GGUF's own Q4/Q8
    blocks, one Numba call each) where it applies (`fused_decode_reason` says why not):
    every decode row of every step then runs it (any batch size: the value is no longer a
    batch limit), in place of the per-op path; prompt tokens keep the per-op path.

    `row_invariant` (default: an fp32 model with the fused step) makes the prompt rows
    results independent of the chunking (`_linear`, aligned prefill attention); a pipeline
    stage of a cluster whose nodes run the fused step sets it, so that its prompt K/V are
    theirs bit for bit.

    `prompt_dtype` bfloat16 (model/numerics.py: `dtype = auto` on AVX512-BF16) runs a
    row-invariant fp32 model's layer projections (which then serve prompt rows only) as
    quant.Bf16Linear, when this CPU's bf16 matmul is measured row-invariant; `prompt_dtype`
    int8 (auto on AVX2 and AVX-512 without bf16) runs them as quant.Int8ActLinear over the
    GGUF's Q4 blocks (kernels/cpu_gemm.py, row-invariant by construction). `prompt_matmul`
    says which they run ("float32", "bfloat16" or "int8"), `prompt_matmul_why` why not the
    one asked for.

    `layers` (a pipeline stage, engine/stage.py) builds only that contiguous range: the
    forward pass then runs those layers over a kv_cache holding only them, the embedding
    exists only when the range starts at layer 0 (or serves a tied LM head) and the final
    norm and LM head only when it ends at the last layer (missing tensors are None).
    """

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, ops: ModuleType, max_positions: int,
                 weight_format: str = "dequantized", dense_above: int | None = None,
                 layers: range | None = None, fused_decode_max_batch: int = 0,
                 row_invariant: bool | None = None, prompt_dtype: torch.dtype | None = None):
        self.cfg, self.dtype, self.device, self.ops = cfg, dtype, device, ops
        self.layer_range = layers if layers is not None else range(cfg.num_layers)

        def w(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else quant.dense(t).to(device=device, dtype=dtype).contiguous()

        def lin(*parts) -> quant.Linear:
            return quant.make_linear(list(parts), weight_format, dtype, device, dense_above)

        self.norm = w(tensors.get("norm"))
        embed = tensors.get("embed")
        if "lm_head" in tensors or embed is None:   # untied, or a stage without the table
            self.lm_head = lin(tensors["lm_head"]) if "lm_head" in tensors else None
            self.embed = w(embed)
        else:
            self.lm_head = lin(embed)
            # A tied head shares its table with the embedding lookup (int8 rows are
            # dequantized per lookup): no second copy.
            if isinstance(self.lm_head, quant.Int8Linear):
                self.embed = None
            elif self.lm_head.kind == "dense":
                self.embed = self.lm_head.weight
            else:
                self.embed = w(embed)
        self.layers = []
        for i in self.layer_range:
            t = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")}
            self.layers.append({
                "attn_norm": w(t["attn_norm"]),
                "wqkv": lin(t["wq"], t["wk"], t["wv"]),
                "wo": lin(t["wo"]),
                "mlp_norm": w(t["mlp_norm"]),
                "w_gate_up": lin(t["w_gate"], t["w_up"]),
                "w_down": lin(t["w_down"]),
            })
        rope_freqs = tensors.get("rope_freqs")
        inv = rope_inv_freq(cfg, quant.dense(rope_freqs) if rope_freqs is not None else None)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles).to(device)  # complex64 [P, hd/2]
        # the same table as fp32 cos / sin [P, hd/2] for an ops module's in-place rotary
        self._rope_cos = self.freqs_cis.real.cpu().numpy().copy()
        self._rope_sin = self.freqs_cis.imag.cpu().numpy().copy()
        self.scale = cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.fused = None  # kernels.cpu_fused_decode.FusedWeights, when the fused step applies
        self.fused_decode_max_batch = fused_decode_max_batch
        self.fused_decode_reason = "off (model.fused_decode_max_batch = 0)"
        if fused_decode_max_batch > 0:
            self.fused_decode_reason = fused.why_not(cfg, tensors, weight_format, dtype, device, ops,
                                                     layers is not None)
            if self.fused_decode_reason is None:
                self.fused = fused.build(cfg, tensors, self._rope_cos, self._rope_sin)
        # An fp32 model with the fused step runs its prompt rows row-invariantly: small
        # matmuls padded (_linear), prefill attention in aligned blocks (the ops module's
        # paged_prefill_attention_aligned), so a prompt token's K/V never depends on the
        # chunking, which the fused step's int8 activations would amplify.
        if row_invariant is None:
            row_invariant = self.fused is not None and dtype == torch.float32
        self.row_invariant = row_invariant and hasattr(ops, "paged_prefill_attention_aligned")
        self.prompt_matmul, self.prompt_matmul_why = self._prompt_matmul(prompt_dtype, tensors)

    def _prompt_matmul(self, prompt_dtype: torch.dtype | None,
                       tensors: dict[str, torch.Tensor]) -> tuple[str, str | None]:
        """Run the layers' projections in bf16 or with int8 activations where `prompt_dtype`
        asks for it (an fp32 model whose prompt rows run row-invariantly: only prompt rows
        reach these linears, the decode rows take the fused step): bf16 where this CPU's
        bf16 matmul keeps rows invariant (quant.bf16_rows_invariant), int8 where the
        weights are Q4 blocks and the CPU has AVX2 (fused.prompt_gemm_why_not). Returns
        (what the projections run: "float32", "bfloat16" or "int8"; why not the one asked
        for, or None)."""
        if prompt_dtype not in (torch.bfloat16, torch.int8) or self.dtype != torch.float32:
            return str(self.dtype).removeprefix("torch."), None
        asked = str(prompt_dtype).removeprefix("torch.")
        if not self.row_invariant or self.device.type != "cpu":
            return "float32", f"{asked} prompt matmuls need an fp32 CPU model with row-invariant prompt rows"
        if prompt_dtype == torch.int8:
            why = fused.prompt_gemm_why_not(tensors, self.layer_range)
            if why is not None:
                return "float32", f"int8 prompt matmuls: {why}"
            for i, layer in zip(self.layer_range, self.layers):
                layer.update(fused.prompt_linears(tensors, i))
            return "int8", None
        names = ("wqkv", "wo", "w_gate_up", "w_down")
        shapes = {tuple(layer[k].weight.shape) for layer in self.layers for k in names}
        if not quant.bf16_rows_invariant(shapes, MIN_GEMM_ROWS):
            return "float32", "this CPU's bf16 matmul gives a row other bits in another batch"
        for layer in self.layers:
            for k in names:
                layer[k] = quant.Bf16Linear(layer[k].weight)
        return "bfloat16", None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.lm_head.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    def _linear(self, lin: quant.Linear, x: torch.Tensor) -> torch.Tensor:
        """lin(x) for x [T, in] -> [T, out]. With `row_invariant` (an fp32 model with the fused
        step), a step of fewer than MIN_GEMM_ROWS rows runs padded with zero rows to that
        many: torch's CPU matmul takes
        other kernels for a few rows (measured on AMD EPYC, fp32: rows of a 1-3-row product
        differ in the last bits from the same rows in a larger one), and the fused step's
        int8 activations turn such last-bit differences of the prompt's K/V into logprob
        differences of 0.01-0.13 later on (a prefix hit's short suffix against a cold
        prefill). Padded, a row's result is the same in any batch (test_fused_decode)."""
        n = x.shape[0]
        if not self.row_invariant or n >= MIN_GEMM_ROWS or n == 0:
            return lin(x)
        return lin(torch.cat([x, x.new_zeros(MIN_GEMM_ROWS - n, x.shape[1])]))[:n]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.ops, "rms_norm", None)  # one Numba call on the CPU (kernels/cpu_fused.py)
        if fused is not None:
            return fused(x, weight, self.cfg.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def _rotary(self, qk: torch.Tensor, rot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """qk: [T, heads, head_dim] interleaved pairs, rot: complex64 [T, 1, head_dim / 2]
        (freqs_cis at the tokens' positions), positions: int64 [T] -> rotated, qk's dtype:
        in place by the ops module's `rotary_` where it handles qk (bf16 on the CPU,
        bitwise the same), else a rotated copy."""
        fused = getattr(self.ops, "rotary_", None)
        if fused is not None and fused(qk, self._rope_cos, self._rope_sin, positions):
            return qk
        t, h, d = qk.shape
        x = torch.view_as_complex(qk.float().reshape(t, h, d // 2, 2))
        x = x * rot
        return torch.view_as_real(x).reshape(t, h, d).to(qk.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, after_layer: Callable[[int], None] | None = None
                ) -> torch.Tensor:
        """Runs all layers on a flat batch and writes its K/V into the pages.

        Args:
            input_ids: int64 [T]; positions: int64 [T] (index in its sequence). A later
                pipeline stage passes the previous stage's hidden states [T, hidden] instead.
            meta: AttentionMetadata for the same T tokens.
            kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], self.dtype.
            after_layer: called with the layer index as soon as that layer's K/V of this
                step is in the pages (before its attention), for layer-wise KV export; in
                a step with decode rows through the fused step, for every layer at the end.
        Returns: hidden states after the last block (before the final norm), [T, hidden], self.dtype
            (fp32 when the fused decode step ran the step's decode rows).
        """
        cfg, ops = self.cfg, self.ops
        T = input_ids.shape[0]
        nd = meta.num_decode_tokens
        if self.fused is not None and nd > 0 and not input_ids.is_floating_point():
            # Every decode row takes the fused step, whatever the batch size or what else
            # shares the step: its per-row arithmetic (int8 activations quantized per row,
            # one GEMV dot per row and weight row, attention per row) is the same bit for
            # bit in any batch, so a token's numerics depend on its sequence only. The
            # prefill rows (prompt tokens) run the per-op path first, so a decode row
            # replaying a recompute's generated tokens finds its prompt's K/V in the pages.
            if nd == T:
                hidden = fused.decode(self, input_ids, positions, meta, kv_cache)
                if after_layer is not None:
                    for i in self.layer_range:
                        after_layer(i)
                return hidden
            dmeta = AttentionMetadata(meta.slot_mapping[:nd], nd, decode_block_tables=meta.decode_block_tables,
                                      decode_context_lens=meta.decode_context_lens)
            pmeta = AttentionMetadata(meta.slot_mapping[nd:], 0, prefill_block_tables=meta.prefill_block_tables,
                                      prefill_cu_seqlens_q=meta.prefill_cu_seqlens_q,
                                      prefill_context_lens=meta.prefill_context_lens)
            rest = self.forward(input_ids[nd:], positions[nd:], pmeta, kv_cache)
            head = fused.decode(self, input_ids[:nd], positions[:nd], dmeta, kv_cache)
            if after_layer is not None:  # once every row's K/V is in (decode rows may be
                for i in self.layer_range:  # a resumed prompt's tail that a stream exports)
                    after_layer(i)
            return torch.cat([head, rest.float()])
        h = input_ids if input_ids.is_floating_point() else self._embed(input_ids)
        rot = self.freqs_cis[positions].unsqueeze(1)  # once per step, not per layer
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer["attn_norm"])
            qkv = self._linear(layer["wqkv"], x)
            qk = qkv[:, : self.q_size + self.kv_size].view(T, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = self._rotary(qk, rot, positions)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(T, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_cache[:, i, 0], kv_cache[:, i, 1]
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            if after_layer is not None:
                after_layer(i)
            if nd == T:
                attn = ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale)
            elif nd == 0:
                prefill = ops.paged_prefill_attention_aligned if self.row_invariant else ops.paged_prefill_attention
                attn = prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                               meta.prefill_context_lens, self.scale)
            else:
                attn = torch.cat([
                    ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                               meta.decode_context_lens, self.scale),
                    ops.paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                                meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                                self.scale)])
            h = h + self._linear(layer["wo"], attn.reshape(T, self.q_size))
            x = self._rms_norm(h, layer["mlp_norm"])
            gate, up = self._linear(layer["w_gate_up"], x).chunk(2, dim=-1)
            h = h + self._linear(layer["w_down"], F.silu(gate) * up)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, num_decode_rows: int | None = None) -> torch.Tensor:
        """Final norm and LM head. hidden: [N, hidden] -> fp32 logits [N, vocab].

        num_decode_rows: how many leading rows are decode rows (generated tokens; the
        runner lays them out first, ModelRunner.prepare); the rest are prompts' last rows
        (a prompt's first token). None: every row is a decode row.

        With the fused step built, each row takes one defined head, whatever else shares
        the step (so a token's logits depend on its sequence only):
        - decode rows: the fused head (fp32 norm, int8 activations per row over the file's
          own Q8_0/Q4 head, as llama.cpp).
        - a prompt's last row, fp32 models (`dtype = auto` on AVX2 / AVX-512 without bf16):
          the dense fp32 head over the exact prefill, so a prompt's first token is
          `dtype = float32`'s (within 1e-4: row-invariant summation orders), on every node (one process, a P/D prefill node, a
          CPP stage). The fused head's int8 activations flipped the bundled model's near
          tie on the quickstart's question ('The' vs 'L', 0.04 apart) and the answer that
          followed was nonsense.
        - a prompt's last row, bf16 models: the fused head too. The per-op head rounds
          logits to bf16 (steps of 1/8 at a logit of 20), which made near ties exact, and
          which of two tied tokens won then depended on the path."""
        if self.fused is None:
            return self._dense_logits(hidden)
        n = hidden.shape[0]
        nd = n if num_decode_rows is None or self.dtype != torch.float32 else num_decode_rows
        if nd == 0:
            return self._dense_logits(hidden)
        head = fused.logits(self, hidden[:nd].float().contiguous())
        if nd == n:
            return head
        return torch.cat([head, self._dense_logits(hidden[nd:])])

    def _dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-op final norm and LM head in the model's dtype: fp32 [N, vocab]."""
        return self._linear(self.lm_head, self._rms_norm(hidden, self.norm)).float()
