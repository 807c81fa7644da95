"""The unified arena replay's CPU time against the fixed split's, point by point (issue 38).

For each point (workload, budget) the trace is replayed with
``bench.runs.memory_split.run_fixed`` at SGLang's default split and with ``run_arena``, in the
same process, ``--repeat`` times each; reported: the least CPU seconds of each
(``time.process_time`` around the replay only, ``run_*``'s ``cpu_s``), their ratio, and both
token hit rates (so that a change of the compaction's cost is seen not to change its choices)::

    PYTHONPATH=. python -m bench.dev.arena.cpu [--points agentic:10 multiturn:40 ...]
        [--repeat 2] [--profile fixed|arena] [--best-fixed bench/results/memory-split-3]

``--best-fixed DIR`` adds the fixed split of the best token hit rate at the point's budget in
the sweep results there (``DIR/MODEL-WORKLOAD.json``, ``MODEL-mooncake-N.json``; the rows of
``bench.runs.memory_split``), replayed the same way: the unified arena's CPU against the split
an operator would have picked.

A point is ``WORKLOAD:GB`` (a ``bench.workloads`` generator, seed 0) or ``mooncake:GB`` (the
shipped Mooncake trace's first ``--mooncake-requests`` requests).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.runs.memory_split import SGLANG_DEFAULT_FRACTION, run_arena, run_fixed

#: The points of issue 38.
DEFAULT_POINTS = ("agentic:10", "agentic:20", "multiturn:40", "mooncake:40")


def _trace(name: str, mooncake_requests: int) -> list[Any]:
    if name == "mooncake":
        from bench.traces.loader import load_trace

        return list(load_trace(None, max_requests=mooncake_requests))
    from bench.workloads import workload_requests

    return workload_requests(name, 0, None)


def best_fraction(results: Path, model: str, name: str, gb: float,
                  mooncake_requests: int) -> float:
    """The state fraction of the best token hit rate among the fixed splits at ``gb`` in
    ``results`` (ties: the first listed).

    Raises:
        ValueError: no such file, or no fixed split at ``gb`` in it (naming both).
    """
    stem = f"mooncake-{mooncake_requests}" if name == "mooncake" else name
    path = results / f"{model}-{stem}.json"
    if not path.is_file():
        raise ValueError(f"--best-fixed: no results file {path}")
    rows = [r for r in json.loads(path.read_text())
            if r.get("memory_gb") == gb and isinstance(r.get("split"), (int, float))]
    if not rows:
        raise ValueError(f"--best-fixed: {path} holds no fixed split at {gb} GB")
    return float(max(rows, key=lambda r: r["token_hit_rate"])["split"])


def _args() -> argparse.Namespace:
    return argparse.Namespace(policy="gds", page_size=1, chunk_size=8192, concurrency=32)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), metavar="NAME:GB")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--mooncake-requests", type=int, default=2000)
    p.add_argument("--model", default="qwen3-next-80b")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared machine the idle "
                        "spinning of more threads is counted as CPU time and swamps the replay)")
    p.add_argument("--best-fixed", type=Path, default=None, metavar="DIR",
                   help="also replay the best fixed split of the sweep results in DIR")
    p.add_argument("--profile", choices=("fixed", "arena"), default=None,
                   help="cProfile one replay of each point instead (top 25 by own time)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from bench.engine.presets import get_preset

    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    preset = get_preset(args.model)
    run_args = _args()
    best = args.best_fixed is not None
    print("| point | fixed s | unified s | ratio | hit fixed | hit unified |"
          + (" best split | best s | ratio best | hit best |" if best else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|" if best else ""))
    for point in args.points:
        name, gb_text = point.rsplit(":", 1)
        gb = float(gb_text)
        trace = _trace(name, args.mooncake_requests)
        if args.profile is not None:
            prof = cProfile.Profile()
            prof.enable()
            if args.profile == "fixed":
                run_fixed(trace, preset, gb, SGLANG_DEFAULT_FRACTION, run_args)
            else:
                run_arena(trace, preset, gb, run_args)
            prof.disable()
            print(f"## {point} ({args.profile})")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        frac = (best_fraction(args.best_fixed, args.model, name, gb, args.mooncake_requests)
                if args.best_fixed is not None else None)
        fixed: list[dict[str, Any]] = []
        arena: list[dict[str, Any]] = []
        tuned: list[dict[str, Any]] = []
        for _ in range(args.repeat):
            rec = run_fixed(trace, preset, gb, SGLANG_DEFAULT_FRACTION, run_args)
            assert rec is not None
            fixed.append(rec)
            arena.append(run_arena(trace, preset, gb, run_args))
            if frac is not None:
                rec = run_fixed(trace, preset, gb, frac, run_args)
                assert rec is not None
                tuned.append(rec)
        f = min(r["cpu_s"] for r in fixed)
        a = min(r["cpu_s"] for r in arena)
        line = (f"| {point} | {f:.3f} | {a:.3f} | {a / f:.2f} | "
                f"{fixed[0]['token_hit_rate']:.6f} | {arena[0]['token_hit_rate']:.6f} |")
        if tuned:
            b = min(r["cpu_s"] for r in tuned)
            line += f" {frac} | {b:.3f} | {a / b:.2f} | {tuned[0]['token_hit_rate']:.6f} |"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
