"""Weight-only quantized linears (model/quant.py) against the dequantized forward.

The bundled GGUF is Q4_1 (every projection) with a Q8_0 tied embedding/LM head.
`weight_format="auto"` keeps them as packed int4 and per-row int8; the reference is
the same file dequantized, both in bf16 (the quantized kernels' activation dtype),
on the same paged path. Measured here (3 chat prompts, 16 teacher-forced tokens):
max |logit error| 1.45-1.5 against the dequantized bf16 forward, which is the size
of bf16's own error against fp32 (1.09; the oracle test allows 2.0); greedy picks
differ only at near ties. Q4_1 maps exactly (scale d, zero m + 8d); Q8_0's per-row
requantization is the lossy step, bounded below.
"""

from __future__ import annotations

import pytest
import torch

from mooncaked.kernels import cpu_ops
from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import load_weights

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 16
MAX_ATOL = 2.0       # logits, quantized vs dequantized, both bf16 (measured 1.5)
CLEAR_MARGIN = 1.0   # where the reference's top-2 gap exceeds this, greedy picks must agree


@pytest.fixture(scope="module")
def models(bundled_model):
    cfg, tensors = load_weights(bundled_model, keep_quantized=True)
    dev = torch.device("cpu")
    ref = LlamaModel(cfg, tensors, torch.bfloat16, dev, cpu_ops, 256, weight_format="dequantized")
    q = LlamaModel(cfg, tensors, torch.bfloat16, dev, cpu_ops, 256, weight_format="auto", dense_above=None)
    return ref, q, tensors, Tokenizer(bundled_model, cfg.eos_token_ids)


def _logits(model: LlamaModel, ids: list[int], forced: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Prefill then NEW_TOKENS - 1 decode steps (greedy, or `forced`); fp32 logits per position."""
    cfg, bs = model.cfg, 16
    nb = (len(ids) + NEW_TOKENS) // bs + 1
    kv = torch.zeros(nb, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    table = torch.arange(nb - 1, -1, -1, dtype=torch.int32)[None]  # reversed pages

    def slots(ps):
        return torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in ps])

    T = len(ids)
    meta = AttentionMetadata(slots(range(T)), 0, prefill_block_tables=table,
                             prefill_cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
                             prefill_context_lens=torch.tensor([T], dtype=torch.int32))
    # the prompt's last row (num_decode_rows=0: the prefill's head), then decode rows
    rows = [model.logits(model.forward(torch.tensor(ids), torch.arange(T), meta, kv)[-1:], num_decode_rows=0)]
    toks = []
    for i, pos in enumerate(range(T, T + NEW_TOKENS - 1)):
        tok = forced[i] if forced else int(rows[-1][-1].argmax())
        toks.append(tok)
        meta = AttentionMetadata(slots([pos]), 1, decode_block_tables=table,
                                 decode_context_lens=torch.tensor([pos + 1], dtype=torch.int32))
        rows.append(model.logits(model.forward(torch.tensor([tok]), torch.tensor([pos]), meta, kv)))
    return toks, torch.cat(rows)


def test_auto_format_keeps_the_files_quantization(models):
    ref, q, _, _ = models
    assert {q.layers[0][k].kind for k in ("wqkv", "wo", "w_gate_up", "w_down")} == {"int4"}
    assert q.lm_head.kind == "int8" and q.embed is None  # tied Q8_0 head serves the lookup
    dense_bytes = sum(layer[k].nbytes() for layer in ref.layers for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    int4_bytes = sum(layer[k].nbytes() for layer in q.layers for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert int4_bytes < 0.35 * dense_bytes  # 4 bits + bf16 scale/zero per 32 vs 16 bits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_quantized_forward_matches_dequantized(models, prompt):
    ref, q, _, tok = models
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    toks, want = _logits(ref, ids, None)
    _, got = _logits(q, ids, toks)
    err = (got - want).abs().max().item()
    assert err <= MAX_ATOL, err
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
    assert clear.sum() >= len(clear) // 4  # the check below is not vacuous (7 of 16 measured)
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_q8_0_requantization_error_is_bounded(models):
    _, q, tensors, _ = models
    w = tensors["embed"].dequantize()  # the file's Q8_0 values, fp32 [vocab, hidden]
    head = q.lm_head
    back = head.q.float() * head.scales.float()[:, None]
    err = (back - w).abs()
    # Round to nearest on a per-row grid: at most half a step (plus the scale's bf16 rounding).
    step = w.abs().amax(1) / 127
    assert (err.amax(1) <= 0.5 * step * 1.01 + w.abs().amax(1) * 2 ** -8).all()
    rel = (err.norm() / w.norm()).item()
    assert rel < 0.02, rel  # measured about 0.008
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    y = head(x).float()
    y_ref = x.float() @ w.t()
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 0.03
