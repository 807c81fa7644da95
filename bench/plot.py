"""``--plot FILE``: token hit rate and state-miss tokens vs memory, one line per policy.

Needs matplotlib (the project's ``plot`` extra); it is imported only when a plot is asked
for. A plot needs a sweep over exactly one memory axis: several ``--kv-tokens`` values or
several ``--state-slots`` values (not both).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.bounds import Bounds
from bench.engine import EngineConfig
from bench.report import RunResult

__all__ = ["sweep_axis_of", "write_plot"]


def sweep_axis_of(configs: Sequence[EngineConfig]) -> str:
    """``"kv_tokens"`` or ``"state_slots"``: the one memory size that varies across configs.

    Raises:
        ValueError: no memory size varies, or both do.
    """
    varying = [a for a in ("kv_tokens", "state_slots") if len({getattr(c, a) for c in configs}) > 1]
    if len(varying) != 1:
        raise ValueError(
            "--plot needs a sweep over exactly one memory axis: give several --kv-tokens values "
            "or several --state-slots values (not both)"
        )
    return varying[0]


def write_plot(path: str | Path, runs: Sequence[RunResult], bounds: Bounds) -> None:
    """Write a two-panel figure (format from the file suffix, e.g. ``.png``, ``.svg``).

    Left: token hit rate vs memory, with the infinite-memory bounds as dashed lines.
    Right: mean state-miss tokens per request vs memory.

    Raises:
        ValueError: see :func:`sweep_axis_of`.
        RuntimeError: matplotlib is not installed.
    """
    axis = sweep_axis_of([r.config for r in runs])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'hybrid-prefix-cache[plot]' (or matplotlib)"
        ) from None
    fig, (hit_ax, miss_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(r.config.policy for r in runs):
        mine = sorted(
            (r for r in runs if r.config.policy == policy), key=lambda r: getattr(r.config, axis)
        )
        xs = [getattr(r.config, axis) for r in mine]
        hit_ax.plot(xs, [r.metrics.token_hit_rate for r in mine], marker="o", label=policy)
        miss_ax.plot(xs, [r.metrics.state_miss_tokens.mean for r in mine], marker="o", label=policy)
    hit_ax.axhline(
        bounds.every_block_hit_rate, linestyle="--", color="grey", label="bound: every block"
    )
    hit_ax.axhline(
        bounds.sparse_hit_rate, linestyle=":", color="grey", label="bound: sparse checkpoints"
    )
    label = "KV pool [tokens]" if axis == "kv_tokens" else "state pool [slots]"
    ticks = sorted({getattr(r.config, axis) for r in runs})
    for ax, title in ((hit_ax, "token hit rate"), (miss_ax, "state-miss tokens / request (mean)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
