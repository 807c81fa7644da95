"""The trace replay with LoRA adapters: ``python -m bench replay --adapters N|DIR... ...``.

Each request runs through an adapter (:func:`bench.lora.sched.assign_adapters`); the
:class:`~bench.lora.sched.LoraScheduler` batches requests so their adapters fit
``--max-loras-per-batch`` slots of a real :class:`~allocators.lora.LoraMemoryPool` and feeds
them to the prefix-cache engine with the adapter's uid as ``extra_key``. One run per
(radix policy, memory size, LoRA eviction policy); the table reads LoRA policies side by side.

``--adapters`` takes either a count ``N`` or adapter directories:

* ``N``: generated adapters (:func:`write_replay_adapters`, ``q_proj`` / ``v_proj`` of a
  64-wide model, ranks 4 / 8 / 16), written as PEFT directories to a temporary directory, so
  every host load reads a real safetensors file and every slot fill is a real tensor copy;
  their size does not affect the counts reported.
* ``DIR ...``: real PEFT adapter directories, in any ``lora_paths`` form (``PATH``,
  ``NAME=PATH``, JSON ``{"lora_name", "lora_path"}``; pinning is not modelled). The replay's
  stand-in base model is then the modules the adapters target, with their shapes (adapters
  that disagree on a module's shape are refused), and ``max_lora_rank`` their largest rank.

Examples::

    python -m bench replay --max-requests 2000 --adapters 32 --adapter-skew zipf:1.1 \\
        --max-loras-per-batch 8 --lora-eviction-policy lru fifo --policy lru
    python -m bench replay --max-requests 2000 --adapters sql=/ckpt/sql chat=/ckpt/chat \\
        /ckpt/code --max-loras-per-batch 2
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from allocators.lora import LoraAdapter
from bench.cli import Progress, write_json
from bench.engine.bounds import Bounds
from bench.engine.core import EngineConfig, ReplayEngine
from bench.engine.metrics import reset_peak_rss
from bench.lora.sched import (
    LoraCounters,
    LoraReplayConfig,
    LoraScheduler,
    adapter_name,
    assign_adapters,
    parse_adapter_skew,
)
from bench.report.tables import RunResult, TraceInfo, to_json_dict
from bench.traces.loader import TraceRequest
from radix.lora import LoraPathSpec, parse_lora_paths, read_peft_adapter, write_peft_adapter

__all__ = [
    "REPLAY_BASE_MODULES",
    "LoraRunResult",
    "ReplayAdapters",
    "lora_replay_configs",
    "render_lora_table",
    "replay_adapters_from_dirs",
    "replay_lora_one",
    "run_lora_replays",
    "write_replay_adapters",
]

REPLAY_BASE_MODULES = {"q_proj": (64, 64), "v_proj": (64, 64)}
"""The replay's stand-in base model: module -> (in_features, out_features)."""

_RANKS = (4, 8, 16)
_SOURCES = {"generated": "generated", "directories": "from their directories"}


@dataclass(frozen=True)
class ReplayAdapters:
    """The adapters one LoRA replay serves.

    Attributes:
        names: serving name of adapter ``k`` (requests are assigned indices ``k``).
        paths: PEFT directory of adapter ``k``.
        base_modules: the stand-in base model: module path -> ``(in_features, out_features)``.
        max_lora_rank: the largest rank among the adapters.
        source: ``"generated"`` or ``"directories"`` (for the report).
    """

    names: tuple[str, ...]
    paths: tuple[str, ...]
    base_modules: Mapping[str, tuple[int, int]]
    max_lora_rank: int
    source: str


def write_replay_adapters(directory: str | Path, n: int, seed: int = 0) -> tuple[list[str], int]:
    """Write ``n`` PEFT adapter directories (adapter ``k`` has rank ``(4, 8, 16)[k % 3]``);
    returns their paths and the largest rank."""
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for k in range(n):
        r = _RANKS[k % len(_RANKS)]
        weights = {
            m: (torch.randn(r, i, generator=gen), torch.randn(o, r, generator=gen))
            for m, (i, o) in REPLAY_BASE_MODULES.items()
        }
        path = Path(directory) / adapter_name(k)
        write_peft_adapter(path, LoraAdapter(weights, scaling=2.0 / r))
        paths.append(str(path))
    return paths, max(_RANKS[: min(n, len(_RANKS))])


def generated_replay_adapters(directory: str | Path, n: int, seed: int = 0) -> ReplayAdapters:
    """:func:`write_replay_adapters` as a :class:`ReplayAdapters` over ``REPLAY_BASE_MODULES``."""
    paths, max_rank = write_replay_adapters(directory, n, seed)
    names = tuple(adapter_name(k) for k in range(n))
    return ReplayAdapters(names, tuple(paths), REPLAY_BASE_MODULES, max_rank, "generated")


def replay_adapters_from_dirs(specs: Sequence[LoraPathSpec]) -> ReplayAdapters:
    """Read every adapter directory once: the base modules they fit and their largest rank.

    Raises:
        FileNotFoundError / LoraFormatError: a directory is missing or not a LoRA adapter.
        ValueError: two adapters disagree on a module's shape.
    """
    base: dict[str, tuple[int, int]] = {}
    owner: dict[str, str] = {}
    max_rank = 0
    for spec in specs:
        adapter = read_peft_adapter(spec.path)
        max_rank = max(max_rank, adapter.rank)
        for module, (a, b) in adapter.weights.items():
            shape = (int(a.shape[1]), int(b.shape[0]))
            if base.setdefault(module, shape) != shape:
                raise ValueError(
                    f"--adapters {spec.name!r} has {module!r} of (in, out) = {shape}, but "
                    f"{owner[module]!r} has {base[module]}: not adapters of one base model"
                )
            owner.setdefault(module, spec.name)
    names = tuple(s.name for s in specs)
    return ReplayAdapters(names, tuple(s.path for s in specs), base, max_rank, "directories")


# --------------------------------------------------------------------------- CLI
def lora_replay_configs(args: argparse.Namespace) -> list[LoraReplayConfig] | None:
    """One config per ``--lora-eviction-policy``, or ``None`` without ``--adapters`` (or 0).

    Raises:
        ValueError: a bad LoRA option (or ``--plot``, which LoRA runs do not draw).
        FileNotFoundError: an adapter directory that does not exist.
    """
    count, specs = _parse_adapters(args.adapters)
    if count == 0:
        return None
    if getattr(args, "plot", None) is not None:
        raise ValueError("--plot is not supported with --adapters")
    for spec in specs:
        if spec.pinned:
            raise ValueError(f"--adapters {spec.name!r}: pinning is not modelled by the replay")
        if not Path(spec.path).exists():
            raise FileNotFoundError(f"--adapters: LoRA adapter directory not found: {spec.path!r}")
    skew = parse_adapter_skew(args.adapter_skew)
    return [
        LoraReplayConfig(
            num_adapters=count,
            adapter_dirs=specs,
            skew=skew,
            max_loras_per_batch=args.max_loras_per_batch,
            max_loaded_loras=args.max_loaded_loras,
            eviction_policy=policy,
            drain_wait_threshold_s=args.lora_drain_wait_threshold,
            base_fraction=args.base_fraction,
            decode_step_s=args.decode_step_ms / 1000.0,
            seed=args.lora_seed,
        )
        for policy in args.lora_eviction_policy
    ]


def _parse_adapters(values: Sequence[str] | None) -> tuple[int, tuple[LoraPathSpec, ...]]:
    """``--adapters`` as ``(count, directories)``: ``N`` -> ``(N, ())``, entries -> specs."""
    if not values:
        return 0, ()
    if len(values) == 1:
        try:
            count = int(values[0])
        except ValueError:
            pass
        else:
            if count < 0:
                raise ValueError(f"--adapters must be >= 0, got {count}")
            return count, ()
    specs = parse_lora_paths(list(values))
    return len(specs), specs


# --------------------------------------------------------------------------- runs
@dataclass(frozen=True, slots=True)
class LoraRunResult:
    """One LoRA replay: the prefix-cache result and the LoRA counters."""

    run: RunResult
    lora: LoraReplayConfig
    counters: LoraCounters

    @property
    def label(self) -> str:
        return f"{self.run.config.policy}/{self.lora.eviction_policy}"


def replay_lora_one(
    trace: Sequence[TraceRequest],
    config: EngineConfig,
    lora: LoraReplayConfig,
    adapters: ReplayAdapters,
    progress: bool | None = None,
) -> LoraRunResult:
    """Replay ``trace`` with adapters through a fresh cache and a fresh LoRA pool.

    Raises:
        AssertionError: the cache or the pool broke an invariant, or a lock survived.
    """
    engine = ReplayEngine(config)
    sched = LoraScheduler(
        lora,
        config.concurrency,
        adapters.paths,
        dict(adapters.base_modules),
        adapters.max_lora_rank,
        names=adapters.names,
    )
    assignment = assign_adapters(trace, lora)
    per_run = reset_peak_rss()
    start = time.perf_counter()
    with Progress(len(trace), f"{config.policy}/{lora.eviction_policy} "
                  f"adapters={lora.num_adapters}", "req", progress) as bar:
        counters = sched.run(trace, assignment, engine, on_admit=bar.update)
    wall = time.perf_counter() - start
    run = RunResult.of(engine, wall, per_run)
    return LoraRunResult(run, lora, counters)


def render_lora_table(
    info: TraceInfo, results: Sequence[LoraRunResult], bounds: Bounds, source: str = "generated"
) -> str:
    """Header lines and one column per run (``radix policy / LoRA policy``)."""
    lo = results[0].lora
    cfg = results[0].run.config
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, f: Any) -> None:
        rows.append((name, [f(r) for r in results]))

    row(
        "KV tokens / state slots",
        lambda r: f"{r.run.config.kv_tokens:,} / {r.run.config.state_slots:,}",
    )
    row("token hit rate", lambda r: f"{r.run.metrics.token_hit_rate:.4f}")
    row("KV hit rate", lambda r: f"{r.run.metrics.kv_hit_rate:.4f}")
    row(
        "requests (skipped)",
        lambda r: f"{r.run.metrics.requests:,} ({r.run.metrics.skipped_requests:,})",
    )
    row("adapter slot hit rate", lambda r: f"{r.counters.slot_hit_rate:.4f}")
    row("slot loads", lambda r: f"{r.counters.slot_loads:,}")
    row("slot evictions", lambda r: f"{r.counters.slot_evictions:,}")
    row("host loads (directory reads)", lambda r: f"{r.counters.host_loads:,}")
    row("drains", lambda r: f"{r.counters.drains:,}")
    row("queue wait s mean", lambda r: f"{r.counters.wait_summary()['mean']:.2f}")
    row(
        "  p50 / p90 / max",
        lambda r: "{p50:.2f} / {p90:.2f} / {max:.1f}".format(**r.counters.wait_summary()),
    )
    row("batches prepared", lambda r: f"{r.counters.batches:,}")
    row("wall time s", lambda r: f"{r.run.wall_s:.1f}")
    lines = [
        f"trace: {info.path} ({info.fmt}, {info.requests:,} requests, "
        f"{info.prompt_tokens:,} prompt tokens, block {info.block_size})",
        f"engine: page {cfg.page_size}, chunk {cfg.chunk_size:,}, concurrency {cfg.concurrency}",
        f"LoRA: {lo.num_adapters} adapters, {_SOURCES.get(source, source)} ({lo.skew}, base "
        f"model {lo.base_fraction:.0%} of sessions), max_loras_per_batch {lo.max_loras_per_batch}, max_loaded_loras "
        f"{lo.max_loaded_loras or 'all'}, drain threshold {lo.drain_wait_threshold_s:g} s, "
        f"decode step {lo.decode_step_s * 1000:g} ms",
        "",
    ]
    header = ("metric", [r.label for r in results])
    w0 = max(len(header[0]), *(len(n) for n, _ in rows))
    widths = [max(len(header[1][i]), *(len(v[i]) for _, v in rows)) for i in range(len(results))]
    for name, vals in [header, *rows]:
        cells = "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
        lines.append(f"{name.ljust(w0)}  {cells}")
    lines += [
        "",
        f"infinite-memory bounds without adapters (match prompt[:-1], page {bounds.page_size}): "
        f"every block {bounds.every_block_hit_rate:.4f}, sparse {bounds.sparse_hit_rate:.4f}",
        "slot hit = the request's adapter was already in a slot or in the running batch; "
        "wait = admission - arrival (simulated)",
    ]
    return "\n".join(lines)


def run_lora_replays(
    trace: Sequence[TraceRequest],
    configs: Sequence[EngineConfig],
    loras: Sequence[LoraReplayConfig],
    info: TraceInfo,
    bounds: Bounds,
    notes_bounds: Bounds,
    json_target: str | None,
    progress: bool | None,
) -> int:
    """Every (engine config, LoRA config) run; print the table, write JSON; exit status 0, or
    2 when an adapter directory cannot be served (the message on stderr)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="hpc-lora-") as tmp:
        first = loras[0]
        try:
            adapters = (
                replay_adapters_from_dirs(first.adapter_dirs)
                if first.adapter_dirs
                else generated_replay_adapters(tmp, first.num_adapters, first.seed)
            )
        except (FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for config in configs:
            for lora in loras:
                gc.collect()
                results.append(replay_lora_one(trace, config, lora, adapters, progress))
    out: TextIO = sys.stderr if json_target == "-" else sys.stdout
    print(render_lora_table(info, results, bounds, adapters.source), file=out)
    if json_target is not None:
        payload = to_json_dict(info, [r.run for r in results], bounds, notes_bounds)
        for run_json, r in zip(payload["runs"], results, strict=True):
            run_json["lora"] = {
                "eviction_policy": r.lora.eviction_policy,
                "num_adapters": r.lora.num_adapters,
                "adapters": adapters.source,
                "adapter_paths": list(adapters.paths) if r.lora.adapter_dirs else None,
                "max_lora_rank": adapters.max_lora_rank,
                "skew": str(r.lora.skew),
                "max_loras_per_batch": r.lora.max_loras_per_batch,
                "max_loaded_loras": r.lora.max_loaded_loras,
                "drain_wait_threshold_s": r.lora.drain_wait_threshold_s,
                "base_fraction": r.lora.base_fraction,
                "decode_step_s": r.lora.decode_step_s,
                **r.counters.as_dict(),
            }
        write_json(json_target, payload)
    return 0
