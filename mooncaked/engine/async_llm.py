"""asyncio front of the engine: requests as async iterators of output deltas.

The model step runs in one worker thread so the event loop keeps serving
HTTP while the model computes; outputs are routed to per-request queues
between steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from mooncaked.config import Settings
from mooncaked.log import get_logger

from .llm_engine import LLMEngine
from .types import EngineStats, RequestOutput, SamplingParams

log = get_logger(__name__)


class AsyncLLM:
    """Runs an LLMEngine in the background of an asyncio loop.

    Use `from_settings`, `await start()`, then `async for out in generate(...)`.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_logprobs = engine.max_logprobs
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> "AsyncLLM":
        """Loads model and tokenizer (seconds). Raises ModelLoadError or ValueError."""
        return cls(LLMEngine(settings))

    async def start(self) -> None:
        """Starts the step loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Aborts everything, stops the loop and the worker thread."""
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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.engine.has_work():
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # a bug or OOM in a step: fail the requests, keep serving
                    log.error("engine_step_failed", exc_info=True, error=repr(e))
                    self._fail_all(repr(e))
                    continue
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)

    def _fail_all(self, error: str) -> None:
        for rid, q in list(self._queues.items()):
            self.engine.abort(rid)
            q.put_nowait(RequestOutput(rid, [], "", True, "abort", error=error))
        # Drop the failed requests' state now: the aborts run before the next schedule.

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Runs one request; yields its output deltas, the last with finished=True.

        Raises: InvalidRequest before the first yield for a bad prompt or parameter.
        Closing the iterator early (client gone) aborts the request and frees its pages.
        """
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.engine.add_request(request_id, prompt_token_ids, params, cache_salt)
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
