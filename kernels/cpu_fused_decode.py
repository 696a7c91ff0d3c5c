"""A whole decode step of a Llama model in one Numba call (CPU, small batches).

At batch 1 the per-token work of a 30-layer model is some 360 small ops: in torch
each is a dispatch (norm, matmul, rotary, KV write, attention, residual, SiLU...)
and the Python between them, about a third of a step, and torch's int4 kernel
reads a Q4 weight at half the speed a VNNI dot product does (kernels/cpu_gemv.py).
llama.cpp runs the same step as one compiled graph. So does this: `decode_layers`
runs every layer for B tokens (one per decoding sequence), `head_logits` the final
norm and the LM head, both over the GGUF's own blocks (`cpu_gemv.GemvWeight`).

Numerics: the residual stream, norms, rotary and SiLU are fp32; every matmul input
is quantized per block of 32 to int8 (as llama.cpp's Q8 activations, cpu_gemv);
q, and the K/V written into the pages, are rounded to bf16 like the torch path
(the cache is bf16), and attention is cpu_decode's kernel. tests/test_fused_decode.py
compares logits and greedy tokens with the dequantized forward.

Layout: per-layer weights stacked into [L, ...] arrays (`FusedWeights`); the KV
cache is the engine's [num_blocks, L, 2, block_size, kv_heads, head_dim] bf16 tensor,
read and written in place through its flat storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from . import cpu_gemv
from .cpu_decode import _LOG2E, _exp2_inplace, _flat, attend

__all__ = ["ISAS", "FusedWeights", "decode_step_fn", "head_logits"]

_JIT = {"cache": True, "fastmath": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}
ISAS = ("avx2", "avx512_vnni")  # the cpu_gemv variants the step runs on


@dataclass
class FusedWeights:
    """One model's weights for the fused step: GemvWeights stacked over layers.

    {qkv,o,gate_up,down}_{codes,d,m}: [L, rows, ...] (cpu_gemv.GemvWeight fields; 4-bit codes);
    attn_norm, mlp_norm: fp32 [L, hidden]; cos, sin: fp32 [max_positions, head_dim / 2]
    (rotary of interleaved pairs); head: the LM head (4- or 8-bit), norm: fp32 [hidden];
    isa: the cpu_gemv variant the step runs (one of ISAS), chosen when the model is built.
    """

    qkv: tuple[np.ndarray, np.ndarray, np.ndarray]
    o: tuple[np.ndarray, np.ndarray, np.ndarray]
    gate_up: tuple[np.ndarray, np.ndarray, np.ndarray]
    down: tuple[np.ndarray, np.ndarray, np.ndarray]
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    head: cpu_gemv.GemvWeight
    norm: np.ndarray
    isa: str = "avx512_vnni"

    @staticmethod
    def stack(layers: list[dict[str, cpu_gemv.GemvWeight]], attn_norm: list[np.ndarray],
              mlp_norm: list[np.ndarray], cos: np.ndarray, sin: np.ndarray, head: cpu_gemv.GemvWeight,
              norm: np.ndarray, isa: str) -> FusedWeights:
        """From per-layer {"qkv", "o", "gate_up", "down"} GemvWeights (4-bit), the norms
        (fp32 [hidden] each), the rotary cos / sin tables (fp32 [P, head_dim / 2], the
        model's own, not copied), the head and the GEMV variant (one of ISAS).
        Raises: ValueError when a layer weight is not 4-bit or isa is not one of ISAS."""
        if isa not in ISAS:
            raise ValueError(f"the fused step runs on {', '.join(ISAS)}, not {isa!r}")
        def st(name):
            ws = [lay[name] for lay in layers]
            if any(w.bits != 4 for w in ws):
                raise ValueError(f"fused decode needs 4-bit {name} weights")
            return (np.ascontiguousarray(np.stack([w.codes for w in ws])),
                    np.ascontiguousarray(np.stack([w.d for w in ws])),
                    np.ascontiguousarray(np.stack([w.m for w in ws])))

        return FusedWeights(st("qkv"), st("o"), st("gate_up"), st("down"),
                            np.ascontiguousarray(np.stack(attn_norm), np.float32),
                            np.ascontiguousarray(np.stack(mlp_norm), np.float32),
                            np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32),
                            head, np.ascontiguousarray(norm, np.float32), isa)

    def nbytes(self) -> int:
        """Bytes of the stacked layer weights and the head."""
        return sum(a.nbytes for w in (self.qkv, self.o, self.gate_up, self.down) for a in w) + self.head.nbytes()


@numba.njit(inline="always", **_JIT)
def _rms_norm(x, w, eps, out):  # pragma: no cover - compiled
    """out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, fp32 [T, n]."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
        for i in range(n):
            out[t, i] = x[t, i] * r * w[i]


@numba.njit(inline="always", **_JIT)
def _bf16_bits(u, i):  # pragma: no cover - compiled
    """bf16 bits of the fp32 whose bits are u[i], round to nearest even as torch's cast."""
    b = u[i]
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(inline="always", **_JIT)
def _silu_mul(gu, inter, e, bits, out):  # pragma: no cover - compiled
    """out[t] = silu(gate) * up for gu[t] = [gate (inter) | up (inter)], fp32; the
    exponential is cpu_decode's vectorizable exp2 (Numba has no vector exp)."""
    for t in range(gu.shape[0]):
        for i in range(inter):
            e[i] = -abs(gu[t, i]) * np.float32(_LOG2E)
        _exp2_inplace(e, inter, bits)  # e = exp(-|g|) in (0, 1]
        for i in range(inter):
            g = gu[t, i]
            s = np.float32(1.0) / (np.float32(1.0) + e[i])
            sig = s if g >= 0 else e[i] * s
            out[t, i] = g * sig * gu[t, inter + i]


def _make_step(D: int, G: int, bf16: bool, vnni: bool):
    """The fused decode step for head_dim D, GQA group G, the KV cache's element type (bf16
    as uint16 bits, else fp32) and the GEMV variant (vnni: AVX-512 VNNI, else AVX2). It
    closes over those plain values only, which key Numba's disk cache, so the next process
    finds it (see cpu_decode._make_kernel) and an ISA cap (MOONCAKED_CPU_ISA) gets its own."""

    @numba.njit(**_JIT)
    def step(h, pos, slots, tables, lens, qkv_c, qkv_d, qkv_m, o_c, o_d, o_m, gu_c, gu_d, gu_m,
             dn_c, dn_d, dn_m, attn_norm, mlp_norm, cos, sin, kv, layer_stride, v_delta, block_size,
             block_stride, token_stride, head_stride, num_heads, num_kv, eps, qscale):  # pragma: no cover
        T, H = h.shape
        L = qkv_c.shape[0]
        half = D // 2
        q_size, kv_size = num_heads * D, num_kv * D
        inter = gu_c.shape[1] // 2
        x = np.empty((T, H), np.float32)
        # int8 activations of each matmul input width (contiguous rows: the GEMV's layout)
        xq_h, dx_h, xs_h = _qbufs(T, H)
        xq_q, dx_q, xs_q = _qbufs(T, q_size)
        xq_i, dx_i, xs_i = _qbufs(T, inter)
        qkv = np.empty((T, q_size + 2 * kv_size), np.float32)
        qkv_u = qkv.view(np.uint32)
        q16 = np.empty((T, num_heads, D), kv.dtype)  # q and attention output, as the cache
        o16 = np.empty((T, num_heads, D), kv.dtype)
        a = np.empty((T, q_size), np.float32)
        a_u = a.view(np.uint32)
        proj = np.empty((T, H), np.float32)
        gu = np.empty((T, 2 * inter), np.float32)
        act = np.empty((T, inter), np.float32)
        e = np.empty(inter, np.float32)
        bits = np.empty(inter, np.int32)
        for layer in range(L):
            # attention block
            _rms_norm(h, attn_norm[layer], eps, x)
            _quant(x, xq_h, dx_h, xs_h, 0)
            cpu_gemv.gemv_q4(qkv_c[layer], qkv_d[layer], qkv_m[layer], xq_h, dx_h, xs_h, qkv, vnni)
            for t in range(T):  # rotary on q and k heads (interleaved pairs), fp32
                c, s = cos[pos[t]], sin[pos[t]]
                row = qkv[t]
                for hd in range(num_heads + num_kv):
                    base = hd * D
                    for i in range(half):
                        x0, x1 = row[base + 2 * i], row[base + 2 * i + 1]
                        row[base + 2 * i] = x0 * c[i] - x1 * s[i]
                        row[base + 2 * i + 1] = x0 * s[i] + x1 * c[i]
                slot = slots[t]
                k_base = layer * layer_stride + (slot // block_size) * block_stride + (slot % block_size) * token_stride
                if bf16:
                    for hd in range(num_heads):
                        for d in range(D):
                            q16[t, hd, d] = _bf16_bits(qkv_u[t], hd * D + d)
                    for hd in range(num_kv):
                        dst_k = kv[k_base + hd * head_stride:k_base + hd * head_stride + D]
                        dst_v = kv[k_base + v_delta + hd * head_stride:k_base + v_delta + hd * head_stride + D]
                        for d in range(D):
                            dst_k[d] = _bf16_bits(qkv_u[t], q_size + hd * D + d)
                        for d in range(D):
                            dst_v[d] = _bf16_bits(qkv_u[t], q_size + kv_size + hd * D + d)
                else:
                    for hd in range(num_heads):
                        for d in range(D):
                            q16[t, hd, d] = row[hd * D + d]
                    for hd in range(num_kv):
                        dst_k = kv[k_base + hd * head_stride:k_base + hd * head_stride + D]
                        dst_v = kv[k_base + v_delta + hd * head_stride:k_base + v_delta + hd * head_stride + D]
                        for d in range(D):
                            dst_k[d] = row[q_size + hd * D + d]
                        for d in range(D):
                            dst_v[d] = row[q_size + kv_size + hd * D + d]
            attend(q16, qscale, kv, layer * layer_stride, kv, layer * layer_stride + v_delta, block_size,
                   block_stride, token_stride, head_stride, tables, lens, o16, bf16, D, G)
            ou = o16.reshape(T, q_size)
            for t in range(T):
                for i in range(q_size):
                    if bf16:
                        a_u[t, i] = np.uint32(ou[t, i]) << np.uint32(16)
                    else:
                        a[t, i] = ou[t, i]
            _quant(a, xq_q, dx_q, xs_q, 0)
            cpu_gemv.gemv_q4(o_c[layer], o_d[layer], o_m[layer], xq_q, dx_q, xs_q, proj, vnni)
            for t in range(T):
                for i in range(H):
                    h[t, i] += proj[t, i]
            # MLP block
            _rms_norm(h, mlp_norm[layer], eps, x)
            _quant(x, xq_h, dx_h, xs_h, 0)
            cpu_gemv.gemv_q4(gu_c[layer], gu_d[layer], gu_m[layer], xq_h, dx_h, xs_h, gu, vnni)
            _silu_mul(gu, inter, e, bits, act)
            _quant(act, xq_i, dx_i, xs_i, 0)
            cpu_gemv.gemv_q4(dn_c[layer], dn_d[layer], dn_m[layer], xq_i, dx_i, xs_i, proj, vnni)
            for t in range(T):
                for i in range(H):
                    h[t, i] += proj[t, i]

    return step


@numba.njit(inline="always", **_JIT)
def _qbufs(t, k):  # pragma: no cover - compiled
    """int8 activations int8 [t, k] and their dx, xs fp32 [t, k / 32]."""
    return (np.empty((t, k), np.int8), np.empty((t, k // 32), np.float32),
            np.empty((t, k // 32), np.float32))


@numba.njit(inline="always", **_JIT)
def _quant(x, xq, dx, xs, offset):  # pragma: no cover - compiled
    """Quantizes each row of x fp32 [T, K] into xq, dx, xs (cpu_gemv.quantize)."""
    for t in range(x.shape[0]):
        cpu_gemv._quantize_row(x[t], xq[t], dx[t], xs[t], offset)


_STEPS: dict[tuple[int, int, bool, bool], object] = {}


def decode_step_fn(head_dim: int, group: int, bf16: bool = True, isa: str = "avx512_vnni"):
    """The compiled step for head_dim, GQA group, KV cache element type (bf16, else fp32)
    and GEMV variant `isa` ("avx2" or "avx512_vnni"), built once, cached on disk by Numba.
    Raises: ValueError for another isa."""
    if isa not in ISAS:
        raise ValueError(f"the fused step runs on {', '.join(ISAS)}, not {isa!r}")
    key = (head_dim, group, bf16, isa == "avx512_vnni")
    if key not in _STEPS:
        _STEPS[key] = _make_step(*key)
    return _STEPS[key]


def decode_layers(w: FusedWeights, h: np.ndarray, positions: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, kv_cache: torch.Tensor,
                  num_heads: int, num_kv_heads: int, eps: float, scale: float) -> np.ndarray:
    """Runs every layer for T decode tokens (one per sequence) and writes their K/V.

    Args:
        w: the model's FusedWeights.
        h: fp32 [T, hidden], the tokens' embeddings; updated in place to the hidden states
            after the last layer (before the final norm) and returned.
        positions: int64 [T]; slot_mapping: int64 [T] (page slot of each token's K/V, >= 0).
        block_tables: int32 [T, max_blocks]; context_lens: int32 [T] (this token included).
        kv_cache: bf16 or fp32 [num_blocks, L, 2, block_size, num_kv_heads, head_dim],
            contiguous (K/V written in its dtype; q rounded to it before attention).
        num_heads, num_kv_heads: attention heads; eps: RMSNorm epsilon; scale: softmax scale.
    Returns: h.
    Raises: ValueError for a cache that is not bf16/fp32 or not contiguous.
    """
    if kv_cache.dtype not in (torch.bfloat16, torch.float32) or not kv_cache.is_contiguous():
        raise ValueError(f"fused decode needs a contiguous bf16 or fp32 KV cache, not {kv_cache.dtype}")
    _, _, _, block_size, _, head_dim = kv_cache.shape
    sb, sl, skv, st, sh, _ = kv_cache.stride()
    step = decode_step_fn(head_dim, num_heads // num_kv_heads, kv_cache.dtype == torch.bfloat16, w.isa)
    kv = _flat(kv_cache)
    off = kv_cache.storage_offset()
    if off:
        kv = kv[off:]
    step(h, positions.numpy(), slot_mapping.numpy(), block_tables.numpy(), context_lens.numpy(),
         *w.qkv, *w.o, *w.gate_up, *w.down, w.attn_norm, w.mlp_norm, w.cos, w.sin, kv, sl, skv,
         block_size, sb, st, sh, num_heads, num_kv_heads, np.float32(eps), np.float32(scale * _LOG2E))
    return h


def _make_head(vnni: bool):
    """The final RMSNorm, int8 activations and the head's GEMV (4-bit or, nibbles False,
    Q8_0) for one GEMV variant (a closure over a plain bool, as `_make_step`). `nibbles` is a
    runtime flag: a literal one would make every call from Python retry its dispatch
    (measured: 8.5 instead of 117 tok/s)."""

    @numba.njit(**_JIT)
    def head(h, norm, eps, codes, d, m, out, nibbles):  # pragma: no cover - compiled
        x = np.empty(h.shape, np.float32)
        _rms_norm(h, norm, eps, x)
        xq, dx, xs = _qbufs(h.shape[0], h.shape[1])
        if nibbles:
            _quant(x, xq, dx, xs, 0)
            cpu_gemv.gemv_q4(codes, d, m, xq, dx, xs, out, vnni)
        else:
            _quant(x, xq, dx, xs, 128)
            cpu_gemv.gemv_q8(codes, d, m, xq, dx, xs, out, vnni)

    return head


_HEADS: dict[bool, object] = {}


def head_logits(w: FusedWeights, h: np.ndarray, eps: float) -> torch.Tensor:
    """Final RMSNorm and LM head: h fp32 [T, hidden] -> fp32 logits [T, vocab] (a tensor)."""
    vnni = w.isa == "avx512_vnni"
    if vnni not in _HEADS:
        _HEADS[vnni] = _make_head(vnni)
    out = np.empty((h.shape[0], w.head.shape[0]), np.float32)
    _HEADS[vnni](np.ascontiguousarray(h, np.float32), w.norm, np.float32(eps), w.head.codes, w.head.d,
                 w.head.m, out, w.head.bits == 4)
    return torch.from_numpy(out)
