"""Per-node stall metrics (issue 13): engine step time, event-loop lag, relay delay. On
the base floor: the engine records its steps here, the API and the cluster node serve them.

One `NodeMetrics` per process (`node_metrics()`), registered into every API app's
Prometheus registry (`attach`) and summarised in `node.status` (`mooncake ctl status`):

  mooncaked_engine_step_seconds{kind}   histogram: one engine step (schedule excluded:
                                        the forward pass, sampling, stop checks), by kind:
                                        ``decode`` (decodes only), ``prefill`` (prefill
                                        chunks only), ``mixed`` (both). Each step's batch
                                        size and context tokens go to the debug log
                                        (event ``engine_step``).
  mooncaked_event_loop_lag_seconds      histogram: how late a periodic timer on the node's
                                        event loop fires (LOOP_LAG_INTERVAL_S apart); a
                                        handler holding the loop (or the GIL) shows here.
  mooncaked_relay_delay_seconds         histogram: from the engine emitting a token (the
                                        step that sampled it returned) to the API node
                                        writing it to the client, seconds. Across nodes it
                                        uses wall clocks (time.time()), so clock skew
                                        between hosts adds to it; on one host it is exact.

The summaries (count, mean, p50, p99, max over the last SUMMARY_WINDOW samples) are what
`mooncake ctl status` prints per node.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from typing import Any

from prometheus_client import Histogram

from mooncaked.log import get_logger

log = get_logger(__name__)

PREFIX = "mooncaked_"
# Seconds. A CPU decode step is tens of ms to seconds; GPU steps are ms.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
# Seconds. A healthy loop fires its timer within a millisecond; a stall is 10 ms and up.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
               10.0)
# The loop-lag timer period, seconds: fine enough to see a stall of a few tens of ms, cheap
# enough (10 wake-ups a second) to be invisible in the node's own load.
LOOP_LAG_INTERVAL_S = 0.1
# Recent samples kept per series for the ctl summary's quantiles.
SUMMARY_WINDOW = 2048
STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(num_decode_seqs: int, num_prefill_tokens: int) -> str:
    """``decode`` (no prefill tokens), ``prefill`` (no decodes) or ``mixed``."""
    if num_prefill_tokens == 0:
        return "decode"
    return "prefill" if num_decode_seqs == 0 else "mixed"


class _Series:
    """Count, sum, max and a window of recent samples of one measure (seconds)."""

    def __init__(self) -> None:
        self.count, self.total, self.max = 0, 0.0, 0.0
        self.recent: deque[float] = deque(maxlen=SUMMARY_WINDOW)

    def add(self, v: float) -> None:
        self.count += 1
        self.total += v
        self.max = max(self.max, v)
        self.recent.append(v)

    def summary(self) -> dict[str, Any]:
        """{"count", "mean_s", "p50_s", "p99_s", "max_s"} (quantiles over the recent window;
        None when empty)."""
        r = sorted(self.recent)
        if not r:
            return {"count": 0, "mean_s": None, "p50_s": None, "p99_s": None, "max_s": None}
        return {"count": self.count, "mean_s": round(self.total / self.count, 6),
                "p50_s": round(statistics.median(r), 6),
                "p99_s": round(r[min(len(r) - 1, int(0.99 * len(r)))], 6),
                "max_s": round(self.max, 6)}


class NodeMetrics:
    """The three stall measures of one process (see the module doc)."""

    def __init__(self) -> None:
        self.step = Histogram(PREFIX + "engine_step_seconds", "One engine step (forward pass, "
                              "sampling), seconds, by kind: decode, mixed, prefill.", ["kind"],
                              buckets=STEP_BUCKETS, registry=None)
        for k in STEP_KINDS:
            self.step.labels(k)
        self.loop_lag = Histogram(PREFIX + "event_loop_lag_seconds", "How late a periodic "
                                  "timer on the node's event loop fired, seconds.",
                                  buckets=LAG_BUCKETS, registry=None)
        self.relay = Histogram(PREFIX + "relay_delay_seconds", "From the engine emitting a "
                               "token to the API node writing it to the client, seconds.",
                               buckets=LAG_BUCKETS, registry=None)
        self._steps = {k: _Series() for k in STEP_KINDS}
        self._lag = _Series()
        self._relay = _Series()
        self._lag_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ recording

    def observe_step(self, seconds: float, num_decode_seqs: int, num_prefill_tokens: int,
                     context_tokens: int) -> None:
        """One engine step: its time (s), decodes in it, prefill tokens in it, and the
        context tokens it attended over (all sequences)."""
        kind = step_kind(num_decode_seqs, num_prefill_tokens)
        self.step.labels(kind).observe(seconds)
        self._steps[kind].add(seconds)
        log.debug("engine_step", kind=kind, seconds=round(seconds, 5),
                  batch=num_decode_seqs + (1 if num_prefill_tokens else 0),
                  decodes=num_decode_seqs, prefill_tokens=num_prefill_tokens,
                  context_tokens=context_tokens)

    def observe_relay(self, emitted_s: float | None) -> None:
        """A token written to the client now; emitted_s: time.time() when its step ended
        (None: unknown, nothing recorded)."""
        if emitted_s is None:
            return
        d = max(0.0, time.time() - emitted_s)
        self.relay.observe(d)
        self._relay.add(d)

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            lag = max(0.0, loop.time() - t - LOOP_LAG_INTERVAL_S)
            self.loop_lag.observe(lag)
            self._lag.add(lag)

    def start_loop_watch(self) -> None:
        """Starts the loop-lag timer on the running loop (idempotent per loop)."""
        if self._lag_task is None or self._lag_task.done():
            self._lag_task = asyncio.get_running_loop().create_task(self._watch_loop(),
                                                                    name="loop-lag")

    async def stop_loop_watch(self) -> None:
        """Stops the loop-lag timer."""
        t, self._lag_task = self._lag_task, None
        if t is not None:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await t

    # ------------------------------------------------------------------ reading

    def summary(self) -> dict[str, Any]:
        """What node.status shows: {"step": {kind: series}, "loop_lag": series,
        "relay_delay": series}; a series is _Series.summary()."""
        return {"step": {k: s.summary() for k, s in self._steps.items()},
                "loop_lag": self._lag.summary(), "relay_delay": self._relay.summary()}

    def collectors(self) -> list:
        """The Prometheus collectors to register in an API app's registry."""
        return [self.step, self.loop_lag, self.relay]


_NODE: NodeMetrics | None = None


def node_metrics() -> NodeMetrics:
    """This process's NodeMetrics (made on first use)."""
    global _NODE
    if _NODE is None:
        _NODE = NodeMetrics()
    return _NODE


def attach(app: Any, registry: Any) -> None:
    """Registers the node metrics in `registry` (an API app's) and runs the loop-lag timer
    while `app` (an aiohttp Application) serves."""
    nm = node_metrics()
    for c in nm.collectors():
        with contextlib.suppress(ValueError):     # already in this registry
            registry.register(c)

    async def _start(_app: Any) -> None:
        nm.start_loop_watch()

    async def _stop(_app: Any) -> None:
        await nm.stop_loop_watch()

    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)


__all__ = ["LOOP_LAG_INTERVAL_S", "NodeMetrics", "attach", "node_metrics", "step_kind"]
