"""The unified arena replayed against committed fixed-split sweeps, with issue 38's verdicts.

For each sweep file ``RECORDS/MODEL-NAME.json`` (the rows ``python -m bench memory-split``
writes) and each budget in it, the unified arena is replayed with
``bench.runs.memory_split.run_arena`` (the code of this checkout) and compared with the file's
fixed splits, which are not rerun (they do not depend on the arena)::

    PYTHONPATH=. python -m bench.dev.arena.grid --model qwen3-next-80b \\
        --records bench/results/memory-split-3 [--names agentic docqa ...] [--out DIR]

``NAME`` is a ``bench.workloads`` spec with an optional ``-seedN`` suffix (``agentic-seed1``)
or ``mooncake-N`` (the shipped trace's first N requests). Per point it prints one JSON line:
the best fixed split and where, the default split (SGLang's 0.4737), the unified arena's hit
rate, the layout waste, and the two verdicts of issue 38:

* ``t1``: unified >= best fixed - 0.5 points;
* ``t2``: unified >= default + 5 points where the default loses >= 5 to the best (``-``
  elsewhere).

``--out DIR`` writes each file's fixed rows with the new unified rows (``DIR/MODEL-NAME.json``,
the same schema), so the tables of ``bench.report.memory_split_tables`` render them.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.runs.memory_split import SGLANG_DEFAULT_FRACTION, build_parser, run_arena

#: The sweeps of issue 38 (the names of ``bench/results/memory-split-3``).
DEFAULT_NAMES = ("agentic", "agentic-seed1", "multiturn", "docqa", "sysprompt", "mix",
                 "mooncake-2000")


def load_requests(name: str) -> list[Any]:
    """The requests of sweep ``name`` (module docstring).

    Raises:
        ValueError: a name that is neither ``mooncake-N`` nor a workload spec (from
            ``bench.workloads``).
    """
    m = re.fullmatch(r"mooncake-(\d+)", name)
    if m:
        from bench.traces.loader import load_trace

        return list(load_trace(None, max_requests=int(m.group(1))))
    from bench.workloads import workload_requests

    m = re.fullmatch(r"(.+)-seed(\d+)", name)
    spec, seed = (m.group(1), int(m.group(2))) if m else (name, 0)
    return workload_requests(spec, seed, None)


def verdicts(fixed: dict[float, float], unified: float) -> dict[str, Any]:
    """Issue 38's two targets at one budget: ``fixed`` maps a state fraction to its token
    hit rate (a fraction), ``unified`` is the arena's; returns ``best``, ``best_at``,
    ``default``, ``t1`` and ``t2`` (``"ok"``, ``"MISS"`` or ``"-"``).

    Raises:
        ValueError: ``fixed`` empty.
    """
    if not fixed:
        raise ValueError("fixed: no fixed split at this budget")
    best_at = max(fixed, key=lambda f: fixed[f])
    best = fixed[best_at]
    default = next((v for f, v in fixed.items() if abs(f - SGLANG_DEFAULT_FRACTION) < 1e-3),
                   None)
    t2 = "-"
    if default is not None and best - default >= 0.05:
        t2 = "ok" if unified >= default + 0.05 else "MISS"
    return {"best": best, "best_at": best_at, "default": default,
            "t1": "ok" if unified >= best - 0.005 else "MISS", "t2": t2}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dev.arena.grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--records", type=Path, required=True, help="directory of sweep files")
    p.add_argument("--names", nargs="+", default=list(DEFAULT_NAMES))
    p.add_argument("--memory-gb", type=float, nargs="+", default=None,
                   help="only these budgets (default: every budget of each file)")
    p.add_argument("--out", type=Path, default=None, help="write fixed + new unified rows here")
    args = p.parse_args(argv)
    from bench.engine.presets import get_preset

    preset = get_preset(args.model)
    replay_args = build_parser().parse_args(["--memory-gb", "1"])  # the sweeps' defaults
    for name in args.names:
        path = args.records / f"{args.model}-{name}.json"
        if not path.is_file():
            p.error(f"--records: no sweep file {path}")
        rows = json.loads(path.read_text())
        fixed_rows = [r for r in rows if r["split"] != "unified"]
        budgets = sorted({r["memory_gb"] for r in fixed_rows})
        if args.memory_gb is not None:
            budgets = [gb for gb in budgets if gb in args.memory_gb]
        trace = load_requests(name)
        out_rows = list(fixed_rows)
        for gb in budgets:
            fixed = {r["split"]: r["token_hit_rate"] for r in fixed_rows if r["memory_gb"] == gb}
            rec = run_arena(trace, preset, gb, replay_args)
            out_rows.append(rec)
            v = verdicts(fixed, rec["token_hit_rate"])
            print(json.dumps({
                "model": args.model, "name": name, "memory_gb": gb,
                "best": round(100 * v["best"], 2), "best_at": v["best_at"],
                "default": None if v["default"] is None else round(100 * v["default"], 2),
                "unified": round(100 * rec["token_hit_rate"], 2),
                "waste_pct": round(100 * rec["waste_fraction_max"], 2),
                "chunks": rec["chunks"], "t1": v["t1"], "t2": v["t2"]}), flush=True)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / path.name).write_text(json.dumps(out_rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
