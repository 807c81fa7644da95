"""``radix_eviction_policy="unified"``: one GreedyDual order per byte over KV leaves and states.

Arena shapes (tests/allocators/test_arena.py): K = 64 B per KV token, a state frees one chunk
S = 384 B; page_size 2. Cost knobs d = 1, e = 0: ``cost(a, b) = b - a`` tokens.

Tree (every node holds a state, stamps all at L = 0):

    P = [0..4)             depth 4,  internal    state:  cost(0, 4)  = 4  / 384       = 0.010417
    Q = P + 36 tokens      depth 40, leaf        leaf:   cost(4, 40) = 36 / (36*64+384) = 0.013393
    R = P + [100..104)     depth 8,  leaf        leaf:   cost(4, 8)  = 4  / (4*64+384)  = 0.006250

(priorities per MiB; a leaf's own state ranks above the leaf: same cost, fewer bytes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import MambaStatePool, TokenAllocator
from allocators.arena import KVShape, MemoryArena, StateShape
from components.eviction.unified import MIB, UnifiedStrategy, make_room
from hicache import HiCacheConfig
from radix.cache import RadixCache
from radix.config import CacheConfig

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))
CFG = CacheConfig(page_size=2, radix_eviction_policy="unified",
                  radix_eviction_policy_config={"d": 1.0, "e": 0.0})
P = [0, 1, 2, 3]
Q = P + list(range(4, 40))
R = P + [100, 101, 102, 103]


def build(chunks: int = 20, state_slots: int = 4) -> tuple[RadixCache, MemoryArena]:
    a = MemoryArena((chunks - 1) * 384, KV, ST, state_slots=state_slots)
    return RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool), a


def insert(cache: RadixCache, a: MemoryArena, key: list[int]) -> None:
    m = cache.match_prefix(key)
    new = a.kv_allocator.alloc(len(key) - len(m.device_indices))
    slot = a.state_pool.alloc_slot()
    assert new is not None and slot is not None
    res = cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot)
    assert res.state_adopted


def tree(cache: RadixCache) -> list[tuple[int, bool]]:
    return sorted((n.depth, n.state_slot is not None) for n in cache.tree.iter_nodes()
                  if n.parent is not None)


def test_victims_in_cost_per_byte_order_by_hand() -> None:
    cache, a = build()
    for key in (P, Q, R):
        insert(cache, a, key)
    assert isinstance(cache.state.gds if cache.state else None, UnifiedStrategy)
    # 700 B: R's leaf (4 tokens + its state = 640 B), then P's state (internal: 384 B).
    res = cache.evict_bytes(700)
    assert (res.num_tokens, res.num_states) == (4, 2)
    assert res.other == () and res.units("num_tokens") == 4  # a whole EvictResult
    assert tree(cache) == [(4, False), (40, True)]
    assert cache.watermark == pytest.approx(4 / 384 * MIB)  # L rose to P's priority
    # Q's leaf now rebuilds from 0: 40 / 2688; it goes with P, left a stateless leaf.
    res = cache.evict_bytes(1)
    assert (res.num_tokens, res.num_states) == (40, 1)
    assert cache.watermark == pytest.approx(40 / 2688 * MIB)
    assert tree(cache) == []
    assert (a.kv_allocator.available_size(), a.state_pool.available_size()) == (90, 4)
    cache.sanity_check()
    a.check()


def test_locked_candidates_are_skipped() -> None:
    cache, a = build()
    for key in (P, Q, R):
        insert(cache, a, key)
    lock = cache.inc_lock_ref(cache.match_prefix(R).last_device_node)
    # R (leaf and state) is locked: P's state, then Q's leaf.
    res = cache.evict_bytes(385)
    assert (res.num_tokens, res.num_states) == (36, 2)
    assert tree(cache) == [(4, False), (8, True)]
    assert cache.evict_bytes(10**6).num_tokens == 0  # nothing else may go
    cache.dec_lock_ref(lock)
    cache.sanity_check()


def test_per_kind_evictions_keep_the_unified_order() -> None:
    cache, a = build()
    for key in (P, Q, R):
        insert(cache, a, key)
    assert cache.evict(1).num_tokens == 4  # KV leaves: R (0.00625) before Q (0.0134)
    assert tree(cache) == [(4, True), (40, True)]
    assert cache.evict_states(1).num_states == 1  # states: P's (0.0104) before Q's (0.094)
    assert tree(cache) == [(4, False), (40, True)]
    cache.sanity_check()


def test_make_room_moves_the_boundary_and_evicts_by_value() -> None:
    cache, a = build(chunks=20, state_slots=4)  # 15 KV chunks (90 tokens), 4 state slots
    for key in (P, Q, R):
        insert(cache, a, key)
    kv, st = a.kv_allocator, a.state_pool
    assert (kv.available_size(), st.available_size()) == (90 - 44, 1)
    # 2 more states: KV chunks wholly free can move (chunks 19..16 hold no used page).
    assert make_room(cache, a, states=2) is True
    assert (a.num_state_chunks, st.available_size()) == (5, 2)
    assert tree(cache) == [(4, True), (8, True), (40, True)]  # nothing evicted
    # Every token of the arena's KV chunks but one chunk's worth: states go first, cheapest.
    before = kv.available_size()
    assert make_room(cache, a, kv_tokens=before + 6) is True  # one free state chunk moves
    assert a.num_state_chunks == 4 and tree(cache) == [(4, True), (8, True), (40, True)]
    assert make_room(cache, a, kv_tokens=kv.owned_size() + 100) is False
    cache.sanity_check()
    a.check()


def test_evict_bytes_bad_input_and_other_policies() -> None:
    cache, _ = build()
    with pytest.raises(ValueError, match="num_bytes"):
        cache.evict_bytes(-1)
    a = MemoryArena(3616, KV, ST)
    lru = RadixCache(CacheConfig(page_size=2), kv_allocator=a.kv_allocator,
                     state_allocator=a.state_pool)
    with pytest.raises(ValueError, match="evict_bytes needs radix_eviction_policy='unified'"):
        lru.evict_bytes(1)
    with pytest.raises(ValueError, match="make_room needs"):
        make_room(lru, a, states=1)


def test_unified_refuses_what_it_does_not_support() -> None:
    a = MemoryArena(3616, KV, ST)
    kv_only = RadixCache(CFG, kv_allocator=a.kv_allocator)  # lru on KV leaves, as gds
    with pytest.raises(ValueError, match="evict_bytes needs"):
        kv_only.evict_bytes(1)
    with pytest.raises(ValueError, match="hicache is not supported"):
        RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool,
                   hicache=HiCacheConfig())
    with pytest.raises(ValueError, match="sliding_window_size is not supported"):
        CacheConfig(page_size=2, radix_eviction_policy="unified", sliding_window_size=4)
    with pytest.raises(ValueError, match="kv_allocator must be a MemoryArena view or have a pool"):
        RadixCache(CacheConfig(radix_eviction_policy="unified"), kv_allocator=TokenAllocator(8),
                   state_allocator=MambaStatePool(2))


def test_unified_over_separate_pools_weighs_their_bytes() -> None:
    from allocators import KVPool

    pool = KVPool(16, num_layers=1, num_heads=1, head_dim=4, dtype=torch.float16)  # 16 B/token
    sp = MambaStatePool(2, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(3,))  # 16 B
    cache = RadixCache(CacheConfig(radix_eviction_policy="unified"),
                       kv_allocator=TokenAllocator(16, pool=pool), state_allocator=sp)
    walk = cache.state.gds if cache.state else None
    assert isinstance(walk, UnifiedStrategy)
    assert (walk.kv_bytes_per_token, walk.state_bytes) == (16, 16)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("e", [0.0, 2000.0])
def test_random_victims_are_the_exact_minimum_over_both_kinds(seed: int, e: float) -> None:
    """Random inserts, matches, locks and byte evictions: each ``evict_bytes`` victim has the
    least true priority over every candidate of both kinds (brute force), every heap entry
    stays a lower bound, and the watermark never falls."""
    import random

    rng = random.Random(seed)
    a = MemoryArena(59 * 384, KV, ST, state_slots=20)
    cfg = CacheConfig(page_size=2, radix_eviction_policy="unified",
                      radix_eviction_policy_config={"d": 1.0, "e": e})
    cache = RadixCache(cfg, kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    walk = cache.state.gds if cache.state else None
    assert isinstance(walk, UnifiedStrategy)
    keys: list[list[int]] = []
    locks: list[Any] = []
    checked = 0
    level = 0.0
    for _ in range(400):
        r = rng.random()
        if r < 0.45:
            base = rng.choice(keys)[: 2 * rng.randint(0, 6)] if keys and rng.random() < 0.7 else []
            key = base + [rng.randint(0, 9) for _ in range(2 * rng.randint(1, 5))]
            if not make_room(cache, a, kv_tokens=len(key), states=1):
                continue
            insert(cache, a, key)
            keys.append(key)
        elif r < 0.6 and keys:
            m = cache.match_prefix(rng.choice(keys))
            if rng.random() < 0.3 and m.last_device_node is not cache.root:
                locks.append(cache.inc_lock_ref(m.last_device_node))
        elif r < 0.7 and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            leaves = walk.kv_leaves
            prio: dict[tuple[str, int], float] = {
                ("kv", n.id): leaves.heap.true_priority(n) for n in leaves}
            prio.update({("state", n.id): walk.heap.true_priority(n)
                         for n in cache.tree.iter_nodes()
                         if n.parent is not None and walk.is_candidate_state(n)})
            stateful = {n.id for n in cache.tree.iter_nodes() if n.state_slot is not None}
            ids = {n.id for n in cache.tree.iter_nodes()}
            res = cache.evict_bytes(1)  # exactly one victim (it frees >= 1 byte)
            if not prio:
                assert (res.num_tokens, res.num_states) == (0, 0)
                continue
            now = {n.id: n for n in cache.tree.iter_nodes()}
            gone = ids - set(now)
            lost = {i for i in stateful & set(now) if now[i].state_slot is None}
            got = [p for (kind, i), p in prio.items()
                   if (i in gone and kind in ("kv", "state")) or (i in lost and kind == "state")]
            assert got, f"no candidate left: gone {gone}, lost state {lost}"
            assert min(got) == pytest.approx(min(prio.values()), rel=1e-9, abs=1e-9)
            assert walk.watermark >= level
            level = walk.watermark
            checked += 1
        cache.sanity_check()
        a.check()
    assert checked >= 20
