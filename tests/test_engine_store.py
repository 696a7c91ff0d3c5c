"""The engine with a KV store: finished blocks are offloaded; a prefix that misses the
device pages but hits the store (DRAM or SSD) is loaded, not recomputed."""

from __future__ import annotations

import asyncio
import time

from mooncaked.config import load_settings
from mooncaked.engine.async_llm import AsyncLLM
from mooncaked.engine.llm_engine import LLMEngine
from mooncaked.engine.types import SamplingParams
from mooncaked.store.store import BlockStore


async def generate(llm: AsyncLLM, prompt: list[int], rid: str) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), rid):
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


def test_prefix_from_store_after_device_cache_is_gone(tmp_path):
    settings = load_settings(None, {"store.dram_bytes": 0, "store.ssd_bytes": 64 * 1024 * 1024})

    async def main():
        first = LLMEngine(settings)
        prompt = first.tokenizer.apply_chat_template(
            [{"role": "user", "content": "List five facts about the Moon, one per line. " * 3}])
        store = await BlockStore(first.block_bytes, settings.store, ssd_dir=str(tmp_path)).start()
        llm = AsyncLLM(first, store)
        await llm.start()
        cold, cached_cold = await generate(llm, prompt, "a")
        await llm.stop()
        # the offload runs in the background: wait (bounded) until it lands
        deadline = time.monotonic() + 60
        while (store.longest_prefix(first.block_keys_for(prompt[:-1])) < (len(prompt) - 1) // 16
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)   # poll interval
        held = store.longest_prefix(first.block_keys_for(prompt[:-1]))
        # A fresh engine (empty device pages) sharing only the store.
        second = AsyncLLM(LLMEngine(settings), store)
        await second.start()
        warm, cached_warm = await generate(second, prompt, "b")
        await second.stop()
        await store.close()
        return cold, cached_cold, warm, cached_warm, held, len(prompt)

    cold, cached_cold, warm, cached_warm, held, n = asyncio.run(main())
    assert cached_cold == 0
    assert held == (n - 1) // 16
    assert cached_warm == held * 16 and cached_warm > 0
    assert warm == cold
