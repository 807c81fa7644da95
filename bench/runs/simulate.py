"""Engine simulator CLI: ``python -m bench simulate`` (:mod:`bench.engine.simulator`).

Replays a trace through the cache *with time*: requests arrive at their timestamps, a
scheduler admits them under a prefill token budget and ``--max-running-requests``, prefill
takes ``cost(a, b)`` seconds per chunk, decode ``--decode-ms`` per token, and requests queue
when memory is short. Prints TTFT (p50 / p90 / p99), queueing delay and output tokens per
minute per GPU beside the cache metrics, one row per run, with the infinite-memory bounds.

Examples::

    python -m bench simulate --max-requests 2000 --policy lru gds marconi belady
    python -m bench simulate --model qwen3-next-80b --memory-gb 40 --state-fraction 0.2
    python -m bench simulate --model qwen3-next-80b --sweep memory-gb=10,20,40 \
        --state-fraction unified
    python -m bench simulate --policy lru joint_lru gds marconi belady \\
        --sweep state-slots=64,128,256,512,1024,2048 --plot bench/results/slots.png
    python -m bench simulate --sweep concurrency=16,24,32,40,64 --arrivals closed --plot c.png

``--plot FILE`` (needs a sweep) writes the figure and a CSV beside it (``FILE`` with
``.csv``); ``--csv FILE`` writes the CSV alone. Runs of a sweep go to ``--jobs`` processes.
Baselines ``marconi``, ``seglen`` (:mod:`bench.dev.policies.utility`: both order KV leaves too),
``belady`` (the offline reference of states and KV leaves, :mod:`bench.dev.policies.offline`) and
``belady_state`` (the earlier, states-only reference) exist only here, as do the
experimental walks ``idea:*`` (:mod:`bench.dev.policies.ideas`); ``gdsf`` and ``gds_adaptive`` are
library policies.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cli import (
    TABLE_WIDTH,
    column_blocks,
    figure_path,
    new_parser,
    non_negative_float,
    output_path,
    parse_count,
    refuse_ignored,
    refuse_unified_policies,
    require_package,
    state_fraction,
    warn_page_split,
    write_json,
)
from bench.cli import positive as _positive
from bench.cli import positive_float as _positive_float
from bench.engine.bounds import Bounds, compute_bounds
from bench.engine.presets import (
    DEFAULT_STATE_FRACTION,
    PRESETS,
    UNIFIED,
    engine_sizes,
    get_preset,
)
from bench.policies import baselines
from bench.runs.sweep import (
    Sweep,
    csv_row,
    fmt_value,
    run_all,
    sweep_arg,
    write_csv,
    write_sweep_plot,
)
from bench.traces.loader import (
    TraceFormatError,
    load_trace,
    resolve_trace_path,
    sniff_format,
    trace_label,
)
from bench.workloads import add_workload_arguments, check_source_options, workload_requests

if TYPE_CHECKING:
    from bench.engine.simulator import SimConfig, SimResult

__all__ = ["build_parser", "check_unified", "main", "plan_runs", "render_rows", "run_splits"]


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("simulate", "Simulate an engine serving a trace over the hybrid prefix cache.")
    a = p.add_argument
    a("--trace", default=None, help="JSONL trace (default: the shipped Mooncake trace)")
    add_workload_arguments(p)
    a("--torch-threads", type=int, default=1,
      help="torch intra-op threads (default 1, as bench.runs.replay: bookkeeping-sized tensor ops)")
    a("--trace-format", choices=("auto", "mooncake", "gmi", "tracelab"), default=None,
      help="the trace file's format (default auto: read off its first line)")
    a("--mooncake-block-size", type=_positive, default=None,
      help="tokens per hash id of a Mooncake-format file (default 512)")
    a("--max-requests", type=_positive, default=None, help="simulate only the first N requests")
    a("--policy", nargs="+", default=None,
      help="radix policies (lru, gds, gdsf, gds_adaptive, ...) and/or the replay baseline "
           "belady_state; in a checkout (bench/dev) also marconi, seglen, belady and the "
           "experimental walks idea:* (default: lru gds; with --state-fraction unified its "
           "one policy, unified)")
    a("--kv-tokens", type=_positive, default=None,
      help="KV pool [tokens] (default 16M; not with --memory-gb)")
    a("--state-slots", type=parse_count, default=None,
      help="state pool [slots] (default 512; not with --memory-gb)")
    a("--model", choices=sorted(PRESETS), default=None,
      help="model preset: with --memory-gb, sizes both pools from bytes (Marconi's bytes too)")
    a("--memory-gb", type=_positive_float, default=None, help="cache memory [GB = 1e9 bytes]")
    a("--state-fraction", type=state_fraction, default=None,
      help=f"share of --memory-gb for states (default {DEFAULT_STATE_FRACTION}), or "
           f"{UNIFIED}: one memory arena for KV pages and states whose boundary moves at run "
           "time, evicting whichever costs the least recompute per byte (bench/engine/arena.py)")
    a("--page-size", type=_positive, default=1, help="tokens per KV page (default 1)")
    a("--chunk-size", type=_positive, default=8192,
      help="prefill chunk / checkpoint stride [tokens] (default 8192)")
    a("--max-prefill-tokens", type=_positive, default=None,
      help="token budget of one prefill step (default: --chunk-size)")
    a("--max-running-requests", "--concurrency", dest="concurrency", type=_positive, default=None,
      help="requests running at most (and clients with --arrivals closed) (default 32)")
    a("--end-checkpoint", choices=("block", "exact"), default="block",
      help="state of a finished prompt at its last full trace block (default) or its last token")
    a("--arrivals", choices=("trace", "closed"), default="trace",
      help="trace timestamps (default) or a closed loop of --concurrency clients")
    a("--time-scale", type=_positive_float, default=None,
      help="arrival time = timestamp x this (2 halves the request rate) (default 1; needs "
           "--arrivals trace)")
    a("--session-hint", action="store_true",
      help="pass each request's session (trace / workload session id) to the cache as the "
           "hint extra={'session_id': ...}, as an engine carrying a conversation id would")
    a("--decode-ms", type=non_negative_float, default=20.0, help="one decode step [ms] (default 20)")
    a("--marconi-alpha", type=non_negative_float, default=None,
      help="fix Marconi's alpha (default: tuned; needs --policy marconi)")
    a("--sweep", type=sweep_arg, default=None, metavar="AXIS=V1,V2,...",
      help="kv-tokens / state-slots / concurrency / memory-gb / state-fraction")
    a("--jobs", type=_positive, default=os.cpu_count() or 1, help="parallel runs (default: CPUs)")
    a("--plot", metavar="FILE", type=figure_path, default=None,
      help="figure of a sweep, and its rows as CSV beside it (FILE with the suffix .csv)")
    a("--csv", metavar="FILE", type=output_path, default=None, help="one row per run")
    a("--json", metavar="FILE|-", type=output_path, default=None, help="everything as JSON ('-': stdout)")
    a("--markdown", action="store_true", help="print the table as Markdown")
    a("--wide", action="store_true",
      help="the table in one block, however wide (default: blocks of at most 120 columns)")
    a("--no-progress", action="store_true", help="no progress bar or lines")
    return p


#: The arrival time scale without ``--time-scale``.
DEFAULT_TIME_SCALE = 1.0

#: Pool sizes without ``--kv-tokens`` / ``--state-slots`` (and without ``--memory-gb``).
DEFAULT_KV_TOKENS = 16_000_000
DEFAULT_STATE_SLOTS = 512
#: Requests running at most without ``--max-running-requests`` / ``--concurrency``.
DEFAULT_CONCURRENCY = 32


def _kv_tokens(args: argparse.Namespace) -> int:
    return DEFAULT_KV_TOKENS if args.kv_tokens is None else int(args.kv_tokens)


def _state_slots(args: argparse.Namespace) -> int:
    return DEFAULT_STATE_SLOTS if args.state_slots is None else int(args.state_slots)


def _concurrency(args: argparse.Namespace) -> int:
    return DEFAULT_CONCURRENCY if args.concurrency is None else int(args.concurrency)


def _state_fraction(args: argparse.Namespace) -> float | str:
    return DEFAULT_STATE_FRACTION if args.state_fraction is None else args.state_fraction


def _policies(args: argparse.Namespace) -> list[str]:
    """``--policy``, or its default: ``lru gds``; ``unified`` with ``--state-fraction unified``."""
    if args.policy is not None:
        return list(args.policy)
    return [UNIFIED] if args.state_fraction == UNIFIED else ["lru", "gds"]


def _time_scale(args: argparse.Namespace) -> float:
    return DEFAULT_TIME_SCALE if args.time_scale is None else float(args.time_scale)


def _base_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        kv_tokens=_kv_tokens(args), state_slots=_state_slots(args), page_size=args.page_size,
        chunk_size=args.chunk_size, concurrency=_concurrency(args),
        end_checkpoint=args.end_checkpoint, time_scale=_time_scale(args), decode_ms=args.decode_ms,
        max_prefill_tokens=args.max_prefill_tokens, arrivals=args.arrivals,
        marconi_alpha=args.marconi_alpha, session_hint=args.session_hint,
    )
    if args.model is not None:
        kw["model"] = args.model
    return kw


def _apply_memory(kw: dict[str, Any], args: argparse.Namespace, memory_gb: float | None,
                  fraction: float | str) -> None:
    if memory_gb is None:
        return
    sizes = engine_sizes(get_preset(args.model), memory_gb, fraction, args.page_size)
    sizes.pop("policy", None)  # the unified arena's: --policy is unified (checked)
    kw.update(sizes)


def check_unified(args: argparse.Namespace, policies: Sequence[str]) -> None:
    """The options ``--state-fraction unified`` cannot go with (``ValueError`` naming the
    option): a policy other than ``unified``, a ``state-fraction`` sweep; without it, the
    policy ``unified`` (fixed pools have no byte sizes)."""
    if args.state_fraction != UNIFIED:
        refuse_unified_policies([], policies)
        return
    refuse_unified_policies([UNIFIED], policies)
    if args.sweep is not None and args.sweep.axis == "state-fraction":
        raise ValueError(f"--sweep state-fraction: --state-fraction {UNIFIED} has no fraction "
                         "to sweep (sweep memory-gb, or give fractions)")


def plan_runs(args: argparse.Namespace) -> list[tuple[SimConfig, float | None]]:
    """Every (config, swept value) to run, validated before anything runs.

    Raises:
        ValueError: a bad policy name or knob, memory options without ``--model``, a
            memory sweep without ``--model``, a baseline policy without state slots.
    """
    from bench.engine.simulator import SimConfig

    sweep: Sweep | None = args.sweep
    if (args.memory_gb is not None or (sweep and sweep.needs_model)) and args.model is None:
        raise ValueError("--memory-gb and memory sweeps need --model PRESET")
    if args.memory_gb is not None or (sweep and sweep.needs_model):  # pools sized from bytes
        given = [f"--{name.replace('_', '-')}" for name in ("kv_tokens", "state_slots")
                 if getattr(args, name) is not None]
        given += [f"--sweep {sweep.axis}" for _ in (0,)
                  if sweep is not None and sweep.axis in ("kv-tokens", "state-slots")]
        if given:
            raise ValueError(f"--memory-gb sizes both pools from --model's bytes: {', '.join(given)} "
                             "would be ignored (give one or the other)")
    if sweep is not None and sweep.axis == "state-fraction" and args.memory_gb is None:
        raise ValueError("--sweep state-fraction needs --memory-gb")
    policies = _policies(args)
    check_unified(args, policies)
    if sweep is not None:  # the swept option given as well: the sweep would override it
        given = getattr(args, sweep.axis.replace("-", "_"))
        if given is not None:
            shown = f"{given:g}" if isinstance(given, float) else str(given)
            raise ValueError(f"--{sweep.axis} {shown} would be ignored: --sweep {sweep.axis} "
                             "sets it (give one or the other)")
    for policy in policies:
        try:
            baselines.check(policy, args.page_size)
        except ValueError as exc:
            raise ValueError(f"--policy: {exc}") from None
    values: Sequence[float | None] = sweep.values if sweep else (None,)
    out = []
    for value in values:
        kw = _base_kwargs(args)
        memory, fraction = args.memory_gb, _state_fraction(args)
        if sweep is not None and value is not None:
            if sweep.axis == "memory-gb":
                memory = value
            elif sweep.axis == "state-fraction":
                fraction = value
            else:
                kw[sweep.field] = value
        _apply_memory(kw, args, memory, fraction)
        for policy in policies:
            out.append((SimConfig.of(policy, **kw), value))
    return out


# ------------------------------------------------------------------------ report
_COLUMNS = (
    "value", "policy", "KV tokens", "slots", "conc", "hit", "KV hit", "state-miss tok/req",
    "prefill s/req", "TTFT p50 s", "p90 s", "p99 s", "queue mean s", "out tok/min/GPU",
    "evicted states", "alpha",
)
#: The columns that name a run (repeated in every block of a table split to fit the width).
_KEY_COLUMNS = 5


def _row(r: SimResult, value: float | None) -> list[str]:
    m, t, e = r.metrics, r.timing, r.config.engine
    return [
        "" if value is None else fmt_value(value), r.label, f"{e.kv_tokens:,}", f"{e.state_slots:,}",
        str(e.concurrency), f"{m.token_hit_rate:.4f}", f"{m.kv_hit_rate:.4f}",
        f"{m.state_miss_tokens.mean:,.1f}", f"{m.prefill_cost.mean:.4f}",
        f"{t.ttft_p50:.2f}", f"{t.ttft_p90:.2f}",
        f"{t.ttft_p99:.2f}", f"{t.queue_mean:.2f}", f"{t.output_tokens_per_min_per_gpu:,.0f}",
        f"{r.counters.evicted_states:,}", "" if r.tuning is None else f"{r.tuning.alpha:g}",
    ]


def render_rows(results: Sequence[SimResult], values: Sequence[float | None],
                markdown: bool = False, wide: bool = False,
                splits: Sequence[float | str] | None = None) -> str:
    """One row per run: cache metrics, TTFT [s], queueing [s], throughput. Plain text fits
    :data:`bench.cli.TABLE_WIDTH` columns (the metrics in blocks, each with the
    columns naming the run) unless ``wide``; Markdown is one table. ``splits``: each run's
    memory split (:func:`run_splits`), a ``split`` column after the policy."""
    header = list(_COLUMNS)
    rows = [_row(r, v) for r, v in zip(results, values, strict=True)]
    key = _KEY_COLUMNS
    if splits is not None:
        header.insert(2, "split")
        for row, split in zip(rows, splits, strict=True):
            row.insert(2, fmt_split(split))
        key += 1
    if values and values[0] is None:  # no sweep: drop the value column
        header, rows, key = header[1:], [row[1:] for row in rows], key - 1
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|"]
        return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    key_width = sum(widths[:key]) + 2 * (key - 1)
    blocks = [[*range(key), *(key + i for i in b)]
              for b in column_blocks(key_width, widths[key:], None if wide else TABLE_WIDTH)]
    return "\n\n".join(
        "\n".join("  ".join(line[i].rjust(widths[i]) for i in block) for line in [header, *rows])
        for block in blocks)


def beats_reference(results: Sequence[SimResult], values: Sequence[float | None]) -> list[str]:
    """Where a policy does better than the offline reference at the same swept value: a
    higher token hit rate, a lower mean prefill cost [s] or a lower p90 TTFT [s]."""
    ref = {v: r for r, v in zip(results, values, strict=True) if r.label == "belady"}
    out = []
    for r, v in zip(results, values, strict=True):
        b = ref.get(v)
        if b is None or r is b:
            continue
        won = []
        if r.metrics.token_hit_rate > b.metrics.token_hit_rate:
            won.append(f"hit {r.metrics.token_hit_rate:.4f} > {b.metrics.token_hit_rate:.4f}")
        if r.metrics.prefill_cost.mean < b.metrics.prefill_cost.mean:
            won.append(f"prefill {r.metrics.prefill_cost.mean:.4f} < "
                       f"{b.metrics.prefill_cost.mean:.4f} s/req")
        if r.timing.ttft_p90 < b.timing.ttft_p90:
            won.append(f"p90 TTFT {r.timing.ttft_p90:.4g} < {b.timing.ttft_p90:.4g} s")
        if won:
            where = "" if v is None else f" at {fmt_value(v)}"
            out.append(f"{r.label}{where}: " + ", ".join(won))
    return out


def _header(args: argparse.Namespace, path: Path | str, n: int, bounds: Bounds) -> str:
    model = ""
    if args.model:
        p = get_preset(args.model)
        model = (f", model {p.name} ({p.kv_bytes_per_token:,} B/token, "
                 f"{p.state_bytes_per_slot:,} B/slot)")
    return "\n".join([
        f"trace: {trace_label(path) if isinstance(path, Path) else path} ({n:,} requests), arrivals {args.arrivals}, time scale {_time_scale(args):g}"
        f", decode {args.decode_ms:g} ms/token, prefill budget "
        f"{args.max_prefill_tokens or args.chunk_size:,} tokens/step{model}",
        f"infinite-memory bounds (match prompt[:-1]): every block {bounds.every_block_hit_rate:.4f}, "
        f"sparse checkpoints {bounds.sparse_hit_rate:.4f}",
    ])


def fmt_split(split: float | str) -> str:
    """A state fraction as ``0.2``, ``"unified"`` as it is."""
    return split if isinstance(split, str) else f"{split:.4g}"


def run_splits(args: argparse.Namespace, values: Sequence[float | None]
               ) -> list[float | str] | None:
    """Each run's memory split: its state fraction, or ``"unified"``; ``None`` when the
    pools are not sized from ``--memory-gb``."""
    if args.model is None or (args.memory_gb is None and not (args.sweep and args.sweep.needs_model)):
        return None
    swept = args.sweep is not None and args.sweep.axis == "state-fraction"
    return [v if swept and v is not None else _state_fraction(args) for v in values]


def _json(results: Sequence[SimResult], values: Sequence[float | None], bounds: Bounds,
          sweep: Sweep | None, splits: Sequence[float | str] | None = None) -> dict[str, Any]:
    runs = []
    for i, (r, v) in enumerate(zip(results, values, strict=True)):
        runs.append({**csv_row(r, sweep, v),
                     **({} if splits is None else {"split": splits[i]}),
                     "metrics": r.metrics.as_dict(),
                     "timing": asdict(r.timing), "counters": asdict(r.counters),
                     "tuning": None if r.tuning is None else asdict(r.tuning)})
    return {"bounds": bounds.as_dict(), "sweep": None if sweep is None else sweep.axis,
            "runs": runs}


def sizes_caption(args: argparse.Namespace) -> str:
    """The pool sizes of a sweep's figure: the swept axis by its values, the others by theirs."""
    sweep: Sweep = args.sweep
    fixed: dict[str, str]
    if args.model is not None:  # both pools sized from bytes
        fixed = {"model": f"model {args.model}", "memory-gb": f"{args.memory_gb} GB",
                 "state-fraction": f"state fraction {fmt_split(_state_fraction(args))}",
                 "concurrency": f"concurrency {_concurrency(args)}"}
    else:
        fixed = {"kv-tokens": f"KV {_kv_tokens(args):,} tokens",
                 "state-slots": f"{_state_slots(args):,} state slots",
                 "concurrency": f"concurrency {_concurrency(args)}"}
    swept = f"{sweep.axis} {', '.join(fmt_value(v) for v in sweep.values)} (swept)"
    if sweep.axis in fixed:
        fixed[sweep.axis] = swept
        return ", ".join(fixed.values())
    return ", ".join(fixed.values()) + f"; {swept}"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; 0 ok, 2 bad arguments or trace."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_source_options(parser, args)
    refuse_ignored(parser, (
        ("--time-scale", args.time_scale, "--arrivals trace", args.arrivals == "trace"),
        ("--state-fraction", args.state_fraction, "--memory-gb",
         args.memory_gb is not None or (args.sweep is not None and args.sweep.axis == "memory-gb")),
        ("--marconi-alpha", args.marconi_alpha, "--policy marconi", "marconi" in _policies(args))))
    if args.plot is not None:
        require_package(parser, "matplotlib", "--plot", "plot")
    if args.torch_threads < 1:
        parser.exit(2, f"{parser.prog}: error: --torch-threads must be >= 1, got {args.torch_threads}\n")
    import torch

    torch.set_num_threads(args.torch_threads)
    try:
        if args.plot is not None and args.sweep is None:
            raise ValueError("--plot needs --sweep AXIS=V1,V2,...")
        plan = plan_runs(args)
        path: Path | str
        if args.workload is not None:
            trace = workload_requests(args.workload, args.workload_seed, args.max_requests,
                                      args.trace)
            path = f"workload {args.workload} (seed {args.workload_seed})"
        else:
            path = resolve_trace_path(args.trace)
            fmt = sniff_format(path) if args.trace_format == "auto" else args.trace_format
            trace = load_trace(path, fmt=fmt, max_requests=args.max_requests,
                               mooncake_block_size=args.mooncake_block_size)
    except (FileNotFoundError, TraceFormatError, ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if not trace:
        parser.exit(2, f"{parser.prog}: error: no requests in {path}\n")
    warn_page_split(parser.prog, args.page_size, trace[0].block_size)
    bounds = compute_bounds(trace, exclude_last_token=True, page_size=args.page_size)
    configs = [c for c, _ in plan]
    values = [v for _, v in plan]
    results = run_all(trace, configs, args.jobs, False if args.no_progress else None)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(_header(args, path, len(trace), bounds), file=out)
    splits = run_splits(args, values)
    print(render_rows(results, values, args.markdown, args.wide, splits), file=out)
    beaten = beats_reference(results, values)
    if any(r.label == "belady" for r in results):
        print("better than the offline reference (belady): " + ("nowhere" if not beaten else ""),
              file=out)
        for line in beaten:
            print(f"  {line}", file=out)
    rows = [csv_row(r, args.sweep, v) for r, v in zip(results, values, strict=True)]
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        write_csv(Path(args.plot).with_suffix(".csv"), rows)
        name = trace_label(path) if isinstance(path, Path) else path
        title = f"{name}: {len(trace):,} requests; " + sizes_caption(args)
        swept = [v for v in values if v is not None]  # --plot needs --sweep: every run has one
        write_sweep_plot(args.plot, results, args.sweep, swept, bounds, title)
    if args.json is not None:
        write_json(args.json, _json(results, values, bounds, args.sweep, splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
