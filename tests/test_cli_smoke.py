"""Smoke tests of the real console scripts (`.venv/bin/mooncaked`, `.venv/bin/mooncake`),
each run as a subprocess at its smallest settings with a bounded wait:

- `mooncaked config --example` and config.example.toml are `example_toml()` byte for byte;
- `mooncaked profile --tiny` writes a cost model JSON of the documented shape whose
  coefficients are the least-squares fit of the samples it records;
- `mooncake bench engine|transfer|store|conductor --json` print one object with each
  benchmark's documented fields (ours, baseline, ratio, ...), positive and finite, and
  `bench kernels` refuses with exit status 2 and a message on a machine without a GPU;
- `mooncake sim` on a four-line trace written here;
- `mooncaked serve --config config.example.toml --port P` answers /health and a completion,
  `mooncake bench trace` replays a two-line trace against it, and it exits 0 on SIGTERM.

Every process runs in its own session; a run past its timeout has its whole process group
killed.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest

from mooncaked.ports import free_port
from mooncaked.kernels import cpu_isa

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
SERVE_READY_TIMEOUT_S = 240.0   # model load on 2 shared cores
# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; K and V in float32.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
# A Mooncake-format trace (512-token blocks): requests 2 and 4 reuse the first request's two
# blocks, request 3 shares nothing. Prompt tokens 4184, of which 2 x 1024 can be cached.
TRACE_LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 100, "input_length": 1536, "output_length": 2, "hash_ids": [0, 1, 2]},
    {"timestamp": 200, "input_length": 600, "output_length": 2, "hash_ids": [3, 4]},
    {"timestamp": 300, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
]
TRACE_HIT_RATE = 2048 / 4184


def run_cli(args: list[str], timeout_s: float, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs a console script of this venv in its own session; returns the completed process.

    A run past timeout_s has its process group killed and fails the test with its output.
    """
    proc = subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True,
                            env={**os.environ, **env} if env else None)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the session this helper created
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{' '.join(args)} ran past {timeout_s} s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def json_out(cp: subprocess.CompletedProcess) -> dict:
    """The one JSON object a `--json` run printed (its last stdout line), after exit 0."""
    assert cp.returncode == 0, f"exit {cp.returncode}\n{cp.stdout[-2000:]}\n{cp.stderr[-3000:]}"
    lines = cp.stdout.strip().splitlines()
    assert lines, cp.stderr[-3000:]
    return orjson.loads(lines[-1])


def positive(x) -> bool:
    """A finite number above zero (bools excluded)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def write_trace(path: Path, lines: list[dict]) -> Path:
    """Writes a Mooncake-format trace (one JSON object a line)."""
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    return path


def http_json(url: str, body: dict | None = None, timeout_s: float = 60.0) -> tuple[int, dict]:
    """GET (body None) or POST JSON to url; returns (status, decoded body)."""
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.status, orjson.loads(r.read())


# ---------------------------------------------------------------------- config


def test_config_example_is_example_toml_byte_for_byte():
    from mooncaked.config import example_toml

    text = example_toml()
    assert (REPO / "config.example.toml").read_bytes() == text.encode()
    cp = run_cli(["mooncaked", "config", "--example"], 60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == text               # what the file's header says generated it
    cp = run_cli(["mooncaked", "config", "--check", str(REPO / "config.example.toml")], 60)
    assert cp.returncode == 0 and cp.stdout.strip().endswith(": ok"), cp.stderr


# ---------------------------------------------------------------------- warm


def test_warm_leaves_the_kernels_in_the_cache_a_later_start_loads():
    """scripts/setup.sh runs `mooncaked warm`: a later process compiles nothing (a venv set
    up before setup ran it compiles on the first call here, then not on the second)."""
    line = re.compile(r"mooncaked warm: SmolLM2-135M-Instruct\.Q4_1 \(float32, decode \S+, "
                      r"prefill \S+\) loaded in [\d.]+ s; (\d+) kernel compilations")
    for _ in range(2):
        cp = run_cli(["mooncaked", "warm"], 300)
        assert cp.returncode == 0, cp.stderr[-3000:]
        m = line.match(cp.stdout.strip())
        assert m, cp.stdout
        if m.group(1) == "0":
            break
    assert m.group(1) == "0" and "all from the cache" in cp.stdout, cp.stdout
    cp = run_cli(["mooncaked", "warm", "--set", "model.path=/nonexistent/model.gguf"], 120)
    assert cp.returncode == 1 and "cannot load the model" in cp.stderr, cp.stderr[-2000:]
    assert "/nonexistent/model.gguf" in cp.stderr


# ---------------------------------------------------------------------- profile


def test_profile_tiny_writes_a_fitted_cost_model(tmp_path):
    from mooncaked.conductor.cost_model import DECODE_TERMS, PREFILL_TERMS, CostModel

    out = tmp_path / "cost_model.json"
    cp = run_cli(["mooncaked", "profile", "--tiny", "--out", str(out),
                  "--set", f"node.state_dir={orjson.dumps(str(tmp_path / 'state')).decode()}",
                  "--set", "engine.kv_cache_bytes=67108864", "--set", "log.level=warning"], 300)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-3000:]
    assert f"cost model written to {out}" in cp.stdout
    d = orjson.loads(out.read_bytes())
    assert d["format"] == "mooncaked-cost-model" and d["version"] == 1
    assert "SmolLM2-135M-Instruct" in d["name"] and "(float32, cpu)" in d["name"]
    assert d["kv_bytes_per_token"] == SMOLLM2_KV_BYTES_PER_TOKEN
    assert positive(d["transfer"]["bandwidth_bytes_per_s"])
    assert 0 <= d["transfer"]["latency_s"] < 1.0
    meta = d["meta"]
    assert meta["source"] == "fit" and meta["block_size"] == 16
    assert meta["transfer_bytes"] == 1024 * 1024
    # The tiny grid: new (16, 32, 64) after cached (0, 32): the 32-token prefix (2 blocks)
    # is a real device-cache hit, so it shows up as cached tokens.
    prefill = meta["prefill_samples"]
    assert sorted((n, c) for n, c, _ in prefill) == [(16, 0), (16, 32), (32, 0), (32, 32),
                                                     (64, 0), (64, 32)]
    assert all(positive(s) for _, _, s in prefill)
    decode = meta["decode_samples"]
    assert len(decode) == 8                # 2 batch sizes x 2 contexts x 2 pure decode steps
    assert {b for b, _, _ in decode} == {1, 2}
    assert all(positive(c) and positive(s) for _, c, s in decode)
    assert meta["prefill_fit"]["samples"] == 6 and meta["decode_fit"]["samples"] == 8
    # The coefficients are the fit the cost model documents (least squares weighted by
    # 1/seconds, i.e. of relative errors) of the recorded samples, and the reported fit
    # errors are those of these coefficients.
    model = CostModel.load(out)
    for part, terms, samples in (("prefill", PREFILL_TERMS, prefill),
                                 ("decode", DECODE_TERMS, decode)):
        assert [tuple(t) for t in d[part]["terms"]] == [tuple(t) for t in terms]
        coef = np.array(d[part]["coef"])
        assert len(coef) == len(terms) and np.isfinite(coef).all()
        x = np.array(samples, dtype=np.float64)
        a = np.stack([x[:, 0] ** i * x[:, 1] ** j for i, j in terms], axis=1) / x[:, 2:]
        want, *_ = np.linalg.lstsq(a, np.ones(len(x)), rcond=None)
        np.testing.assert_allclose(a @ coef, a @ want, rtol=1e-6, atol=1e-9)
        rel = np.abs(a @ coef - 1.0)
        assert meta[f"{part}_fit"]["max_rel_error"] == pytest.approx(rel.max(), rel=1e-6)
        pred = [getattr(model, part)(n, c) for n, c, _ in samples]
        np.testing.assert_allclose(pred, (a @ coef) * x[:, 2], rtol=1e-9)
    # Six points for five prefill terms: the fit nearly interpolates, so every profiled
    # point is predicted within 100%, hence positive.
    assert meta["prefill_fit"]["max_rel_error"] < 1.0
    assert all(model.prefill_s(n, c) > 0 for n, c, _ in prefill)


# ---------------------------------------------------------------------- benchmarks


def check_ratio_row(row: dict, ours: str = "ours", base: str = "baseline") -> None:
    """ours and baseline positive and finite; ratio = ours / baseline (as rounded)."""
    assert positive(row[ours]) and positive(row[base]), row
    assert positive(row["ratio"]), row
    assert row["ratio"] == pytest.approx(row[ours] / row[base], rel=2e-2, abs=2e-3), row


def test_bench_engine_quick_json():
    res = json_out(run_cli(["mooncake", "bench", "engine", "--quick", "--reps", "1", "--json"],
                           420))
    # --dtype auto (the default) resolves per CPU (model/numerics.py), both sides run it
    want_dtype = "float32"     # auto on every CPU (model/numerics.py)
    assert res["benchmark"] == "engine" and (res["dtype"], res["requested_dtype"]) == (want_dtype, "auto")
    assert (res["cpu"], res["isa"]) == (cpu_isa.cpu_name(), cpu_isa.isa_level())
    assert res["decode_path"] == "per-op-torch" or res["decode_path"].startswith("fused-")
    assert res["prefill_path"] in ("sdpa", "sdpa-aligned", "cpu_prefill-avx512_bf16")
    assert res["prompt_matmul"] in {"avx512_bf16": ("float32", "bfloat16"), "avx2": ("float32", "int8"),
                                    "avx512_vnni": ("float32", "int8")}.get(res["isa"], ("float32",))
    assert res["reps"] == 1 and res["statistic"] == "median"
    assert res["engine"]["kv_cache_bytes"] == 64 * 1024 * 1024
    assert positive(res["wall_s"]) and positive(res["torch_threads"])
    rows = {r["case"]: r for r in res["results"]}
    want = ["decode_batch1", "concurrent_4", "ttft_prefix_cached", "ttft_cold_vs_transformers",
            "decode_step_long_context"]
    if res["llamacpp"]:  # llama-cpp-python installed (the optional [bench] extra)
        want.append("decode_batch1_vs_llamacpp")
    want += ["constrained_batch1", "constrained_batch4"]   # JSON schema vs unconstrained
    assert list(rows) == want
    for r in rows.values():
        assert {"case", "unit", "ours", "baseline", "ratio", "ratio_means", "baseline_name",
                "target", "meets_target"} <= set(r), r
        check_ratio_row(r)
        if r["target"] is None:
            assert r["meets_target"] is None
        else:
            op, val = r["target"].split()
            assert r["meets_target"] == (r["ratio"] >= float(val) if op == ">="
                                         else r["ratio"] <= float(val))
    assert rows["decode_batch1"]["unit"] == "tok/s" and rows["decode_batch1"]["decode_tokens"] == 8
    step = rows["decode_step_long_context"]
    assert (step["requests"], step["prompt_tokens_long"], step["prompt_tokens_short"]) == (4, 64, 16)
    # each rep's prompts come from the prefix cache: 4 x (0 + 3) full blocks of 16
    assert step["prefix_hit_tokens_per_rep"] == 4 * 3 * 16
    assert positive(rows["decode_batch1"]["ours_ttft_s"])
    c = rows["concurrent_4"]
    assert c["requests"] == 4 and c["output_tokens_each"] == 4
    assert (c["prompt_tokens_min"], c["prompt_tokens_max"]) == (16, 32)
    assert rows["ttft_prefix_cached"]["unit"] == "s"
    assert (rows["ttft_prefix_cached"]["prompt_tokens"],
            rows["ttft_prefix_cached"]["cached_tokens"]) == (80, 64)
    # The cold TTFT is the same measurement in both TTFT rows.
    assert rows["ttft_prefix_cached"]["baseline"] == rows["ttft_cold_vs_transformers"]["ours"]
    assert all(len(v) == 1 for v in res["samples"]["decode_batch1"].values())


def test_bench_kernels_refuses_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: benchmarks/gpu_check.sh runs the kernel benchmark")
    cp = run_cli(["mooncake", "bench", "kernels", "--json"], 120)
    assert cp.returncode == 2            # documented: "exits with status 2 and a message"
    assert "no CUDA device" in cp.stderr and "needs a GPU" in cp.stderr
    assert cp.stdout.strip() == ""       # no half-made JSON object


def test_bench_transfer_json():
    res = json_out(run_cli(["mooncake", "bench", "transfer", "--json", "--sizes", "128k,1m",
                            "--concurrency", "1,2", "--duration", "0.2", "--rounds", "1"], 120))
    assert res["benchmark"] == "transfer" and res["op"] == "write" and res["rounds"] == 1
    assert [(r["bytes"], r["concurrency"]) for r in res["results"]] == [
        (128 * 1024, 1), (128 * 1024, 2), (1 << 20, 1), (1 << 20, 2)]
    for r in res["results"]:
        check_ratio_row(r, "ours_gbps", "baseline_gbps")
        for side in ("ours", "baseline"):
            assert positive(r[f"{side}_p50_ms"]) and r[f"{side}_p99_ms"] >= r[f"{side}_p50_ms"]
            assert r[f"{side}_transfers"] >= 1
    s = res["summary"]
    big = [r["ratio"] for r in res["results"] if r["bytes"] >= 1 << 20]
    assert s["min_ratio_ge_1MiB"] == min(big)
    assert s["target_ratio_ge_1MiB_met"] == (min(big) >= 0.8)
    p128 = [r["ours_p50_ms"] / r["baseline_p50_ms"] for r in res["results"]
            if r["bytes"] == 128 * 1024]
    assert s["max_p50_ratio_128KiB"] == pytest.approx(max(p128), rel=1e-2)


def test_bench_store_json(tmp_path):
    from mooncaked.store.policy import POLICIES

    trace = write_trace(tmp_path / "trace.jsonl", TRACE_LINES)
    res = json_out(run_cli(["mooncake", "bench", "store", "--json", "--block-sizes", "16",
                            "--total-mb", "2", "--reps", "1", "--dir", str(tmp_path),
                            "--trace", str(trace), "--capacities", "2,8"], 120))
    assert res["benchmark"] == "store" and res["config"]["reps"] == 1
    assert {(r["tier"], r["op"]) for r in res["results"]} == {
        ("dram", "put"), ("dram", "get"), ("ssd", "put"), ("ssd", "get_cold"),
        ("ssd", "get_warm")}
    for r in res["results"]:
        assert r["block_bytes"] == 16 * SMOLLM2_KV_BYTES_PER_TOKEN
        assert r["baseline"]
        check_ratio_row(r, "ours_gbps", "baseline_gbps")
        assert r["cpu_ratio"] is None or r["cpu_ratio"] > 0  # None: ours took no CPU tick
    assert sorted(os.listdir(tmp_path)) == ["trace.jsonl"]   # its SSD work dir is gone
    ev = res["eviction"]
    assert ev["requests"] == 4
    assert ev["unbounded_hit_rate"] == pytest.approx(TRACE_HIT_RATE, abs=1e-4)
    assert len(ev["rows"]) == 2 * len(POLICIES) * 2
    for r in ev["rows"]:
        assert 0 <= r["hit_rate"] <= ev["unbounded_hit_rate"]
        if r["capacity_blocks"] == 8:          # room for all 5 blocks: nothing is evicted
            assert r["hit_rate"] == ev["unbounded_hit_rate"], r


def test_bench_conductor_json():
    res = json_out(run_cli(["mooncake", "bench", "conductor", "--json", "--requests", "100"],
                           180))
    assert res["requests"] == 100
    assert (res["prefill_nodes"], res["decode_nodes"]) == (64, 64)
    assert res["indexed_blocks"] >= 1_000_000
    for mix in ("typical", "hot"):
        for side in ("ours", "naive"):
            med, p99 = res[f"{mix}_{side}_median_us"], res[f"{mix}_{side}_p99_us"]
            assert positive(med) and p99 >= med
        assert res[f"{mix}_speedup_median"] == pytest.approx(
            res[f"{mix}_naive_median_us"] / res[f"{mix}_ours_median_us"], rel=2e-2)


def test_sim_on_a_small_trace(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", TRACE_LINES)
    res = json_out(run_cli(["mooncake", "sim", str(trace), "--json", "--prefill", "2",
                            "--decode", "1", "--policy", "load_balancing,global_cache_aware"],
                           120))
    assert res["config"]["prefill"] == 2 and res["config"]["decode"] == 1
    assert set(res["runs"]) == {"load_balancing", "global_cache_aware"}
    for s in res["runs"].values():
        assert s["requests"] == s["completed"] == 4 and s["rejected"] == 0
        assert positive(s["ttft_mean_s"]) and positive(s["tbt_mean_s"])
        assert 0 <= s["effective_request_capacity"] <= 1
    # With unbounded caches, Algorithm 1 serves both repeats of blocks 0-1 from cache.
    assert res["runs"]["global_cache_aware"]["cache_hit_rate"] == pytest.approx(TRACE_HIT_RATE)


# ---------------------------------------------------------------------- serve


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`mooncaked serve --config config.example.toml --port P` (a free port; its state dir
    in a temp dir); yields (URL, Popen, log path). On teardown it sends SIGTERM and asserts
    that the server exits 0 within 60 s and logs `stopped`; the process group is SIGKILLed
    whatever happens."""
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    log = tmp / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "mooncaked"), "serve", "--config", str(REPO / "config.example.toml"),
             "--port", str(port), "--set", f"node.state_dir={orjson.dumps(str(tmp)).decode()}"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve exited with {proc.returncode}:\n{_log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve not ready after {SERVE_READY_TIMEOUT_S} s:\n{_log_tail(log)}")
            time.sleep(0.2)   # poll interval; readiness is what /health answers
        yield url, proc, log
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running 60 s after SIGTERM:\n{_log_tail(log)}")
        assert rc == 0, _log_tail(log)
        assert '"event":"stopped"' in log.read_text().replace(" ", ""), _log_tail(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # the session this fixture created
            proc.wait(10)


def test_serve_answers_health_and_a_completion(served):
    url, proc, _ = served
    assert http_json(f"{url}/health") == (200, {"status": "ok"})
    _, models = http_json(f"{url}/v1/models")
    model = models["data"][0]["id"]
    assert "SmolLM2-135M-Instruct" in model
    status, body = http_json(f"{url}/v1/completions",
                             {"model": model, "prompt": "The capital of France is",
                              "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}, 120)
    assert status == 200 and body["object"] == "text_completion" and body["model"] == model
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    assert choice["text"]
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] >= 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    assert proc.poll() is None


def test_bench_trace_replays_against_serve(served, tmp_path):
    url, _, _ = served
    # At --length-scale 32 a trace block is 16 tokens, one engine block, and the outputs are
    # 3 and 2 tokens long; the second request repeats the first one's two blocks, which the
    # server's prefix cache holds by then.
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 96, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 1536, "output_length": 64, "hash_ids": [0, 1, 2]}])
    out = tmp_path / "out"
    s = json_out(run_cli(["mooncake", "bench", "trace", str(trace), "--url", url, "--json",
                          "--no-progress", "--length-scale", "32", "--time-scale", "0",
                          "--concurrency-limit", "1", "--timeout", "120", "--out", str(out)],
                         240, cwd=tmp_path))
    assert s["requests"] == s["completed"] == 2
    assert s["rejected"] == 0 and s["errors"] == 0
    assert s["output_tokens"] == 5                        # ignore_eos: the trace's lengths
    assert s["cached_tokens"] >= 32 and 0 < s["cache_hit_rate"] < 1
    assert positive(s["ttft_mean_s"]) and positive(s["duration_s"])
    assert s == orjson.loads((out / "replay.json").read_bytes())["summary"]
