"""The replay's engine model (bench/engine/core.py) and CLI (bench/runs/replay.py) on the real cache.

Narrated scenarios on a 4-token-block trace with exact matched lengths, then ~50 Mooncake
requests under memory pressure with the cache's ``sanity_check`` after every request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.engine.core import ReplayEngine
from bench.runs.replay import main, parse_count
from bench.traces.loader import TraceRequest, load_trace
from tests.helpers.replay_helpers import assert_usage_error, rows
from tests.helpers.replay_helpers import replay as replay_checked


def block_req(ids: list[int], length: int, out: int = 2, block: int = 4) -> TraceRequest:
    """A Mooncake-style request with block size 4 (block h = tokens 4h+1 .. 4h+4)."""
    runs = tuple((h * block + 1, min(block, length - j * block)) for j, h in enumerate(ids))
    return TraceRequest(0.0, length, out, block, tuple(ids), runs)


# r0: tokens 1..8, 9,10      r1: 1..8, 21..24      r2: 1..4, 13..16      r3: 1..4, 25,26
TRACE = [
    block_req([0, 1, 2], 10),
    block_req([0, 1, 5], 12),
    block_req([0, 3], 8),
    block_req([0, 6], 6),
]


def replay(trace: list[TraceRequest], **kw: Any) -> ReplayEngine:
    return replay_checked(trace, **{"kv_tokens": 1000, "state_slots": 16, **kw})


def test_block_end_checkpoint_and_branch_checkpoint() -> None:
    e = replay(TRACE)
    # r0 cold. Finished r0 keeps 2 full blocks (8 tokens) with a state at 8.
    # r1 matches 1..8 with the state -> usable 8.  It keeps 12 tokens, state at 12.
    # r2 matches 1..4 (KV) but no state at 4 -> usable 0, 4 state-miss tokens; it
    #    checkpoints at the branch (4).  r3 then resumes from that state -> usable 4.
    assert rows(e) == [(10, 0, 0), (12, 8, 8), (8, 0, 4), (6, 4, 4)]
    assert e.counters.checkpoints == 1 and e.log.skipped == 0
    # everything released: only the tree holds KV, and the allocator balances
    assert e.cache.protected_size() == 0
    assert e.kv_allocator.available_size() + e.cache.total_size() == 1000


def test_exact_end_checkpoint_cannot_serve_the_next_turn() -> None:
    e = replay(TRACE, end_checkpoint="exact")
    # r0's state sits at 10; r1 shares only 8 tokens of it -> KV hit 8, usable 0.
    assert rows(e)[:2] == [(10, 0, 0), (12, 0, 8)]


def test_kv_only_model_uses_every_kv_hit() -> None:
    e = replay(TRACE, state_slots=0)
    assert rows(e) == [(10, 0, 0), (12, 8, 8), (8, 4, 4), (6, 4, 4)]


def test_concurrency_window_delays_inserts() -> None:
    e = replay(TRACE, concurrency=2)
    # r1 runs beside r0, which has not inserted yet -> cold.  Admitting r2 finishes r0 first.
    assert rows(e)[:3] == [(10, 0, 0), (12, 0, 0), (8, 0, 4)]


def test_chunk_checkpoints_along_a_long_prompt() -> None:
    long = block_req([0, 1, 2, 3, 4], 20)
    e = replay([long, block_req([0, 1, 2, 7], 16)], chunk_size=6)
    # the first prompt checkpoints at 6, 12, 18 (chunk ends < 20) and keeps 20 tokens;
    # the second matches 12 KV tokens (blocks 0, 1, 2) and resumes from the state at 12
    assert e.counters.checkpoints == 3
    assert rows(e)[1] == (16, 12, 12)


def test_too_large_a_request_is_skipped() -> None:
    e = replay([block_req([0, 1, 2], 10, out=0), block_req([9] * 1, 4)], kv_tokens=8)
    assert e.log.skipped == 1 and len(e.log) == 1
    assert e.kv_allocator.available_size() + e.cache.total_size() == 8


def test_mooncake_prefix_under_memory_pressure_keeps_the_invariants() -> None:
    trace = load_trace(max_requests=50)
    e = replay(trace, kv_tokens=150_000, state_slots=6, concurrency=4, page_size=16)
    assert e.log.skipped == 0 and len(e.log) == 50
    assert e.counters.evicted_kv_tokens > 0 and e.counters.evicted_states > 0
    assert e.kv_allocator.available_size() + e.cache.total_size() == 150_000 // 16 * 16
    assert e.state_pool is not None
    assert e.state_pool.available_size() + e.cache.state_evictable_size() == 6


def test_cli_writes_json_with_one_run_per_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_ = [
        {"timestamp": i, "input_length": 1000 + i, "output_length": 5, "hash_ids": [0, 1 + i]}
        for i in range(6)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    out = tmp_path / "r.json"
    argv = [
        "--trace",
        str(trace),
        "--policy",
        "lru",
        "gds",
        "--kv-tokens",
        "100K",
        "--state-slots",
        "8",
        "--concurrency",
        "1",
        "--no-progress",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "token hit rate" in table and "end checkpoint: block" in table
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["runs"]] == ["lru", "gds"]
    assert data["engine"]["end_checkpoint"] == "block" and data["trace"]["requests"] == 6
    # one at a time, requests 1..5 resume from the state at the end of block 0 (512 tokens)
    assert data["runs"][0]["usable_tokens"] == data["bounds"]["sparse_hit_tokens"] == 5 * 512
    assert_usage_error(main, ["--trace", str(trace), "--policy", "nope", "--no-progress"])


def test_parse_count() -> None:
    assert [parse_count(s) for s in ("16000000", "16e6", "16M", "512K", "1_000")] == [
        16_000_000
    ] * 3 + [512_000, 1000]


def test_plot_needs_a_single_memory_sweep(tmp_path: Path) -> None:
    # no sweep: refused before any replay
    assert_usage_error(main, ["--max-requests", "5", "--plot", str(tmp_path / "p.png"),
                              "--no-progress"])
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    argv = [
        "--max-requests",
        "20",
        "--state-slots",
        "4",
        "16",
        "--policy",
        "lru",
        "gds",
        "--plot",
        str(png),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert png.stat().st_size > 1000
