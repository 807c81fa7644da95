"""The replay's KV-event check (``bench.runs.replay --kv-events``, ``bench.engine.kv_events``): over the
shipped Mooncake trace, under memory pressure, the page set rebuilt from the events alone
equals the tree's at every check, for KV-only, hybrid, host-tier and paged caches; the
consumer flags a redundant or orphan event; the CLI runs the modes side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.core import EngineConfig
from bench.engine.kv_events import EventConsumer, EventCounter, disagreements, tree_pages
from bench.runs.replay import main, replay_one
from bench.traces.loader import load_trace, resolve_trace_path
from components.events import AllBlocksCleared, BlockRemoved, BlockStored


@pytest.fixture(scope="module")
def trace() -> list:
    return load_trace(resolve_trace_path(None), fmt="mooncake", max_requests=60)


@pytest.mark.parametrize("kw", [
    dict(page_size=1, state_slots=0),
    dict(page_size=16, state_slots=32),
    dict(page_size=1, state_slots=32, hicache_ratio=2.0),
    dict(page_size=16, state_slots=32, hicache_ratio=2.0, hicache_write_policy="write_back"),
], ids=["kv-p1", "state-p16", "host-p1", "host-writeback-p16"])
def test_the_rebuilt_page_set_equals_the_tree_at_every_check(trace: list, kw: dict) -> None:
    cfg = EngineConfig(policy="lru", kv_tokens=300_000, kv_events="check", **kw)
    run = replay_one(trace, cfg, progress=False, check_every=10)
    ev = run.kv_events
    assert ev is not None
    assert ev["checks"] == 7 and ev["disagreements"] == 0 and ev["redundant_events"] == 0
    assert ev["pages_removed"] > 0  # the pool is small: pages left and the router saw it
    assert ev["pages_held"] == ev["pages_stored"] - ev["pages_removed"]
    assert run.cache_stats["kv_events_emitted"] >= ev["events"]
    # a router's usable hits from the events alone (state checkpoints as group 1)
    assert ev["router_kv_tokens"] >= ev["router_usable_tokens"]
    if "hicache_ratio" in kw:  # load-backs change the device set before the match: not compared
        assert ev["router_compared"] == 0
    else:
        assert ev["router_compared"] == ev["router_agreements"] == run.metrics.requests
        assert ev["router_usable_tokens"] == run.metrics.usable_tokens


def test_on_mode_counts_what_the_check_mode_sees(trace: list) -> None:
    runs = [replay_one(trace, EngineConfig(policy="lru", kv_tokens=300_000, page_size=16,
                                           kv_events=mode), progress=False)
            for mode in ("on", "check")]
    on, check = (r.kv_events for r in runs)
    assert on is not None and check is not None
    assert {k: on[k] for k in ("events", "pages_stored", "pages_removed")} == {
        k: check[k] for k in ("events", "pages_stored", "pages_removed")}
    assert runs[0].metrics.as_dict() == runs[1].metrics.as_dict()  # events change no answer


def test_the_consumer_flags_redundant_and_orphan_events() -> None:
    c = EventConsumer()
    c.apply([BlockStored([1, 2], None, [5, 6], 1), BlockStored([3], 2, [7], 1)])
    assert c.redundant == 0 and len(c.pages) == 3
    c.apply([BlockStored([3], 2, [7], 1)])  # stored twice
    c.apply([BlockStored([9], 42, [8], 1)])  # parent 42 is not held
    c.apply([BlockRemoved([77])])  # never stored
    assert c.redundant == 3
    c.apply([AllBlocksCleared()])
    assert c.pages == set() and c.cleared == 1
    n = EventCounter()
    n.apply([BlockStored([1, 2], None, [5, 6], 1), BlockRemoved([1]), AllBlocksCleared()])
    assert n.summary() == {"events": 3, "pages_stored": 2, "pages_removed": 1, "all_cleared": 1}


def test_a_wrong_page_set_is_a_disagreement(trace: list) -> None:
    from bench.engine.core import ReplayEngine

    engine = ReplayEngine(EngineConfig(kv_tokens=300_000, page_size=16, kv_events="on"))
    for i, tr in enumerate(trace[:5]):
        engine.admit(tr, rid=i)
    engine.drain()
    c = EventConsumer()
    c.apply(engine.cache.take_events())
    assert disagreements(c, engine.cache) == 0
    c.pages.pop()
    assert disagreements(c, engine.cache) == 1
    assert len(tree_pages(engine.cache)) == len(c.pages) + 1


def test_cli_runs_the_modes_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["--max-requests", "20", "--policy", "lru", "--page-size", "16",
                 "--kv-events", "off", "check", "--no-progress", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["kv_events_mode"] for r in runs] == ["off", "check"]
    assert runs[0]["kv_events"] is None and runs[1]["kv_events"]["disagreements"] == 0
    assert runs[0]["token_hit_rate"] == runs[1]["token_hit_rate"]
