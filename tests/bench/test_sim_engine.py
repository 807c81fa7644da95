"""The discrete-event engine model (bench/engine/simulator.py) on tiny hand-made traces.

Cost model in these tests: ``d = 0.1`` s per token and (unless named) ``e = 0``, so a chunk of
``n`` tokens takes ``0.1 n`` s; one decode step is 1 s. Block size 4: block ``h`` is tokens
``4h+1 .. 4h+4``. Every expected time below is worked out by hand in the comment above it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.engine.simulator import SimConfig, Simulator, run_policy
from bench.traces.loader import TraceRequest


def req(ids: list[int], length: int, out: int, ts: float, block: int = 4) -> TraceRequest:
    runs = tuple((h * block + 1, min(block, length - j * block)) for j, h in enumerate(ids))
    return TraceRequest(ts, length, out, block, tuple(ids), runs)


def sim(trace: list[TraceRequest], policy: str = "lru", **kw: object) -> Simulator:
    base = dict(kv_tokens=1000, state_slots=16, concurrency=4, cost_d=0.1, cost_e=0.0,
                decode_ms=1000.0, max_prefill_tokens=16)
    s = Simulator(trace, SimConfig.of(policy, **{**base, **kw}))
    assert s.run()
    return s


def close(a: np.ndarray, b: list[float]) -> bool:
    return bool(np.allclose(a, b, equal_nan=True))


def test_two_requests_fifo_prefill_then_decode() -> None:
    # r0 (t=0, 8 tokens, 3 out): step [0, 0.8]; first token 0.8, 2 decode steps left.
    # r1 arrives at 0.5, admitted at the next step boundary 0.8 (queue 0.3): [0.8, 1.6];
    # 1 output token -> done at 1.6 (TTFT 1.1). Then r0 decodes 2 steps: 2.6, 3.6.
    s = sim([req([0, 1], 8, 3, 0.0), req([2, 3], 8, 1, 0.5)])
    assert close(s.admitted, [0.0, 0.8])
    assert close(s.first_token, [0.8, 1.6])
    assert close(s.finished, [3.6, 1.6])
    t = s.timing()
    assert t.ttft_mean == pytest.approx((0.8 + 1.1) / 2)
    assert t.queue_mean == pytest.approx(0.15)
    assert t.makespan_s == pytest.approx(3.6)
    assert t.output_tokens == 4
    assert t.output_tokens_per_min_per_gpu == pytest.approx(4 / 3.6 * 60)
    assert t.prefill_busy_s == pytest.approx(1.6)


def test_cache_hit_shortens_prefill() -> None:
    # r0 (8 tokens, 1 out) finishes at 0.8 and caches 2 blocks with a state at 8.
    # r1 (blocks 0,1,5: 12 tokens) arrives at 1.0, matches 8 usable tokens, prefills 4: 0.4 s.
    s = sim([req([0, 1], 8, 1, 0.0), req([0, 1, 5], 12, 1, 1.0)])
    assert list(s.engine.log.usable_len) == [0, 8]
    assert close(s.first_token, [0.8, 1.4])
    assert s.timing().ttft_p50 == pytest.approx(0.6)  # median of 0.8 and 0.4


def test_budget_split_with_quadratic_cost() -> None:
    # e = 2e4 -> e/2e5 = 0.1 per token^2: cost(a, b) = 0.1 (b-a) + 0.1 (b^2 - a^2).
    # Budget 8. Both arrive at 0. Step 1: r0 [0,8) = 0.8 + 6.4 = 7.2 -> t = 7.2 (no budget
    # left for r1). Step 2: r0 [8,10) = 0.2 + 3.6 = 3.8, r1 admitted at 7.2, [0,6) = 0.6 + 3.6
    # = 4.2 -> t = 15.2: both first tokens at 15.2.
    s = sim([req([0, 1, 2], 10, 1, 0.0), req([3, 4], 6, 1, 0.0)], max_prefill_tokens=8,
            cost_e=2e4)
    assert close(s.admitted, [0.0, 7.2])
    assert close(s.first_token, [15.2, 15.2])
    t = s.timing()
    assert t.queue_p50 == pytest.approx(3.6) and t.ttft_mean == pytest.approx(15.2)


def test_memory_short_requests_queue_until_a_finish() -> None:
    # 20 KV tokens. r0 holds 8 prompt + 4 output = 12; r1 (arrives 0.1) needs 8 + 5 = 13
    # but only 8 are free and none evictable -> waits. r0: prefill [0, 0.8], 3 decode steps
    # -> 3.8; it caches its 8 prompt tokens (evictable) and frees its output: 12 free + 8
    # evictable. r1 admitted at 3.8 (queue 3.7), evicting r0's 8 cached tokens for the 13th;
    # prefill 0.8 -> first token 4.6 (TTFT 4.5).
    s = sim([req([0, 1], 8, 4, 0.0), req([2, 3], 8, 5, 0.1)], kv_tokens=20)
    assert close(s.admitted, [0.0, 3.8])
    assert close(s.first_token, [0.8, 4.6])
    assert s.engine.counters.forced_finishes == 0
    assert s.engine.counters.evicted_kv_tokens == 8  # r0's cached prompt made room for r1


def test_max_running_requests_queue() -> None:
    # concurrency 1: r1 (arrives 0) waits for r0 (finishes at 0.8 + 1 decode step = 1.8).
    s = sim([req([0, 1], 8, 2, 0.0), req([2, 3], 8, 1, 0.0)], concurrency=1)
    assert close(s.admitted, [0.0, 1.8])
    assert close(s.finished, [1.8, 2.6])


def test_request_that_never_fits_is_skipped() -> None:
    # 10 KV tokens cannot hold 8 + 4: skipped; the other request is served normally.
    s = sim([req([0, 1], 8, 4, 0.0), req([2], 4, 1, 0.0)], kv_tokens=10)
    assert s.engine.log.skipped == 1
    assert math.isnan(s.finished[0]) and s.finished[1] == pytest.approx(0.4)
    assert s.timing().requests_per_s == pytest.approx(1 / 0.4)


def test_closed_arrivals_issue_on_finish() -> None:
    # one client: r1 is issued when r0 finishes (0.8 + 1 decode step = 1.8).
    s = sim([req([0, 1], 8, 2, 0.0), req([2, 3], 8, 1, 50.0)], concurrency=1, arrivals="closed")
    assert close(s.arrival, [0.0, 1.8])
    assert close(s.first_token, [0.8, 2.6])


def test_time_scale_and_zero_decode() -> None:
    # time_scale 2: r1 arrives at 4.0; decode_ms 0: every request ends with its prefill.
    s = sim([req([0, 1], 8, 5, 0.0), req([2, 3], 8, 5, 2.0)], time_scale=2.0, decode_ms=0.0)
    assert close(s.arrival, [0.0, 4.0])
    assert close(s.finished, [0.8, 4.8])


def test_decode_jump_stops_at_arrivals() -> None:
    # r0 decodes 9 steps (1 s each) from 0.8 (boundaries 1.8, 2.8, ...); r1 arrives at 2.5
    # and is admitted at the first boundary after it (2.8), not after r0's last step.
    s = sim([req([0, 1], 8, 10, 0.0), req([2, 3], 8, 1, 2.5)])
    assert s.admitted[1] == pytest.approx(2.8)
    # r0: 0.8 + 2 decode steps, r1's prefill (0.8 s) stalls its decode, then 7 steps more
    assert s.finished[0] == pytest.approx(0.8 + 2 + 0.8 + 7)


@pytest.mark.parametrize("policy", ["lru", "joint_lru", "gds", "marconi", "belady"])
def test_every_policy_runs_and_checks(policy: str) -> None:
    rng = np.random.default_rng(1)
    trace = []
    for i in range(40):
        ids = [0, int(rng.integers(1, 4))] + [100 + 10 * i + k for k in range(int(rng.integers(1, 4)))]
        trace.append(req(ids, 4 * len(ids) - int(rng.integers(0, 3)), int(rng.integers(1, 4)), i * 0.3))
    r = run_policy(trace, SimConfig.of(policy, kv_tokens=60, state_slots=6, concurrency=3,
                                       cost_d=0.1, cost_e=0.0, decode_ms=500.0, chunk_size=8))
    assert r.metrics.requests + r.metrics.skipped_requests == 40
    assert r.counters.forced_finishes == 0
    assert r.timing.ttft_p50 <= r.timing.ttft_p90 <= r.timing.ttft_p99
    assert (r.tuning is not None) == (policy == "marconi")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="state slots"):
        SimConfig.of("belady", state_slots=0)
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig.of("lru", time_scale=0.0)
    with pytest.raises(ValueError, match="arrivals"):
        SimConfig.of("lru", arrivals="poisson")
    with pytest.raises(ValueError, match="unknown model preset"):
        SimConfig.of("lru", model="gpt-5")
    assert SimConfig.of("marconi").engine.policy == "gds"
