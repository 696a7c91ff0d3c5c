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

__all__ = ["rms_norm", "write_kv"]

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
    (x * rsqrt(mean(x^2) + eps) * weight, one rounding to x's dtype). Other shapes/dtypes,
    or T above 64 (torch's vectorized ops win there), use F.rms_norm."""
    kern = _RMS.get(x.dtype)
    if kern is None or x.dim() != 2 or weight.dtype != x.dtype or x.shape[0] > 64 or x.stride(-1) != 1:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    kern(_np(x.detach()), _np(weight), np.float32(eps), _np(out))
    return out
