"""``python -m bench workloads NAME[:k=v,...] [--seed N] [--out FILE] [--json FILE|-]``.

Generates a workload (:mod:`bench.workloads`), prints its reuse statistics (the same ones
``python -m bench trace-stats`` prints for a trace file) and, with ``--out``, writes it as
Mooncake-format JSONL (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``
one per block, plus ``session``), which ``--trace FILE --mooncake-block-size B`` reads back
request for request (``B`` = the workload's block size, 64 unless ``block=`` says otherwise).

Examples::

    python -m bench workloads docqa
    python -m bench workloads agentic:sessions=80,tool_s=30 --seed 3 --out agentic.jsonl
    python -m bench workloads --list
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from bench.cli import new_parser, output_path, seed, write_json
from bench.traces.loader import TraceRequest
from bench.traces.stats import render_stats, trace_stats
from bench.workloads import WORKLOADS, generate


def write_jsonl(path: str | Path, trace: Sequence[TraceRequest]) -> None:
    """``trace`` as Mooncake-format JSONL (timestamps in whole milliseconds, rounded)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps({
                "timestamp": round(r.timestamp_s * 1000.0), "input_length": r.input_length,
                "output_length": r.output_length, "hash_ids": list(r.block_ids),
                "session": r.session,
            }) + "\n")


def _listing() -> str:
    lines = []
    for w in WORKLOADS.values():
        params = ", ".join(f"{f.name}={f.default}" for f in fields(w.params))
        lines.append(f"{w.name}: {w.doc}\n    {params}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("workloads", "Generate a workload and print its reuse statistics.")
    p.add_argument("spec", nargs="?", help="NAME or NAME:key=value,... (--list shows them)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--out", metavar="FILE", type=output_path, default=None, help="write Mooncake-format JSONL")
    p.add_argument("--json", metavar="FILE|-", type=output_path, default=None, help="statistics as JSON")
    p.add_argument("--list", action="store_true", help="list the workloads and parameters")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.list:
        print(_listing())
        return 0
    if not args.spec:
        p.exit(2, "error: a workload NAME is required (--list shows them)\n")
    try:
        trace = generate(args.spec, seed=args.seed)
        stats = trace_stats(trace)
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    out = sys.stderr if args.json == "-" else sys.stdout
    print(render_stats(f"workload {args.spec} (seed {args.seed})", "generated", stats), file=out)
    if args.out:
        write_jsonl(args.out, trace)
        print(f"wrote {len(trace):,} requests to {args.out} (read with --trace {args.out} "
              f"--mooncake-block-size {trace[0].block_size})", file=out)
    if args.json is not None:
        write_json(args.json, {"workload": args.spec, "seed": args.seed, **stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
