"""Whether a request rejected on its TTFT SLO could ever meet it (issue 32, fault 5).

An early rejection on the TTFT SLO is a 429 with Retry-After: the load goes down, the
request fits later. A request whose TTFT breaks the SLO even on an idle cluster (no
queue anywhere) never fits, and a client that retries a 429 waits in vain: the API
answers it 400 `slo_unattainable` with no Retry-After, and names what would pass, the
longest prompt (with the same prefix) that the same placement predicts within the SLO
on an idle cluster.

Pure functions over the policy's frozen Snapshot; the placement itself is passed in
(`Place`: the conductor's single-node `place` and its CPP groups alike), so the idle
verdict is the placement's own prediction with the queues emptied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from mooncaked.utils import cdiv

from .policy import Placement, PlacementRequest, Rejection, Snapshot

# A placement over a snapshot: the conductor's `place` (with its groups) under fixed
# settings. Returns a Placement or a Rejection.
Place = Callable[[PlacementRequest, Snapshot], "Placement | Rejection | None"]


def idle_snapshot(snap: Snapshot) -> Snapshot:
    """`snap` with every queue empty and every node free now: prefill queues 0, nothing
    waiting or in flight, no pending prefixes, transfers not busy; the prefix matches
    (what is cached where) and the decode side are kept."""
    n = len(snap.prefill_nodes)
    return dataclasses.replace(
        snap, prefill_queue_s=[0.0] * n, prefill_queued_s=(),
        prefill_busy_s=[0.0] * n if snap.prefill_busy_s else (),
        holder_busy_s=[0.0] * len(snap.holder_nodes) if snap.holder_busy_s else (),
        pending_prefix_blocks=(), pending_ready_s=(),
        prefill_free_s=[0.0] * n if snap.prefill_free_s else ())


def unattainable(place: Place, req: PlacementRequest, snap: Snapshot) -> bool:
    """True when `place` rejects req on the TTFT SLO even over idle_snapshot(snap)."""
    r = place(req, idle_snapshot(snap))
    return isinstance(r, Rejection) and r.reason == "ttft_slo"


def longest_attainable(place: Place, req: PlacementRequest, snap: Snapshot,
                       block_size: int) -> int:
    """The longest prompt (tokens, a prefix of req's, its keys cut to match) that `place`
    admits on the TTFT SLO over idle_snapshot(snap): by bisection, predicted TTFT growing
    with the prompt. 0 when not even one token would. O(log prompt_tokens) placements."""
    idle = idle_snapshot(snap)

    def fits(m: int) -> bool:
        r = place(PlacementRequest(list(req.keys[:cdiv(m, block_size)]), m,
                                   req.max_new_tokens), idle)
        return not (isinstance(r, Rejection) and r.reason == "ttft_slo")

    lo, hi = 0, req.prompt_tokens          # fits(lo) assumed; hi does not fit
    if not fits(1):
        return 0
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["Place", "idle_snapshot", "longest_attainable", "unattainable"]
