"""Library bugs found by the reliability suite, each pinned by a minimal repro as a strict xfail.

When a fix lands the xfail turns into a failure: remove the marker then (and the matching
tolerance in ``reliability_harness.Harness.check_freed``).
"""

from __future__ import annotations

import pytest
import torch

from allocators import MambaStatePool, TokenAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, RadixCache


def _states(n: int) -> MambaStatePool:
    return MambaStatePool(n, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))


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
    kv, sp = TokenAllocator(20), _states(10)
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


@pytest.mark.xfail(strict=True, reason=(
    "BUG: cache_finished_req / cache_unfinished_req do not validate req.cached_len; with a "
    "cached_len past the prefix the request's own duplicates are neither freed nor adopted: "
    "3 KV slots leak for good (no node, no caller holds them)"))
def test_a_wrong_cached_len_is_refused_before_it_leaks_slots() -> None:
    kv, sp = TokenAllocator(32), _states(4)
    cache = RadixCache(kv_allocator=kv, state_allocator=sp)
    cache.insert([1, 2, 3], kv.alloc(3), state_slot=int(sp.alloc(1)[0]))
    req = CacheRequest(key=[1, 2, 3, 4], kv_indices=kv.alloc(4), cached_len=9, last_node=cache.root)
    try:
        cache.cache_finished_req(req, state_slot=int(sp.alloc(1)[0]))
    except ValueError:
        return  # refused: fine
    tree = sum(len(n.kv_value) for n in cache.tree.iter_nodes())
    assert kv.available_size() + tree == kv.size, "KV slots leaked"
