"""Regressions: library bugs found by the reliability suite (once strict xfails), each a
minimal repro, now fixed."""

from __future__ import annotations

import pytest
import torch

from allocators import MambaStatePool, TokenAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, RadixCache
from tests.helpers.cache_helpers import tiny_state_pool


def _put(cache: RadixCache, kv: TokenAllocator, sp: MambaStatePool, key: list[int],
         extra_key: object = None) -> None:
    m = cache.match_prefix(key, extra_key)
    fresh = kv.alloc(len(key) - m.prefix_len)
    assert fresh is not None
    res = cache.insert(key, torch.cat([m.device_indices, fresh]), extra_key,
                       state_slot=int(sp.alloc(1)[0]))
    assert res.state_adopted
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()


def test_write_back_evict_counts_every_device_token() -> None:
    kv, sp = TokenAllocator(20), tiny_state_pool(10)
    cache = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                       hicache=HiCacheConfig(hicache_ratio=1.1, hicache_write_policy="write_back"))
    assert cache.hicache is not None and cache.hicache.host_kv.size == 22
    t_key, s_key = list(range(100, 110)), list(range(200, 210))
    _put(cache, kv, sp, t_key, "T")
    assert cache.evict(1).num_tokens == 10  # T: host-only
    _put(cache, kv, sp, [1, 2, 3, 4, 5, 6])
    _put(cache, kv, sp, [1, 2, 3, 4, 7, 8])  # P = [1,2,3,4] (no state) with two leaves
    assert cache.evict(2).num_tokens == 2 and cache.evict(2).num_tokens == 2  # both demoted
    cache.match_prefix(t_key, "T")  # T is now the most recent host-only leaf
    _put(cache, kv, sp, s_key, "S")
    cache.match_prefix([1, 2, 3, 4])  # P is more recent than S: S is the victim
    assert cache.host_size() == 18 and kv.available_size() == 6
    before, stats_before = kv.available_size(), cache.stats()["evicted_tokens"]
    res = cache.evict(1)
    cache.sanity_check()
    freed = kv.available_size() - before
    assert freed == 14 and cache.stats()["evicted_tokens"] - stats_before == 14
    assert res.num_tokens == freed


def test_a_wrong_cached_len_is_refused_before_it_leaks_slots() -> None:
    kv, sp = TokenAllocator(32), tiny_state_pool(4)
    cache = RadixCache(kv_allocator=kv, state_allocator=sp)
    cache.insert([1, 2, 3], kv.alloc(3), state_slot=int(sp.alloc(1)[0]))
    slot = int(sp.alloc(1)[0])
    for cached_len in (9, -1, 3):  # past kv_indices; negative; past last_node (the root)
        req = CacheRequest(key=[1, 2, 3, 4], kv_indices=kv.alloc(4), cached_len=cached_len,
                           last_node=cache.root)
        kv.undo_alloc(req.kv_indices)
        before = cache.pretty_print(), kv.snapshot(), sp.snapshot()
        for call in (cache.cache_finished_req, cache.cache_unfinished_req):
            with pytest.raises(ValueError, match="cached_len"):
                call(req, state_slot=slot)
            assert (cache.pretty_print(), kv.snapshot(), sp.snapshot()) == before
    with pytest.raises(TypeError, match="cached_len"):
        cache.cache_finished_req(CacheRequest(key=[1, 2, 3, 4], kv_indices=kv.alloc(4),
                                              cached_len=True, last_node=cache.root))
    cache.sanity_check()


def test_a_chunk_ending_before_cached_len_is_refused_a_finish_keeps_the_trees_slots() -> None:
    """A request holding [1..4] from the tree (cached_len 4) may finish with upto 2 (the
    engine keeps less), but its slots [2, 4) are the tree's: only its own [4, 6) are freed.
    A chunk (cache_unfinished_req) ending before cached_len would move its lock above slots it
    keeps: refused."""
    kv, sp = TokenAllocator(32), tiny_state_pool(4)
    cache = RadixCache(kv_allocator=kv, state_allocator=sp)
    cache.insert([1, 2, 3, 4], kv.alloc(4), state_slot=int(sp.alloc(1)[0]))
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_device_node)
    own = kv.alloc(2)
    req = CacheRequest(key=[1, 2, 3, 4, 5, 6], kv_indices=torch.cat([m.device_indices, own]),
                       cached_len=4, last_node=m.last_device_node)
    slot = int(sp.alloc(1)[0])
    before = cache.pretty_print(), kv.snapshot(), sp.snapshot()
    with pytest.raises(ValueError, match="cached_len"):
        cache.cache_unfinished_req(req, state_slot=slot, upto=2)
    assert (cache.pretty_print(), kv.snapshot(), sp.snapshot()) == before
    sp.free(torch.tensor([slot]))
    free_before = kv.available_size()
    res = cache.cache_finished_req(req, upto=2)
    assert (res.prefix_len, res.inserted_len) == (2, 2)
    assert kv.available_size() == free_before + 2 and bool(kv.is_free(own).all())
    assert not bool(kv.is_free(m.device_indices).any())
    cache.sanity_check()


def test_write_back_evict_counts_earlier_copies_landing_during_it() -> None:
    """evict(4) under write_back with the copy held: nothing freed yet (the copy is in flight,
    counted towards the target). The next evict lands it first: those 4 tokens are freed in
    that call and reported there, but do not count towards its own target."""
    kv, sp = TokenAllocator(20), tiny_state_pool(10)
    cache = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                       hicache=HiCacheConfig(hicache_write_policy="write_back"))
    hc = cache.hicache
    assert hc is not None
    for key in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        _put(cache, kv, sp, key)
    hc.hold_completions = True
    free0 = kv.available_size()
    res = cache.evict(4)
    assert (res.num_tokens, res.num_states, hc.num_inflight) == (0, 0, 1)
    assert kv.available_size() == free0
    hc.hold_completions = False
    hc.release_held()
    res = cache.evict(4)
    cache.sanity_check()
    assert (res.num_tokens, res.num_states) == (8, 2) and hc.num_inflight == 0
    assert kv.available_size() == free0 + 8
