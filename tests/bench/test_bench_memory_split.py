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


@pytest.mark.parametrize(("argv", "says"), [
    (["--page-size", "0"], "argument --page-size: must be >= 1"),  # was a ZeroDivisionError
    (["--chunk-size", "0"], "argument --chunk-size: must be >= 1"),
    (["--concurrency", "-1"], "argument --concurrency: not a whole non-negative count"),
    (["--max-requests", "0"], "argument --max-requests: must be >= 1"),  # was a 0.0 table
    (["--state-fractions", "1.0"], "argument --state-fractions: must be in [0, 1)"),
    (["--state-fractions", "nan"], "argument --state-fractions: must be in [0, 1)"),
    (["--state-fractions", "unified"], "argument --state-fractions: expected a number"),
    (["--policy", "nosuch"], "--policy: radix_eviction_policy='nosuch' is unknown"),
    (["--policy", "unified"], "--policy unified: the fixed splits' pools have no byte sizes"),
    (["--memory-gb", "1e6"], "--memory-gb 1e+06 at state fraction 0.2: kv_tokens="),  # the fixed pools past this machine's memory
    (["--trace", "/nonexistent.jsonl"], "trace file not found"),
    (["--memory-gb", "0.1"], "memory_gb=0.1 holds 1 arena chunks"),  # below two chunks
])
def test_bad_arguments_are_one_error_line_before_any_run(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each was a traceback (or, for ``--max-requests 0``, a table of zeros) before."""
    base = ["--workload", "multiturn:sessions=2,turns=2", "--model", "qwen3-next-80b",
            "--memory-gb", "1", "--state-fractions", "0.2"]
    if argv[0] == "--trace":
        base = base[2:]
    with pytest.raises(SystemExit) as exc:
        memory_split.main([*base, *argv])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran
    assert "python -m bench memory-split: error: " in err and says in err, err


def test_a_malformed_trace_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [0, 1]}\n')
    with pytest.raises(SystemExit) as exc:
        memory_split.main(["--trace", str(trace), "--memory-gb", "1"])
    assert exc.value.code == 2
    assert "t.jsonl:1: 2 hash_ids for input_length 8" in capsys.readouterr().err
