"""Insert cost over a memory arena: 900 inserts of 128 new tokens and a state into a unified
cache over a fresh arena of 64-token chunks (page size 1); prints the best of 5 runs, in
microseconds per insert. Run from a checkout's root: ``PYTHONPATH=. python
bench/results/hunt-arena/bench_insert.py`` (see ``bench/results/2026-12-06-hunt-arena.md``)."""

from __future__ import annotations

import time

import torch

from allocators.arena import KVShape, MemoryArena, StateShape
from radix.cache import RadixCache
from radix.config import CacheConfig


def best_insert_us(runs: int = 5, requests: int = 900) -> float:
    kv_shape = KVShape(1, 1, 1, torch.float16, 1)  # 4 B per token
    st_shape = StateShape(1, (1,), (63,), torch.float32)  # 256 B: 64 tokens per chunk
    best = float("inf")
    for _ in range(runs):
        a = MemoryArena(4000 * 256, kv_shape, st_shape, state_slots=1000)
        cache = RadixCache(CacheConfig(page_size=1, radix_eviction_policy="unified"),
                           kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
        reqs = []
        for i in range(requests):
            kv = a.kv_allocator.alloc(128)
            slot = a.state_pool.alloc_slot()
            assert kv is not None and slot is not None
            reqs.append((list(range(i * 1000, i * 1000 + 128)), kv, slot))
        t = time.perf_counter()
        for key, kv, slot in reqs:
            cache.insert(key, kv, state_slot=slot)
        best = min(best, (time.perf_counter() - t) / requests * 1e6)
    return best


if __name__ == "__main__":
    print(f"insert of 128 tokens + a state over an arena: {best_insert_us():.2f} us "
          "(best of 5)")
