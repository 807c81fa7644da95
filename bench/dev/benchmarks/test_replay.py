"""A whole (small) replay: the first ``REQUESTS`` Mooncake conversation requests through the
engine model, per policy, page size and model kind (pytest-benchmark).

    python -m pytest bench/dev/benchmarks/test_replay.py --benchmark-only

The engine (``bench.engine.core.ReplayEngine``) is built in the setup, outside the timer; the timed
part is ``admit`` of every request and the final ``drain``, i.e. every match, lock, chunked
checkpoint insert, finish insert and eviction of the replay, allocator work included.
The KV pool is small enough (``KV_TOKENS``) that eviction runs.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from bench.engine.core import EngineConfig, ReplayEngine
from bench.traces.loader import load_trace

REQUESTS = 500
KV_TOKENS = 1_000_000


@lru_cache(maxsize=1)
def trace():
    return load_trace(None, max_requests=REQUESTS)


@pytest.mark.parametrize("state_slots", [0, 512], ids=["kv-only", "hybrid"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["lru", "gds"])
def test_replay(benchmark, policy: str, page_size: int, state_slots: int) -> None:
    if policy == "gds" and state_slots == 0:
        pytest.skip("gds orders states: same as lru on a KV-only model")
    reqs = trace()
    cfg = EngineConfig(policy=policy, kv_tokens=KV_TOKENS, state_slots=state_slots,
                       page_size=page_size)

    engines: list[ReplayEngine] = []

    def setup():
        engines.append(ReplayEngine(cfg))
        return (engines[-1],), {}

    def run(engine: ReplayEngine) -> None:
        for i, tr in enumerate(reqs):
            engine.admit(tr, rid=i)
        engine.drain()

    benchmark.extra_info["requests"] = len(reqs)
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
    cache = engines[-1].cache
    cache.sanity_check()
    assert cache.protected_size() == 0
    benchmark.extra_info["evicted_kv_tokens"] = engines[-1].counters.evicted_kv_tokens
