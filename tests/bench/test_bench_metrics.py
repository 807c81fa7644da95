"""Replay metrics (bench/engine/metrics.py): definitions and percentiles checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from bench.engine.metrics import COST_D, COST_E, Distribution, RequestLog, prefill_cost, summarize


def test_prefill_cost_by_hand() -> None:
    # cost(0, 1000) = d*1000 + e*1e6/2e5 = d*1000 + 5e
    assert prefill_cost(0, 1000) == pytest.approx(COST_D * 1000 + 5 * COST_E)
    # cost(a, a) = 0; arrays work element-wise; d = 0 leaves only the quadratic term
    assert prefill_cost(700, 700) == 0.0
    np.testing.assert_allclose(
        prefill_cost(np.array([0, 100]), np.array([200, 300]), d=0.0, e=1.0),
        [40000 / 2e5, 80000 / 2e5],
    )


def test_percentiles_interpolate_linearly() -> None:
    dist = Distribution.of(np.array([30, 0, 20, 10]))
    # sorted 0, 10, 20, 30: p50 halfway between 10 and 20; p90 at rank 2.7 -> 20 + 0.7*10
    assert (dist.mean, dist.p50, dist.p90) == (15.0, 15.0, 27.0)
    assert Distribution.of(np.array([], dtype=np.int64)) == Distribution(0.0, 0.0, 0.0)


def test_summarize_by_hand() -> None:
    log = RequestLog()
    # (prompt, usable, kv_hit)
    for row in [(100, 0, 0), (200, 100, 100), (300, 100, 200), (400, 300, 400)]:
        log.record(*row)
    log.skip()
    m = summarize(log)
    assert (m.requests, m.skipped_requests) == (4, 1)
    assert (m.prompt_tokens, m.usable_tokens, m.kv_hit_tokens) == (1000, 500, 700)
    assert (m.token_hit_rate, m.kv_hit_rate) == (0.5, 0.7)
    # state-miss: 0, 0, 100, 100 -> mean 50, p50 50, p90 100
    assert m.state_miss_tokens == Distribution(50.0, 50.0, 100.0)
    # uncached: 100, 100, 200, 100 -> sorted 100,100,100,200: mean 125, p50 100, p90 170
    u = m.uncached_tokens
    assert (u.mean, u.p50) == (125.0, 100.0) and u.p90 == pytest.approx(170.0)
    costs = [
        prefill_cost(u, p) for p, u, _ in [(100, 0, 0), (200, 100, 0), (300, 100, 0), (400, 300, 0)]
    ]
    assert m.prefill_cost.mean == pytest.approx(float(np.mean(costs)))
    assert m.as_dict()["state_miss_tokens"] == {"mean": 50.0, "p50": 50.0, "p90": 100.0}


def test_empty_log_and_bad_records() -> None:
    m = summarize(RequestLog())
    assert m.requests == 0 and m.token_hit_rate == 0.0
    log = RequestLog()
    with pytest.raises(ValueError, match="usable"):
        log.record(10, 5, 4)  # usable beyond the KV hit
    with pytest.raises(ValueError, match="usable"):
        log.record(10, 0, 11)  # KV hit beyond the prompt
