"""`model.dtype = auto` (model/numerics.py) and the kernel-path report (engine/kernel_paths.py).

The resolution is a pure function, checked for every CPU level here whatever this machine
is; the engine tests run the real bundled model: `auto` against the exact `float32` path
on this CPU. Accuracy stated by model/numerics.py: where auto resolves to float32 the
prefill's layers are the float32 engine's (same dense fp32 linears); the logits of steps
the fused step serves (decodes and their LM head rows, with int8 activations over the
GGUF blocks) keep greedy tokens equal where the fp32 reference's top-2 gap exceeds
CLEAR_MARGIN (test_quant's margin); a prefill's first token takes the dense fp32 head, so
it is the float32 engine's exactly. Where auto resolves to bfloat16 (AVX512-BF16) the first
token's logprob is within LOGPROB_ATOL. With the fused step off, auto on fp32 is the
float32 engine exactly.
"""

from __future__ import annotations

import pytest
import torch

from mooncaked.benchmarks.engine import skipped_cases
from mooncaked.config import load_settings
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.types import SamplingParams
from mooncaked.kernels import cpu_isa, cpu_ops
from mooncaked.model.numerics import DTYPE_CHOICES, resolve
from mooncaked.store.keys import make_salt

CLEAR_MARGIN = 1.0        # nats; where the fp32 reference's top-2 gap exceeds it, greedy agrees
LOGPROB_ATOL = 0.5        # first token's logprob vs fp32: bf16, or the fused step's LM head
NEW_TOKENS = 24


@pytest.mark.parametrize("isa, dtype, keep, prompt", [
    ("portable", "float32", False, "float32"), ("avx2", "float32", True, "int8"),
    ("avx512_vnni", "float32", True, "int8"), ("avx512_bf16", "float32", True, "bfloat16")])
def test_auto_on_the_cpu_is_float32_with_the_files_blocks_on_x86(isa, dtype, keep, prompt):
    n = resolve("auto", "auto", "cpu", isa)
    assert (n.dtype, n.weight_format, n.keep_quantized) == (dtype, "auto" if keep else "dequantized", keep)
    assert n.torch_dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    # bf16 prompt matmuls only where the CPU has native bf16, int8 activations on other x86
    assert n.prompt_dtype == prompt
    assert n.torch_prompt_dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                    "int8": torch.int8}[prompt]
    assert isa in n.reason
    # the exact options never take bf16 or int8 prompt matmuls
    assert resolve("auto", "dequantized", "cpu", isa).prompt_dtype == "float32"
    assert resolve("float32", "auto", "cpu", isa).prompt_dtype == "float32"


def test_explicit_float32_is_the_exact_dense_path_on_every_cpu():
    for isa in cpu_isa.LEVELS:
        for fmt in ("auto", "dequantized", "int8"):
            n = resolve("float32", fmt, "cpu", isa)
            assert (n.dtype, n.weight_format, n.keep_quantized) == ("float32", "dequantized", False)


def test_bfloat16_keeps_the_weight_format_and_cuda_keeps_no_blocks():
    assert resolve("bfloat16", "auto", "cpu", "avx2").keep_quantized
    assert not resolve("bfloat16", "dequantized", "cpu", "avx512_bf16").keep_quantized
    assert resolve("bfloat16", "int8", "cpu", "avx2").weight_format == "int8"
    for d in ("auto", "bfloat16"):
        n = resolve(d, "auto", "cuda", "avx2")
        assert (n.dtype, n.keep_quantized) == ("bfloat16", False)
    assert resolve("auto", "dequantized", "cpu", "avx2").keep_quantized is False


def test_resolve_rejects_an_unknown_dtype_and_config_offers_auto_by_default():
    with pytest.raises(ValueError, match="float16"):
        resolve("float16", "auto", "cpu", "avx2")
    s = load_settings(None, {})
    assert s.model.dtype == "auto" and "auto" in DTYPE_CHOICES


def test_prefill_path_routing():
    # fp32 prefill attention is torch SDPA on every CPU; bf16 takes cpu_prefill's kernel
    # exactly where the CPU has AVX512-BF16 and torch runs at most two threads
    assert cpu_ops.prefill_path(torch.float32, torch.float32, 64, threads=1) == "sdpa"
    bf16 = cpu_ops.prefill_path(torch.bfloat16, torch.bfloat16, 64, threads=1)
    assert bf16 == ("cpu_prefill-avx512_bf16" if cpu_isa.has("avx512_bf16") else "sdpa")
    assert cpu_ops.prefill_path(torch.bfloat16, torch.bfloat16, 64, threads=8) == "sdpa"


@pytest.fixture(scope="module")
def engines(bundled_model):
    def make(dtype):
        return LLMEngine(load_settings(None, {"model.dtype": dtype, "model.num_threads": 1,
                                              "engine.kv_cache_bytes": 32 * 1024 * 1024}))
    return make("auto"), make("float32")


def _greedy(engine: LLMEngine, prompt: list[int], rid: str):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    engine.add_request(rid, prompt, params)
    toks, lps = [], []
    while engine.has_work():
        for o in engine.step():
            toks += o.new_token_ids
            lps += o.logprobs or []
    return toks, lps


def test_auto_resolves_once_for_this_cpu_and_salts_keys_with_the_resolved_dtype(engines):
    auto, ref = engines
    want = resolve("auto", "auto", "cpu", cpu_isa.isa_level())
    assert auto.numerics == want
    assert auto.dtype == want.torch_dtype and auto.runner.kv_cache.dtype == want.torch_dtype
    assert auto.salt(None) == make_salt(auto.model_id, auto.block_size, str(want.torch_dtype), None)
    assert (auto.salt("t") == ref.salt("t")) == (want.dtype == "float32")


def test_auto_matches_the_fp32_reference(engines, bundled_model):
    auto, ref = engines
    prompt = auto.tokenizer.apply_chat_template([{"role": "user",
                                                   "content": "Name three rivers of Europe."}])
    want, want_lp = _greedy(ref, prompt, "ref")
    got, got_lp = _greedy(auto, prompt, "auto")
    assert len(got) == len(want) == NEW_TOKENS
    if auto.numerics.dtype == "float32" and auto.model.prompt_matmul == "float32":
        # the exact prefill and the dense fp32 head (LlamaModel.logits: the fused head's int8
        # activations only for decode rows), run row-invariantly (padded small matmuls,
        # aligned prefill attention: other summation orders than float32's, 1.6e-5 measured)
        assert got[0] == want[0]
        assert got_lp[0].logprob == pytest.approx(want_lp[0].logprob, abs=1e-4)
    elif auto.numerics.dtype == "float32":   # bf16 / int8 prompt projections, the fp32 head
        assert auto.model.layers[0]["wqkv"].kind == {"bfloat16": "bf16",
                                                      "int8": "int8-activations"}[auto.model.prompt_matmul]
        assert got_lp[0].logprob == pytest.approx(want_lp[0].logprob, abs=LOGPROB_ATOL)
    else:   # bf16: the fused head for the first token too
        assert got_lp[0].logprob == pytest.approx(want_lp[0].logprob, abs=LOGPROB_ATOL)
    if auto.model.fused is None and auto.numerics.dtype == "float32":
        assert got == want   # every step on the exact path
    for i, (g, w, lp) in enumerate(zip(got, want, want_lp)):
        gap = lp.top[0][1] - lp.top[1][1]
        if gap <= CLEAR_MARGIN:
            break   # a near tie: the tokens may part here, and the contexts after it
        assert g == w, f"token {i}: {g} != {w} with the reference's top-2 gap {gap:.2f}"


def test_kernel_paths_report_the_models_decisions(engines):
    auto, ref = engines
    for e in (auto, ref):
        kp = e.kernel_paths
        assert (kp.cpu, kp.isa) == (cpu_isa.cpu_name(), cpu_isa.isa_level())
        assert kp.prefill_path == ("sdpa-aligned" if e.model.row_invariant
                                   else cpu_ops.prefill_path(e.dtype, e.dtype, e.cfg.head_dim))
        assert (kp.decode_path.startswith("fused-")) == (e.model.fused is not None)
        assert kp.decode_why == e.model.fused_decode_reason
    # the exact path never runs the fused step (int8 activations)
    assert ref.model.fused is None and ref.kernel_paths.decode_path == "per-op-torch"
    assert set(auto.kernel_paths.to_json()) == {"cpu", "isa", "decode_path", "decode_why",
                                                "prefill_path", "prompt_matmul"}
    assert ref.kernel_paths.prompt_matmul == "float32"
    assert auto.kernel_paths.prompt_matmul == auto.model.prompt_matmul == (
        auto.numerics.prompt_dtype if auto.model.prompt_matmul_why is None else "float32")


def test_bench_engine_skips_only_emulated_bf16_cases():
    """`mooncake bench engine` stays bounded (issue 30): bf16 without native bf16 leaves out
    the cases that prefill tens of thousands of tokens, with the reason; nothing else skips."""
    for isa in cpu_isa.LEVELS:
        assert skipped_cases("float32", "cpu", isa, 32) == {}
    assert skipped_cases("bfloat16", "cpu", "avx512_bf16", 32) == {}
    assert skipped_cases("bfloat16", "cuda", "avx2", 32) == {}
    sk = skipped_cases("bfloat16", "cpu", "avx2", 32)
    assert set(sk) == {"concurrent_32", "ttft_cold_other_lengths", "decode_step_long_context",
                       "constrained"}
    assert all("avx2" in why and "bf16" in why for why in sk.values())
