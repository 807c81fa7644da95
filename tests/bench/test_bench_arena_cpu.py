"""``bench.dev.arena.cpu``: the best fixed split read off a sweep's results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.dev.arena.cpu import best_fraction


def test_best_fraction_is_the_best_hit_rate_at_the_budget(tmp_path: Path) -> None:
    rows = [
        {"memory_gb": 10.0, "split": 0.2, "token_hit_rate": 0.30},
        {"memory_gb": 10.0, "split": 0.3, "token_hit_rate": 0.40},
        {"memory_gb": 10.0, "split": "unified", "token_hit_rate": 0.90},  # not a split
        {"memory_gb": 20.0, "split": 0.6, "token_hit_rate": 0.95},  # another budget
        {"memory_gb": 10.0, "split": 0.6, "token_hit_rate": 0.40},  # a tie: the first
    ]
    (tmp_path / "m-agentic.json").write_text(json.dumps(rows))
    (tmp_path / "m-mooncake-50.json").write_text(json.dumps(rows[3:4]))
    assert best_fraction(tmp_path, "m", "agentic", 10.0, 2000) == 0.3
    assert best_fraction(tmp_path, "m", "mooncake", 20.0, 50) == 0.6
    with pytest.raises(ValueError, match="no fixed split at 30.0 GB"):
        best_fraction(tmp_path, "m", "agentic", 30.0, 2000)
    with pytest.raises(ValueError, match="no results file"):
        best_fraction(tmp_path, "m", "docqa", 10.0, 2000)


def test_the_shipped_sweep_gives_the_splits_read_off_by_hand() -> None:
    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "memory-split-3"
    got = [best_fraction(results, "qwen3-next-80b", p.split(":")[0], float(p.split(":")[1]),
                         2000) for p in ("agentic:10", "agentic:20", "multiturn:40",
                                         "mooncake:40")]
    # hit rates there: agentic:10 0.4024 at 0.3, agentic:20 0.6800 at 0.3, multiturn:40
    # 0.7806 at 0.6, mooncake:40 0.0639 at 0.2 (each the highest of the seven splits)
    assert got == [0.3, 0.3, 0.6, 0.2]
