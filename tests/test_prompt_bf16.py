"""Prompt projections in bf16 (`dtype = auto` on AVX512-BF16; model/numerics.py,
quant.Bf16Linear, LlamaModel `prompt_dtype`) against the exact fp32 forward.

The arithmetic is torch's bf16 matmul on a CPU with native bf16 (the only CPUs auto gives
it to), so the accuracy test runs there (cpu_isa marker); emulated on AVX2 the same
products round differently (1.05 measured). Stated accuracy: every prompt row's
logits within MAX_LOGIT_ERR of the fp32 forward (measured on AMD EPYC Zen 4: 0.47-0.71
over chat prompts and 277-1,000 tokens of English text) and its greedy pick equal where
the fp32 top-2 gap exceeds CLEAR_MARGIN (measured: none changed above 0.5). Where the
start-up check finds this CPU's bf16 matmul row-invariant, the model takes bf16 and its
prompt rows keep the chunking invariance that test_fused_decode checks for fp32.
"""

from __future__ import annotations

import pytest
import torch

from mooncaked.kernels import cpu_ops
from mooncaked.model import quant
from mooncaked.model.llama import MIN_GEMM_ROWS, AttentionMetadata, LlamaModel
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import load_weights

from test_fused_decode import assert_prompt_rows_chunk_invariant

MAX_LOGIT_ERR = 1.0   # logits of prompt rows, bf16 projections vs fp32 (measured <= 0.71)
CLEAR_MARGIN = 0.5    # nats; above this fp32 top-2 gap the greedy pick must agree
TEXT = ("The lighthouse stood on a rock a mile from the shore. Every evening the keeper climbed "
        "the narrow stairs, trimmed the wick and wound the clockwork that turned the lens. Ships "
        "passing in the night saw the beam sweep the water every ten seconds, and they knew where "
        "the reef lay. In winter the storms threw spray over the gallery, and the keeper wrote in "
        "his log the hour the light was lit, the state of the sea and the ships he counted. ") * 3


def prompt_models(path, prompt_dtype: torch.dtype) -> tuple[LlamaModel, LlamaModel, Tokenizer]:
    """(fp32 dense reference, the fp32 model with the fused step and `prompt_dtype` prompt
    projections, tokenizer) of the GGUF at `path`."""
    cfg, tensors = load_weights(path, keep_quantized=True)
    dev = torch.device("cpu")
    ref = LlamaModel(cfg, tensors, torch.float32, dev, cpu_ops, 1024, weight_format="dequantized")
    model = LlamaModel(cfg, tensors, torch.float32, dev, cpu_ops, 1024, weight_format="auto",
                       fused_decode_max_batch=4, row_invariant=True, prompt_dtype=prompt_dtype)
    return ref, model, Tokenizer(path, cfg.eos_token_ids)


@pytest.fixture(scope="module")
def models(bundled_model):
    """prompt_models with bf16 prompt projections."""
    return prompt_models(bundled_model, torch.bfloat16)


def _prompt_logits(model: LlamaModel, ids: list[int], linears=None) -> torch.Tensor:
    """fp32 logits [T, vocab] of every prompt row (the dense head), one prefill."""
    cfg, bs, n = model.cfg, 16, len(ids)
    table = torch.arange(n // bs + 1, dtype=torch.int32)[None]
    kv = torch.zeros(table.shape[1], cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim)
    meta = AttentionMetadata(torch.arange(n), 0, prefill_block_tables=table,
                             prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             prefill_context_lens=torch.tensor([n], dtype=torch.int32))
    return model._dense_logits(model.forward(torch.tensor(ids), torch.arange(n), meta, kv))


def _bf16_linears(bf: LlamaModel, ref: LlamaModel) -> None:
    """Where the start-up check kept fp32 (this CPU's bf16 matmul is not row-invariant), the
    accuracy test still measures the bf16 arithmetic: the reference's projections as bf16."""
    if bf.prompt_matmul == "bfloat16":
        return
    for mine, theirs in zip(bf.layers, ref.layers):
        for k in ("wqkv", "wo", "w_gate_up", "w_down"):
            mine[k] = quant.Bf16Linear(theirs[k].weight)


def assert_prompt_rows_near(ref: LlamaModel, model: LlamaModel, tok: Tokenizer, max_logit_err: float,
                            logprob_atol: float | None = None) -> None:
    """Two chat prompts and 277 tokens of English text through `model` and the fp32 `ref`:
    every prompt row's logits within max_logit_err (and not equal: the other path ran),
    greedy equal where ref's top-2 gap exceeds CLEAR_MARGIN, and with logprob_atol the
    first token's logprob within it."""
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}])
               for c in ("What is the capital of France?", "List three prime numbers.")]
    prompts.append(tok.encode(TEXT))
    assert len(prompts[-1]) > 250
    for ids in prompts:
        want, got = _prompt_logits(ref, ids), _prompt_logits(model, ids)
        err = (got - want).abs().max().item()
        assert 0 < err <= max_logit_err, err
        top2 = want.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
        if logprob_atol is not None:
            pick = want[-1].argmax()
            lp_err = torch.log_softmax(got[-1], -1)[pick] - torch.log_softmax(want[-1], -1)[pick]
            assert abs(lp_err.item()) <= logprob_atol


@pytest.mark.cpu_isa("avx512_bf16")
def test_bf16_prompt_projections_stay_within_the_stated_error(models):
    ref, bf, tok = models
    _bf16_linears(bf, ref)
    assert_prompt_rows_near(ref, bf, tok, MAX_LOGIT_ERR)


def test_bf16_linear_rounds_inputs_and_keeps_the_callers_dtype():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    lin = quant.Bf16Linear(w)
    assert lin.weight.dtype == torch.bfloat16 and lin.nbytes() == 40 * 64 * 2
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (5, 40)
    exact = x.bfloat16().double() @ w.bfloat16().double().T   # bf16 inputs, exact sums
    assert torch.allclose(y.double(), exact, rtol=2 ** -7, atol=1e-3)   # one bf16 rounding
    assert not torch.equal(y, x @ w.T)


def test_the_model_takes_bf16_where_the_check_passes_and_keeps_rows_invariant(models):
    _, bf, tok = models
    shapes = {tuple(bf.layers[0][k].weight.shape) for k in ("wqkv", "wo", "w_gate_up", "w_down")}
    invariant = quant.bf16_rows_invariant(shapes, MIN_GEMM_ROWS)
    assert bf.prompt_matmul == ("bfloat16" if invariant else "float32")
    assert (bf.prompt_matmul_why is None) == invariant
    if invariant:
        assert {bf.layers[0][k].kind for k in ("wqkv", "wo", "w_gate_up", "w_down")} == {"bf16"}
        assert_prompt_rows_chunk_invariant(bf, tok)


def test_bf16_prompts_need_a_row_invariant_fp32_model(bundled_model):
    cfg, tensors = load_weights(bundled_model, keep_quantized=True)
    plain = LlamaModel(cfg, tensors, torch.float32, torch.device("cpu"), cpu_ops, 64,
                       weight_format="dequantized", prompt_dtype=torch.bfloat16)
    assert plain.prompt_matmul == "float32" and "row-invariant" in plain.prompt_matmul_why
    assert plain.layers[0]["wqkv"].kind == "dense"
