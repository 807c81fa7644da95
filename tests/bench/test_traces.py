"""Trace loaders (bench/traces/loader.py) and infinite-memory bounds (bench/engine/bounds.py).

Narrated cases on tiny hand-written traces with exact token ids and bounds computed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.bounds import compute_bounds
from bench.traces.loader import (
    SHIPPED_TRACE,
    TraceFormatError,
    TraceRequest,
    load_trace,
    resolve_trace_path,
)


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mooncake_row(ts: int, length: int, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}


# --------------------------------------------------------------------------- Mooncake


def test_mooncake_block_h_is_ids_hB_plus_1_and_last_block_is_partial(tmp_path: Path) -> None:
    # block size 4: ids [2, 7] with 6 tokens -> block 2 = 9..12, block 7 (partial, 2) = 29, 30
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(1500, 6, [2, 7])])
    (req,) = load_trace(path, mooncake_block_size=4)
    assert req.tokens == [9, 10, 11, 12, 29, 30]
    assert all(type(t) is int for t in req.tokens)
    assert req.input_length == 6 and req.output_length == 10
    assert req.block_size == 4 and req.num_full_blocks == 1 and req.block_ids == (2, 7)
    assert req.timestamp_s == 0.0 and req.session is None


def test_mooncake_consecutive_ids_merge_into_one_run(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, 10, [0, 1, 2])])
    (req,) = load_trace(path, mooncake_block_size=4)
    assert req.runs == ((1, 10),)
    assert req.tokens == list(range(1, 11))


def test_mooncake_timestamps_are_seconds_since_the_first(tmp_path: Path) -> None:
    rows = [mooncake_row(1000, 4, [0]), mooncake_row(3500, 4, [1])]
    reqs = load_trace(write_jsonl(tmp_path / "t.jsonl", rows), mooncake_block_size=4)
    assert [r.timestamp_s for r in reqs] == [0.0, 2.5]


def test_mooncake_wrong_number_of_ids_names_the_line(tmp_path: Path) -> None:
    rows = [mooncake_row(0, 4, [0]), mooncake_row(1, 9, [0, 1])]  # 9 tokens need 3 blocks
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: 2 hash_ids for input_length 9"):
        load_trace(path, mooncake_block_size=4)


def test_shipped_trace_is_the_default_and_max_requests_cuts() -> None:
    assert resolve_trace_path(None) == SHIPPED_TRACE
    reqs = load_trace(max_requests=3)
    assert len(reqs) == 3
    assert reqs[0].input_length == 6758 and reqs[0].block_ids[:3] == (0, 1, 2)
    assert len(reqs[0].tokens) == 6758 and reqs[0].tokens[-1] == 13 * 512 + (6758 - 13 * 512)


# --------------------------------------------------------------------------- GMI


def test_gmi_every_id_is_32_tokens_and_ns_timestamps(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": "1753694362000000000",
            "input_length": 50,
            "output_length": 3,
            "hash_ids": [5, 9],
        },
        {
            "timestamp": "1753694362500000000",
            "input_length": 7,
            "output_length": 1,
            "hash_ids": [5],
        },
    ]
    first, second = load_trace(write_jsonl(tmp_path / "g.jsonl", rows))
    # the file's input_length (50, 7) is replaced by 32 * len(hash_ids)
    assert first.input_length == 64 and second.input_length == 32
    assert first.tokens == list(range(161, 193)) + list(range(289, 321))
    assert second.tokens == first.tokens[:32]
    assert first.block_size == 32 and first.num_full_blocks == 2
    assert second.timestamp_s == pytest.approx(0.5)


# --------------------------------------------------------------------------- TraceLab


def tracelab_row(session: str, rnd: int, prefix: int, fresh: int, stamp: str) -> dict[str, object]:
    return {
        "session_id": session,
        "round_index": rnd,
        "input_tokens_total": prefix + fresh,
        "prefix_tokens": prefix,
        "newly_append_tokens": fresh,
        "output_tokens": 7,
        "timing_events": [{"event_type": "user_message", "timestamp": stamp}],
    }


def test_tracelab_rounds_chain_within_a_session(tmp_path: Path) -> None:
    rows = [
        tracelab_row("a", 0, 2, 3, "2026-01-01T00:00:00.000Z"),  # first round: all 5 fresh
        tracelab_row("a", 1, 4, 2, "2026-01-01T00:00:10.000Z"),  # 4 of round 0 + 2 fresh
        tracelab_row("a", 2, 1, 1, "2026-01-01T00:00:20.000Z"),  # 1 of round 1 + 1 fresh
        tracelab_row("b", 0, 0, 2, "2026-01-01T00:00:05.000Z"),  # another session, later file line
    ]
    reqs = load_trace(write_jsonl(tmp_path / "tl.jsonl", rows))
    assert [r.session for r in reqs] == ["a", "b", "a", "a"]  # sorted by time, stable
    a0, b0, a1, a2 = reqs
    assert a0.tokens == [1, 2, 3, 4, 5]
    assert a1.tokens == [1, 2, 3, 4, 6, 7]
    assert a2.tokens == [1, 8]
    assert b0.tokens == [9, 10]  # fresh ids never repeat across sessions
    assert [r.timestamp_s for r in reqs] == [0.0, 5.0, 10.0, 20.0]
    assert a1.block_size == 1 and a1.block_ids == tuple(a1.tokens) and a1.output_length == 7


def test_tracelab_block_size_gives_content_block_ids(tmp_path: Path) -> None:
    rows = [
        tracelab_row("a", 0, 0, 4, "2026-01-01T00:00:00Z"),
        tracelab_row("a", 1, 2, 2, "2026-01-01T00:00:01Z"),
    ]
    first, second = load_trace(write_jsonl(tmp_path / "tl.jsonl", rows), tracelab_block_size=2)
    assert first.block_ids[0] == second.block_ids[0] and first.block_ids[1] != second.block_ids[1]


# --------------------------------------------------------------------------- validation


def test_missing_file_and_bad_lines(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(mooncake_row(0, 4, [0])) + "\n\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3: not valid JSON"):
        load_trace(bad)
    missing = write_jsonl(tmp_path / "m.jsonl", [{"timestamp": 0, "hash_ids": [0]}])
    with pytest.raises(TraceFormatError, match=r"m\.jsonl:1: missing field 'input_length'"):
        load_trace(missing)
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"foo": 1}])
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(unknown)
    mixed = write_jsonl(
        tmp_path / "x.jsonl",
        [
            mooncake_row(0, 4, [0]),
            {"timestamp": "5", "input_length": 4, "output_length": 0, "hash_ids": [1]},
        ],
    )
    with pytest.raises(TraceFormatError, match=r"x\.jsonl:2: line looks like 'gmi'"):
        load_trace(mixed)


# --------------------------------------------------------------------------- bounds


def req(ids: list[int], length: int, block: int = 4) -> TraceRequest:
    return TraceRequest(0.0, length, 0, block, tuple(ids), ())


def test_bounds_by_hand() -> None:
    # block 4.   r0: [1,2,3] 12 tokens -> nothing cached.
    #            r1: [1,2,4] 11 tokens -> matches 2 blocks (8 tokens). Sparse: node "1,2" is
    #                neither an earlier prompt end (r0's is "1,2,3") nor a branch yet -> 0.
    #                r1 has 11 // 4 = 2 full blocks, so "1,2" becomes a prompt end (and a branch).
    #            r2: [1,2,4]  9 tokens -> matches 3 blocks, capped at 9. Sparse: "1,2,4" is
    #                no prompt end and no branch; "1,2" is both -> 8.
    #            r3: [1,2,3] 12 tokens -> 3 blocks = 12; r0's prompt end is "1,2,3" -> 12.
    trace = [req([1, 2, 3], 12), req([1, 2, 4], 11), req([1, 2, 4], 9), req([1, 2, 3], 12)]
    b = compute_bounds(trace)
    assert b.prompt_tokens == 44
    assert b.every_block_hit_tokens == 0 + 8 + 9 + 12
    assert b.sparse_hit_tokens == 0 + 0 + 8 + 12
    assert b.every_block_hit_rate == pytest.approx(29 / 44)
    # replay convention: at most input_length - 1, and a stop point must lie at or below it:
    # r2 -> min(12, 8) = 8; r3 -> every-block 11, sparse: 12 > 11 so back to the branch at 8.
    r = compute_bounds(trace, exclude_last_token=True)
    assert (r.every_block_hit_tokens, r.sparse_hit_tokens) == (0 + 8 + 8 + 11, 0 + 0 + 8 + 8)
    # page size 3 aligns every hit down: 8 -> 6, 11 -> 9
    p = compute_bounds(trace, exclude_last_token=True, page_size=3)
    assert (p.every_block_hit_tokens, p.sparse_hit_tokens) == (0 + 6 + 6 + 9, 0 + 0 + 6 + 6)


def test_bounds_reject_mixed_block_sizes() -> None:
    with pytest.raises(ValueError, match="one block size"):
        compute_bounds([req([1], 4, block=4), req([1], 4, block=8)])


def test_bounds_match_the_trace_notes_on_the_shipped_mooncake_trace() -> None:
    b = compute_bounds(load_trace())
    assert b.every_block_hit_rate == pytest.approx(0.3736, abs=5e-5)
    assert b.sparse_hit_rate == pytest.approx(0.3586, abs=5e-5)


# ------------------------------------------------------------------ refused values
@pytest.mark.parametrize("block", [512, 1])
def test_a_hash_id_whose_tokens_leave_int64_names_the_line(tmp_path: Path, block: int) -> None:
    """Block ``h`` holds token ids up to ``h*B + B``: past int64 they cannot be tokens."""
    top = (2**63 - 1 - block) // block  # the largest id whose tokens still fit
    ok = write_jsonl(tmp_path / "ok.jsonl", [mooncake_row(0, block, [top])])
    assert load_trace(ok, mooncake_block_size=block)[0].tokens[-1] == top * block + block
    bad = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, block, [1]),
                                             mooncake_row(1, block, [top + 1])])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: .*hash_id.*int64"):
        load_trace(bad, mooncake_block_size=block)
    huge = write_jsonl(tmp_path / "h.jsonl", [mooncake_row(0, block, [2**64])])
    with pytest.raises(TraceFormatError, match=r"h\.jsonl:1: .*int64"):
        load_trace(huge, mooncake_block_size=block)


def test_gmi_hash_ids_past_int64_are_refused(tmp_path: Path) -> None:
    rows = [{"timestamp": "1", "output_length": 1, "hash_ids": [2**58]}]
    with pytest.raises(TraceFormatError, match=r"g\.jsonl:1: .*int64"):
        load_trace(write_jsonl(tmp_path / "g.jsonl", rows))


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_timestamps_name_the_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(mooncake_row(0, 4, [1])) + "\n"
                    + f'{{"timestamp": {bad}, "input_length": 4, "output_length": 1, "hash_ids": [2]}}\n')
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: 'timestamp' must be a finite"):
        load_trace(path, mooncake_block_size=4)


def test_decreasing_timestamps_name_the_line(tmp_path: Path) -> None:
    rows = [mooncake_row(0, 4, [1]), mooncake_row(10, 4, [2]), mooncake_row(10, 4, [3]),
            mooncake_row(5, 4, [4])]
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:4: timestamp 5 is before the previous "
                                               r"line's 10"):
        load_trace(write_jsonl(tmp_path / "t.jsonl", rows), mooncake_block_size=4)
    gmi = [{"timestamp": "20", "output_length": 1, "hash_ids": [1]},
           {"timestamp": "10", "output_length": 1, "hash_ids": [2]}]
    with pytest.raises(TraceFormatError, match=r"g\.jsonl:2: timestamp"):
        load_trace(write_jsonl(tmp_path / "g.jsonl", gmi))
    neg = [{"timestamp": "-1", "output_length": 1, "hash_ids": [1]}]
    with pytest.raises(TraceFormatError, match=r"n\.jsonl:1: 'timestamp'"):
        load_trace(write_jsonl(tmp_path / "n.jsonl", neg))


@pytest.mark.parametrize("bad", ["true", "-1", "1.5", '"7"', "null"])
def test_a_hash_id_that_is_not_a_non_negative_int_names_itself(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1030, "output_length": 1, '
                    f'"hash_ids": [4, {bad}, 6]}}\n')
    with pytest.raises(TraceFormatError,
                       match=r"t\.jsonl:1: 'hash_ids' must hold non-negative integers, got "):
        load_trace(path)


def test_a_non_utf8_trace_names_the_file_and_the_line(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff ...`` with neither the
    file nor the line."""
    from bench import cli

    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(json.dumps(mooncake_row(0, 4, [0])).encode() + b"\n\xff{}\n")
    with pytest.raises(TraceFormatError, match=r"latin\.jsonl:2: not UTF-8 text \(byte 0xff at "
                                               r"column 1\)"):
        load_trace(bad)
    with pytest.raises(SystemExit) as info:
        cli.main(["replay", "--trace", str(bad), "--policy", "lru"])
    assert info.value.code == 2
    assert f"replay: error: {bad}:2: not UTF-8 text (byte 0xff" in capsys.readouterr().err


@pytest.mark.parametrize("events", [5, "2026-01-01T00:00:00Z", {"timestamp": "x"}, [3]])
def test_tracelab_timing_events_not_a_list_of_objects_names_the_line(
        tmp_path: Path, events: object) -> None:
    """``timing_events`` is a list of event objects; anything else is a TraceFormatError
    naming the file, the line and the field (it was a bare ``TypeError: 'int' object is not
    iterable``, or, for a string or a map, silently no time)."""
    good = tracelab_row("a", 0, 0, 2, "2026-01-01T00:00:00Z")
    bad = {**tracelab_row("b", 0, 0, 2, "2026-01-01T00:00:01Z"), "timing_events": events}
    path = write_jsonl(tmp_path / "tl.jsonl", [good, bad])
    with pytest.raises(TraceFormatError, match=r"tl\.jsonl:2: 'timing_events' must be a list"):
        load_trace(path)


def test_mooncake_line_may_carry_a_session(tmp_path: Path) -> None:
    """An optional ``session`` (str or int; what ``workloads --out`` writes) becomes
    ``TraceRequest.session`` (an int as its decimal text, as TraceLab's session_id); any other
    type names the line."""
    rows = [{**mooncake_row(0, 4, [0]), "session": "a"}, {**mooncake_row(1, 4, [0]), "session": 7},
            mooncake_row(2, 4, [0])]
    got = load_trace(write_jsonl(tmp_path / "s.jsonl", rows), mooncake_block_size=4)
    assert [r.session for r in got] == ["a", "7", None]
    bad = write_jsonl(tmp_path / "b.jsonl", [{**mooncake_row(0, 4, [0]), "session": [1]}])
    with pytest.raises(TraceFormatError, match=r"b\.jsonl:1: 'session' must be a string or an "
                                               r"integer, got \[1\]"):
        load_trace(bad, mooncake_block_size=4)
