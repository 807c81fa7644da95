"""Rendering of replay results: an aligned plain-text table for people, a dict for ``--json``.

One column per run (policy x memory size), one row per metric, so policies read side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.cli import TABLE_WIDTH, column_blocks
from bench.engine.bounds import Bounds
from bench.engine.core import EngineConfig, EngineCounters, ReplayEngine
from bench.engine.metrics import ReplayMetrics, peak_rss_mib, summarize

__all__ = ["RunResult", "TraceInfo", "render_table", "to_json_dict"]

END_CHECKPOINT_NOTE = {
    "block": "block (a finished prompt's state sits at its last full trace block; the partial tail is not kept)",
    "exact": "exact (a finished prompt's state sits at its last token)",
}


@dataclass(frozen=True, slots=True)
class TraceInfo:
    """What was replayed."""

    path: str
    fmt: str
    requests: int
    prompt_tokens: int
    block_size: int


@dataclass(frozen=True, slots=True)
class RunResult:
    """One replay: its configuration, token metrics, engine counters and costs."""

    config: EngineConfig
    metrics: ReplayMetrics
    counters: EngineCounters
    wall_s: float
    peak_rss_mib: float
    cache_stats: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0
    kv_events: dict[str, Any] | None = None
    peak_rss_of_run: bool = False
    """``peak_rss_mib`` is this run's own peak (``False``: the process's so far)."""
    memory_gb: float | None = None
    """The byte budget the pools were sized from (``--memory-gb``), or ``None``."""
    split: float | str | None = None
    """Its split: the states' fraction, or ``"unified"`` (one arena, ``config.arena``)."""

    @classmethod
    def of(cls, engine: ReplayEngine, wall_s: float, peak_rss_of_run: bool,
           **extra: Any) -> RunResult:
        """The result of the replay ``engine`` has just run: its config, log and counters,
        ``wall_s`` and the peak RSS now (``peak_rss_of_run``: the mark was reset when the run
        started), after checking the cache (``extra``: ``cpu_s``, ``kv_events``).

        Raises:
            AssertionError: the cache broke an invariant, or a lock survived the replay.
        """
        engine.cache.sanity_check()
        if engine.cache.protected_size():
            raise AssertionError(
                f"{engine.cache.protected_size()} KV tokens still locked after the replay")
        return cls(config=engine.config, metrics=summarize(engine.log),
                   counters=engine.counters, wall_s=wall_s, peak_rss_mib=peak_rss_mib(),
                   peak_rss_of_run=peak_rss_of_run, cache_stats=engine.cache.stats(), **extra)

    @property
    def label(self) -> str:
        ratio = self.config.hicache_ratio
        out = f"{self.config.policy} host {ratio:g}x" if ratio else self.config.policy
        if self.config.kv_events != "off":
            out += f" events{'+check' if self.config.kv_events == 'check' else ''}"
        return out


def _fmt_int(x: float) -> str:
    return f"{int(round(x)):,}"


def _host_stat(r: RunResult, name: str) -> int:
    """A host-tier counter of the run's cache (tokens; 0 without a host tier)."""
    return int(r.cache_stats.get(name, 0))


def _rows(runs: Sequence[RunResult]) -> list[tuple[str, list[str]]]:
    def col(f: Any) -> list[str]:
        return [f(r) for r in runs]

    def memory(r: RunResult) -> str:
        if r.memory_gb is None:
            return "-"
        return f"{r.memory_gb:g} / " + (r.split if isinstance(r.split, str) else f"{r.split:.4g}")

    budget = ([("memory GB / split", col(memory))] if any(r.memory_gb is not None for r in runs)
              else [])
    return [
        *budget,
        (
            "KV tokens / state slots",
            col(lambda r: f"{r.config.kv_tokens:,} / {r.config.state_slots:,}"),
        ),
        ("token hit rate", col(lambda r: f"{r.metrics.token_hit_rate:.4f}")),
        ("KV hit rate", col(lambda r: f"{r.metrics.kv_hit_rate:.4f}")),
        ("state-miss tok/req mean", col(lambda r: f"{r.metrics.state_miss_tokens.mean:,.1f}")),
        (
            "  p50 / p90",
            col(
                lambda r: (
                    f"{_fmt_int(r.metrics.state_miss_tokens.p50)} / {_fmt_int(r.metrics.state_miss_tokens.p90)}"
                )
            ),
        ),
        ("uncached tok/req mean", col(lambda r: f"{r.metrics.uncached_tokens.mean:,.1f}")),
        (
            "  p50 / p90",
            col(
                lambda r: (
                    f"{_fmt_int(r.metrics.uncached_tokens.p50)} / {_fmt_int(r.metrics.uncached_tokens.p90)}"
                )
            ),
        ),
        ("prefill s/req mean", col(lambda r: f"{r.metrics.prefill_cost.mean:.4f}")),
        ("  p90", col(lambda r: f"{r.metrics.prefill_cost.p90:.4f}")),
        ("evicted KV tokens", col(lambda r: _fmt_int(r.counters.evicted_kv_tokens))),
        ("evicted states", col(lambda r: _fmt_int(r.counters.evicted_states))),
        *(
            [
                ("SWA-miss tok/req mean", col(lambda r: f"{r.metrics.swa_miss_tokens.mean:,.1f}")),
                ("evicted SWA tokens", col(lambda r: _fmt_int(r.counters.evicted_swa_tokens))),
            ]
            if any(r.config.sliding_window for r in runs)
            else []
        ),
        *(
            [
                ("host hit tokens", col(lambda r: _fmt_int(_host_stat(r, "host_hit_tokens")))),
                ("load-back tokens", col(lambda r: _fmt_int(_host_stat(r, "load_back_tokens")))),
                ("backup tokens", col(lambda r: _fmt_int(_host_stat(r, "backup_tokens")))),
            ]
            if any(r.config.hicache_ratio for r in runs)
            else []
        ),
        (
            "checkpoints (skipped)",
            col(lambda r: f"{r.counters.checkpoints:,} ({r.counters.skipped_checkpoints:,})"),
        ),
        (
            "requests (skipped)",
            col(lambda r: f"{r.metrics.requests:,} ({r.metrics.skipped_requests:,})"),
        ),
        ("wall time s", col(lambda r: f"{r.wall_s:.1f}")),
        ("CPU time s", col(lambda r: f"{r.cpu_s:.1f}")),
        (f"peak RSS MiB ({'run' if all(r.peak_rss_of_run for r in runs) else 'process'})",
         col(lambda r: f"{r.peak_rss_mib:,.0f}")),
    ]


def render_table(
    trace: TraceInfo, runs: Sequence[RunResult], bounds: Bounds, notes_bounds: Bounds,
    wide: bool = False,
) -> str:
    """The stdout report: header lines, the metric table, the bounds. The table fits
    :data:`bench.cli.TABLE_WIDTH` columns (the runs in blocks of rows) unless ``wide``."""
    if not runs:
        raise ValueError("no runs to report")
    cfg = runs[0].config
    lines = [
        f"trace: {trace.path} ({trace.fmt}, {trace.requests:,} requests, "
        f"{trace.prompt_tokens:,} prompt tokens, block {trace.block_size})",
        f"engine: page {cfg.page_size}, chunk {cfg.chunk_size:,}, concurrency {cfg.concurrency}"
        + (f", sliding window {cfg.sliding_window:,} (SWA pool {cfg.swa_tokens:,} tokens)"
           if cfg.sliding_window else ""),
        f"end checkpoint: {END_CHECKPOINT_NOTE[cfg.end_checkpoint]}",
        *(
            [f"host tier: {cfg.hicache_write_policy}; host hit = tokens a match found on host "
             "only; load-back / backup = tokens copied host -> device / device -> host"]
            if any(r.config.hicache_ratio for r in runs)
            else []
        ),
        "",
    ]
    rows = _rows(runs)
    header = ("metric", [r.label for r in runs])
    w0 = max(len(header[0]), *(len(name) for name, _ in rows))
    widths = [max(len(header[1][i]), *(len(vals[i]) for _, vals in rows)) for i in range(len(runs))]
    for k, block in enumerate(column_blocks(w0, widths, None if wide else TABLE_WIDTH)):
        if k:
            lines.append("")
        for name, vals in [header, *rows]:
            cells = "  ".join(vals[i].rjust(widths[i]) for i in block)
            lines.append(f"{name.ljust(w0)}  {cells}")
    lines += [
        "",
        f"infinite-memory bounds (replay convention: match prompt[:-1], page {bounds.page_size}): "
        f"every block {bounds.every_block_hit_rate:.4f}, sparse checkpoints {bounds.sparse_hit_rate:.4f}",
        f"  (trace notes' convention, whole prompt: every block {notes_bounds.every_block_hit_rate:.4f}, "
        f"sparse {notes_bounds.sparse_hit_rate:.4f})",
        "token hit = usable matched / prompt tokens; state-miss = KV-matched - usable [tokens]",
        "prefill s = d*(L-U) + e*(L^2-U^2)/2e5 (seconds of the GLM prefill fit; U usable of L)",
    ]
    for r in runs:
        ev = r.kv_events
        if ev is not None:
            line = (f"kv events ({r.label}): {ev['events']:,} events, {ev['pages_stored']:,} pages "
                    f"stored, {ev['pages_removed']:,} removed, {ev['all_cleared']} cleared")
            if "checks" in ev:
                line += (f"; rebuilt page set checked {ev['checks']}x against the tree "
                         f"({ev['pages_held']:,} pages at the end): {ev['disagreements']} "
                         f"disagreements, {ev['redundant_events']} redundant events")
            if "router_usable_tokens" in ev:
                line += (f"; a router predicts {ev['router_kv_tokens']:,} KV-hit tokens, "
                         f"{ev['router_usable_tokens']:,} usable (state group)")
                if ev["router_compared"]:
                    line += (f", equal to the cache's usable hit on {ev['router_agreements']:,} "
                             f"of {ev['router_compared']:,} requests")
            lines.append(line)
    return "\n".join(lines)


def to_json_dict(
    trace: TraceInfo, runs: Sequence[RunResult], bounds: Bounds, notes_bounds: Bounds
) -> dict[str, Any]:
    """Everything in :func:`render_table`, as plain JSON values."""
    cfg = runs[0].config if runs else None
    return {
        "trace": {
            "path": trace.path,
            "format": trace.fmt,
            "requests": trace.requests,
            "prompt_tokens": trace.prompt_tokens,
            "block_size": trace.block_size,
        },
        "engine": None
        if cfg is None
        else {
            "page_size": cfg.page_size,
            "chunk_size": cfg.chunk_size,
            "concurrency": cfg.concurrency,
            "end_checkpoint": cfg.end_checkpoint,
        },
        "bounds": bounds.as_dict(),
        "bounds_trace_notes_convention": notes_bounds.as_dict(),
        "runs": [
            {
                "policy": r.config.policy,
                "policy_config": r.config.policy_config,
                "memory_gb": r.memory_gb,
                "split": r.split,
                "kv_tokens": r.config.kv_tokens,
                "state_slots": r.config.state_slots,
                "hicache_ratio": r.config.hicache_ratio,
                "hicache_write_policy": (
                    r.config.hicache_write_policy if r.config.hicache_ratio else None
                ),
                "host_hit_tokens": _host_stat(r, "host_hit_tokens"),
                "load_back_tokens": _host_stat(r, "load_back_tokens"),
                "backup_tokens": _host_stat(r, "backup_tokens"),
                **r.metrics.as_dict(),
                "evicted_kv_tokens": r.counters.evicted_kv_tokens,
                "evicted_states": r.counters.evicted_states,
                "evicted_swa_tokens": r.counters.evicted_swa_tokens,
                "checkpoints": r.counters.checkpoints,
                "skipped_checkpoints": r.counters.skipped_checkpoints,
                "forced_finishes": r.counters.forced_finishes,
                "wall_s": r.wall_s,
                "peak_rss_mib": r.peak_rss_mib,
                "peak_rss_of_run": r.peak_rss_of_run,
                "cpu_s": r.cpu_s,
                "kv_events_mode": r.config.kv_events,
                "kv_events": r.kv_events,
                "cache_stats": r.cache_stats,
            }
            for r in runs
        ],
    }
