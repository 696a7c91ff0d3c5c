"""The fused CPU decode step (kernels/cpu_fused_decode.py over kernels/cpu_gemv.py).

The GEMV against its NumPy contract and against the exact weights; the GGUF blocks it
keeps against the loader's dequantization; the whole fused model against the same file
dequantized (the oracle test_quant.py uses for torch's int4 path, with the same
bounds), and batches against single sequences. Measured here: max |logit error| over
16 teacher-forced tokens of 4 chat prompts 0.87-1.37 against the dequantized fp32
forward (torch's int4 path: 0.87-1.96; the bf16 dequantized forward itself: 0.67-1.14).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mooncaked.kernels import cpu_gemv, cpu_ops
from mooncaked.model import quant
from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import load_weights

from test_quant import CLEAR_MARGIN, MAX_ATOL, _logits

pytestmark = pytest.mark.cpu_isa("avx512_vnni")

PROMPTS = ["What is the capital of France?", "Write a short story about a lighthouse keeper.",
           "List three prime numbers."]


def _random_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """GGUF blocks of random codes with realistic fp16 scales: uint8 [rows, cols/32, bytes]."""
    size = {quant.Q4_0: 18, quant.Q4_1: 20, quant.Q8_0: 34}[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 32, size), dtype=np.uint8)
    d = (rng.random((rows, cols // 32)) * 0.02).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // 32, 2)
    if qtype == quant.Q4_1:
        m = (-rng.random((rows, cols // 32)) * 0.1).astype(np.float16)
        blocks[..., 2:4] = m.view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks


@pytest.mark.parametrize("qtype", [quant.Q4_0, quant.Q4_1, quant.Q8_0])
def test_gemv_matches_its_contract_and_the_exact_product(qtype):
    rng = np.random.default_rng(qtype)
    rows, cols = 200, 576
    blocks = _random_blocks(rng, qtype, rows, cols)
    w = cpu_gemv.GemvWeight.from_blocks(qtype, blocks)
    qw = quant.QuantizedWeight(qtype, blocks.reshape(rows, -1), (rows, cols))
    assert np.array_equal(w.dense(), qw.dequantize().numpy())  # the file's values, exactly
    x = rng.standard_normal((3, cols)).astype(np.float32)
    y = cpu_gemv.gemv(w, x)
    ref = cpu_gemv.gemv_reference(w, x)  # the same int8 activations, in NumPy
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    exact = x @ w.dense().T  # only the activations' int8 rounding separates the two
    rel = np.abs(y - exact).max() / np.abs(exact).max()
    assert 1e-5 < rel < 0.02, rel  # measured 0.005-0.006


def test_gemv_rejects_an_odd_number_of_blocks():
    blocks = _random_blocks(np.random.default_rng(0), quant.Q4_1, 4, 96)  # 3 blocks a row
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_gemv.GemvWeight.from_blocks(quant.Q4_1, blocks)


@pytest.fixture(scope="module")
def models(bundled_model):
    cfg, tensors = load_weights(bundled_model, keep_quantized=True)
    dev = torch.device("cpu")
    ref = LlamaModel(cfg, tensors, torch.float32, dev, cpu_ops, 256, weight_format="dequantized")
    fused = LlamaModel(cfg, tensors, torch.bfloat16, dev, cpu_ops, 256, weight_format="auto",
                       dense_above=None, fused_decode_max_batch=4)
    return ref, fused, tensors, Tokenizer(bundled_model, cfg.eos_token_ids)


def test_the_bundled_model_runs_fused_and_keeps_the_files_blocks(models):
    ref, fused, tensors, _ = models
    assert fused.fused_decode_reason is None and fused.fused is not None
    assert fused.fused.head.bits == 8  # the tied Q8_0 embedding / LM head
    assert np.array_equal(fused.fused.head.rows(np.array([7, 42])),
                          tensors["embed"].dequantize().numpy()[[7, 42]])
    # the file's bytes: Q4_1 is 20 bytes a block of 32, Q8_0 34
    linear = sum(t.data.nbytes for k, t in tensors.items() if k.startswith("layers.")
                 and isinstance(t, quant.QuantizedWeight))
    assert fused.fused.nbytes() == linear + tensors["embed"].data.nbytes
    assert "bfloat16" in LlamaModel(ref.cfg, tensors, torch.float32, torch.device("cpu"), cpu_ops, 64,
                                    weight_format="auto", fused_decode_max_batch=4).fused_decode_reason


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fused_decode_matches_the_dequantized_forward(models, prompt):
    ref, fused, _, tok = models
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    toks, want = _logits(ref, ids, None)  # fp32, dequantized weights, greedy
    _, got = _logits(fused, ids, toks)    # teacher-forced: the same tokens
    err = (got - want).abs().max().item()
    assert err <= MAX_ATOL, err
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
    assert clear.sum() >= len(clear) // 4  # the check below is not vacuous
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_a_fused_batch_equals_its_sequences_alone(models):
    """Three sequences decoded in one fused step get the logits and KV each gets alone."""
    _, model, _, tok = models
    cfg, bs = model.cfg, 16
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    nb = sum(len(p) // bs + 2 for p in prompts)
    kv = torch.zeros(nb, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    tables, start = [], 0
    for p in prompts:  # each prompt's pages, scattered; prefill through the per-op path
        n = len(p) // bs + 2
        table = order[start:start + n][None]
        start += n
        T = len(p)
        slots = torch.tensor([int(table[0, i // bs]) * bs + i % bs for i in range(T)])
        model.forward(torch.tensor(p), torch.arange(T), AttentionMetadata(
            slots, 0, prefill_block_tables=table, prefill_cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
            prefill_context_lens=torch.tensor([T], dtype=torch.int32)), kv)
        tables.append(table)

    def decode(idx, cache):
        pos = [len(prompts[i]) for i in idx]
        width = max(tables[i].shape[1] for i in idx)
        table = torch.stack([torch.nn.functional.pad(tables[i][0], (0, width - tables[i].shape[1])) for i in idx])
        slots = torch.tensor([int(tables[i][0, p // bs]) * bs + p % bs for i, p in zip(idx, pos)])
        meta = AttentionMetadata(slots, len(idx), decode_block_tables=table,
                                 decode_context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32))
        hidden = model.forward(torch.tensor([100 + i for i in idx]), torch.tensor(pos), meta, cache)
        assert hidden.dtype == torch.float32  # the fused step ran
        return model.logits(hidden)

    alone_kv = kv.clone()
    alone = torch.cat([decode([i], alone_kv) for i in range(3)])
    together = decode([0, 1, 2], kv)
    assert torch.equal(together, alone)
    assert torch.equal(kv, alone_kv)
    assert not torch.equal(alone[0], alone[1])  # different sequences, different logits


def test_small_batches_get_fp32_logits_from_the_files_head(models):
    """A prefill's first token (bf16 hidden states, few rows) takes the fused head too:
    fp32 logits, not bf16-rounded ones (where near ties became exact ties)."""
    ref, model, _, _ = models
    h = torch.randn(2, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = model.logits(h)
    assert got.dtype == torch.float32 and got.shape == (2, model.cfg.vocab_size)
    assert (got.to(torch.bfloat16).float() != got).float().mean() > 0.9  # not on the bf16 grid
    want = ref.logits(h.float())  # the dequantized fp32 head
    assert (got - want).abs().max() < 0.5  # only the int8 activations' rounding apart
    big = torch.randn(model.fused_decode_max_batch + 1, model.cfg.hidden_size).to(torch.bfloat16)
    assert (model.logits(big).to(torch.bfloat16).float() == model.logits(big)).all()  # the per-op head


def test_a_decode_beside_a_prefill_chunk_gets_the_logits_it_gets_alone(models):
    """A mixed step (decodes + prefill chunks) runs its decodes through the fused step
    too: the decode's logits and K/V equal those of a decode-only step (batch invariance)."""
    _, model, _, tok = models
    cfg, bs = model.cfg, 16
    a, b = (tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:2])
    kv = torch.zeros(16, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    ta = torch.arange(0, 8, dtype=torch.int32)[None]
    tb = torch.arange(8, 16, dtype=torch.int32)[None]

    def slots(table, ps):
        return [int(table[0, p // bs]) * bs + p % bs for p in ps]

    n = len(a)
    model.forward(torch.tensor(a), torch.arange(n), AttentionMetadata(
        torch.tensor(slots(ta, range(n))), 0, prefill_block_tables=ta,
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32)), kv)
    dec = dict(decode_block_tables=ta, decode_context_lens=torch.tensor([n + 1], dtype=torch.int32))
    alone_kv = kv.clone()
    alone = model.logits(model.forward(torch.tensor([7]), torch.tensor([n]), AttentionMetadata(
        torch.tensor(slots(ta, [n])), 1, **dec), alone_kv))
    m = len(b)  # the same decode, beside b's whole prompt as a prefill chunk
    width = max(ta.shape[1], tb.shape[1])
    hidden = model.forward(torch.tensor([7] + b), torch.tensor([n, *range(m)]), AttentionMetadata(
        torch.tensor(slots(ta, [n]) + slots(tb, range(m))), 1, **dec,
        prefill_block_tables=torch.nn.functional.pad(tb, (0, width - tb.shape[1])),
        prefill_cu_seqlens_q=torch.tensor([0, m], dtype=torch.int32),
        prefill_context_lens=torch.tensor([m], dtype=torch.int32)), kv)
    mixed = model.logits(hidden[[0, m]])
    assert torch.equal(mixed[:1], alone)
    assert torch.equal(kv[:8], alone_kv[:8])  # a's pages: the same K/V
    assert kv[8:].abs().sum() > 0 and not torch.equal(mixed[1], mixed[0])  # b's chunk ran
