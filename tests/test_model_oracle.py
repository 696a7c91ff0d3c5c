"""Our forward pass against Hugging Face transformers on the same weights (the oracle).

Tolerance: fp32 last-position logits within 2e-3 absolute (logits are O(10)); greedy
tokens identical.
"""

from __future__ import annotations

import pytest
import torch

from mooncaked.kernels import reference
from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.tokenizer import Tokenizer
from mooncaked.model.weights import load_weights

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]
LOGIT_ATOL = 2e-3
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(bundled_model):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(bundled_model.parent), gguf_file=bundled_model.name, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="module")
def ours(bundled_model):
    cfg, tensors = load_weights(bundled_model)
    model = LlamaModel(cfg, tensors, torch.float32, torch.device("cpu"), reference, max_positions=2048)
    return model, Tokenizer(bundled_model, cfg.eos_token_ids)


def greedy(model: LlamaModel, ids: list[int], n: int, block_size: int = 16) -> tuple[list[int], torch.Tensor]:
    """Greedy decode with one sequence on scattered pages; returns tokens and prompt logits."""
    cfg = model.cfg
    num_blocks = (len(ids) + n) // block_size + 2
    kv = torch.zeros(num_blocks * 2, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.dtype)
    table = torch.arange(num_blocks * 2 - 1, 0, -2, dtype=torch.int32)[None]  # scattered, reversed
    tbl = table[0].tolist()

    def slots(positions):
        return torch.tensor([tbl[p // block_size] * block_size + p % block_size for p in positions])

    T = len(ids)
    meta = AttentionMetadata(slots(range(T)), 0, prefill_block_tables=table,
                             prefill_cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
                             prefill_context_lens=torch.tensor([T], dtype=torch.int32))
    logits = model.logits(model.forward(torch.tensor(ids), torch.arange(T), meta, kv)[-1:])[0]
    first_logits = logits.clone()
    out = []
    for pos in range(T, T + n):
        tok = int(logits.argmax())
        out.append(tok)
        meta = AttentionMetadata(slots([pos]), 1, decode_block_tables=table,
                                 decode_context_lens=torch.tensor([pos + 1], dtype=torch.int32))
        logits = model.logits(model.forward(torch.tensor([tok]), torch.tensor([pos]), meta, kv))[0]
    return out, first_logits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_and_logits_match_transformers(ours, hf_model, prompt):
    model, tok = ours
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    mine, my_logits = greedy(model, ids, NEW_TOKENS)
    with torch.no_grad():
        ref_logits = hf_model(torch.tensor([ids])).logits[0, -1]
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                do_sample=False)[0, len(ids):].tolist()
    assert (my_logits - ref_logits).abs().max().item() < LOGIT_ATOL
    # transformers stops at EOS (id 2); compare up to and including it.
    assert len(ref) >= 5
    assert mine[:len(ref)] == ref


def test_safetensors_directory_loads_to_the_same_logits(ours, hf_model, bundled_model, tmp_path):
    """A Hugging Face checkpoint (half-split rotary layout) gives the same logits as the GGUF."""
    import json

    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    transformers = pytest.importorskip("transformers")
    transformers.AutoTokenizer.from_pretrained(str(bundled_model.parent),
                                               gguf_file=bundled_model.name).save_pretrained(tmp_path)
    cfg, tensors = load_weights(tmp_path)
    model = LlamaModel(cfg, tensors, torch.float32, torch.device("cpu"), reference, max_positions=2048)
    gguf_model, tok = ours
    st_tok = Tokenizer(tmp_path, cfg.eos_token_ids)
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    ids = tok.apply_chat_template(msgs)
    assert st_tok.apply_chat_template(msgs) == ids
    a, la = greedy(model, ids, 8)
    b, lb = greedy(gguf_model, ids, 8)
    assert a == b
    assert (la - lb).abs().max().item() < 1e-4


def test_bfloat16_forward_agrees_with_fp32_on_greedy_start(ours, bundled_model):
    cfg, tensors = load_weights(bundled_model)
    model16 = LlamaModel(cfg, tensors, torch.bfloat16, torch.device("cpu"), reference, max_positions=2048)
    model32, tok = ours
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    a, la = greedy(model16, ids, 4)
    b, lb = greedy(model32, ids, 4)
    assert a[:2] == b[:2]
    # bf16 has ~3 significant digits: logits agree to a few tenths.
    assert (la - lb).abs().max().item() < 1.5
