"""The installed bench against the checkout's: the developer instruments (``bench/dev/``) stay
out of the wheel and register their commands and baselines only when present; tables fit 120
columns (``--wide``: one block); pool sizes are checked against memory before anything is
allocated; each run reports its own peak memory."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from allocators.memory import available_host_memory
from bench import cli
from bench.cli import column_blocks
from bench.engine.core import EngineConfig, MemoryBudgetError

REPO = Path(__file__).resolve().parents[2]

USER_COMMANDS = ["convert", "memory-split", "replay", "robustness", "simulate", "trace-stats",
                 "workloads"]


def _without_dev(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter where ``bench.dev`` cannot be imported (as in the
    wheel); its stdout lines."""
    prelude = "import sys; sys.modules['bench.dev'] = None; "
    out = subprocess.run([sys.executable, "-c", prelude + code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    return out.stdout.splitlines()


def test_without_bench_dev_only_the_users_commands_and_library_baselines_remain() -> None:
    out = _without_dev(
        "import json; from bench import cli; from bench.policies import baselines; "
        "from bench.runs import robustness as r; "
        "print(json.dumps(sorted(cli.COMMANDS))); print(json.dumps(baselines.names())); "
        "print(json.dumps([p for p in r.POLICIES if r._known(p)]))")
    assert json.loads(out[0]) == USER_COMMANDS
    assert json.loads(out[1]) == ["belady_state"]  # bench/policies/strategies.py's only
    # robustness's default: the radix policies; seglen, marconi and belady are instruments
    assert json.loads(out[2]) == ["lru", "gds", "gdsf", "gds_adaptive"]


def test_in_a_checkout_the_instruments_are_registered_too() -> None:
    assert set(USER_COMMANDS) < set(cli.COMMANDS)
    for name in ("compare", "radix-ops", "evict-scaling", "sync-counts", "storage", "l3-share",
                 "lora-load", "model", "state-budget", "hit-breakdown"):
        assert cli.COMMANDS[name].module.startswith("bench.dev."), name


def test_the_wheel_finds_no_developer_instrument() -> None:
    setuptools = pytest.importorskip("setuptools")
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(REPO), include=find["include"], exclude=find["exclude"])
    assert "bench.runs" in packages and "radix.lora" in packages and "components.eviction" in packages
    assert not [p for p in packages if p == "bench.dev" or p.startswith("bench.dev.")]
    assert not [p for p in packages if p.startswith("tests")]


def test_column_blocks_by_hand() -> None:
    # labels 10 wide, columns 50 wide, 2 spaces before each: 10 + 52 + 52 = 114 <= 120, a third
    # would make 166
    assert column_blocks(10, [50, 50, 50], 120) == [[0, 1], [2]]
    assert column_blocks(10, [50, 50, 50], None) == [[0, 1, 2]]
    assert column_blocks(10, [200, 5], 120) == [[0], [1]]  # too wide alone: a block of its own
    assert column_blocks(10, [], 120) == [[]]


def _table(out: str) -> list[str]:
    """The metric table's lines (from the 'metric' header to the blank line before the bounds)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("metric "))
    end = next(i for i, line in enumerate(lines) if line.startswith("infinite-memory bounds"))
    return lines[start:end - 1]


def test_replay_tables_fit_120_columns_unless_wide(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--max-requests", "20", "--policy", "lru", "gds", "gds_adaptive",
            "--state-slots", "64", "256", "1024", "--no-progress"]
    assert cli.main(argv) == 0
    narrow = _table(capsys.readouterr().out)
    assert max(map(len, narrow)) <= 120
    assert sum(line.startswith("metric ") for line in narrow) >= 2  # nine runs: several blocks
    assert cli.main([*argv, "--wide"]) == 0
    wide = _table(capsys.readouterr().out)
    assert sum(line.startswith("metric ") for line in wide) == 1 and max(map(len, wide)) > 120
    # the same cells either way: every run's token hit rate, in order
    hits = [line.split()[3:] for line in narrow if line.startswith("token hit rate")]
    assert [v for block in hits for v in block] == next(
        line.split()[3:] for line in wide if line.startswith("token hit rate"))
    # each run's own peak memory, in MiB
    assert any(line.startswith("peak RSS MiB (run)") for line in wide)


def test_simulate_names_the_unit_of_every_time_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "--max-requests", "20", "--policy", "lru", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    for header in ("TTFT p50 s", "p90 s", "p99 s", "queue mean s", "prefill s/req"):
        assert header in out
    assert max(len(line) for line in out.splitlines() if not line.startswith("trace:")) <= 120


def test_pools_larger_than_memory_are_refused_before_allocation(
        capsys: pytest.CaptureFixture[str]) -> None:
    avail = available_host_memory()
    if avail is None:
        pytest.skip("no /proc/meminfo: the available memory is not known here")
    too_many = 2 * avail // 13  # 13 bytes per free-list entry: twice what fits
    with pytest.raises(MemoryBudgetError, match=f"kv_tokens={too_many:,}"):
        EngineConfig(kv_tokens=too_many)
    EngineConfig(kv_tokens=min(too_many // 4, 16_000_000))  # a size that fits is accepted
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--kv-tokens", str(too_many), "--max-requests", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "python -m bench replay: error: kv_tokens=" in err and "available" in err


def test_a_state_pool_larger_than_memory_is_refused_before_allocation(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The state pool counts too: each slot holds a free-list entry and two float32 state
    elements (the engine's one-layer pool), so twice the slots memory holds at 8 bytes each is
    refused by the config, and by ``replay`` / ``simulate`` as an argument error (it was a
    ``MemoryBudgetError`` traceback from the first run's pool)."""
    avail = available_host_memory()
    if avail is None:
        pytest.skip("no /proc/meminfo: the available memory is not known here")
    too_many = 2 * avail // 8
    with pytest.raises(MemoryBudgetError, match=f"state_slots={too_many:,}"):
        EngineConfig(kv_tokens=1000, state_slots=too_many)
    EngineConfig(kv_tokens=1000, state_slots=min(too_many // 4, 1_000_000))  # fits
    for command in ("replay", "simulate"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--state-slots", str(too_many), "--max-requests", "5",
                      "--no-progress"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"python -m bench {command}: error: " in err and "state_slots=" in err, err
