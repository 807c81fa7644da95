"""``bench.dev.arena.grid``: issue 38's verdicts, by hand."""

from __future__ import annotations

import pytest

from bench.dev.arena.grid import load_requests, verdicts


def test_verdicts_by_hand() -> None:
    fixed = {0.2: 0.30, 0.4737: 0.24, 0.6: 0.28}
    # best 0.30 at 0.2; the default loses 6 points, so unified needs >= 0.29 (t2) and >= 0.295 (t1)
    v = verdicts(fixed, 0.296)
    assert (v["best"], v["best_at"], v["default"], v["t1"], v["t2"]) == (0.30, 0.2, 0.24, "ok", "ok")
    assert verdicts(fixed, 0.294)["t1"] == "MISS"
    assert verdicts(fixed, 0.294)["t2"] == "ok"
    assert verdicts(fixed, 0.2899)["t2"] == "MISS"
    # the default within 5 points of the best: no second target
    assert verdicts({0.3: 0.30, 0.4737: 0.26}, 0.0)["t2"] == "-"
    # no default split in the grid: no second target either
    assert verdicts({0.3: 0.30}, 0.30)["t2"] == "-"
    with pytest.raises(ValueError, match="fixed"):
        verdicts({}, 0.5)


def test_sweep_names_pick_the_seed_and_the_trace() -> None:
    a0, a1 = load_requests("agentic"), load_requests("agentic-seed1")
    assert len(a0) > 0 and len(a1) > 0
    assert [r.token_array.tolist() for r in a0[:3]] != [r.token_array.tolist() for r in a1[:3]]
    assert len(load_requests("mooncake-50")) == 50
