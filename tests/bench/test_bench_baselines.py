"""The replay-side policies registered by name (``bench/policies/baselines.py``): the simulator looks
them up and never imports an experiment itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.engine.simulator import SimConfig
from bench.policies import baselines

REPO = Path(__file__).resolve().parents[2]


def test_the_simulator_imports_no_baseline_module_until_a_lookup() -> None:
    code = ("import sys, bench.engine.simulator as s; "
            "print(sorted(m for m in sys.modules if m in ('bench.dev.policies.ideas', 'bench.dev.policies.offline',"
            " 'bench.dev.policies.utility'))); "
            "s.SimConfig.of('belady', state_slots=8); "
            "print('bench.dev.policies.ideas' in sys.modules, 'bench.dev.policies.offline' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["[]", "True True"]


def test_every_baseline_is_registered_once_by_its_module() -> None:
    names = baselines.names()
    for name in ("marconi", "seglen", "belady", "belady_state", "idea:gds", "idea:gdsf"):
        assert name in names
    assert len(set(names)) == len(names)
    assert baselines.get("lru") is None and baselines.get("gds_adaptive") is None
    belady = baselines.get("belady")
    assert belady is not None and belady.offline and belady.order_kv is not None
    with pytest.raises(ValueError, match="registered twice"):
        baselines.register(belady)


def test_a_baseline_runs_on_the_gds_policy_and_a_library_policy_on_itself() -> None:
    assert SimConfig.of("marconi", state_slots=8).engine.policy == "gds"
    assert SimConfig.of("gdsf", state_slots=8).engine.policy == "gdsf"
    with pytest.raises(ValueError, match="runs on engine.policy 'gds'"):
        from bench.engine.core import EngineConfig

        SimConfig(EngineConfig(policy="lru", state_slots=8), "seglen")
