"""The fused CPU decode step (kernels/cpu_fused_decode.py over kernels/cpu_gemv.py), per
ISA variant.

The GEMV of every variant (portable NumPy, AVX2, AVX-512 VNNI) against its NumPy contract
and the exact weights, on odd shapes and zero / negative blocks; the GGUF blocks it keeps
against the loader's dequantization; the whole fused model on each compiled variant and
KV cache dtype (bf16, fp32) against the same file dequantized (the oracle test_quant.py
uses for torch's int4 path, with the same bounds), and batches against single sequences.
A variant this CPU cannot run is skipped through the cpu_isa marker (allowed in CI); the
portable variant and the one this CPU selects run everywhere. Measured (AVX-512 CPU, VNNI,
bf16): max |logit error| over 16 teacher-forced tokens of 4 chat prompts 0.87-1.37 against
the dequantized fp32 forward (torch's int4 path: 0.87-1.96; the bf16 dequantized forward
itself: 0.67-1.14); AMD EPYC (AVX2), the first prompt: 0.95 (fp32 cache), 1.22 (bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mooncaked.kernels import cpu_gemv, cpu_isa, cpu_ops
from mooncaked.model import quant
from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import load_weights

from test_quant import CLEAR_MARGIN, MAX_ATOL, _logits

PROMPTS = ["What is the capital of France?", "Write a short story about a lighthouse keeper.",
           "List three prime numbers."]


def _isa(level: str):
    """A parameter for an ISA variant, marked so that it runs only where the CPU has it."""
    return pytest.param(level, marks=pytest.mark.cpu_isa(level), id=level)


GEMV_VARIANTS = [_isa("portable"), _isa("avx2"), _isa("avx512_vnni")]
# the fused step's variants x the KV cache dtype (the model's: bfloat16 or float32)
FUSED_VARIANTS = [pytest.param((level, dt), marks=pytest.mark.cpu_isa(level), id=f"{level}-{name}")
                  for level in ("avx2", "avx512_vnni") for name, dt in (("bf16", torch.bfloat16),
                                                                       ("fp32", torch.float32))]


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


@pytest.mark.parametrize("isa", GEMV_VARIANTS)
@pytest.mark.parametrize("qtype", [quant.Q4_0, quant.Q4_1, quant.Q8_0])
@pytest.mark.parametrize(("rows", "cols", "t"), [(200, 576, 3), (37, 64, 1), (5, 1536, 2)])
def test_gemv_matches_its_contract_and_the_exact_product(isa, qtype, rows, cols, t):
    rng = np.random.default_rng(qtype * 1000 + rows)
    blocks = _random_blocks(rng, qtype, rows, cols)
    blocks[1, 0, 0:2] = 0  # a block whose scale d is zero
    blocks[2, 0, 0:2] = np.array([-0.015], np.float16).view(np.uint8)  # a negative scale
    if qtype == quant.Q8_0:  # the extreme int8 codes: -128 (vpmaddubsw's |q| = 128) and 127
        blocks[3 % rows, -1, 2:] = np.array([0x80, 0x7F] * 16, np.uint8)
    w = cpu_gemv.GemvWeight.from_blocks(qtype, blocks)
    qw = quant.QuantizedWeight(qtype, blocks.reshape(rows, -1), (rows, cols))
    assert np.array_equal(w.dense(), qw.dequantize().numpy())  # the file's values, exactly
    x = rng.standard_normal((t, cols)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero activation block (dx = 0)
    x[-1, 32:64] = -np.abs(x[-1, 32:64]) * 40  # a block of large negative activations
    y = cpu_gemv.gemv(w, x, isa)
    ref = cpu_gemv.gemv_reference(w, x)  # the same int8 activations, in NumPy
    assert y.shape == (t, rows) and y.dtype == np.float32
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(y - ref).max() / np.abs(ref).max()
    exact = x @ w.dense().T  # only the activations' int8 rounding separates the two
    rel = np.abs(y - exact).max() / np.abs(exact).max()
    assert 1e-5 < rel < 0.02, rel  # measured 0.005-0.006


@pytest.mark.parametrize("isa", [_isa("avx2"), _isa("avx512_vnni")])
@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q8_0])
def test_a_gemv_rows_result_does_not_depend_on_the_batch(isa, qtype):
    """9 activation rows at once (the AVX2 variant serves them 4 a weight load, then one)
    give each row the bits it gets alone, and the contract's values. (The compiled variants,
    which the fused step runs; the portable one is NumPy's BLAS, not batch-invariant.)"""
    rng = np.random.default_rng(qtype)
    w = cpu_gemv.GemvWeight.from_blocks(qtype, _random_blocks(rng, qtype, 67, 576))
    x = rng.standard_normal((9, 576)).astype(np.float32)
    x[5, 64:96] = 0.0
    y = cpu_gemv.gemv(w, x, isa)
    alone = np.concatenate([cpu_gemv.gemv(w, x[i:i + 1], isa) for i in range(9)])
    assert np.array_equal(y, alone)
    ref = cpu_gemv.gemv_reference(w, x)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_gemv_rejects_an_odd_number_of_blocks():
    blocks = _random_blocks(np.random.default_rng(0), quant.Q4_1, 4, 96)  # 3 blocks a row
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_gemv.GemvWeight.from_blocks(quant.Q4_1, blocks)


def test_the_selected_gemv_variant_follows_the_isa_level(monkeypatch):
    """variant() is the highest variant the (capped) ISA level runs; a variant the CPU
    lacks is refused, not run."""
    monkeypatch.delenv(cpu_isa.ENV_CAP, raising=False)
    level = cpu_isa.isa_level()
    want = {"portable": "portable", "avx2": "avx2"}.get(level, "avx512_vnni")
    assert cpu_gemv.variant() == want
    assert cpu_gemv.supported() == (want != "portable")
    monkeypatch.setenv(cpu_isa.ENV_CAP, "portable")
    assert cpu_gemv.variant() == "portable" and not cpu_gemv.supported()
    w = cpu_gemv.GemvWeight.from_blocks(quant.Q4_1, _random_blocks(np.random.default_rng(1), quant.Q4_1, 3, 64))
    with pytest.raises(ValueError, match="this CPU runs portable"):
        cpu_gemv.gemv(w, np.ones((1, 64), np.float32), "avx2")
    with pytest.raises(ValueError, match="variant 'neon'"):
        cpu_gemv.gemv(w, np.ones((1, 64), np.float32), "neon")


@pytest.fixture(scope="module")
def weights(bundled_model):
    cfg, tensors = load_weights(bundled_model, keep_quantized=True)
    ref = LlamaModel(cfg, tensors, torch.float32, torch.device("cpu"), cpu_ops, 256, weight_format="dequantized")
    return cfg, tensors, ref, Tokenizer(bundled_model, cfg.eos_token_ids)


def _fused_model(cfg, tensors, dtype: torch.dtype, isa: str) -> LlamaModel:
    """The bundled model with the fused step on the GEMV variant `isa` (the ISA capped to it
    while the model is built, which is when the variant is chosen)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_isa.ENV_CAP, isa)
        model = LlamaModel(cfg, tensors, dtype, torch.device("cpu"), cpu_ops, 256, weight_format="auto",
                           dense_above=None, fused_decode_max_batch=4)
    return model


@pytest.fixture(scope="module", params=FUSED_VARIANTS)
def models(request, weights):
    """(reference fp32 model, fused model, tensors, tokenizer) for one (variant, dtype)."""
    cfg, tensors, ref, tok = weights
    isa, dtype = request.param
    return ref, _fused_model(cfg, tensors, dtype, isa), tensors, tok


def test_the_bundled_model_runs_fused_and_keeps_the_files_blocks(models):
    ref, fused, tensors, _ = models
    assert fused.fused_decode_reason is None and fused.fused is not None
    assert fused.fused.isa in ("avx2", "avx512_vnni")
    assert fused.fused.head.bits == 8  # the tied Q8_0 embedding / LM head
    assert np.array_equal(fused.fused.head.rows(np.array([7, 42])),
                          tensors["embed"].dequantize().numpy()[[7, 42]])
    # the file's bytes: Q4_1 is 20 bytes a block of 32, Q8_0 34
    linear = sum(t.data.nbytes for k, t in tensors.items() if k.startswith("layers.")
                 and isinstance(t, quant.QuantizedWeight))
    assert fused.fused.nbytes() == linear + tensors["embed"].data.nbytes


def test_why_not_says_what_the_fused_step_needs(weights):
    """The model says why it runs the per-op path: the weight format, or a CPU level with
    no compiled GEMV variant (here forced by the ISA cap)."""
    cfg, tensors, _, _ = weights
    dev = torch.device("cpu")
    deq = LlamaModel(cfg, tensors, torch.float32, dev, cpu_ops, 64, weight_format="dequantized",
                     fused_decode_max_batch=4)
    assert deq.fused is None and "weight_format = auto" in deq.fused_decode_reason
    assert "dequantized" in deq.fused_decode_reason
    portable = _fused_model(cfg, tensors, torch.float32, "portable")
    assert portable.fused is None and "AVX2+FMA" in portable.fused_decode_reason
    assert "portable" in portable.fused_decode_reason


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
    assert model.fused is not None
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    nb = sum(len(p) // bs + 2 for p in prompts)
    kv = torch.zeros(nb, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
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
        assert hidden.dtype == torch.float32  # the fused step ran (or an fp32 model's forward)
        return model.logits(hidden)

    alone_kv = kv.clone()
    alone = torch.cat([decode([i], alone_kv) for i in range(3)])
    together = decode([0, 1, 2], kv)
    assert torch.equal(together, alone)
    assert torch.equal(kv, alone_kv)
    assert not torch.equal(alone[0], alone[1])  # different sequences, different logits


def test_each_row_kind_takes_one_head_whatever_shares_the_step(models):
    """Decode rows take the fused head (fp32 logits off the file's blocks, int8 activations
    per row) in any number; a prompt's last row takes the dense fp32 head on an fp32 model
    (float32's exact first token) and the fused head on a bf16 one (not bf16-rounded
    logits, where near ties became exact ties). A row's logits never depend on the others."""
    ref, model, _, _ = models
    h = torch.randn(12, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    h = h.to(torch.bfloat16).to(model.dtype)
    dec = model.logits(h)  # all decode rows: more than the old batch limit of 8
    assert dec.dtype == torch.float32 and dec.shape == (12, model.cfg.vocab_size)
    assert (dec.to(torch.bfloat16).float() != dec).float().mean() > 0.9  # not on the bf16 grid
    want = ref.logits(h.float())  # the dequantized fp32 head
    assert (dec - want).abs().max() < 0.5  # only the int8 activations' rounding apart
    assert (dec - want).abs().max() > 0    # (and not the dense head)
    assert torch.equal(model.logits(h[:1]), dec[:1]) and torch.equal(model.logits(h[5:7]), dec[5:7])
    mixed = model.logits(h, num_decode_rows=4)
    assert torch.equal(mixed[:4], dec[:4])
    if model.dtype == torch.float32:  # the dense fp32 head: the reference's weights
        assert torch.equal(mixed[4:], model.logits(h[4:], num_decode_rows=0))
        assert torch.allclose(mixed[4:], ref.logits(h[4:]), atol=1e-4)
    else:
        assert torch.equal(mixed[4:], dec[4:])


def test_a_decode_beside_a_prefill_chunk_gets_the_logits_it_gets_alone(models):
    """A mixed step (decodes + prefill chunks) runs its decodes through the fused step
    too: the decode's logits and K/V equal those of a decode-only step (batch invariance)."""
    _, model, _, tok = models
    cfg, bs = model.cfg, 16
    a, b = (tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:2])
    kv = torch.zeros(16, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
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


def test_a_prompts_rows_are_the_same_in_any_chunking(models):
    """The prompt rows (the per-op path of a model with the fused step) give each row the
    same K/V and hidden state bit for bit whether the prompt runs whole or as a long chunk
    and a 2-row one (a prefix hit's short suffix): LlamaModel._linear pads small products,
    whose rows torch computes differently, and prefill attention runs in aligned blocks
    (reference.paged_prefill_attention_aligned). Else the fused step's int8 activations would
    turn the last bits into logprob differences later. fp32 models only (dtype auto on
    CPUs without native bf16): a bf16 model's prompt path (torch's int4 kernel, bf16 SDPA)
    is not row-invariant yet (the chunked K/V differ in the last bf16 bit here)."""
    _, model, _, tok = models
    if model.dtype != torch.float32:
        return
    assert_prompt_rows_chunk_invariant(model, tok)


def assert_prompt_rows_chunk_invariant(model: LlamaModel, tok: Tokenizer) -> None:
    """A chat prompt prefilled whole and in three chunkings (a prefix hit's 2-row suffix,
    chunked prefill): the same pages and hidden states bit for bit, and the same first-token
    head row in a batch of 1 or 3 rows."""
    cfg, bs = model.cfg, 16
    p = tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])
    n = len(p)
    table = torch.arange(0, n // bs + 1, dtype=torch.int32)[None]

    def prefill(kv, start, end):
        meta = AttentionMetadata(torch.tensor([int(table[0, i // bs]) * bs + i % bs for i in range(start, end)]),
                                 0, prefill_block_tables=table,
                                 prefill_cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
                                 prefill_context_lens=torch.tensor([end], dtype=torch.int32))
        return model.forward(torch.tensor(p[start:end]), torch.arange(start, end), meta, kv)

    whole_kv = torch.zeros(table.shape[1], cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    whole = prefill(whole_kv, 0, n)
    assert n > 20
    for cuts in ([0, n - 2, n], [0, 16, n], [0, 7, 20, n]):  # a prefix hit's suffix, chunked prefill
        kv = torch.zeros_like(whole_kv)
        hidden = torch.cat([prefill(kv, a, b) for a, b in zip(cuts, cuts[1:])])
        assert torch.equal(kv, whole_kv), cuts
        assert torch.equal(hidden, whole), cuts
    first = model.logits(whole[-1:], num_decode_rows=0)  # the dense head, padded: any row count
    assert torch.equal(model.logits(whole[-3:], num_decode_rows=0)[-1:], first)


_COMPILE_VNNI = """
from numba import types
from mooncaked.kernels import cpu_gemv
a2 = lambda dt: types.Array(dt, 2, "C")
sig = (a2(types.uint8), a2(types.uint16), a2(types.uint16), a2(types.int8), a2(types.float32),
       a2(types.float32), a2(types.float32), types.boolean)
for f in (cpu_gemv._gemv_vnni, cpu_gemv._gemv_avx2):
    f.compile(sig)
    asm = "\\n".join(f.inspect_asm().values())
    print(f.__name__, "vpdpbusd" in asm, "vpmaddubsw" in asm, "zmm" in asm)
"""


@pytest.mark.cpu_isa("avx2")
def test_each_compiled_variant_has_its_own_instructions(tmp_path):
    """Compiled (not run) for an AVX-512 VNNI target in a child process, so an x86 CPU
    without AVX-512 still checks that variant's code: vpdpbusd in the VNNI GEMV only, and
    the AVX2 GEMV with vpmaddubsw and no 512-bit register."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_CPU_NAME="icelake-server",
               NUMBA_CPU_FEATURES="+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512vnni,+avx2,+avx,+fma,+f16c")
    out = subprocess.run([sys.executable, "-c", _COMPILE_VNNI], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["_gemv_vnni True False True", "_gemv_avx2 False True False"], out.stdout
