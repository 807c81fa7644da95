"""The bench as one tool (``python -m bench COMMAND``, ``bench/cli.py``): the command list
without imports, each command's usage under its own name, arguments checked before a run,
progress lines off a terminal, fixed plot styles, trace names in reports."""

from __future__ import annotations

import argparse
import importlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli
from bench.report.plot import POLICY_STYLES, policy_style
from bench.traces.loader import SHIPPED_TRACE, trace_label
from tests.helpers.replay_helpers import assert_usage_error

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_every_command_without_importing_torch() -> None:
    code = ("import sys; from bench.cli import main; main(['--help']); "
            "print('torch' in sys.modules, 'radix' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.splitlines()[-1] == "False False"
    for name in cli.COMMANDS:
        assert f"\n  {name} " in out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replays"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'replays'" in err and "replay " in err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_each_command_shows_its_usage_under_its_name(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(cli.COMMANDS[name].module)
    assert callable(module.main)
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {name} ")


def test_every_commands_help_imports_no_torch() -> None:
    """``COMMAND --help`` builds the parser alone: in a fresh interpreter, building every
    command's parser leaves torch (and the library's packages) unimported."""
    code = ("import sys; from bench import cli\n"
            "for name in cli.COMMANDS: cli.command_parser(name).format_help()\n"
            "heavy = sorted(m for m in ('torch', 'radix', 'hicache', 'allocators') "
            "if m in sys.modules)\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == ""


def test_parser_choices_are_the_librarys() -> None:
    """The torch-free parsers spell some library constants out; they must not drift."""
    from bench.dev.gpu.options import MODEL_NAMES
    from bench.dev.gpu.sync_counts import MODELS
    from bench.dev.model.options import ARCHITECTURE_NAMES
    from bench.dev.model.options import WRITE_POLICIES as MODEL_WRITE_POLICIES
    from bench.runs import replay
    from hicache import WRITE_POLICIES
    from radix.config import SWA_RELEASE_EXTRA_PAGES

    assert replay.WRITE_POLICIES == WRITE_POLICIES == MODEL_WRITE_POLICIES
    assert replay.SWA_RELEASE_EXTRA_PAGES == SWA_RELEASE_EXTRA_PAGES
    args = replay.build_parser().parse_args([])  # None: the flag was not given
    assert replay._configs(args)[0].swa_release_extra_pages == SWA_RELEASE_EXTRA_PAGES
    assert tuple(MODELS) == MODEL_NAMES
    pytest.importorskip("transformers", reason="the model command needs the model extra")
    from bench.dev.model.adapter import ARCHITECTURES

    assert sorted(ARCHITECTURES) == list(ARCHITECTURE_NAMES)


def test_help_is_the_parser_the_command_runs_with(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` through the registry prints what the command's own parser prints."""
    from bench.dev.compare import radix_ops

    with pytest.raises(SystemExit):
        cli.main(["radix-ops", "--help"])
    via_cli = capsys.readouterr().out
    with pytest.raises(SystemExit):
        radix_ops.main(["--help"])
    assert capsys.readouterr().out == via_cli


def test_count_types() -> None:
    assert [cli.parse_count(t) for t in ("16000000", "16e6", "16M", "512K", "1_000")] == [
        16_000_000, 16_000_000, 16_000_000, 512_000, 1000]
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.parse_count(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        cli.positive("0")
    with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
        cli.positive_float("inf")


def test_output_path_checked_before_the_run(tmp_path: Path) -> None:
    assert cli.output_path("-") == "-"
    assert cli.output_path(str(tmp_path / "x.json")) == str(tmp_path / "x.json")
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        cli.output_path(str(tmp_path / "missing" / "x.json"))
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder"):
        cli.output_path(str(tmp_path))
    # The replay refuses a bad --json path at once (no trace read, no run).
    from bench.runs.replay import main

    assert_usage_error(main, ["--json", str(tmp_path / "missing" / "x.json")])


def test_progress_prints_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(cli, "PROGRESS_INTERVAL_S", 0.0)
    with cli.Progress(3, "lru kv=16", "req") as bar:
        for _ in range(3):
            bar.update()
    lines = err.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines[:3]] == [
        "lru kv=16: 1/3 req", "lru kv=16: 2/3 req", "lru kv=16: 3/3 req"]
    err.truncate(0)
    with cli.Progress(3, "off", "req", enabled=False) as bar:
        bar.update(3)
    assert err.getvalue() == ""


def test_policy_styles_are_fixed_and_distinct() -> None:
    colours = [s["color"] for s in POLICY_STYLES.values()]
    assert len(set(colours)) == len(colours) - 1  # the two offline references share black
    assert policy_style("gds") == POLICY_STYLES["gds"] == policy_style("gds")
    assert policy_style("gds:variant") == POLICY_STYLES["gds"]  # the name before ':'
    spare = policy_style("a_policy_nobody_knows")
    assert spare["color"] not in colours and spare == policy_style("a_policy_nobody_knows")


def test_reports_name_traces_by_their_repository_path(tmp_path: Path) -> None:
    assert trace_label(SHIPPED_TRACE) == "bench/traces/" + SHIPPED_TRACE.name
    outside = tmp_path / "t.jsonl"
    outside.write_text("")
    assert trace_label(outside) == "t.jsonl"


@pytest.mark.parametrize("argv, says", [
    # refused when the command line is read (argparse)
    (["replay", "--plot", "out.txt"], "must end in a figure format"),
    (["simulate", "--sweep", "state-slots=64,x"], "--sweep state-slots: not a number: 'x'"),
    (["simulate", "--sweep", "nosuch=1"], "AXIS one of"),
    (["robustness", "--kv-tokens", "-1"], "not a whole non-negative count"),
    (["robustness", "--jobs", "0"], "must be >= 1"),
    (["replay", "--max-requests", "0"], "--max-requests: must be >= 1"),
    (["replay", "--swa-tokens", "1000"], "--swa-tokens needs --sliding-window, which is off"),
    (["replay", "--swa-release-extra-pages", "2"], "--swa-release-extra-pages needs --sliding-window"),
    (["replay", "--hicache-write-policy", "write_back"], "--hicache-write-policy needs --hicache-ratio"),
    (["simulate", "--arrivals", "closed", "--time-scale", "2"],
     "--time-scale needs --arrivals trace, which is off"),
    (["simulate", "--state-fraction", "0.3"], "--state-fraction needs --memory-gb, which is off"),
    (["simulate", "--marconi-alpha", "0.5"], "--marconi-alpha needs --policy marconi"),
    # a fixed alpha must be finite and >= 0 (these were a ValueError traceback from a run)
    (["simulate", "--policy", "marconi", "--marconi-alpha", "-1"],
     "argument --marconi-alpha: must be a finite number >= 0: '-1'"),
    (["simulate", "--policy", "marconi", "--marconi-alpha", "nan"],
     "argument --marconi-alpha: must be a finite number >= 0: 'nan'"),
    (["simulate", "--decode-ms", "-5"], "argument --decode-ms: must be a finite number >= 0"),
    (["simulate", "--decode-ms", "inf"], "argument --decode-ms: must be a finite number >= 0"),
    # a seed is a whole number >= 0 (numpy's "expected non-negative integer" named no option)
    (["workloads", "docqa", "--seed", "-1"], "argument --seed: not a seed (a whole number >= 0)"),
    (["replay", "--workload", "docqa", "--workload-seed", "-1"],
     "argument --workload-seed: not a seed (a whole number >= 0)"),
    (["trace-stats", "--mooncake-block-size", "0"], "argument --mooncake-block-size: must be >= 1"),
    (["trace-stats", "--tracelab-block-size", "0"], "argument --tracelab-block-size: must be >= 1"),
    (["convert", "in.jsonl", "out.jsonl", "--block-size", "0"], "argument --block-size: must be >= 1"),
    (["convert", "in.jsonl", "/nonexistent/out.jsonl"],
     "argument dst: the folder of '/nonexistent/out.jsonl' does not exist"),
    # developer instruments: counts >= 1, a probability in [0, 1], a known policy (each was a
    # traceback: max() of an empty sequence, an empty randrange, an unknown policy's ValueError)
    (["radix-ops", "--requests", "0"], "argument --requests: must be >= 1"),
    (["radix-ops", "--vocab", "0"], "argument --vocab: must be >= 1"),
    (["radix-ops", "--capacity", "0"], "argument --capacity: must be >= 1"),
    (["radix-ops", "--new-conv-prob", "2"], "argument --new-conv-prob: must be in [0, 1]: '2'"),
    (["radix-ops", "--requests", "5", "--policy", "nosuch"],
     "--policy: radix_eviction_policy='nosuch' is unknown"),
    (["hit-breakdown", "--time-scale", "0"], "argument --time-scale: must be a finite number > 0"),
    (["hit-breakdown", "--kv-tokens", "0"], "argument --kv-tokens: must be >= 1"),
    (["hit-breakdown", "--trace", "/nonexistent.jsonl"], "trace file not found"),
    (["hit-breakdown", "--policy", "gds", "--state-slots", "1e12"], "state_slots=1,000,000,000,000"),
    (["sync-counts", "--requests", "0"], "argument --requests: must be >= 1"),  # was a 0 table
    (["sync-counts", "--page-size", "0"], "argument --page-size: must be >= 1"),
    (["sync-counts", "--kv-tokens", "0"], "argument --kv-tokens: must be >= 1"),
    (["sync-counts", "--policy", "nosuch"], "--policy: radix_eviction_policy='nosuch' is unknown"),
    (["sync-counts", "--trace", "/nonexistent.jsonl"], "trace file not found"),
    (["hicache-bandwidth", "--node-tokens", "0"], "argument --node-tokens: must be >= 1"),
    (["hicache-bandwidth", "--gib", "nan"], "argument --gib: must be a finite number > 0"),
    (["hicache-bandwidth", "--gib", "0"], "argument --gib: must be a finite number > 0"),
    (["lora-load", "--repeats", "0"], "argument --repeats: must be >= 1"),  # was StatisticsError
    (["storage", "--pages", "0"], "argument --pages: must be >= 1"),  # was ZeroDivisionError
    (["storage", "--page-bytes", "0"], "argument --page-bytes: must be >= 1"),
    (["l3-share", "--instances", "0"], "argument --instances: must be >= 1"),
    (["l3-share", "--trace", "/nonexistent.jsonl"], "trace file not found"),
    (["l3-share", "--hicache-ratio", "0.5"], "hicache_ratio must be a finite number > 1"),
    # options of a trace file with --workload, a workload seed without one: silently ignored
    (["replay", "--workload", "docqa", "--trace-format", "gmi"],
     "--trace-format reads a trace file, not --workload's generated requests"),
    (["replay", "--workload", "docqa", "--mooncake-block-size", "4", "--tracelab-block-size", "2"],
     "--mooncake-block-size, --tracelab-block-size read a trace file"),
    (["simulate", "--workload", "docqa", "--mooncake-block-size", "4"],
     "--mooncake-block-size reads a trace file"),
    (["replay", "--workload-seed", "3"], "--workload-seed needs --workload, which is off"),
    (["simulate", "--workload-seed", "3"], "--workload-seed needs --workload, which is off"),
    (["memory-split", "--memory-gb", "1", "--workload-seed", "3"],
     "--workload-seed needs --workload, which is off"),
    (["evict-scaling", "--nodes", "100", "--policy", "nosuch"],
     "--policy: radix_eviction_policy='nosuch' is unknown"),
    (["evict-scaling", "--nodes", "100000", "100"], "--nodes 100: the measurement evicts about"),
    # refused by the command before its run starts
    (["replay", "--policy", "lru", "nosuch"], "--policy: radix_eviction_policy='nosuch' is unknown"),
    (["simulate", "--policy", "nosuch"], "--policy: radix_eviction_policy='nosuch' is unknown"),
    (["robustness", "--policies", "nosuch"], "--policies: radix_eviction_policy='nosuch' is unknown"),
    (["robustness", "--from-csv", "/nonexistent.csv"], "--from-csv: no such file"),
    (["robustness", "--sources", "gmi", "--traces-dir", "/nonexistent", "--policies", "lru"],
     "no source could be loaded"),
    (["replay", "--trace", "/"], "is a folder, not a trace file"),
    (["replay", "--policy-config", "nosuch={}"], "--policy-config names ['nosuch'], not in --policy"),
])
def test_bad_input_is_refused_before_a_run_starts(argv: list[str], says: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(cli.main, argv)
    err = capsys.readouterr().err
    assert says in err and f"python -m bench {argv[0]}: error: " in err
    assert "usage:" not in err, err  # the error in one line, not argparse's usage first


def test_a_replay_that_serves_nothing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", "--max-requests", "5", "--kv-tokens", "10", "--policy", "lru",
                     "--no-progress"]) == 0
    assert "lru kv=10: every request was skipped" in capsys.readouterr().err


def test_a_closed_pipe_ends_the_tool_quietly() -> None:
    """``python -m bench | head -1``: no BrokenPipeError traceback."""
    proc = subprocess.run(f"{sys.executable} -m bench | head -1", shell=True, cwd=REPO,
                          capture_output=True, text=True, check=True)
    assert proc.stdout.startswith("usage: python -m bench COMMAND")
    assert "Traceback" not in proc.stderr


def test_count_types_refuse_infinity_and_keep_large_integers_exact() -> None:
    """``inf`` / ``1e400`` are not counts (an argument error, not an OverflowError), and a
    count written out in digits is read exactly, not through a float (2**53 + 1 stays odd)."""
    for bad in ("inf", "-inf", "1e400", "nan", "infK"):
        with pytest.raises(argparse.ArgumentTypeError, match="count"):
            cli.parse_count(bad)
    assert cli.parse_count("9007199254740993") == 2**53 + 1
    assert cli.parse_count("9_007_199_254_740_993") == 2**53 + 1
    assert cli.parse_count("3K") == 3000 and cli.parse_count("1.5K") == 1500
    from bench.runs.replay import main

    assert_usage_error(main, ["--kv-tokens", "inf"])


@pytest.mark.parametrize("argv", [
    ["memory-split", "--workload", "multiturn:sessions=2,turns=2", "--memory-gb", "1",
     "--state-fractions", "0.2"],
    ["opcodes", "--reps", "2"],
    ["l3-share", "--max-requests", "3", "--setups", "shared"],
    ["hicache-bandwidth", "--simulate", "--gib", "0.0005", "--node-tokens", "16",
     "--io-backends", "direct", "--mem-layouts", "page_first"],
    ["hicache-bandwidth", "--replay", "--models", "hicache"],
    ["storage", "--pages", "4", "--batch", "2"],
])
def test_json_to_stdout_leaves_stdout_one_json_document(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--json -`` gives stdout to the JSON (as replay and simulate do): the table and the
    progress lines go to stderr. stdout held the records' lines, the table and the JSON (a
    JSON reader failed on it); hicache-bandwidth printed the JSON once per record, and
    storage wrote a file named '-'."""
    import json

    if argv[0] == "l3-share":
        argv = [*argv, "--l3", f"file:{tmp_path / 'l3'}"]
    monkeypatch.chdir(tmp_path)  # a file named '-' would land here
    assert cli.main([*argv, "--json", "-"]) == 0
    out = capsys.readouterr().out
    json.loads(out)  # one document, nothing else
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("command", ["replay", "simulate"])
def test_a_page_that_splits_trace_blocks_is_warned_about(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both engine commands say when ``--page-size`` does not divide the trace block (shared
    blocks then end inside a page, and such pages are not cached); simulate said nothing."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [0, 1]}\n')
    argv = [command, "--trace", str(trace), "--mooncake-block-size", "4", "--page-size", "3",
            "--kv-tokens", "300", "--state-slots", "4", "--policy", "lru", "--no-progress"]
    assert cli.main(argv + (["--jobs", "1"] if command == "simulate" else [])) == 0
    err = capsys.readouterr().err
    assert (f"python -m bench {command}: warning: --page-size 3 does not divide the trace's "
            "block size (4 tokens)") in err, err
