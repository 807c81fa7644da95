"""``python -m bench memory-split``: fixed KV / state splits against one memory arena.

For each byte budget (``--memory-gb``) of a model preset (``--model``,
``bench.engine.presets``), the trace is replayed in the engine model
(``bench.engine.core.ReplayEngine``) once per fixed split of ``--state-fractions`` (the state
pool gets that share of the bytes: ``split_memory``; the per-kind policy ``--policy``) and once
with the unified arena (``allocators.arena.MemoryArena`` with
``radix_eviction_policy="unified"``: the boundary moves at run time toward a target learned
from what each side lost, and when the arena is short the cache evicts KV tokens or states:
``components.eviction.unified.make_room``, ``components.eviction.boundary``). One JSON record per run: ``memory_gb``, ``split``
(the state fraction, or ``"unified"``), ``token_hit_rate``, CPU time, and for the arena its
layout waste (real bytes) and where the boundary ended.

The default split an operator gets: SGLang's ``--mamba-full-memory-ratio`` (default 0.9,
``server_args.py``), the ratio of Mamba-state to full-attention KV memory; the model runner
gives states ``total * r / (1 + r)`` of the cache memory, a state fraction of
``0.9 / 1.9 = 0.4737`` (:data:`SGLANG_DEFAULT_FRACTION`).

The arena of a replay is built with the preset's *counts*, not its bytes
(``bench.engine.presets.arena_layout``, ``bench.engine.arena``): one chunk holds
``tokens_per_chunk = ceil(state_bytes / (page * kv_bytes_per_token)) * page`` KV tokens or one
state, and the budget holds ``memory_gb * 1e9 // (tokens_per_chunk * kv_bytes_per_token)``
chunks, as a real arena of the preset's shapes would; its tensors use 4 bytes per KV token
(the replay writes no KV data), so a 100 GB budget costs megabytes here. ``python -m bench
replay`` and ``python -m bench simulate`` run the same arena with ``--state-fraction unified``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from typing import Any

from bench.cli import (
    ArgumentParser,
    output_path,
    positive,
    positive_float,
    prog,
    state_fraction,
    text_stream,
)
from bench.engine.presets import SGLANG_DEFAULT_FRACTION

__all__ = ["SGLANG_DEFAULT_FRACTION", "arena_fields", "build_parser", "fixed_config",
           "fixed_fraction", "main", "run_arena", "run_fixed"]


#: The fixed splits swept by default (state fraction of the budget).
DEFAULT_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.3, SGLANG_DEFAULT_FRACTION, 0.6, 0.8)


def fixed_fraction(text: str) -> float:
    """A fixed split of ``--state-fractions``: a number in ``[0, 1)`` (the unified arena always
    runs beside them)."""
    value = state_fraction(text)
    if isinstance(value, str):
        raise argparse.ArgumentTypeError(
            f"expected a number in [0, 1), got {text!r} (the unified arena runs anyway)")
    return value


def build_parser() -> argparse.ArgumentParser:
    from bench.engine.presets import PRESETS
    from bench.workloads import add_workload_arguments

    p = ArgumentParser(prog=prog("memory-split"), description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="trace file (default: the shipped Mooncake trace)")
    add_workload_arguments(p)
    p.add_argument("--model", default="qwen3-next-80b", choices=sorted(PRESETS),
                   help="model preset whose KV and state bytes split the budget")
    p.add_argument("--memory-gb", type=positive_float, nargs="+", required=True,
                   help="byte budgets of the cache [decimal GB]")
    p.add_argument("--state-fractions", type=fixed_fraction, nargs="+",
                   default=list(DEFAULT_FRACTIONS),
                   help="fixed splits: the state pool's share of the budget, in [0, 1) "
                        "(default: a grid with SGLang's default 0.4737)")
    p.add_argument("--policy", default="gds", help="radix eviction policy of the fixed splits")
    p.add_argument("--max-requests", type=positive, default=None, help="replay only the first N")
    p.add_argument("--page-size", type=positive, default=1)
    p.add_argument("--chunk-size", type=positive, default=8192)
    p.add_argument("--concurrency", type=positive, default=32)
    p.add_argument("--json", type=output_path, default=None, metavar="OUT",
                   help="write the records as a JSON list")
    return p


def _arena_for(preset: Any, memory_gb: float, page_size: int, fraction: float) -> Any:
    """The scaled arena of ``preset`` at ``memory_gb`` (``bench.engine.arena.build_arena``),
    states owning ``fraction`` of the usable chunks at first."""
    from bench.engine.arena import build_arena
    from bench.engine.presets import arena_layout

    return build_arena(arena_layout(preset, memory_gb, fraction, page_size), page_size)


def real_waste_fraction(preset: Any, memory_gb: float, arena: Any, state_chunks: int) -> float:
    """The layout waste of a real arena of ``preset``'s bytes with ``arena``'s chunk counts and
    ``state_chunks`` state chunks: the budget's tail past the last usable chunk and
    ``chunk - state`` bytes per state chunk (a fraction of the budget; the padding chunk is
    on top of the budget, as ``allocators.arena.MemoryArena.waste_bytes`` counts it)."""
    from bench.engine.presets import GB

    budget = memory_gb * GB
    chunk = arena.tokens_per_chunk * preset.kv_bytes_per_token
    waste = (budget - (arena.num_chunks - 1) * chunk) \
        + state_chunks * (chunk - preset.state_bytes_per_slot)
    return float(waste / budget)


def _replay(engine: Any, trace: Sequence[Any]) -> dict[str, Any]:
    """Replay ``trace`` through ``engine``: the token hit rate over every request's prompt
    tokens (a skipped request's count as misses, so that runs that skip differently compare),
    the requests skipped, the CPU seconds of the replay."""
    cpu0 = time.process_time()
    for i, tr in enumerate(trace):
        engine.admit(tr, rid=i)
    engine.drain()
    cpu = time.process_time() - cpu0
    engine.cache.sanity_check()
    total = sum(len(tr.token_array) for tr in trace)
    usable = sum(engine.log.usable_len)
    return {"token_hit_rate": usable / total if total else 0.0,
            "skipped": engine.log.skipped, "cpu_s": cpu}


def fixed_config(preset: Any, memory_gb: float, fraction: float, args: argparse.Namespace
                 ) -> Any:
    """The ``EngineConfig`` of one fixed split; ``None`` when it holds no state slot or no KV
    page.

    Raises:
        ValueError: a bad policy or engine option, or pools past this machine's memory
            (``MemoryBudgetError``).
    """
    from bench.engine.core import EngineConfig
    from bench.engine.presets import split_memory

    try:
        split = split_memory(preset, memory_gb, fraction, args.page_size)
    except ValueError:
        return None
    if split.state_slots < 1:
        return None
    return EngineConfig(policy=args.policy, kv_tokens=split.kv_tokens,
                        state_slots=split.state_slots, page_size=args.page_size,
                        chunk_size=args.chunk_size, concurrency=args.concurrency)


def run_fixed(trace: Sequence[Any], preset: Any, memory_gb: float, fraction: float,
              args: argparse.Namespace) -> dict[str, Any] | None:
    """One fixed split; ``None`` when it holds no state slot or no KV page."""
    from bench.engine.core import ReplayEngine

    cfg = fixed_config(preset, memory_gb, fraction, args)
    if cfg is None:
        return None
    return {"memory_gb": memory_gb, "split": fraction, "policy": args.policy,
            **_replay(ReplayEngine(cfg), trace), "kv_tokens": cfg.kv_tokens,
            "state_slots": cfg.state_slots}


def run_arena(trace: Sequence[Any], preset: Any, memory_gb: float,
              args: argparse.Namespace) -> dict[str, Any]:
    """The unified arena, starting from SGLang's default split."""
    from bench.engine.arena import ArenaReplayEngine
    from bench.engine.core import EngineConfig
    from bench.engine.presets import UNIFIED, engine_sizes

    cfg = EngineConfig(**engine_sizes(preset, memory_gb, UNIFIED, args.page_size),
                       page_size=args.page_size, chunk_size=args.chunk_size,
                       concurrency=args.concurrency)
    engine = ArenaReplayEngine(cfg)
    rec = _replay(engine, trace)
    arena = engine.arena
    arena.check()
    return {"memory_gb": memory_gb, "split": "unified", "policy": "unified",
            **rec, **arena_fields(preset, memory_gb, engine)}


def arena_fields(preset: Any, memory_gb: float, engine: Any) -> dict[str, Any]:
    """What a unified run reports besides its hit rate: ``chunks``, ``tokens_per_chunk``,
    ``final_state_fraction`` (of the usable chunks), ``state_chunks_range`` (fewest, most
    state chunks over the run) and ``waste_fraction_max`` (:func:`real_waste_fraction` at
    the worse end of that range)."""
    arena = engine.arena
    return {"chunks": arena.num_chunks, "tokens_per_chunk": arena.tokens_per_chunk,
            "final_state_fraction": arena.num_state_chunks / max(arena.num_chunks - 1, 1),
            "state_chunks_range": list(engine.state_chunks),
            "waste_fraction_max": max(real_waste_fraction(preset, memory_gb, arena, n)
                                      for n in engine.state_chunks)}


def render(records: Sequence[dict[str, Any]]) -> str:
    """A markdown table: one row per budget, token hit rate [%] per split and unified."""
    splits = sorted({r["split"] for r in records if r["split"] != "unified"})
    head = ["GB"] + [f"{s:.3g}" + (" (sglang)" if math.isclose(s, SGLANG_DEFAULT_FRACTION, rel_tol=1e-3)
                                   else "") for s in splits] + ["best fixed", "unified",
                                                                "unified - best", "cpu x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for gb in sorted({r["memory_gb"] for r in records}):
        row = {r["split"]: r for r in records if r["memory_gb"] == gb}
        fixed = [row[s]["token_hit_rate"] for s in splits if s in row]
        best = max(fixed) if fixed else float("nan")
        uni = row.get("unified")
        cells = [f"{gb:g}"] + [f"{100 * row[s]['token_hit_rate']:.1f}" if s in row else "-"
                               for s in splits]
        cells.append(f"{100 * best:.1f}")
        if uni is not None:
            cpu_fixed = [row[s]["cpu_s"] for s in splits if s in row]
            ratio = uni["cpu_s"] / (sum(cpu_fixed) / len(cpu_fixed)) if cpu_fixed else float("nan")
            cells += [f"{100 * uni['token_hit_rate']:.1f}",
                      f"{100 * (uni['token_hit_rate'] - best):+.1f}", f"{ratio:.2f}"]
        else:
            cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from bench.engine.presets import UNIFIED, engine_sizes, get_preset
    from bench.traces.loader import TraceFormatError, load_trace
    from bench.workloads import check_source_options, workload_requests

    check_source_options(parser, args)
    from radix import CacheConfig

    preset = get_preset(args.model)
    try:  # everything that can be refused, before any run
        if args.policy == UNIFIED:
            raise ValueError(f"--policy {UNIFIED}: the fixed splits' pools have no byte sizes "
                             f"for it to weigh (the {UNIFIED} arena runs beside them anyway)")
        try:
            CacheConfig(page_size=args.page_size, radix_eviction_policy=args.policy)
        except ValueError as exc:
            raise ValueError(f"--policy: {exc}") from None
        for gb in args.memory_gb:  # every run's pools (the arena: two chunks at least)
            engine_sizes(preset, gb, UNIFIED, args.page_size)
            for f in args.state_fractions:
                try:
                    fixed_config(preset, gb, f, args)
                except ValueError as exc:
                    raise ValueError(f"--memory-gb {gb:g} at state fraction {f:g}: {exc}"
                                     ) from None
        if args.workload is not None:
            trace = workload_requests(args.workload, args.workload_seed, args.max_requests,
                                      args.trace)
        else:
            trace = load_trace(args.trace, max_requests=args.max_requests)
    except (FileNotFoundError, TraceFormatError, ValueError, TypeError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    out = text_stream(args.json)
    records: list[dict[str, Any]] = []
    for gb in args.memory_gb:
        for f in args.state_fractions:
            rec = run_fixed(trace, preset, gb, f, args)
            if rec is not None:
                records.append(rec)
                print(json.dumps(rec), file=out, flush=True)
        rec = run_arena(trace, preset, gb, args)
        records.append(rec)
        print(json.dumps(rec), file=out, flush=True)
    print(render(records), file=out)
    if args.json is not None:
        from bench.cli import write_json

        write_json(args.json, records)
    return 0
