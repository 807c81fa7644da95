"""``python -m bench sync-counts``: the JSON it writes (launches, memcpys and syncs per request,
per model) and its real-device mode's parts that run without a GPU: the refusal without CUDA,
and the sorting of profiler events into engine-facing calls, step reads and the rest."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.dev.gpu import real_device
from bench.dev.gpu.sync_counts import main


def test_json_file_has_the_per_request_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    out = tmp_path / "counts.json"
    assert main(["--requests", "30", "--models", "kv", "hybrid", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["kv", "hybrid"]
    for r in rows:
        ops = r["ops"]
        engine = [op for op in ops if not op.startswith("step.")]
        launches = sum(sum(ops[op]["launches"].values()) for op in engine)
        memcpys = sum(sum(ops[op]["memcpys"].values()) for op in engine)
        assert r["requests"] == 30
        assert r["launches_per_request"] == launches / 30
        assert r["memcpys_per_request"] == memcpys / 30
        assert r["syncs_per_request"] == 0
        assert r["memcpys_per_request"] > 0  # the KV uploads
    table = capsys.readouterr().out  # the table is printed too
    assert "| launches per request |" in table and "| memcpys per request |" in table


def test_json_to_stdout_prints_json_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--requests", "10", "--models", "kv", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["model"] == "kv" and "launches_per_request" in rows[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_real_device_mode_refuses_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--requests", "5", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@dataclass
class Span:
    start: float
    end: float


@dataclass
class Ev:
    name: str
    cpu_parent: Ev | None = None
    time_range: Span | None = None


def test_profiler_events_are_counted_by_where_they_ran() -> None:
    api = Ev("api:cache.match_prefix")
    inner = Ev("aten::cat", Ev("record_function", api))
    step = Ev("step:read")
    events = [
        Ev("cudaLaunchKernel", inner), Ev("cudaMemcpyAsync", api), Ev("cudaStreamWaitEvent", api),
        Ev("cudaLaunchKernel", step), Ev("cudaMemcpyAsync", Ev("aten::copy_", step)),
        Ev("cuLaunchKernel"), Ev("aten::add", api), Ev("cudaEventRecord", api),
    ]
    got = real_device.count_runtime(events)
    assert dict(got) == {("api", "launch"): 1, ("api", "memcpy"): 1, ("api", "wait"): 1,
                         ("step", "launch"): 1, ("step", "memcpy"): 1, ("other", "launch"): 1}
    assert real_device.classify("cudaLaunchKernelExC") == "launch"
    # runtime calls the profiler did not link to their op: placed by time
    timed = [Ev("api:cache.insert", time_range=Span(10, 20)), Ev("step:read", time_range=Span(30, 40)),
             Ev("cudaMemcpyAsync", time_range=Span(12, 13)),
             Ev("cudaLaunchKernel", time_range=Span(31, 32)),
             Ev("cudaLaunchKernel", time_range=Span(25, 26))]
    assert dict(real_device.count_runtime(timed)) == {
        ("api", "memcpy"): 1, ("step", "launch"): 1, ("other", "launch"): 1}
    assert real_device.classify("aten::add") is None


def test_the_real_device_mode_runs_on_the_simulated_device(capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    """Its replays, timing, profiling and stats comparison, on the simulated device (the
    profiler sees no CUDA runtime calls there: the counts are zero, the rest is real)."""
    from bench.dev.gpu.simcuda import SimCuda
    from bench.dev.gpu.sync_counts import conversations

    with SimCuda(strict=False):
        rc = real_device.compare(["kv", "hybrid"], conversations(12), json_path="-")
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("["):])
    assert rc == 0 and [r["model"] for r in rows] == ["kv", "hybrid"]
    for r in rows:
        assert r["stats_equal"] is True and r["requests"] == 12
        assert r["cpu_us_per_request"] > 0 and r["cuda_us_per_request"] > 0
        assert r["launches_per_request"] == 0 and r["memcpys_per_request"] == 0
    assert "| kv |" in out and "stats equal" in out
