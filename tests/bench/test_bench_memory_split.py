"""``python -m bench memory-split``: fixed splits and the unified arena on one small workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.presets import GB, get_preset
from bench.runs import memory_split
from bench.runs.memory_split import SGLANG_DEFAULT_FRACTION, _arena_for, real_waste_fraction


def test_default_fraction_is_sglangs_ratio() -> None:
    # mamba_full_memory_ratio = 0.9 (state : full KV) -> states get 0.9 / 1.9 of the budget
    assert SGLANG_DEFAULT_FRACTION == pytest.approx(0.47368, abs=1e-5)


def test_scaled_arena_keeps_the_presets_counts() -> None:
    p = get_preset("qwen3-next-80b")  # 24,576 B per token, 77,266,944 B per state
    a = _arena_for(p, 10.0, 1, 0.5)
    assert a.tokens_per_chunk == 3144  # ceil(77,266,944 / 24,576) = 3144 (exact)
    # 129 usable chunks, and the padding chunk on top of the budget
    assert a.num_chunks == int(10 * GB // (3144 * 24576)) + 1 == 130
    assert a.num_state_chunks == 64  # round(0.5 * 129)
    # real waste: the tail past the 129 usable chunks + 0 per state (3144 * 24576 == 77,266,944)
    chunk = 3144 * 24576
    assert real_waste_fraction(p, 10.0, a, 64) == pytest.approx((10 * GB - 129 * chunk) / (10 * GB))


def test_command_writes_one_record_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    out = tmp_path / "r.json"
    rc = memory_split.main(["--workload", "multiturn:sessions=6,turns=3", "--model",
                            "qwen3-next-80b", "--memory-gb", "0.5", "--state-fractions", "0.2",
                            "0.5", "--json", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [r["split"] for r in recs] == [0.2, 0.5, "unified"]
    for r in recs:
        assert r["memory_gb"] == 0.5 and 0.0 <= r["token_hit_rate"] <= 1.0 and r["cpu_s"] >= 0
    assert recs[2]["chunks"] == int(0.5 * GB // (3144 * 24576)) + 1  # + the padding chunk
    assert "| 0.5 |" in capsys.readouterr().out
