"""asyncio front of the engine: requests as async iterators of output deltas.

The model step runs in one worker thread so the event loop keeps serving
HTTP while the model computes; outputs are routed to per-request queues
between steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from mooncaked.config import Settings
from mooncaked.log import get_logger
from mooncaked.stall_metrics import node_metrics

import torch

from .llm_engine import LLMEngine
from .kv_stream import LayerwiseKV
from .staging import wait_ready
from .types import (EngineStats, KVExport, KVGeometry, KVImport, RequestOutput, SamplingParams,
                    StartupProfile)

log = get_logger(__name__)


class AsyncLLM:
    """Runs an LLMEngine in the background of an asyncio loop.

    Use `from_settings`, `await start()`, then `async for out in generate(...)`.

    With a `store` (mooncaked.store.BlockStore whose block size equals engine.block_bytes),
    a prompt whose prefix misses the device pages but hits the store is loaded from
    the store instead of recomputed, and the full blocks of finished requests are
    offloaded into the store.
    """

    def __init__(self, engine: LLMEngine, store=None):
        self.engine = engine
        self.attach_store(store)
        self._offloads: set[asyncio.Task] = set()
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._metrics = node_metrics()

    @classmethod
    def from_settings(cls, settings: Settings) -> "AsyncLLM":
        """Loads model and tokenizer (seconds). Raises ModelLoadError or ValueError."""
        return cls(LLMEngine(settings))

    def attach_store(self, store) -> None:
        """Uses `store` (a BlockStore, or None to detach) for prefix loads and offloads."""
        self.store = store
        self.engine.offload_finished = store is not None

    async def start(self) -> None:
        """Starts the step loop on the running event loop."""
        if self._task is None:
            loop = asyncio.get_running_loop()
            self.engine.on_start = lambda rids: loop.call_soon_threadsafe(self._started, rids)
            self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Aborts everything, stops the loop and the worker thread, starts the offloads of
        finished requests the loop had not started, and waits for every offload into the
        store (the store can then close)."""
        for rid in list(self._queues):
            self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.store is not None:    # no step runs any more: gathering here is safe
            for export in self.engine.take_offloads():
                self._offload(export)
        await self.wait_offloads()

    async def wait_offloads(self) -> None:
        """Waits until the offloads into the store started so far have ended."""
        if self._offloads:
            await asyncio.gather(*self._offloads, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.engine.has_work():
                last = self.engine.last_step
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # a bug or OOM in a step: fail the requests, keep serving
                    log.error("engine_step_failed", exc_info=True, error=repr(e))
                    self._fail_all(repr(e))
                    continue
                st, now = self.engine.last_step, time.time()
                if st is not None and st is not last:     # a step ran (not only aborts)
                    self._metrics.observe_step(st.seconds, st.num_decode_seqs,
                                               st.num_prefill_tokens, st.context_tokens)
                for out in outputs:
                    out.emitted_s = now
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                # after the outputs: a finished request's last token leaves before its
                # blocks are offloaded (the consumers run first, FIFO)
                if self.store is not None:
                    for out in outputs:
                        if out.kv_export is not None:      # a hand-over export
                            self._offload(out.kv_export)
                    if any(out.finished for out in outputs):
                        await asyncio.sleep(0)             # the streams write their last token
                        # the copy on the step thread; the exports stay in the engine until
                        # taken, so a stop() that cancels this await still offloads them
                        await loop.run_in_executor(self._executor, self.engine.gather_offloads)
                        for export in self.engine.take_offloads():    # gathered: no copy
                            self._offload(export)

    def _started(self, rids: list[str]) -> None:
        """On the loop: an empty delta to each continuation whose first step began
        (LLMEngine.on_start), before that step's token."""
        for rid in rids:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(RequestOutput(rid, [], "", False))

    def _fail_all(self, error: str) -> None:
        for rid, q in list(self._queues.items()):
            self.engine.abort(rid)
            q.put_nowait(RequestOutput(rid, [], "", True, "abort", error=error))
        # Drop the failed requests' state now: the aborts run before the next schedule.

    def _offload(self, export: KVExport) -> None:
        """Puts the full blocks of a finished request into the store, in the background."""
        keys = [k for k in export.keys if not self.store.exists(k)]
        if not keys:
            return
        first = len(export.keys) - len(keys)
        if export.keys[first:] != keys:  # a hole: put block by block
            pairs = [(k, export.blocks[i]) for i, k in enumerate(export.keys) if not self.store.exists(k)]
        else:
            pairs = list(zip(keys, export.blocks[first:len(export.keys)]))
        srcs = [b.contiguous().cpu() for _, b in pairs]  # host already (engine/staging.py): views
        task = asyncio.create_task(self._put_when_ready(export.ready, [k for k, _ in pairs], srcs))
        self._offloads.add(task)
        task.add_done_callback(self._offloads.discard)

    async def _put_when_ready(self, ready, keys: list[bytes], srcs: list[torch.Tensor]) -> None:
        """Waits (in a worker thread) for the export's copy out of GPU pages, then puts
        into reserved DRAM slots of the store (`put_from`), copying in a worker thread.

        Why a thread: the copy into slots not yet written faults their pages in, and with
        transparent huge pages the kernel may compact memory in that fault: 24-29 ms for
        a 262-token request's 8 blocks (12 MB) where a warm copy takes 1.5 ms (AMD EPYC).
        On the event loop that held the decode node's next step and stream writes.
        A store without DRAM slots takes the blocks through `put_many` (onto its SSD)."""
        if ready is not None:
            await asyncio.to_thread(wait_ready, ready)
        if not self.store.dram.num_slots:     # an SSD-only store: put_many writes there
            await self.store.put_many(keys, srcs)
            return
        by_key = dict(zip(keys, srcs))

        async def fill(filled: list[bytes], views: list) -> list[str]:
            def copy() -> None:
                for k, v in zip(filled, views):   # torch's copy_ releases the GIL
                    torch.from_numpy(v).copy_(by_key[k].reshape(-1).view(torch.uint8))
            await asyncio.to_thread(copy)
            return [""] * len(filled)

        await self.store.put_from(keys, fill)

    async def _load_from_store(self, prompt_token_ids: list[int], cache_salt: str | None) -> KVImport | None:
        """KV of the prompt's prefix from the store when it beats the device prefix cache."""
        eng = self.engine
        keys = eng.block_keys_for(prompt_token_ids[:-1], cache_salt)
        if not keys:
            return None
        on_device = 0
        while on_device < len(keys) and keys[on_device] in eng.block_manager.key_to_block:
            on_device += 1
        in_store = self.store.longest_prefix(keys)
        if in_store <= on_device:
            return None
        c = eng.cfg
        buf = torch.empty((in_store, c.num_layers, 2, eng.block_size, c.num_kv_heads, c.head_dim),
                          dtype=eng.dtype)
        n = await self.store.load_prefix(keys[:in_store], list(buf))
        if n <= on_device:
            return None
        return KVImport(blocks=buf[:n], num_tokens=n * eng.block_size)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None, kv_import: KVImport | None = None,
                       export_kv: bool = False, first_token: int | None = None,
                       kv_stream=None) -> AsyncIterator[RequestOutput]:
        """Runs one request; yields its output deltas, the last with finished=True.

        Args: see LLMEngine.add_request (kv_import: K/V given for the prompt's first tokens;
            export_kv: the final output carries all the request's blocks as a KVExport;
            first_token: the first output token when continuing a prefill node's request
                (not reported again: the deltas carry only the tokens sampled here; the
                first delta, with no token, comes when the request's first step begins:
                the caller sends the first token to its client then);
            kv_stream: a LayerwiseKV the prompt's K/V is staged into layer by layer).
        Raises: InvalidRequest before the first yield for a bad prompt or parameter.
        Closing the iterator early (client gone) aborts the request and frees its pages.
        """
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if (kv_import is None and self.store is not None and params.prompt_logprobs is None
                and len(prompt_token_ids) > self.engine.block_size):   # scored prompts compute all
            kv_import = await self._load_from_store(prompt_token_ids, cache_salt)
        self.engine.add_request(request_id, prompt_token_ids, params, cache_salt, kv_import, export_kv,
                                first_token, kv_stream)
        self._queues[request_id] = q
        self._wake.set()
        finished = False
        try:
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stops a request at the next step (its pages are freed then)."""
        self.engine.abort(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        """Engine counters for metrics."""
        return self.engine.stats()

    # ------------------------------------------------------------------ what the cluster needs

    @property
    def model_id(self) -> str:
        """Identity of the weights (file name and size): part of every block key's salt."""
        return self.engine.model_id

    def kernels(self) -> dict:
        """What this engine runs, decided once at start: the resolved dtype and weight format
        (model/numerics.py; `requested_dtype` is model.dtype as configured, e.g. "auto") and
        the CPU, ISA level and kernel variants (engine/kernel_paths.py KernelPaths)."""
        e = self.engine
        return {"dtype": e.numerics.dtype, "requested_dtype": e.settings.model.dtype,
                "weight_format": e.numerics.weight_format, **e.kernel_paths.to_json()}

    @property
    def startup_profile(self) -> StartupProfile | None:
        """What the engine's start-up profile measured (engine/startup_profile.py), None
        when it did not run."""
        return self.engine.startup_profile

    def kv_geometry(self) -> KVGeometry:
        """The paged KV layout (layers, block size, heads, dtype, bytes and count of blocks)."""
        e = self.engine
        return KVGeometry(e.cfg.num_layers, e.block_size, e.cfg.num_kv_heads, e.cfg.head_dim,
                          e.dtype, e.block_bytes, e.block_manager.num_blocks)

    def layerwise_kv(self, num_tokens: int) -> LayerwiseKV:
        """A layer-major stage for the KV of a prompt of num_tokens tokens, to pass to
        `generate(kv_stream=...)`: filled layer by layer as the prefill computes.
        Raises: ValueError when num_tokens is not in [1, max_model_len]."""
        return self.engine.layerwise_kv(num_tokens)

    def take_decode_steps(self, limit: int = 64) -> list[tuple[int, int, float]]:
        """The timed decode steps since the last call, newest `limit` of them: (batch size,
        context tokens, seconds) each. Safe from the event loop (a deque the step thread
        appends to)."""
        return _take(self.engine.decode_steps, limit)

    def take_prefill_steps(self, limit: int = 64) -> list[tuple[int, int, float]]:
        """The timed steps of prefill chunks only (no decodes) since the last call, newest
        `limit` of them: (new tokens, tokens cached before them, seconds) each; the
        conductor calibrates its prefill model from them. Safe from the event loop."""
        return _take(self.engine.prefill_steps, limit)


def _take(log_: deque, limit: int) -> list[tuple[int, int, float]]:
    """Pops everything from the deque `log_` (another thread appends); returns the newest
    `limit` entries."""
    steps = []
    while log_:
        steps.append(log_.popleft())
    return steps[-limit:]
