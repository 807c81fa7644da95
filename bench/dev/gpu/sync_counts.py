"""Host synchronisations, kernel launches and memcpys per request and per operation of the
replay's engine on a (simulated) CUDA device: ``python -m bench sync-counts``.

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

The host tier's transfers are counted over :data:`HOST_TIER_MODELS` (``hicache``, and the
sliding-window models ``swa_hicache``: KV + SWA KV, ``hybrid_swa_hicache``: KV + SWA KV +
states; each with one-layer device pools behind every allocator):
``tests/gpu/test_gpu_transfers.py`` and ``python -m bench hicache-bandwidth --replay``.

Counted (``bench/dev/gpu/simcuda.py``): host synchronisations, kernel launches and memcpys of the
engine-facing calls (the cache's, the pools' alloc / free / copy); the host tier's data
transfers (:data:`TRANSFER_OPS`) apart. After every request the replay runs what a forward
step reads first (:class:`Step`: the state pool's pending zeroing and copies, the SWA device
map's pending writes), counted apart as ``step.read``: an engine does it once per step for the
whole batch, the replay once per request.

``--json [FILE]`` writes the counts as JSON (per model: requests, ``syncs_per_request``,
``launches_per_request``, ``memcpys_per_request``, the step's, per operation calls / syncs /
launches / memcpys, and the call sites). ``--device cuda`` runs the real-GPU comparison
instead (``bench.dev.gpu.real_device``). The test ``tests/gpu/test_sync_budget.py`` asserts the
budget on the same runs.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.dev.gpu.options import sync_counts_parser
from bench.dev.gpu.simcuda import OUTSIDE, SimCuda
from bench.engine.core import EngineConfig, ReplayEngine
from bench.traces.loader import TraceRequest, load_trace, runs_from_blocks
from radix import CacheConfig

#: The engine-facing calls of the cache and the pool calls an engine makes itself.
CACHE_OPS = ("match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "evict", "evict_states",
             "evict_swa", "cache_unfinished_req", "cache_finished_req", "release_swa",
             "load_back", "poll_transfers")
ALLOC_OPS = ("alloc", "free")
STATE_OPS = ("alloc", "free", "copy")
#: The host tier's data transfers (``HiCacheController``): their launches and memcpys are
#: counted apart (``ApiCalls.excluded``), not in the per-request budget.
TRANSFER_OPS = ("write", "save_state", "load", "write_rows", "load_rows", "poll")

#: The label of the per-step reads (:class:`Step`), counted apart from the engine-facing calls.
STEP = "step"

#: CUDA API calls (kernel launches + memcpys) per request allowed to the engine-facing calls,
#: per model, in the common path (the host tier's data transfers and the step's reads apart).
API_BUDGET = {"kv": 2, "hybrid": 4, "swa": 4, "hicache": 6}

#: The models measured (EngineConfig fields beyond the common ones).
MODELS: dict[str, dict[str, Any]] = {
    "kv": {"state_slots": 0},
    "hybrid": {"state_slots": 48},
    "swa": {"state_slots": 0, "sliding_window": 1024, "swa_tokens": 12_000},
    "hicache": {"state_slots": 48, "hicache_ratio": 2.0},
}
#: The models with a host tier whose transfers ``tests/gpu/test_gpu_transfers.py`` and
#: ``python -m bench hicache-bandwidth --replay`` count (``run_model`` takes these names too):
#: which pool pairs the host tier moves (KV; recurrent states; sliding-window KV).
HOST_TIER_MODELS: dict[str, dict[str, Any]] = {
    "hicache": MODELS["hicache"],  # KV + states
    "swa_hicache": {**MODELS["swa"], "hicache_ratio": 2.0},  # KV + SWA KV
    "hybrid_swa_hicache": {**MODELS["swa"], "state_slots": 48, "hicache_ratio": 2.0},
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


class Step:
    """What a forward step reads before it runs, per request in the replay: the state pool's
    states (its pending zeroing and copies go out: ``MambaStatePool.flush``) and the SWA
    allocator's device map (its pending writes go out: ``full_to_swa_device``)."""

    def __init__(self, engine: ReplayEngine) -> None:
        self.engine = engine

    def read(self) -> None:
        flush = getattr(self.engine.state_pool, "flush", None)  # (a pool with pending work)
        if flush is not None:
            flush()
        getattr(self.engine.kv_allocator, "full_to_swa_device", None)


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

    def _api(self, step: bool, memcpys: bool) -> int:
        total = 0
        for op, c in self.sim.api.items():
            if op != OUTSIDE and op.startswith(STEP + ".") == step:
                total += sum((c.memcpys if memcpys else c.launches).values())
        return total

    @property
    def launches_per_request(self) -> float:
        """Kernel launches of the engine-facing calls per request (transfers excluded)."""
        return self._api(False, False) / max(self.requests, 1)

    @property
    def memcpys_per_request(self) -> float:
        """Memcpys of the engine-facing calls per request (transfers excluded)."""
        return self._api(False, True) / max(self.requests, 1)

    @property
    def api_per_request(self) -> float:
        """Launches plus memcpys of the engine-facing calls per request: the budgeted sum."""
        return self.launches_per_request + self.memcpys_per_request

    @property
    def step_launches_per_request(self) -> float:
        """Kernel launches of the per-request step reads (:class:`Step`)."""
        return self._api(True, False) / max(self.requests, 1)

    @property
    def step_memcpys_per_request(self) -> float:
        """Memcpys of the per-request step reads (:class:`Step`)."""
        return self._api(True, True) / max(self.requests, 1)

    def as_dict(self) -> dict[str, Any]:
        sim = self.sim
        ops = {op: {"calls": s.calls, "syncs": s.total, "kinds": dict(s.syncs),
                    "launches": dict(sim.api_of(op).launches),
                    "memcpys": dict(sim.api_of(op).memcpys),
                    "excluded": dict(sim.api_of(op).excluded)}
               for op, s in sorted(sim.ops.items())}
        sites = [{"op": op, "kind": kind, "site": site, "count": n}
                 for (op, kind, site), n in self.sim.sites.most_common()]
        api_sites = [{"op": op, "what": what, "kind": kind, "site": site, "count": n}
                     for (op, what, kind, site), n in sim.api_sites.most_common()]
        return {"model": self.model, "requests": self.requests, "syncs": sim.total_syncs,
                "syncs_per_request": self.per_request,
                "launches_per_request": self.launches_per_request,
                "memcpys_per_request": self.memcpys_per_request,
                "step_launches_per_request": self.step_launches_per_request,
                "step_memcpys_per_request": self.step_memcpys_per_request,
                "api_budget_per_request": API_BUDGET.get(self.model),
                "ops": ops, "sites": sites, "api_sites": api_sites,
                "errors": list(sim.errors)}


def track_engine(sim: SimCuda, engine: ReplayEngine) -> None:
    """Charge syncs, launches and memcpys to the cache's engine-facing calls and the engine's
    pool calls; the host tier's data transfers (:data:`TRANSFER_OPS`) counted apart."""
    cache = engine.cache
    sim.track(cache, [op for op in CACHE_OPS if hasattr(cache, op)], "cache")
    hicache = getattr(cache, "hicache", None)
    if hicache is not None:
        sim.exclude(hicache, [op for op in TRANSFER_OPS if hasattr(hicache, op)])
        if hasattr(engine.state_pool, "flush"):  # pending state work a transfer's read sends
            sim.include(engine.state_pool, ["flush"])
    sim.track(engine.kv_allocator, ALLOC_OPS, "kv_allocator")
    if engine.state_pool is not None:
        sim.track(engine.state_pool, STATE_OPS, "state_pool")


def run_model(model: str, trace: Sequence[TraceRequest], *, strict: bool = True,
              check_every: int = 0, **extra: Any) -> ModelCounts:
    """Replay ``trace`` through one model on the simulated device (``check_every`` > 0:
    ``sanity_check()`` after every that many requests, outside the counted calls; ``extra``:
    ``EngineConfig`` fields over the model's, e.g. ``page_size``). ``model``: a name of
    :data:`MODELS` or :data:`HOST_TIER_MODELS`."""
    cfg = EngineConfig(**{**COMMON, **{**MODELS, **HOST_TIER_MODELS}[model], **extra})
    with SimCuda(strict=strict) as sim:
        engine = ReplayEngine(cfg)
        track_engine(sim, engine)
        sim.track(engine.cache, ["sanity_check"], "checks")  # reads the device: not counted
        step = Step(engine)
        sim.track(step, ["read"], STEP)
        for i, tr in enumerate(trace):
            engine.admit(tr, rid=i)
            step.read()
            if check_every and (i + 1) % check_every == 0:
                engine.cache.sanity_check()
        engine.drain()
        engine.cache.sanity_check()
        sim.ops.pop("checks.sanity_check", None)
        sim.api.pop("checks.sanity_check", None)
    return ModelCounts(model, len(trace), sim, engine)


def table(results: Sequence[ModelCounts]) -> str:
    """Markdown: syncs per request per model, then per operation (syncs / calls)."""
    ops = sorted({op for r in results for op in r.sim.ops})
    head = "| | " + " | ".join(r.model for r in results) + " |"
    rule = "|---|" + "---:|" * len(results)
    lines = [head, rule,
             "| syncs per request | " + " | ".join(f"{r.per_request:.2f}" for r in results) + " |",
             "| launches per request | "
             + " | ".join(f"{r.launches_per_request:.2f}" for r in results) + " |",
             "| memcpys per request | "
             + " | ".join(f"{r.memcpys_per_request:.2f}" for r in results) + " |",
             "| budget (launches + memcpys) | "
             + " | ".join(str(API_BUDGET.get(r.model, "")) for r in results) + " |",
             "| step reads: launches + memcpys per request | "
             + " | ".join(f"{r.step_launches_per_request:.2f} + {r.step_memcpys_per_request:.2f}"
                          for r in results) + " |"]
    for op in ops:
        cells = []
        for r in results:
            s = r.sim.ops.get(op)
            cells.append("" if s is None else f"{s.total / max(s.calls, 1):.2f} ({s.total}/{s.calls})")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = sync_counts_parser()
    args = parser.parse_args(argv)
    try:  # the policy, before anything is built
        CacheConfig(page_size=args.page_size, radix_eviction_policy=args.policy)
    except ValueError as exc:
        parser.error(f"--policy: {exc}")
    if args.device == "cuda":
        from bench.dev.gpu.real_device import has_cuda

        if not has_cuda():  # before the trace is read
            return 2
    try:
        trace = (conversations(args.requests) if args.trace is None
                 else load_trace(args.trace, max_requests=args.requests))
    except (FileNotFoundError, ValueError) as exc:  # TraceFormatError is a ValueError
        parser.error(str(exc))
    extra: dict[str, Any] = {"page_size": args.page_size, "policy": args.policy}
    if args.kv_tokens is not None:
        extra["kv_tokens"] = args.kv_tokens
    if args.device == "cuda":
        from bench.dev.gpu.real_device import compare

        return compare(args.models, trace, json_path=args.json, **extra)
    results = [run_model(m, trace, strict=False, **extra) for m in args.models]
    if args.json is not None:
        text = json.dumps([r.as_dict() for r in results], indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    print(table(results))
    for r in results:
        for e in r.sim.errors[:5]:
            print(f"{r.model}: error: {e}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
