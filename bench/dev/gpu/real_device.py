"""``python -m bench sync-counts --device cuda``: the replay's engine on a real GPU against the
same replay on the CPU, in one run (one GPU, under 2 minutes for the default 160 requests of
the four models, or a shipped trace's first 3,000 requests of one model).

Per model, the replay (``bench.dev.gpu.sync_counts``: its models, trace and per-request
:class:`~bench.dev.gpu.sync_counts.Step`) runs three times on ``cuda``: a warm-up over the first
requests (CUDA context, allocator pools, pinned staging), a timed run, and a profiled run
(``torch.profiler``, CPU and CUDA activity) whose CUDA runtime calls are counted per request:
kernel launches, memcpys and stream waits made inside the engine-facing calls (each wrapped
in a ``record_function`` range named ``api:<op>``), those inside the step's reads
(``step:read``) and those elsewhere (the engine's own work). The same replay runs timed on the
CPU; ``stats()`` of the cache must be equal on both devices.

Printed: a table of us/request on cpu and cuda, their ratio, the counts, and whether the
stats are equal; ``--json FILE`` also writes them. Without CUDA the command refuses (exit
status 2) before running anything.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from bench.cli import write_json
from bench.dev.gpu.sync_counts import (
    ALLOC_OPS,
    CACHE_OPS,
    COMMON,
    MODELS,
    STATE_OPS,
    TRANSFER_OPS,
    Step,
)
from bench.engine.core import EngineConfig, ReplayEngine
from bench.traces.loader import TraceRequest

__all__ = ["classify", "compare", "count_runtime", "has_cuda"]

#: Requests of the warm-up run on the device.
WARMUP = 20

#: CUDA runtime / driver call names (as the profiler names them) by what they are.
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")
MEMCPY_NAMES = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemcpy2DAsync", "cudaMemsetAsync",
                "cuMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2")
WAIT_NAMES = ("cudaStreamWaitEvent", "cuStreamWaitEvent")


def classify(name: str) -> str | None:
    """``"launch"``, ``"memcpy"``, ``"wait"`` for a CUDA runtime / driver call's name as the
    profiler reports it, else ``None``."""
    for kind, names in (("launch", LAUNCH_NAMES), ("memcpy", MEMCPY_NAMES), ("wait", WAIT_NAMES)):
        if name in names:
            return kind
    return None


def count_runtime(events: Iterable[Any]) -> Counter[tuple[str, str]]:
    """(where, kind) -> count of the CUDA runtime calls among profiler ``events`` (objects with
    ``name`` and ``cpu_parent``, as ``torch.profiler``'s ``FunctionEvent``): ``where`` is
    ``"api"`` under a ``record_function`` range whose name starts with ``api:``, ``"step"``
    under one starting with ``step:``, else ``"other"``; the outermost such range decides.
    An event without such a parent is placed by time (``time_range``: the range that
    contains its start), where the profiler did not link runtime calls to their op."""
    events = list(events)
    ranges = sorted((ev.time_range.start, ev.time_range.end, _where(str(ev.name)))
                    for ev in events if _where(str(ev.name)) != "other"
                    and getattr(ev, "time_range", None) is not None)
    out: Counter[tuple[str, str]] = Counter()
    for ev in events:
        kind = classify(str(ev.name))
        if kind is None:
            continue
        where = "other"
        p = getattr(ev, "cpu_parent", None)
        while p is not None:
            if _where(str(p.name)) != "other":
                where = _where(str(p.name))
            p = getattr(p, "cpu_parent", None)
        tr = getattr(ev, "time_range", None)
        if where == "other" and tr is not None:
            for start, end, w in ranges:  # (few: one per engine-facing call)
                if start > tr.start:
                    break
                if tr.start < end:
                    where = w
                    break
        out[(where, kind)] += 1
    return out


def _where(name: str) -> str:
    return "api" if name.startswith("api:") else "step" if name.startswith("step:") else "other"


def _ranged(obj: Any, names: Sequence[str], label: str) -> None:
    """Wrap ``obj``'s methods ``names`` in ``record_function(label + name)`` ranges."""
    for name in names:
        if not hasattr(obj, name):
            continue
        fn = getattr(obj, name)

        def wrapped(*args: Any, _fn: Callable[..., Any] = fn, _r: str = label + name,
                    **kwargs: Any) -> Any:
            with torch.profiler.record_function(_r):
                return _fn(*args, **kwargs)

        setattr(obj, name, functools.wraps(fn)(wrapped))


def _replay(cfg: EngineConfig, trace: Sequence[TraceRequest], ranges: bool = False
            ) -> tuple[ReplayEngine, float]:
    """One replay; returns the engine and its wall time [s] (the device synchronised at the
    end, outside the requests)."""
    engine = ReplayEngine(cfg)
    step = Step(engine)
    if ranges:
        _ranged(engine.cache, CACHE_OPS, "api:cache.")
        _ranged(engine.kv_allocator, ALLOC_OPS, "api:kv_allocator.")
        if engine.state_pool is not None:
            _ranged(engine.state_pool, STATE_OPS, "api:state_pool.")
        _ranged(step, ["read"], "step:")
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, tr in enumerate(trace):
        engine.admit(tr, rid=i)
        step.read()
    engine.drain()
    if cuda:
        torch.cuda.synchronize()
    return engine, time.perf_counter() - t0


def _model(model: str, trace: Sequence[TraceRequest], **extra: Any) -> dict[str, Any]:
    base = {**COMMON, **MODELS[model], **extra}
    n = max(len(trace), 1)
    cpu, t_cpu = _replay(EngineConfig(**{**base, "device": "cpu"}), trace)
    gpu_cfg = EngineConfig(**{**base, "device": "cuda"})
    _replay(gpu_cfg, trace[:WARMUP])
    gpu, t_gpu = _replay(gpu_cfg, trace)
    acts = [a for a in (torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA)
            if a in torch.profiler.supported_activities()]
    with torch.profiler.profile(activities=acts) as prof:
        _replay(gpu_cfg, trace, ranges=True)
    counts = count_runtime(prof.events())
    row: dict[str, Any] = {
        "model": model, "requests": len(trace),
        "cpu_us_per_request": 1e6 * t_cpu / n, "cuda_us_per_request": 1e6 * t_gpu / n,
        "stats_equal": gpu.cache.stats() == cpu.cache.stats(),
    }
    row["cuda_over_cpu"] = row["cuda_us_per_request"] / max(row["cpu_us_per_request"], 1e-9)
    for where in ("api", "step", "other"):
        for kind in ("launch", "memcpy", "wait"):
            row[f"{where}_{kind}s_per_request"] = counts[(where, kind)] / n
    # the names the simulated device's JSON uses, for the engine-facing calls
    row["launches_per_request"] = row["api_launchs_per_request"]
    row["memcpys_per_request"] = row["api_memcpys_per_request"]
    return row


def _device_name() -> str:
    try:
        return str(torch.cuda.get_device_name(0))
    except (RuntimeError, AssertionError, AttributeError, NameError):  # (a simulated one)
        return "cuda"


def has_cuda() -> bool:
    """Whether a CUDA device is there; without one, says so on stderr."""
    if torch.cuda.is_available():
        return True
    print("sync-counts --device cuda: no CUDA device (torch.cuda.is_available() is False); "
          "run it on a machine with a GPU, or without --device for the simulated device",
          file=sys.stderr)
    return False


def compare(models: Sequence[str], trace: Sequence[TraceRequest], *, json_path: str | None = None,
            **extra: Any) -> int:
    """Run the comparison (see the module docstring; ``extra``: ``EngineConfig`` fields over
    the models', e.g. ``policy``, ``page_size``, ``kv_tokens``); returns the exit status: 0, 1
    when the stats differ on a model, 2 without CUDA (nothing run)."""
    if not has_cuda():
        return 2
    rows = [_model(m, trace, **extra) for m in models]
    head = ("| model | cpu us/req | cuda us/req | cuda/cpu | launches/req | memcpys/req | "
            "waits/req | step launches+memcpys/req | other launches+memcpys/req | stats equal |")
    lines = [head, "|---|" + "---:|" * 9]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['cpu_us_per_request']:.0f} | {r['cuda_us_per_request']:.0f} | "
            f"{r['cuda_over_cpu']:.2f}x | {r['api_launchs_per_request']:.2f} | "
            f"{r['api_memcpys_per_request']:.2f} | {r['api_waits_per_request']:.2f} | "
            f"{r['step_launchs_per_request'] + r['step_memcpys_per_request']:.2f} | "
            f"{r['other_launchs_per_request'] + r['other_memcpys_per_request']:.2f} | "
            f"{r['stats_equal']} |")
    print("\n".join(lines))
    print(f"(device {_device_name()}, torch {torch.__version__}, "
          f"{len(trace)} requests, transfers {', '.join(TRANSFER_OPS)} inside the api ranges)")
    if json_path is not None:
        write_json(json_path, rows)
    return 0 if all(r["stats_equal"] for r in rows) else 1
