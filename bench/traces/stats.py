"""Statistics of a request trace: ``python -m bench trace-stats TRACE [--json FILE|-]``.

Prints requests, time span and rate, prompt / output lengths, block reuse and the
infinite-cache bounds, computed as follows:

* *repeated ids*: share of block ids already seen in an earlier request (set-based; it
  overstates reuse when ids are not prefix-chained, as in the GMI trace);
* *trie reuse*: share of blocks covered by the longest prefix match against the earlier
  requests' block lists (the every-block bound at block granularity);
* *per-request reused share*: matched blocks / blocks of each request (mean, p50, p90);
* *bounds*: :func:`bench.engine.bounds.compute_bounds` in the trace notes' convention (whole
  prompt) and in the replay's (match ``prompt[:-1]``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.cli import new_parser, output_path, positive, write_json
from bench.engine.bounds import compute_bounds
from bench.traces.loader import (
    TraceFormatError,
    TraceRequest,
    load_trace,
    resolve_trace_path,
    sniff_format,
    trace_label,
)

__all__ = ["BlockReuse", "block_reuse", "main", "render_stats", "trace_stats"]


@dataclass(frozen=True, slots=True)
class BlockReuse:
    """Block-level reuse of a trace (counts in blocks)."""

    total_blocks: int
    unique_ids: int
    repeated_ids: int
    trie_nodes: int
    branch_nodes: int
    matched_blocks: int
    per_request_share: tuple[float, float, float]  # mean, p50, p90

    @property
    def repeat_fraction(self) -> float:
        return self.repeated_ids / self.total_blocks if self.total_blocks else 0.0

    @property
    def trie_reuse(self) -> float:
        return self.matched_blocks / self.total_blocks if self.total_blocks else 0.0


def block_reuse(trace: Sequence[TraceRequest]) -> BlockReuse:
    """Reuse counts over the requests' ``block_ids`` in order (O(total blocks))."""
    seen: set[int] = set()
    child: dict[tuple[int, int], int] = {}
    children = [0]
    total = repeated = matched = 0
    shares = []
    for r in trace:
        ids = r.block_ids
        total += len(ids)
        repeated += sum(1 for h in ids if h in seen)
        seen.update(ids)
        node = depth = 0
        for h in ids:
            nxt = child.get((node, h))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        matched += depth
        shares.append(depth / len(ids) if ids else 0.0)
        for h in ids[depth:]:
            child[(node, h)] = len(children)
            children[node] += 1
            children.append(0)
            node = len(children) - 1
    s = np.asarray(shares or [0.0])
    return BlockReuse(total, len(seen), repeated, len(children) - 1,
                      sum(1 for c in children[1:] if c >= 2), matched,
                      (float(s.mean()), float(np.percentile(s, 50)), float(np.percentile(s, 90))))


def _dist(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "max": float(x.max())}


def trace_stats(trace: Sequence[TraceRequest]) -> dict[str, Any]:
    """Everything :func:`main` prints, as plain values."""
    if not trace:
        raise ValueError("empty trace")
    ts = np.asarray([r.timestamp_s for r in trace])
    inp = np.asarray([r.input_length for r in trace], dtype=np.float64)
    out = np.asarray([r.output_length for r in trace], dtype=np.float64)
    span = float(ts.max() - ts.min())
    reuse = block_reuse(trace)
    notes = compute_bounds(trace)
    replay = compute_bounds(trace, exclude_last_token=True)
    return {
        "requests": len(trace),
        "span_s": span,
        "requests_per_s": len(trace) / span if span > 0 else None,
        "block_size": trace[0].block_size,
        "input_tokens": int(inp.sum()),
        "input_length": _dist(inp),
        "output_length": _dist(out),
        "sessions": len({r.session for r in trace if r.session is not None}) or None,
        "total_blocks": reuse.total_blocks,
        "unique_ids": reuse.unique_ids,
        "repeat_fraction": reuse.repeat_fraction,
        "trie_reuse": reuse.trie_reuse,
        "trie_nodes": reuse.trie_nodes,
        "branch_nodes": reuse.branch_nodes,
        "per_request_reused_share": dict(zip(("mean", "p50", "p90"), reuse.per_request_share,
                                             strict=True)),
        "bounds_whole_prompt": notes.as_dict(),
        "bounds_replay": replay.as_dict(),
    }


def render_stats(path: str, fmt: str, s: dict[str, Any]) -> str:
    """The human-readable statistics of :func:`trace_stats` (``path``, ``fmt``: what was read)."""
    i, o = s["input_length"], s["output_length"]
    b, r = s["bounds_whole_prompt"], s["bounds_replay"]
    share = s["per_request_reused_share"]
    rate = s["requests_per_s"]
    lines = [
        f"trace: {path} ({fmt})",
        f"requests: {s['requests']:,}" + (f" in {s['sessions']} sessions" if s["sessions"] else ""),
        f"span: {s['span_s']:,.1f} s" + (f" ({rate:.3f} requests/s)" if rate else ""),
        f"input tokens: {s['input_tokens']:,}; per request mean {i['mean']:,.1f}, "
        f"p50 {i['p50']:,.0f}, p90 {i['p90']:,.0f}, max {i['max']:,.0f}",
        f"output tokens per request: mean {o['mean']:,.1f}, p50 {o['p50']:,.0f}, "
        f"p90 {o['p90']:,.0f}, max {o['max']:,.0f}",
        f"blocks ({s['block_size']} tokens): {s['total_blocks']:,} total, "
        f"{s['unique_ids']:,} unique ids, {s['trie_nodes']:,} trie nodes "
        f"({s['branch_nodes']:,} with >= 2 children)",
        f"block reuse: repeated ids {s['repeat_fraction']:.4f} (set-based), "
        f"longest-prefix {s['trie_reuse']:.4f}; per request mean {share['mean']:.3f}, "
        f"p50 {share['p50']:.3f}, p90 {share['p90']:.3f}",
        f"infinite-cache token hit, whole prompt: every block {b['every_block_hit_rate']:.4f}, "
        f"sparse checkpoints {b['sparse_hit_rate']:.4f}",
        f"infinite-cache token hit, replay convention (prompt[:-1]): every block "
        f"{r['every_block_hit_rate']:.4f}, sparse checkpoints {r['sparse_hit_rate']:.4f}",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("trace-stats", __doc__.split("\n")[0])
    p.add_argument("trace", nargs="?", default=None, help="JSONL trace (default: the shipped one)")
    p.add_argument("--trace-format", choices=("auto", "mooncake", "gmi", "tracelab"), default="auto")
    p.add_argument("--mooncake-block-size", type=positive, default=512)
    p.add_argument("--tracelab-block-size", type=positive, default=1)
    p.add_argument("--json", metavar="FILE|-", type=output_path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        path = resolve_trace_path(args.trace)
        fmt = sniff_format(path) if args.trace_format == "auto" else args.trace_format
        trace = load_trace(path, fmt=fmt, mooncake_block_size=args.mooncake_block_size,
                           tracelab_block_size=args.tracelab_block_size)
        stats = trace_stats(trace)
    except (FileNotFoundError, TraceFormatError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(render_stats(trace_label(path), fmt, stats), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json is not None:
        write_json(args.json, {"trace": trace_label(path), "format": fmt, **stats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
