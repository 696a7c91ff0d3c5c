"""Measured bandwidth per peer path, from the transfers the engine makes.

Requests to one peer overlap (a batch, slices over several connections), so one request's
bytes / seconds would read the link as k times slower than it is when k share it. The
meter counts per peer busy periods instead: from the moment a first request to the peer
starts until none is in flight (or at most `max_period_s`, so that a path that never
idles still yields samples), it adds the bytes of the requests that completed; a period
of at least `min_sample_bytes` is one sample (its bytes and its seconds). The estimate is
the ratio of the exponentially weighted means of the samples' bytes and of their seconds
(weight `alpha` for the newest; the first sample is taken as is), not a mean of the
samples' rates: a request that ends just after a period was cut at `max_period_s`
brings all its bytes into a sample of a few milliseconds (two slices of one transfer
ending together read 100x the link), and a mean of rates keeps that; bytes over seconds
count every byte and every busy second once, whichever sample they fell in. Periods
below `min_sample_bytes` are latency, not bandwidth, and are ignored.

Direction: the TransferEngine meters the requests it starts (`TransferEngine._run`), per
peer node, READs (bytes peer -> this node) and WRITEs (this node -> peer) in one path; a
node's estimate for a peer is that link as its own transfers used it. In a cluster a
prefill node READs fetched prefix blocks from their holder and WRITEs its KV push to the
decode node; a decode node READs a prefill node's staged KV when no push delivered it;
the destination of a replica READs it from its source (docs/cluster.md, "Measured
bandwidth"; the conductor reads them as ConductorService.path_rates).

Pure bookkeeping over times the caller passes (seconds, time.monotonic()), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PathEstimate:
    """One peer path's measured bandwidth: bytes_per_s (smoothed), the samples it rests on,
    and the bytes they measured."""

    bytes_per_s: float
    samples: int
    bytes: int

    def to_json(self) -> dict:
        """{"bytes_per_s", "samples", "bytes"}."""
        return {"bytes_per_s": self.bytes_per_s, "samples": self.samples, "bytes": self.bytes}


@dataclass
class _Path:
    inflight: int = 0
    start: float = 0.0
    period_bytes: int = 0
    ewma_bytes: float = 0.0
    ewma_s: float = 0.0
    samples: int = 0
    measured: int = 0


@dataclass
class BandwidthMeter:
    """Per-peer busy-period bandwidth (see the module doc).

    Args:
        alpha: weight of the newest sample in the smoothed estimate (0 < alpha <= 1).
        min_sample_bytes: a busy period that moved fewer bytes is not a sample.
        max_period_s: a busy period is cut into samples of at most this many seconds.
    """

    alpha: float = 0.3
    min_sample_bytes: int = 256 << 10
    max_period_s: float = 1.0
    _paths: dict[str, _Path] = field(default_factory=dict)

    def begin(self, peer: str, now: float) -> None:
        """A request to `peer` starts at `now`."""
        p = self._paths.setdefault(peer, _Path())
        if p.inflight == 0:
            p.start, p.period_bytes = now, 0
        p.inflight += 1

    def end(self, peer: str, now: float, nbytes: int) -> None:
        """A request to `peer` that began ends at `now`, having moved `nbytes` (0 when it
        failed). Raises: KeyError for a peer with no begin()."""
        p = self._paths[peer]
        p.inflight = max(0, p.inflight - 1)
        p.period_bytes += nbytes
        if p.inflight == 0 or now - p.start >= self.max_period_s:
            self._sample(p, now)
            p.start, p.period_bytes = now, 0

    def _sample(self, p: _Path, now: float) -> None:
        dur = now - p.start
        if p.period_bytes < self.min_sample_bytes or dur <= 0:
            return
        if not p.samples:
            p.ewma_bytes, p.ewma_s = float(p.period_bytes), dur
        else:
            a = self.alpha
            p.ewma_bytes = a * p.period_bytes + (1 - a) * p.ewma_bytes
            p.ewma_s = a * dur + (1 - a) * p.ewma_s
        p.samples += 1
        p.measured += p.period_bytes

    def estimate(self, peer: str) -> PathEstimate | None:
        """The path's estimate, or None before its first sample."""
        p = self._paths.get(peer)
        if p is None or not p.samples:
            return None
        return PathEstimate(p.ewma_bytes / p.ewma_s, p.samples, p.measured)

    def estimates(self) -> dict[str, PathEstimate]:
        """Every measured path: peer -> estimate."""
        return {peer: e for peer in self._paths if (e := self.estimate(peer)) is not None}


__all__ = ["BandwidthMeter", "PathEstimate"]
