"""TraceLab round trace -> Mooncake-style JSONL: ``python -m bench convert IN OUT``.

TraceLab (uw-syfi/TraceLab) records one LLM call per line with ``session_id``,
``input_tokens_total``, ``prefix_tokens`` and ``newly_append_tokens`` but no block hashes.
Each session becomes a chain (as :mod:`bench.traces.loader` builds it): round ``k``'s prompt is the
first ``prefix_tokens`` tokens of round ``k-1``'s prompt followed by fresh tokens. This tool
cuts every prompt into blocks of ``--block-size`` tokens and writes one Mooncake line per
round::

    {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...], "session_id": s}

``hash_ids`` are prefix-chained like Mooncake's: a block's id depends on its content and on
the id of the block before it, so equal ids mean equal blocks with equal whole prefixes; a
request's last block may be partial (``len(hash_ids) == ceil(input_length / block_size)``).
Sharing finer than a block is lost: a round that keeps 1,000 tokens of the previous prompt
shares ``floor(1000 / B)`` blocks with it. Timestamps are milliseconds since the first
round. Read the output back with ``--trace-format mooncake --mooncake-block-size B`` when
``B`` is not 512.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.cli import new_parser, output_path, positive
from bench.traces.loader import TraceFormatError, TraceRequest, load_trace

__all__ = ["block_runs", "convert", "main", "to_mooncake_lines"]

Runs = tuple[tuple[int, int], ...]


def block_runs(runs: Runs, block_size: int) -> Iterator[Runs]:
    """Cut a prompt (as ``(first_token, length)`` runs) into blocks, each as its own runs."""
    cur: list[tuple[int, int]] = []
    room = block_size
    for first, length in runs:
        while length:
            take = min(length, room)
            cur.append((first, take))
            first, length, room = first + take, length - take, room - take
            if room == 0:
                yield tuple(cur)
                cur, room = [], block_size
    if cur:
        yield tuple(cur)


def to_mooncake_lines(trace: Sequence[TraceRequest], block_size: int) -> list[dict[str, Any]]:
    """One Mooncake-style record per request (prefix-chained ids, see the module docstring)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids: dict[tuple[int, Runs], int] = {}
    out = []
    for r in trace:
        parent = -1
        hash_ids = []
        for content in block_runs(r.runs, block_size):
            parent = ids.setdefault((parent, content), len(ids))
            hash_ids.append(parent)
        out.append({
            "timestamp": int(round(r.timestamp_s * 1000)),
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": hash_ids,
            "session_id": r.session,
        })
    return out


def convert(src: str | Path, dst: str | Path, block_size: int = 512) -> int:
    """Convert a TraceLab round trace file; returns the number of lines written."""
    trace = load_trace(src, fmt="tracelab")
    lines = to_mooncake_lines(trace, block_size)
    with open(dst, "w", encoding="utf-8") as f:
        for rec in lines:
            f.write(json.dumps(rec) + "\n")
    return len(lines)


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("convert", "TraceLab round trace -> Mooncake-style JSONL")
    p.add_argument("src", help="TraceLab round_trace.jsonl")
    p.add_argument("dst", type=output_path, help="output JSONL")
    p.add_argument("--block-size", type=positive, default=512, help="tokens per hash id (default 512)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        n = convert(args.src, args.dst, args.block_size)
    except (FileNotFoundError, TraceFormatError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    extra = "" if args.block_size == 512 else f" --mooncake-block-size {args.block_size}"
    print(f"wrote {n} requests to {args.dst} (read it with --trace-format mooncake{extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
