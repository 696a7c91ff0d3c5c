"""The live prefill node's run order (cluster/prefill_queue.py, issue 17): the simulator's
shortest-predicted-prefill-first with its aging bound (`policy.spf_pick`), behind
conductor.prefill_order. Pure asyncio with a hand-driven clock; no engine."""

from __future__ import annotations

import asyncio

import pytest

from mooncaked.cluster.prefill_queue import (
                                             PrefillQueue,
                                             resolve_aging,
                                             resolve_bound_rule,
                                             resolve_fcfs_slack_ratio,
                                             resolve_order,
                                             )
from mooncaked.cluster.prefill_worker import PrefillWorker
from mooncaked.cluster.role import NodeContext
from mooncaked.config import load_settings


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def _order(q: PrefillQueue, clock: Clock, preds: list[float], age_s: float = 0.0
                 ) -> list[float]:
    """One request holds the node while `preds` queue up (in that order), the clock moves
    `age_s`, then the node is released: returns the predicted seconds in run order."""
    ran: list[float] = []
    first = asyncio.Event()

    async def one(p: float, hold: asyncio.Event | None = None) -> None:
        async with q.turn(p):
            ran.append(p)
            if hold is not None:
                first.set()
                await hold.wait()

    hold = asyncio.Event()
    tasks = [asyncio.create_task(one(100.0, hold))]
    await asyncio.wait_for(first.wait(), 5)
    for p in preds:
        tasks.append(asyncio.create_task(one(p)))
        await asyncio.sleep(0)            # let it enqueue, in this order
        clock.t += 1.0
    assert q.waiting == len(preds)
    clock.t += age_s
    hold.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return ran[1:]


def test_spf_runs_the_shortest_predicted_prefill_first_within_the_aging_bound():
    clock = Clock()
    q = PrefillQueue("spf", aging_s=30.0, clock=clock)
    assert asyncio.run(_order(q, clock, [5.0, 1.0, 3.0])) == [1.0, 3.0, 5.0]
    # after 30 s of waiting every request is past the bound: arrival order
    q = PrefillQueue("spf", aging_s=30.0, clock=clock)
    assert asyncio.run(_order(q, clock, [5.0, 1.0, 3.0], age_s=30.0)) == [5.0, 1.0, 3.0]


def test_fcfs_holds_nothing_back_and_a_cancelled_waiter_leaves():
    async def main() -> None:
        q = PrefillQueue("fcfs")
        assert await q.acquire(9.0) is False and q.waiting == 0     # straight to the engine
        s = PrefillQueue("spf", clock=Clock())
        assert await s.acquire(1.0) is True
        waiter = asyncio.create_task(s.acquire(2.0))
        await asyncio.sleep(0)
        assert s.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert s.waiting == 0
        s.release()
        assert await asyncio.wait_for(s.acquire(3.0), 5) is True   # the node is free again
    asyncio.run(main())


def test_the_prefill_node_and_the_conductor_resolve_the_same_order():
    assert resolve_order("cost_aware", "") == "spf"
    assert resolve_order("global_cache_aware", "") == "fcfs"
    assert resolve_order("global_cache_aware", "spf") == "spf"
    assert resolve_fcfs_slack_ratio("cost_aware", -1.0) == 1.0
    assert resolve_aging("cost_aware", -1.0) == float("inf")
    assert resolve_aging("global_cache_aware", -1.0) == 30.0
    assert resolve_aging("cost_aware", 12.0) == 12.0
    assert resolve_fcfs_slack_ratio("global_cache_aware", -1.0) == float("inf")
    assert resolve_fcfs_slack_ratio("cost_aware", 2.0) == 2.0
    assert resolve_bound_rule("cost_aware", "") == "start"
    assert resolve_bound_rule("global_cache_aware", "") == "wait"
    assert resolve_bound_rule("cost_aware", "wait") == "wait"
    with pytest.raises(ValueError, match="prefill order"):
        resolve_order("cost_aware", "lifo")
    s = load_settings(None, {"conductor.policy": "cost_aware", "conductor.prefill_aging_s": 12.0})
    w = PrefillWorker(NodeContext("p0", "127.0.0.1:1", s))
    assert (w.queue.order, w.queue.aging_s) == ("spf", 12.0)
    fcfs = PrefillWorker(NodeContext("p1", "127.0.0.1:1", load_settings(None, {})))
    assert fcfs.queue.order == "fcfs" and fcfs._predict(100, 0) == 0.0


def test_a_real_prefill_node_runs_the_short_prompt_before_the_long_one(tmp_path):
    """PrefillWorker.handle on the bundled model: while a first prompt runs, a long and then
    a short prompt arrive; with cost_aware (spf) the short one runs second."""
    from mooncaked.wire.messages import PrefillReply, PrefillRequest
    from mooncaked.engine.async_llm import AsyncLLM
    from mooncaked.engine.llm_engine import LLMEngine
    from mooncaked.engine.types import SamplingParams

    # No slack cap by the FCFS wait (prefill_fcfs_slack_ratio inf): with cost_aware's ratio 1
    # the long prompt's bound is twice its FCFS wait, 2 x the first prompt's predicted
    # 0.48 s, and the first prefill on a loaded machine can take longer than that; the
    # bound itself is tested with a hand-driven clock below and in
    # test_conductor_policy_beyond.py.
    s = load_settings(None, {"conductor.policy": "cost_aware", "node.state_dir": str(tmp_path),
                             "conductor.prefill_fcfs_slack_ratio": float("inf")})
    llm = AsyncLLM(LLMEngine(s))
    w = PrefillWorker(NodeContext("p0", "127.0.0.1:1", s, engine=llm))
    tok = llm.tokenizer
    first, long_, short = (tok.encode("Tell me about the sea. " * k) for k in (12, 24, 2))
    params = SamplingParams(max_tokens=8, temperature=0.0)

    seen: set[tuple[str, ...]] = set()        # what the node's report would list as waiting

    async def watch() -> None:
        while True:
            seen.add(w.queued())
            await asyncio.sleep(0.002)

    async def main() -> list[PrefillReply]:
        await llm.start()
        watcher = asyncio.create_task(watch())
        try:
            calls = [w.handle(PrefillRequest(f"r{i}", tuple(p), params).to_json())
                     for i, p in enumerate((first, long_, short))]
            return [PrefillReply.from_json(r) for r in
                    await asyncio.wait_for(asyncio.gather(*calls), 120)]
        finally:
            watcher.cancel()
            await llm.stop()
    replies = asyncio.run(main())
    # while r0 ran, r1 and r2 waited; then r1 alone (r2 ran second); never r0
    assert ("r1", "r2") in seen and ("r1",) in seen and all("r0" not in x for x in seen), seen
    assert w.queued() == ()
    assert all(len(r.output.ids) == 1 for r in replies)       # the first token each
    pred = [w._predict(len(p), 0) for p in (first, long_, short)]
    assert w.queue.started == pred[:1] + [pred[2], pred[1]]            # short before long
    assert w.queue.waiting == 0


def test_adaptive_bound_starts_a_request_soon_after_its_fcfs_turn():
    """fcfs_slack_s: A (5 s) saw a 1 s FCFS wait, so after 1.5 s it goes before the
    shorter B; with the aging bound alone B (1 s) goes first."""
    async def order(slack: float) -> list[str]:
        clock = Clock()
        q = PrefillQueue("spf", aging_s=30.0, fcfs_slack_s=slack, clock=clock)
        assert await q.acquire(1.0)                     # runs until its predicted 1 s
        ran: list[str] = []

        async def one(name: str, pred: float) -> None:
            async with q.turn(pred):
                ran.append(name)
        tasks = [asyncio.create_task(one("A", 5.0)), asyncio.create_task(one("B", 1.0))]
        await asyncio.sleep(0)
        clock.t = 2.0
        q.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return ran
    assert asyncio.run(order(0.5)) == ["A", "B"]
    assert asyncio.run(order(float("inf"))) == ["B", "A"]
