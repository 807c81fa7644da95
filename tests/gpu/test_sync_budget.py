"""The host-synchronisation and CUDA-call budgets of the engine's hot path, on the simulated
CUDA device.

The replay's engine (``bench.engine.core.ReplayEngine`` on ``device="cuda"``) serves a seeded
multi-turn workload (``bench.dev.gpu.sync_counts.conversations``) through four models; every call the
engine makes on the cache and on the pools is charged with the syncs it causes. The budget is
zero for every one of them: match_prefix, insert (through cache_unfinished_req /
cache_finished_req), lock and unlock, evict / evict_states / evict_swa, release_swa,
load_back, the KV allocator's alloc / free, the state pool's alloc / free / copy. The
simulator is strict (an unordered copy or a mixed-device operation fails at once), no device
tensor may be read without its host mirror, and the replay on the simulated device must make
exactly the decisions of the same replay on the CPU.

CUDA API calls (kernel launches + memcpys) of those engine-facing calls, per request over the
seeded replay (``bench.dev.gpu.sync_counts.API_BUDGET``): at most 2 for the KV-only model, 4 with
recurrent states, 4 with SWA, 6 with the host tier (its data transfers apart). The pending
state and SWA-map work a forward step sends out when it reads the pools is counted apart
(``step.read``): at most 1 memcpy + 6 launches for the state pool and 1 + 1 for the SWA map
per step.
"""

from __future__ import annotations

from typing import Any

import pytest

from allocators.host_mirror import MISSES
from bench.dev.gpu.simcuda import OUTSIDE
from bench.dev.gpu.sync_counts import (
    API_BUDGET,
    COMMON,
    HOST_TIER_MODELS,
    MODELS,
    STEP,
    ModelCounts,
    conversations,
    run_model,
)
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
    cfg = EngineConfig(**{**COMMON, **{**MODELS, **HOST_TIER_MODELS}[model], **extra,
                          "device": "cpu"})
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
    _check_api(res, model)


#: Most launches and memcpys of one step's reads (the state pool's flush: one upload, a gather
#: and a scatter per state tensor, a fill per state tensor; the SWA map: one upload, one copy).
STEP_MAX = {"kv": (0, 0), "hybrid": (6, 1), "swa": (1, 1), "hicache": (6, 1)}


def _check_api(res: ModelCounts, model: str) -> None:
    """The per-request budget of CUDA calls, and the step's reads within theirs."""
    per = res.launches_per_request + res.memcpys_per_request
    assert per <= API_BUDGET[model], f"{model}: {per:.2f} CUDA calls per request\n" + \
        res.sim.api_report()
    step = res.sim.api_of(f"{STEP}.read")
    calls = res.sim.ops[f"{STEP}.read"].calls
    launches, memcpys = STEP_MAX[model]
    assert sum(step.launches.values()) <= launches * calls, res.sim.api_report()
    assert sum(step.memcpys.values()) <= memcpys * calls, res.sim.api_report()


def test_the_budget_counts_what_the_calls_issue() -> None:
    """The per-request figures are the simulator's launches and memcpys of the engine-facing
    calls divided by the requests (by hand from the per-operation counters), the step's and
    the transfers' apart; and a model that issues no CUDA call at all (kv, the step) counts
    zero there."""
    res = run_model("hicache", conversations(40), strict=True)
    sim = res.sim
    engine_ops = [op for op in sim.api if op != OUTSIDE and not op.startswith(STEP + ".")]
    launches = sum(sum(sim.api[op].launches.values()) for op in engine_ops)
    memcpys = sum(sum(sim.api[op].memcpys.values()) for op in engine_ops)
    assert res.launches_per_request == launches / 40
    assert res.memcpys_per_request == memcpys / 40
    assert memcpys > 0  # the KV uploads, at least
    assert sum(sum(c.excluded.values()) for c in sim.api.values()) > 0  # the transfers, apart
    kv = run_model("kv", conversations(40), strict=True)
    assert kv.sim.api_of(f"{STEP}.read").total == 0 and kv.launches_per_request == 0


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
    _check_api(res, "hicache")
