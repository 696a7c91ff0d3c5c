"""The CUDA serving path's pieces that run on the CPU (issue 16): dummy weights from a
config.json, CUDA-graph bucket selection and padding, the pinned-staging hand-over with
CPU tensors standing in for the GPU's, and `gpu_serve.sh --dry-run` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mooncaked.engine.cuda_graph import (
    DecodeInputs,
    bucket_for,
    decode_inputs,
    graph_buckets,
    pad_decode,
)
from mooncaked.engine.model_runner import ModelRunner
from mooncaked.engine.staging import HostStaging, host_buffer
from mooncaked.kernels import reference
from mooncaked.model.dummy import INIT_STD, dummy_tensors, read_hf_config, tensor_shapes
from mooncaked.model.llama import AttentionMetadata, LlamaModel
from mooncaked.model.weights import LAYER_TENSORS, ModelLoadError

ROOT = Path(__file__).resolve().parent.parent
CONFIG_8B = ROOT / "benchmarks" / "configs" / "llama3_8b.json"
CONFIG_TINY = ROOT / "benchmarks" / "configs" / "tiny_llama.json"


@pytest.fixture(scope="module")
def tiny():
    """(config, fp32 LlamaModel on the torch reference ops) of the tiny dummy config."""
    cfg, _ = read_hf_config(CONFIG_TINY)
    tensors = dummy_tensors(cfg, torch.float32, "cpu", seed=0)
    return cfg, LlamaModel(cfg, tensors, torch.float32, torch.device("cpu"), reference, max_positions=256)


# ---------------------------------------------------------------- dummy weights


def test_llama3_8b_config_shapes():
    cfg, path = read_hf_config(CONFIG_8B)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.intermediate_size) == (32, 4096, 32, 8, 128, 128256, 14336)
    assert path == CONFIG_8B and not cfg.tie_word_embeddings
    shapes = tensor_shapes(cfg)
    assert shapes["layers.0.wq"] == (4096, 4096) and shapes["layers.31.wk"] == (1024, 4096)
    assert shapes["layers.7.w_gate"] == (14336, 4096) and shapes["layers.7.w_down"] == (4096, 14336)
    assert shapes["lm_head"] == shapes["embed"] == (128256, 4096)
    assert len(shapes) == 3 + 32 * len(LAYER_TENSORS)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 8.0e9 < params < 8.1e9   # Llama-3-8B: 8.03 billion


def test_dummy_tensors_shapes_dtypes_and_seed():
    cfg, _ = read_hf_config(CONFIG_TINY)
    t = dummy_tensors(cfg, torch.bfloat16, "cpu", seed=1)
    assert {k: tuple(v.shape) for k, v in t.items()} == tensor_shapes(cfg)
    assert "lm_head" not in t   # tied in this config
    assert all(v.dtype == torch.bfloat16 and v.is_contiguous() for v in t.values())
    assert torch.equal(t["norm"], torch.ones(cfg.hidden_size, dtype=torch.bfloat16))
    assert abs(t["embed"].float().std().item() - INIT_STD) < 0.002
    again, other = dummy_tensors(cfg, torch.bfloat16, "cpu", seed=1), dummy_tensors(cfg, torch.bfloat16, "cpu", seed=2)
    assert torch.equal(again["layers.1.wq"], t["layers.1.wq"])
    assert not torch.equal(other["layers.1.wq"], t["layers.1.wq"])


def test_bad_configs_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_hf_config(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="not Llama-family"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="missing key"):
        read_hf_config(tmp_path)


# ---------------------------------------------------------------- CUDA-graph buckets


def test_graph_buckets_and_selection():
    assert graph_buckets(256, 64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(20, 64) == (1, 2, 4, 8, 16, 20)   # the cap itself is a bucket
    assert graph_buckets(3, 64) == (1, 2, 3)
    assert graph_buckets(0, 64) == () and graph_buckets(8, 0) == ()
    b = graph_buckets(64, 64)
    assert [bucket_for(n, b) for n in (0, 1, 2, 3, 5, 8, 9, 63, 64, 65)] == [None, 1, 2, 4, 8, 8, 16, 64, 64, None]


def _decode_step(cfg, n: int, width: int, ctx: list[int]) -> DecodeInputs:
    tables = torch.tensor([[1 + r * width + j for j in range(width)] for r in range(n)], dtype=torch.int32)
    slots = torch.tensor([int(tables[r, (c - 1) // 4]) * 4 + (c - 1) % 4 for r, c in enumerate(ctx)])
    return DecodeInputs(torch.tensor([7, 8, 9][:n]), torch.tensor([c - 1 for c in ctx]), slots, tables,
                        torch.tensor(ctx, dtype=torch.int32))


def test_pad_decode_values_and_errors(tiny):
    cfg, _ = tiny
    step = _decode_step(cfg, 3, 2, [5, 6, 8])
    p = pad_decode(step, 8, 5)
    assert p.num_seqs == 8 and p.block_tables.shape == (8, 5)
    assert p.input_ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert p.slot_mapping[3:].tolist() == [-1] * 5 and p.slot_mapping[:3].tolist() == step.slot_mapping.tolist()
    assert p.context_lens.tolist() == [5, 6, 8, 1, 1, 1, 1, 1] and p.context_lens.dtype == torch.int32
    assert torch.equal(p.block_tables[:3, :2], step.block_tables) and int(p.block_tables[:, 2:].abs().sum()) == 0
    assert int(p.block_tables[3:].abs().sum()) == 0
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode(step, 2, 5)
    with pytest.raises(ValueError, match="exceed"):
        pad_decode(step, 4, 1)
    mixed = AttentionMetadata(step.slot_mapping, 2, decode_block_tables=step.block_tables[:2])
    assert decode_inputs(step.input_ids, step.positions, mixed) is None


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_padded_step_computes_the_same_rows_and_writes_no_kv(tiny, kernels):
    """What a graph replays (padded rows, wide tables) equals the eager step on the real
    rows, and padded rows leave the pages untouched; with the torch ops and with the
    Triton kernels the GPU replays (here under the interpreter)."""
    cfg, model = tiny
    if kernels == "triton":
        from mooncaked.kernels import triton_ops
        model = LlamaModel(cfg, dummy_tensors(cfg, torch.float32, "cpu", seed=0), torch.float32,
                           torch.device("cpu"), triton_ops, max_positions=256)
    kv = torch.randn(16, cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim)
    step = _decode_step(cfg, 3, 2, [5, 6, 8])

    def run(s: DecodeInputs, pages: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata(s.slot_mapping, s.num_seqs, decode_block_tables=s.block_tables,
                                 decode_context_lens=s.context_lens)
        return model.forward(s.input_ids, s.positions, meta, pages)

    eager_kv, padded_kv = kv.clone(), kv.clone()
    eager = run(step, eager_kv)
    padded = run(pad_decode(step, 8, 6), padded_kv)
    assert padded.shape[0] == 8
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded_kv, eager_kv, rtol=1e-5, atol=1e-5)
    # slot -1: the padded rows wrote nothing; only the real rows' slots changed
    changed = (padded_kv != kv).permute(0, 3, 1, 2, 4, 5).flatten(2).any(-1)   # [blocks, block_size]
    written = {(int(s) // 4, int(s) % 4) for s in step.slot_mapping}
    assert {tuple(ix) for ix in changed.nonzero().tolist()} == written


# ---------------------------------------------------------------- pinned staging


def test_host_staging_with_cpu_tensors(tiny):
    _, model = tiny
    runner = ModelRunner(model, num_blocks=12, block_size=4)
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache))
    stager = HostStaging("cpu")
    assert stager.stream is None
    ids = torch.tensor([5, 0, 11])
    layer = runner.kv_cache[:, 1]
    dst = host_buffer((3, *layer.shape[1:]), layer.dtype)
    assert dst.is_pinned() == torch.cuda.is_available()
    assert stager.gather(layer, ids, dst) is None   # synchronous on the CPU: no event to wait on
    assert torch.equal(dst, layer[ids])
    with pytest.raises(ValueError, match="does not match"):
        stager.gather(layer, ids, dst[:2])
    blocks, ready = runner.read_blocks_to_host([3, 7])
    assert ready is None and blocks.device.type == "cpu"
    assert torch.equal(blocks, runner.read_blocks([3, 7]))


# ---------------------------------------------------------------- gpu_serve.sh --dry-run


def test_gpu_serve_dry_run_end_to_end(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_serve.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_serve.json").read_text())
    assert res["dry_run"] and res["ok"]
    c = res["correctness"]
    assert c["ok"] and c["max_abs_logit_diff"] < 1e-4 and c["engine_tokens_equal_direct"]
    assert c["http"]["ok"] and c["http"]["completion_tokens"] == 16
    cases = res["speed"]["cases"]
    assert set(cases) == {"decode_b1", "decode_b4", "ttft_64"}
    for x in cases.values():
        assert x["ours"] > 0 and x["transformers"] > 0 and 0 < x["ours_roofline"]
    d = cases["decode_b1"]
    assert d["ratio"] == pytest.approx(d["transformers_step_s"] / d["ours_step_s"])
    assert d["ours_steps"] >= 3   # every output token after the first is one measured step
    last = r.stdout.strip().splitlines()[-9:]   # the summary, printed again at the very end
    assert last[0].startswith("gpu_serve: cpu") and last[1].startswith("correctness (dummy, fp32")
    assert last[-2].startswith("targets:") and last[-1] == "gpu_serve exit status: 0"


# ---------------------------------------------------------------- on a GPU (gpu_serve.sh runs these first)

needs_cuda = pytest.mark.gpu(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_graph_replay_matches_eager_on_gpu():
    from mooncaked.engine.cuda_graph import CudaGraphRunner
    from mooncaked.kernels import attention_ops

    cfg, _ = read_hf_config(CONFIG_TINY)
    dev = torch.device("cuda")
    model = LlamaModel(cfg, dummy_tensors(cfg, torch.float32, dev), torch.float32, dev, attention_ops(dev),
                       max_positions=256)
    kv = torch.randn(16, cfg.num_layers, 2, 4, cfg.num_kv_heads, cfg.head_dim, device=dev)
    graphs = CudaGraphRunner(model, kv, graph_buckets(8, 8), max_blocks=6)
    graphs.capture()
    step = _decode_step(cfg, 3, 2, [5, 6, 8])
    assert graphs.bucket(step) == 4
    eager_kv = kv.clone()
    replayed = graphs.run(step, 4).clone()
    meta = AttentionMetadata(step.slot_mapping.to(dev), 3, decode_block_tables=step.block_tables.to(dev),
                             decode_context_lens=step.context_lens.to(dev))
    eager = model.forward(step.input_ids.to(dev), step.positions.to(dev), meta, eager_kv)
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv, eager_kv, rtol=1e-5, atol=1e-5)   # same K/V written, nothing else
    assert graphs.replays == 1


@needs_cuda
def test_staging_copy_is_ordered_before_later_writes_on_gpu():
    pages = torch.randn(64, 2, 16, 8, 128, device="cuda")
    want = pages[[3, 9, 40]].cpu()
    stager = HostStaging("cuda")
    dst = host_buffer((3, *pages.shape[1:]), pages.dtype)
    assert dst.is_pinned()
    ready = stager.gather(pages, torch.tensor([3, 9, 40], device="cuda"), dst)
    pages.zero_()                      # the next step reusing the pages, queued right after
    ready.synchronize()
    assert torch.equal(dst, want)
    from mooncaked.engine.staging import scatter_from_host
    scatter_from_host(pages, [7, 2], dst[:2])   # and back up, without a host sync
    assert torch.equal(pages[[7, 2]].cpu(), want[:2]) and int(pages[3].abs().sum()) == 0


def test_scatter_from_host_checks_and_writes():
    from mooncaked.engine.staging import scatter_from_host

    pages = torch.zeros(6, 2, 3)
    blocks = torch.arange(12, dtype=torch.float64).reshape(2, 2, 3)
    scatter_from_host(pages, [4, 1], blocks)
    assert torch.equal(pages[4], blocks[0].float()) and torch.equal(pages[1], blocks[1].float())
    assert int(pages[[0, 2, 3, 5]].abs().sum()) == 0
    with pytest.raises(IndexError, match="outside a pool of 6"):
        scatter_from_host(pages, [6, 0], blocks)
    with pytest.raises(ValueError, match="do not match"):
        scatter_from_host(pages, [0], blocks)
