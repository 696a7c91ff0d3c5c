"""What the conductor knows of each node's load: its view of the node, fed by the node's
reports and by the placements not yet in them (so a burst of requests between two
reports does not all land on the same node)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from mooncaked.wire.messages import NodeReport

from .cost_model import CostModel

INFLIGHT_TTL_S = 3.0        # a placement not seen in the chosen node's reports by then is gone


@dataclass(frozen=True)
class InflightPrefill:
    """A placement on a prefill node that its reports do not count yet: tokens to compute
    and cached, and when it was placed (monotonic seconds)."""

    new: int
    cached: int
    placed_at: float


@dataclass(frozen=True)
class InflightDecode:
    """A decode placement: KV tokens it will hold (prompt + output), when it was placed,
    and when the conductor stops counting it unless a report names it (monotonic
    seconds).

    The decode node only learns of a request when its prefill is done, so the entry must
    outlive the prefill: `expires_at` = placement + predicted TTFT + INFLIGHT_TTL_S (see
    `inflight_decode`). A fixed TTL from placement let a long prefill's request vanish
    from decode placement, and a second request land on the same node meanwhile.

    `starts_at`, `decode_s`: when it is predicted to decode there (placement + predicted
    TTFT) and for how long (its output tokens at the predicted step time). A new request's
    TBT and KV room count it only when their decodes overlap (`decode_load_during`).
    Counting every placement still in a prefill queue as decoding now made a queue of
    prefills look like a full decode batch (issue 33: 9 of 11 predicted misses were such
    `decode_full`s, with 1 request decoding). Once a report names it, its end moves to
    `NodeView.decoding`, re-anchored at that report (`apply_load`)."""

    tokens: int
    placed_at: float
    expires_at: float
    starts_at: float = 0.0
    decode_s: float = math.inf


def inflight_decode(tokens: int, now: float, predicted_ttft_s: float,
                    decode_s: float = math.inf) -> InflightDecode:
    """The in-flight entry of a decode placement made at monotonic `now` (seconds) for a
    request that will hold `tokens` KV tokens, whose first token is predicted
    `predicted_ttft_s` seconds later (NaN or negative counts as 0) and whose decode is
    predicted to take `decode_s` seconds (NaN: unknown, inf)."""
    ttft = predicted_ttft_s if predicted_ttft_s == predicted_ttft_s and predicted_ttft_s > 0 else 0.0
    dec = decode_s if decode_s == decode_s and decode_s >= 0 else math.inf
    return InflightDecode(tokens, now, now + ttft + INFLIGHT_TTL_S, now + ttft, dec)


def decode_load_during(v: NodeView, start: float, end: float, now: float,
                       rid: str | None = None) -> tuple[int, int, int]:
    """(requests, KV tokens, KV tokens in flight) a request decoding on node v over
    [start, end] (monotonic seconds; `now`: the present) shares its steps with: the
    reported batch less the requests predicted to have finished by `start`
    (`v.decoding`), plus the placements in flight to v predicted to decode within the
    window. A placement not decoding yet
    decodes from `now` at the earliest, whatever its predicted start said. The placement
    of request `rid` itself is not counted: a request placed again (its KV hand-over
    failed, its stream resumed, its prefill node refused) replaces its earlier
    placement, it does not share KV with it (counted, it made a decode node with room
    for the request look full: a 429 decode_full for a request sent across a cut link,
    issue 34).

    Counting the whole reported batch predicted a request's step at the batch of the
    moment it was placed, though with outputs of tens of tokens most of that batch has
    finished by its first token (issue 33: predicted steps 1.5-2x the gaps observed).
    The third figure, the in-flight placements' tokens alone, is what KV room must keep
    free (a finished request's pages are only predicted to be free)."""
    done = [t for r, (e, t) in v.decoding.items() if r in v.decode_rids and e < start]
    batch = max(0, v.decode_batch - len(done))
    context = max(0, v.decode_context_tokens - sum(done))
    inflight = 0
    for r, x in v.inflight_decode.items():
        first = max(x.starts_at, now)
        if r != rid and first <= end and first + x.decode_s >= start:
            batch += 1
            inflight += x.tokens
    return batch, context + inflight, inflight


@dataclass
class NodeView:
    """What the conductor knows of one node (from its member record and its reports)."""

    node_id: str
    role: str = ""
    control: str = ""
    api: str = ""
    info: dict = field(default_factory=dict)
    draining: bool = False
    reported_at: float = 0.0                 # monotonic seconds of the last report; 0: none
    # rid -> (new tokens, cached tokens)
    prefill_pending: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefill_waiting: set[str] = field(default_factory=set)   # pending, not computing yet
    # rid -> when a report first listed it computing (pending, not waiting; monotonic s)
    prefill_running_since: dict[str, float] = field(default_factory=dict)
    decode_rids: set[str] = field(default_factory=set)
    decode_batch: int = 0
    decode_context_tokens: int = 0
    free_kv_tokens: int = 0
    store_seq: int = -1                      # last store event seq applied (-1: no inventory yet)
    inflight_prefill: dict[str, InflightPrefill] = field(default_factory=dict)
    inflight_decode: dict[str, InflightDecode] = field(default_factory=dict)
    # rid -> (predicted end of its decode, monotonic s; its KV tokens) of the placements
    # its reports name as decoding (moved from inflight_decode by apply_load)
    decoding: dict[str, tuple[float, int]] = field(default_factory=dict)
    placed: int = 0                          # requests placed here (prefill or decode)
    # peer -> bytes/s its transfer engine measured on the transfers it started with the
    # peer (READs: peer -> node, WRITEs: node -> peer; ConductorService.path_rates)
    links: dict[str, float] = field(default_factory=dict)
    stalled: str = ""                        # why it cannot take requests now ("" : it can)


def apply_load(v: NodeView, r: NodeReport, now: float) -> None:
    """Takes node v's reported load (monotonic `now`), and forgets the placements it now
    counts itself or that never reached it in time: a prefill placement within
    INFLIGHT_TTL_S, a decode placement by its `expires_at`."""
    v.reported_at = now
    v.links = dict(r.links)
    v.stalled = r.stalled
    v.draining = r.draining or bool(v.info.get("draining", False))
    v.prefill_pending = dict(r.pending)
    v.prefill_waiting = set(r.waiting) & v.prefill_pending.keys()
    running = v.prefill_pending.keys() - v.prefill_waiting
    v.prefill_running_since = {rid: v.prefill_running_since.get(rid, now) for rid in running}
    v.decode_rids = set(r.decode.rids)
    v.decode_batch = r.decode.batch
    v.decode_context_tokens = r.decode.context_tokens
    v.free_kv_tokens = r.decode.free_kv_tokens
    seen = set(r.arrived) | v.prefill_pending.keys() | v.decode_rids
    for rid in v.decode_rids & v.inflight_decode.keys():   # it decodes from now on
        x = v.inflight_decode[rid]
        v.decoding[rid] = (now + x.decode_s, x.tokens)
    for rid in [x for x in v.decoding if x not in v.decode_rids]:
        del v.decoding[rid]
    for rid in [x for x, e in v.inflight_prefill.items()
                if x in seen or now - e.placed_at > INFLIGHT_TTL_S]:
        del v.inflight_prefill[rid]
    for rid in [x for x, e in v.inflight_decode.items()
                if x in seen or now > e.expires_at]:
        del v.inflight_decode[rid]


def queue_s(v: NodeView, cost: CostModel, now: float | None = None) -> float:
    """Predicted prefill work queued on node v at monotonic `now` (default: the present),
    seconds: its reported pending prefills and the placements its reports do not count
    yet, less the time the oldest running prefill has computed since a report first
    listed it (at least 0; a lower bound on its progress, as it started before that
    report; one only, as the node computes its queue in turn). Counting a running
    prefill's whole cost over-predicted TTFTs under load by the part it had done, and by
    a finished one's whole cost until the next report (issue 33: TTFT prediction error
    0.4-0.5 at P/D's top rates)."""
    now = time.monotonic() if now is None else now
    work = {rid: cost.prefill_s(new, cached) for rid, (new, cached) in v.prefill_pending.items()}
    total = sum(work.values())
    if v.prefill_running_since:
        rid = min(v.prefill_running_since, key=v.prefill_running_since.__getitem__)
        total -= min(work.get(rid, 0.0), max(0.0, now - v.prefill_running_since[rid]))
    total += sum(cost.prefill_s(x.new, x.cached) for rid, x in v.inflight_prefill.items()
                 if rid not in v.prefill_pending)
    return total


def queued_work(v: NodeView, cost: CostModel) -> list[float]:
    """Predicted prefill seconds of each request waiting its turn on node v (the running
    ones excluded), for the shortest-first wait (`policy.Snapshot.prefill_queued_s`): the
    reported waiting prefills and the placements its reports do not count yet, except
    that on a node running nothing the oldest unreported placement is taken as running
    (it will start at once)."""
    work = [cost.prefill_s(*v.prefill_pending[rid]) for rid in sorted(v.prefill_waiting)]
    unseen = sorted((x.placed_at, rid) for rid, x in v.inflight_prefill.items()
                    if rid not in v.prefill_pending)
    if unseen and len(v.prefill_pending) == len(v.prefill_waiting):
        unseen = unseen[1:]                   # nothing runs there: the oldest starts now
    work += [cost.prefill_s(v.inflight_prefill[rid].new, v.inflight_prefill[rid].cached)
             for _, rid in unseen]
    return work


__all__ = ["INFLIGHT_TTL_S", "InflightDecode", "InflightPrefill", "NodeView", "apply_load",
           "decode_load_during", "inflight_decode",
           "queue_s", "queued_work"]
