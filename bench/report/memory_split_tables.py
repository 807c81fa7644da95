"""The tables of a ``python -m bench memory-split`` sweep (issue 38), from its JSON files.

``python -m bench.report.memory_split_tables FILE.json [...]`` prints, per file (one preset
and one trace: the name ``PRESET-TRACE.json`` of ``bench/results/2026-12-05-memory-split-sweeps.sh``),
a Markdown table of token hit rates [%]: one row per budget, one column per fixed split, the
best fixed split, SGLang's default split (:data:`bench.engine.presets.SGLANG_DEFAULT_FRACTION`),
the unified arena, ``unified - best`` and ``unified - default`` [points], the arena's layout
waste (``waste_fraction_max``) and its CPU time over the mean fixed run's; then one summary
table of the issue's two hit-rate targets per file.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engine.presets import SGLANG_DEFAULT_FRACTION

__all__ = ["main", "sweep_table", "targets"]


def _is_default(split: Any) -> bool:
    return not isinstance(split, str) and math.isclose(split, SGLANG_DEFAULT_FRACTION,
                                                        rel_tol=1e-3)


def _rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget: the fixed hit rates by split, best, default, unified, waste, cpu ratio."""
    out = []
    for gb in sorted({r["memory_gb"] for r in records}):
        at = [r for r in records if r["memory_gb"] == gb]
        fixed = {r["split"]: r for r in at if r["split"] != "unified"}
        uni = next(r for r in at if r["split"] == "unified")
        best = max(r["token_hit_rate"] for r in fixed.values())
        default = next((r["token_hit_rate"] for s, r in fixed.items() if _is_default(s)),
                       float("nan"))
        cpu = sum(r["cpu_s"] for r in fixed.values()) / len(fixed)
        out.append({"gb": gb, "fixed": {s: r["token_hit_rate"] for s, r in fixed.items()},
                    "best": best, "default": default, "unified": uni["token_hit_rate"],
                    "waste": uni.get("waste_fraction_max", float("nan")),
                    "cpu_x": uni["cpu_s"] / cpu if cpu else float("nan")})
    return out


def sweep_table(records: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of one sweep (module docstring)."""
    rows = _rows(records)
    splits = sorted({s for row in rows for s in row["fixed"]})
    head = ["GB", *(f"{s:.3g}" + (" (sglang)" if _is_default(s) else "") for s in splits),
            "best fixed", "unified", "unified - best", "unified - default", "waste %", "cpu x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{row['gb']:g}"]
        cells += [f"{100 * row['fixed'][s]:.1f}" if s in row["fixed"] else "-" for s in splits]
        cells += [f"{100 * row['best']:.1f}", f"{100 * row['unified']:.1f}",
                  f"{100 * (row['unified'] - row['best']):+.1f}",
                  f"{100 * (row['unified'] - row['default']):+.1f}",
                  f"{100 * row['waste']:.1f}", f"{row['cpu_x']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(records: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """The issue's two hit-rate targets over the budgets of one sweep: ``unified >= best
    fixed - 0.5 pt`` (the budgets that miss it, with the gap) and ``unified >= default + 5
    pt where the default loses >= 5 pt to the best`` (where it applies: met or missed)."""
    miss, applies = [], []
    for row in _rows(records):
        gap = 100 * (row["unified"] - row["best"])
        if gap < -0.5:
            miss.append(f"{row['gb']:g} GB {gap:+.1f}")
        if 100 * (row["best"] - row["default"]) >= 5:
            gain = 100 * (row["unified"] - row["default"])
            applies.append(f"{row['gb']:g} GB {gain:+.1f} {'yes' if gain >= 5 else '**no**'}")
    return ("every budget" if not miss else "**missed**: " + ", ".join(miss),
            ", ".join(applies) if applies else "(the default never loses 5 pt)")


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m bench.report.memory_split_tables FILE.json [...]",
              file=sys.stderr)
        return 2
    summary = ["| sweep | unified >= best fixed - 0.5 pt | unified >= default + 5 pt "
               "(where the default loses >= 5 pt) |", "|---|---|---|"]
    for path in paths:
        records = json.loads(path.read_text())
        print(f"### {path.stem}\n\n{sweep_table(records)}\n")
        a, b = targets(records)
        summary.append(f"| {path.stem} | {a} | {b} |")
    print("### Targets\n\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
