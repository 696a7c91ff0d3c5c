"""The order in which a prefill node runs its waiting requests (issue 17).

With ``fcfs`` (Algorithm 1, the default) nothing is held back: every request goes
straight into the engine, whose scheduler takes waiting requests oldest first.

With ``spf`` the node runs one prefill at a time (as the paper's prefill instance and
the simulator do) and picks the next one with the same pure function the simulator
uses, `conductor.policy.spf_pick`: the shortest predicted prefill first, except that a
request that has waited its starvation bound goes first, oldest first: `aging_s`, or
sooner the wait FCFS would have given it plus `fcfs_slack_s`, a slack of at most
`fcfs_slack_ratio` x that FCFS wait (`policy.spf_bound_s`). With the bound rule "start"
(`cost_aware`'s default) the bound is on the start time: a shorter prefill runs only if
it is predicted to end before every waiting request's bound runs out. The prediction is
the cost model's prefill time of the request's (uncached, cached) tokens, the model the
conductor places with.

The option is `conductor.prefill_order` (empty: the placement policy's default, so
`cost_aware` runs spf on the nodes and predicts spf waits in the conductor) and
`conductor.prefill_aging_s`, `conductor.prefill_fcfs_slack_s`,
`conductor.prefill_fcfs_slack_ratio`, `conductor.prefill_bound_rule`; `resolve_order`,
`resolve_aging`, `resolve_fcfs_slack`, `resolve_fcfs_slack_ratio` and `resolve_bound_rule` are where both
sides resolve them (through `PolicyConfig`, as the simulator does).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mooncaked.conductor.policy import (
    PREFILL_ORDERS,
    SPF_BOUND_RULES,
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


def resolve_aging(policy: str, aging_s: float) -> float:
    """spf's absolute starvation bound (PolicyConfig.aging_s), seconds: `aging_s` when >= 0,
    else the placement policy's default (inf for cost_aware, whose bound is relative to
    FCFS; else 30)."""
    if aging_s >= 0:
        return aging_s
    return PolicyConfig(policy=policy).aging_s


def resolve_fcfs_slack_ratio(policy: str, fcfs_slack_ratio: float) -> float:
    """spf's cap on the slack as a multiple of the FCFS wait (PolicyConfig.fcfs_slack_ratio):
    `fcfs_slack_ratio` when >= 0, else the placement policy's default (1 for cost_aware,
    else inf)."""
    if fcfs_slack_ratio >= 0:
        return fcfs_slack_ratio
    return PolicyConfig(policy=policy).fcfs_slack_ratio


def resolve_bound_rule(policy: str, bound_rule: str) -> str:
    """How spf reads the starvation bound (PolicyConfig.spf_bound_rule): `bound_rule` when
    set, else the placement policy's default ("start" for cost_aware, else "wait").
    Raises: ValueError on an unknown rule."""
    return PolicyConfig(policy=policy, spf_bound_rule=bound_rule).spf_bound_rule


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
        fcfs_slack_ratio: the slack is at most this times that FCFS wait (inf: no cap).
        bound_rule: "wait" (a request goes first once it waited its bound) or "start" (a
            shorter prefill runs only if predicted to end before every waiting request's
            bound runs out; `policy.spf_pick`'s bound_on_start).
        clock: monotonic seconds (injectable for tests).
    Use `async with queue.turn(predicted_s):` (or `acquire`/`release`) around the
    engine's prefill. Must be used
    from one event loop. Raises (constructor): ValueError on an unknown order or a
    negative aging bound, slack or ratio.
    """

    def __init__(self, order: str = "fcfs", aging_s: float = 30.0,
                 fcfs_slack_s: float = float("inf"),
                 clock: Callable[[], float] = time.monotonic,
                 fcfs_slack_ratio: float = float("inf"), bound_rule: str = "wait"):
        if order not in PREFILL_ORDERS:
            raise ValueError(f"unknown prefill order {order!r}")
        if bound_rule not in SPF_BOUND_RULES:
            raise ValueError(f"unknown bound rule {bound_rule!r}")
        if not (aging_s >= 0 and fcfs_slack_s >= 0 and fcfs_slack_ratio >= 0):
            raise ValueError(f"aging_s, fcfs_slack_s and fcfs_slack_ratio must be >= 0, got "
                             f"{aging_s}, {fcfs_slack_s}, {fcfs_slack_ratio}")
        self.order, self.aging_s, self.fcfs_slack_s, self._clock = (order, aging_s,
                                                                    fcfs_slack_s, clock)
        self.fcfs_slack_ratio, self.bound_on_start = fcfs_slack_ratio, bound_rule == "start"
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
                    spf_bound_s(self.aging_s, fcfs_wait, self.fcfs_slack_s,
                                self.fcfs_slack_ratio),
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
                         self.aging_s, self.bound_on_start)
            w = self._waiting.pop(k)
            if w.turn.done():          # cancelled meanwhile
                continue
            self._running += 1
            self._run_end = now + w.predicted_s
            w.turn.set_result(None)
            self.started.append(w.predicted_s)
            del self.started[:-1000]


__all__ = ["PrefillQueue", "resolve_aging", "resolve_bound_rule", "resolve_fcfs_slack",
           "resolve_fcfs_slack_ratio", "resolve_order"]
