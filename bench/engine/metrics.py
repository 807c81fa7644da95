"""Per-request replay records -> the metrics an engine builder reads .

The replay appends one record per served request (:meth:`RequestLog.record`); after the run
:func:`summarize` turns the log into a :class:`ReplayMetrics`. Definitions (all lengths in
tokens, per served request ``i`` with prompt length ``L_i``):

* usable ``U_i``: the matched prefix the request may skip (``MatchResult.prefix_len``);
* KV hit ``K_i``: the KV-matched prefix ignoring states (``MatchResult.kv_hit_length``);
* token hit rate ``sum U / sum L``; KV hit rate ``sum K / sum L``;
* state-miss tokens ``K_i - U_i`` (KV present, no state to resume from);
* uncached tokens ``L_i - U_i`` (what the request prefills);
* prefill cost ``cost(U_i, L_i)`` with ``cost(a, b) = d*(b - a) + e*(b*b - a*a)/2e5``
  (the GDS cost model of ``components.eviction.gds``, in its own units; ``d = 1.862e-5``, ``e = 3.33e-6``).

Percentiles use numpy's default linear interpolation between order statistics
(``numpy.percentile(x, q)``): for ``x = [0, 10, 20, 30]``, p50 = 15 and p90 = 27.
Skipped requests (never admitted: memory could not hold them) are counted apart and take no
part in any rate or distribution.
"""

from __future__ import annotations

import resource
from array import array
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "COST_D",
    "COST_E",
    "Distribution",
    "ReplayMetrics",
    "RequestLog",
    "prefill_cost",
    "summarize",
]

COST_D = 1.862e-5
"""Linear (per-token) coefficient of the prefill cost model."""

COST_E = 3.33e-6
"""Quadratic (attention) coefficient of the prefill cost model, per ``2e5`` tokens squared."""


def prefill_cost(
    a: np.ndarray | float, b: np.ndarray | float, d: float = COST_D, e: float = COST_E
) -> Any:
    """``d*(b - a) + e*(b*b - a*a)/2e5``: cost to prefill positions ``a .. b`` [model units].

    Works on scalars and numpy arrays alike (float64; no overflow for any prompt length).
    """
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    return d * (b64 - a64) + e * (b64 * b64 - a64 * a64) / 2e5


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of one per-request quantity."""

    mean: float
    p50: float
    p90: float

    @classmethod
    def of(cls, values: np.ndarray) -> Distribution:
        """Summarize ``values`` (all zeros when empty)."""
        if values.size == 0:
            return cls(0.0, 0.0, 0.0)
        p50, p90 = np.percentile(values, [50, 90])
        return cls(float(values.mean()), float(p50), float(p90))


class RequestLog:
    """Append-only per-request lengths of one replay, stored compactly (``array('q')``).

    ``record`` is O(1) amortized; nothing else is computed until :func:`summarize`.
    """

    __slots__ = ("prompt_len", "usable_len", "kv_hit_len", "swa_miss_len", "skipped")

    def __init__(self) -> None:
        self.prompt_len = array("q")
        self.usable_len = array("q")
        self.kv_hit_len = array("q")
        self.swa_miss_len = array("q")
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.prompt_len)

    def record(self, prompt_len: int, usable_len: int, kv_hit_len: int, swa_miss_len: int = 0) -> None:
        """Log one served request (``swa_miss_len``: tokens the sliding-window rule cut).

        Raises:
            ValueError: unless ``0 <= usable_len <= kv_hit_len <= prompt_len`` and
                ``0 <= swa_miss_len <= kv_hit_len - usable_len``.
        """
        if not 0 <= usable_len <= kv_hit_len <= prompt_len:
            raise ValueError(
                f"need 0 <= usable ({usable_len}) <= kv_hit ({kv_hit_len}) <= prompt ({prompt_len})"
            )
        if not 0 <= swa_miss_len <= kv_hit_len - usable_len:
            raise ValueError(f"need 0 <= swa_miss ({swa_miss_len}) <= kv_hit - usable")
        self.swa_miss_len.append(swa_miss_len)
        self.prompt_len.append(prompt_len)
        self.usable_len.append(usable_len)
        self.kv_hit_len.append(kv_hit_len)

    def skip(self) -> None:
        """Count one request that could not be admitted."""
        self.skipped += 1


@dataclass(frozen=True, slots=True)
class ReplayMetrics:
    """Token-level outcome of one replay (see the module docstring for the definitions)."""

    requests: int
    skipped_requests: int
    prompt_tokens: int
    usable_tokens: int
    kv_hit_tokens: int
    token_hit_rate: float
    kv_hit_rate: float
    state_miss_tokens: Distribution
    swa_miss_tokens: Distribution
    uncached_tokens: Distribution
    prefill_cost: Distribution

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (distributions as nested dicts)."""
        return asdict(self)


def summarize(log: RequestLog, d: float = COST_D, e: float = COST_E) -> ReplayMetrics:
    """Aggregate a :class:`RequestLog` (O(n log n) for the percentiles)."""
    # copies, so the log's arrays may still grow afterwards
    prompt = np.frombuffer(log.prompt_len, dtype=np.int64).copy()
    usable = np.frombuffer(log.usable_len, dtype=np.int64).copy()
    kv_hit = np.frombuffer(log.kv_hit_len, dtype=np.int64).copy()
    swa_miss = np.frombuffer(log.swa_miss_len, dtype=np.int64).copy()
    total = int(prompt.sum())
    return ReplayMetrics(
        requests=len(log),
        skipped_requests=log.skipped,
        prompt_tokens=total,
        usable_tokens=int(usable.sum()),
        kv_hit_tokens=int(kv_hit.sum()),
        token_hit_rate=float(usable.sum()) / total if total else 0.0,
        kv_hit_rate=float(kv_hit.sum()) / total if total else 0.0,
        state_miss_tokens=Distribution.of(kv_hit - usable - swa_miss),
        swa_miss_tokens=Distribution.of(swa_miss),
        uncached_tokens=Distribution.of(prompt - usable),
        prefill_cost=Distribution.of(prefill_cost(usable, prompt, d, e)),
    )


def reset_peak_rss() -> bool:
    """Start a run's memory high-water mark: reset the process's peak resident set size to
    what it holds now (Linux, ``/proc/self/clear_refs``), so that :func:`peak_rss_mib` reads
    this run's peak, not an earlier run's. ``False`` where the kernel refuses: the peak is then
    the process's so far."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """Peak resident set size since :func:`reset_peak_rss` (else since the process started)
    [MiB]: ``VmHWM`` of ``/proc/self/status``; ``getrusage`` where that file is missing."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
