"""RadixCache (KV only): narrated scenarios with tiny pools, exact slot ids and exact eviction order.

Slot ids follow the allocator contract (allocators/README.md): ``TokenAllocator(n)`` hands out
``1..n`` ascending, ``free`` appends to the back, so the tail of ``snapshot().free_ids()`` says
exactly which slots an eviction gave back and in which order. ``PagedAllocator(n, 4)`` hands
out page ``k`` as slots ``4k .. 4k+3`` starting at page 1.
"""

from __future__ import annotations

import pytest
import torch

from allocators import PagedAllocator, TokenAllocator
from radix import CacheConfig, EvictResult, RadixCache
from tests.helpers.cache_helpers import node_slots


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def ids(x: torch.Tensor) -> list[int]:
    assert x.dtype == torch.int64 and x.dim() == 1
    return x.tolist()


def make(page_size: int = 1, size: int = 16, policy: str | None = None):
    kv = TokenAllocator(size) if page_size == 1 else PagedAllocator(size, page_size)
    cache = RadixCache(
        CacheConfig(page_size=page_size, radix_eviction_policy=policy), kv_allocator=kv
    )
    cache.sanity_check()
    return cache, kv


def freed_tail(kv, n: int) -> list[int]:
    """The last ``n`` ids appended to the free list (what was just given back, in order)."""
    return kv.snapshot().free_ids()[-n:]


def put(cache: RadixCache, kv, key: list[int], **kw):
    """Insert ``key`` with fresh slots; free what the result says is the caller's."""
    value = kv.alloc(len(key))
    assert value is not None
    res = cache.insert(key, value, **kw)
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()
    return res


# ====================================================================== insert / match
def test_insert_then_match_returns_exact_slots_and_splits_at_the_match_end() -> None:
    cache, kv = make(size=16)
    value = kv.alloc(5)
    assert ids(value) == [1, 2, 3, 4, 5]
    res = cache.insert([10, 11, 12, 13, 14], value)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (0, 5, False)
    assert ids(res.adopted_indices) == [1, 2, 3, 4, 5]
    assert ids(res.duplicate_indices) == [] and ids(res.remainder_indices) == []
    assert res.last_node.depth == 5
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (5, 0, 5)
    assert kv.available_size() == 11

    m = cache.match_prefix([10, 11, 12])
    cache.sanity_check()
    assert ids(m.device_indices) == [1, 2, 3]
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.branching_seqlen) == (3, 3, None, None)
    node = m.last_device_node
    assert node.depth == 3 and list(node.key) == [10, 11, 12]
    (child,) = node.children.values()
    assert list(child.key) == [13, 14] and ids(node_slots(child)) == [4, 5]
    assert cache.stats()["num_nodes"] == 2

    m = cache.match_prefix([10, 11, 12, 13, 14, 99])
    assert ids(m.device_indices) == [1, 2, 3, 4, 5] and m.prefix_len == 5
    assert m.last_device_node is child
    for miss in ([99, 10], [], [11, 12]):
        m = cache.match_prefix(miss)
        assert m.prefix_len == 0 and ids(m.device_indices) == []
        assert m.last_device_node is cache.root
    assert cache.stats()["num_nodes"] == 2
    cache.sanity_check()


def test_match_accepts_tensor_and_numpy_keys() -> None:
    import numpy as np

    cache, kv = make()
    put(cache, kv, [5, 6, 7])
    assert ids(cache.match_prefix(torch.tensor([5, 6, 9])).device_indices) == [1, 2]
    assert ids(cache.match_prefix(np.array([5, 6, 7], dtype=np.int32)).device_indices) == [1, 2, 3]
    assert ids(cache.match_prefix((5,)).device_indices) == [1]
    cache.sanity_check()


def test_insert_result_lists_only_the_callers_slots_that_differ_from_the_tree() -> None:
    cache, kv = make(size=16)
    put(cache, kv, [1, 2, 3, 4])  # tree: [1, 2, 3, 4] -> slots 1..4
    # Request B matched only [1, 2] (slots 1, 2 from the tree), computed tokens 3..6 itself.
    fresh = kv.alloc(4)
    assert ids(fresh) == [5, 6, 7, 8]
    value = torch.cat([t64(1, 2), fresh])
    res = cache.insert([1, 2, 3, 4, 5, 6], value)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (4, 6)
    assert ids(res.duplicate_indices) == [5, 6]  # its copies of tokens 3, 4
    assert ids(res.adopted_indices) == [7, 8]
    assert ids(res.remainder_indices) == []
    kv.free(res.duplicate_indices)
    assert kv.available_size() == 16 - 6
    assert ids(cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices) == [1, 2, 3, 4, 7, 8]

    # Fully cached again with all-fresh slots: every slot is a duplicate, nothing adopted.
    value = kv.alloc(3)
    res = cache.insert([1, 2, 3], value)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (3, 3)
    assert ids(res.duplicate_indices) == ids(value)
    assert ids(res.adopted_indices) == []
    assert res.last_node.depth == 3  # split at 3, at a node boundary now
    kv.free(res.duplicate_indices)
    assert kv.available_size() == 10
    cache.sanity_check()


def test_paged_insert_keeps_whole_pages_and_hands_back_the_partial_tail() -> None:
    cache, kv = make(page_size=4, size=32)  # pages 1..8, page k = slots 4k..4k+3
    slots = kv.alloc(12)
    assert ids(slots) == list(range(4, 16))
    key = list(range(100, 110))  # 10 tokens: two whole pages + 2
    res = cache.insert(key, slots[:10])
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (0, 8)
    assert ids(res.adopted_indices) == list(range(4, 12))
    assert ids(res.remainder_indices) == [12, 13]
    assert res.last_node.depth == 8
    kv.free(torch.cat([res.remainder_indices, slots[10:]]))  # page 3 back, whole
    assert kv.available_size() == 24
    m = cache.match_prefix(key)
    assert m.prefix_len == 8 and ids(m.device_indices) == list(range(4, 12))
    cache.sanity_check()


def test_page_alignment_short_and_empty_keys_touch_nothing() -> None:
    cache, kv = make(page_size=4, size=32)
    v = kv.alloc(8)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], v)
    cache.sanity_check()
    before = cache.pretty_print()
    ev = cache.evictable_size()
    assert ev == 8
    for key in ([1, 2, 3], []):
        m = cache.match_prefix(key)
        cache.sanity_check()
        assert m.prefix_len == 0 and m.kv_hit_length == 0 and ids(m.device_indices) == []
        assert m.last_device_node is cache.root
        assert cache.pretty_print() == before  # no split, no stamp
        cache.inc_lock_ref(m.last_device_node)
        assert (cache.evictable_size(), cache.protected_size()) == (ev, 0)
        cache.dec_lock_ref(m.last_device_node)
        assert (cache.evictable_size(), cache.protected_size()) == (ev, 0)
        assert cache.evict(0) == EvictResult(0, 0)
        assert cache.evictable_size() == ev
        cache.sanity_check()
    # Inserting a key shorter than a page caches nothing: the whole value is the remainder.
    snap = kv.snapshot()
    res = cache.insert([1, 2, 3], t64(20, 21, 22))
    assert (res.prefix_len, res.inserted_len, res.last_node) == (0, 0, cache.root)
    assert ids(res.remainder_indices) == [20, 21, 22] and ids(res.adopted_indices) == []
    assert ids(res.duplicate_indices) == []
    res = cache.insert([], torch.empty(0, dtype=torch.int64))
    assert (res.prefix_len, res.inserted_len, res.last_node) == (0, 0, cache.root)
    assert kv.snapshot() == snap and cache.evictable_size() == ev
    assert cache.stats()["num_nodes"] == 1
    cache.sanity_check()


@pytest.mark.parametrize(
    ("page_size", "query", "hit"),
    [
        (4, [1, 2, 3, 4, 5, 6, 99, 99], 4),  # diverges at 6 -> page floor 4
        (4, [1, 2, 3, 4, 5, 6, 7], 4),  # 7 tokens: only one whole page to match
        (4, [1, 2, 99, 4, 5, 6, 7, 8], 0),  # diverges in the first page: no split at 0
        (2, [1, 2, 3, 9, 5, 6, 7, 8], 2),  # diverges at 3 -> 2
        (1, [1, 2, 3, 9], 3),  # token level: exactly at 3
        (1, [9, 2, 3], 0),
    ],
)
def test_splits_only_at_page_multiples_never_at_zero(page_size: int, query: list[int], hit: int) -> None:
    cache, kv = make(page_size=page_size, size=32)
    slots = kv.alloc(8)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], slots)
    cache.sanity_check()
    m = cache.match_prefix(query)
    cache.sanity_check()
    assert m.kv_hit_length == hit and m.prefix_len == hit
    assert ids(m.device_indices) == ids(slots[:hit])
    nodes = cache.stats()["num_nodes"]
    if hit == 0:
        assert nodes == 1 and m.last_device_node is cache.root
    else:
        assert nodes == 2
        upper = m.last_device_node
        assert upper.depth == hit and hit % page_size == 0
        (lower,) = upper.children.values()
        assert lower.depth == 8 and ids(node_slots(lower)) == ids(slots[hit:])


def test_extra_key_namespaces_share_nothing() -> None:
    cache, kv = make(size=16)
    a = put(cache, kv, [1, 2, 3])
    b = put(cache, kv, [1, 2, 3], extra_key="lora-A")
    assert a.prefix_len == 0 and b.prefix_len == 0
    assert ids(b.adopted_indices) == [4, 5, 6] and ids(b.duplicate_indices) == []
    assert ids(cache.match_prefix([1, 2, 3]).device_indices) == [1, 2, 3]
    assert ids(cache.match_prefix([1, 2, 3], extra_key="lora-A").device_indices) == [4, 5, 6]
    assert cache.match_prefix([1, 2, 3], extra_key="lora-B").prefix_len == 0
    c = put(cache, kv, [1, 2, 3, 4], extra_key="lora-A")
    assert c.prefix_len == 3 and ids(c.adopted_indices) == [10]
    assert ids(c.duplicate_indices) == [7, 8, 9]
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 3
    assert cache.stats()["num_nodes"] == 3
    # Evicting one namespace leaves the other whole. The match just above stamped the
    # unnamespaced [1, 2, 3] last, so lora-A's leaf [4] goes first, then lora-A's [1, 2, 3].
    assert cache.evict(1) == EvictResult(1, 0)
    assert freed_tail(kv, 1) == [10]
    assert cache.evict(1) == EvictResult(3, 0)
    assert freed_tail(kv, 3) == [4, 5, 6]
    assert cache.match_prefix([1, 2, 3], extra_key="lora-A").prefix_len == 0
    assert ids(cache.match_prefix([1, 2, 3, 4]).device_indices) == [1, 2, 3]
    cache.sanity_check()


# ====================================================================== locks
def _fork(cache: RadixCache, kv) -> None:
    """[1, 2, 3] -> {[4, 5] slots 4, 5 ; [6, 7] slots 6, 7}."""
    put(cache, kv, [1, 2, 3, 4, 5])
    value = torch.cat([t64(1, 2, 3), kv.alloc(2)])
    res = cache.insert([1, 2, 3, 6, 7], value)
    assert ids(res.adopted_indices) == [6, 7] and ids(res.duplicate_indices) == []
    cache.sanity_check()


def test_lock_protects_path_and_sizes_are_exact() -> None:
    cache, kv = make(size=16)
    _fork(cache, kv)
    assert (cache.evictable_size(), cache.protected_size()) == (7, 0)
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).last_device_node
    cache.inc_lock_ref(leaf)
    cache.sanity_check()
    assert (cache.evictable_size(), cache.protected_size()) == (2, 5)
    cache.inc_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (2, 5)
    assert cache.evict(100) == EvictResult(2, 0)  # only [6, 7]; the locked path stays
    assert freed_tail(kv, 2) == [6, 7]
    cache.sanity_check()
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)
    assert cache.evict(100) == EvictResult(0, 0)
    cache.dec_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)
    cache.dec_lock_ref(leaf)
    cache.sanity_check()
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.evict(1) == EvictResult(2, 0)  # the leaf [4, 5]; [1, 2, 3] stays (2 >= 1)
    assert freed_tail(kv, 2) == [4, 5]
    assert (cache.evictable_size(), cache.total_size()) == (3, 3)
    cache.sanity_check()


def test_unlocking_an_unlocked_node_raises_and_changes_nothing() -> None:
    cache, kv = make(size=16)
    _fork(cache, kv)
    leaf = cache.match_prefix([1, 2, 3, 4, 5]).last_device_node
    before = (cache.pretty_print(), kv.snapshot(), cache.evictable_size())
    with pytest.raises(ValueError, match="lock"):
        cache.dec_lock_ref(leaf)
    assert (cache.pretty_print(), kv.snapshot(), cache.evictable_size()) == before
    cache.inc_lock_ref(leaf)
    cache.dec_lock_ref(leaf)
    with pytest.raises(ValueError, match="lock"):
        cache.dec_lock_ref(leaf)
    cache.sanity_check()


def test_unlocking_an_ancestor_that_was_never_locked_raises() -> None:
    cache, kv = make(size=16)
    put(cache, kv, [1, 2, 3, 4])
    upper = cache.match_prefix([1, 2]).last_device_node  # split: [1, 2] -> [3, 4]
    leaf = cache.match_prefix([1, 2, 3, 4]).last_device_node
    cache.inc_lock_ref(leaf)
    before = (cache.pretty_print(), kv.snapshot(), cache.protected_size())
    try:
        with pytest.raises(ValueError):
            cache.dec_lock_ref(upper)
    finally:
        cache.sanity_check()  # today: "parent less locked than child"
    assert (cache.pretty_print(), kv.snapshot(), cache.protected_size()) == before


# ====================================================================== eviction order
def test_evict_is_lru_by_logical_clock() -> None:
    cache, kv = make(size=16)
    put(cache, kv, [1, 1])  # slots 1, 2
    put(cache, kv, [2, 2])  # slots 3, 4
    put(cache, kv, [3, 3])  # slots 5, 6
    cache.match_prefix([1, 1, 9])  # A is now the most recent
    for expect in ([3, 4], [5, 6], [1, 2]):
        assert cache.evict(1) == EvictResult(2, 0)
        assert freed_tail(kv, 2) == expect
        cache.sanity_check()
    assert cache.evict(1) == EvictResult(0, 0)
    assert kv.available_size() == 16
    st = cache.stats()
    assert st["evicted_tokens"] == 6 and st["evicted_states"] == 0


def test_insert_of_a_cached_key_refreshes_it() -> None:
    cache, kv = make(size=16)
    put(cache, kv, [1, 1])
    put(cache, kv, [2, 2])
    put(cache, kv, [1, 1])  # duplicate insert: stamps [1, 1]
    assert cache.evict(1) == EvictResult(2, 0)
    assert freed_tail(kv, 2) == [3, 4]
    cache.sanity_check()


def test_evict_cascades_to_a_parent_that_becomes_a_leaf_in_the_same_call() -> None:
    cache, kv = make(size=16)
    put(cache, kv, [1, 2, 3])  # slots 1, 2, 3
    value = torch.cat([t64(1, 2), kv.alloc(1)])  # slot 4 for token 4
    cache.insert([1, 2, 4], value)
    cache.sanity_check()  # [1, 2] -> {[3], [4]}
    assert cache.evict(3) == EvictResult(4, 0)  # [3], [4], then their parent [1, 2]: overshoot
    assert freed_tail(kv, 4) == [3, 4, 1, 2]
    assert cache.total_size() == 0 and cache.stats()["num_nodes"] == 0
    cache.sanity_check()


def test_cascade_stops_at_a_locked_sibling() -> None:
    cache, kv = make(size=16)
    put(cache, kv, [1, 2, 3])
    cache.insert([1, 2, 4], torch.cat([t64(1, 2), kv.alloc(1)]))
    right = cache.match_prefix([1, 2, 4]).last_device_node
    cache.inc_lock_ref(right)
    assert cache.evict(10) == EvictResult(1, 0)
    assert freed_tail(kv, 1) == [3]
    assert (cache.evictable_size(), cache.protected_size()) == (0, 3)
    cache.dec_lock_ref(right)
    assert cache.evict(10) == EvictResult(3, 0)
    assert freed_tail(kv, 3) == [4, 1, 2]
    cache.sanity_check()


# ====================================================================== reset
def test_reset_frees_everything_and_forgets_nodes() -> None:
    cache, kv = make(size=16)
    _fork(cache, kv)
    node = cache.match_prefix([1, 2, 3, 4, 5]).last_device_node
    cache.inc_lock_ref(node)
    before = (cache.pretty_print(), kv.snapshot())
    with pytest.raises(ValueError, match="lock"):
        cache.reset()
    assert (cache.pretty_print(), kv.snapshot()) == before
    cache.dec_lock_ref(node)
    cache.reset()
    cache.sanity_check()
    assert kv.available_size() == 16 and cache.total_size() == 0
    assert cache.stats()["num_nodes"] == 0
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    with pytest.raises(ValueError, match="node"):
        cache.inc_lock_ref(node)
    # The cache works as new afterwards.
    res = put(cache, kv, [7, 8])
    assert res.prefix_len == 0 and ids(cache.match_prefix([7, 8]).device_indices) == ids(res.adopted_indices)
