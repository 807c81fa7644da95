"""Helpers shared by the GreedyDual-Size cache tests (``gds`` and its variants)."""

from __future__ import annotations

import random

from allocators import MambaStatePool, TokenAllocator
from radix import CacheConfig, RadixCache
from radix.node import TreeNode
from tests.helpers.cache_helpers import draw_tokens, tiny_state_pool


def make(d: float = 1.0, e: float = 0.0, size: int = 1200, states: int = 8,
         policy: str = "gds") -> tuple[RadixCache, TokenAllocator, MambaStatePool]:
    """A hybrid cache with the GDS-family ``policy`` and cost coefficients ``d``, ``e`` over
    ``size`` KV slots and ``states`` tiny state slots: (cache, KV allocator, state pool)."""
    kv = TokenAllocator(size)
    pool = tiny_state_pool(states)
    cfg = CacheConfig(radix_eviction_policy=policy, radix_eviction_policy_config={"d": d, "e": e})
    return RadixCache(cfg, kv_allocator=kv, state_allocator=pool), kv, pool


def gds_entry(cache: RadixCache, node: TreeNode) -> float | None:
    """The priority of ``node``'s current entry in the cache's GreedyDual heap (``None``: no
    entry, or no GreedyDual walk)."""
    heap = getattr(cache.state.gds, "heap", None) if cache.state is not None else None
    return None if heap is None else heap.entry(node.id)


def gds_stamp(cache: RadixCache, node: TreeNode) -> float | None:
    """The stamp of ``node``'s state in the cache's GreedyDual heap: the watermark at its last
    use (``None``: no state, or no GreedyDual walk)."""
    heap = getattr(cache.state.gds, "heap", None) if cache.state is not None else None
    return None if heap is None else heap.stamp.get(node.id)


def state_nodes(cache: RadixCache) -> list[TreeNode]:
    """Every node holding a state (any order)."""
    out, stack = [], list(cache.root.children.values())
    while stack:
        n = stack.pop()
        if n.state_slot is not None:
            out.append(n)
        stack.extend(n.children.values())
    return out


def put(cache: RadixCache, kv: TokenAllocator, pool: MambaStatePool,
        key: list[int], extra: dict | None = None) -> tuple[TreeNode, int]:
    """Insert ``key`` with fresh KV slots (the cached part comes back as duplicates, freed)
    and a fresh state slot at its end, with the request hints ``extra``. No match, so no
    state is stamped on the way."""
    slot = int(pool.alloc(1)[0])
    res = cache.insert(key, kv.alloc(len(key)), state_slot=slot, extra=extra)
    assert res.state_adopted
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()
    return res.last_node, slot


def draw_key(rng: random.Random, keys: list[list[int]]) -> list[int]:
    """A random key over tokens 1..3, usually extending a prefix of an earlier one (shared
    prefixes: splits, chains of states); appended to ``keys``."""
    return draw_tokens(rng, keys, min_cut=1, grow=(0, 6), fresh=(1, 12))
