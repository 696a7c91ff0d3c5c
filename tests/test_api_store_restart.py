"""`mooncaked serve --role all` attaches its KV store as configured (issue 18, faults 1, 2).

One process with a small DRAM pool and an SSD tier: a prompt's blocks go to the
store when the request finishes; after a clean stop (SIGTERM) and a restart, the
same prompt finds its prefix in the store (SSD) and reports it as cached_tokens.
A setting the role does not read is warned about at start.
"""

from __future__ import annotations

import asyncio

import aiohttp
from cluster_harness import apost as post, run_server

BLOCK = 16                      # engine.block_size
PROMPT_TOKENS = 150  # the issue used 582; 9 full blocks show the same


def test_all_role_store_survives_a_clean_restart(tmp_path):
    ssd_dir = tmp_path / "kvstore"
    args = ("--set", "store.dram_bytes=7372800", "--set", "store.ssd_bytes=268435456",
            "--set", f"store.ssd_dir={ssd_dir}", "--set", "cluster.backend=etcd")
    # A prompt of token ids (no tokenizer round trip), several full blocks.
    prompt = [(i * 7919) % 20000 + 100 for i in range(PROMPT_TOKENS)]
    req = {"prompt": prompt, "max_tokens": 4, "temperature": 0}

    async def ask(url):
        async with aiohttp.ClientSession() as s:
            return await post(s, f"{url}/v1/completions", req)

    with run_server(tmp_path, *args) as server:
        status, first = asyncio.run(ask(server.url))
        assert status == 200, first
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        log = server.log
    text = log.read_text()
    assert '"settings_unused"' in text and "cluster.backend" in text
    assert '"store_started"' in text
    assert next(p for p in ssd_dir.iterdir() if p.suffix == ".dat").stat().st_size > 0

    with run_server(tmp_path, *args) as server:
        status, again = asyncio.run(ask(server.url))
    assert status == 200, again
    # Every full block but the one with the last prompt token comes from the SSD tier.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        (PROMPT_TOKENS - 1) // BLOCK * BLOCK
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
