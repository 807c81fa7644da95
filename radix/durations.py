"""Durations of the cache's maintenance calls, as fixed-bucket histograms (seconds).

``RadixCache.durations`` records, per kind, the wall time of each call (``time.perf_counter``):

* ``eviction``: one device eviction pass (``evict``, ``evict_states``, ``evict_swa``);
* ``load_back``: one host -> device load-back (``load_back``; the call, which on a GPU
  enqueues the copies on the transfer stream);
* ``backup``: one device -> host backup of a chain (the host tier's write policy; the call).

The histograms are cumulative over the cache's life (``reset`` keeps them: a Prometheus
histogram never goes down). ``radix.metrics`` exports them as SGLang's
``eviction_duration_seconds``, ``load_back_duration_seconds`` and
``hicache_backup_duration_seconds``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: Bucket upper bounds, seconds (the last bucket, +Inf, is implicit).
BUCKETS: tuple[float, ...] = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                              1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

KINDS = ("eviction", "load_back", "backup")


@dataclass
class Histogram:
    """Counts per bucket (``len(BUCKETS) + 1``, the last for +Inf; not cumulative), the sum
    of the observed seconds, the number of observations."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(upper bound, observations <= it)`` per bucket, ``"+Inf"`` last (Prometheus)."""
        out, run = [], 0
        for bound, n in zip((*map(repr, BUCKETS), "+Inf"), self.counts, strict=True):
            run += n
            out.append((bound, run))
        return out


class Durations:
    """One :class:`Histogram` per kind of :data:`KINDS`."""

    def __init__(self) -> None:
        self.histograms: dict[str, Histogram] = {k: Histogram() for k in KINDS}

    def observe(self, kind: str, seconds: float) -> None:
        self.histograms[kind].observe(seconds)
