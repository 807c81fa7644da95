"""RadixCache with a sliding-window (SWA) component: narrated scenarios with exact slot ids.

Slot ids follow the SWAAllocator contract (allocators/swa.py): each side is a FIFO free list,
initially ascending, ``alloc`` takes from the front of *both* sides and maps them element-wise,
``free`` / ``free_swa`` append to the back in the order given (``free`` skips the SWA side of a
tombstoned slot). So the tails of ``snapshot().free_ids()`` (full side) and
``snapshot().swa.free_ids()`` (SWA side) say exactly what an eviction gave back, in order.

Node ids: the first node of a cache is id 1; a split creates the *upper* half as a new node
(next id), the lower half keeps its id. ``evict_swa`` orders live candidates by
``(last_access_time, id)``.
"""

from __future__ import annotations

import pytest
import torch

from allocators import SWAAllocator
from radix import CacheConfig, EvictResult, RadixCache
from tests.helpers.cache_helpers import node_slots
from tests.helpers.swa_helpers import Checked, ids, t64

K = list(range(101, 113))  # tokens 101..112




def make(window: int, full: int = 32, swa: int = 16, page_size: int = 1):
    kv = SWAAllocator(full, swa, page_size)
    cache = RadixCache(
        CacheConfig(page_size=page_size, sliding_window_size=window), kv_allocator=kv
    )
    cache.sanity_check()
    return Checked(cache), kv


def sides(kv: SWAAllocator) -> tuple[list[int], list[int]]:
    """(full free list, SWA free list), front first (page ids when paged)."""
    snap = kv.snapshot()
    return snap.free_ids(), snap.swa.free_ids()


def swa_sizes(cache: RadixCache) -> tuple[int, int]:
    return cache.swa_evictable_size(), cache.swa_protected_size()


def span(node) -> tuple[int, int]:
    return node.start, node.depth


def three_nodes(window: int, **kw):
    """K cached as X [0,4) id 3, Y [4,8) id 2, Z [8,12) id 1 (slots = SWA slots = 1..12), then Y
    tombstoned by ``evict_swa`` while Z is locked. Stamps: X, Y = 3, Z = 2. Z is unlocked again.
    """
    cache, kv = make(window, **kw)
    v = kv.alloc(12)
    assert ids(v) == list(range(1, 13))
    z = cache.insert(K, v).last_node
    cache.sanity_check()
    cache.match_prefix(K[:8] + [99])  # split at 8: upper [0,8) is id 2
    cache.match_prefix(K[:4] + [99])  # split at 4: upper [0,4) is id 3
    cache.sanity_check()
    y = z.parent
    x = y.parent
    assert (x.id, y.id, z.id) == (3, 2, 1)
    assert (span(x), span(y), span(z)) == ((0, 4), (4, 8), (8, 12))
    assert (x.last_access_time, y.last_access_time, z.last_access_time) == (3, 3, 2)
    start = cache.inc_lock_ref(z)
    assert start.part("swa") == 8  # Z alone covers the window (W <= 4)
    # Z (the LRU node) is locked: Y (t=3, id 2) goes before X (t=3, id 3); internal -> tombstone.
    assert cache.evict_swa(1) == EvictResult(0, 0, 4)
    cache.dec_lock_ref(start)
    cache.sanity_check()
    assert (x.swa_tombstone, y.swa_tombstone, z.swa_tombstone) == (False, True, False)
    return cache, kv, x, y, z


# ====================================================================== the usable-prefix rule
def test_match_stops_where_fewer_than_a_window_of_live_tokens_precede_it() -> None:
    cache, kv = make(4)  # W = 4
    v = kv.alloc(12)
    assert ids(v) == list(range(1, 13))
    z = cache.insert(K, v).last_node
    cache.match_prefix(K[:8] + [99])
    cache.match_prefix(K[:4] + [99])
    y, x = z.parent, z.parent.parent
    start = cache.inc_lock_ref(z)
    assert start.part("swa") == 8  # Z alone covers the window: only Z is SWA-locked
    assert (z.swa_lock, y.swa_lock, x.swa_lock) == (1, 0, 0)
    assert swa_sizes(cache) == (8, 4)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 12)
    cache.sanity_check()

    # Y (t=3, id 2) before X (t=3, id 3); Z is locked. Y is internal: a tombstone.
    assert cache.evict_swa(1) == EvictResult(0, 0, 4)
    cache.sanity_check()
    assert y.swa_tombstone and ids(node_slots(y)) == [5, 6, 7, 8]  # full KV stays
    assert sides(kv) == (list(range(13, 33)), [13, 14, 15, 16, 5, 6, 7, 8])
    assert ids(kv.translate(v)) == [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12]
    assert kv.has_swa(t64(4, 5, 8, 9)).tolist() == [True, False, False, True]
    assert (kv.full_available_size(), kv.swa_available_size()) == (20, 8)
    assert swa_sizes(cache) == (4, 4)
    assert cache.stats()["evicted_swa_tokens"] == 4

    # The end of Z has 4 live tokens before it: usable. Ends inside Z have 1..3: not usable, and
    # Y's end is a tombstone, so those matches fall back to X's end (the path above is live).
    for query, split_id, want_miss in ((K[:9], 4, 5), (K[:10], 5, 6), (K[:11], 6, 7)):
        m = cache.match_prefix(query + [99])
        cache.sanity_check()
        assert (m.prefix_len, m.kv_hit_length, m.swa_miss_tokens) == (4, len(query), want_miss)
        assert ids(m.device_indices) == [1, 2, 3, 4] and m.last_device_node is x
        assert cache.stats()["num_nodes"] == split_id  # the walk split Z at the KV-hit end
    m = cache.match_prefix(K)
    assert (m.prefix_len, m.kv_hit_length, m.swa_miss_tokens) == (12, 12, 0)
    assert ids(m.device_indices) == list(range(1, 13)) and m.last_device_node is z
    # Z is now [8,9) id 4, [9,10) id 5, [10,11) id 6, [11,12) id 1; the splits copied its lock.
    chain = [z, z.parent, z.parent.parent, z.parent.parent.parent]
    assert [(n.id, span(n), n.swa_lock) for n in chain] == [
        (1, (11, 12), 1), (6, (10, 11), 1), (5, (9, 10), 1), (4, (8, 9), 1),
    ]
    assert chain[-1].parent is y and swa_sizes(cache) == (4, 4)

    # A split of the locked node between lock and unlock: one unlock releases every half once.
    cache.dec_lock_ref(start)
    cache.sanity_check()
    assert [n.swa_lock for n in chain] == [0, 0, 0, 0]
    assert swa_sizes(cache) == (8, 0)
    assert (cache.evictable_size(), cache.protected_size()) == (12, 0)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(start)  # a second unlock is refused
    cache.sanity_check()


def test_a_live_path_from_the_root_is_usable_even_shorter_than_a_window() -> None:
    cache, kv = make(8)  # W = 8, longer than any key here
    a = cache.insert(K[:4], kv.alloc(4)).last_node  # id 1, slots 1..4
    b = cache.insert(K[:6], torch.cat([node_slots(a), kv.alloc(2)])).last_node  # id 2, slots 5, 6
    cache.sanity_check()
    assert (span(a), span(b), ids(node_slots(b))) == ((0, 4), (4, 6), [5, 6])
    for query, want in ((K[:4], 4), (K[:4] + [99], 4), (K[:6], 6), (K + [99], 6)):
        m = cache.match_prefix(query)
        cache.sanity_check()
        assert (m.prefix_len, m.swa_miss_tokens) == (want, 0)  # no tombstone on the path
        assert ids(m.device_indices) == list(range(1, want + 1))
    assert cache.stats()["num_nodes"] == 2  # every query left at a node boundary

    # The lock climbs to the root (6 tokens < W): nothing is SWA-evictable meanwhile.
    start = cache.inc_lock_ref(b)
    assert start.part("swa") == 0 and (a.swa_lock, b.swa_lock) == (1, 1) and swa_sizes(cache) == (0, 6)
    assert cache.evict_swa(3) == EvictResult(0, 0, 0)
    cache.dec_lock_ref(start)
    cache.sanity_check()
    # A (same stamp, id 1) is tombstoned; B's 2 live tokens (< W) no longer make a usable end.
    assert cache.evict_swa(1) == EvictResult(0, 0, 4)
    cache.sanity_check()
    for query, hit in ((K[:6], 6), (K[:4], 4)):
        m = cache.match_prefix(query)
        assert (m.prefix_len, m.kv_hit_length, m.swa_miss_tokens) == (0, hit, hit)
        assert ids(m.device_indices) == [] and m.last_device_node is cache.root
    cache.sanity_check()


def test_paged_window_not_a_page_multiple() -> None:
    cache, kv = make(3, full=16, swa=16, page_size=2)  # W = 3, pages of 2: page k = 2k, 2k+1
    v = kv.alloc(8)
    assert ids(v) == list(range(2, 10))
    p2 = cache.insert(K[:8], v).last_node
    cache.match_prefix(K[:4] + [99, 99])  # split at 4 (upper id 2)
    cache.match_prefix(K[:2] + [99, 99])  # split at 2 (upper id 3)
    p1 = p2.parent
    p0 = p1.parent
    assert [(n.id, span(n)) for n in (p0, p1, p2)] == [(3, (0, 2)), (2, (2, 4)), (1, (4, 8))]
    start = cache.inc_lock_ref(p2)
    assert start.part("swa") == 4 and swa_sizes(cache) == (4, 4)
    assert cache.evict_swa(1) == EvictResult(0, 0, 2)  # P1 (t=3, id 2): tombstone, page 2
    cache.sanity_check()
    assert p1.swa_tombstone and sides(kv)[1] == [5, 6, 7, 8, 2]
    assert ids(kv.translate(v)) == [2, 3, 0, 0, 6, 7, 8, 9]
    m = cache.match_prefix(K[:8])
    assert (m.prefix_len, m.swa_miss_tokens) == (8, 0)  # 4 live tokens >= 3 before the end
    for query in (K[:6], K[:7]):  # 7 tokens: only 3 whole pages; 2 live tokens < 3
        m = cache.match_prefix(query)
        cache.sanity_check()
        assert (m.prefix_len, m.kv_hit_length, m.swa_miss_tokens) == (2, 6, 4)
        assert ids(m.device_indices) == [2, 3] and m.last_device_node is p0
    upper = p2.parent
    assert span(upper) == (4, 6) and (upper.swa_lock, p2.swa_lock) == (1, 1)
    cache.dec_lock_ref(start)
    assert swa_sizes(cache) == (6, 0)
    cache.sanity_check()


# ====================================================================== evict_swa
def test_evict_swa_tombstones_an_internal_node_and_removes_a_leaf_whole() -> None:
    cache, kv = make(2, full=16, swa=16)  # W = 2
    a = cache.insert(K[:4], kv.alloc(4)).last_node  # t=1, id 1, slots 1..4
    b = cache.insert(K[:6], torch.cat([node_slots(a), kv.alloc(2)])).last_node  # t=2, id 2: 5, 6
    cache.sanity_check()
    assert (a.last_access_time, b.last_access_time) == (2, 2)
    assert swa_sizes(cache) == (6, 0)

    # A (t=2, id 1) before B (t=2, id 2); A is internal: tombstone, its full KV stays.
    assert cache.evict_swa(1) == EvictResult(0, 0, 4)
    cache.sanity_check()
    assert a.swa_tombstone and not b.swa_tombstone
    assert sides(kv) == (list(range(7, 17)), list(range(7, 17)) + [1, 2, 3, 4])
    assert ids(kv.translate(t64(1, 2, 3, 4, 5, 6))) == [0, 0, 0, 0, 5, 6]
    assert (kv.full_available_size(), kv.swa_available_size()) == (10, 14)
    assert swa_sizes(cache) == (2, 0)
    assert (cache.evictable_size(), cache.protected_size()) == (6, 0)
    m = cache.match_prefix(K[:6])  # B's 2 live tokens fill the window
    assert (m.prefix_len, ids(m.device_indices)) == (6, [1, 2, 3, 4, 5, 6])

    # B is a leaf: it leaves whole, and A, now a childless unlocked tombstone, goes with it.
    assert cache.evict_swa(1) == EvictResult(6, 0, 2)
    cache.sanity_check()
    assert cache.stats()["num_nodes"] == 0
    full_free, swa_free = sides(kv)
    assert full_free[-6:] == [5, 6, 1, 2, 3, 4]  # B's full slots, then A's
    assert swa_free[-6:] == [1, 2, 3, 4, 5, 6]  # A's (tombstoned earlier), then B's
    assert (kv.full_available_size(), kv.swa_available_size()) == (16, 16)
    assert cache.stats()["evicted_swa_tokens"] == 6 and cache.stats()["evicted_tokens"] == 6
    assert cache.evict_swa(5) == EvictResult(0, 0, 0)  # nothing left


def test_evict_swa_takes_victims_in_lru_order_until_enough() -> None:
    cache, kv = make(2, full=16, swa=16)  # W = 2
    l1 = cache.insert(K[:6], kv.alloc(6)).last_node  # t=1, id 1, slots 1..6
    # A branch at 4: the split makes [0,4) id 2, the new leaf [4,6)' is id 3 (slots 7, 8).
    r = cache.insert(K[:4] + [201, 202], torch.cat([t64(1, 2, 3, 4), kv.alloc(2)]))
    l2 = r.last_node
    u = l1.parent
    assert (u.id, l1.id, l2.id, span(u), span(l1), ids(node_slots(l2))) == (
        2, 1, 3, (0, 4), (4, 6), [7, 8]
    )
    cache.match_prefix(K[:4] + [201, 202])  # t=3 on U and L2; L1 keeps t=2
    cache.sanity_check()
    # Order: L1 (t=2, id 1) leaf, U (t=3, id 2) internal, L2 (t=3, id 3) leaf.
    assert cache.evict_swa(3) == EvictResult(2, 0, 6)  # L1 whole (2 < 3), then U tombstoned
    cache.sanity_check()
    assert u.swa_tombstone and not l2.swa_tombstone and cache.stats()["num_nodes"] == 2
    assert sides(kv)[0][-2:] == [5, 6]
    assert sides(kv)[1][-6:] == [5, 6, 1, 2, 3, 4]
    m = cache.match_prefix(K[:4] + [201, 202])  # L2's 2 live tokens fill the window
    assert (m.prefix_len, ids(m.device_indices)) == (6, [1, 2, 3, 4, 7, 8])
    m = cache.match_prefix(K[:6])  # L1 is gone; U alone is a tombstone
    assert (m.prefix_len, m.kv_hit_length) == (0, 4)
    # L2 leaves whole and takes the dead tombstone U with it.
    assert cache.evict_swa(1) == EvictResult(6, 0, 2)
    assert sides(kv)[0][-6:] == [7, 8, 1, 2, 3, 4]
    assert cache.stats()["num_nodes"] == 0
    assert (kv.full_available_size(), kv.swa_available_size()) == (16, 16)
    cache.sanity_check()


# ====================================================================== revival on insert
def test_insert_revives_a_tombstone_with_the_callers_live_slots() -> None:
    cache, kv, x, y, z = three_nodes(4)  # SWA free list: [13, 14, 15, 16, 5, 6, 7, 8]
    assert sides(kv) == (list(range(13, 33)), [13, 14, 15, 16, 5, 6, 7, 8])
    key = K[:8] + [50, 51]
    m = cache.match_prefix(key)
    assert (m.prefix_len, m.kv_hit_length, m.last_device_node) == (4, 8, x)
    start = cache.inc_lock_ref(x)  # the request holds X (its window: X alone)
    assert start.part("swa") == 0
    # It computes tokens [4, 10) itself: full 13..18, SWA 13, 14, 15, 16 and the reused 5, 6.
    fresh = kv.alloc(6)
    assert ids(fresh) == [13, 14, 15, 16, 17, 18]
    assert ids(kv.translate(fresh)) == [13, 14, 15, 16, 5, 6]
    res = cache.insert(key, torch.cat([m.device_indices, fresh]))
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (8, 10)
    assert ids(res.revived_indices) == [13, 14, 15, 16]  # Y took the caller's live slots
    assert ids(res.duplicate_indices) == []  # ... so they are not duplicates
    assert ids(res.adopted_indices) == [17, 18]
    assert not y.swa_tombstone and ids(node_slots(y)) == [13, 14, 15, 16]
    assert ids(kv.translate(node_slots(y))) == [13, 14, 15, 16]
    assert sides(kv)[0][-4:] == [5, 6, 7, 8]  # Y's old (tombstoned) full slots, freed by the tree
    assert sides(kv)[1] == [7, 8]  # the SWA side of a tombstone was already free: untouched
    assert ids(kv.translate(t64(17, 18))) == [5, 6]  # the reused SWA slots stay mapped
    assert cache.stats()["revived_swa_tokens"] == 4
    assert swa_sizes(cache) == (10, 4) and cache.total_size() == 14  # X: the request's window
    cache.dec_lock_ref(start)
    m = cache.match_prefix(K)
    assert (m.prefix_len, m.swa_miss_tokens) == (12, 0)
    assert ids(m.device_indices) == [1, 2, 3, 4, 13, 14, 15, 16, 9, 10, 11, 12]
    assert (kv.full_available_size(), kv.swa_available_size()) == (18, 2)
    cache.sanity_check()


def test_partial_revival_splits_at_the_page_where_the_callers_live_slots_start() -> None:
    """Chunked prefill with W = 2: the request released the SWA KV of its tokens [4, 6) (they
    slid out of its window), so only Y's [6, 8) comes back to life; [4, 6) stays a tombstone."""
    from radix import CacheRequest

    cache, kv, x, y, z = three_nodes(2)
    key = K[:8] + [50, 51]
    m = cache.match_prefix(key)
    assert (m.prefix_len, m.last_device_node) == (4, x)
    req = CacheRequest(key=key, kv_indices=torch.cat([m.device_indices, kv.alloc(6)]),
                       cached_len=4, last_node=x)
    req.lock = cache.inc_lock_ref(x)
    assert req.lock.part("swa") == 0 and ids(req.kv_indices) == [1, 2, 3, 4, 13, 14, 15, 16, 17, 18]
    # Next chunk boundary 8: keep max(W, page) = 2 tokens before it, release [4, 6).
    assert cache.release_swa(req, 8) == 2
    assert req.swa_evicted_seqlen == 6
    assert sides(kv)[1] == [7, 8, 13, 14]
    res = cache.cache_unfinished_req(req, upto=8)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (8, 8)
    assert ids(res.revived_indices) == [15, 16]
    assert ids(res.duplicate_indices) == [13, 14]  # its dead copies of [4, 6): freed for it
    y_up = res.last_node.parent
    assert res.last_node is y and span(y) == (6, 8) and span(y_up) == (4, 6)
    assert y_up.swa_tombstone and ids(node_slots(y_up)) == [5, 6]
    assert not y.swa_tombstone and ids(node_slots(y)) == [15, 16]
    assert sides(kv)[0][-4:] == [7, 8, 13, 14]  # Y's old [6, 8), then the duplicates
    assert sides(kv)[1] == [7, 8, 13, 14]  # no SWA slot moved: all four were dead already
    # The request now holds Y [6, 8): 2 live tokens fill its window.
    assert ids(req.kv_indices) == [1, 2, 3, 4, 5, 6, 15, 16, 17, 18]
    assert (req.cached_len, req.last_node, req.lock.part("swa")) == (8, y, 6)
    assert (x.kv_lock, y_up.kv_lock, y.kv_lock, y.swa_lock, x.swa_lock) == (1, 1, 1, 1, 0)
    assert swa_sizes(cache) == (8, 2)

    assert cache.release_swa(req, 10) == 0  # [cached_len, 8) is the tree's: nothing of its own
    res = cache.cache_finished_req(req)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len, ids(res.adopted_indices)) == (8, 10, [17, 18])
    assert ids(res.revived_indices) == [] and ids(res.duplicate_indices) == []
    assert (req.last_node, req.lock, req.cached_len) == (cache.root, None, 0)
    assert swa_sizes(cache) == (12, 0) and cache.protected_size() == 0
    m = cache.match_prefix(key)
    assert (m.prefix_len, m.swa_miss_tokens) == (10, 0)
    assert ids(m.device_indices) == [1, 2, 3, 4, 5, 6, 15, 16, 17, 18]
    m = cache.match_prefix(K[:7] + [99])  # 1 live token (< 2) after the tombstone [4, 6)
    assert (m.prefix_len, m.kv_hit_length) == (4, 7)
    cache.sanity_check()


def test_no_revival_of_a_tombstone_another_request_holds() -> None:
    cache, kv, x, y, z = three_nodes(4)
    other = cache.match_prefix(K).last_device_node
    assert other is z
    other_start = cache.inc_lock_ref(z)  # another request holds Z, hence Y's full KV
    assert y.kv_lock == 1 and y.swa_lock == 0
    key = K[:8] + [50, 51]
    m = cache.match_prefix(key)
    assert m.prefix_len == 4
    start = cache.inc_lock_ref(x)
    fresh = kv.alloc(6)
    assert ids(fresh) == [13, 14, 15, 16, 17, 18]
    snap_swa = sides(kv)[1]
    res = cache.insert(key, torch.cat([m.device_indices, fresh]))
    cache.sanity_check()
    assert ids(res.revived_indices) == []
    assert ids(res.duplicate_indices) == [13, 14, 15, 16]  # the caller frees its live copies
    assert y.swa_tombstone and ids(node_slots(y)) == [5, 6, 7, 8]
    assert sides(kv)[1] == snap_swa  # the tree freed nothing
    kv.free(res.duplicate_indices)
    assert sides(kv)[1] == snap_swa + [13, 14, 15, 16]
    cache.dec_lock_ref(start)
    cache.dec_lock_ref(other_start)
    # Released: a later request with live slots of its own revives Y after all.
    fresh = kv.alloc(4)
    assert ids(fresh) == [19, 20, 21, 22] and ids(kv.translate(fresh)) == [7, 8, 13, 14]
    res = cache.insert(K[:8], torch.cat([t64(1, 2, 3, 4), fresh]))
    cache.sanity_check()
    assert ids(res.revived_indices) == [19, 20, 21, 22] and ids(res.duplicate_indices) == []
    assert not y.swa_tombstone and ids(node_slots(y)) == [19, 20, 21, 22]
    assert sides(kv)[0][-4:] == [5, 6, 7, 8]


def test_insert_over_a_tombstone_with_the_trees_own_slots_revives_nothing() -> None:
    cache, kv, x, y, z = three_nodes(4)
    m = cache.match_prefix(K)  # usable: Z's window is live; the caller gets Y's full slots
    assert ids(m.device_indices) == list(range(1, 13))
    snap = kv.snapshot()
    res = cache.insert(K, m.device_indices)
    cache.sanity_check()
    assert ids(res.revived_indices) == [] and ids(res.duplicate_indices) == []
    assert y.swa_tombstone and kv.snapshot() == snap


# ====================================================================== free_swa and reuse
def test_free_swa_slot_reused_by_another_request_survives_the_tombstone_eviction() -> None:
    from radix import CacheRequest

    cache, kv = make(4, full=16, swa=8)  # W = 4
    a = CacheRequest(key=K[:8], kv_indices=kv.alloc(8), cached_len=0, last_node=cache.root)
    assert ids(a.kv_indices) == list(range(1, 9)) and sides(kv)[1] == []
    # Request A decoded to 8 tokens: [0, 4) slid out of its window; their SWA slots go back.
    assert cache.release_swa(a, 8) == 4
    assert sides(kv)[1] == [1, 2, 3, 4]
    assert ids(kv.translate(a.kv_indices)) == [0, 0, 0, 0, 5, 6, 7, 8]
    # Request B takes SWA slots 1, 2 for its full slots 9, 10.
    b = kv.alloc(2)
    assert ids(b) == [9, 10] and ids(kv.translate(b)) == [1, 2]
    # A finishes: [0, 4) is cached as a tombstone (its SWA KV is gone), [4, 8) as a live leaf.
    res = cache.cache_finished_req(a)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len, ids(res.adopted_indices)) == (0, 8, list(range(1, 9)))
    leaf = res.last_node
    tomb = leaf.parent
    assert (span(tomb), tomb.swa_tombstone, span(leaf), leaf.swa_tombstone) == (
        (0, 4), True, (4, 8), False
    )
    assert swa_sizes(cache) == (4, 0) and cache.evictable_size() == 8
    m = cache.match_prefix(K[:8])
    assert (m.prefix_len, ids(m.device_indices)) == (8, list(range(1, 9)))
    # Evict the leaf: the tombstone above it is left dead and goes too. Its full slots 1..4
    # are freed; B's SWA slots 1, 2 (once the tombstone's) are left alone.
    assert cache.evict(1) == EvictResult(8, 0, 4)
    cache.sanity_check()
    assert cache.stats()["num_nodes"] == 0
    assert sides(kv) == (list(range(11, 17)) + [5, 6, 7, 8, 1, 2, 3, 4], [3, 4, 5, 6, 7, 8])
    assert ids(kv.translate(b)) == [1, 2] and kv.has_swa(b).tolist() == [True, True]
    kv.free(b)
    assert (kv.full_available_size(), kv.swa_available_size()) == (16, 8)
    kv.check()


# ====================================================================== window-bounded locks
def four_nodes(window: int):
    """K[:10] as A [0,4) id 4, B [4,6) id 3, C [6,8) id 2, D [8,10) id 1; stamps 4, 4, 3, 2."""
    cache, kv = make(window)
    d = cache.insert(K[:10], kv.alloc(10)).last_node
    for cut in (8, 6, 4):
        cache.match_prefix(K[:cut] + [99])
    c = d.parent
    b = c.parent
    a = b.parent
    assert [(n.id, span(n)) for n in (a, b, c, d)] == [
        (4, (0, 4)), (3, (4, 6)), (2, (6, 8)), (1, (8, 10))
    ]
    cache.sanity_check()
    return cache, kv, a, b, c, d


def test_a_lock_protects_one_window_above_the_node_and_no_more() -> None:
    cache, kv, a, b, c, d = four_nodes(4)
    start = cache.inc_lock_ref(d)
    assert start.part("swa") == 6  # D (2) + C (2) cover W = 4
    assert [n.swa_lock for n in (a, b, c, d)] == [0, 0, 1, 1]
    assert [n.kv_lock for n in (a, b, c, d)] == [1, 1, 1, 1]
    assert swa_sizes(cache) == (6, 4)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 10)
    cache.sanity_check()
    # Above the window, A and B stay SWA-evictable while the lock holds: B (t=4, id 3), then A.
    assert cache.evict_swa(100) == EvictResult(0, 0, 6)
    cache.sanity_check()
    assert [n.swa_tombstone for n in (a, b, c, d)] == [True, True, False, False]
    assert sides(kv)[1][-6:] == [5, 6, 1, 2, 3, 4]
    assert swa_sizes(cache) == (0, 4) and cache.total_size() == 10
    m = cache.match_prefix(K[:10])
    assert (m.prefix_len, m.last_device_node) == (10, d)  # the locked window is intact
    assert ids(m.device_indices) == list(range(1, 11))
    cache.dec_lock_ref(start)
    cache.sanity_check()
    assert swa_sizes(cache) == (4, 0) and cache.protected_size() == 0
    # The match stamped every node (t=5): D (id 1) leaves first, then C, A, B as dead nodes.
    assert cache.evict_swa(1) == EvictResult(2, 0, 2)
    assert cache.evict_swa(1) == EvictResult(8, 0, 2)
    assert sides(kv)[0][-10:] == [9, 10, 7, 8, 5, 6, 1, 2, 3, 4]
    assert cache.stats()["num_nodes"] == 0
    cache.sanity_check()


def test_a_lock_stops_at_a_tombstone_and_two_locks_count_twice() -> None:
    cache, kv = make(6)  # W = 6
    a = cache.insert(K[:4], kv.alloc(4)).last_node  # id 1, slots 1..4
    # A request whose tokens [4, 6) slid out of its window before it inserted [4, 10).
    own = kv.alloc(6)
    assert ids(own) == [5, 6, 7, 8, 9, 10]
    kv.free_swa(t64(5, 6))
    res = cache.insert(K[:10], torch.cat([node_slots(a), own]))
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len, ids(res.adopted_indices)) == (4, 10, ids(own))
    d = res.last_node
    b = d.parent
    assert (b.id, span(b), b.swa_tombstone, d.id, span(d), d.swa_tombstone) == (
        2, (4, 6), True, 3, (6, 10), False
    )
    assert b.parent is a and swa_sizes(cache) == (8, 0) and cache.total_size() == 10
    cache.match_prefix(K[:8] + [99])  # split D: C [6,8) id 4
    c = d.parent
    assert (c.id, span(c), span(d)) == (4, (6, 8), (8, 10))

    s1 = cache.inc_lock_ref(d)  # D (2) + C (2) < W, then B is a tombstone: stop
    assert s1.part("swa") == 6 and [n.swa_lock for n in (a, b, c, d)] == [0, 0, 1, 1]
    assert swa_sizes(cache) == (4, 4)
    s2 = cache.inc_lock_ref(d)  # a second request on the same node
    assert s2.part("swa") == 6 and [n.swa_lock for n in (a, b, c, d)] == [0, 0, 2, 2]
    assert swa_sizes(cache) == (4, 4) and d.lock_ref == 2
    cache.sanity_check()
    cache.dec_lock_ref(s1)
    assert [n.swa_lock for n in (c, d)] == [1, 1] and swa_sizes(cache) == (4, 4)
    cache.dec_lock_ref(s2)
    assert [n.swa_lock for n in (c, d)] == [0, 0] and swa_sizes(cache) == (8, 0)
    cache.sanity_check()
    # 4 live tokens after the tombstone are less than W: the usable prefix ends at A.
    m = cache.match_prefix(K[:10])
    assert (m.prefix_len, m.kv_hit_length, m.swa_miss_tokens, m.last_device_node) == (4, 10, 6, a)
    s3 = cache.inc_lock_ref(a)
    assert s3.part("swa") == 0 and a.swa_lock == 1 and swa_sizes(cache) == (4, 4)
    cache.dec_lock_ref(s3)
    cache.sanity_check()


def test_dec_lock_ref_refuses_anything_but_the_lock_inc_lock_ref_returned() -> None:
    cache, kv, a, b, c, d = four_nodes(4)
    start = cache.inc_lock_ref(d)
    assert start.part("swa") == 6
    before = (cache.pretty_print(), kv.snapshot(), swa_sizes(cache), cache.protected_size())
    # The node instead of its lock (the window start would be lost), another node, junk.
    for bad, err in ((d, ValueError), (c, ValueError), (None, TypeError), (6, TypeError),
                     ("6", TypeError), (6.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="lock"):
            cache.dec_lock_ref(bad)  # type: ignore[arg-type]
        assert (cache.pretty_print(), kv.snapshot(), swa_sizes(cache), cache.protected_size()) == before
        cache.sanity_check()
    cache.dec_lock_ref(start)
    assert swa_sizes(cache) == (10, 0)
    cache.sanity_check()


def test_dec_lock_ref_refuses_a_lock_released_already() -> None:
    cache, kv, a, b, c, d = four_nodes(4)
    start = cache.inc_lock_ref(d)
    other = cache.inc_lock_ref(d)  # a second request on D: C and D locked twice
    assert start.part("swa") == other.part("swa") == 6
    cache.dec_lock_ref(start)
    before = (cache.pretty_print(), kv.snapshot(), swa_sizes(cache))
    # A second release of the same lock would release C's window for the other request.
    with pytest.raises(ValueError, match="released already"):
        cache.dec_lock_ref(start)
    assert (cache.pretty_print(), kv.snapshot(), swa_sizes(cache)) == before
    cache.dec_lock_ref(other)
    assert swa_sizes(cache) == (10, 0)
    assert cache.evict(100) == EvictResult(10, 0, 10)
    cache.sanity_check()
