"""Trace replay CLI: ``python -m bench replay`` / ``hpc-bench replay``.

Replays a request trace through the prefix cache the way an engine would
(:mod:`bench.engine.core`), once per eviction policy and memory size, and prints the metrics side
by side (:mod:`bench.report.tables`) with the trace's infinite-memory bounds (:mod:`bench.engine.bounds`).

Examples::

    python -m bench replay                                   # shipped Mooncake trace, lru vs gds
    python -m bench replay --max-requests 2000 --policy lru gds --kv-tokens 16M --state-slots 512
    python -m bench replay --trace ../shared/traces/lmbench_gmi_trace.jsonl --kv-tokens 1M --json out.json
    python -m bench replay --state-slots 128 256 512 --policy lru gds --json -   # a sweep, JSON on stdout
    python -m bench replay --max-requests 2000 --adapters 32 --adapter-skew zipf:1.1 --max-loras-per-batch 8
        # LoRA adapters (bench.lora.replay): slot loads, evictions, hit rate; lru vs fifo
    python -m bench replay --kv-tokens 2M --state-slots 256 --hicache-ratio 0 4
        # without and with a host (L2) tier of 4x the device pools, side by side
    python -m bench replay --policy lru --page-size 16 --kv-events off on check
    python -m bench replay --model qwen3-next-80b --memory-gb 10 20 --state-fraction 0.2 unified
        # pools sized from bytes: a fixed split (lru, gds) beside one memory arena (unified)
        # KV events for routers: their cost (off vs on), and the page set a router rebuilds
        # from them checked against the tree's (0 disagreements expected)

Memory sizes accept ``16000000``, ``16e6``, ``16M`` or ``512K``. Several ``--kv-tokens`` /
``--state-slots`` values run every combination (a sweep). ``--model PRESET --memory-gb G
[G ...] --state-fraction F [F ...]`` sizes both pools from bytes instead (as ``python -m bench
simulate``, ``bench.engine.presets``): every budget with every split; ``F = unified`` is one
memory arena whose boundary moves at run time (:mod:`bench.engine.arena`, policy
``unified``, once per budget: ``--policy`` names the fixed splits' policies). ``--state-slots 0`` replays a
KV-only (pure attention) model. Progress goes to stderr (a bar on a terminal, a line every few
seconds elsewhere; none with ``--no-progress``); the table to stdout (to stderr when ``--json -`` takes stdout).
Peak RSS is each run's own high-water mark (the process's is reset when a run starts,
``bench.engine.metrics.reset_peak_rss``; where the kernel refuses, the table says "process").
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from bench.cli import (
    Progress,
    figure_path,
    new_parser,
    output_path,
    parse_count,
    positive_float,
    refuse_ignored,
    refuse_unified_policies,
    require_package,
    state_fraction,
    warn_page_split,
    write_json,
)
from bench.cli import positive as _positive
from bench.engine.presets import DEFAULT_STATE_FRACTION, PRESETS, UNIFIED
from bench.lora.options import add_lora_arguments
from bench.traces.loader import (
    TraceFormatError,
    resolve_trace_path,
    sniff_format,
    trace_label,
)
from bench.workloads import add_workload_arguments, check_source_options, workload_requests

if TYPE_CHECKING:
    from bench.engine.core import EngineConfig
    from bench.engine.floor import FloorResult
    from bench.report.tables import RunResult
    from bench.traces.loader import TraceRequest

# The parser imports no torch (``--help`` stays fast): the engine, the cache and the reports
# are imported where they run. ``tests/bench/test_bench_cli.py`` checks these two against the
# library's ``hicache.WRITE_POLICIES`` and ``radix.config.SWA_RELEASE_EXTRA_PAGES``.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SWA_RELEASE_EXTRA_PAGES = 0

__all__ = ["main", "parse_count", "replay_one"]

def _ratio(text: str) -> float:
    """A host-tier ratio: 0 (off) or a finite number (> 1, checked with the config)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a finite number > 1: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("replay", (
        "Replay a request trace through the hybrid prefix cache, one run per policy."))
    a = p.add_argument
    a("--trace", default=None, help="JSONL trace (default: the shipped Mooncake trace)")
    a("--trace-format", choices=("auto", "mooncake", "gmi", "tracelab"), default=None,
      help="the trace file's format (default auto: read off its first line)")
    add_workload_arguments(p)
    a("--torch-threads", type=_positive, default=1,
      help="torch intra-op threads (default 1: the replay's tensor ops are bookkeeping-sized;"
           " on a shared 2-core machine two threads made the whole replay 1.9x slower)")
    a("--mooncake-block-size", type=_positive, default=None,
      help="tokens per hash id of a Mooncake-format file (default 512)")
    a("--tracelab-block-size", type=_positive, default=None,
      help="block size recorded for TraceLab rounds [tokens] (default 1: token-exact)")
    a("--max-requests", type=_positive, default=None, help="replay only the first N requests")
    a("--policy", nargs="+", default=None,
      help="radix eviction policies (default: lru gds; unified when every --state-fraction "
           "is unified)")
    a("--kv-tokens", nargs="+", type=_positive, default=None,
      help="KV pool size(s) [tokens] (default 16M; not with --memory-gb)")
    a("--state-slots", nargs="+", type=parse_count, default=None,
      help="recurrent-state pool size(s) [slots]; 0 = KV-only model (default 512; not with "
           "--memory-gb)")
    a("--model", choices=sorted(PRESETS), default=None,
      help="model preset whose KV and state bytes size both pools from --memory-gb")
    a("--memory-gb", nargs="+", type=positive_float, default=None,
      help="cache memory budget(s) [GB = 1e9 bytes] (needs --model)")
    a("--state-fraction", nargs="+", type=state_fraction, default=None,
      help=f"share(s) of --memory-gb for states (default {DEFAULT_STATE_FRACTION}), or "
           f"{UNIFIED}: one memory arena for KV pages and states whose boundary moves at run "
           "time, evicting whichever costs the least recompute per byte")
    a("--page-size", type=_positive, default=1,
      help="tokens per KV page (default 1: exact token accounting; any divisor of the "
           "trace block keeps block boundaries page-aligned)")
    a("--chunk-size", type=_positive, default=8192, help="prefill chunk [tokens] (default 8192)")
    a("--concurrency", type=_positive, default=32, help="requests in flight (default 32)")
    a("--end-checkpoint", choices=("block", "exact"), default="block",
      help="state of a finished prompt at its last full trace block (default) or its last token")
    a("--json", metavar="FILE|-", type=output_path, default=None,
      help="also write results as JSON ('-': stdout)")
    a("--plot", metavar="FILE", type=figure_path, default=None,
      help="hit rate and state-miss vs memory, one line per policy (needs a sweep and matplotlib)")
    a("--policy-config", metavar="NAME=JSON", action="append", default=[],
      help="knobs of one policy, e.g. tlru='{\"threshold\": 8192}' (repeatable); tlru "
           f"defaults to {DEFAULT_POLICY_CONFIG['tlru']} here")
    a("--sliding-window", type=parse_count, default=0,
      help="SWA window [tokens] of a model with sliding-window layers (default 0: none)")
    a("--swa-tokens", type=parse_count, default=None,
      help="SWA pool size [tokens] with --sliding-window (default: kv-tokens / 4)")
    a("--swa-release-extra-pages", type=int, default=None,
      help="pages a request keeps live past the window when it releases out-of-window SWA KV "
           f"(default {SWA_RELEASE_EXTRA_PAGES}; 0 keeps exactly max(window, page); needs "
           "--sliding-window)")
    a("--hicache-ratio", nargs="+", type=_ratio, default=[0.0],
      help="host (L2) KV and state pools of R x the device pools (R > 1); 0 = no host tier "
           "(default); several values run side by side, e.g. 0 4")
    a("--hicache-write-policy", choices=WRITE_POLICIES, default=None,
      help="when a node is copied to host (default write_through; needs --hicache-ratio)")
    a("--kv-events", nargs="+", choices=("off", "on", "check"), default=["off"],
      help="KV events (BlockStored / BlockRemoved for routers): off (default); on = the "
           "cache records them and the replay takes them after every request; check = also "
           "rebuild the page set from them and compare it with the tree's; several values run "
           "side by side (off on: the events' cost)")
    a("--kv-events-check-every", type=parse_count, default=1000,
      help="with --kv-events check: compare the rebuilt page set with the tree's every N "
           "requests, and at the end (default 1000; 0 = at the end only)")
    a("--session-hint", action="store_true",
      help="pass each request's session (trace / workload session id) to the cache as the "
           "hint extra={'session_id': ...}, as an engine carrying a conversation id would")
    a("--floor", action="store_true",
      help="also replay each pool size through the minimal block-level engine "
           "(bench/engine/floor.py), twice before the runs and once after (the fastest counts), "
           "and print every run's CPU time as a multiple of it")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--wide", action="store_true",
      help="every run in one row block, however wide (default: blocks of at most 120 columns)")
    add_lora_arguments(p)
    return p


#: Knobs the replay passes when the command line gives none (tlru has no library default).
DEFAULT_POLICY_CONFIG: dict[str, dict[str, Any]] = {"tlru": {"threshold": 8192}}


def _policy_configs(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--policy-config NAME=JSON`` items over :data:`DEFAULT_POLICY_CONFIG`.

    Raises:
        ValueError: an item that is not ``NAME=JSON`` with a JSON object, or that names a
            policy neither in ``policies`` (``--policy``) nor among the defaults.
    """
    out = {k: dict(v) for k, v in DEFAULT_POLICY_CONFIG.items()}
    unused = sorted({item.partition("=")[0] for item in items} - set(policies) - set(out))
    if unused:
        raise ValueError(f"--policy-config names {unused}, not in --policy {' '.join(policies)}")
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--policy-config needs NAME=JSON, got {item!r}")
        try:
            knobs = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--policy-config {name}: invalid JSON ({exc})") from None
        if not isinstance(knobs, dict):
            raise ValueError(f"--policy-config {name}: expected a JSON object, got {text!r}")
        out[name] = knobs
    return out


def replay_one(
    trace: Sequence[TraceRequest], config: EngineConfig, progress: bool | None = None,
    check_every: int = 1000,
) -> RunResult:
    """Replay ``trace`` through a fresh cache built from ``config``; check the cache after.

    ``progress``: ``False`` none, else on stderr (:class:`bench.cli.Progress`).
    With ``config.kv_events`` the events are taken after every request; ``"check"`` also
    rebuilds the page set from them (``bench.engine.kv_events``) and compares it with the tree's
    every ``check_every`` requests (0: at the end only) and at the end.

    Raises:
        AssertionError (from ``sanity_check``) if the cache broke an invariant, or a lock
        survived the replay.
    """
    from bench.engine.arena import make_engine
    from bench.engine.kv_events import EventConsumer, EventCounter, disagreements, prompt_hashes
    from bench.engine.metrics import reset_peak_rss
    from bench.report.tables import RunResult

    per_run = reset_peak_rss()
    engine = make_engine(config)
    desc = f"{config.policy} kv={config.kv_tokens:,} slots={config.state_slots:,}"
    if config.hicache_ratio:
        desc += f" host={config.hicache_ratio:g}x"
    events = config.kv_events
    consumer = EventConsumer() if events == "check" else None
    counter = EventCounter()
    checks = bad = 0
    cache = engine.cache
    # the router's prediction of each request's hit from the events alone (check mode): device
    # KV pages held from the start, and of those the usable ones (up to a state checkpoint)
    hybrid = cache.state is not None
    ps = cache.page_size
    router = {"router_kv_tokens": 0, "router_usable_tokens": 0, "router_agreements": 0,
              "router_compared": 0}
    start = time.perf_counter()
    cpu0 = time.process_time()
    with Progress(len(trace), desc, "req", progress) as bar:
        for i, tr in enumerate(trace):
            if consumer is not None:
                held, usable = consumer.usable_prefix(prompt_hashes(tr.token_array, ps), hybrid)
                logged = len(engine.log)
            engine.admit(tr, rid=i)
            if consumer is not None and len(engine.log) > logged:
                router["router_kv_tokens"] += held * ps
                router["router_usable_tokens"] += usable * ps
                if cache.hicache is None:  # (a load-back would change the device set first)
                    router["router_compared"] += 1
                    router["router_agreements"] += usable * ps == engine.log.usable_len[-1]
            if events != "off":
                got = cache.take_events()
                counter.apply(got)
                if consumer is not None:
                    consumer.apply(got)
                    if check_every and (i + 1) % check_every == 0:
                        bad += disagreements(consumer, cache)
                        checks += 1
            bar.update()
        engine.drain()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    report: dict[str, Any] | None = None
    if events != "off":
        got = cache.take_events()
        counter.apply(got)
        report = counter.summary()
        if consumer is not None:
            consumer.apply(got)
            bad += disagreements(consumer, cache)
            checks += 1
            report = {**consumer.summary(), "checks": checks, "disagreements": bad, **router}
    return RunResult.of(engine, wall, per_run, cpu_s=cpu, kv_events=report)


#: Pool sizes without ``--kv-tokens`` / ``--state-slots`` (and without ``--memory-gb``).
DEFAULT_KV_TOKENS = 16_000_000
DEFAULT_STATE_SLOTS = 512


def _splits(args: argparse.Namespace) -> list[float | str]:
    return [DEFAULT_STATE_FRACTION] if args.state_fraction is None else list(args.state_fraction)


def _policies(args: argparse.Namespace) -> list[str]:
    """``--policy``, or its default: ``lru gds``, ``unified`` when every split is unified."""
    if args.policy is not None:
        return list(args.policy)
    by_memory = args.memory_gb is not None
    return [UNIFIED] if by_memory and all(f == UNIFIED for f in _splits(args)) else ["lru", "gds"]


def check_memory_options(args: argparse.Namespace) -> None:
    """The pool options that cannot go together (``ValueError`` naming the option):
    ``--memory-gb`` without ``--model`` or with ``--kv-tokens`` / ``--state-slots``; a
    ``unified`` split with a sliding window, a host tier or LoRA adapters; ``--policy`` other
    than ``unified`` when every split is unified, ``unified`` when one is not."""
    if args.memory_gb is None:
        refuse_unified_policies([], args.policy)
        return
    if args.model is None:
        raise ValueError("--memory-gb needs --model PRESET (whose bytes size the pools)")
    given = [o for o, v in (("--kv-tokens", args.kv_tokens), ("--state-slots", args.state_slots))
             if v is not None]
    if given:
        raise ValueError(f"--memory-gb sizes both pools from --model's bytes: {', '.join(given)} "
                         "would be ignored (give one or the other)")
    if UNIFIED in _splits(args):
        for option, on in (("--sliding-window", bool(args.sliding_window)),
                           ("--hicache-ratio", any(args.hicache_ratio)),
                           ("--adapters", bool(getattr(args, "adapters", None)))):
            if on:
                raise ValueError(f"{option}: --state-fraction {UNIFIED} has no such pool (one "
                                 "arena of KV pages and states); drop one of them")
    refuse_unified_policies(_splits(args), args.policy)


def _pool_sizes(args: argparse.Namespace
                ) -> list[tuple[dict[str, Any], float | None, float | str | None]]:
    """Each pool size to replay: the ``EngineConfig`` pool fields, the budget [GB] and split
    they come from (``None`` without ``--memory-gb``)."""
    if args.memory_gb is None:
        kvs = [DEFAULT_KV_TOKENS] if args.kv_tokens is None else args.kv_tokens
        slots = [DEFAULT_STATE_SLOTS] if args.state_slots is None else args.state_slots
        return [({"kv_tokens": kv, "state_slots": s}, None, None)
                for kv, s in itertools.product(kvs, slots)]
    from bench.engine.presets import engine_sizes, get_preset

    preset = get_preset(args.model)
    return [(engine_sizes(preset, gb, f, args.page_size), gb, f)
            for gb, f in itertools.product(args.memory_gb, _splits(args))]


def _plan(args: argparse.Namespace, knobs: dict[str, dict[str, Any]] | None = None
          ) -> list[tuple[EngineConfig, float | None, float | str | None]]:
    """Every (config, budget [GB], split) to replay, validated before any run starts: every
    pool size with every policy, host ratio and events mode (a unified arena with its one
    policy); ``knobs``: the parsed ``--policy-config`` (parsed here when not given).

    Raises:
        ValueError / TypeError: as :func:`check_memory_options`, a bad policy name or knob, a
            budget too small for a split.
    """
    from bench.engine.core import EngineConfig
    from radix import CacheConfig

    check_memory_options(args)
    policies = _policies(args)
    if knobs is None:
        knobs = _policy_configs(args.policy_config, policies)
    out = []
    for sizes, gb, split in _pool_sizes(args):
        for policy, host_ratio, events in itertools.product(
            [sizes["policy"]] if "policy" in sizes else policies, args.hicache_ratio,
            args.kv_events
        ):
            # fails on a bad name or knob before anything runs
            try:
                CacheConfig(page_size=args.page_size, radix_eviction_policy=policy)
            except ValueError as exc:
                raise ValueError(f"--policy: {exc}") from None
            try:
                CacheConfig(page_size=args.page_size, radix_eviction_policy=policy,
                            radix_eviction_policy_config=knobs.get(policy))
            except ValueError as exc:
                raise ValueError(f"--policy-config {policy}: {exc}") from None
            swa_tokens = 0
            if args.sliding_window:
                swa_tokens = (args.swa_tokens if args.swa_tokens is not None
                              else sizes["kv_tokens"] // 4)
            fields = {**sizes, "policy": policy}
            out.append((EngineConfig(
                **fields,
                policy_config=knobs.get(policy),
                page_size=args.page_size,
                chunk_size=args.chunk_size,
                concurrency=args.concurrency,
                end_checkpoint=args.end_checkpoint,
                sliding_window=args.sliding_window,
                swa_release_extra_pages=(SWA_RELEASE_EXTRA_PAGES
                                         if args.swa_release_extra_pages is None
                                         else args.swa_release_extra_pages),
                swa_tokens=swa_tokens,
                hicache_ratio=host_ratio,
                hicache_write_policy=args.hicache_write_policy or "write_through",
                kv_events=events,
                session_hint=args.session_hint,
            ), gb, split))
    return out


def _configs(args: argparse.Namespace,
             knobs: dict[str, dict[str, Any]] | None = None) -> list[EngineConfig]:
    """The configs of :func:`_plan`."""
    return [c for c, _, _ in _plan(args, knobs)]


#: Floor runs by pool size: (KV tokens, state slots) -> the fastest run so far.
Floors = dict[tuple[int, int], "FloorResult"]


def floor_runs(trace: Sequence[TraceRequest], configs: Sequence[EngineConfig], chunk_size: int,
               concurrency: int, best: Floors | None = None) -> Floors:
    """One floor replay (:func:`bench.engine.floor.floor_replay`) per distinct pool size of
    ``configs``, in their order; where ``best`` has a faster run of a size, that one."""
    from bench.engine.floor import floor_replay

    out: Floors = {}
    for size in dict.fromkeys((c.kv_tokens, c.state_slots) for c in configs):
        f = floor_replay(trace, *size, chunk_size, concurrency)
        out[size] = f if best is None or f.cpu_s < best[size].cpu_s else best[size]
    return out


def render_floor(runs: Sequence[RunResult], floors: Floors) -> str:
    """The replay's distance to its floor: each run's CPU time over the floor's at its pool
    size, with both token hit rates (close when both served the same requests alike)."""
    lines = ["", "speed floor (bench/engine/floor.py: the same engine over a minimal block-level "
             "cache, LRU; CPU time, time.process_time):"]
    for (kv, s), f in floors.items():
        lines.append(f"  kv={kv:,} slots={s:,}: floor {f.cpu_s:.2f} s CPU, token hit "
                     f"{f.token_hit_rate:.4f}")
    for r in runs:
        f = floors[r.config.kv_tokens, r.config.state_slots]
        lines.append(f"  {r.config.policy:>12} kv={r.config.kv_tokens:,} "
                     f"slots={r.config.state_slots:,}: {r.cpu_s:.2f} s CPU = "
                     f"{r.cpu_s / f.cpu_s:.2f}x the floor (token hit "
                     f"{r.metrics.token_hit_rate:.4f})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad arguments or trace)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_source_options(parser, args)
    refuse_ignored(parser, (
        ("--swa-tokens", args.swa_tokens, "--sliding-window", bool(args.sliding_window)),
        ("--swa-release-extra-pages", args.swa_release_extra_pages, "--sliding-window",
         bool(args.sliding_window)),
        ("--hicache-write-policy", args.hicache_write_policy, "--hicache-ratio",
         any(args.hicache_ratio)),
        ("--model", args.model, "--memory-gb", args.memory_gb is not None),
        ("--state-fraction", args.state_fraction, "--memory-gb", args.memory_gb is not None)))
    if args.plot is not None:
        require_package(parser, "matplotlib", "--plot", "plot")
    try:  # what can be checked without torch, first
        path = None if args.workload is not None else resolve_trace_path(args.trace)
        knobs = _policy_configs(args.policy_config, _policies(args))
        check_memory_options(args)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    import torch

    from bench.engine.bounds import compute_bounds
    from bench.lora.replay import lora_replay_configs, run_lora_replays
    from bench.report.plot import sweep_axis_of, write_plot
    from bench.report.tables import TraceInfo, render_table, to_json_dict
    from bench.traces.loader import load_trace

    torch.set_num_threads(args.torch_threads)
    try:
        plan = _plan(args, knobs)
        configs = [c for c, _, _ in plan]
        loras = lora_replay_configs(args)  # None unless --adapters N
        source: str
        if args.workload is not None:
            trace = workload_requests(args.workload, args.workload_seed, args.max_requests,
                                      args.trace)
            source, fmt = f"workload {args.workload} (seed {args.workload_seed})", "generated"
        else:
            assert path is not None
            fmt = sniff_format(path) if args.trace_format == "auto" else args.trace_format
            trace = load_trace(
                path,
                fmt=fmt,
                max_requests=args.max_requests,
                mooncake_block_size=args.mooncake_block_size,
                tracelab_block_size=args.tracelab_block_size,
            )
            source = trace_label(path)
    except (FileNotFoundError, TraceFormatError, ValueError, TypeError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if not trace:
        parser.exit(2, f"{parser.prog}: error: no requests in {source}\n")
    warn_page_split(parser.prog, args.page_size, trace[0].block_size)
    if args.plot is not None:
        try:
            sweep_axis_of(configs)
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    info = TraceInfo(
        source, fmt, len(trace), sum(r.input_length for r in trace), trace[0].block_size
    )
    bounds = compute_bounds(trace, exclude_last_token=True, page_size=args.page_size)
    notes_bounds = compute_bounds(trace)
    progress = False if args.no_progress else None
    if loras is not None:
        return run_lora_replays(
            trace, configs, loras, info, bounds, notes_bounds, args.json, progress
        )
    # the floor's CPU time moves with the heap it runs on (first touch of fresh memory, the
    # cyclic GC over what else is alive: 4.6-7.6 s for one run here), so it runs twice before
    # the replays (the first also warms the heap they run on) and once after, the fastest
    # counted: the ratio must not gain from a slow floor
    floors: Floors = {}
    if args.floor:
        floors = floor_runs(trace, configs, args.chunk_size, args.concurrency)
        floors = floor_runs(trace, configs, args.chunk_size, args.concurrency, floors)
    runs = []
    for config, gb, split in plan:
        gc.collect()
        runs.append(replace(replay_one(trace, config, progress, args.kv_events_check_every),
                            memory_gb=gb, split=split))
    if floors:
        floors = floor_runs(trace, configs, args.chunk_size, args.concurrency, floors)
    for r in runs:
        if r.metrics.skipped_requests and not r.metrics.requests:
            print(f"{parser.prog}: warning: {r.config.policy} kv={r.config.kv_tokens:,}: every "
                  "request was skipped (the pools cannot hold one request and its output)",
                  file=sys.stderr)
    table_out: TextIO = sys.stderr if args.json == "-" else sys.stdout
    print(render_table(info, runs, bounds, notes_bounds, args.wide), file=table_out)
    if floors:
        print(render_floor(runs, floors), file=table_out)
    if args.json is not None:
        out = to_json_dict(info, runs, bounds, notes_bounds)
        if floors:
            out["floor"] = [{"kv_tokens": kv, "state_slots": s, "cpu_s": f.cpu_s,
                             "token_hit_rate": f.token_hit_rate} for (kv, s), f in floors.items()]
        write_json(args.json, out)
    if args.plot is not None:
        sizes = ", ".join(f"{a.replace('_', ' ')} "
                          f"{', '.join(f'{v:,}' for v in dict.fromkeys(getattr(c, a) for c in configs))}"
                          for a in ("kv_tokens", "state_slots"))
        write_plot(args.plot, runs, bounds,
                   f"{info.path}: {info.requests:,} requests; {sizes}; "
                   f"concurrency {args.concurrency}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
