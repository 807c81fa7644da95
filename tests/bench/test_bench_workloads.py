"""The generated workloads (bench/workloads) and the robustness table's bookkeeping
(bench/robustness): determinism, the sharing structure each shape promises, the errors at the
boundary, a trace slice re-timed from 0, and the verdict computed by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.runs.robustness import ALL_SOURCES, HOLDOUT, SOURCES, Source, verdict
from bench.traces.loader import TraceRequest, load_trace
from bench.workloads import generate, parse_spec


def shared_blocks(a: TraceRequest, b: TraceRequest) -> int:
    n = 0
    for x, y in zip(a.block_ids, b.block_ids, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_generators_are_deterministic_per_seed() -> None:
    for spec in ("docqa:docs=3", "agentic:sessions=4", "multiturn:sessions=5", "toolcall:sessions=4",
                 "sysprompt:requests=20", "mix:docqa=0.05,agentic=0.05,multiturn=0.05,sysprompt=0.05"):
        a, b = generate(spec, seed=3), generate(spec, seed=3)
        assert a == b and a, spec
        assert generate(spec, seed=4) != a, spec
        times = [r.timestamp_s for r in a]
        assert times == sorted(times) and times[0] == 0.0, spec
        for r in a:
            assert r.block_size == 64 and r.input_length == sum(n for _, n in r.runs)
            assert len(r.block_ids) == -(-r.input_length // 64)


def test_docqa_questions_share_their_document_and_all_share_the_system_prompt() -> None:
    """Two documents, questions on them, no follow-ups: the 768-token system prompt is
    12 blocks shared by every request; the questions on one document share all of its
    blocks (the document is a whole number of blocks), the two documents nothing past the
    system prompt."""
    reqs = generate("docqa:docs=2,questions=6,followup_p=0", seed=0)
    by_doc: dict[str | None, list[TraceRequest]] = {}
    for r in reqs:
        by_doc.setdefault(r.session, []).append(r)
    assert set(by_doc) <= {"doc0", "doc1"} and len(reqs) == sum(map(len, by_doc.values()))
    firsts = [v[0] for v in by_doc.values()]
    assert len(firsts) == 2 and shared_blocks(*firsts) == 12
    multi = [qs for qs in by_doc.values() if len(qs) >= 2]  # questions: geometric, mean 6
    assert multi
    for qs in multi:
        doc = {shared_blocks(a, b) for a in qs for b in qs if a is not b}
        assert len(doc) == 1  # every question leaves the document where it ends
        (blocks,) = doc
        assert blocks >= 12 + 2_000 // 64  # a document has at least 2,000 tokens
        for q in qs:  # then the question, 8 - 1,500 fresh tokens
            assert 8 <= q.input_length - 64 * blocks <= 1_500


def test_spec_errors_name_the_parameter() -> None:
    assert parse_spec("docqa:docs=20,questions=8") == ("docqa", {"docs": 20, "questions": 8.0})
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        parse_spec("nope")
    with pytest.raises(ValueError, match="no parameter 'foo'"):
        parse_spec("docqa:foo=1")
    with pytest.raises(ValueError, match="must be KEY=VALUE"):
        parse_spec("docqa:docs")
    with pytest.raises(ValueError, match="docs='2.5' is not a"):
        parse_spec("docqa:docs=2.5")
    with pytest.raises(ValueError, match="docs must be >= 0"):
        generate("docqa:docs=-1")


def test_holdout_sources_are_apart_and_a_trace_slice_is_retimed() -> None:
    assert not set(SOURCES) & set(HOLDOUT) and set(ALL_SOURCES) == set(SOURCES) | set(HOLDOUT)
    whole = load_trace(None, max_requests=8)
    part = Source("slice", None, None, 5, skip=3).load(Path("."))
    assert part is not None and len(part) == 5
    t0 = whole[3].timestamp_s
    for got, want in zip(part, whole[3:], strict=True):
        assert got.block_ids == want.block_ids
        assert got.timestamp_s == pytest.approx(want.timestamp_s - t0)


def grid_rows(slots: int, hits: dict[str, float]) -> list[dict[str, object]]:
    return [{"source": "s", "state_slots": slots, "kv_tokens": 16_000_000,
             "concurrency": 16, "policy": p, "token_hit_rate": h} for p, h in hits.items()]


def test_verdict_by_hand() -> None:
    """Point 64: adaptive 0.30, best baseline seglen 0.31 (margin -0.01 < -0.005: a failure),
    belady 0.40 (headroom 0.09 >= 0.02; captured (0.30 - 0.31) / 0.09 = -0.111: a failure).
    Point 256: adaptive 0.50, best marconi 0.49 (+0.01), belady 0.52 (headroom 0.03,
    captured 0.01 / 0.03 = 0.333: a failure, margin fine). Point 1,024: adaptive 0.600, best
    gdsf 0.604 (margin -0.004: passes), belady 0.612 (headroom 0.008 < 0.02: not counted).
    Point 4,096: adaptive 0.70, best lru 0.60, belady 0.70 (captured 1.0: passes). No
    online policy beats belady anywhere."""
    v = verdict(
        grid_rows(64, {"lru": 0.2, "gds": 0.25, "gdsf": 0.29, "seglen": 0.31, "marconi": 0.1,
                       "gds_adaptive": 0.30, "belady": 0.40})
        + grid_rows(256, {"lru": 0.45, "gds": 0.48, "gdsf": 0.47, "seglen": 0.3,
                          "marconi": 0.49, "gds_adaptive": 0.50, "belady": 0.52})
        + grid_rows(1024, {"lru": 0.5, "gds": 0.6, "gdsf": 0.604, "gds_adaptive": 0.600,
                           "belady": 0.612})
        + grid_rows(4096, {"lru": 0.60, "gds_adaptive": 0.70, "belady": 0.70}))
    assert v["points"] == 4 and v["headroom_points"] == 3
    assert v["worst_margin"].key[1] == 64 and v["worst_margin"].best_name == "seglen"
    assert v["worst_margin"].margin == pytest.approx(-0.01)
    assert [f.key[1] for f in v["margin_failures"]] == [64]
    assert [f.key[1] for f in v["captured_failures"]] == [64, 256]  # worst first
    assert v["captured_failures"][0].captured == pytest.approx(-0.01 / 0.09)
    assert v["captured_failures"][1].captured == pytest.approx(0.01 / 0.03)
    assert v["worst_captured"].key[1] == 64
    assert v["reference_bugs"] == []


def test_verdict_reports_a_reference_bug_loudly() -> None:
    """At 64 slots marconi (0.41) and gds_adaptive (0.405) beat belady (0.40): a reference bug
    naming both, best first; at 256 slots lru ties belady (0.52 = 0.52, within the CSV's
    rounding) and is no bug. A point with only baselines and the reference (no
    gds_adaptive) is still checked. Another offline walk above the reference (belady_next
    0.45) is no online policy and no bug. The rendered table marks the point and the verdict
    starts with the bug."""
    from bench.runs.robustness import render

    rows = (grid_rows(64, {"lru": 0.2, "marconi": 0.41, "gds_adaptive": 0.405,
                           "belady": 0.40, "belady_next": 0.45})
            + grid_rows(256, {"lru": 0.52, "gds": 0.5, "belady": 0.52}))
    v = verdict(rows)
    assert [b.key[1] for b in v["reference_bugs"]] == [64]
    assert v["reference_bugs"][0].beaten_by == (("marconi", 0.41), ("gds_adaptive", 0.405))
    assert v["points"] == 1 and v["margin_failures"] == []
    text = render(rows, ["lru", "gds", "marconi", "gds_adaptive", "belady"])
    verdict_part = text.split("\n\n")[-1]
    assert verdict_part.startswith("**REFERENCE BUG** at s 64 slots, 16M KV, conc 16: "
                                   "belady 0.4000 below marconi 0.4100, gds_adaptive 0.4050")
    assert text.count("marconi 0.4100 **REF BUG**") == 1  # the table's mark
    assert text.count("REFERENCE BUG") == 1  # the verdict's line
    only_base = verdict(grid_rows(64, {"lru": 0.5, "belady": 0.4}))
    assert only_base["points"] == 0 and len(only_base["reference_bugs"]) == 1


def test_from_csv_merges_several_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    """A baselines CSV and a policy CSV render as one table; a later file's row replaces an
    earlier one's for the same point and policy."""
    from bench.runs.robustness import FIELDS, main

    def write(name: str, hits: dict[str, float]) -> str:
        path = tmp_path / name
        lines = [",".join(FIELDS)]
        for p, h in hits.items():
            lines.append(f"s,64,16000000,16,{p},{h},{h},0,0,0,0")
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return str(path)

    a = write("a.csv", {"lru": 0.2, "gds": 0.3, "belady": 0.5, "gds_adaptive": 0.1})
    b = write("b.csv", {"gds_adaptive": 0.45})
    assert main(["--from-csv", a, b, "--policies", "lru", "gds", "gds_adaptive", "belady"]) == 0
    out = capsys.readouterr().out
    # best gds 0.30, headroom 0.20, captured (0.45 - 0.30) / 0.20 = 0.75
    assert "| 64 | 16M | 16 | 0.2000 | 0.3000 | 0.4500 | 0.5000 | gds 0.3000 | +0.1500 | " \
           "+0.2000 | 0.75 |" in out
    assert "0 of 1 points fail" in out


def test_the_reduced_grid_is_the_committed_tables_grid() -> None:
    """``--grid reduced`` plans the points of ``bench/results/robustness_reduced.csv``
    (the table in bench/results/2026-12-02-robustness.md), so one command reproduces it."""
    import csv
    from pathlib import Path

    from bench.runs.robustness import build_parser, plan

    committed = Path(__file__).resolve().parents[2] / "bench/results/robustness_reduced.csv"
    with committed.open(encoding="utf-8") as f:
        want = {(r["source"], int(r["state_slots"]), int(r["kv_tokens"]), int(r["concurrency"]))
                for r in csv.DictReader(f)}
    planned = plan(build_parser().parse_args(["--grid", "reduced", "--slots", "7"]))
    got = {(name, *point) for name, points in planned for point in points}
    base = [(s, 16_000_000, 16) for s in (64, 256, 1024)]
    added = {(name, *p) for name in ("toolcall", "toolcall_s1", "mooncake_b") for p in base}
    assert got == want | added and len(want) == 34 and len(got) == 43  # round 3: 9 more
    full = plan(build_parser().parse_args(["--sources", "mix", "--slots", "64", "256",
                                           "--kv-tokens", "4000000", "--concurrency", "16"]))
    assert full == [("mix", [(64, 4_000_000, 16), (256, 4_000_000, 16)])]


def by_session(reqs: list[TraceRequest]) -> dict[str | None, list[TraceRequest]]:
    out: dict[str | None, list[TraceRequest]] = {}
    for r in reqs:
        out.setdefault(r.session, []).append(r)
    return out


def test_every_generator_names_the_session_of_each_request() -> None:
    """The session hint reads ``TraceRequest.session``: every generated request carries one,
    and in the single-chain shapes (multiturn, toolcall) a session's requests extend each
    other."""
    for name in ("docqa", "agentic", "multiturn", "sysprompt", "toolcall", "mix"):
        reqs = generate(name, seed=2)
        assert reqs and all(isinstance(r.session, str) and r.session for r in reqs), name
    assert len(by_session(generate("sysprompt:requests=30"))) == 30  # one-off requests


def test_toolcall_steps_extend_the_previous_prompt_by_its_output_and_a_tool_result() -> None:
    """Step k + 1's prompt is step k's prompt (every block id, the partial last one too: the
    session's stream owns it), then step k's output, then a tool result of at least
    ``result_min`` tokens; the time between them is step k's decode (20 ms a token) plus a
    pause of 0.1 s - ``tool_max_s``."""
    reqs = generate("toolcall:sessions=30,result_min=200", seed=5)
    steps = 0
    for sess, rs in by_session(reqs).items():
        assert sess is not None and sess.startswith("tool")
        for a, b in zip(rs, rs[1:], strict=False):
            assert b.block_ids[:len(a.block_ids)] == a.block_ids
            result = b.input_length - a.input_length - a.output_length
            assert 200 <= result <= 24_000
            pause = b.timestamp_s - a.timestamp_s - a.output_length * 0.020
            assert 0.1 - 1e-9 <= pause <= 1_800.0 + 1e-9
            steps += 1
    assert steps > 100


def test_toolcall_heavy_tails_follow_their_laws() -> None:
    """400 sessions (about 3,600 steps): the share of pauses above a minute is the
    log-normal tail ``1 - Phi(ln(60 / 4) / 1.6)`` = 0.0452 and their median is 4 s; the share
    of tool results above 1,500 tokens is the Pareto tail ``(150 / 1500) ** 1.2`` = 0.0631.
    Tolerances: 4 binomial standard deviations."""
    import math

    reqs = generate("toolcall:sessions=400,max_context=1000000", seed=0)
    pauses: list[float] = []
    results: list[int] = []
    for rs in by_session(reqs).values():
        for a, b in zip(rs, rs[1:], strict=False):
            pauses.append(b.timestamp_s - a.timestamp_s - a.output_length * 0.020)
            results.append(b.input_length - a.input_length - a.output_length)
    n = len(pauses)
    assert n > 2_500
    p_pause = 1.0 - 0.5 * (1.0 + math.erf(math.log(60.0 / 4.0) / 1.6 / math.sqrt(2.0)))
    assert p_pause == pytest.approx(0.0452, abs=1e-4)
    got = sum(x > 60.0 for x in pauses) / n
    assert abs(got - p_pause) < 4 * math.sqrt(p_pause * (1 - p_pause) / n)
    assert sorted(pauses)[n // 2] == pytest.approx(4.0, rel=0.1)
    p_res = (150 / 1500) ** 1.2
    got_res = sum(x > 1_500 for x in results) / n
    assert abs(got_res - p_res) < 4 * math.sqrt(p_res * (1 - p_res) / n)


def test_toolcall_sessions_share_zipf_popular_heads_and_interleave() -> None:
    """Four heads of whole blocks (512 - 16,000 tokens); a session's first prompt is its head
    plus a task, so two sessions share exactly their head's blocks or nothing; with Zipf 1.0
    over four heads the most popular one takes 1 / (1 + 1/2 + 1/3 + 1/4) = 0.48 of the
    sessions (4 standard deviations over 300 sessions: +-0.115). Sessions overlap in time."""
    import math

    reqs = generate("toolcall:sessions=300", seed=1)
    firsts = [rs[0] for rs in by_session(reqs).values()]
    heads: dict[int, list[TraceRequest]] = {}
    for r in firsts:
        heads.setdefault(r.block_ids[0], []).append(r)
    assert 2 <= len(heads) <= 4
    for group in heads.values():
        shared = {shared_blocks(a, b) for a in group for b in group if a is not b}
        assert len(shared) <= 1  # everyone below one head shares exactly the head
        for a in group:
            for other in heads.values():
                if other is not group:
                    assert shared_blocks(a, other[0]) == 0
    top = max(len(g) for g in heads.values()) / len(firsts)
    p = 1 / (1 + 1 / 2 + 1 / 3 + 1 / 4)
    assert abs(top - p) < 4 * math.sqrt(p * (1 - p) / len(firsts))
    spans = [(rs[0].timestamp_s, rs[-1].timestamp_s) for rs in by_session(reqs).values()]
    overlapping = sum(1 for a in spans for b in spans if a < b and b[0] < a[1])
    assert overlapping > len(spans)


@pytest.mark.parametrize(("text", "message"), [
    ("a,b\n1,2\n", "no column source, state_slots, kv_tokens, concurrency, policy, "
                   "token_hit_rate"),
    ("", "no column source"),
    ("source,state_slots,kv_tokens,concurrency,policy,token_hit_rate\n"
     "s,64,16000000,16,lru,0.5\ns,sixty,16000000,16,gds,0.5\n",
     "bad.csv:3: column state_slots: cannot read 'sixty' as int"),
    ("source,state_slots,kv_tokens,concurrency,policy,token_hit_rate\ns,64,16000000,16,lru,\n",
     "bad.csv:2: column token_hit_rate: cannot read '' as float"),
])
def test_from_csv_that_is_not_a_saved_run_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    """``--from-csv`` of a file without the columns (or values) the table reads: one error
    line naming the file, exit status 2 (it was a KeyError / ValueError traceback)."""
    from bench.runs.robustness import main

    path = tmp_path / "bad.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(["--from-csv", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "python -m bench robustness: error: --from-csv" in err and message in err, err


def test_robustness_refuses_the_unified_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """Its pools are fixed (``--slots`` / ``--kv-tokens``): ``unified`` weighs bytes only an
    arena has, so it is refused before any run (it was a traceback from the first run)."""
    from bench.runs.robustness import main

    with pytest.raises(SystemExit) as exc:
        main(["--policies", "lru", "unified", "--sources", "docqa", "--slots", "8",
              "--kv-tokens", "1M", "--concurrency", "4", "--jobs", "1"])
    assert exc.value.code == 2
    assert "--policies unified: only --state-fraction unified" in capsys.readouterr().err


def test_a_malformed_trace_in_traces_dir_is_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``robustness`` and ``state-budget`` over a ``--traces-dir`` whose trace has a bad line:
    the loader's message (file and line), exit status 2, before any run (were tracebacks)."""
    from bench.dev.policies.budget import main as budget_main
    from bench.runs.robustness import main

    (tmp_path / "lmbench_gmi_trace.jsonl").write_text('{"timestamp": "5", "hash_ids": []}\n')
    for command, argv in ((main, ["--sources", "docqa", "gmi", "--policies", "lru", "--slots",
                                  "8", "--kv-tokens", "1M", "--concurrency", "4", "--jobs", "1"]),
                          (budget_main, ["--source", "gmi"])):
        with pytest.raises(SystemExit) as exc:
            command([*argv, "--traces-dir", str(tmp_path)])
        assert exc.value.code == 2
        out, err = capsys.readouterr()
        assert "lmbench_gmi_trace.jsonl:1: " in err and "error:" in err, err
        assert "docqa:" not in err  # no source ran before the error


def test_a_written_workload_reads_back_with_its_sessions(tmp_path: Path) -> None:
    """``workloads --out`` writes each request's ``session``; reading the file back gives the
    same requests *and* sessions (the loader dropped them, so ``--session-hint`` over the file
    passed no hint at all where ``--workload`` passes one per request)."""
    from bench.traces.loader import load_trace
    from bench.workloads.__main__ import main as workloads_main

    out = tmp_path / "w.jsonl"
    assert workloads_main(["multiturn:sessions=3,turns=2", "--out", str(out)]) == 0
    want = generate("multiturn:sessions=3,turns=2", seed=0)
    got = load_trace(out, mooncake_block_size=64)
    assert [r.runs for r in got] == [r.runs for r in want]
    assert [r.session for r in got] == [r.session for r in want]
    assert all(r.session is not None for r in got)


@pytest.mark.parametrize(("spec", "message"), [
    # each was a traceback (ZeroDivisionError, OverflowError, numpy's unnamed ValueError) or a
    # silently meaningless workload (a probability of 2, of NaN)
    ("docqa:span_s=inf", "workload parameter span_s must be a finite number, got inf"),
    ("docqa:think_s=nan", "workload parameter think_s must be a finite number, got nan"),
    ("docqa:followup_p=2", "workload parameter followup_p is a probability: in [0, 1], got 2.0"),
    ("agentic:subagent_p=1.5", "subagent_p is a probability: in [0, 1], got 1.5"),
    ("multiturn:turns=0", "turns is the mean of a count 1, 2, ...: >= 1, got 0.0"),
    ("agentic:steps=0.5", "steps is the mean of a count 1, 2, ...: >= 1, got 0.5"),
    ("docqa:questions=0", "questions is the mean of a count 1, 2, ...: >= 1, got 0.0"),
    ("toolcall:steps=0", "steps is the mean of a count 1, 2, ...: >= 1"),
    ("sysprompt:systems=0", "systems is how many there are to draw from: >= 1, got 0"),
    ("agentic:toolsets=0", "toolsets is how many there are to draw from: >= 1, got 0"),
    ("toolcall:result_alpha=0", "result_alpha is a Pareto index: > 0, got 0.0"),
])
def test_parameters_outside_their_domain_are_refused_naming_them(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(spec)


def test_parameters_at_the_edge_of_their_domain_generate() -> None:
    """The limits are the generators' own: a mean count of 1 is always one; a probability of
    0 or 1 is never or always; one system prompt is drawn every time."""
    one_turn = generate("multiturn:sessions=5,turns=1")
    assert len(one_turn) == 5  # one request per session
    assert generate("docqa:docs=2,followup_p=0,questions=1")
    assert generate("sysprompt:requests=4,systems=1")
    assert generate("docqa:docs=1,followup_p=1")
