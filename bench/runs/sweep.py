"""Sweeps of the simulator: ``--sweep AXIS=V1,V2,...``, parallel runs, CSV, plot and table.

Axes (one per sweep)::

    kv-tokens=1M,4M,16M          KV pool [tokens]
    state-slots=64,128,...,2048  state pool [slots]
    concurrency=16,24,32,40,64   max running requests (and clients with closed arrivals)
    memory-gb=20,40,80           total cache memory [GB], split by --model / --state-fraction
    state-fraction=0.1,0.2,0.4   share of --memory-gb given to states (with --model)

Every (value, policy) pair is one run; runs go to a pool of worker processes (``fork``: the
trace and the offline next-use index are shared, not pickled) and come back in a fixed order.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cli import Progress
from bench.engine.bounds import Bounds

if TYPE_CHECKING:  # the axis parsing imports no torch (``--help``); runs import it
    from bench.engine.simulator import SimConfig, SimResult
    from bench.traces.loader import TraceRequest

__all__ = [
    "AXES",
    "fmt_value",
    "CSV_FIELDS",
    "Sweep",
    "csv_row",
    "parse_sweep",
    "run_all",
    "write_csv",
    "write_sweep_plot",
]

AXES = ("kv-tokens", "state-slots", "concurrency", "memory-gb", "state-fraction")
_INT_AXES = {"kv-tokens": 1, "state-slots": 0, "concurrency": 1}  # axis -> minimum
_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}


@dataclass(frozen=True, slots=True)
class Sweep:
    """One swept axis and its values, in the order given."""

    axis: str
    values: tuple[float, ...]

    @property
    def field(self) -> str:
        """The config field the axis sets (``kv_tokens``, ..., ``state_fraction``)."""
        return self.axis.replace("-", "_")

    @property
    def needs_model(self) -> bool:
        return self.axis in ("memory-gb", "state-fraction")


def _number(text: str, axis: str) -> float:
    s = text.strip().upper().replace("_", "")
    scale = 1
    if s and s[-1] in _SUFFIX and axis in _INT_AXES:
        scale, s = _SUFFIX[s[-1]], s[:-1]
    try:
        return float(s) * scale
    except ValueError:
        raise ValueError(f"--sweep {axis}: not a number: {text!r}") from None


def parse_sweep(text: str) -> Sweep:
    """``"state-slots=64,128,256"`` -> ``Sweep("state-slots", (64, 128, 256))``.

    Counts accept ``16M`` / ``512K`` / ``16e6``. Raises ``ValueError`` naming the problem: an
    unknown axis (the message lists them), no values, a repeated value, a count that is not a
    whole number at or above its minimum, ``memory-gb <= 0``, a state fraction outside [0, 1).
    """
    axis, sep, rest = text.partition("=")
    axis = axis.strip()
    if not sep or axis not in AXES:
        raise ValueError(f"--sweep needs AXIS=V1,V2,... with AXIS one of {', '.join(AXES)}; "
                         f"got {text!r}")
    items = [v for v in rest.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--sweep {axis}: no values")
    values = tuple(_number(v, axis) for v in items)
    if len(set(values)) != len(values):
        raise ValueError(f"--sweep {axis}: repeated value in {rest!r}")
    for v in values:
        if axis in _INT_AXES:
            if v != int(v) or v < _INT_AXES[axis]:
                raise ValueError(f"--sweep {axis}: {v:g} is not a whole number >= {_INT_AXES[axis]}")
        elif axis == "memory-gb" and not v > 0:
            raise ValueError(f"--sweep memory-gb: {v:g} must be > 0")
        elif axis == "state-fraction" and not 0 <= v < 1:
            raise ValueError(f"--sweep state-fraction: {v:g} must be in [0, 1)")
    if axis in _INT_AXES:
        values = tuple(int(v) for v in values)
    return Sweep(axis, values)


def sweep_arg(text: str) -> Sweep:
    """:func:`parse_sweep` as an ``argparse`` type: its message, not argparse's generic one."""
    try:
        return parse_sweep(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fmt_value(v: float) -> str:
    """A swept value for tables and ticks: ``16M``, ``512K``, ``2,048``, ``0.25``."""
    if float(v).is_integer():
        n = int(v)
        if n >= 100_000 and n % 1_000_000 == 0:
            return f"{n // 1_000_000}M"
        if n >= 100_000 and n % 1_000 == 0:
            return f"{n // 1_000}K"
        return f"{n:,}"
    return f"{v:g}"


# ------------------------------------------------------------------- parallel runs
_SHARED: dict[str, Any] = {}


def _init_worker() -> None:
    """One intra-op thread per worker: the cache's tensor ops are tiny, and the workers
    already take the cores."""
    import torch

    torch.set_num_threads(1)


def _worker(cfg: SimConfig) -> SimResult:
    from bench.engine.simulator import run_policy

    return run_policy(_SHARED["trace"], cfg, next_use=_SHARED.get("next_use"))


def run_all(trace: Sequence[TraceRequest], configs: Sequence[SimConfig], jobs: int = 1,
            progress: bool | None = None) -> list[SimResult]:
    """Run every config (in ``jobs`` processes when > 1); results in the order of ``configs``.

    The offline next-use index is built once when any config runs ``belady``.
    """
    from bench.policies.strategies import NextUseIndex

    importlib.import_module("bench.engine.simulator")  # loaded once, before the workers fork
    if any(c.policy in ("belady", "belady_next", "belady_state") for c in configs):
        _SHARED["next_use"] = NextUseIndex(trace, configs[0].engine.page_size)
    else:
        _SHARED.pop("next_use", None)
    _SHARED["trace"] = trace
    bar = Progress(len(configs), "runs", "run", progress)
    try:
        if jobs <= 1 or len(configs) == 1:
            out = []
            for cfg in configs:
                out.append(_worker(cfg))
                bar.update()
            return out
        ctx = mp.get_context("fork")
        results: list[SimResult | None] = [None] * len(configs)
        with ctx.Pool(min(jobs, len(configs)), initializer=_init_worker) as pool:
            order = _heaviest_first(configs)
            for k, res in pool.imap_unordered(_indexed, [(i, configs[i]) for i in order]):
                results[k] = res
                bar.update()
        return [r for r in results if r is not None]
    finally:
        bar.close()
        _SHARED.clear()


def _indexed(item: tuple[int, SimConfig]) -> tuple[int, SimResult]:
    return item[0], _worker(item[1])


def _heaviest_first(configs: Sequence[SimConfig]) -> list[int]:
    """Marconi runs (grid search) first, so the pool does not end on one long run."""
    return sorted(range(len(configs)), key=lambda i: configs[i].policy != "marconi")


# ------------------------------------------------------------------- CSV and plot
CSV_FIELDS = (
    "policy", "axis", "value", "kv_tokens", "state_slots", "concurrency", "requests",
    "skipped", "token_hit_rate", "kv_hit_rate", "state_miss_mean", "state_miss_p90",
    "uncached_mean", "prefill_cost_mean", "ttft_p50", "ttft_p90", "ttft_p99", "queue_mean",
    "queue_p90", "requests_per_s", "output_tokens_per_min_per_gpu", "evicted_kv_tokens",
    "evicted_states", "marconi_alpha", "wall_s",
)


def csv_row(r: SimResult, sweep: Sweep | None, value: float | None) -> dict[str, Any]:
    """One CSV row (``CSV_FIELDS``) for a result."""
    m, t, e = r.metrics, r.timing, r.config.engine
    return {
        "policy": r.label, "axis": sweep.axis if sweep else "", "value": "" if value is None else value,
        "kv_tokens": e.kv_tokens, "state_slots": e.state_slots, "concurrency": e.concurrency,
        "requests": m.requests, "skipped": m.skipped_requests,
        "token_hit_rate": round(m.token_hit_rate, 6), "kv_hit_rate": round(m.kv_hit_rate, 6),
        "state_miss_mean": round(m.state_miss_tokens.mean, 2),
        "state_miss_p90": round(m.state_miss_tokens.p90, 2),
        "uncached_mean": round(m.uncached_tokens.mean, 1),
        "prefill_cost_mean": round(m.prefill_cost.mean, 6),
        "ttft_p50": round(t.ttft_p50, 4), "ttft_p90": round(t.ttft_p90, 4),
        "ttft_p99": round(t.ttft_p99, 4), "queue_mean": round(t.queue_mean, 4),
        "queue_p90": round(t.queue_p90, 4), "requests_per_s": round(t.requests_per_s, 4),
        "output_tokens_per_min_per_gpu": round(t.output_tokens_per_min_per_gpu, 1),
        "evicted_kv_tokens": r.counters.evicted_kv_tokens,
        "evicted_states": r.counters.evicted_states,
        "marconi_alpha": "" if r.tuning is None else r.tuning.alpha,
        "wall_s": round(r.wall_s, 1),
    }


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)


def write_sweep_plot(path: str | Path, results: Sequence[SimResult], sweep: Sweep,
                     values: Sequence[float], bounds: Bounds, title: str = "") -> None:
    """Three panels against the swept value, one line per policy: token hit rate (with the
    infinite-memory bounds), mean state-miss tokens per request, p90 TTFT.

    ``values[i]`` is the swept value of ``results[i]``. Raises ``RuntimeError`` without
    matplotlib (the project's ``plot`` extra).
    """
    from bench.report.plot import legend_below, policy_style, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("token hit rate", lambda r: r.metrics.token_hit_rate),
        ("state-miss tokens / request (mean)", lambda r: r.metrics.state_miss_tokens.mean),
        ("p90 TTFT [s]", lambda r: r.timing.ttft_p90),
    )
    for policy in dict.fromkeys(r.label for r in results):
        pts = sorted((v, r) for v, r in zip(values, results, strict=True) if r.label == policy)
        style = policy_style(policy)
        label = "belady (offline reference)" if policy == "belady" else policy
        for ax, (_, get) in zip(axes, panels, strict=True):
            ax.plot([v for v, _ in pts], [get(r) for _, r in pts], label=label, **style)
    axes[0].axhline(bounds.every_block_hit_rate, color="grey", linestyle="--", lw=1,
                    label="bound: every block")
    axes[0].axhline(bounds.sparse_hit_rate, color="grey", linestyle=":", lw=1,
                    label="bound: sparse checkpoints")
    ticks = sorted(set(values))
    log = ticks[0] > 0 and ticks[-1] / ticks[0] >= 8
    for ax, (name, _) in zip(axes, panels, strict=True):
        if log:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(ticks, [fmt_value(t) for t in ticks])
        ax.set_xlabel(sweep.axis)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    legend_below(fig, axes, title)
    fig.savefig(path, dpi=90)
    plt.close(fig)
