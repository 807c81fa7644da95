"""The replay with a host tier: ``--hicache-ratio`` / ``--hicache-write-policy``, the engine's
load-back before locking, and the host counters in the table and the JSON."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.engine.core import EngineConfig
from bench.runs.replay import _configs, build_parser, main
from bench.traces.loader import TraceRequest
from tests.helpers.replay_helpers import assert_usage_error, replay, rows


def block_req(ids: list[int], length: int, out: int = 2, block: int = 16) -> TraceRequest:
    """A Mooncake-style request with block size 16 (block h = tokens 16h+1 .. 16h+16)."""
    runs = tuple((h * block + 1, min(block, length - j * block)) for j, h in enumerate(ids))
    return TraceRequest(0.0, length, out, block, tuple(ids), runs)


# r0: blocks 0 1 (32 tokens)   r1: blocks 2 3   r2: blocks 0 1 4 (48 tokens)
TRACE = [block_req([0, 1], 32), block_req([2, 3], 32), block_req([0, 1, 4], 48)]


def test_engine_loads_back_a_host_hit_before_locking() -> None:
    e = replay(TRACE, kv_tokens=64, state_slots=0, hicache_ratio=4.0)
    c = e.cache
    assert c.hicache is not None and c.hicache.host_kv.size == 256
    # r1 pushes r0's 32 tokens to host; r2 finds them there, loads them back and uses them.
    assert rows(e) == [(32, 0, 0), (32, 0, 0), (48, 32, 32)]
    st = c.stats()
    assert (st["host_hit_tokens"], st["load_back_tokens"]) == (32, 32)
    assert st["backup_tokens"] == 32 + 32 + 16  # r0, r1, r2's new block (write_through)
    assert e.kv_allocator.available_size() + c.total_size() == 64
    assert c.hicache.host_kv.available_size() + c.host_size() == 256


def test_without_a_host_tier_the_same_trace_recomputes() -> None:
    e = replay(TRACE, kv_tokens=64, state_slots=0)
    assert e.cache.hicache is None
    assert rows(e) == [(32, 0, 0), (32, 0, 0), (48, 0, 0)]
    st = e.cache.stats()
    assert (st["host_hit_tokens"], st["load_back_tokens"], st["backup_tokens"]) == (0, 0, 0)


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_engine_write_policies(policy: str) -> None:
    e = replay(TRACE, kv_tokens=64, state_slots=0, hicache_ratio=4.0, hicache_write_policy=policy)
    assert e.cache.hicache is not None
    assert e.cache.hicache.config.hicache_write_policy == policy
    if policy == "write_back":  # r0 is written back when r1 evicts it: the same hit
        assert rows(e) == [(32, 0, 0), (32, 0, 0), (48, 32, 32)]
    else:  # each prompt was inserted once: never hit twice, never backed up, evicted
        assert rows(e) == [(32, 0, 0), (32, 0, 0), (48, 0, 0)]
        assert e.cache.stats()["backup_tokens"] == 0


def conversations(seed: int, sessions: int = 10, turns: int = 4) -> list[TraceRequest]:
    """Multi-turn sessions, interleaved at random: each turn repeats the session's previous
    prompt and adds one to three blocks of 16 tokens, plus a partial block sometimes."""
    rng = random.Random(seed)
    blocks = {s: [1000 * s + j for j in range(8)] for s in range(sessions)}
    order = [s for s in range(sessions) for _ in range(turns)]
    rng.shuffle(order)
    done = dict.fromkeys(range(sessions), 0)
    out = []
    for s in order:
        done[s] = min(done[s] + rng.randint(1, 3), 8)
        ids = blocks[s][:done[s]]
        length = 16 * len(ids) - rng.choice([0, 0, 5])
        out.append(block_req(ids, length, out=rng.randint(0, 4)))
    return out


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("state_slots", [0, 8])
def test_interleaved_conversations_keep_every_invariant(write_policy: str, state_slots: int) -> None:
    trace = conversations(seed=5)
    kw = dict(kv_tokens=200, state_slots=state_slots, concurrency=3, chunk_size=32)
    on = replay(trace, hicache_ratio=4.0, hicache_write_policy=write_policy, **kw)
    off = replay(trace, **kw)
    c = on.cache
    assert c.hicache is not None
    assert on.log.skipped == off.log.skipped == 0 and c.protected_size() == 0
    assert on.kv_allocator.available_size() + c.total_size() == 200
    assert c.hicache.host_kv.available_size() + c.host_size() == c.hicache.host_kv.size
    if state_slots:
        assert on.state_pool is not None and c.hicache.host_state is not None
        assert on.state_pool.available_size() + c.state_evictable_size() == state_slots
    st = c.stats()
    assert st["backup_tokens"] > 0 and st["load_back_tokens"] > 0
    # On this trace the host tier turns recomputed turns into hits.
    assert sum(on.log.usable_len) > sum(off.log.usable_len)


# ======================================================================== CLI
def three_conversations(tmp_path: Path) -> Path:
    """A Mooncake trace file of three conversations of three turns, interleaved; each turn
    adds one 512-token block (9 requests, 9,216 prompt tokens)."""
    rows = [
        {"timestamp": 3 * t + c, "input_length": 512 * (t + 1), "output_length": 2,
         "hash_ids": [10 * c + j for j in range(t + 1)]}
        for t in range(3)
        for c in range(3)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trace


def test_cli_runs_without_and_with_the_host_tier_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["--trace", str(three_conversations(tmp_path)), "--policy", "lru", "--kv-tokens", "1600", "--state-slots",
            "0", "--concurrency", "1", "--hicache-ratio", "0", "4", "--no-progress",
            "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "lru host 4x" in table and "host tier: write_through" in table
    for row in ("host hit tokens", "load-back tokens", "backup tokens"):
        assert row in table
    data = json.loads(out.read_text())
    off, on = data["runs"]
    assert (off["hicache_ratio"], on["hicache_ratio"]) == (0.0, 4.0)
    assert (off["hicache_write_policy"], on["hicache_write_policy"]) == (None, "write_through")
    assert (off["host_hit_tokens"], off["load_back_tokens"], off["backup_tokens"]) == (0, 0, 0)
    # 1,600 device tokens hold about one conversation: without a host tier later turns mostly
    # recompute (512 of 9,216 tokens reused); with it every earlier turn comes back from host
    # and the replay reaches the every-block bound: 0 + 512 + 1024 tokens per conversation.
    assert (off["usable_tokens"], on["usable_tokens"]) == (512, 4608)
    assert on["usable_tokens"] == data["bounds"]["every_block_hit_tokens"]
    assert (on["host_hit_tokens"], on["load_back_tokens"]) == (4096, 4096)
    assert on["backup_tokens"] == 9 * 512  # write_through: every inserted block once
    assert on["backup_tokens"] == on["cache_stats"]["backup_tokens"]


def test_cli_runs_a_sliding_window_model_with_the_host_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same three conversations on a model with sliding-window layers (window 256): the
    host tier keeps each turn's full KV and its live window, so later turns hit from host."""
    out = tmp_path / "r.json"
    argv = ["--trace", str(three_conversations(tmp_path)), "--policy", "lru", "--kv-tokens", "1600", "--state-slots",
            "0", "--concurrency", "1", "--sliding-window", "256", "--swa-tokens", "800",
            "--hicache-ratio", "0", "4", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    off, on = json.loads(out.read_text())["runs"]
    assert (off["host_hit_tokens"], off["backup_tokens"]) == (0, 0)
    assert on["host_hit_tokens"] > 0 and on["load_back_tokens"] > 0
    assert on["usable_tokens"] > off["usable_tokens"]


def test_cli_without_the_option_has_no_host_rows(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-requests", "3", "--policy", "lru", "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "host hit tokens" not in table and "host tier" not in table


def test_cli_builds_one_config_per_ratio_and_policy() -> None:
    args = build_parser().parse_args(
        ["--policy", "lru", "gds", "--hicache-ratio", "0", "2.5",
         "--hicache-write-policy", "write_back"]
    )
    cfgs = _configs(args)
    assert [(c.policy, c.hicache_ratio) for c in cfgs] == [
        ("lru", 0.0), ("lru", 2.5), ("gds", 0.0), ("gds", 2.5)]
    assert {c.hicache_write_policy for c in cfgs} == {"write_back"}
    assert cfgs[0].hicache_config() is None
    hc = cfgs[1].hicache_config()
    assert hc is not None and (hc.hicache_ratio, hc.hicache_write_policy) == (2.5, "write_back")
    args = build_parser().parse_args([])
    assert [c.hicache_ratio for c in _configs(args)] == [0.0, 0.0]  # default: off


@pytest.mark.parametrize("argv", [
    ["--hicache-ratio", "0.5"],
    ["--hicache-ratio", "1"],
    ["--hicache-ratio", "-1"],
    ["--hicache-ratio", "nan"],
    ["--hicache-ratio", "inf"],
    ["--hicache-ratio", "four"],
    ["--hicache-write-policy", "write_around"],
])
def test_cli_refuses_bad_host_tier_options(argv: list[str]) -> None:
    assert_usage_error(main, [*argv, "--max-requests", "2", "--no-progress"])


def test_engine_config_validates_the_host_tier() -> None:
    with pytest.raises(ValueError, match="hicache_ratio must be a finite number > 1"):
        EngineConfig(hicache_ratio=1.0)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        EngineConfig(hicache_ratio=2.0, hicache_write_policy="nope")
    assert EngineConfig(hicache_ratio=2.0, sliding_window=8, swa_tokens=100).hicache_config()
    assert EngineConfig(hicache_write_policy="nope").hicache_config() is None  # off: unused
