"""`mooncake bench store`: the KV store's tiers against plain memcpy and plain file I/O.

Throughput (same run, same bytes, same block sizes):
  - DRAM put / get (BlockStore.put / get_into into a pre-faulted pool) vs
    numpy memcpy of the same blocks between the same kinds of buffers;
  - SSD put (a checksummed slot in the tier's slot file + its header) vs writing
    the same bytes sequentially into one plain file;
  - SSD get, cold (page cache dropped for both sides with fsync +
    posix_fadvise(DONTNEED), so the device is read) and warm (page cache hot)
    vs reading that plain file sequentially.
Ours and the baseline run back to back in every repetition, alternating which
goes first; dirty pages are written back (untimed) before each timed write.
Both sides read into the same destination arrays, the same bytes; each side's
warm read follows its own cold read, so the page cache holds each file as that
side's cold read left it (the kernel's folio sizes depend on the read pattern,
and a warm read copies small folios more slowly).
Targets (issue 5): SSD >= 0.7x plain file, DRAM >= 0.5x memcpy.
Each row's `ratio` is of wall-clock medians (ours / baseline throughput);
`cpu_ratio` is baseline CPU seconds / ours (process CPU time, every thread
counted, medians), which a loaded host disturbs less. The store may use two
threads on a large warm SSD read (ssd.py), so its `ratio` can exceed its
`cpu_ratio` when a second core is free.

Eviction study: prefix hit rate (cached prompt tokens / prompt tokens, the
paper's definition) of each eviction policy on the conversation trace's
`hash_ids` (512-token blocks), for several cache capacities, with the
store's deepest-first touch order and with plain chain order.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from mooncaked.config import StoreSettings
from mooncaked.replay.trace import shared_trace_path
from mooncaked.store.policy import POLICIES, make_policy
from mooncaked.store.ssd import HEADER_BYTES
from mooncaked.store.store import BlockStore

SMOLLM2_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # layers*K/V*block_size 16*kv heads*head_dim*fp32
DEFAULT_TRACE = str(shared_trace_path() or "")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _drop_cache(path: str) -> None:
    """Writes back and drops one file's page cache (no privileges needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Time(float):
    """Wall-clock seconds of one timed call, with its process CPU seconds as `cpu`."""

    cpu: float


def _row(tier: str, op: str, block_bytes: int, ours: list[_Time], base: list[_Time],
         nbytes: int, baseline: str) -> dict:
    """One result row from the repetitions' times (medians of wall and CPU seconds)."""
    med = statistics.median
    ours_gbps, base_gbps = _gbps(nbytes, med(ours)), _gbps(nbytes, med(base))
    ours_cpu, base_cpu = med(t.cpu for t in ours), med(t.cpu for t in base)
    return {"tier": tier, "op": op, "block_bytes": block_bytes,
            "ours_gbps": round(ours_gbps, 3), "baseline_gbps": round(base_gbps, 3),
            "ratio": round(ours_gbps / base_gbps, 3),
            "cpu_ratio": round(base_cpu / ours_cpu, 3) if ours_cpu > 0 else None,
            "baseline": baseline}


async def _timed(fn) -> _Time:
    c, t = time.process_time(), time.perf_counter()
    await fn()
    out = _Time(time.perf_counter() - t)
    out.cpu = time.process_time() - c
    return out


async def _pair(ours, base, rep: int) -> tuple[_Time, _Time]:
    """Times `ours` and `base` (coroutine functions) back to back, alternating which
    goes first from one repetition to the next so neither always inherits the
    other's cache or writeback state."""
    if rep % 2:
        b = await _timed(base)
        return await _timed(ours), b
    o = await _timed(ours)
    return o, await _timed(base)


async def _dram_case(block_bytes: int, n: int, reps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]
    dsts = [np.ones(block_bytes, np.uint8) for _ in range(n)]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    pool = np.ones(n * block_bytes, np.uint8)  # baseline's "pool", pre-faulted like ours
    nbytes = n * block_bytes
    times: dict[str, list[_Time]] = {"put": [], "put_b": [], "get": [], "get_b": []}
    async with BlockStore(block_bytes, StoreSettings(dram_bytes=nbytes)) as st:
        st.subscribe()  # events are part of the put path

        async def put():
            results = await st.put_many(keys, srcs)
            if results[-1].status.value != "stored":
                raise RuntimeError(f"DRAM tier refused a block: {results[-1]}")

        async def put_b():
            for i, src in enumerate(srcs):
                np.copyto(pool[i * block_bytes:(i + 1) * block_bytes], src)

        async def get():
            if None in await st.get_many(keys, dsts):
                raise RuntimeError("DRAM tier lost a block during the benchmark")

        async def get_b():
            for i, dst in enumerate(dsts):
                np.copyto(dst, pool[i * block_bytes:(i + 1) * block_bytes])

        for rep in range(reps + 1):  # rep 0 faults the pool's pages in and warms up
            await st.remove_many(keys)
            o, b = await _pair(put, put_b, rep)
            go, gb = await _pair(get, get_b, rep)
            if rep:
                times["put"].append(o), times["put_b"].append(b)
                times["get"].append(go), times["get_b"].append(gb)
        await get()
        if any(d.tobytes() != src.tobytes() for d, src in zip(dsts, srcs)):
            raise RuntimeError("DRAM tier returned wrong bytes")
    return [_row("dram", "put", block_bytes, times["put"], times["put_b"], nbytes, "memcpy"),
            _row("dram", "get", block_bytes, times["get"], times["get_b"], nbytes, "memcpy")]


def _plain_write(path: str, srcs: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        f.writelines(srcs)


def _plain_read(path: str, dsts: list[np.ndarray]) -> None:
    with open(path, "rb", buffering=0) as f:
        for d in dsts:
            f.readinto(d)


async def _ssd_case(block_bytes: int, n: int, reps: int, directory: str) -> list[dict]:
    rng = np.random.default_rng(1)
    srcs = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]
    dsts = [np.ones(block_bytes, np.uint8) for _ in range(n)]
    keys = [i.to_bytes(16, "little") for i in range(n)]
    nbytes = n * block_bytes
    plain = os.path.join(directory, "plain.bin")
    s = StoreSettings(dram_bytes=0, ssd_bytes=n * (block_bytes + HEADER_BYTES + 4096),
                      promote_on_get=False)
    times: dict[str, list[_Time]] = {k: [] for k in
                                     ("put", "put_b", "cold", "cold_b", "warm", "warm_b")}
    async with BlockStore(block_bytes, s, ssd_dir=os.path.join(directory, "ssd")) as st:
        async def put():
            results = await st.put_many(keys, srcs)
            if not all(r.status.value == "stored" for r in results):
                raise RuntimeError(f"SSD tier refused a block: {results[0]}")

        async def put_b():
            _plain_write(plain, srcs)

        async def get():
            if (await st.get_many(keys, dsts)).count("ssd") != n:
                raise RuntimeError("SSD tier missed a block during the benchmark")

        async def get_b():
            _plain_read(plain, dsts)

        def settle():
            """Untimed: write everything back and drop it from the page cache, so each
            timed write starts without dirty pages and each cold read hits the device."""
            for path in (st.ssd.data_path, st.ssd.index_path, plain):
                if os.path.exists(path):
                    _drop_cache(path)

        for rep in range(reps):
            await st.remove_many(keys)
            if os.path.exists(plain):
                os.unlink(plain)
            settle()
            if rep % 2:
                b = await _timed(put_b)
                settle()
                o = await _timed(put)
            else:
                o = await _timed(put)
                settle()
                b = await _timed(put_b)
            settle()
            times["put"].append(o), times["put_b"].append(b)
            o, b = await _pair(get, get_b, rep)  # cold: both were just dropped
            times["cold"].append(o), times["cold_b"].append(b)
            o, b = await _pair(get, get_b, rep)  # warm: both now in the page cache
            times["warm"].append(o), times["warm_b"].append(b)
        await get()
        if any(d.tobytes() != src.tobytes() for d, src in zip(dsts, srcs)):
            raise RuntimeError("SSD tier returned wrong bytes")
    return [_row("ssd", "put", block_bytes, times["put"], times["put_b"], nbytes,
                 "sequential file write (page cache)"),
            _row("ssd", "get_cold", block_bytes, times["cold"], times["cold_b"], nbytes,
                 "sequential file read, page cache dropped"),
            _row("ssd", "get_warm", block_bytes, times["warm"], times["warm_b"], nbytes,
                 "sequential file read, page cache hot")]


# ---------------------------------------------------------------------------- eviction study


def load_trace(path: str) -> list[tuple[int, list[int]]]:
    """(input_length, hash_ids) per request of a Mooncake trace (JSON lines)."""
    out = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                r = orjson.loads(line)
                out.append((int(r["input_length"]), list(r["hash_ids"])))
    return out


def simulate_hit_rate(trace: list[tuple[int, list[int]]], capacity_blocks: int, policy: str,
                      deepest_first: bool = True, block_tokens: int = 512) -> float:
    """Prefix hit rate of one cache of `capacity_blocks` blocks replaying `trace`.

    Per request: count the cached prefix (walk hash_ids until the first miss),
    then insert/touch every block of the prompt (it was computed or loaded), in
    deepest-first order (as BlockStore.put_many/get_many do) or chain order,
    evicting by `policy` when full. Returns cached tokens / prompt tokens.
    """
    cache = make_policy(policy)
    hit_tokens = total_tokens = 0
    always = lambda _k: True
    for input_len, ids in trace:
        n = 0
        for h in ids:
            if h not in cache:
                break
            n += 1
        hit_tokens += min(n * block_tokens, input_len)
        total_tokens += input_len
        for h in (reversed(ids) if deepest_first else ids):
            if h in cache:
                cache.touch(h)
            else:
                if len(cache) >= capacity_blocks:
                    cache.remove(cache.victim(always))
                cache.insert(h)
    return hit_tokens / total_tokens if total_tokens else 0.0


def eviction_study(trace_path: str, capacities: list[int], max_requests: int = 0) -> dict:
    """Hit rate per (policy, touch order, capacity) on `trace_path`, plus the unbounded cache."""
    trace = load_trace(trace_path)
    if max_requests:
        trace = trace[:max_requests]
    unbounded = simulate_hit_rate(trace, 1 << 62, "fifo")
    rows = []
    for cap in capacities:
        for name in POLICIES:
            for deepest in (True, False):
                rows.append({"capacity_blocks": cap, "capacity_tokens": cap * 512, "policy": name,
                             "touch": "deepest_first" if deepest else "chain_order",
                             "hit_rate": round(simulate_hit_rate(trace, cap, name, deepest), 4)})
    return {"trace": trace_path, "requests": len(trace), "unbounded_hit_rate": round(unbounded, 4),
            "rows": rows}


# ---------------------------------------------------------------------------- entry point


def run(block_sizes: tuple[int, ...] = (16, 64), total_mb: int = 64, reps: int = 5,
        directory: str | None = None, trace: str | None = DEFAULT_TRACE,
        capacities: tuple[int, ...] = (1024, 4096, 16384, 65536)) -> dict:
    """Runs every case; returns {"benchmark", "config", "results", "eviction"}."""
    workdir = tempfile.mkdtemp(prefix="bench-store-", dir=directory)
    results = []
    try:
        for bs in block_sizes:
            block_bytes = SMOLLM2_BLOCK // 16 * bs
            n = max(4, total_mb * 1024 * 1024 // block_bytes)
            results += asyncio.run(_dram_case(block_bytes, n, reps))
            results += asyncio.run(_ssd_case(block_bytes, n, reps, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = {"benchmark": "store",
           "config": {"block_sizes_tokens": list(block_sizes), "model": "SmolLM2-135M fp32",
                      "bytes_per_case": total_mb * 1024 * 1024, "reps": reps,
                      "dir": directory or tempfile.gettempdir(), "statistic": "median"},
           "results": results}
    if trace and Path(trace).exists():
        out["eviction"] = eviction_study(trace, list(capacities))
    return out


def main(json_out: bool = False, **kw) -> dict:
    """Runs the benchmark and prints a table (or one JSON object with `json_out`)."""
    res = run(**kw)
    if json_out:
        print(orjson.dumps(res).decode())
        return res
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title="KV store tiers vs plain memcpy / file I/O (GB/s, median)")
    for col in ("tier", "op", "block bytes", "ours", "baseline", "ratio", "cpu ratio",
                "baseline is"):
        t.add_column(col)
    for r in res["results"]:
        cpu = "-" if r["cpu_ratio"] is None else f"{r['cpu_ratio']:.2f}"
        t.add_row(r["tier"], r["op"], f"{r['block_bytes']:,}", f"{r['ours_gbps']:.2f}",
                  f"{r['baseline_gbps']:.2f}", f"{r['ratio']:.2f}", cpu, r["baseline"])
    con.print(t)
    ev = res.get("eviction")
    if ev:
        t = Table(title=f"Prefix hit rate by eviction policy, {ev['requests']} requests "
                        f"(unbounded cache: {ev['unbounded_hit_rate']:.3f})")
        for col in ("capacity (blocks of 512 tokens)", "policy", "touch order", "hit rate"):
            t.add_column(col)
        for r in ev["rows"]:
            t.add_row(f"{r['capacity_blocks']:,}", r["policy"], r["touch"], f"{r['hit_rate']:.4f}")
        con.print(t)
    return res
