"""The slot-time budget model: what a state pool can save at most, offline and online.

``python -m bench state-budget --source mooncake --cacheable 32`` asks how many prefill tokens
the prompt-end states of a trace can save when only ``C`` of them fit in the pool besides the
running requests' own slots, and how much of that an online rule can reach.

Each request ``i`` with a whole trace block leaves one end state: its prompt's whole blocks
``K_i``. Keeping it until its next consumer (the first later request whose ``prompt[:-1]``
covers ``K_i``, ``d_i`` requests later) costs ``d_i`` slot-requests and saves ``|K_i|`` tokens;
the pool has ``C x n`` slot-requests over ``n`` requests. That is a knapsack:

* **offline** (the future known): cheapest per saved token first (``d_i / |K_i|``), as an
  offline reference that keeps what comes back soonest would;
* **online**: a rule sees at store time only what the state looks like, so the most it can do
  is keep each *class* of states for a hold time ``t`` (a state consumed within ``t`` saves its
  tokens; each costs ``min(d_i, t)``). Per class, the tokens against the slot-requests over
  every ``t`` of :data:`HOLD_TIMES` span a curve; its concave hull, filled best slope first
  across the classes, is what the best such rule buys. Classes: none; the seen-share bucket
  (the share of the prompt some earlier request already had: < 0.3, < 0.9, more, as the
  walks' :func:`components.eviction.adaptive.seen_bucket` reads it off the tree); bucket x prompt
  length (:data:`LENGTH_BANDS`, in blocks). The curves are taken from the whole trace, so the
  online figures are optimistic: no online rule knows them in advance.

A state consumed saves its tokens once per stay; later consumers of the same stay are not
counted (both sides alike), and chunk-end and branch checkpoints are left out (they are a
separate budget; see ``bench/results/2026-12-02-robustness.md``, "Why the reference stays ahead on Mooncake").
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cli import new_parser
from bench.traces.loader import TraceRequest

__all__ = ["HOLD_TIMES", "LENGTH_BANDS", "EndState", "build_parser", "end_states", "main",
           "offline_tokens", "online_tokens"]

HOLD_TIMES = (1, 2, 3, 5, 8, 12, 20, 30, 50, 75, 100, 150, 200, 300, 400, 600, 800, 1200, 1600,
              2000)
"""Hold times an online rule may choose per class [requests]."""
LENGTH_BANDS = ((0, 8), (8, 16), (16, 32), (32, 64), (64, math.inf))
"""Prompt-length bands of the bucket x length classes [whole blocks], half-open."""


@dataclass(frozen=True, slots=True)
class EndState:
    """One request's end state: its next consumer ``distance`` requests later (``inf``:
    never), the ``tokens`` a consumer saves, its seen-share ``bucket`` and ``blocks``."""

    distance: float
    tokens: int
    bucket: int
    blocks: int


def end_states(trace: Sequence[TraceRequest]) -> list[EndState]:
    """Every request's end state (requests without a whole block leave none)."""
    cover: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)
    for j, r in enumerate(trace):
        for k in range(1, (r.input_length - 1) // r.block_size + 1):
            cover[r.block_ids[:k]].append(j)  # in request order
    first_seen: dict[tuple[int, ...], int] = {}
    out = []
    for i, r in enumerate(trace):
        nfb = r.num_full_blocks
        for k in range(1, len(r.block_ids) + 1):
            first_seen.setdefault(r.block_ids[:k], i)
        if nfb == 0:
            continue
        seen = next((k for k in range(nfb, 0, -1) if first_seen[r.block_ids[:k]] < i), 0)
        later = cover.get(r.block_ids[:nfb], [])
        at = bisect.bisect_right(later, i)
        distance = later[at] - i if at < len(later) else math.inf
        share = seen / nfb
        out.append(EndState(distance, nfb * r.block_size, 0 if share < 0.3 else
                            1 if share < 0.9 else 2, nfb))
    return out


def offline_tokens(states: Sequence[EndState], budget: float) -> int:
    """Tokens the offline knapsack saves within ``budget`` slot-requests (cheapest per saved
    token first, stopping at the first that does not fit)."""
    saved, used = 0, 0.0
    for s in sorted((s for s in states if s.distance < math.inf),
                    key=lambda s: s.distance / s.tokens):
        if used + s.distance > budget:
            break
        used += s.distance
        saved += s.tokens
    return saved


def _hull(states: Sequence[EndState]) -> list[tuple[float, float, float]]:
    """The concave hull of (slot-requests, tokens) over :data:`HOLD_TIMES` from (0, 0), as
    segments ``(slope, cost, tokens)``."""
    points = sorted([(0.0, 0.0)] + [
        (float(sum(min(s.distance, t) for s in states)),
         float(sum(s.tokens for s in states if s.distance <= t))) for t in HOLD_TIMES])
    hull: list[tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
                                  <= (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    return [((b[1] - a[1]) / (b[0] - a[0]), b[0] - a[0], b[1] - a[1])
            for a, b in zip(hull, hull[1:], strict=False) if b[1] > a[1] and b[0] > a[0]]


def online_tokens(states: Sequence[EndState], budget: float,
                  classify: Callable[[EndState], object] | None = None) -> float:
    """Tokens the best per-class hold-time rule saves within ``budget`` slot-requests: the
    classes' hull segments filled best slope first (a fraction of the last one)."""
    groups: defaultdict[object, list[EndState]] = defaultdict(list)
    for s in states:
        groups[None if classify is None else classify(s)].append(s)
    segments = sorted((seg for g in groups.values() for seg in _hull(g)), key=lambda x: -x[0])
    saved, left = 0.0, budget
    for _, cost, tokens in segments:
        take = min(1.0, left / cost)
        saved += take * tokens
        left -= take * cost
        if left <= 0:
            break
    return saved


def by_bucket(s: EndState) -> object:
    return s.bucket


def by_bucket_and_length(s: EndState) -> object:
    band = next(i for i, (lo, hi) in enumerate(LENGTH_BANDS) if lo <= s.blocks < hi)
    return s.bucket, band


def build_parser() -> argparse.ArgumentParser:
    from bench.runs.robustness import ALL_SOURCES

    p = new_parser("state-budget", __doc__.split("\n")[0])
    p.add_argument("--source", default="mooncake", choices=list(ALL_SOURCES),
                   help="a source of the robustness table (default mooncake: its first 2,000 "
                        "requests)")
    p.add_argument("--cacheable", type=int, nargs="+", default=[32],
                   help="states that fit besides the running requests' slots, C (default 32: "
                        "64 slots, 16 running requests holding ~2 each)")
    p.add_argument("--traces-dir", default="../shared/traces",
                   help="where the GMI and TraceLab files are (default ../shared/traces)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from bench.runs.robustness import ALL_SOURCES

    parser = build_parser()
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.cacheable):
        parser.error("--cacheable must be >= 1")
    try:
        trace = ALL_SOURCES[args.source].load(Path(args.traces_dir))
    except ValueError as exc:  # TraceFormatError: a malformed trace file
        parser.error(str(exc))
    if not trace:
        parser.exit(2, f"{parser.prog}: error: no requests for {args.source} (trace file missing?)\n")
    states = end_states(trace)
    reused = sum(s.distance < math.inf for s in states)
    print(f"{args.source}: {len(trace):,} requests, {len(states):,} end states, {reused:,} "
          f"ever consumed")
    print("| C | offline | online, no class | by seen-share bucket | by bucket x length |")
    print("|---:|---:|---:|---:|---:|")
    for c in args.cacheable:
        budget = c * len(trace)
        off = offline_tokens(states, budget)
        cells = [online_tokens(states, budget, f) for f in (None, by_bucket, by_bucket_and_length)]
        share = [f"{v:,.0f} ({v / off:.0%})" if off else f"{v:,.0f}" for v in cells]
        print(f"| {c} | {off:,} | " + " | ".join(share) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
