"""Bad input to the host tier: each one a clear error naming the problem, and nothing changed
(``dump``: every node, stamp, counter, order and pool snapshot)."""

from __future__ import annotations

import math

import pytest
import torch

from allocators import KVPool, MambaStatePool, SWAAllocator, TokenAllocator
from hicache import WRITE_POLICIES, HiCacheConfig
from radix import CacheConfig, RadixCache
from tests.hicache.test_hicache_common import assert_same, dump, make, node_at, put


# ======================================================================== HiCacheConfig
@pytest.mark.parametrize("ratio", [1, 1.0, 0.5, 0, -2.0, math.nan, math.inf, -math.inf])
def test_ratio_must_be_a_finite_number_above_one(ratio: float) -> None:
    with pytest.raises(ValueError, match="hicache_ratio must be a finite number > 1"):
        HiCacheConfig(hicache_ratio=ratio)


@pytest.mark.parametrize("ratio", ["2", "2.0", None, True, [2.0], b"2"])
def test_ratio_must_be_a_number(ratio: object) -> None:
    with pytest.raises(TypeError, match="hicache_ratio must be a number"):
        HiCacheConfig(hicache_ratio=ratio)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["write_around", "", "WRITE_BACK", None, "write-through"])
def test_unknown_write_policy_lists_the_known_ones(policy: object) -> None:
    with pytest.raises(ValueError, match="hicache_write_policy=.* is unknown") as e:
        HiCacheConfig(hicache_write_policy=policy)  # type: ignore[arg-type]
    for known in WRITE_POLICIES:
        assert known in str(e.value)


@pytest.mark.parametrize("threshold", [-1, -10, True, 2.5, "10", None])
def test_load_back_threshold_must_be_a_non_negative_int(threshold: object) -> None:
    with pytest.raises(ValueError, match="load_back_threshold must be an int >= 0"):
        HiCacheConfig(load_back_threshold=threshold)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [-1, -0.5, True, float("nan"), float("inf"), "1024", None])
def test_host_size_must_be_a_number_of_gb(size: object) -> None:
    with pytest.raises(ValueError, match="hicache_size must be a finite number >= 0"):
        HiCacheConfig(hicache_size=size)  # type: ignore[arg-type]


def test_defaults_are_sglangs() -> None:
    cfg = HiCacheConfig()
    assert (cfg.hicache_ratio, cfg.hicache_size, cfg.hicache_write_policy,
            cfg.load_back_threshold) == (2.0, 0, "write_through", 10)
    assert cfg.hicache_storage_prefetch_policy == "timeout"
    assert WRITE_POLICIES == ("write_through", "write_through_selective", "write_back")


# ======================================================================== building the cache
def test_hicache_with_a_sliding_window_mirrors_the_swa_pool_too() -> None:
    kv = SWAAllocator(16, 8, 1)
    cache = RadixCache(CacheConfig(sliding_window_size=4), kv_allocator=kv, hicache=HiCacheConfig())
    assert cache.hicache is not None
    pools = cache.hicache.pools
    assert sorted(pools) == ["kv", "swa"]
    assert pools["swa"].device is kv.swa_side
    assert (pools["kv"].host.size, pools["swa"].host.size) == (32, 16)  # 2 x 16, 2 x 8


@pytest.mark.parametrize("bad", [{"hicache_ratio": 2.0}, 2.0, "write_back", CacheConfig()])
def test_hicache_must_be_a_hicache_config(bad: object) -> None:
    kv = TokenAllocator(8)
    with pytest.raises(TypeError, match="hicache must be a HiCacheConfig or None"):
        RadixCache(kv_allocator=kv, hicache=bad)  # type: ignore[arg-type]
    assert kv.available_size() == 8


def test_host_pool_by_bytes_must_exceed_the_device_pool() -> None:
    pool = KVPool(16, 2, 1, 2, torch.float32)
    kv = TokenAllocator(16, pool=pool)
    per_token = pool.bytes_per_token  # 2 layers x (K + V) x 1 head x 2 dims x 4 bytes = 32
    assert per_token == 32
    with pytest.raises(ValueError, match=r"host pool of 16 units must be larger than the device pool \(16\)"):
        RadixCache(kv_allocator=kv, hicache=HiCacheConfig(hicache_size=16 * per_token / 1e9))
    c = RadixCache(kv_allocator=kv, hicache=HiCacheConfig(hicache_size=(40 * per_token + 5) / 1e9))
    assert c.hicache is not None and c.hicache.host_kv.size == 40


def test_a_ratio_too_small_for_the_state_pool_is_refused() -> None:
    sp = MambaStatePool(1, 1, (1,), (1,))
    with pytest.raises(ValueError, match=r"host pool of 1 units must be larger than the device pool \(1\)"):
        RadixCache(kv_allocator=TokenAllocator(8), state_allocator=sp,
                   hicache=HiCacheConfig(hicache_ratio=1.5))


def test_a_ratio_rounding_down_to_the_device_size_is_refused() -> None:
    with pytest.raises(ValueError, match="must be larger than the device pool"):
        RadixCache(kv_allocator=TokenAllocator(8), hicache=HiCacheConfig(hicache_ratio=1.1))


# ======================================================================== calls
def host_only_cache():
    h = make(size=16, states=4)
    c = h.cache
    put(h, [1, 2, 3, 4])
    put(h, [5, 6, 7, 8])
    x = node_at(c, [1, 2, 3, 4])
    c.inc_lock_ref(node_at(c, [5, 6, 7, 8]))
    c.evict(4)
    assert x.kv_value is None and x.host_value is not None
    return h, x


def test_locking_a_host_only_node_is_an_error_and_changes_nothing() -> None:
    h, x = host_only_cache()
    before = dump(h)
    with pytest.raises(ValueError, match=f"node {x.id} is host-only; load_back it before locking it"):
        h.cache.inc_lock_ref(x)
    with pytest.raises(ValueError, match="host-only"):
        h.cache.dec_lock_ref(x)
    assert_same(before, dump(h))


def test_load_back_refuses_what_is_not_a_node_of_this_cache() -> None:
    h, x = host_only_cache()
    other, y = host_only_cache()
    before = dump(h)
    with pytest.raises(TypeError, match="node must be a TreeNode"):
        h.cache.load_back("node")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="node must be a TreeNode"):
        h.cache.load_back(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"node {y.id} is not in this cache"):
        h.cache.load_back(y)
    assert_same(before, dump(h))
    h.cache.evict_host(4)  # x leaves the tree
    assert not h.cache.tree.is_attached(x)
    before = dump(h)
    with pytest.raises(ValueError, match="is not in this cache"):
        h.cache.load_back(x)
    assert_same(before, dump(h))


def test_load_back_and_evict_host_without_hicache_are_errors() -> None:
    kv = TokenAllocator(8)
    c = RadixCache(kv_allocator=kv)
    r = c.insert([1, 2, 3, 4], kv.alloc(4))
    before = (c.pretty_print(), c.stats(), kv.snapshot())
    with pytest.raises(ValueError, match="load_back on a cache without HiCache"):
        c.load_back(r.last_node)
    with pytest.raises(ValueError, match="evict_host on a cache without HiCache"):
        c.evict_host(4)
    assert (c.pretty_print(), c.stats(), kv.snapshot()) == before
    assert c.host_size() == 0 and c.poll_transfers() == 0
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.host_hit_length, m.last_host_node) == (0, m.last_device_node)


@pytest.mark.parametrize("n,exc", [(-1, ValueError), (True, TypeError), (1.0, TypeError),
                                   ("4", TypeError), (None, TypeError)])
def test_evict_host_count_must_be_a_non_negative_int(n: object, exc: type) -> None:
    h, _ = host_only_cache()
    before = dump(h)
    with pytest.raises(exc, match="num_tokens must be an int >= 0"):
        h.cache.evict_host(n)  # type: ignore[arg-type]
    assert_same(before, dump(h))


# ======================================================================== huge numbers
@pytest.mark.parametrize("kwargs,name", [
    ({"hicache_ratio": 10**400}, "hicache_ratio"),  # an int no float holds
    ({"hicache_size": 10**400}, "hicache_size"),
    ({"hicache_size": 1e300}, "hicache_size"),  # finite, but 1e300 GB is not a finite byte count
])
def test_numbers_past_a_float_are_refused_naming_the_field(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        HiCacheConfig(**kwargs)  # type: ignore[arg-type]


def test_a_ratio_whose_host_size_is_not_finite_is_refused_naming_it() -> None:
    # 16 device slots x 1e308 = inf host slots: refused naming the ratio, nothing allocated
    # (not an OverflowError from deep inside the pool sizing).
    # (With a memory fraction the ratio is cut to what fits instead.)
    kv = TokenAllocator(16, pool=KVPool(16, 2, 1, 2, torch.float32))
    with pytest.raises(ValueError, match="hicache_ratio"):
        RadixCache(kv_allocator=kv, hicache=HiCacheConfig(
            hicache_ratio=1e308, hicache_host_memory_fraction=None))
    assert kv.available_size() == 16


def test_a_state_allocator_hicache_cannot_mirror_is_refused_naming_it() -> None:
    # a bare slot allocator is a valid state_allocator without a host tier; with one, its
    # host mirror needs the conv / SSM tensors (actual: AttributeError 'bytes_per_slot')
    kv, states = TokenAllocator(8), TokenAllocator(4)
    RadixCache(kv_allocator=kv, state_allocator=states)
    with pytest.raises(TypeError, match="state_allocator needs an allocators.MambaStatePool"):
        RadixCache(kv_allocator=kv, state_allocator=states, hicache=HiCacheConfig())
    assert (kv.available_size(), states.available_size()) == (8, 4)


@pytest.mark.parametrize("kwargs,name", [({"config": "write_back"}, "config"),
                                         ({"config": None}, "config"),
                                         ({"kv_device": "kv"}, "kv_device")])
def test_the_controller_refuses_what_is_not_its_arguments_naming_them(kwargs: dict[str, object],
                                                                       name: str) -> None:
    # HiCacheController is public (an engine may build the host pools itself); actual:
    # AttributeError from deep in the pool sizing
    from hicache import HiCacheController

    args: dict[str, object] = {"kv_device": TokenAllocator(8), "state_device": None,
                               "config": HiCacheConfig(), **kwargs}
    with pytest.raises(TypeError, match=f"^{name} .*must be"):
        HiCacheController(**args)  # type: ignore[arg-type]
