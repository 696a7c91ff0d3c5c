"""`mooncake bench trace --hosts` (benchmarks/fetch_policy.py): the inputs it replays, the
prefix it counts as reusable, adaptive against the better fixed policy, and the CLI's
refusals. The runs themselves need root and minutes (docs/benchmarks.md has figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mooncaked.benchmarks.fetch_policy import (generated_requests, reusable_tokens,
                                               shared_prefix_subset, summarize_rate)
from mooncaked.replay.trace import TraceRequest

MOONCAKE = str(Path(sys.executable).parent / "mooncake")


def req(i: int, ids: tuple[int, ...], length: int = 1024) -> TraceRequest:
    return TraceRequest(index=i, timestamp_ms=float(i), input_length=length, output_length=8,
                        hash_ids=ids)


def test_subset_takes_whole_conversations_turn_by_turn():
    # block 0 is everyone's system prompt (shared by 10: not a conversation); conversations
    # 1 (three turns) and 2 (two turns); request 9 shares nothing; 8 is too long
    reqs = [req(0, (0, 1)), req(1, (0, 2)), req(2, (0, 1, 3)), req(3, (0, 9)), req(4, (0, 2, 4)),
            req(5, (0, 1, 3, 5)), req(6, (0, 7)), req(7, (0, 8)), req(8, (0, 1), 99_999),
            req(9, (0, 6))]
    out = shared_prefix_subset(reqs, limit=10, max_input=4096)
    assert [r.index for r in out] == [0, 1, 2, 4, 5]          # turn 1 of both, turn 2, turn 3
    # limit 4: conversation 1 whole, then the first turn of conversation 2
    assert [r.index for r in shared_prefix_subset(reqs, limit=4, max_input=4096)] == [0, 1, 2, 5]
    gen = shared_prefix_subset(generated_requests(), limit=30, max_input=24000)
    assert len(gen) == 30 and len({r.index for r in gen}) == 30


def test_reusable_prefix_counts_full_blocks_an_earlier_prompt_began_with():
    a = list(range(40))
    b = a[:35] + [99] * 10          # shares 35 tokens with a: 2 full blocks of 16
    c = a[:]                        # a again: all but the last token, in full blocks: 32
    assert reusable_tokens([a, b, c, [7] * 20], 16) == [0, 32, 32, 0]


def test_adaptive_against_the_better_fixed_policy():
    def run(policy: str, ttfts: list[float]) -> dict:
        return {"policy": policy, "inputs": {"trace": {
            "_ttfts": ttfts, "reusable_prefix_tokens": 100, "fetched_tokens": 50,
            "recomputed_prefix_tokens": 10, "fetched_bytes": 5, "failed": 0}}}
    out = summarize_rate([run("adaptive", [1.0, 1.2]), run("always", [1.0, 1.0]),
                          run("never", [2.0, 2.0])])
    assert out["adaptive_vs_best_fixed_ttft_mean"] == 1.1 and out["target_met"] is False
    assert out["pooled"]["never"]["fetched_share"] == 0.5


def test_cli_hosts_refusals():
    cp = subprocess.run([MOONCAKE, "bench", "trace", "--hosts", "--url", "http://x:1"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "drop --url" in cp.stderr, cp.stderr
    cp = subprocess.run([MOONCAKE, "bench", "trace", "--hosts", "--concurrency-limit", "4"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "drop --concurrency-limit" in cp.stderr, cp.stderr
    cp = subprocess.run([MOONCAKE, "bench", "trace", "--hosts", "--link-rate", "fast"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "link rate 'fast'" in cp.stderr, cp.stderr
    cp = subprocess.run([MOONCAKE, "bench", "trace"], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "--url" in cp.stderr, cp.stderr
