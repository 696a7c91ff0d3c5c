"""Prometheus metrics of the API node (prometheus_client, one registry per app).

Latency series are measured where the client sees them, at the API: TTFT from the
request's arrival to its first token; inter-token latency once per generated
token; per-request TBT as the Mooncake paper defines it (the mean of the longest
10% of a request's inter-token gaps, `mooncaked.measures.tbt_s`). Engine state
(running and waiting requests, KV blocks, admitted and prefix-hit tokens) is
read from `EngineStats` at scrape time by a custom collector, so it is never stale.

Two scopes, so that summing a series over a cluster's nodes means one thing:
  - API series count the requests this node's API served (each request is served
    by exactly one API node): latencies, requests_total, prompt_tokens_total and
    generation_tokens_total (prompt tokens once per prompt, as `usage.prompt_tokens`;
    generated tokens over every choice, as `usage.completion_tokens`).
  - Engine series count this node's own engine (zero on a node without one, such as
    a cache node): a disaggregated request's prompt is admitted by its prefill node
    and again by its decode node, so engine_prompt_tokens_total summed over nodes
    counts it twice; prefix_hit_tokens_total / engine_prompt_tokens_total of one
    node is its prefix hit rate.

Series (all prefixed `mooncaked_`):
  API: time_to_first_token_seconds, inter_token_latency_seconds, request_tbt_seconds,
  e2e_request_latency_seconds (histograms), requests_total{finish_reason} (counter:
  stop, length, abort, error), prompt_tokens_total, generation_tokens_total,
  http_requests_total{route,status} (counters).
  Engine: num_requests_running, num_requests_waiting, kv_blocks_used,
  kv_blocks_capacity (gauges), engine_prompt_tokens_total, prefix_hit_tokens_total,
  preemptions_total (counters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mooncaked.engine.types import EngineStats
from mooncaked.measures import tbt_s

FINISH_REASONS = ("stop", "length", "abort", "error")

# Seconds. TTFT spans a cached short prompt (ms) to a long cold prefill on CPU (tens of s).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
# Seconds. Per-token gaps; the paper's TBT SLOs are 0.1, 0.2 and 0.3 s, so they are edges.
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

PREFIX = "mooncaked_"


class _EngineCollector(Collector):
    """Reads EngineStats at scrape time (gauges and the engine's own counters)."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        gauges = [
            ("num_requests_running", "Requests in the engine's running batch.", s.num_running),
            ("num_requests_waiting", "Requests queued for the engine.", s.num_waiting),
            ("kv_blocks_used", "KV blocks in use (referenced by requests).", s.kv_blocks_used),
            ("kv_blocks_capacity", "KV blocks in the device pool.", s.kv_blocks_total),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = [
            ("engine_prompt_tokens", ("Prompt tokens this node's engine admitted, once per "
                                      "choice (a disaggregated request counts on its prefill "
                                      "and its decode node)."),
             s.prompt_tokens_total),
            ("prefix_hit_tokens", ("Prompt tokens this node's engine served from cached KV "
                                   "blocks (prefix hits)."),
             s.prefix_hit_tokens_total),
            ("preemptions", "Requests preempted when KV blocks ran out.",
             s.num_preemptions_total),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ApiMetrics:
    """The API node's metrics in their own CollectorRegistry (so several apps in one
    process, as in tests, never collide in the global registry).

    Args:
        stats: returns the engine's EngineStats; called on each scrape.
    """

    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from request arrival to its first token (TTFT), seconds.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap before each generated token after the first, seconds.",
                             buckets=TBT_BUCKETS, registry=r)
        self.tbt = Histogram(PREFIX + "request_tbt_seconds",
                             "Per-request TBT: mean of the longest 10% of its inter-token gaps "
                             "(Mooncake, section 5), seconds.", buckets=TBT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from request arrival to its last token, seconds.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished engine requests (one per choice) "
                                "by finish reason.", ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)     # every series exists from the start, at 0
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens",
                                     "Prompt tokens of the requests this node's API served, "
                                     "once per prompt (as usage.prompt_tokens).", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Generated (output) tokens of the requests this "
                                         "node's API served.", registry=r)
        self.http = Counter(PREFIX + "http_requests", "HTTP requests by route and status.",
                            ["route", "status"], registry=r)
        r.register(_EngineCollector(stats))

    def observe_request(self, arrival_s: float, token_times_s: Sequence[float],
                        finish_reason: str, num_output_tokens: int) -> None:
        """Records one finished engine request.

        Args:
            arrival_s: when the API received the request (time.monotonic(), seconds).
            token_times_s: arrival time of each output token at the API (monotonic s).
            finish_reason: one of FINISH_REASONS (others are counted as given).
            num_output_tokens: tokens generated.
        """
        self.requests.labels(finish_reason).inc()
        self.generation_tokens.inc(num_output_tokens)
        if not token_times_s:
            return
        self.ttft.observe(token_times_s[0] - arrival_s)
        for a, b in zip(token_times_s, token_times_s[1:]):
            self.itl.observe(b - a)
        if len(token_times_s) > 1:
            self.tbt.observe(tbt_s(token_times_s))
        self.e2e.observe(token_times_s[-1] - arrival_s)

    def observe_prompt(self, num_tokens: int) -> None:
        """Records the prompt (tokens) of a request this API served: one whose engine
        request produced output (not one refused before its prefill)."""
        self.prompt_tokens.inc(num_tokens)

    def render(self) -> tuple[bytes, str]:
        """(Prometheus text exposition, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
