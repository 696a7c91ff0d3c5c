"""Placement decision cost: our bitmask prefix index + Algorithm 1 vs a per-node linear scan.

Setup (issue: "64 prefill instances and 1M indexed blocks"): 64 prefill and 64 decode
instances; 200 system prompts of 8 blocks, the 20 most used held by every prefill node
(hot blocks end up everywhere: the paper's Figure 11), the others by 4 to 16 nodes;
40,000 conversations of 25 blocks after a system prompt, each held by 1 to 3 nodes
(one of them in full), so 1,001,600 distinct 16-byte block keys as mooncaked.store
makes them. Each request continues one conversation with fresh blocks (a 64-block
prompt: 16k tokens at 256 tokens a block, the paper's store block size). One decision
= prefix match on every prefill node + `place()` (global cache-aware, SLOs on). The
heap is frozen (gc.freeze) after the build, as a long-lived conductor would do, so
that collections do not rescan the million index entries.

A second request mix, "hot": prompts that extend one of 20 hot 32-block documents held
by every prefill node (where per-node scans hurt most: every node matches the whole
prefix).

Baseline: the same `place()` fed by a naive match, walking the request's keys through
each node's own key set in turn (O(nodes x prefix) set lookups).
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import time

from mooncaked.conductor.cost_model import paper_cost_model
from mooncaked.conductor.index import PrefixIndex
from mooncaked.conductor.policy import PlacementRequest, PolicyConfig, Snapshot, place

PREFILL_NODES = 64
DECODE_NODES = 64
SYSTEM_PROMPTS = 200
HOT_SYSTEM_PROMPTS = 20
HOT_DOCS = 20
HOT_DOC_BLOCKS = 32
SYSTEM_BLOCKS = 8
CONVERSATIONS = 40_000
CONV_BLOCKS = 25
PROMPT_BLOCKS = 64
BLOCK_TOKENS = 256


def build(seed: int = 0):
    """The index, per-node key sets (baseline) and the conversations' key chains."""
    rng = random.Random(seed)
    nodes = [f"prefill-{i}" for i in range(PREFILL_NODES)]
    index = PrefixIndex()
    sets: dict[str, set] = {n: set() for n in nodes}
    systems = []
    for i in range(SYSTEM_PROMPTS):
        chain = [os.urandom(16) for _ in range(SYSTEM_BLOCKS)]
        systems.append(chain)
        holders = nodes if i < HOT_SYSTEM_PROMPTS else rng.sample(nodes, rng.randint(4, 16))
        for n in holders:
            index.stored(n, chain)
            sets[n].update(chain)
    convs = []
    for _ in range(CONVERSATIONS):
        # Zipf-like popularity of system prompts: rank r used about 1/r as often.
        sp = systems[min(int(rng.paretovariate(1.0)) - 1, SYSTEM_PROMPTS - 1)]
        own = [os.urandom(16) for _ in range(CONV_BLOCKS)]
        chain = sp + own
        convs.append(chain)
        for j, n in enumerate(rng.sample(nodes, rng.randint(1, 3))):
            depth = CONV_BLOCKS if j == 0 else rng.randint(1, CONV_BLOCKS)
            index.stored(n, chain[:SYSTEM_BLOCKS + depth])
            sets[n].update(chain[:SYSTEM_BLOCKS + depth])
    hot = []
    for _ in range(HOT_DOCS):
        doc = [os.urandom(16) for _ in range(HOT_DOC_BLOCKS)]
        hot.append(doc)
        for n in nodes:
            index.stored(n, doc)
            sets[n].update(doc)
    return nodes, index, sets, convs, hot


def naive_match(sets: dict[str, set], keys, nodes) -> list[int]:
    """Per-node linear scan: walk the keys through each node's set until its first miss."""
    out = []
    for n in nodes:
        s = sets[n]
        m = 0
        for k in keys:
            if k not in s:
                break
            m += 1
        out.append(m)
    return out


def run(requests: int = 3000, seed: int = 1) -> dict:
    """Builds the setup, times both paths on the same requests; returns the figures."""
    t0 = time.perf_counter()
    nodes, index, sets, convs, hot = build()
    build_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()
    rng = random.Random(seed)
    cost = paper_cost_model()
    cfg = PolicyConfig(block_size=BLOCK_TOKENS, ttft_slo_s=30.0, tbt_slo_s=0.1)
    queue = [rng.uniform(0, 5) for _ in nodes]
    dnodes = [f"decode-{i}" for i in range(DECODE_NODES)]
    dbatch = [rng.randint(0, 64) for _ in dnodes]
    dctx = [b * 12_000 for b in dbatch]
    dfree = [1.3e6 - c for c in dctx]

    def make(chains):
        out = []
        for _ in range(requests):
            chain = rng.choice(chains)
            keys = chain + [os.urandom(16) for _ in range(PROMPT_BLOCKS - len(chain))]
            out.append(PlacementRequest(keys, PROMPT_BLOCKS * BLOCK_TOKENS, 512))
        return out

    def decide(match_fn, req):
        snap = Snapshot(nodes, queue, match_fn(req.keys), dnodes, dbatch, dctx, dfree)
        return place(req, snap, cost, cfg)

    ours = lambda keys: index.match(keys, nodes)          # noqa: E731
    naive = lambda keys: naive_match(sets, keys, nodes)   # noqa: E731
    clock = time.perf_counter_ns
    out = {"prefill_nodes": PREFILL_NODES, "decode_nodes": DECODE_NODES,
           "indexed_blocks": len(index), "prompt_blocks": PROMPT_BLOCKS,
           "requests": requests, "build_s": round(build_s, 2), "target_median_us": 100.0}
    for mix, reqs in (("typical", make(convs)), ("hot", make(hot))):
        for req in reqs[:200]:                            # same decisions, and warm-up
            a, b = decide(ours, req), decide(naive, req)
            assert a == b, (a, b)
        times: dict[str, list[float]] = {"ours": [], "naive": []}
        for req in reqs:                                  # interleaved: same noise for both
            for name, fn in (("ours", ours), ("naive", naive)):
                t = clock()
                decide(fn, req)
                times[name].append((clock() - t) / 1000.0)
        for name, v in times.items():
            out[f"{mix}_{name}_median_us"] = round(statistics.median(v), 1)
            out[f"{mix}_{name}_p99_us"] = round(sorted(v)[int(len(v) * 0.99)], 1)
        out[f"{mix}_speedup_median"] = round(out[f"{mix}_naive_median_us"]
                                             / out[f"{mix}_ours_median_us"], 2)
    return out


def main(json_out: bool = False, requests: int = 3000) -> dict:
    """Runs the benchmark and prints a table (or one JSON object)."""
    res = run(requests)
    if json_out:
        print(json.dumps(res))
        return res
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Placement decision: {res['prefill_nodes']} prefill + {res['decode_nodes']} "
                    f"decode nodes, {res['indexed_blocks']:,} indexed blocks, "
                    f"{res['prompt_blocks']}-block prompts")
    for c in ("requests", "path", "median (us)", "p99 (us)"):
        t.add_column(c, justify="right" if c in ("median (us)", "p99 (us)") else "left")
    for mix in ("typical", "hot"):
        t.add_row(mix, "bitmask index + place()", f"{res[f'{mix}_ours_median_us']:.1f}",
                  f"{res[f'{mix}_ours_p99_us']:.1f}")
        t.add_row(mix, "per-node linear scan + place()", f"{res[f'{mix}_naive_median_us']:.1f}",
                  f"{res[f'{mix}_naive_p99_us']:.1f}")
        t.add_row(mix, "ratio (naive / ours)", f"{res[f'{mix}_speedup_median']:.2f}x", "",
                  end_section=True)
    Console().print(t)
    return res
