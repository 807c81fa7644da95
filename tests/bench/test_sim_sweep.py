"""Sweep arguments (bench/runs/sweep.py), run planning and the simulator CLI (bench/runs/simulate.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench.runs.simulate import build_parser, main, plan_runs
from bench.runs.sweep import Sweep, fmt_value, parse_sweep


@pytest.mark.parametrize(
    ("text", "sweep"),
    [
        ("state-slots=64,128,2048", Sweep("state-slots", (64, 128, 2048))),
        ("kv-tokens=1M, 4M,16e6", Sweep("kv-tokens", (10**6, 4 * 10**6, 16 * 10**6))),
        ("concurrency=16,24,32,40,64", Sweep("concurrency", (16, 24, 32, 40, 64))),
        ("state-slots=0,512K", Sweep("state-slots", (0, 512_000))),
        ("memory-gb=20,40.5", Sweep("memory-gb", (20.0, 40.5))),
        ("state-fraction=0,0.25", Sweep("state-fraction", (0.0, 0.25))),
    ],
)
def test_parse_sweep(text: str, sweep: Sweep) -> None:
    got = parse_sweep(text)
    assert got == sweep
    assert all(isinstance(v, int) for v in got.values) == (sweep.axis in
                                                            ("state-slots", "kv-tokens", "concurrency"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("slots=1,2", "AXIS=V1"),
        ("state-slots", "AXIS=V1"),
        ("state-slots=", "no values"),
        ("state-slots=64,64", "repeated"),
        ("concurrency=0,4", "whole number >= 1"),
        ("kv-tokens=1.5", "whole number"),
        ("state-slots=-1", "whole number >= 0"),
        ("memory-gb=0", "> 0"),
        ("state-fraction=1", r"\[0, 1\)"),
        ("concurrency=lots", "not a number"),
    ],
)
def test_parse_sweep_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_sweep(text)


def test_bad_sweep_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--sweep", "slots=1"])
    assert "--sweep" in capsys.readouterr().err


def test_plan_runs_value_major_with_baselines() -> None:
    args = build_parser().parse_args(
        ["--policy", "lru", "belady", "--sweep", "state-slots=64,128", "--kv-tokens", "1M"])
    plan = plan_runs(args)
    assert [(c.policy, c.engine.policy, c.engine.state_slots, v) for c, v in plan] == [
        ("lru", "lru", 64, 64), ("belady", "gds", 64, 64),
        ("lru", "lru", 128, 128), ("belady", "gds", 128, 128),
    ]
    assert {c.engine.kv_tokens for c, _ in plan} == {10**6}


def test_plan_runs_with_model_memory() -> None:
    args = build_parser().parse_args(
        ["--model", "qwen3-next-80b", "--memory-gb", "40", "--state-fraction", "0.2"])
    (cfg, value), _ = plan_runs(args)
    assert (cfg.engine.kv_tokens, cfg.engine.state_slots, value) == (1_302_083, 103, None)
    assert cfg.model == "qwen3-next-80b"
    args = build_parser().parse_args(
        ["--model", "qwen3-next-80b", "--memory-gb", "40", "--sweep", "state-fraction=0.1,0.4",
         "--policy", "gds"])
    assert [c.engine.state_slots for c, _ in plan_runs(args)] == [51, 207]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--memory-gb", "40"], "--model"),
        (["--sweep", "memory-gb=20,40"], "--model"),
        (["--model", "marconi-7b", "--sweep", "state-fraction=0.1,0.2"], "--memory-gb"),
        (["--policy", "marconi", "--state-slots", "0"], "state slots"),
        (["--policy", "nope"], "unknown"),
        # the preset's bytes size both pools: explicit sizes would be silently ignored
        (["--model", "marconi-7b", "--memory-gb", "40", "--kv-tokens", "1M"], "--kv-tokens"),
        (["--model", "marconi-7b", "--memory-gb", "40", "--sweep", "state-slots=64,128"],
         "--sweep state-slots"),
        # the swept option given as well: the sweep sets it, the given value was silently
        # ignored (a run the user did not ask for)
        (["--kv-tokens", "5", "--sweep", "kv-tokens=1M,2M"],
         "--kv-tokens 5 would be ignored: --sweep kv-tokens sets it"),
        (["--state-slots", "64", "--sweep", "state-slots=8,16"],
         "--state-slots 64 would be ignored: --sweep state-slots sets it"),
        (["--concurrency", "8", "--sweep", "concurrency=16,32"],
         "--concurrency 8 would be ignored: --sweep concurrency sets it"),
        (["--max-running-requests", "32", "--sweep", "concurrency=16,32"],
         "--concurrency 32 would be ignored"),
        (["--model", "marconi-7b", "--memory-gb", "40", "--sweep", "memory-gb=10,20"],
         "--memory-gb 40 would be ignored: --sweep memory-gb sets it"),
        (["--model", "marconi-7b", "--memory-gb", "40", "--state-fraction", "0.3",
          "--sweep", "state-fraction=0.1,0.2"], "--state-fraction 0.3 would be ignored"),
    ],
)
def test_plan_runs_refuses(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_runs(build_parser().parse_args(argv))


def _tiny_trace(path: Path) -> Path:
    lines = []
    for i in range(16):
        ids = [0, 1 + i % 3, 10 + i]
        lines.append({"timestamp": 100 * i, "input_length": 3 * 512 - 7, "output_length": 3,
                      "hash_ids": ids})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_cli_sweep_writes_plot_csv_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _tiny_trace(tmp_path / "t.jsonl")
    plot = tmp_path / "sweep.png"
    rc = main(["--trace", str(trace), "--policy", "lru", "belady", "--kv-tokens", "20K",
               "--sweep", "state-slots=4,8", "--plot", str(plot), "--json", str(tmp_path / "r.json"),
               "--jobs", "2", "--no-progress", "--markdown"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| value | policy |" in out and "than the offline reference" in out
    assert plot.stat().st_size > 1000
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["policy"], r["value"]) for r in rows] == [
        ("lru", "4"), ("belady", "4"), ("lru", "8"), ("belady", "8")]
    assert all(int(r["requests"]) == 16 for r in rows)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["sweep"] == "state-slots" and len(data["runs"]) == 4


def test_cli_plot_needs_a_sweep(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--trace", str(_tiny_trace(tmp_path / "t.jsonl")), "--plot", str(tmp_path / "x.png")])
    assert e.value.code == 2


def test_fmt_value() -> None:
    assert [fmt_value(v) for v in (16_000_000, 512_000, 2048, 0.25, 40.0)] == [
        "16M", "512K", "2,048", "0.25", "40"]


def test_a_sweeps_caption_names_the_swept_values_not_the_default() -> None:
    from bench.runs.simulate import sizes_caption

    args = build_parser().parse_args(["--sweep", "state-slots=64,256", "--kv-tokens", "4M"])
    assert sizes_caption(args) == ("KV 4,000,000 tokens, state-slots 64, 256 (swept), "
                                   "concurrency 32")
    args = build_parser().parse_args(["--sweep", "memory-gb=10,20", "--model", "qwen3-next-80b"])
    assert sizes_caption(args) == ("model qwen3-next-80b, memory-gb 10, 20 (swept), "
                                   "state fraction 0.2, concurrency 32")
