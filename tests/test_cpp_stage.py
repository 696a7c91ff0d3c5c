"""Pipeline stages (engine/stage.py): layer split, stage-sliced weights and KV, and a
two-stage chain producing the full engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from mooncaked.config import load_settings
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.stage import StageEngine, prefill_through, split_layers
from mooncaked.engine.types import SamplingParams
from mooncaked.model.weights import ModelLoadError, bundled_model_path

MAX_STEPS = 1000


def test_split_layers_even_weighted_and_errors():
    assert split_layers(30, 2) == [range(15), range(15, 30)]
    assert split_layers(7, 3) == [range(3), range(3, 5), range(5, 7)]
    assert split_layers(30, 2, [2.0, 1.0]) == [range(20), range(20, 30)]
    assert split_layers(4, 4, [100, 1, 1, 1]) == [range(1), range(1, 2), range(2, 3), range(3, 4)]
    for bad in ((30, 0, None), (3, 4, None), (30, 2, [1.0]), (30, 2, [1.0, 0.0])):
        with pytest.raises(ValueError):
            split_layers(*bad)


@pytest.fixture(scope="module")
def stages():
    p = bundled_model_path()
    return [StageEngine(p, r, kv_cache_bytes=32 << 20, num_threads=1) for r in split_layers(30, 2)]


def test_stage_holds_only_its_layers(stages):
    s0, s1 = stages
    assert [len(s.model.layers) for s in stages] == [15, 15]
    assert s0.model.embed is not None and s0.model.norm is None
    assert s1.model.norm is not None and s1.model.lm_head is not None  # tied: the embedding
    cfg = s0.cfg
    # fp32 stages: norms are tensors, projections quant.Linear (dense here)
    per_layer = sum(x.nbytes() if hasattr(x, "nbytes") and callable(x.nbytes) else x.numel() * 4
                    for x in s0.model.layers[0].values())
    embed = cfg.vocab_size * cfg.hidden_size * 4
    # Each stage: its 15 layers plus the embedding (tied LM head on the last), not the other 15.
    assert s0.weight_bytes == pytest.approx(15 * per_layer + embed, rel=0.01)
    assert s1.weight_bytes == pytest.approx(15 * per_layer + embed + cfg.hidden_size * 4, rel=0.01)
    full = 30 * per_layer + embed
    assert s0.weight_bytes < 0.65 * full
    # KV pages hold the stage's layers only: a block is half the full engine's.
    assert s0.kv_cache.shape[1] == 15
    assert s0.block_bytes == 15 * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4


def test_bad_layer_range_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="layer range"):
        StageEngine(bundled_model_path(), range(20, 40))


def test_two_stages_give_the_full_engines_greedy_tokens(stages):
    engine = LLMEngine(load_settings(None, {"engine.max_num_batched_tokens": 64,
                                            "engine.kv_cache_bytes": 32 << 20}))
    prompt = engine.tokenizer.encode("The lighthouse keeper climbed the stairs and") * 8
    n_out = 6
    engine.add_request("ref", prompt, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True))
    ref = []
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for out in engine.step():
            ref += out.new_token_ids
    assert len(ref) == n_out
    # Prefill through the pipeline in chunks that cross block boundaries, then decode one
    # token at a time through both stages (a 1-token chunk each).
    tokens = list(prompt)
    logits = prefill_through(stages, "cpp", tokens, chunk_tokens=37)
    ours = []
    for _ in range(n_out):
        tok = int(torch.argmax(logits))
        ours.append(tok)
        tokens.append(tok)
        logits = prefill_through(stages, "cpp", tokens, start=len(tokens) - 1)
    assert ours == ref
    free = [s.num_free_blocks() for s in stages]
    assert all(s.release("cpp") for s in stages)
    assert [s.num_free_blocks() for s in stages] == [f + -(-len(tokens) // 16) for f in free]
    with pytest.raises(ValueError, match="chunk starts"):
        stages[0].run_chunk("x", 5, torch.tensor([1, 2]))
    stages[0].release("x")
