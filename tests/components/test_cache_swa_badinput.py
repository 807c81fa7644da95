"""Bad input to the SWA parts of the cache: each a clear error, nothing changed.

"Nothing changed" is checked on the tree (``pretty_print()``: spans, locks, tombstones, stamps),
the allocator (``snapshot()``: both free lists and the full-to-SWA mapping) and the counters.
"""

from __future__ import annotations

import pytest
import torch

from allocators import PagedAllocator, SWAAllocator, TokenAllocator
from radix import CacheConfig, CacheRequest, RadixCache
from tests.helpers.swa_helpers import Checked, t64

K = list(range(101, 113))
NEVER = "SWA indices never allocated or already freed"




def state_of(cache: RadixCache, kv: SWAAllocator) -> tuple:
    return (
        cache.pretty_print(),
        kv.snapshot(),
        cache.swa_evictable_size(),
        cache.swa_protected_size(),
        cache.evictable_size(),
        cache.protected_size(),
        cache.stats()["num_nodes"],
    )


def populated(window: int = 2):
    """K[:8] cached as A [0,4) (tombstone, slots 1..4) and B [4,8) (live, 5..8); B is locked by
    a request (its lock returned); the caller still holds slots 9, 10 (live) and 11 (its SWA
    side released)."""
    kv = SWAAllocator(16, 12)
    cache = Checked(RadixCache(CacheConfig(sliding_window_size=window), kv_allocator=kv))
    b = cache.insert(K[:8], kv.alloc(8)).last_node
    cache.match_prefix(K[:4] + [99])  # split at 4
    start = cache.inc_lock_ref(b)
    assert start.part("swa") == 4 and cache.evict_swa(1).num_swa_tokens == 4  # A tombstoned
    held = kv.alloc(3)
    assert held.tolist() == [9, 10, 11]
    kv.free_swa(t64(11))
    cache.sanity_check()
    assert b.parent.swa_tombstone and not b.swa_tombstone
    return cache, kv, b, start


# ====================================================================== building
@pytest.mark.parametrize(
    ("window", "exc"),
    [(0, ValueError), (-4, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError)],
)
def test_window_must_be_a_positive_int(window: object, exc: type) -> None:
    with pytest.raises(exc, match="sliding_window_size"):
        CacheConfig(sliding_window_size=window)  # type: ignore[arg-type]
    with pytest.raises(exc, match="sliding_window_size"):
        CacheConfig.from_dict({"sliding_window_size": window})


def test_window_none_means_no_swa_component() -> None:
    kv = SWAAllocator(8, 4)
    cache = RadixCache(CacheConfig(sliding_window_size=None), kv_allocator=kv)
    assert cache.swa is None
    assert CacheConfig.from_json('{"sliding_window_size": 3}').sliding_window_size == 3


def test_swa_pool_larger_than_the_full_pool_is_refused() -> None:
    with pytest.raises(ValueError, match=r"swa_size=16 must be <= full_size=8"):
        SWAAllocator(8, 16)
    with pytest.raises(ValueError, match=r"swa_size=12 must be <= full_size=8"):
        SWAAllocator(8, 12, page_size=4)
    assert SWAAllocator(8, 8).swa_size == 8  # equal is fine


@pytest.mark.parametrize("alloc", [TokenAllocator(8), PagedAllocator(8, 1)])
def test_a_window_needs_an_swa_allocator(alloc: object) -> None:
    with pytest.raises(TypeError, match="SWAAllocator"):
        RadixCache(CacheConfig(sliding_window_size=4), kv_allocator=alloc)  # type: ignore[arg-type]
    assert alloc.available_size() == 8  # type: ignore[attr-defined]


def test_swa_allocator_page_size_must_match_the_config() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(CacheConfig(sliding_window_size=4), kv_allocator=SWAAllocator(8, 8, 2))


# ====================================================================== free_swa
@pytest.mark.parametrize(
    ("slots", "msg"),
    [
        ((13,), f"{NEVER}: slot 13 is not allocated"),  # never handed out
        ((2,), f"{NEVER}: slot 2 has no live SWA slot"),  # the tree's tombstone A
        ((11,), f"{NEVER}: slot 11 has no live SWA slot"),  # the caller's, released before
        ((9, 12), f"{NEVER}: slot 12 is not allocated"),  # one good, one bad: nothing freed
        ((0,), "foreign index"),  # padding
        ((99,), "foreign index"),
        ((9, 9), "double free"),
    ],
)
def test_free_swa_of_slots_without_a_live_swa_slot_is_refused(slots: tuple, msg: str) -> None:
    cache, kv, b, start = populated()
    before = state_of(cache, kv)
    with pytest.raises(ValueError, match=msg):
        kv.free_swa(t64(*slots))
    assert state_of(cache, kv) == before
    kv.check()
    cache.sanity_check()


# ====================================================================== locks and counts
def test_dec_lock_ref_without_its_lock_changes_nothing() -> None:
    cache, kv, b, start = populated()
    before = state_of(cache, kv)
    for bad, err in ((b, ValueError), (None, TypeError), (0, TypeError), (9, TypeError),
                     (False, TypeError), (4.0, TypeError)):
        with pytest.raises(err, match="lock"):
            cache.dec_lock_ref(bad)  # type: ignore[arg-type]
        assert state_of(cache, kv) == before
    with pytest.raises(ValueError, match="lock"):
        cache.dec_lock_ref(b.parent)  # A is only locked through B
    assert state_of(cache, kv) == before
    cache.dec_lock_ref(start)
    assert (cache.swa_protected_size(), cache.protected_size()) == (0, 0)
    cache.sanity_check()


@pytest.mark.parametrize(("n", "exc"), [(-1, ValueError), (True, TypeError), (1.5, TypeError)])
def test_evict_swa_refuses_a_bad_count(n: object, exc: type) -> None:
    cache, kv, b, start = populated()
    before = state_of(cache, kv)
    with pytest.raises(exc, match="num_tokens"):
        cache.evict_swa(n)  # type: ignore[arg-type]
    assert state_of(cache, kv) == before


@pytest.mark.parametrize(
    ("seq_len", "exc"), [(-1, ValueError), (9, ValueError), (True, TypeError), (4.0, TypeError)]
)
def test_release_swa_refuses_a_bad_seq_len(seq_len: object, exc: type) -> None:
    cache, kv, b, start = populated()
    req = CacheRequest(key=K[:8] + [1, 2], kv_indices=torch.cat([t64(*range(1, 9))]),
                       cached_len=8, last_node=b, lock=start)
    before = state_of(cache, kv)
    with pytest.raises(exc, match="seq_len"):
        cache.release_swa(req, seq_len)  # type: ignore[arg-type]
    assert state_of(cache, kv) == before and req.swa_evicted_seqlen == 0


# ====================================================================== insert
def test_insert_with_a_slot_outside_the_pool_changes_nothing() -> None:
    kv = SWAAllocator(16, 8)
    cache = Checked(RadixCache(CacheConfig(sliding_window_size=2), kv_allocator=kv))
    cache.insert([1, 2, 3, 4], kv.alloc(4))
    before = state_of(cache, kv)
    with pytest.raises(ValueError, match="999"):
        cache.insert([1, 2, 9, 9], t64(1, 2, 999, 1000))
    assert state_of(cache, kv) == before  # today: [0,4) split at 2, stamps moved


def test_insert_with_live_slots_before_released_ones_stays_consistent() -> None:
    kv = SWAAllocator(16, 16)
    cache = RadixCache(CacheConfig(sliding_window_size=2), kv_allocator=kv)
    v = kv.alloc(6)
    kv.free_swa(t64(3, 4))  # tokens [2, 4) released, [0, 2) and [4, 6) still live
    before = state_of(cache, kv)
    try:
        cache.insert([1, 2, 3, 4, 5, 6], v)
    except ValueError:
        assert state_of(cache, kv) == before  # refusing it would be fine too
        return
    cache.sanity_check()  # today: "tombstone still maps SWA slots" on [0, 4)
    live_held_by_caller = 0
    assert (
        kv.swa_available_size()
        + cache.swa_evictable_size()
        + cache.swa_protected_size()
        + live_held_by_caller
        == kv.swa_size
    )
