"""The host tier's transfers on the simulated CUDA device, over the seeded HiCache replay
(``bench.dev.gpu.sync_counts``, 100 requests) of every model with a host tier
(:data:`bench.dev.gpu.sync_counts.HOST_TIER_MODELS`): KV + recurrent states (``hicache``),
KV + sliding-window KV (``swa_hicache``) and KV + sliding-window KV + recurrent states
(``hybrid_swa_hicache``). For every write policy and page sizes 1 and 16, the CPU copies
**0 bytes** of pool data per byte the copies move between the device and the host, and no
engine-facing call waits on the host (0 blocking waits), also when events never complete on
their own (every copy then stays in flight until the run's end). The bytes the simulator saw
cross the link are the bytes the controller says it moved, and both are the rows each pool
pair's copies named times that pool's bytes per row (so the SWA pair's rows are counted, and
seen to move); the replay makes exactly the decisions of the same replay on the CPU."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest

from allocators.swa import SWAAllocator
from bench.dev.gpu import sync_counts
from bench.dev.gpu.simcuda import OUTSIDE, SimCuda
from bench.dev.gpu.sync_counts import conversations, run_model
from hicache.controller import HiCacheController
from tests.gpu.test_sync_budget import _cpu_replay, _log

REQUESTS = 100
POLICIES = ("write_through", "write_through_selective", "write_back")
CASES: list[tuple[str, str, int, bool, dict[str, Any]]] = [
    *(("hicache", p, ps, True, {}) for p in POLICIES for ps in (1, 16)),
    ("hicache", "write_through", 1, False, {}),
    ("hicache", "write_back", 16, False, {}),
    ("hicache", "write_through", 16, True, {"hicache_mem_layout": "layer_first"}),
    *((m, p, ps, True, {}) for m in ("swa_hicache", "hybrid_swa_hicache")
      for p in POLICIES for ps in (1, 16)),
    ("swa_hicache", "write_through", 1, False, {}),
    ("hybrid_swa_hicache", "write_back", 16, False, {}),
    ("swa_hicache", "write_back", 16, True, {"hicache_mem_layout": "layer_first"}),
]
#: The pool pairs each model's host tier moves.
PAIRS = {"hicache": {"kv", "state"}, "swa_hicache": {"kv", "swa"},
         "hybrid_swa_hicache": {"kv", "swa", "state"}}


def _count_rows(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Host rows named per pool pair by every ``write_rows`` / ``load_rows`` of every
    controller from now on (read from the host slot ids the callers pass: no device read)."""
    rows: Counter[str] = Counter()

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: HiCacheController, moves: Sequence[tuple[str, Any, Any]],
                    *args: Any) -> Any:
            out = fn(self, moves, *args)
            for name, _, h in moves:
                rows[name] += 1 if isinstance(h, int) else len(h)
            return out
        return counted

    for name in ("write_rows", "load_rows"):
        monkeypatch.setattr(HiCacheController, name, wrap(getattr(HiCacheController, name)))
    return rows


@pytest.mark.parametrize("model, policy, page_size, events_complete, extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-p{c[2]}-{'events' if c[3] else 'never-complete'}"
                              + "".join(f"-{v}" for v in c[4].values()) for c in CASES])
def test_the_replay_copies_nothing_on_the_cpu_and_never_waits(model: str, policy: str,
                                                             page_size: int,
                                                             events_complete: bool,
                                                             extra: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_counts, "SimCuda", partial(SimCuda, events_complete=events_complete))
    named = _count_rows(monkeypatch)
    res = run_model(model, conversations(REQUESTS), strict=True, page_size=page_size,
                    hicache_write_policy=policy, **extra)
    sim = res.sim
    assert sim.errors == []
    report = sim.transfer_report()
    moved = sum(r["link_bytes"] for r in report.values())
    assert moved > 0
    assert {op: r["cpu_copied_bytes"] for op, r in report.items()
            if op != OUTSIDE and r["cpu_copied_bytes"]} == {}
    assert {op: r["blocking_waits"] for op, r in report.items() if r["blocking_waits"]} == {}, sim.report()
    assert res.engine is not None
    hc = res.engine.cache.hicache
    assert hc is not None and moved == hc.bytes_written + hc.bytes_loaded
    # bytes per row from the device pools (the controller counts its lanes' host rows)
    engine = res.engine
    alloc = engine.kv_allocator
    per_row = {"kv": alloc.pool.bytes_per_token}
    if isinstance(alloc, SWAAllocator):
        assert alloc.swa_pool is not None
        per_row["swa"] = alloc.swa_pool.bytes_per_token
    if engine.state_pool is not None:
        per_row["state"] = engine.state_pool.bytes_per_slot
    assert set(named) == set(per_row) == PAIRS[model] and all(named.values()), named
    assert moved == sum(n * per_row[name] for name, n in named.items())
    if events_complete:
        assert hc.load_tokens > 0 or policy != "write_through"
        cpu = _cpu_replay(model, conversations(REQUESTS), page_size=page_size,
                          hicache_write_policy=policy, **extra)
        assert _log(res.engine) == _log(cpu)
        assert res.engine.cache.stats() == cpu.cache.stats()

