"""Small fused CPU kernels (Numba) for the per-layer work of a decode step.

At batch 1 a decode step is ~60 torch dispatches per layer, most of them tiny:
`F.rms_norm` alone is eight (cast, pow, mean, add, rsqrt, mul, mul, cast) and
`reference.write_kv` another eight (mask, all, sync, div, mul, sub, two
index_puts). Each of these is one Numba call here, with the same contract and
fp32 arithmetic. Both fall back to the torch code for layouts or dtypes they
do not handle.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
import torch.nn.functional as F

from . import reference
from .cpu_decode import _flat, _np

__all__ = ["rms_norm", "rotary_", "write_kv"]

_JIT = {"cache": True, "fastmath": True, "nogil": True, "boundscheck": False}


@numba.njit(**_JIT)
def _write_kv(k, v, slots, kf, k_off, vf, v_off, block_size, block_stride, token_stride,
              head_stride):  # pragma: no cover - compiled
    num_heads, head_dim = k.shape[1], k.shape[2]
    for t in range(k.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        base = (slot // block_size) * block_stride + (slot % block_size) * token_stride
        for h in range(num_heads):
            o = base + h * head_stride
            dk = kf[k_off + o:k_off + o + head_dim]  # slices: no per-element wraparound
            dv = vf[v_off + o:v_off + o + head_dim]
            for d in range(head_dim):
                dk[d] = k[t, h, d]
            for d in range(head_dim):
                dv[d] = v[t, h, d]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """reference.write_kv's contract (k, v: [T, num_kv_heads, head_dim] in the cache's dtype;
    slot -1 skips a token), one Numba call for bf16/fp32 CPU caches."""
    if (k_cache.dtype not in (torch.bfloat16, torch.float32) or k.dtype != k_cache.dtype
            or v.dtype != k_cache.dtype or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride()
            or k.stride(-1) != 1 or v.stride(-1) != 1 or slot_mapping.dtype != torch.long):
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    kf = _flat(k_cache)
    same = k_cache.untyped_storage().data_ptr() == v_cache.untyped_storage().data_ptr()
    sb, st, sh, _ = k_cache.stride()
    _write_kv(_np(k.detach()), _np(v.detach()), slot_mapping.numpy(), kf, k_cache.storage_offset(),
              kf if same else _flat(v_cache), v_cache.storage_offset(), k_cache.shape[1], sb, st, sh)


def _make_rms(bf16: bool):
    @numba.njit(**_JIT)
    def rms(x, w, eps, out):  # pragma: no cover - compiled
        n = x.shape[1]
        f = np.empty(n, np.float32)
        u = f.view(np.uint32)
        wf = np.empty(n, np.float32)
        wu = wf.view(np.uint32)
        for i in range(n):
            if bf16:
                wu[i] = np.uint32(w[i]) << np.uint32(16)
            else:
                wf[i] = w[i]
        for t in range(x.shape[0]):
            for i in range(n):
                if bf16:
                    u[i] = np.uint32(x[t, i]) << np.uint32(16)
                else:
                    f[i] = x[t, i]
            ss = np.float32(0.0)
            for i in range(n):
                ss += f[i] * f[i]
            r = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
            for i in range(n):
                f[i] = f[i] * r * wf[i]
            if bf16:  # round to nearest even, as torch's fp32 -> bf16 cast
                for i in range(n):
                    b = u[i]
                    out[t, i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                                          >> np.uint32(16))
            else:
                for i in range(n):
                    out[t, i] = f[i]

    return rms


_RMS = {torch.bfloat16: _make_rms(True), torch.float32: _make_rms(False)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (hidden,), weight, eps) for x [T, hidden], computed in fp32 like torch's
    (x * rsqrt(mean(x^2) + eps) * weight, one rounding to x's dtype). Other shapes/dtypes
    use F.rms_norm. At every T: bf16 [T, 576], one thread, F.rms_norm against this kernel
    (medians of 31): T = 128 57 vs 21 us, 512 394 vs 69 us, 1,000 2,224 vs 130 us (the
    prefill's norms were 120 ms of a 950 ms 1,000-token prefill); equal bf16 outputs."""
    kern = _RMS.get(x.dtype)
    if kern is None or x.dim() != 2 or weight.dtype != x.dtype or x.stride(-1) != 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    kern(_np(x.detach()), _np(weight), np.float32(eps), _np(out))
    return out


@numba.njit(cache=True, nogil=True, boundscheck=False)  # no fastmath: no FMA contraction, torch's rounding
def _rotary_bf16(qk, cos, sin, pos):  # pragma: no cover - compiled
    T, H, D = qk.shape
    half = D // 2
    f = np.empty(D, np.float32)
    u = f.view(np.uint32)
    for t in range(T):
        c, s = cos[pos[t]], sin[pos[t]]
        for h in range(H):
            row = qk[t, h]
            for i in range(D):
                u[i] = np.uint32(row[i]) << np.uint32(16)
            for j in range(half):
                x0, x1 = f[2 * j], f[2 * j + 1]
                f[2 * j] = x0 * c[j] - x1 * s[j]
                f[2 * j + 1] = x0 * s[j] + x1 * c[j]
            for i in range(D):  # round to nearest even, as torch's fp32 -> bf16 cast
                b = u[i]
                row[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def rotary_(qk: torch.Tensor, cos: np.ndarray, sin: np.ndarray, positions: torch.Tensor) -> bool:
    """Rotates qk in place (rotary embedding of interleaved pairs, fp32 arithmetic, one
    rounding back: bitwise the model's complex multiply) and returns True; returns False
    (nothing done) for anything but a bf16 CPU qk with a unit head_dim stride.

    Args: qk: bf16 [T, heads, head_dim] (may be a strided view of the QKV output);
        cos, sin: fp32 [max_positions, head_dim / 2]; positions: int64 [T].
    Measured: 0.55 vs 0.84 ms a layer at T = 1,000 (one thread)."""
    if qk.dtype != torch.bfloat16 or qk.device.type != "cpu" or qk.stride(-1) != 1 or qk.dim() != 3:
        return False
    _rotary_bf16(_np(qk.detach()), cos, sin, positions.numpy())
    return True
