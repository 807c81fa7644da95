"""Where the unified arena loses against the best fixed split at one point (issue 38).

    PYTHONPATH=. python bench/results/memory-split-8/decompose.py MODEL WORKLOAD GB MODE [F]

MODE:

* ``fixed F``: two fixed pools, state fraction ``F``, per-kind orders (``gds``: LRU KV leaves,
  GreedyDual-Size states), as ``python -m bench memory-split`` runs them;
* ``hard F``: the arena with its boundary never moved from ``F`` (``make_room`` replaced by
  ``cache.evict`` / ``cache.evict_states`` of the short side: each kind frees its own, in the
  unified orders);
* ``held F``: the arena with its own mechanics, the learned target replaced by ``F``;
* ``unified``: the arena as shipped; prints the band and the target every 5 % of the trace.

Prints the token hit rate and the KV hit rate (percent of prompt tokens).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

import bench.engine.arena as engine_arena
from bench.engine.core import EngineConfig, ReplayEngine
from bench.engine.presets import UNIFIED, ArenaLayout, engine_sizes, get_preset, split_memory
from bench.workloads import workload_requests
from components.eviction.boundary import BoundaryTarget
from components.eviction.unified import UnifiedStrategy
from radix.results import EvictResult


class HeldTarget(BoundaryTarget):
    """A boundary target that stays at ``chunks`` (the ghosts still record)."""

    def __init__(self, kv_bytes_per_token: int, state_bytes: int, chunks: int) -> None:
        super().__init__(kv_bytes_per_token, state_bytes)
        self.chunks = chunks

    def target_chunks(self, chunk_bytes: int) -> int:
        return self.chunks


def _hard(cache: Any, arena: Any, *, kv_tokens: int = 0, states: int = 0,
          on_evict: Any = None) -> bool:
    """``make_room`` with the boundary fixed: the short side frees its own."""
    res: EvictResult | None = None
    short = kv_tokens - arena.kv_allocator.available_size()
    if kv_tokens and short > 0:
        res = cache.evict(short)
        if on_evict is not None:
            on_evict(res)
    short = states - arena.state_pool.available_size()
    if states and short > 0:
        res = cache.evict_states(short)
        if on_evict is not None:
            on_evict(res)
    return True


def main(argv: list[str]) -> None:
    model, workload, gb, mode = argv[0], argv[1], float(argv[2]), argv[3]
    frac = float(argv[4]) if len(argv) > 4 else 0.0
    torch.set_num_threads(1)
    preset = get_preset(model)
    trace = workload_requests(workload, 0, None)
    engine: ReplayEngine
    walk: Any = None
    if mode == "fixed":
        split = split_memory(preset, gb, frac, 1)
        engine = ReplayEngine(EngineConfig(policy="gds", kv_tokens=split.kv_tokens,
                                           state_slots=split.state_slots, page_size=1,
                                           chunk_size=8192, concurrency=32))
    else:
        sizes: dict[str, Any] = engine_sizes(preset, gb, UNIFIED, 1)
        layout: ArenaLayout = sizes["arena"]
        if mode in ("hard", "held"):
            n = round(frac * (layout.num_chunks - 1))
            layout = ArenaLayout(tokens_per_chunk=layout.tokens_per_chunk,
                                 num_chunks=layout.num_chunks, state_chunks=n)
            sizes.update(arena=layout, kv_tokens=layout.kv_tokens, state_slots=n)
            if mode == "hard":
                engine_arena.make_room = _hard
        engine = engine_arena.ArenaReplayEngine(EngineConfig(**sizes, page_size=1,
                                                             chunk_size=8192, concurrency=32))
        walk = engine.cache.state.gds if engine.cache.state is not None else None
        assert isinstance(walk, UnifiedStrategy)
        if mode == "held":
            walk.boundary = HeldTarget(walk.kv_bytes_per_token, walk.state_bytes,
                                       round(frac * (layout.num_chunks - 1)))
    step = max(1, len(trace) // 20)
    for i, req in enumerate(trace):
        engine.admit(req, rid=i)
        if mode == "unified" and i % step == 0:
            assert isinstance(engine, engine_arena.ArenaReplayEngine)
            assert isinstance(walk, UnifiedStrategy)
            arena = engine.arena
            target = walk.boundary.target_bytes
            usable = arena.num_chunks - 1
            print(f"request {i:5d}: state band {arena.num_state_chunks / usable:.3f}, target "
                  f"{(target or 0) / arena.chunk_bytes / usable:.3f}")
    engine.drain()
    usable_len = np.frombuffer(engine.log.usable_len, dtype=np.int64)
    kv_len = np.frombuffer(engine.log.kv_hit_len, dtype=np.int64)
    total = sum(len(r.token_array) for r in trace)
    print(f"{mode} {frac}: token hit {100 * usable_len.sum() / total:.2f} %, "
          f"KV hit {100 * kv_len.sum() / total:.2f} %")


if __name__ == "__main__":
    main(sys.argv[1:])
