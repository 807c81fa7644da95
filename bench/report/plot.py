"""``--plot FILE``: token hit rate and state-miss tokens vs memory, one line per policy.

Needs matplotlib (the project's ``plot`` extra); it is imported only when a plot is asked
for. A plot needs a sweep over exactly one memory axis: several ``--kv-tokens`` values or
several ``--state-slots`` values (not both).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engine.bounds import Bounds
from bench.engine.core import EngineConfig
from bench.report.tables import RunResult

__all__ = ["POLICY_STYLES", "legend_below", "policy_style", "pyplot", "sweep_axis_of", "write_plot"]

#: One colour and marker per policy, the same in every figure the bench draws (tab10 colours;
#: offline references black and dashed).
POLICY_STYLES: dict[str, dict[str, Any]] = {
    "lru": {"color": "#1f77b4", "marker": "o"},
    "gds": {"color": "#d62728", "marker": "s"},
    "gdsf": {"color": "#ff7f0e", "marker": "^"},
    "gds_adaptive": {"color": "#2ca02c", "marker": "D"},
    "joint_lru": {"color": "#9467bd", "marker": "v"},
    "lfu": {"color": "#8c564b", "marker": "<"},
    "slru": {"color": "#e377c2", "marker": ">"},
    "priority": {"color": "#7f7f7f", "marker": "p"},
    "tlru": {"color": "#bcbd22", "marker": "h"},
    "fifo": {"color": "#17becf", "marker": "*"},
    "mru": {"color": "#aec7e8", "marker": "P"},
    "filo": {"color": "#ffbb78", "marker": "X"},
    "marconi": {"color": "#98df8a", "marker": "d"},
    "seglen": {"color": "#c5b0d5", "marker": "8"},
    "belady": {"color": "black", "marker": "x", "linestyle": "--"},
    "offline": {"color": "black", "marker": "+", "linestyle": "-."},
}
_SPARE = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")


def policy_style(name: str) -> dict[str, Any]:
    """The line style of policy ``name`` (matplotlib ``plot`` keywords): fixed for the known
    policies, else chosen from the name itself (the same in every figure)."""
    base = name.split(":", 1)[0]
    if base in POLICY_STYLES:
        return dict(POLICY_STYLES[base])
    return {"color": _SPARE[zlib.crc32(name.encode()) % len(_SPARE)], "marker": "o"}


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend.

    Raises:
        RuntimeError: matplotlib is not installed (the project's ``plot`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'hybrid-prefix-cache[plot]' (or matplotlib)"
        ) from None
    return plt


def legend_below(fig: Any, axes: Sequence[Any], caption: str = "") -> None:
    """One legend for the whole figure, below the panels (never over the data), and the
    caption (trace, sizes, requests) under it; then the layout."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    ncol = min(len(handles), 6) or 1
    rows = -(-len(handles) // ncol)
    bottom = 0.06 * rows + (0.07 if caption else 0.0) + 0.02
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol,
               fontsize="small", frameon=False, bbox_to_anchor=(0.5, 0.06 if caption else 0.0))
    if caption:
        fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize="small", wrap=True)
    fig.tight_layout(rect=(0.0, bottom, 1.0, 1.0))


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


def write_plot(path: str | Path, runs: Sequence[RunResult], bounds: Bounds,
               caption: str = "") -> None:
    """Write a two-panel figure (format from the file suffix, e.g. ``.png``, ``.svg``), each
    policy in its :func:`policy_style`, the legend and ``caption`` below the panels.

    Left: token hit rate vs memory, with the infinite-memory bounds as dashed lines.
    Right: mean state-miss tokens per request vs memory.

    Raises:
        ValueError: see :func:`sweep_axis_of`.
        RuntimeError: matplotlib is not installed.
    """
    axis = sweep_axis_of([r.config for r in runs])
    plt = pyplot()
    fig, (hit_ax, miss_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(r.config.policy for r in runs):
        mine = sorted(
            (r for r in runs if r.config.policy == policy), key=lambda r: getattr(r.config, axis)
        )
        xs = [getattr(r.config, axis) for r in mine]
        style = policy_style(policy)
        hit_ax.plot(xs, [r.metrics.token_hit_rate for r in mine], label=policy, **style)
        miss_ax.plot(xs, [r.metrics.state_miss_tokens.mean for r in mine], label=policy, **style)
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
    legend_below(fig, (hit_ax, miss_ax), caption)
    fig.savefig(path)
    plt.close(fig)
