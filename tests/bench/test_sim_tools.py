"""Trace tools: ``bench.traces.stats`` and the TraceLab -> Mooncake converter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.traces.convert import block_runs, convert, to_mooncake_lines
from bench.traces.loader import TraceRequest, load_trace
from bench.traces.stats import block_reuse, trace_stats
from bench.traces.stats import main as stats_main

TRACELAB = Path(__file__).resolve().parents[3] / "shared" / "traces" / "tracelab_example_round_trace.jsonl"


def req(ids: list[int], length: int, ts: float = 0.0) -> TraceRequest:
    runs = tuple((h * 4 + 1, min(4, length - j * 4)) for j, h in enumerate(ids))
    return TraceRequest(ts, length, 2, 4, tuple(ids), runs)


def test_block_reuse_by_hand() -> None:
    # r1 repeats block 0 then diverges; r2 repeats 0,1 (and id 5 at another position)
    trace = [req([0, 1, 2], 12), req([0, 5], 8), req([0, 1, 5], 12, 10.0)]
    r = block_reuse(trace)
    assert (r.total_blocks, r.unique_ids, r.repeated_ids) == (8, 4, 4)
    assert r.matched_blocks == 1 + 2 and r.trie_reuse == pytest.approx(3 / 8)
    assert (r.trie_nodes, r.branch_nodes) == (5, 2)  # 0,1,2 + 0->5 + 0,1->5: 0 and 1 branch
    assert r.per_request_share[0] == pytest.approx((0 + 0.5 + 2 / 3) / 3)
    s = trace_stats(trace)
    assert s["requests"] == 3 and s["span_s"] == 10.0 and s["input_tokens"] == 32
    assert s["bounds_whole_prompt"]["every_block_hit_tokens"] == 4 + 8


def test_trace_stats_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 1,
                                        "hash_ids": [0, 1 + i]}) + "\n" for i in range(3)))
    assert stats_main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "requests: 3" in out and "every block" in out
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["repeat_fraction"] == pytest.approx(2 / 6)


def test_block_runs() -> None:
    assert list(block_runs(((1, 5), (100, 3)), 4)) == [((1, 4),), ((5, 1), (100, 3))]
    assert list(block_runs(((7, 8),), 4)) == [((7, 4),), ((11, 4),)]


@pytest.mark.skipif(not TRACELAB.is_file(), reason="shared TraceLab example not present")
@pytest.mark.parametrize("block", [64, 512])
def test_tracelab_conversion_keeps_whole_shared_blocks(tmp_path: Path, block: int) -> None:
    rounds = load_trace(TRACELAB, fmt="tracelab")
    out = tmp_path / "tl.jsonl"
    assert convert(TRACELAB, out, block) == len(rounds) == 19
    back = load_trace(out, fmt="mooncake", mooncake_block_size=block)
    assert [r.input_length for r in back] == [r.input_length for r in rounds]
    assert [r.timestamp_s for r in back] == pytest.approx([r.timestamp_s for r in rounds], abs=1e-3)
    by_session: dict[str, int] = {}
    for k, r in enumerate(rounds):
        prev = by_session.get(r.session)  # type: ignore[arg-type]
        by_session[r.session] = k  # type: ignore[index]
        if prev is None:
            continue
        a, b = rounds[prev].tokens, r.tokens
        shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        ids_a, ids_b = back[prev].block_ids, back[k].block_ids
        common = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y),
                      min(len(ids_a), len(ids_b)))
        assert common == shared // block


def test_converted_ids_are_prefix_chained() -> None:
    # two rounds with the same second block content after different first blocks get
    # different ids (an id stands for the block *and* its whole prefix)
    a = TraceRequest(0.0, 8, 1, 1, (), ((1, 4), (50, 4)), "s")
    b = TraceRequest(1.0, 8, 1, 1, (), ((9, 4), (50, 4)), "t")
    c = TraceRequest(2.0, 6, 1, 1, (), ((1, 4), (50, 2)), "s")
    lines = to_mooncake_lines([a, b, c], 4)
    assert [x["hash_ids"] for x in lines] == [[0, 1], [2, 3], [0, 4]]
    assert lines[2]["timestamp"] == 2000 and lines[0]["session_id"] == "s"
