"""``--state-fraction unified`` in ``python -m bench replay`` and ``simulate``: the unified
arena (``bench.engine.arena``) sized from bytes (``bench.engine.presets.arena_layout``), checked
against ``python -m bench memory-split``'s records of the same budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.engine.core import EngineConfig
from bench.engine.presets import (
    GB,
    SGLANG_DEFAULT_FRACTION,
    ArenaLayout,
    arena_layout,
    engine_sizes,
    get_preset,
)
from bench.runs import memory_split, replay, simulate

#: Small enough that every request fits every budget below (no request skipped), so the
#: hit rates of the three commands are over the same requests.
WORKLOAD = "multiturn:sessions=8,turns=4"
MODEL = ["--model", "qwen3-next-80b"]


def split_records(tmp_path: Path, gb: str, *extra: str) -> dict[Any, dict[str, Any]]:
    """memory-split's records at ``gb`` (fixed split 0.3 and unified), keyed by split."""
    out = tmp_path / "split.json"
    assert memory_split.main(["--workload", WORKLOAD, *MODEL, "--memory-gb", gb,
                              "--state-fractions", "0.3", "--json", str(out), *extra]) == 0
    recs = {r["split"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {0.3, "unified"} and all(r["skipped"] == 0 for r in recs.values())
    return recs


def test_arena_layout_counts_and_refusals() -> None:
    p = get_preset("qwen3-next-80b")  # 24,576 B per token, 77,266,944 B per state
    lay = arena_layout(p, 10.0, SGLANG_DEFAULT_FRACTION)
    # one chunk = ceil(77,266,944 / 24,576) = 3,144 tokens = one state exactly
    # 129 usable chunks in 10 GB, and the padding chunk on top (as a fixed pool's padding rows)
    assert (lay.tokens_per_chunk, lay.num_chunks) == (3144, 10 * GB // (3144 * 24576) + 1) == (3144, 130)
    assert lay.state_chunks == round(0.9 / 1.9 * 129) == 61
    assert lay.kv_tokens == (130 - 1 - 61) * 3144
    # page 64: a chunk is whole pages, ceil(3,144 / 64) = 50 pages = 3,200 tokens
    assert arena_layout(p, 10.0, 0.5, page_size=64).tokens_per_chunk == 3200
    # two usable chunks (one state, one KV chunk) = 154,533,888 B; one byte less refused
    two = 2 * 3144 * 24576
    assert arena_layout(p, two / GB, 0.5).num_chunks == 3
    with pytest.raises(ValueError, match=r"memory_gb=.* holds 1 arena chunks .* needs 2"):
        arena_layout(p, (two - 1) / GB, 0.5)
    with pytest.raises(ValueError, match="state_fraction"):
        arena_layout(p, 10.0, 1.0)
    with pytest.raises(ValueError, match="page_size"):
        arena_layout(p, 10.0, 0.5, page_size=0)
    with pytest.raises(ValueError, match="state_chunks=2 leaves no KV chunk"):
        ArenaLayout(3144, 3, 2)
    with pytest.raises(ValueError, match="num_chunks must be an int >= 3"):
        ArenaLayout(3144, 2, 1)


def test_engine_config_of_an_arena_must_agree_with_it() -> None:
    p = get_preset("qwen3-next-80b")
    sizes = engine_sizes(p, 10.0, "unified")
    lay = sizes["arena"]
    assert sizes == {"policy": "unified", "kv_tokens": lay.kv_tokens,
                     "state_slots": lay.state_chunks, "arena": lay}
    EngineConfig(**sizes)
    for field, bad in (("policy", "gds"), ("kv_tokens", lay.kv_tokens - 1),
                       ("state_slots", lay.state_chunks + 1)):
        with pytest.raises(ValueError, match=f"^{field}=.* with a unified arena"):
            EngineConfig(**{**sizes, field: bad})
    with pytest.raises(ValueError, match="sliding_window=1024 with a unified arena"):
        EngineConfig(**sizes, sliding_window=1024, swa_tokens=1024)
    with pytest.raises(ValueError, match="not a multiple of page_size=64"):
        EngineConfig(**sizes, page_size=64)  # 3,144 tokens per chunk are not whole pages
    assert engine_sizes(p, 40.0, 0.2) == {"kv_tokens": 1_302_083, "state_slots": 103}
    with pytest.raises(ValueError, match="split must be a state fraction or 'unified'"):
        engine_sizes(p, 40.0, "half")


@pytest.mark.parametrize("gb", ["1", "2"])
def test_replay_unified_matches_memory_split(tmp_path: Path, gb: str) -> None:
    recs = split_records(tmp_path, gb)
    out = tmp_path / "replay.json"
    assert replay.main(["--workload", WORKLOAD, *MODEL, "--memory-gb", gb, "--state-fraction",
                        "0.3", "unified", "--policy", "gds", "--no-progress",
                        "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["split"], r["memory_gb"]) for r in runs] == [
        ("gds", 0.3, float(gb)), ("unified", "unified", float(gb))]
    for r in runs:
        assert r["skipped_requests"] == 0
        assert r["token_hit_rate"] == recs[r["split"]]["token_hit_rate"]
    start = arena_layout(get_preset("qwen3-next-80b"), float(gb), SGLANG_DEFAULT_FRACTION)
    assert (runs[1]["kv_tokens"], runs[1]["state_slots"]) == (start.kv_tokens, start.state_chunks)
    assert recs["unified"]["chunks"] == start.num_chunks
    # the arena run is not the fixed one: on this workload it serves more (a non-vacuous match)
    assert runs[1]["token_hit_rate"] > runs[0]["token_hit_rate"]


@pytest.mark.parametrize("gb", ["1", "2"])
def test_simulate_unified_matches_memory_split(tmp_path: Path, gb: str) -> None:
    # one closed-loop client: the simulator admits in trace order, one request at a time, as
    # the replay engine does at concurrency 1 (with trace arrivals a session's next request
    # waits for its predecessor, and the order, so the hit rate, differs)
    recs = split_records(tmp_path, gb, "--concurrency", "1")
    got = {}
    for split, policy in (("unified", []), ("0.3", ["--policy", "gds"])):
        out = tmp_path / f"sim-{split}.json"
        assert simulate.main(["--workload", WORKLOAD, *MODEL, "--memory-gb", gb,
                              "--state-fraction", split, *policy, "--concurrency", "1",
                              "--arrivals", "closed", "--no-progress", "--jobs", "1",
                              "--json", str(out)]) == 0
        (run,) = json.loads(out.read_text())["runs"]
        assert run["skipped"] == 0
        got[run["split"]] = run["metrics"]["token_hit_rate"]
    assert got == {s: r["token_hit_rate"] for s, r in recs.items()}


def test_tables_name_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate.main(["--workload", WORKLOAD, *MODEL, "--memory-gb", "1",
                          "--state-fraction", "unified", "--no-progress", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.split()[:2] == ["policy", "split"])
    row = lines[lines.index(head) + 1].split()
    assert row[:2] == ["unified", "unified"]
    assert replay.main(["--workload", WORKLOAD, *MODEL, "--memory-gb", "1", "--state-fraction",
                        "unified", "--no-progress"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("memory GB / split")]
    assert line.split()[-3:] == ["1", "/", "unified"]


BAD = [
    (["--state-fraction", "unified"], "--state-fraction needs --memory-gb"),
    (["--model", "qwen3-next-80b", "--memory-gb", "1", "--state-fraction", "unified",
      "--policy", "lru"], "--policy lru: --state-fraction unified runs one policy"),
    (["--model", "qwen3-next-80b", "--memory-gb", "1", "--state-fraction", "unify"],
     "argument --state-fraction: expected a number in [0, 1) or 'unified'"),
    (["--model", "qwen3-next-80b", "--memory-gb", "0.1", "--state-fraction", "unified"],
     "memory_gb=0.1 holds 1 arena chunks"),
    (["--model", "qwen3-next", "--memory-gb", "1"], "argument --model: invalid choice"),
    # the unified policy weighs bytes: only the arena has them (it was a ValueError traceback
    # from the first run's cache)
    (["--policy", "unified"], "--policy unified: only --state-fraction unified"),
    (["--policy", "lru", "unified", "--model", "qwen3-next-80b", "--memory-gb", "1",
      "--state-fraction", "0.2"], "--policy unified: only --state-fraction unified"),
]
BAD_SIMULATE = [
    (["--model", "qwen3-next-80b", "--memory-gb", "1", "--state-fraction", "unified",
      "--sweep", "state-fraction=0.1,0.2"], "--sweep state-fraction: --state-fraction unified"),
]
BAD_REPLAY = [
    (["--memory-gb", "1"], "--memory-gb needs --model"),
    (["--model", "qwen3-next-80b", "--memory-gb", "1", "--state-slots", "64"],
     "--state-slots would be ignored"),
    (["--model", "qwen3-next-80b", "--memory-gb", "1", "--state-fraction", "unified",
      "--hicache-ratio", "2"], "--hicache-ratio: --state-fraction unified has no such pool"),
    (["--model", "qwen3-next-80b", "--memory-gb", "1", "--state-fraction", "unified",
      "--sliding-window", "512"], "--sliding-window: --state-fraction unified has no such pool"),
    (["--policy", "gds", "unified", "--model", "qwen3-next-80b", "--memory-gb", "1",
      "--state-fraction", "0.2", "unified"], "--policy unified: only --state-fraction unified"),
]


@pytest.mark.parametrize(("command", "argv", "message"), [
    *((simulate, a, m) for a, m in BAD + BAD_SIMULATE),
    *((replay, a, m) for a, m in BAD + BAD_REPLAY),
])
def test_bad_combinations_exit_2_naming_the_option(
        command: Any, argv: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        command.main(["--workload", WORKLOAD, "--no-progress", *argv])
    assert exc.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and message in err[0], err


def test_unified_run_counts_its_evictions() -> None:
    # the arena engine's eviction counters are the sum of make_room's EvictResults; the cache
    # counts the same evictions on its own (its stats), so the two must agree, and at 1 GB
    # this workload must evict (else the check is vacuous)
    from bench.engine.arena import ArenaReplayEngine
    from bench.workloads import generate

    p = get_preset("qwen3-next-80b")
    engine = ArenaReplayEngine(EngineConfig(**engine_sizes(p, 1.0, "unified")))
    for i, req in enumerate(generate(WORKLOAD, seed=0)):
        engine.admit(req, rid=i)
    engine.drain()
    st = engine.cache.stats()
    c = engine.counters
    assert c.evicted_kv_tokens > 0 and c.evicted_states > 0
    assert (c.evicted_kv_tokens, c.evicted_states) == (st["evicted_tokens"], st["evicted_states"])
