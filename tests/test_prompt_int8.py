"""Prompt projections with int8 activations (`dtype = auto` on AVX2 and AVX-512 without bf16;
model/numerics.py, quant.Int8ActLinear over kernels/cpu_gemm.py) against the exact fp32
forward of the same weights.

Stated accuracy: every prompt row's logits within MAX_LOGIT_ERR of the fp32 forward
(measured on the bundled model, AMD EPYC Zen 4: 1.26-1.68 over chat prompts and 265-277
tokens of English text), the greedy pick equal where the fp32 top-2 gap exceeds
test_prompt_bf16's CLEAR_MARGIN (measured: none changed above 0.5; over 30 chat questions
5 first tokens changed, each at an fp32 gap <= 0.11), and the first token's logprob
within LOGPROB_ATOL (measured <= 0.28). The kernel is row-invariant by construction, so
the prompt rows keep the chunking invariance that test_fused_decode checks for fp32.
"""

from __future__ import annotations

import pytest
import torch

from mooncaked.kernels import cpu_ops
from mooncaked.model import quant
from mooncaked.model.llama import LlamaModel
from mooncaked.model.weights import load_weights

from test_fused_decode import assert_prompt_rows_chunk_invariant
from test_prompt_bf16 import assert_prompt_rows_near, prompt_models

pytestmark = pytest.mark.cpu_isa("avx2")

MAX_LOGIT_ERR = 2.0   # logits of prompt rows, int8 activations vs fp32 (measured <= 1.68)
LOGPROB_ATOL = 0.5    # the first token's logprob (test_numerics' bound; measured <= 0.28)
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


@pytest.fixture(scope="module")
def models(bundled_model):
    """test_prompt_bf16's prompt_models with int8 prompt projections."""
    return prompt_models(bundled_model, torch.int8)


def test_int8_prompt_projections_stay_within_the_stated_error(models):
    ref, i8, tok = models
    assert i8.prompt_matmul == "int8" and i8.prompt_matmul_why is None
    assert {i8.layers[0][k].kind for k in PROJECTIONS} == {"int8-activations"}
    assert_prompt_rows_near(ref, i8, tok, MAX_LOGIT_ERR, LOGPROB_ATOL)


def test_int8_prompt_rows_are_chunk_invariant_and_smaller(models):
    ref, i8, tok = models
    assert_prompt_rows_chunk_invariant(i8, tok)
    # a byte a weight and two fp32 per block of 32 (1.25 bytes), against 4 for the fp32 copy
    mine = sum(i8.layers[0][k].nbytes() for k in PROJECTIONS)
    dense = sum(ref.layers[0][k].nbytes() for k in PROJECTIONS)
    assert mine == dense * 1.25 / 4


def test_int8_prompts_need_a_row_invariant_fp32_model_of_q4_blocks(bundled_model):
    cfg, tensors = load_weights(bundled_model, keep_quantized=True)
    plain = LlamaModel(cfg, tensors, torch.float32, torch.device("cpu"), cpu_ops, 64,
                       weight_format="dequantized", prompt_dtype=torch.int8)
    assert plain.prompt_matmul == "float32" and "row-invariant" in plain.prompt_matmul_why
    assert plain.layers[0]["wqkv"].kind == "dense"
    one_dense = {**tensors, "layers.3.wo": quant.dense(tensors["layers.3.wo"])}
    mixed = LlamaModel(cfg, one_dense, torch.float32, torch.device("cpu"), cpu_ops, 64,
                       weight_format="auto", row_invariant=True, prompt_dtype=torch.int8)
    assert mixed.prompt_matmul == "float32" and "layers.3.wo is not Q4_0/Q4_1" in mixed.prompt_matmul_why
