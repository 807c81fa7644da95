"""The host tier's transfers on the simulated CUDA device, over the seeded HiCache replay
(``bench.dev.gpu.sync_counts``: KV + recurrent states, a host tier, 100 requests): for every write
policy and page sizes 1 and 16, the CPU copies **0 bytes** of pool data per byte the copies
move between the device and the host, and no engine-facing call waits on the host (0
blocking waits), also when events never complete on their own (every copy then stays in
flight until the run's end). The bytes the simulator saw cross the link are the bytes the
controller says it moved (rows x bytes per row of every lane), and the replay makes exactly
the decisions of the same replay on the CPU. (SWA has no host tier in this library yet.)"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from bench.dev.gpu import sync_counts
from bench.dev.gpu.simcuda import OUTSIDE, SimCuda
from bench.dev.gpu.sync_counts import conversations, run_model
from tests.gpu.test_sync_budget import _cpu_replay, _log

REQUESTS = 100
POLICIES = ("write_through", "write_through_selective", "write_back")
CASES: list[tuple[str, int, bool, dict[str, Any]]] = [
    *((p, ps, True, {}) for p in POLICIES for ps in (1, 16)),
    ("write_through", 1, False, {}),
    ("write_back", 16, False, {}),
    ("write_through", 16, True, {"hicache_mem_layout": "layer_first"}),
]


@pytest.mark.parametrize("policy, page_size, events_complete, extra", CASES,
                         ids=[f"{c[0]}-p{c[1]}-{'events' if c[2] else 'never-complete'}"
                              + "".join(f"-{v}" for v in c[3].values()) for c in CASES])
def test_the_replay_copies_nothing_on_the_cpu_and_never_waits(policy: str, page_size: int,
                                                             events_complete: bool,
                                                             extra: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_counts, "SimCuda", partial(SimCuda, events_complete=events_complete))
    res = run_model("hicache", conversations(REQUESTS), strict=True, page_size=page_size,
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
    if events_complete:
        assert hc.load_tokens > 0 or policy == "write_back"
        cpu = _cpu_replay("hicache", conversations(REQUESTS), page_size=page_size,
                          hicache_write_policy=policy)
        assert _log(res.engine) == _log(cpu)
        assert res.engine.cache.stats() == cpu.cache.stats()
