"""Host synchronisations per request and per operation of the replay's engine on a (simulated)
CUDA device: ``python -m bench sync-counts``.

The replay's engine (:class:`bench.engine.core.ReplayEngine`) runs on ``device="cuda"`` inside
:class:`bench.dev.gpu.simcuda.SimCuda`, so every allocator, pool and cache takes its CUDA path on a
CPU-only machine, and every call the engine makes is charged with the host synchronisations
it causes (see ``bench/dev/gpu/simcuda.py`` for what counts). Four models over one seeded workload
(:func:`conversations`: multi-turn sessions over shared system prompts; memories small enough
that eviction, state eviction, SWA tombstones, host-tier demotion and load-back all happen)::

    kv        full-attention KV only
    hybrid    KV + recurrent states
    swa       KV + sliding-window KV
    hicache   KV + recurrent states + the host tier (write_through, a one-layer KV pool: the
              copies move real data)

``--json`` prints the counts as JSON (per model: requests, syncs per request, per operation
calls / syncs, and the call sites of the syncs). The test ``tests/gpu/test_sync_budget.py`` asserts
the budget on the same runs.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.dev.gpu.options import sync_counts_parser
from bench.dev.gpu.simcuda import SimCuda
from bench.engine.core import EngineConfig, ReplayEngine
from bench.traces.loader import TraceRequest, load_trace, runs_from_blocks

#: The engine-facing calls of the cache and the pool calls an engine makes itself.
CACHE_OPS = ("match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "evict", "evict_states",
             "evict_swa", "cache_unfinished_req", "cache_finished_req", "release_swa",
             "load_back", "poll_transfers")
ALLOC_OPS = ("alloc", "free")
STATE_OPS = ("alloc", "free", "copy")

#: The models measured (EngineConfig fields beyond the common ones).
MODELS: dict[str, dict[str, Any]] = {
    "kv": {"state_slots": 0},
    "hybrid": {"state_slots": 48},
    "swa": {"state_slots": 0, "sliding_window": 1024, "swa_tokens": 12_000},
    "hicache": {"state_slots": 48, "hicache_ratio": 2.0},
}
COMMON: dict[str, Any] = {"kv_tokens": 30_000, "chunk_size": 1024, "concurrency": 6,
                          "policy": "lru", "device": "cuda"}


def conversations(num_requests: int = 160, num_sessions: int = 24, seed: int = 0,
                  block_size: int = 64) -> list[TraceRequest]:
    """A seeded multi-turn workload: ``num_sessions`` sessions, each opened on one of four
    system prompts (16 blocks), picked with an exponential preference for the first ones;
    every request extends its session by 4-12 fresh blocks (the last block partial) and asks
    16-128 output tokens. Block ``h`` is tokens ``h*B+1 .. h*B+B``, as in the traces."""
    rng = random.Random(seed)
    systems = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    fresh = 10_000
    sessions = [list(systems[rng.randrange(4)]) for _ in range(num_sessions)]
    out = []
    for i in range(num_requests):
        s = min(int(rng.expovariate(1 / 6)), num_sessions - 1)
        add = rng.randint(4, 12)
        sessions[s] += range(fresh, fresh + add)
        fresh += add
        ids = sessions[s]
        length = len(ids) * block_size - rng.randint(0, block_size - 1)
        out.append(TraceRequest(float(i), length, rng.randint(16, 128), block_size, tuple(ids),
                                runs_from_blocks(ids, block_size, length)))
    return out


@dataclass
class ModelCounts:
    """One model's run: requests served and the simulator's per-operation counters."""

    model: str
    requests: int
    sim: SimCuda
    engine: ReplayEngine | None = None

    @property
    def per_request(self) -> float:
        return self.sim.total_syncs / max(self.requests, 1)

    def as_dict(self) -> dict[str, Any]:
        ops = {op: {"calls": s.calls, "syncs": s.total, "kinds": dict(s.syncs)}
               for op, s in sorted(self.sim.ops.items())}
        sites = [{"op": op, "kind": kind, "site": site, "count": n}
                 for (op, kind, site), n in self.sim.sites.most_common()]
        return {"model": self.model, "requests": self.requests, "syncs": self.sim.total_syncs,
                "syncs_per_request": self.per_request, "ops": ops, "sites": sites,
                "errors": list(self.sim.errors)}


def track_engine(sim: SimCuda, engine: ReplayEngine) -> None:
    """Charge syncs to the cache's engine-facing calls and the engine's pool calls."""
    cache = engine.cache
    sim.track(cache, [op for op in CACHE_OPS if hasattr(cache, op)], "cache")
    sim.track(engine.kv_allocator, ALLOC_OPS, "kv_allocator")
    if engine.state_pool is not None:
        sim.track(engine.state_pool, STATE_OPS, "state_pool")


def run_model(model: str, trace: Sequence[TraceRequest], *, strict: bool = True,
              check_every: int = 0, **extra: Any) -> ModelCounts:
    """Replay ``trace`` through one model on the simulated device (``check_every`` > 0:
    ``sanity_check()`` after every that many requests, outside the counted calls; ``extra``:
    ``EngineConfig`` fields over the model's, e.g. ``page_size``)."""
    cfg = EngineConfig(**{**COMMON, **MODELS[model], **extra})
    with SimCuda(strict=strict) as sim:
        engine = ReplayEngine(cfg)
        track_engine(sim, engine)
        sim.track(engine.cache, ["sanity_check"], "checks")  # reads the device: not counted
        for i, tr in enumerate(trace):
            engine.admit(tr, rid=i)
            if check_every and (i + 1) % check_every == 0:
                engine.cache.sanity_check()
        engine.drain()
        engine.cache.sanity_check()
        sim.ops.pop("checks.sanity_check", None)
    return ModelCounts(model, len(trace), sim, engine)


def table(results: Sequence[ModelCounts]) -> str:
    """Markdown: syncs per request per model, then per operation (syncs / calls)."""
    ops = sorted({op for r in results for op in r.sim.ops})
    head = "| | " + " | ".join(r.model for r in results) + " |"
    rule = "|---|" + "---:|" * len(results)
    lines = [head, rule,
             "| syncs per request | " + " | ".join(f"{r.per_request:.2f}" for r in results) + " |"]
    for op in ops:
        cells = []
        for r in results:
            s = r.sim.ops.get(op)
            cells.append("" if s is None else f"{s.total / max(s.calls, 1):.2f} ({s.total}/{s.calls})")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = sync_counts_parser().parse_args(argv)
    trace = (conversations(args.requests) if args.trace is None
             else load_trace(args.trace, max_requests=args.requests))
    results = [run_model(m, trace, strict=False, page_size=args.page_size) for m in args.models]
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        print(table(results))
        for r in results:
            for e in r.sim.errors[:5]:
                print(f"{r.model}: error: {e}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
