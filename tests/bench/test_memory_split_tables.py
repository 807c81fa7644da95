"""bench/report/memory_split_tables.py: the sweep tables and the issue-38 target verdicts."""

from __future__ import annotations

from typing import Any

from bench.engine.presets import SGLANG_DEFAULT_FRACTION
from bench.report.memory_split_tables import sweep_table, targets


def rec(gb: float, split: Any, hit: float, cpu: float = 1.0) -> dict[str, Any]:
    return {"memory_gb": gb, "split": split, "token_hit_rate": hit, "cpu_s": cpu,
            **({"waste_fraction_max": 0.011} if split == "unified" else {})}


def test_table_and_targets_by_hand() -> None:
    d = SGLANG_DEFAULT_FRACTION
    records = [
        # 5 GB: best 0.30 (split 0.2), default 0.20 loses 10 pt; unified 0.297 (-0.3 pt, +9.7)
        rec(5, 0.2, 0.30), rec(5, d, 0.20, 3.0), rec(5, "unified", 0.297, 4.0),
        # 10 GB: best = default 0.50; unified 0.48 misses by 2 pt; default rule does not apply
        rec(10, 0.2, 0.40), rec(10, d, 0.50), rec(10, "unified", 0.48),
        # 20 GB: default loses 6 pt; unified gains only 3 on it
        rec(20, 0.2, 0.70), rec(20, d, 0.64), rec(20, "unified", 0.67),
    ]
    table = sweep_table(records).splitlines()
    assert table[0] == ("| GB | 0.2 | 0.474 (sglang) | best fixed | unified | unified - best | "
                        "unified - default | waste % | cpu x |")
    # cpu x = 4 / mean(1, 3) = 2.00; waste 1.1 %
    assert table[2] == "| 5 | 30.0 | 20.0 | 30.0 | 29.7 | -0.3 | +9.7 | 1.1 | 2.00 |"
    assert table[3] == "| 10 | 40.0 | 50.0 | 50.0 | 48.0 | -2.0 | -2.0 | 1.1 | 1.00 |"
    best_rule, default_rule = targets(records)
    assert best_rule == "**missed**: 10 GB -2.0, 20 GB -3.0"
    assert default_rule == "5 GB +9.7 yes, 20 GB +3.0 **no**"
