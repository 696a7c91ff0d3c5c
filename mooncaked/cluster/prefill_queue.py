"""The order in which a prefill node runs its waiting requests (issue 17).

With ``fcfs`` (Algorithm 1, the default) nothing is held back: every request goes
straight into the engine, whose scheduler takes waiting requests oldest first.

With ``spf`` the node runs one prefill at a time (as the paper's prefill instance and
the simulator do) and picks the next one with the same pure function the simulator
uses, `conductor.policy.spf_pick`: the shortest predicted prefill first, except that a
request that has waited `aging_s` seconds or more goes first, oldest first (the
starvation bound). The prediction is the cost model's prefill time of the request's
(uncached, cached) tokens, the model the conductor places with.

The option is `conductor.prefill_order` (empty: the placement policy's default, so
`cost_aware` runs spf on the nodes and predicts spf waits in the conductor) and
`conductor.prefill_aging_s`; `resolve_order` is the one place both sides resolve it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mooncaked.conductor.policy import PREFILL_ORDERS, policy_defaults, spf_pick


def resolve_order(policy: str, prefill_order: str) -> str:
    """The prefill order a cluster runs: `prefill_order` when set, else the placement
    policy's default (`policy.policy_defaults`). Raises: ValueError on an unknown order."""
    order = prefill_order or policy_defaults(policy)[2]
    if order not in PREFILL_ORDERS:
        raise ValueError(f"unknown prefill order {order!r}; choose one of "
                         f"{', '.join(PREFILL_ORDERS)}")
    return order


@dataclass
class _Waiter:
    enqueued: float                 # seconds on the queue's clock
    predicted_s: float
    turn: asyncio.Future


class PrefillQueue:
    """Admission of one node's prefills into its engine (see the module doc).

    Args:
        order: "fcfs" (pass through) or "spf".
        aging_s: spf's starvation bound, seconds (>= 0).
        clock: monotonic seconds (injectable for tests).
    Use `async with queue.turn(predicted_s):` (or `acquire`/`release`) around the
    engine's prefill. Must be used
    from one event loop. Raises (constructor): ValueError on an unknown order or a
    negative aging bound.
    """

    def __init__(self, order: str = "fcfs", aging_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if order not in PREFILL_ORDERS:
            raise ValueError(f"unknown prefill order {order!r}")
        if not aging_s >= 0:
            raise ValueError(f"aging_s must be >= 0, got {aging_s}")
        self.order, self.aging_s, self._clock = order, aging_s, clock
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
        w = _Waiter(self._clock(), float(predicted_s),
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
            k = spf_pick([(w.enqueued, w.predicted_s) for w in self._waiting], self._clock(),
                         self.aging_s)
            w = self._waiting.pop(k)
            if w.turn.done():          # cancelled meanwhile
                continue
            self._running += 1
            w.turn.set_result(None)
            self.started.append(w.predicted_s)
            del self.started[:-1000]


__all__ = ["PrefillQueue", "resolve_order"]
