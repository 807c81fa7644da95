"""The session-hint grid (developer instrument): ``gds_adaptive`` with and without the hint
beside the baselines and the offline reference of a saved robustness run, with the captured
share of the headroom at every point.

Runs ``--policies`` (default ``gds_adaptive``) on the robustness sources and points twice,
without and with ``EngineConfig.session_hint``, and joins the rows with ``--baseline-csv``
(a ``python -m bench robustness --csv`` file holding lru / gds / gdsf / seglen / marconi /
belady at the same points)::

    python -m bench.dev.policies.hint_grid --sources agentic docqa --slots 64 256 1024 \\
        --baseline-csv /tmp/base.csv --csv /tmp/hint.csv

Per point: the best baseline ``B``, the reference ``R``, each run's token hit rate ``h``, its
margin ``h - B`` and its captured share of the headroom ``(h - B) / (R - B)`` (shown where
``R - B >= 0.02``, the issue's bar). CPU time (``time.process_time``) of each run is kept.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engine.simulator import SimConfig, run_policy
from bench.runs.robustness import ALL_SOURCES

BASELINES = ("lru", "gds", "gdsf", "seglen", "marconi")
HEADROOM_BAR = 0.02
"""The reference's lead over the best baseline from which a share is required."""

Row = dict[str, Any]


def run_rows(sources: Sequence[str], policies: Sequence[str], slots: Sequence[int],
             kv_tokens: int, concurrency: int, traces_dir: Path) -> list[Row]:
    """Every (source, slots, policy, hint) run, one row each (CPU seconds included)."""
    rows = []
    for name in sources:
        src = ALL_SOURCES[name]
        trace = src.load(traces_dir)
        if trace is None:
            continue
        for s, policy, hint in itertools.product(slots, policies, (False, True)):
            cfg = SimConfig.of(policy, state_slots=s, kv_tokens=kv_tokens,
                               concurrency=concurrency, time_scale=src.time_scale,
                               session_hint=hint)
            t0 = time.process_time()
            r = run_policy(trace, cfg)
            rows.append({"source": name, "state_slots": s, "kv_tokens": kv_tokens,
                         "concurrency": concurrency, "policy": policy + ("+hint" if hint else ""),
                         "token_hit_rate": round(r.metrics.token_hit_rate, 6),
                         "cpu_s": round(time.process_time() - t0, 2)})
    return rows


def render(rows: Sequence[Row], base: Sequence[Row]) -> str:
    """Markdown: per point the baselines, the reference, each run, margin and share."""
    hits: dict[tuple[str, int, int, int], dict[str, float]] = {}
    for r in list(base) + list(rows):
        key = (r["source"], int(r["state_slots"]), int(r["kv_tokens"]), int(r["concurrency"]))
        hits.setdefault(key, {})[r["policy"]] = float(r["token_hit_rate"])
    runs = list(dict.fromkeys(r["policy"] for r in rows))
    head = ["source", "slots", *BASELINES, "belady"] + [c for p in runs
                                                        for c in (p, "margin", "share")]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for key in sorted(k for k in hits if any(p in hits[k] for p in runs)):
        h = hits[key]
        b = max((h[p] for p in BASELINES if p in h), default=None)
        ref = h.get("belady")
        cells = [key[0], f"{key[1]:,}"] + [f"{h[p]:.4f}" if p in h else "" for p in BASELINES]
        cells.append(f"{ref:.4f}" if ref is not None else "")
        for p in runs:
            v = h.get(p)
            cells.append(f"{v:.4f}" if v is not None else "")
            cells.append(f"{v - b:+.4f}" if v is not None and b is not None else "")
            ok = v is not None and b is not None and ref is not None and ref - b >= HEADROOM_BAR
            cells.append(f"{(v - b) / (ref - b):.0%}" if ok and v is not None and b is not None
                         and ref is not None else "")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dev.policies.hint_grid",
                                description=__doc__.split("\n")[0])
    p.add_argument("--sources", nargs="+", default=["agentic", "docqa", "multiturn"],
                   choices=list(ALL_SOURCES))
    p.add_argument("--policies", nargs="+", default=["gds_adaptive"])
    p.add_argument("--slots", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument("--kv-tokens", type=int, default=16_000_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--traces-dir", type=Path, default=Path("../shared/traces"))
    p.add_argument("--baseline-csv", default=None, help="a robustness --csv file")
    p.add_argument("--csv", default=None, help="write this run's rows here")
    p.add_argument("--from-csv", default=None, help="render saved rows instead of running")
    args = p.parse_args(argv)
    if args.from_csv:
        with open(args.from_csv, encoding="utf-8") as f:
            rows: list[Row] = list(csv.DictReader(f))
    else:
        rows = run_rows(args.sources, args.policies, args.slots, args.kv_tokens,
                        args.concurrency, args.traces_dir)
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    base: list[Row] = []
    if args.baseline_csv:
        with open(args.baseline_csv, encoding="utf-8") as f:
            base = list(csv.DictReader(f))
    print(render(rows, base))
    total = sum(float(r["cpu_s"]) for r in rows)
    print(f"\nCPU time of these runs: {total:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
