"""The order in which a prefill node runs its waiting requests (issue 17).

With ``fcfs`` (Algorithm 1, the default) nothing is held back: every request goes
straight into the engine, whose scheduler takes waiting requests oldest first.

With ``spf`` the node runs one prefill at a time (as the paper's prefill instance and
the simulator do) and picks the next one with the same pure function the simulator
uses, `conductor.policy.spf_pick`: the shortest predicted prefill first, except that a
request that has waited its starvation bound goes first, oldest first: `aging_s`, or
sooner the wait FCFS would have given it plus `fcfs_slack_s` (`policy.spf_bound_s`). The prediction is the cost model's prefill time of the request's
(uncached, cached) tokens, the model the conductor places with.

The option is `conductor.prefill_order` (empty: the placement policy's default, so
`cost_aware` runs spf on the nodes and predicts spf waits in the conductor) and
`conductor.prefill_aging_s`, `conductor.prefill_fcfs_slack_s`; `resolve_order` and
`resolve_fcfs_slack` are where both sides resolve them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mooncaked.conductor.policy import (
    PREFILL_ORDERS,
    PolicyConfig,
    policy_defaults,
    spf_bound_s,
    spf_pick,
)


def resolve_order(policy: str, prefill_order: str) -> str:
    """The prefill order a cluster runs: `prefill_order` when set, else the placement
    policy's default (`policy.policy_defaults`). Raises: ValueError on an unknown order."""
    order = prefill_order or policy_defaults(policy)[2]
    if order not in PREFILL_ORDERS:
        raise ValueError(f"unknown prefill order {order!r}; choose one of "
                         f"{', '.join(PREFILL_ORDERS)}")
    return order


def resolve_fcfs_slack(policy: str, fcfs_slack_s: float) -> float:
    """spf's adaptive starvation slack (PolicyConfig.fcfs_slack_s): `fcfs_slack_s` when
    >= 0, else the placement policy's default (10 s for cost_aware, else inf)."""
    if fcfs_slack_s >= 0:
        return fcfs_slack_s
    return PolicyConfig(policy=policy).fcfs_slack_s


@dataclass
class _Waiter:
    enqueued: float                 # seconds on the queue's clock
    predicted_s: float
    bound_s: float                  # waited this long, it goes first (spf_bound_s)
    turn: asyncio.Future


class PrefillQueue:
    """Admission of one node's prefills into its engine (see the module doc).

    Args:
        order: "fcfs" (pass through) or "spf".
        aging_s: spf's starvation bound, seconds (>= 0).
        fcfs_slack_s: spf's adaptive bound: a request also goes first once it has waited
            the FCFS wait it saw when it arrived (the running remainder plus everything
            waiting) plus this, seconds (`policy.spf_bound_s`); inf: aging_s only.
        clock: monotonic seconds (injectable for tests).
    Use `async with queue.turn(predicted_s):` (or `acquire`/`release`) around the
    engine's prefill. Must be used
    from one event loop. Raises (constructor): ValueError on an unknown order or a
    negative aging bound.
    """

    def __init__(self, order: str = "fcfs", aging_s: float = 30.0,
                 fcfs_slack_s: float = float("inf"),
                 clock: Callable[[], float] = time.monotonic):
        if order not in PREFILL_ORDERS:
            raise ValueError(f"unknown prefill order {order!r}")
        if not (aging_s >= 0 and fcfs_slack_s >= 0):
            raise ValueError(f"aging_s and fcfs_slack_s must be >= 0, got {aging_s}, "
                             f"{fcfs_slack_s}")
        self.order, self.aging_s, self.fcfs_slack_s, self._clock = (order, aging_s,
                                                                    fcfs_slack_s, clock)
        self._run_end = 0.0                    # predicted end of the running prefill
        self._waiting: list[_Waiter] = []      # arrival order
        self._running = 0
        self.started: list[float] = []         # predicted seconds, in run order (last 1000)

    @property
    def waiting(self) -> int:
        """Requests held back, waiting for their turn."""
        return len(self._waiting)

    async def acquire(self, predicted_s: float) -> bool:
        """Waits for this request's turn; True when it then holds the node (spf: call
        `release` once its prefill is done), False when nothing is held (fcfs). A cancelled
        waiter leaves the queue without running."""
        if self.order == "fcfs":
            return False
        now = self._clock()
        fcfs_wait = max(0.0, self._run_end - now) * (self._running > 0) + sum(
            x.predicted_s for x in self._waiting)
        w = _Waiter(now, float(predicted_s),
                    spf_bound_s(self.aging_s, fcfs_wait, self.fcfs_slack_s),
                    asyncio.get_running_loop().create_future())
        self._waiting.append(w)
        self._dispatch()
        try:
            await w.turn
        except asyncio.CancelledError:
            if w in self._waiting:
                self._waiting.remove(w)
            elif w.turn.done() and not w.turn.cancelled():
                self.release()         # granted just as it was cancelled: pass it on
            raise
        return True

    def release(self) -> None:
        """Hands the node to the next waiting request (after an `acquire` that returned True)."""
        self._running -= 1
        self._dispatch()

    @contextlib.asynccontextmanager
    async def turn(self, predicted_s: float) -> AsyncIterator[None]:
        """`acquire`, run the body, `release`."""
        held = await self.acquire(predicted_s)
        try:
            yield
        finally:
            if held:
                self.release()

    def _dispatch(self) -> None:
        """Starts the next request when the node is free (spf_pick over the waiting)."""
        while self._running < 1 and self._waiting:
            now = self._clock()
            k = spf_pick([(w.enqueued, w.predicted_s, w.bound_s) for w in self._waiting], now,
                         self.aging_s)
            w = self._waiting.pop(k)
            if w.turn.done():          # cancelled meanwhile
                continue
            self._running += 1
            self._run_end = now + w.predicted_s
            w.turn.set_result(None)
            self.started.append(w.predicted_s)
            del self.started[:-1000]


__all__ = ["PrefillQueue", "resolve_fcfs_slack", "resolve_order"]
