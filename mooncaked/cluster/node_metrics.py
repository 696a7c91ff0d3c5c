"""A cluster node's own Prometheus series, and the node/role labelling of every series
the node exports (issue 19: "every series is labelled with node and role").

`NodeCollector` reads the node at scrape time (never stale, nothing on the hot path):

  mooncaked_node_up{node,role}                    1 (the series to join on)
  mooncaked_node_leader / _draining / _healthy    0 or 1 (healthy: /health would say 200)
  mooncaked_conductor_placed_total                placements by this node's conductor
  mooncaked_conductor_rejected_total{reason}      early rejections by reason
  mooncaked_conductor_ttft_predictions_total      predictions that got their observation
  mooncaked_conductor_predicted_ttft_seconds_total / _observed_ttft_seconds_total
                                                  sums over those (divide by the count
                                                  for the means; the ratio is the bias)
  mooncaked_admission_decisions_total{check,verdict}  admission verdicts (admit, reject,
                                                  shadow) of the conductor's check and of
                                                  this node's TBT check (check=conductor|node)
  mooncaked_cost_model_scale{check,part}          calibration scale of the prefill / decode
                                                  model (conductor/refit.py)
  mooncaked_cost_model_abs_rel_error{check,kind}  median |predicted - measured| / measured
                                                  of recent TTFT, prefill-step and
                                                  decode-step predictions
  mooncaked_store_blocks{tier} / _bytes{tier} / _capacity_bytes{tier}
  mooncaked_store_hits_total{tier}, _misses_total, _evictions_total{tier},
  mooncaked_store_corrupt_blocks_total, _io_errors_total
  mooncaked_kv_transfer_bytes_total{direction=push|read}
  mooncaked_kv_transfer_total{kind=push|push_failed|staged_only|read|received_pushed}
  mooncaked_kv_transfer_exposed_seconds_total     push WRITE time after the compute ended
  mooncaked_kv_transfer_busy_seconds_total{direction}

The conductor series exist only on the leader. `label_registry` makes the node's ApiMetrics render
every series of its registry (the API's, the engine's, these, and any another module
registers there) with node and role labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .health import node_health

PREFIX = "mooncaked_"


def _gauge(name: str, doc: str, value: float, labels: dict | None = None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), value)
    return g


class NodeCollector(Collector):
    """Scrape-time series of one ClusterNode (see the module doc)."""

    def __init__(self, node: Any):
        self.node = node

    def collect(self):
        n = self.node
        yield _gauge("node_up", "1 while the node process serves.", 1)
        yield _gauge("node_leader", "1 while this node runs the conductor.",
                     int(n.conductor is not None))
        yield _gauge("node_draining", "1 while the node drains (ctl drain or SIGTERM).",
                     int(n.draining))
        yield _gauge("node_healthy", "1 while /health answers 200 (joined, not draining, "
                     "coordination session alive, conductor elected).",
                     int(node_health(n)[0] == 200))
        yield from self._conductor()
        yield from self._admission()
        yield from self._store()
        yield from self._transfer()

    def _conductor(self):
        c = self.node.conductor
        if c is None:
            return
        yield CounterMetricFamily(PREFIX + "conductor_placed", "Requests placed.",
                                  value=c.placed)
        rej = CounterMetricFamily(PREFIX + "conductor_rejected",
                                  "Requests rejected early, by reason.", labels=["reason"])
        for reason, count in sorted(c.rejected.items()):
            rej.add_metric([reason], count)
        yield rej
        m = c.model
        yield CounterMetricFamily(PREFIX + "conductor_ttft_predictions",
                                  "TTFT predictions that got their observed prefill time.",
                                  value=m.ttft_pairs)
        yield CounterMetricFamily(PREFIX + "conductor_predicted_ttft_seconds",
                                  "Sum of predicted TTFTs of those requests, seconds.",
                                  value=m.predicted_ttft_sum_s)
        yield CounterMetricFamily(PREFIX + "conductor_observed_ttft_seconds",
                                  "Sum of their observed prefill times, seconds.",
                                  value=m.observed_ttft_sum_s)

    def _admission(self):
        """Verdicts, calibration scales and prediction errors of the conductor's check (on
        the leader) and this node's TBT check (decode and coupled nodes)."""
        checks = []
        if self.node.conductor is not None:
            checks.append(("conductor", self.node.conductor.admission, self.node.conductor.model))
        if self.node.decode is not None:
            checks.append(("node", self.node.decode.admission.ledger,
                           self.node.decode.admission.model))
        if not checks:
            return
        dec = CounterMetricFamily(PREFIX + "admission_decisions", "Admission verdicts.",
                                  labels=["check", "verdict"])
        scale = GaugeMetricFamily(PREFIX + "cost_model_scale", "Calibration scale of the "
                                  "cost model's part (1: as loaded or last refitted).",
                                  labels=["check", "part"])
        err = GaugeMetricFamily(PREFIX + "cost_model_abs_rel_error", "Median absolute "
                                "relative error of recent predictions.",
                                labels=["check", "kind"])
        for name, ledger, model in checks:
            for verdict, count in sorted(ledger.counts.items()):
                dec.add_metric([name, verdict], count)
            for part, k in sorted(model.scale.items()):
                scale.add_metric([name, part], k)
            st = model.status()
            for kind in ("ttft_prediction", "prefill_step_prediction", "decode_step_prediction"):
                e = st[kind]["median_abs_rel_error"]
                if e is not None:
                    err.add_metric([name, kind.removesuffix("_prediction")], e)
        yield dec
        yield scale
        yield err

    def _store(self):
        store = self.node.store
        if store is None:
            return
        s = store.stats()
        blocks = GaugeMetricFamily(PREFIX + "store_blocks", "KV blocks held, by tier.",
                                   labels=["tier"])
        used = GaugeMetricFamily(PREFIX + "store_bytes", "Bytes held, by tier.", labels=["tier"])
        cap = GaugeMetricFamily(PREFIX + "store_capacity_bytes", "Tier capacity, bytes.",
                                labels=["tier"])
        for tier in ("dram", "ssd"):
            blocks.add_metric([tier], s[f"{tier}_blocks"])
            used.add_metric([tier], s[f"{tier}_used_bytes"])
            cap.add_metric([tier], s[f"{tier}_capacity_bytes"])
        yield from (blocks, used, cap)
        hits = CounterMetricFamily(PREFIX + "store_hits", "Block lookups served, by tier.",
                                   labels=["tier"])
        ev = CounterMetricFamily(PREFIX + "store_evictions", "Blocks evicted, by tier.",
                                 labels=["tier"])
        for tier, v in sorted((s.get("hits") or {}).items()):
            hits.add_metric([str(tier)], v)
        for tier, v in sorted((s.get("evictions") or {}).items()):
            ev.add_metric([str(tier)], v)
        yield from (hits, ev)
        yield CounterMetricFamily(PREFIX + "store_misses", "Block lookups missed.",
                                  value=s.get("misses", 0))
        yield CounterMetricFamily(PREFIX + "store_corrupt_blocks",
                                  "SSD blocks that failed their checksum (served as misses).",
                                  value=s.get("corrupt", 0))
        yield CounterMetricFamily(PREFIX + "store_io_errors", "SSD read/write errors.",
                                  value=s.get("io_errors", 0))

    def _transfer(self):
        k = self.node.kv_transfer
        b = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV bytes moved between nodes.",
                                labels=["direction"])
        b.add_metric(["push"], k.push_bytes)
        b.add_metric(["read"], k.read_bytes)
        yield b
        c = CounterMetricFamily(PREFIX + "kv_transfer", "KV hand-overs by kind.", labels=["kind"])
        for kind in ("pushed", "push_failed", "staged_only", "read", "received_pushed"):
            c.add_metric([kind], getattr(k, kind))
        yield c
        busy = CounterMetricFamily(PREFIX + "kv_transfer_busy_seconds",
                                   "Seconds KV transfers were in flight.", labels=["direction"])
        busy.add_metric(["push"], k.push_busy_s)
        busy.add_metric(["read"], k.read_s)
        yield busy
        yield CounterMetricFamily(PREFIX + "kv_transfer_exposed_seconds",
                                  "Seconds of push WRITEs after the prefill compute ended "
                                  "(transfer time the request waited for).",
                                  value=k.push_exposed_s)


class Labelled(Collector):
    """Every series of `inner` (a registry) with constant labels added; labels() is read at
    each scrape (a node's id is settled only once it joins)."""

    def __init__(self, inner: Any, labels: Callable[[], dict[str, str]]):
        self.inner, self.labels = inner, labels

    def collect(self):
        const = self.labels()
        for fam in self.inner.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**const, **s.labels}, s.value, s.timestamp, s.exemplar)
            yield out


def label_registry(metrics: Any, node: Any) -> None:
    """Adds the node's series to an ApiMetrics and makes its render() label every series
    of its registry with node and role (whatever registers there, now or later)."""
    from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry,  # noqa: PLC0415
                                   generate_latest)

    metrics.registry.register(NodeCollector(node))
    view = CollectorRegistry(auto_describe=False)
    view.register(Labelled(metrics.registry, lambda: {"node": node.node_id, "role": node.role}))
    metrics.render = lambda: (generate_latest(view), CONTENT_TYPE_LATEST)


__all__ = ["Labelled", "NodeCollector", "label_registry"]
