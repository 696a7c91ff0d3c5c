"""One periodic throughput line per node, as vLLM's engine logs it: prompt and
generation tokens per second over the last interval, running and waiting requests and
KV cache usage (`log.stats_interval_s`; quiet while the node is idle)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mooncaked.log import get_logger

log = get_logger(__name__)


async def log_throughput(node: Any, interval_s: float) -> None:
    """Logs `throughput` every interval_s seconds while node serves (a ClusterNode with an
    engine); nothing for an interval with no tokens and no running request. Runs until
    cancelled."""
    last_t = time.monotonic()
    last_prompt = node.engine.stats().prompt_tokens_total
    last_gen = _generated(node)
    while True:
        await asyncio.sleep(interval_s)
        st, now, gen = node.engine.stats(), time.monotonic(), _generated(node)
        dt = max(1e-9, now - last_t)
        prompt_rate = (st.prompt_tokens_total - last_prompt) / dt
        gen_rate = (gen - last_gen) / dt
        last_t, last_prompt, last_gen = now, st.prompt_tokens_total, gen
        if prompt_rate == 0 and gen_rate == 0 and not st.num_running and not st.num_waiting:
            continue
        log.info("throughput", node=node.node_id, role=node.role,
                 prompt_tokens_per_s=round(prompt_rate, 1),
                 generation_tokens_per_s=round(gen_rate, 1), running=st.num_running,
                 waiting=st.num_waiting,
                 kv_usage=round(st.kv_blocks_used / st.kv_blocks_total, 3)
                 if st.kv_blocks_total else None, interval_s=round(dt, 1))


def _generated(node: Any) -> int:
    """Tokens this node's decode side has streamed (0 on other roles)."""
    return node.decode.tokens_out if node.decode is not None else 0


__all__ = ["log_throughput"]
