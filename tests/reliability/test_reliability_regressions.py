"""Regression tests for ten public bug reports against radix prefix caches (SGLang and its
relatives), each retold for this library with exact expected outcomes. Every test ends with the
idle leak check: no lock held, every pool ``available + evictable == capacity``, and after
evicting everything every pool is whole again.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from allocators import KVPool, MambaStatePool, PagedAllocator, SWAAllocator, TokenAllocator
from components.eviction.registry import POLICY_REGISTRY
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, RadixCache, RadixKey
from tests.helpers.cache_helpers import node_slots, tiny_state_pool

KNOBS: dict[str, dict[str, Any]] = {"gds": {"d": 1.0, "e": 0.0},
                                    "tlru": {"threshold": 4, "next_prompt_estimate": 1}}


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def hybrid(page_size: int = 1, size: int = 32, policy: str | None = None, n_states: int = 8,
           window: int | None = None, hicache: HiCacheConfig | None = None) -> RadixCache:
    """A cache with real pools: KV (full + SWA when ``window``) and recurrent states."""
    if window is not None:
        kv: Any = SWAAllocator(size, size // 2, page_size,
                               full_pool=KVPool(size, 1, 1, 1, torch.float64, page_size=page_size),
                               swa_pool=KVPool(size // 2, 1, 1, 1, torch.float64, page_size=page_size))
    else:
        pool = KVPool(size, 1, 1, 1, torch.float64, page_size=page_size)
        kv = TokenAllocator(size, pool=pool) if page_size == 1 else PagedAllocator(size, page_size, pool=pool)
    cfg = CacheConfig(page_size=page_size, radix_eviction_policy=policy,
                      radix_eviction_policy_config=KNOBS.get(policy or ""), sliding_window_size=window)
    cache = RadixCache(cfg, kv_allocator=kv, state_allocator=tiny_state_pool(n_states), hicache=hicache)
    cache.sanity_check()
    return cache


def kv_of(cache: RadixCache) -> Any:
    return cache.kv.allocator


def sp_of(cache: RadixCache) -> MambaStatePool:
    assert cache.state is not None
    return cache.state.allocator


def new_state(cache: RadixCache) -> int:
    got = sp_of(cache).alloc(1)
    assert got is not None
    return int(got[0])


def put(cache: RadixCache, key: list[int], extra_key: Any = None) -> Any:
    """Insert ``key`` the way a one-shot caller does (matched prefix + fresh slots + a state),
    free what the result leaves to the caller, return the tree's node at the end."""
    ps = cache.page_size
    key = key[: len(key) // ps * ps]  # the state is valid at a page end (insert refuses others)
    m = cache.match_prefix(key, extra_key)
    need = len(key) - m.prefix_len
    fresh = kv_of(cache).alloc(-(-need // ps) * ps)
    assert fresh is not None
    value = torch.cat([m.device_indices, fresh[:need]])
    s = new_state(cache)
    res = cache.insert(key, value, extra_key, state_slot=s)
    for part in (res.duplicate_indices, torch.cat([res.remainder_indices, fresh[need:]])):
        if len(part):
            kv_of(cache).free(part)
    if not res.state_adopted:
        sp_of(cache).free(t64(s))
    cache.sanity_check()
    return res.last_node


def assert_idle_without_leaks(cache: RadixCache, held_host_kv: int = 0) -> None:
    """Idle (no lock held): every pool ``available + evictable == capacity``; then evicting
    everything leaves every pool whole and the tree empty."""
    cache.poll_transfers()
    cache.sanity_check()
    kv, sp = kv_of(cache), sp_of(cache)
    swa = cache.swa is not None
    assert cache.protected_size() == 0 and cache.state_protected_size() == 0
    full_avail = kv.full_available_size() if swa else kv.available_size()
    assert full_avail + cache.evictable_size() == kv.size, "device KV leaked"
    assert sp.available_size() + cache.state_evictable_size() == sp.size, "state slots leaked"
    if swa:
        assert cache.swa_protected_size() == 0
        assert kv.swa_available_size() + cache.swa_evictable_size() == kv.swa_size, "SWA KV leaked"
    hc = cache.hicache
    if hc is not None:
        assert hc.host_kv.available_size() + cache.host_size() + held_host_kv == hc.host_kv.size
        host_states = sum(n.host_state_slot is not None for n in cache.tree.iter_nodes())
        assert hc.host_state.available_size() + host_states == hc.host_state.size  # type: ignore[union-attr]
    cache.evict(10**9)
    if hc is not None:
        cache.evict_host(10**9)
    cache.sanity_check()
    assert cache.tree.num_nodes == 0, cache.pretty_print()
    assert (kv.full_available_size() if swa else kv.available_size()) == kv.size
    assert sp.available_size() == sp.size
    if swa:
        assert kv.swa_available_size() == kv.swa_size
    if hc is not None:
        assert hc.host_kv.available_size() + held_host_kv == hc.host_kv.size
        assert hc.host_state.available_size() == hc.host_state.size  # type: ignore[union-attr]


def label_kv(cache: RadixCache, slots: torch.Tensor, value: float) -> None:
    kv = kv_of(cache)
    kv.pool.k_all[0, slots, 0, 0] = value
    if cache.swa is not None:
        kv.swa_pool.k_all[0, kv.translate(slots), 0, 0] = value


def kv_values(cache: RadixCache, slots: torch.Tensor) -> list[float]:
    return kv_of(cache).pool.k_all[0, slots, 0, 0].tolist()


# ============================================================================ 1
@pytest.mark.parametrize("with_state", [False, True])
def test_1_a_key_shorter_than_a_page_matches_nothing_and_counters_return_to_zero(with_state: bool) -> None:
    """Page size 4: a 3-token key and an empty key match 0 tokens at the root, split nothing,
    cache nothing; the evictable counter is exactly 0 again after lock / unlock / evict."""
    kv = PagedAllocator(32, 4)
    cache = RadixCache(CacheConfig(page_size=4), kv_allocator=kv,
                       state_allocator=tiny_state_pool(8) if with_state else None)
    slot = new_state(cache) if with_state else None
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], kv.alloc(8), state_slot=slot)
    tree = cache.pretty_print()
    assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
    for key in ([1, 2, 3], []):
        m = cache.match_prefix(key)
        assert (m.prefix_len, m.kv_hit_length, len(m.device_indices)) == (0, 0, 0)
        assert m.last_device_node is cache.root and m.branching_seqlen is None
        assert cache.pretty_print() == tree  # nothing split
        assert cache.inc_lock_ref(m.last_device_node) is cache.root  # the root is its own (no-op) lock
        assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
        cache.dec_lock_ref(m.last_device_node)
        assert (cache.evictable_size(), cache.protected_size()) == (8, 0)
    short = kv.alloc(4)
    res = cache.insert([9, 9, 9], short[:3], state_slot=None)
    assert (res.prefix_len, res.inserted_len, res.remainder_indices.tolist()) == (0, 0, short[:3].tolist())
    assert res.last_node is cache.root and not res.state_adopted and cache.pretty_print() == tree
    kv.free(short)
    assert cache.evict(1).num_tokens == 8
    assert (cache.evictable_size(), cache.protected_size(), cache.tree.num_nodes) == (0, 0, 0)
    assert kv.available_size() == kv.size
    if with_state:
        assert_idle_without_leaks(cache)


# ============================================================================ 2
@pytest.mark.parametrize("with_state", [False, True])
def test_2_split_under_a_lock_keeps_evictable_plus_protected_exact(with_state: bool) -> None:
    """A=[1..6] locked; B=[1,2,3,7,8] splits A under the lock; B' locked; A' unlocked first,
    then B'. After every step: evictable + protected == tokens in the tree, neither negative,
    with these exact values."""
    kv = TokenAllocator(16)
    cache = RadixCache(kv_allocator=kv, state_allocator=tiny_state_pool(8) if with_state else None)

    def st() -> int | None:
        return new_state(cache) if with_state else None

    def sizes(evictable: int, protected: int) -> None:
        cache.sanity_check()
        held = sum(len(n.key) for n in cache.tree.iter_nodes())
        assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)
        assert evictable >= 0 and protected >= 0 and evictable + protected == held

    a = cache.insert([1, 2, 3, 4, 5, 6], kv.alloc(6), state_slot=st()).last_node
    sizes(6, 0)
    cache.inc_lock_ref(a)
    sizes(0, 6)
    a_slots = node_slots(a).clone()  # the caller reuses A's first three slots (its match)
    b = cache.insert([1, 2, 3, 7, 8], torch.cat([a_slots[:3], kv.alloc(2)]), state_slot=st()).last_node
    assert a.parent is b.parent and a.parent is not cache.root and len(a.parent.key) == 3
    sizes(2, 6)  # [1,2,3] and [4,5,6] under A's lock, [7,8] free
    cache.inc_lock_ref(b)
    sizes(0, 8)
    cache.dec_lock_ref(a)
    sizes(3, 5)  # [4,5,6] released; [1,2,3] still held through B'
    cache.dec_lock_ref(b)
    sizes(8, 0)
    assert cache.evict(100).num_tokens == 8
    sizes(0, 0)
    assert kv.available_size() == kv.size
    if with_state:
        assert_idle_without_leaks(cache)


# ============================================================================ 3
@pytest.mark.parametrize("kind", ["kv+state", "swa+state", "hicache+state"])
def test_3_a_request_whose_prefix_was_cached_meanwhile_points_at_the_trees_slots(kind: str) -> None:
    """R1 and R2 compute the same 8 tokens with their own slots; R2 finishes first; R1's
    cache_unfinished_req then finds the prefix cached: R1's 8 duplicates are freed exactly
    once, R1's kv_indices become the tree's slots, none of them free; R1 goes on and finishes."""
    cache = {"kv+state": lambda: hybrid(size=32),
             "swa+state": lambda: hybrid(size=32, window=4),
             "hicache+state": lambda: hybrid(size=32, hicache=HiCacheConfig(load_back_threshold=0)),
             }[kind]()
    kv = kv_of(cache)
    key = list(range(1, 9))
    reqs = []
    for _ in range(2):
        m = cache.match_prefix(key)
        assert m.prefix_len == 0
        slots = kv.alloc(8)
        label_kv(cache, slots, 42.0)
        reqs.append(CacheRequest(key=key + [9, 10], kv_indices=slots, cached_len=0,
                                 last_node=cache.root, lock=None))
    r1, r2 = reqs
    r1_own = r1.kv_indices.clone()
    cache.cache_finished_req(r2, state_slot=new_state(cache))
    tree_slots = cache.match_prefix(key).device_indices.clone()
    assert tree_slots.tolist() != r1_own.tolist()
    avail = kv.full_available_size() if cache.swa is not None else kv.available_size()
    res = cache.cache_unfinished_req(r1, state_slot=new_state(cache))
    after = kv.full_available_size() if cache.swa is not None else kv.available_size()
    assert res.prefix_len == 8 and after - avail == 8  # R1's own 8 slots freed, once
    assert r1.kv_indices.tolist() == tree_slots.tolist() and r1.cached_len == 8
    assert not bool(kv.is_free(r1.kv_indices).any())
    assert bool(kv.is_free(r1_own).all())  # every duplicate is free, none referenced by R1
    assert r1.last_node.depth == 8 and r1.last_node.lock_ref == 1
    cache.sanity_check()
    more = kv.alloc(2)
    r1.kv_indices = torch.cat([r1.kv_indices, more])
    res = cache.cache_finished_req(r1, state_slot=new_state(cache))
    assert (res.prefix_len, res.inserted_len) == (8, 10)
    assert kv_values(cache, cache.match_prefix(key).device_indices) == [42.0] * 8
    assert_idle_without_leaks(cache)


# ============================================================================ 4
def test_4_host_eviction_of_two_tokens_frees_exactly_one_two_token_leaf() -> None:
    cache = hybrid(size=16, hicache=HiCacheConfig(hicache_write_policy="write_through"))
    for i, ns in enumerate(("a", "b", "c")):
        put(cache, [10 + i, 20 + i], ns)
    assert cache.evict(6).num_tokens == 6  # all three demoted: host-only leaves of 2 tokens
    assert cache.host_size() == 6 and cache.host_evictable_size() == 6
    before = {n.extra_key for n in cache.tree.iter_nodes()}
    assert cache.evict_host(2) == 2
    after = {n.extra_key for n in cache.tree.iter_nodes()}
    assert before - after == {"a"} and after == {"b", "c"}  # the least recent one, only
    assert cache.host_size() == 4 and cache.stats()["host_evicted_tokens"] == 2
    assert_idle_without_leaks(cache)


# ============================================================================ 5
def test_5_no_child_backup_after_its_parents_backup_failed_for_lack_of_host_space() -> None:
    """write_through; another user holds all but 2 host slots. P (4 tokens) cannot be backed
    up; its child C (2 tokens) would fit but is not backed up before its parent. Device
    eviction then removes both without error."""
    cache = hybrid(size=16, hicache=HiCacheConfig(hicache_ratio=1.5, hicache_write_policy="write_through"))
    hc = cache.hicache
    assert hc is not None and hc.host_kv.size == 24
    other = hc.host_kv.alloc(22)
    assert other is not None
    p = put(cache, [1, 2, 3, 4])
    assert p.host_value is None and hc.host_kv.available_size() == 2
    c = put(cache, [1, 2, 3, 4, 5, 6])
    assert c.parent is p and c.host_value is None and p.host_value is None
    assert hc.host_kv.available_size() == 2 and cache.host_size() == 0
    res = cache.evict(6)
    assert (res.num_tokens, res.num_states) == (6, 2) and cache.tree.num_nodes == 0
    assert_idle_without_leaks(cache, held_host_kv=22)
    hc.host_kv.free(other)
    assert hc.host_kv.available_size() == hc.host_kv.size


# ============================================================================ 6
def test_6_unaligned_keys_on_a_paged_state_tree_never_split_at_zero() -> None:
    cache = hybrid(page_size=4, size=64)
    root = cache.root
    leaf = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    for key in ([1, 2, 3], [1, 2, 3, 5, 6], [1, 2, 3, 5, 6, 7, 8, 9]):  # nothing matches a page
        m = cache.match_prefix(key)
        assert (m.prefix_len, m.kv_hit_length, m.last_device_node) == (0, 0, root)
        assert cache.tree.num_nodes == 1 and list(root.children.values()) == [leaf]
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])  # ends inside the leaf: split at 4, not 7
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen) == (0, 4, 4)
    assert cache.tree.num_nodes == 2 and leaf.parent.depth == 4 and leaf.parent.parent is root
    assert (leaf.key.tolist(), leaf.parent.key.tolist()) == ([5, 6, 7, 8], [1, 2, 3, 4])
    top = put(cache, [1, 2, 3, 4, 9, 9, 9, 9, 7])  # 9 tokens: 8 cached, diverges at a page
    assert top.depth == 8 and len(top.key) == 4 and top.parent.depth == 4
    other = put(cache, [1, 2, 3, 5, 1, 1, 1, 1])  # diverges inside the first page: a new root child
    assert other.parent is root and len(root.children) == 2
    for child_key, child in root.children.items():
        assert child_key == (None, child.key[:4].tobytes())
    mid = top.parent
    assert sorted(k for k in mid.children) == sorted(c.key[:4].tobytes() for c in mid.children.values())
    assert cache.match_prefix([1, 2, 3, 5, 1, 1, 1, 1, 2]).prefix_len == 8
    assert cache.match_prefix([1, 2, 3, 4, 9, 9, 9, 9]).prefix_len == 8
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1]).prefix_len == 8
    assert_idle_without_leaks(cache)


# ============================================================================ 7
def test_7_identical_prompts_and_branch_point_checkpoints() -> None:
    cache = hybrid(size=64)
    sp = sp_of(cache)
    key = list(range(1, 9))
    r1 = put(cache, key)
    s8 = r1.state_slot
    sp.conv[0, s8, 0] = 8.0
    m = cache.match_prefix(key[:7])  # R2: the same prompt minus its last token
    assert (m.prefix_len, m.kv_hit_length, m.branching_seqlen, m.state_slot) == (0, 7, 7, None)
    assert r1.state_slot == s8 and r1.depth == 8 and float(sp.conv[0, s8, 0]) == 8.0
    assert r1.parent.depth == 7 and r1.parent.state_slot is None
    m = cache.match_prefix(key)
    assert (m.prefix_len, m.state_slot) == (8, s8)
    # Two different prompts sharing 6 tokens; the second checkpoints its state at the fork.
    shared = [40, 41, 42, 43, 44, 45]
    put(cache, shared + [50, 51])
    m = cache.match_prefix(shared + [60, 61])
    assert (m.prefix_len, m.branching_seqlen) == (0, 6)
    kv = kv_of(cache)
    req = CacheRequest(key=shared + [60, 61], kv_indices=kv.alloc(8), cached_len=0, last_node=cache.root)
    ck = new_state(cache)
    sp.conv[0, ck, 0] = 6.0
    cache.cache_unfinished_req(req, state_slot=ck, upto=m.branching_seqlen)
    cache.cache_finished_req(req, state_slot=new_state(cache))
    m = cache.match_prefix(shared + [70])  # a third request
    assert m.prefix_len == 6 and float(sp.conv[0, m.state_slot, 0]) == 6.0
    assert_idle_without_leaks(cache)


# ============================================================================ 8
def _weak_nodes(cache: RadixCache) -> list[weakref.ref]:
    return [weakref.ref(n) for n in cache.tree.iter_nodes()]


def _alive(refs: list[weakref.ref]) -> int:
    return sum(r() is not None for r in refs)


@contextmanager
def gc_disabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _populate(cache: RadixCache) -> None:
    for i, key in enumerate(([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 7, 7], [9, 9, 9], [1, 2, 3, 4, 5, 8])):
        put(cache, key, "ns" if i % 2 else None)
    cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.match_prefix([9, 9, 9])


@pytest.mark.parametrize("policy", sorted(POLICY_REGISTRY))
def test_8_evicted_nodes_are_freed_at_once_without_the_garbage_collector(policy: str) -> None:
    """With the cycle collector off, every node that leaves the tree (KV eviction, state
    eviction of a leaf, reset) is freed at once: no ordered structure keeps it alive."""
    cache = hybrid(size=64, policy=policy)
    with gc_disabled():
        _populate(cache)
        refs = _weak_nodes(cache)
        assert _alive(refs) == len(refs) >= 6
        cache.evict_states(2)  # leaves leave whole, internal nodes lose only their state
        gone = len(refs) - cache.tree.num_nodes
        assert _alive(refs) == cache.tree.num_nodes, f"{gone} removed but not all freed"
        cache.evict(3)
        assert _alive(refs) == cache.tree.num_nodes
        _populate(cache)
        refs += _weak_nodes(cache)
        cache.reset()
        assert _alive(refs) == 0
    assert_idle_without_leaks(cache)


@pytest.mark.parametrize("kind", ["swa", "hicache"])
def test_8_nodes_leaving_swa_and_host_orders_are_freed_at_once(kind: str) -> None:
    cache = (hybrid(size=64, window=2) if kind == "swa"
             else hybrid(size=64, hicache=HiCacheConfig(load_back_threshold=0)))
    with gc_disabled():
        _populate(cache)
        refs = _weak_nodes(cache)
        if kind == "swa":
            cache.evict_swa(100)  # internal nodes tombstoned, leaves removed whole
        else:
            cache.evict(100)  # demoted: host-only, still in the tree
            assert _alive(refs) == cache.tree.num_nodes > 0
            cache.evict_host(100)
        assert _alive(refs) == cache.tree.num_nodes
        cache.evict(100)
        assert _alive(refs) == cache.tree.num_nodes
        cache.reset()
        assert _alive(refs) == 0
    assert_idle_without_leaks(cache)


# ============================================================================ 9
def test_9_freeing_a_tombstones_old_slots_never_frees_a_reused_swa_slot() -> None:
    """A tombstone's SWA slots are reused by a running request; the tombstone's old full slots
    are then freed twice over (its revival by another caller, then eviction): the request's SWA
    slots stay mapped and keep their data."""
    cache = hybrid(size=32, window=2)
    kv = kv_of(cache)
    assert kv.swa_size == 16
    a = put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5, 6])
    cache.match_prefix([1, 2, 3, 4, 5, 6])  # the leaf is newer than A: A is the SWA victim
    a_slots = node_slots(a).clone()
    a_swa = kv.translate(a_slots).tolist()
    assert cache.evict_swa(1).num_swa_tokens == 4 and a.swa_tombstone
    # fill the SWA pool so that the next allocation must reuse A's freed SWA slots
    filler = kv.alloc(kv.swa_available_size() - 4)
    mine = kv.alloc(4)  # a running request's own slots
    assert sorted(kv.translate(mine).tolist()) == sorted(a_swa)
    label_kv(cache, mine, 99.0)
    mapped = kv.translate(mine).tolist()
    # revival: another caller inserts [1,2,3,4] with its own live slots; A's old slots are freed
    kv.free(filler)
    theirs = kv.alloc(4)
    s = new_state(cache)
    res = cache.insert([1, 2, 3, 4], theirs, state_slot=s)
    assert res.revived_indices.tolist() == theirs.tolist() and not a.swa_tombstone
    assert not res.state_adopted  # A keeps its own state
    sp_of(cache).free(t64(s))
    assert bool(kv.is_free(a_slots).all())
    assert kv.translate(mine).tolist() == mapped
    assert kv.swa_pool.k_all[0, kv.translate(mine), 0, 0].tolist() == [99.0] * 4
    # tombstone again and evict it whole: still nothing of the request's freed
    cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.evict_swa(1)
    cache.evict(100)
    assert cache.tree.num_nodes == 0
    assert kv.translate(mine).tolist() == mapped
    assert kv.swa_pool.k_all[0, kv.translate(mine), 0, 0].tolist() == [99.0] * 4
    kv.free(mine)
    cache.sanity_check()
    assert_idle_without_leaks(cache)


# ============================================================================ 10
NAMESPACES = [None, "", "X", ("lora", "X"), ("salt", "X")]


@pytest.mark.parametrize("kind", ["kv+state", "hicache+state"])
def test_10_typed_namespaces_never_share(kind: str) -> None:
    """The same tokens under five namespaces: each namespace matches only its own slots, on
    device and after a round trip through the host tier. An adapter id "X" and a cache salt
    "X" are told apart by typing them: ("lora", "X") vs ("salt", "X"); None and "" differ."""
    # write_back: the host copies are made when evicted, after the labels below are written
    hi = (HiCacheConfig(load_back_threshold=0, hicache_write_policy="write_back")
          if kind == "hicache+state" else None)
    cache = hybrid(size=64, hicache=hi, n_states=8)
    key = [5, 6, 7, 8, 9, 10]
    for i, ns in enumerate(NAMESPACES):
        put(cache, key, ns)
        label_kv(cache, cache.match_prefix(key, ns).device_indices, float(i))
    seen = set()
    for i, ns in enumerate(NAMESPACES):
        m = cache.match_prefix(key, ns)
        assert m.prefix_len == 6 and kv_values(cache, m.device_indices) == [float(i)] * 6
        seen.add(tuple(m.device_indices.tolist()))
    assert len(seen) == len(NAMESPACES)
    assert cache.match_prefix(key, ("lora", "Y")).kv_hit_length == 0
    assert cache.match_prefix(key, "x").kv_hit_length == 0
    if hi is not None:
        cache.evict(100)
        for i, ns in enumerate(NAMESPACES):
            m = cache.match_prefix(key, ns)
            assert m.host_hit_length == 6
            assert cache.load_back(m.last_host_node) == 6
            m = cache.match_prefix(key, ns)
            assert m.prefix_len == 6 and kv_values(cache, m.device_indices) == [float(i)] * 6
    assert_idle_without_leaks(cache)


def test_10_namespaces_of_equal_value_but_different_type_do_not_share() -> None:
    """1 == True == 1.0 in Python, but they are three namespaces (typed as the L3 key
    encoding types them), and so are None, "" and "1", and (1,) and (True,)."""
    cache = hybrid(size=64, n_states=12)
    put(cache, [5, 6, 7, 8], 1)
    for other in (True, 1.0, "1", None, "", (1,)):
        assert cache.match_prefix([5, 6, 7, 8], other).kv_hit_length == 0, other
    assert cache.match_prefix([5, 6, 7, 8], 1).prefix_len == 4
    for ns in (True, 1.0, (1,), (True,), 0, False, 0.0, -0.0):
        put(cache, [5, 6, 7, 8], ns)
    seen = {tuple(cache.match_prefix([5, 6, 7, 8], ns).device_indices.tolist())
            for ns in (1, True, 1.0, (1,), (True,), 0, False, 0.0, -0.0)}
    assert len(seen) == 9
    with pytest.raises(ValueError, match="extra_key"):
        cache.match_prefix(RadixKey([5, 6, 7, 8], 1), True)
    cache.sanity_check()
    assert_idle_without_leaks(cache)


def test_10_typed_namespaces_never_share_through_a_shared_l3(tmp_path: Any) -> None:
    """Engine A writes the same tokens under five namespaces to a file L3; engine B (empty,
    same store) reads each namespace back: every namespace gets its own pages, never another's."""

    def engine() -> RadixCache:
        return hybrid(size=64, n_states=8, hicache=HiCacheConfig(
            load_back_threshold=0, hicache_storage_backend="file",
            hicache_storage_dir=str(tmp_path), hicache_storage_prefetch_policy="wait_complete"))

    key = [5, 6, 7, 8, 9, 10]
    a = engine()
    kv = kv_of(a)
    for i, ns in enumerate(NAMESPACES):
        slots = kv.alloc(6)
        label_kv(a, slots, float(i + 1))  # written before insert: write_through copies at once
        s = new_state(a)
        sp_of(a).conv[0, s, 0] = float(i + 1)
        assert a.insert(key, slots, ns, state_slot=s).state_adopted
    assert a.flush_storage(30.0)
    b = engine()
    for i, ns in enumerate(NAMESPACES):
        m = b.match_prefix(key, ns)  # wait_complete: the L3 pages are attached host-only
        assert (m.prefix_len, m.host_hit_length) == (0, 6), ns
        assert b.load_back(m.last_host_node) == 6
        m = b.match_prefix(key, ns)
        assert m.prefix_len == 6 and kv_values(b, m.device_indices) == [float(i + 1)] * 6, ns
        assert float(sp_of(b).conv[0, m.state_slot, 0]) == float(i + 1)
    assert b.match_prefix(key, ("lora", "Y")).kv_hit_length == 0
    for cache in (a, b):
        assert_idle_without_leaks(cache)
        cache.close_storage()


def test_10_l3_seeds_of_equal_value_but_different_type_differ(tmp_path: Any) -> None:
    """The L3 seed cache is keyed by the typed encoding: asking for 1 first must not hand
    True (or 1.0) namespace 1's seed."""
    from hicache.storage.keys import chain_seed

    cache = hybrid(size=64, hicache=HiCacheConfig(hicache_storage_backend="file",
                                                  hicache_storage_dir=str(tmp_path)))
    storage = cache.storage
    assert storage is not None
    seeds = [storage.seed(ns) for ns in (1, True, 1.0, (1,), (True,))]
    assert len(set(seeds)) == 5
    assert seeds == [chain_seed(storage.tag, ns) for ns in (1, True, 1.0, (1,), (True,))]
    cache.close_storage()
