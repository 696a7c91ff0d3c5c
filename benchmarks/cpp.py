"""`mooncake bench cpp`: TTFT of a 2-stage prefill pipeline against one prefill node.

Ours: two stage processes (mooncaked.benchmarks.stage_process), each holding half of the
bundled model's layers and one torch thread; the prompt goes to stage 0 in chunks of
`chunk_tokens`, each chunk's hidden states are WRITten into a slot stage 1 reserved, over
the transfer engine (TCP on loopback), while stage 0 computes the next chunk. TTFT is the
wall time of the `cpp.prefill` call (tokens in, greedy first token out), control RPCs
and transfers included.

Baseline: one LLMEngine (the prefill node's engine: scheduler, chunked prefill at
`engine.max_num_batched_tokens`, also when idle (`engine.idle_prefill_tokens` set equal, so
both sides prefill in chunks of the same size), prefix caching with a fresh cache salt per rep) in its
own process with one torch thread: time from add_request to the first token.

Prompts of 1k, 2k, 4k and 7k random tokens (a fresh prompt per rep, the same prompt on
both sides), reps interleaved side by side so that load from other processes hits both;
medians. Both sides' greedy first tokens are compared (`tokens_equal`).
Target (issue 14): ours / single <= 0.6 at 4k tokens and above.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time

import orjson

from mooncaked.benchmarks.stage_process import start_stage_process
from mooncaked.wire.rpc import ControlClient

PROMPTS = (1024, 2048, 4096, 7168)
VOCAB_LOW, VOCAB_HIGH = 100, 49000  # ordinary tokens of the bundled model's vocabulary
READY_TIMEOUT_S = 600.0  # model load; minutes on a heavily shared 2-core machine
CALL_TIMEOUT_S = 600.0


def _single_worker(conn, kv_cache_bytes: int, max_batched: int) -> None:
    """The baseline: one LLMEngine, one thread; answers (ttft_s, token) per prompt."""
    from mooncaked.config import load_settings  # noqa: PLC0415 - heavy, in the child only
    from mooncaked.engine.llm_engine import LLMEngine  # noqa: PLC0415
    from mooncaked.engine.types import SamplingParams  # noqa: PLC0415

    engine = LLMEngine(load_settings(None, {"model.num_threads": 1, "engine.kv_cache_bytes": kv_cache_bytes,
                                            "engine.max_num_batched_tokens": max_batched,
                                            # chunks of max_batched even when idle: both sides
                                            # prefill in chunks of the same size
                                            "engine.idle_prefill_tokens": max_batched}))
    conn.send("ready")
    n = 0
    while True:
        msg = conn.recv()
        if msg is None:
            return
        n += 1
        rid = f"single-{n}"
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        engine.add_request(rid, msg, params, f"salt-{n}")
        token = None
        while token is None and engine.has_work():
            for out in engine.step():
                if out.new_token_ids:
                    token = out.new_token_ids[0]
        conn.send((time.perf_counter() - t0, token))


def _prompt(n: int, seed: int) -> list[int]:
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


async def _run(prompts: tuple[int, ...], reps: int, chunk_tokens: int, max_batched: int) -> dict:
    from mooncaked.engine.stage import split_layers  # noqa: PLC0415

    num_layers = _num_layers()
    r0, r1 = split_layers(num_layers, 2)
    max_tokens = max(prompts) + 64
    procs = []
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    single = ctx.Process(target=_single_worker, args=(child, 1 << 30, max_batched), daemon=True)
    client = ControlClient(timeout_s=CALL_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    # Its own thread for the blocking pipe, so an interrupted run does not wait for it.
    pipe_thread = concurrent.futures.ThreadPoolExecutor(1)

    def single_call(msg):
        parent.send(msg)
        if not parent.poll(CALL_TIMEOUT_S):
            raise RuntimeError("the single-node baseline did not answer")
        return parent.recv()

    try:
        p1, a1 = start_stage_process(r1, "", max_tokens=max_tokens, idle_timeout_s=60.0, ready_timeout_s=READY_TIMEOUT_S)
        procs.append(p1)
        p0, a0 = start_stage_process(r0, a1, max_tokens=max_tokens, idle_timeout_s=60.0, ready_timeout_s=READY_TIMEOUT_S)
        procs.append(p0)
        single.start()
        if not parent.poll(READY_TIMEOUT_S) or parent.recv() != "ready":
            raise RuntimeError("the single-node baseline did not start")
        n_req = 0

        stage_s: list[list[float]] = []     # each stage's compute seconds, per rep of ours

        async def ours(ids: list[int]) -> tuple[float, int]:
            nonlocal n_req
            n_req += 1
            t0 = time.perf_counter()
            r = await client.call(a0, "cpp.prefill", {"request_id": f"cpp-{n_req}", "token_ids": ids,
                                                      "chunk_tokens": chunk_tokens},
                                  timeout_s=CALL_TIMEOUT_S)
            stage_s.append([s["compute_s"] for s in r["stages"]])
            return time.perf_counter() - t0, r["token_id"]

        warm = _prompt(300, 1)
        await ours(warm)
        await loop.run_in_executor(pipe_thread, single_call, warm)
        results = []
        for n in prompts:
            o_t, s_t, equal = [], [], True
            stage_s.clear()
            for rep in range(reps):
                ids = _prompt(n, 1000 * n + rep)
                t, tok_o = await ours(ids)
                o_t.append(t)
                t, tok_s = await loop.run_in_executor(pipe_thread, single_call, ids)
                s_t.append(t)
                equal = equal and tok_o == tok_s
            o, s = statistics.median(o_t), statistics.median(s_t)
            results.append({"prompt_tokens": n, "ours_s": round(o, 4), "single_s": round(s, 4),
                            "ratio": round(o / s, 3), "tokens_equal": equal,
                            # each stage's compute seconds (medians): ours_s minus the
                            # larger is the pipeline's fill/drain bubble plus its overheads
                            "stage_compute_s": [round(statistics.median(c), 4) for c in zip(*stage_s)],
                            "ours_reps_s": [round(x, 4) for x in o_t],
                            "single_reps_s": [round(x, 4) for x in s_t]})
            print(f"cpp bench: {orjson.dumps(results[-1]).decode()} load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr, flush=True)  # progress: a long run's partial figures
        return {"benchmark": "cpp", "stages": 2, "layers": [[r0.start, r0.stop], [r1.start, r1.stop]],
                "chunk_tokens": chunk_tokens, "single_max_num_batched_tokens": max_batched,
                "threads_per_node": 1, "reps": reps, "loadavg_1m": round(os.getloadavg()[0], 2),
                "cpu_count": os.cpu_count(), "results": results,
                "target": "ratio <= 0.6 at >= 4096 prompt tokens",
                "target_met": all(r["ratio"] <= 0.6 for r in results if r["prompt_tokens"] >= 4096)}
    finally:
        pipe_thread.shutdown(wait=False, cancel_futures=True)
        await client.close()
        if single.is_alive():
            try:
                parent.send(None)
            except OSError:
                pass
            single.join(10)
            if single.is_alive():
                single.kill()
        for p in procs:
            p.kill()
            p.wait(10)


def _num_layers() -> int:
    """The bundled model's layer count, from the GGUF header (no tensor is loaded)."""
    import gguf  # noqa: PLC0415

    from mooncaked.model.weights import bundled_model_path  # noqa: PLC0415

    reader = gguf.GGUFReader(str(bundled_model_path()))
    return int(reader.fields["llama.block_count"].contents())


def main(json_out: bool = False, reps: int = 3, chunk_tokens: int = 512, max_batched: int = 512,
         prompts: tuple[int, ...] = PROMPTS) -> dict:
    """Runs the benchmark and prints a table or one JSON object; returns the result dict."""
    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so the stage processes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = asyncio.run(_run(tuple(prompts), reps, chunk_tokens, max_batched))
    if json_out:
        print(orjson.dumps(res).decode())
        return res
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=f"CPP: 2 stages x 1 thread vs one prefill node x 1 thread (chunk {chunk_tokens} "
                    f"tokens, median of {reps}; load {res['loadavg_1m']} on {res['cpu_count']} CPUs)")
    for c in ("prompt tokens", "ours TTFT s", "single TTFT s", "ours / single", "same token"):
        t.add_column(c, justify="right")
    for r in res["results"]:
        t.add_row(str(r["prompt_tokens"]), f"{r['ours_s']:.3f}", f"{r['single_s']:.3f}", f"{r['ratio']:.3f}",
                  "yes" if r["tokens_equal"] else "NO")
    Console().print(t)
    print(f"target (ratio <= 0.6 at >= 4k tokens): {'met' if res['target_met'] else 'NOT met'}")
    return res
