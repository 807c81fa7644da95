"""Helpers shared by the GreedyDual-Size cache tests (``gds`` and its variants)."""

from __future__ import annotations

import random

from allocators import MambaStatePool, TokenAllocator
from radix import CacheConfig, RadixCache
from radix.node import TreeNode


def make(d: float = 1.0, e: float = 0.0, size: int = 1200, states: int = 8,
         policy: str = "gds") -> tuple[RadixCache, TokenAllocator, MambaStatePool]:
    """A hybrid cache with the GDS-family ``policy`` and cost coefficients ``d``, ``e`` over
    ``size`` KV slots and ``states`` tiny state slots: (cache, KV allocator, state pool)."""
    kv = TokenAllocator(size)
    pool = MambaStatePool(states, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))
    cfg = CacheConfig(radix_eviction_policy=policy, radix_eviction_policy_config={"d": d, "e": e})
    return RadixCache(cfg, kv_allocator=kv, state_allocator=pool), kv, pool


def put(cache: RadixCache, kv: TokenAllocator, pool: MambaStatePool,
        key: list[int]) -> tuple[TreeNode, int]:
    """Insert ``key`` with fresh KV slots (the cached part comes back as duplicates, freed)
    and a fresh state slot at its end. No match, so no state is stamped on the way."""
    slot = int(pool.alloc(1)[0])
    res = cache.insert(key, kv.alloc(len(key)), state_slot=slot)
    assert res.state_adopted
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()
    return res.last_node, slot


def draw_key(rng: random.Random, keys: list[list[int]]) -> list[int]:
    """A random key over tokens 1..3, usually extending a prefix of an earlier one (shared
    prefixes: splits, chains of states); appended to ``keys``."""
    if keys and rng.random() < 0.7:
        base = rng.choice(keys)
        key = base[: rng.randint(1, len(base))] + [rng.randint(1, 3) for _ in range(rng.randint(0, 6))]
    else:
        key = [rng.randint(1, 3) for _ in range(rng.randint(1, 12))]
    keys.append(key)
    return key
