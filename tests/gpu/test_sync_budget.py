"""The host-synchronisation budget of the engine's hot path, on the simulated CUDA device.

The replay's engine (``bench.engine.core.ReplayEngine`` on ``device="cuda"``) serves a seeded
multi-turn workload (``bench.dev.gpu.sync_counts.conversations``) through four models; every call the
engine makes on the cache and on the pools is charged with the syncs it causes. The budget is
zero for every one of them: match_prefix, insert (through cache_unfinished_req /
cache_finished_req), lock and unlock, evict / evict_states / evict_swa, release_swa,
load_back, the KV allocator's alloc / free, the state pool's alloc / free / copy. The
simulator is strict (an unordered copy or a mixed-device operation fails at once), no device
tensor may be read without its host mirror, and the replay on the simulated device must make
exactly the decisions of the same replay on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest

from allocators.host_mirror import MISSES
from bench.dev.gpu.simcuda import OUTSIDE
from bench.dev.gpu.sync_counts import COMMON, MODELS, ModelCounts, conversations, run_model
from bench.engine.core import EngineConfig, ReplayEngine

REQUESTS = 100
#: Syncs allowed per call, per operation (every operation the replay makes): none.
BUDGET: dict[str, int] = {}

#: The operations each model must exercise (so that a zero cannot come from a path not taken).
MUST_RUN = {
    "kv": ("cache.evict",),
    "hybrid": ("cache.evict", "cache.evict_states", "state_pool.copy"),
    "swa": ("cache.evict_swa", "cache.release_swa"),
    "hicache": ("cache.load_back", "cache.evict", "state_pool.copy"),
}


def _cpu_replay(model: str, trace: list[Any], **extra: Any) -> ReplayEngine:
    cfg = EngineConfig(**{**COMMON, **MODELS[model], **extra, "device": "cpu"})
    engine = ReplayEngine(cfg)
    for i, tr in enumerate(trace):
        engine.admit(tr, rid=i)
    engine.drain()
    return engine


def _log(engine: ReplayEngine) -> tuple[Any, ...]:
    log = engine.log
    return (log.prompt_len.tolist(), log.usable_len.tolist(), log.kv_hit_len.tolist(),
            log.swa_miss_len.tolist(), log.skipped, engine.counters)


def _check(res: ModelCounts, model: str) -> None:
    sim = res.sim
    assert sim.errors == []
    over = {op: s.total for op, s in sim.ops.items()
            if op != OUTSIDE and s.total > BUDGET.get(op, 0) * s.calls}
    assert over == {}, sim.report()
    assert sim.syncs_of(OUTSIDE) == 0, sim.report()  # the engine itself reads nothing either
    for op in MUST_RUN[model]:
        assert sim.ops[op].calls > 0, f"{model}: {op} never ran"


@pytest.mark.parametrize("model", list(MODELS))
def test_the_replay_makes_no_host_sync_and_the_decisions_of_the_cpu(model: str) -> None:
    trace = conversations(REQUESTS)
    misses = sum(MISSES.values())
    res = run_model(model, trace, strict=True, check_every=25)
    assert sum(MISSES.values()) == misses, f"device tensors read without a mirror: {MISSES}"
    _check(res, model)
    cpu = _cpu_replay(model, trace)
    assert res.engine is not None
    assert _log(res.engine) == _log(cpu)
    assert res.engine.cache.stats() == cpu.cache.stats()


@pytest.mark.parametrize("model, extra", [
    ("kv", {"page_size": 16}),
    ("swa", {"page_size": 16}),
    ("hicache", {"hicache_write_policy": "write_back"}),
    ("hicache", {"hicache_write_policy": "write_through_selective", "policy": "gds"}),
])
def test_the_budget_holds_paged_and_under_other_policies(model: str, extra: dict[str, Any]) -> None:
    trace = conversations(REQUESTS)
    res = run_model(model, trace, strict=True, check_every=50, **extra)
    if extra.get("hicache_write_policy") == "write_back":
        _check_write_back(res)
    else:
        _check(res, model)
    cpu = _cpu_replay(model, trace, **extra)
    assert res.engine is not None and _log(res.engine) == _log(cpu)
    assert res.engine.cache.stats() == cpu.cache.stats()


def _check_write_back(res: ModelCounts) -> None:
    """write_back backs up on eviction: load-backs may not happen in this workload, evictions
    with demotion must."""
    sim = res.sim
    assert sim.errors == [] and sim.total_syncs == 0, sim.report()
    assert res.engine is not None and res.engine.cache.stats()["demoted_tokens"] > 0
