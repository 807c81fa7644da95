"""Hybrid cache (KV + recurrent-state checkpoints): narrated scenarios with exact slots.

State slots come from ``MambaStatePool(n)``: ids ``1..n`` ascending, FIFO reuse, so the tail of
``pool.snapshot().free_ids()`` names the states an eviction gave back.
"""

from __future__ import annotations

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix import CacheConfig, CacheRequest, EvictResult, RadixCache
from tests.helpers.cache_helpers import free_leftovers


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def ids(x: torch.Tensor) -> list[int]:
    assert x.dtype == torch.int64 and x.dim() == 1
    return x.tolist()


def make(page_size: int = 1, size: int = 32, states: int = 4, policy: str | None = None):
    kv = TokenAllocator(size) if page_size == 1 else PagedAllocator(size, page_size)
    pool = MambaStatePool(states, num_layers=2, conv_state_shape=(2,), ssm_state_shape=(2, 2))
    cache = RadixCache(
        CacheConfig(page_size=page_size, radix_eviction_policy=policy),
        kv_allocator=kv,
        state_allocator=pool,
    )
    cache.sanity_check()
    return cache, kv, pool


def put(cache: RadixCache, kv, pool, key: list[int], prefix: torch.Tensor | None = None):
    """Insert ``key`` reusing ``prefix`` slots (from a match) and fresh ones for the rest,
    with a fresh state slot; free whatever the result leaves to the caller."""
    prefix = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
    ps = cache.page_size
    need = len(key) - len(prefix)
    fresh = kv.alloc(-(-need // ps) * ps)
    slot = int(pool.alloc(1)[0])
    res = cache.insert(key, torch.cat([prefix, fresh[:need]]), state_slot=slot)
    free_leftovers(kv, res, fresh, need)
    if not res.state_adopted:
        pool.free(t64(slot))
    cache.sanity_check()
    return res, slot


def state_tail(pool, n: int) -> list[int]:
    return pool.snapshot().free_ids()[-n:]


K = list(range(1, 13))  # tokens 1..12


# ====================================================================== matching
def test_match_truncates_to_the_deepest_matched_state() -> None:
    cache, kv, pool = make()
    res, s8 = put(cache, kv, pool, K[:8])  # slots 1..8, state 1 at 8
    assert (res.prefix_len, res.inserted_len, res.state_adopted, s8) == (0, 8, True, 1)
    assert (cache.state_evictable_size(), cache.state_protected_size()) == (1, 0)

    m = cache.match_prefix(K[:8] + [30])
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.branching_seqlen) == (8, 8, 1, None)
    assert ids(m.device_indices) == list(range(1, 9))
    assert m.last_device_node.state_slot == 1 and m.state_miss_tokens == 0

    # KV up to 6, no state there: nothing usable; branch point at 6.
    m = cache.match_prefix(K[:6] + [30])
    cache.sanity_check()
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.branching_seqlen) == (0, 6, None, 6)
    assert ids(m.device_indices) == [] and m.last_device_node is cache.root
    assert m.state_miss_tokens == 6

    # A state at 4: the same query is usable up to 4.
    res, s4 = put(cache, kv, pool, K[:4], prefix=t64(1, 2, 3, 4))
    assert (res.prefix_len, res.inserted_len, res.state_adopted, s4) == (4, 4, True, 2)
    assert ids(res.duplicate_indices) == [] and ids(res.adopted_indices) == []
    m = cache.match_prefix(K[:6] + [30])
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.branching_seqlen) == (4, 6, 2, 6)
    assert ids(m.device_indices) == [1, 2, 3, 4]
    cache.sanity_check()


def test_branching_seqlen_is_page_aligned_and_none_without_a_branch() -> None:
    cache, kv, pool = make(page_size=4, size=48)
    res, s12 = put(cache, kv, pool, K)  # pages 1..3 = slots 4..15, state 1 at 12
    assert ids(res.adopted_indices) == list(range(4, 16))
    q = K[:6] + [99] * 6  # diverges at 6: page floor 4
    m = cache.match_prefix(q)
    cache.sanity_check()
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen, m.state_slot) == (0, 4, 4, None)
    m = cache.match_prefix(K[:8] + [99] * 4)
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen) == (0, 8, 8)
    put(cache, kv, pool, K[:4], prefix=torch.arange(4, 8))  # a state at 4 (slot 2)
    m = cache.match_prefix(K[:8] + [99] * 4)
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen, m.state_slot) == (4, 8, 8, 2)
    m = cache.match_prefix(K)
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen, m.state_slot) == (12, 12, None, 1)
    m = cache.match_prefix(K[:4] + [99] * 8)  # leaves the tree exactly at the state at 4
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen) == (4, 4, None)
    m = cache.match_prefix(K + [13, 14, 15, 16])  # runs past the leaf
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen) == (12, 12, None)
    cache.sanity_check()


def test_kv_only_cache_never_reports_a_branch_point() -> None:
    kv = TokenAllocator(8)
    cache = RadixCache(kv_allocator=kv)
    cache.insert([1, 2, 3, 4], kv.alloc(4))
    m = cache.match_prefix([1, 2, 9])
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen, m.state_slot) == (2, 2, None, None)


def test_copy_on_write_leaves_the_trees_state_bit_exact() -> None:
    cache, kv, pool = make()
    slot = int(pool.alloc(1)[0])
    g = torch.Generator().manual_seed(0)
    for layer in range(pool.num_layers):
        pool.set_state(slot, layer, torch.randn(2, generator=g), torch.randn(2, 2, generator=g))
    cache.insert(K[:4], kv.alloc(4), state_slot=slot)
    cache.sanity_check()
    tree_conv = pool.conv[:, slot].clone()
    tree_ssm = pool.ssm[:, slot].clone()
    m = cache.match_prefix(K[:4] + [50])
    assert m.state_slot == slot
    mine = int(pool.alloc(1)[0])
    pool.copy(m.state_slot, mine)
    assert torch.equal(pool.conv[:, mine], tree_conv) and torch.equal(pool.ssm[:, mine], tree_ssm)
    pool.conv[:, mine] += 1.0  # the request advances its own copy
    pool.ssm[:, mine].mul_(3.0)
    assert torch.equal(pool.conv[:, slot], tree_conv)
    assert torch.equal(pool.ssm[:, slot], tree_ssm)
    cache.sanity_check()


def test_a_hit_refreshes_only_the_consumed_state() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:8])  # state 1 at 8
    put(cache, kv, pool, K[:4], prefix=t64(1, 2, 3, 4))  # state 2 at 4
    upper = cache.match_prefix(K[:4]).last_device_node
    leaf = cache.match_prefix(K[:8]).last_device_node
    assert (upper.state_slot, leaf.state_slot) == (2, 1)
    up_state_t, up_kv_t = upper.state_access_time, upper.last_access_time
    leaf_t = leaf.state_access_time
    m = cache.match_prefix(K[:8] + [77])
    assert m.state_slot == 1
    assert leaf.state_access_time > leaf_t
    assert upper.state_access_time == up_state_t  # the ancestor's state is not refreshed
    assert upper.last_access_time > up_kv_t  # its KV is
    # So the LRU state walk takes the ancestor's state first (a tombstone: KV stays).
    assert cache.evict_states(1) == EvictResult(0, 1)
    assert state_tail(pool, 1) == [2]
    cache.sanity_check()


# ====================================================================== state eviction
def test_evict_states_on_an_internal_node_leaves_a_tombstone() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:4])  # state 1 at 4 (oldest)
    put(cache, kv, pool, K[:8], prefix=t64(1, 2, 3, 4))  # state 2 at 8
    assert pool.available_size() == 2
    assert cache.evict_states(1) == EvictResult(0, 1)
    cache.sanity_check()
    assert state_tail(pool, 1) == [1] and pool.available_size() == 3
    assert cache.total_size() == 8 and cache.state_evictable_size() == 1
    m = cache.match_prefix(K[:8])
    assert (m.prefix_len, m.state_slot) == (8, 2)
    m = cache.match_prefix(K[:4] + [40])
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen) == (0, 4, 4)
    st = cache.stats()
    assert (st["evicted_states"], st["evicted_tokens"]) == (1, 0)


def test_evict_states_on_a_leaf_removes_it_and_stateless_childless_ancestors() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:8])  # slots 1..8, state 1
    put(cache, kv, pool, K[:4] + [20, 21], prefix=t64(1, 2, 3, 4))  # slots 9, 10, state 2
    # [1..4] (no state) -> {[5..8] state 1, [20, 21] state 2}
    assert cache.stats()["num_nodes"] == 3
    assert cache.evict_states(1) == EvictResult(4, 1)  # leaf [5..8]; its parent has a child
    assert state_tail(pool, 1) == [1] and kv.snapshot().free_ids()[-4:] == [5, 6, 7, 8]
    cache.sanity_check()
    assert cache.evict_states(1) == EvictResult(6, 1)  # [20, 21] and the bare [1..4]
    assert kv.snapshot().free_ids()[-6:] == [9, 10, 1, 2, 3, 4]
    assert cache.total_size() == 0 and cache.stats()["num_nodes"] == 0
    assert kv.available_size() == 32 and pool.available_size() == 4
    assert cache.evict_states(5) == EvictResult(0, 0)
    cache.sanity_check()


def test_kv_eviction_of_a_leaf_frees_its_state_and_cascades() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:8])
    put(cache, kv, pool, K[:4] + [20, 21], prefix=t64(1, 2, 3, 4))
    assert cache.evict(1) == EvictResult(4, 1)  # LRU leaf [5..8] with state 1
    assert state_tail(pool, 1) == [1]
    cache.sanity_check()
    assert cache.evict(1) == EvictResult(6, 1)  # [20, 21] + its stateless parent at once
    assert state_tail(pool, 1) == [2]
    assert cache.total_size() == 0 and pool.available_size() == 4
    cache.sanity_check()


def test_locked_state_is_protected_from_both_walks() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:4])  # state 1
    put(cache, kv, pool, [50, 51])  # state 2
    node = cache.match_prefix(K[:4]).last_device_node
    cache.inc_lock_ref(node)
    cache.sanity_check()
    assert (cache.state_evictable_size(), cache.state_protected_size()) == (1, 1)
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    assert cache.evict_states(5) == EvictResult(2, 1)
    assert cache.evict(5) == EvictResult(0, 0)
    assert state_tail(pool, 1) == [2]
    # An ancestor of the locked node was never locked itself: refused, nothing changes.
    m = cache.match_prefix(K[:2])  # splits [1, 2] | [3, 4]; no state at 2: the root
    assert m.last_device_node is cache.root and m.kv_hit_length == 2
    upper = node.parent
    assert upper.depth == 2 and upper.kv_lock == 1
    before = (cache.pretty_print(), kv.snapshot(), pool.snapshot())
    with pytest.raises(ValueError, match="lock"):
        cache.dec_lock_ref(upper)
    assert (cache.pretty_print(), kv.snapshot(), pool.snapshot()) == before
    cache.sanity_check()
    cache.dec_lock_ref(node)
    assert (cache.state_evictable_size(), cache.state_protected_size()) == (1, 0)
    assert cache.evict_states(1) == EvictResult(4, 1)
    cache.sanity_check()


def test_joint_lru_ages_a_passed_state_with_its_node() -> None:
    def build(policy: str):
        cache, kv, pool = make(policy=policy)
        put(cache, kv, pool, K[:4])  # state 1 at 4
        put(cache, kv, pool, [50, 51])  # state 2, other branch
        put(cache, kv, pool, K[:8], prefix=t64(1, 2, 3, 4))  # state 3 at 8 below state 1
        cache.match_prefix([50, 51])
        m = cache.match_prefix(K[:8])  # passes state 1's node, consumes state 3
        assert m.state_slot == 3
        assert cache.evict_states(1).num_states == 1
        cache.sanity_check()
        return state_tail(pool, 1)

    assert build("lru") == [1]  # state 1's own stamp is the oldest
    assert build("joint_lru") == [2]  # node [1..4] was just passed: [50, 51] is the oldest


# ====================================================================== refusals
def test_insert_new_tokens_without_a_state_is_refused_and_changes_nothing() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:8])
    value = kv.alloc(10)
    before = (cache.pretty_print(), kv.snapshot(), pool.snapshot(), cache.stats())
    for key in (K[:10], K[:4] + [60] * 6):  # would extend the leaf / would split it at 4
        with pytest.raises(ValueError, match="state_slot"):
            cache.insert(key, value)
        assert (cache.pretty_print(), kv.snapshot(), pool.snapshot(), cache.stats()) == before
    cache.sanity_check()
    # A fully cached key needs no state: it is only a refresh.
    res = cache.insert(K[:6], value[:6])
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (6, 6, False)
    assert ids(res.duplicate_indices) == ids(value[:6])
    cache.sanity_check()


def test_a_state_on_a_node_that_already_has_one_is_not_adopted() -> None:
    cache, kv, pool = make()
    put(cache, kv, pool, K[:4])  # state 1
    slot = int(pool.alloc(1)[0])
    res = cache.insert(K[:4], t64(1, 2, 3, 4), state_slot=slot)
    assert res.state_adopted is False and res.last_node.state_slot == 1
    assert pool.available_size() == 2  # the caller still owns `slot`
    pool.free(t64(slot))
    cache.sanity_check()


# ====================================================================== request helpers
def test_chunked_prefill_then_finish_moves_the_lock_and_frees_exactly() -> None:
    cache, kv, pool = make(size=16, states=4)
    key = K[:6]
    m = cache.match_prefix(key)
    assert m.prefix_len == 0
    req = CacheRequest(key=key, kv_indices=kv.alloc(4), cached_len=0, last_node=cache.root)
    assert ids(req.kv_indices) == [1, 2, 3, 4]
    s1 = int(pool.alloc(1)[0])
    res = cache.cache_unfinished_req(req, state_slot=s1)  # chunk 1: 4 tokens
    cache.sanity_check()
    n1 = res.last_node
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (0, 4, True)
    assert (req.cached_len, req.last_node, ids(req.kv_indices)) == (4, n1, [1, 2, 3, 4])
    assert (n1.kv_lock, n1.state_lock, n1.state_slot) == (1, 1, s1)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)
    assert (kv.available_size(), pool.available_size()) == (12, 3)

    req.kv_indices = torch.cat([req.kv_indices, kv.alloc(2)])  # chunk 2: tokens 5, 6 -> 5, 6
    s2 = int(pool.alloc(1)[0])
    res = cache.cache_finished_req(req, state_slot=s2)
    cache.sanity_check()
    n2 = res.last_node
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (4, 6, True)
    assert ids(res.adopted_indices) == [5, 6] and ids(res.duplicate_indices) == []
    assert (n1.kv_lock, n1.state_lock, n2.kv_lock, n2.state_lock) == (0, 0, 0, 0)
    assert req.last_node is cache.root and req.cached_len == 0 and len(req.kv_indices) == 0
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    assert (kv.available_size(), pool.available_size()) == (10, 2)

    # A racing request computed all 8 tokens itself: duplicates and the tail go back, state kept.
    r2 = CacheRequest(key=K[:8], kv_indices=kv.alloc(8), cached_len=0, last_node=cache.root)
    assert ids(r2.kv_indices) == [7, 8, 9, 10, 11, 12, 13, 14]
    s3 = int(pool.alloc(1)[0])
    res = cache.cache_finished_req(r2, state_slot=s3, upto=7)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (6, 7, True)
    assert ids(res.duplicate_indices) == [7, 8, 9, 10, 11, 12]
    assert ids(res.adopted_indices) == [13]
    assert kv.snapshot().free_ids()[-7:] == [7, 8, 9, 10, 11, 12, 14]  # dups, then the tail
    assert (kv.available_size(), pool.available_size()) == (16 - 7, 1)

    # The same 6 tokens again with a state: the node has one, so the state is freed for it.
    r3 = CacheRequest(key=K[:6], kv_indices=kv.alloc(6), cached_len=0, last_node=cache.root)
    s4 = int(pool.alloc(1)[0])
    res = cache.cache_finished_req(r3, state_slot=s4)
    cache.sanity_check()
    assert res.state_adopted is False and state_tail(pool, 1) == [s4]
    assert (kv.available_size(), pool.available_size()) == (9, 1)
    assert cache.total_size() == 7 and cache.state_evictable_size() == 3


def test_unfinished_req_rewrites_duplicates_to_the_trees_slots() -> None:
    cache, kv, pool = make(size=16)
    put(cache, kv, pool, K[:4])  # slots 1..4, state 1
    req = CacheRequest(key=K[:6], kv_indices=kv.alloc(6), cached_len=0, last_node=cache.root)
    assert ids(req.kv_indices) == [5, 6, 7, 8, 9, 10]
    s = int(pool.alloc(1)[0])
    res = cache.cache_unfinished_req(req, state_slot=s)
    cache.sanity_check()
    assert ids(res.duplicate_indices) == [5, 6, 7, 8]
    assert ids(req.kv_indices) == [1, 2, 3, 4, 9, 10]
    assert req.cached_len == 6 and req.last_node is res.last_node
    assert (res.last_node.kv_lock, res.last_node.state_lock) == (1, 1)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    assert kv.available_size() == 16 - 6
    # Releasing: nothing new to insert, no state given; the lock goes, nothing leaks.
    res = cache.cache_finished_req(req)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (6, 6)
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    assert (kv.available_size(), pool.available_size()) == (10, 2)
