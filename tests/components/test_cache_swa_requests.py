"""SWA caches driven through the request helpers (``release_swa``, ``cache_unfinished_req``,
``cache_finished_req``), and the full + SWA + state configuration in one cache.

Slot ids follow the FIFO free-list order of each SWAAllocator side (see
test_cache_swa_scenarios.py); paged free lists hold page ids (page ``k`` = slots
``k*P .. k*P+P-1``). State slots: ``MambaStatePool(n)`` hands out ``1..n`` ascending.
"""

from __future__ import annotations

import pytest
import torch

from allocators import MambaStatePool, SWAAllocator
from radix import CacheConfig, CacheRequest, EvictResult, RadixCache
from tests.helpers.cache_helpers import node_slots, tiny_state_pool
from tests.helpers.swa_helpers import Checked, ids, t64

K = list(range(101, 117))  # 16 tokens




def span(node) -> tuple[int, int]:
    return node.start, node.depth


def make(window: int, full: int = 32, swa: int = 16, page_size: int = 1, states: int = 0):
    kv = SWAAllocator(full, swa, page_size)
    pool = (
        MambaStatePool(states, num_layers=1, conv_state_shape=(2,), ssm_state_shape=(2,))
        if states
        else None
    )
    cache = RadixCache(
        CacheConfig(page_size=page_size, sliding_window_size=window),
        kv_allocator=kv,
        state_allocator=pool,
    )
    cache.sanity_check()
    return Checked(cache), kv, pool


def swa_sizes(cache: RadixCache) -> tuple[int, int]:
    return cache.swa_evictable_size(), cache.swa_protected_size()


# ====================================================================== release_swa margin
def test_release_swa_keeps_a_whole_page_when_the_page_is_larger_than_the_window() -> None:
    cache, kv, _ = make(2, full=32, swa=32, page_size=4)  # W = 2 < page 4
    req = CacheRequest(key=K[:12], kv_indices=kv.alloc(12), cached_len=0, last_node=cache.root)
    assert ids(req.kv_indices) == list(range(4, 16))  # pages 1, 2, 3
    # 10 tokens computed; the margin is max(W, page) = 4: release [0, 4), keep [4, 10).
    # (A margin of W would release [0, 8) and leave nothing live to cache below 8.)
    assert cache.release_swa(req, 10) == 4
    assert req.swa_evicted_seqlen == 4
    assert ids(kv.translate(req.kv_indices)) == [0, 0, 0, 0] + list(range(8, 16))
    assert kv.snapshot().swa.free_ids() == [4, 5, 6, 7, 8, 1]
    assert cache.release_swa(req, 10) == 0  # idempotent
    res = cache.cache_finished_req(req, upto=10)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len) == (0, 8)
    leaf = res.last_node
    tomb = leaf.parent
    assert (span(tomb), tomb.swa_tombstone, ids(node_slots(tomb))) == ((0, 4), True, [4, 5, 6, 7])
    assert (span(leaf), leaf.swa_tombstone, ids(node_slots(leaf))) == ((4, 8), False, [8, 9, 10, 11])
    # Page 3 (slots 12..15: the partial tail and the unused rest) went back, both sides.
    assert kv.snapshot().free_ids()[-1:] == [3] and kv.snapshot().swa.free_ids()[-1:] == [3]
    assert swa_sizes(cache) == (4, 0) and cache.total_size() == 8
    m = cache.match_prefix(K[:8])
    assert (m.prefix_len, m.swa_miss_tokens) == (8, 0)  # 4 live tokens >= W before the end
    assert (req.last_node, req.lock, req.cached_len) == (cache.root, None, 0)
    cache.sanity_check()


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_the_leaf_cache_finished_req_inserts_is_never_a_tombstone(page_size: int, window: int) -> None:
    margin = max(window, page_size)
    for seq in range(1, 16):
        cache, kv, _ = make(window, full=16, swa=16, page_size=page_size)
        n = -(-seq // page_size) * page_size
        req = CacheRequest(key=K[:n], kv_indices=kv.alloc(n), cached_len=0, last_node=cache.root)
        released = cache.release_swa(req, seq)
        # the margin counts back from the whole pages the insert caches (seq's, aligned down)
        want = max(seq // page_size * page_size - margin, 0) // page_size * page_size
        assert released == want, (seq, window, page_size)
        res = cache.cache_finished_req(req, upto=seq)
        cache.sanity_check()
        end = seq // page_size * page_size
        assert res.inserted_len == end
        if end:
            assert not res.last_node.swa_tombstone and res.last_node.depth == end
            assert res.last_node.start == released  # one tombstone [0, released) above it
        assert swa_sizes(cache) == (end - released, 0)
        assert kv.swa_available_size() + cache.swa_evictable_size() == 16
        assert kv.full_available_size() + cache.evictable_size() == 16


# ====================================================================== chunked prefill
def test_chunked_prefill_moves_the_window_lock_and_keeps_its_start_in_the_request() -> None:
    cache, kv, _ = make(4)  # W = 4, page 1
    req = CacheRequest(key=K[:12], kv_indices=kv.alloc(6), cached_len=0, last_node=cache.root)
    assert ids(req.kv_indices) == [1, 2, 3, 4, 5, 6]
    assert cache.release_swa(req, 6) == 2  # [0, 2) slid out already
    res = cache.cache_unfinished_req(req)
    cache.sanity_check()
    n2 = res.last_node
    n1 = n2.parent
    assert (span(n1), n1.swa_tombstone, span(n2), n2.swa_tombstone) == ((0, 2), True, (2, 6), False)
    assert (req.cached_len, req.last_node, req.lock.part("swa")) == (6, n2, 2)
    assert ids(req.kv_indices) == [1, 2, 3, 4, 5, 6]
    assert (n1.kv_lock, n2.kv_lock, n1.swa_lock, n2.swa_lock) == (1, 1, 0, 1)
    assert swa_sizes(cache) == (0, 4)

    # Chunk 2: tokens [6, 12); boundary 12 keeps [8, 12) live, releases its own [6, 8).
    req.kv_indices = torch.cat([req.kv_indices, kv.alloc(6)])
    assert ids(req.kv_indices[6:]) == [7, 8, 9, 10, 11, 12]
    assert cache.release_swa(req, 12) == 2  # starts at cached_len: [2, 6) is the tree's
    assert req.swa_evicted_seqlen == 8
    assert ids(kv.translate(req.kv_indices)) == [0, 0, 3, 4, 5, 6, 0, 0, 9, 10, 11, 12]
    res = cache.cache_unfinished_req(req)
    cache.sanity_check()
    n4 = res.last_node
    n3 = n4.parent
    assert (span(n3), n3.swa_tombstone, span(n4), n4.swa_tombstone) == ((6, 8), True, (8, 12), False)
    assert n3.parent is n2
    assert (req.cached_len, req.last_node, req.lock.part("swa")) == (12, n4, 8)
    assert [n.swa_lock for n in (n1, n2, n3, n4)] == [0, 0, 0, 1]  # the lock moved down
    assert [n.kv_lock for n in (n1, n2, n3, n4)] == [1, 1, 1, 1]
    assert swa_sizes(cache) == (4, 4)

    # N2 is above the request's window now: SWA eviction tombstones it while the request runs.
    assert cache.evict_swa(1) == EvictResult(0, 0, 4)
    cache.sanity_check()
    assert n2.swa_tombstone and swa_sizes(cache) == (0, 4)
    m = cache.match_prefix(K[:12])
    assert (m.prefix_len, ids(m.device_indices)) == (12, list(range(1, 13)))

    res = cache.cache_finished_req(req)
    cache.sanity_check()
    assert (res.prefix_len, res.inserted_len, ids(res.duplicate_indices)) == (12, 12, [])
    assert (req.last_node, req.lock, req.cached_len) == (cache.root, None, 0)
    assert swa_sizes(cache) == (4, 0) and cache.protected_size() == 0
    # The live leaf goes, and every tombstone above it is left dead.
    assert cache.evict(1) == EvictResult(12, 0, 4)
    assert cache.stats()["num_nodes"] == 0
    assert (kv.full_available_size(), kv.swa_available_size()) == (32, 16)
    cache.sanity_check()


def test_request_helpers_refuse_a_missing_lock() -> None:
    cache, kv, _ = make(4)
    req = CacheRequest(key=K[:4], kv_indices=kv.alloc(4), cached_len=0, last_node=cache.root)
    cache.cache_unfinished_req(req)
    lock = req.lock
    assert lock is not None and lock.part("swa") == 0
    req.lock = None  # the engine lost it
    before = (cache.pretty_print(), kv.snapshot(), swa_sizes(cache))
    for call in (cache.cache_unfinished_req, cache.cache_finished_req):
        with pytest.raises(ValueError, match="lock"):
            call(req)
        assert (cache.pretty_print(), kv.snapshot(), swa_sizes(cache)) == before
    req.lock = lock
    cache.cache_finished_req(req)
    assert swa_sizes(cache) == (4, 0)
    cache.sanity_check()


# ====================================================================== full + SWA + state
def test_usable_prefix_needs_both_a_state_and_a_live_window() -> None:
    cache, kv, pool = make(4, states=4)  # W = 4
    a = cache.insert(K[:4], kv.alloc(4), state_slot=int(pool.alloc(1)[0])).last_node
    assert (span(a), a.state_slot) == ((0, 4), 1)
    own = kv.alloc(6)
    assert ids(own) == [5, 6, 7, 8, 9, 10]
    kv.free_swa(t64(5, 6))  # its tokens [4, 6) slid out of its window
    res = cache.insert(K[:10], torch.cat([node_slots(a), own]), state_slot=int(pool.alloc(1)[0]))
    cache.sanity_check()
    c = res.last_node
    b = c.parent
    assert (span(b), b.swa_tombstone, b.state_slot) == ((4, 6), True, None)
    assert (span(c), c.swa_tombstone, c.state_slot, res.state_adopted) == ((6, 10), False, 2, True)
    res = cache.insert(K[:12], torch.cat([t64(*range(1, 11)), kv.alloc(2)]),
                       state_slot=int(pool.alloc(1)[0]))
    d = res.last_node
    assert (span(d), d.state_slot, ids(node_slots(d))) == ((10, 12), 3, [11, 12])
    cache.sanity_check()

    m = cache.match_prefix(K[:12])
    assert (m.prefix_len, m.state_slot, m.swa_miss_tokens, m.branching_seqlen) == (12, 3, 0, None)
    # Ends inside C: no state there, and only 2 live tokens: back to A (the state rule alone
    # already cuts to A, so the SWA rule cuts nothing more).
    m = cache.match_prefix(K[:8] + [99])
    cache.sanity_check()
    c1 = c.parent
    assert span(c1) == (6, 8) and c1.state_slot is None
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.branching_seqlen) == (4, 8, 1, 8)
    assert m.swa_miss_tokens == 0 and m.state_miss_tokens == 4
    # A state at 8 (the tree adopts it on C1) but still only 2 live tokens: the SWA rule cuts.
    res = cache.insert(K[:8], t64(*range(1, 9)), state_slot=int(pool.alloc(1)[0]))
    assert (res.state_adopted, c1.state_slot, res.prefix_len) == (True, 4, 8)
    m = cache.match_prefix(K[:8] + [99])
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.swa_miss_tokens) == (4, 8, 1, 4)
    assert ids(m.device_indices) == [1, 2, 3, 4]
    # Inside D: 5 live tokens (window fine) but no state at 11: back to C's state at 10.
    m = cache.match_prefix(K[:11] + [99])
    cache.sanity_check()
    assert (m.prefix_len, m.kv_hit_length, m.state_slot, m.swa_miss_tokens) == (10, 11, 2, 0)
    assert ids(m.device_indices) == list(range(1, 11))
    assert (cache.state_evictable_size(), cache.state_protected_size()) == (4, 0)
    assert swa_sizes(cache) == (10, 0) and cache.total_size() == 12
    cache.sanity_check()


def test_state_and_swa_eviction_in_one_cache() -> None:
    cache, kv, pool = make(2, full=16, swa=16, states=4)  # W = 2
    assert ids(pool.alloc(2)) == [1, 2]  # the caller's states, given to the tree below
    a = cache.insert(K[:4], kv.alloc(4), state_slot=1).last_node  # t=1, id 1
    b = cache.insert(K[:6], torch.cat([node_slots(a), kv.alloc(2)]), state_slot=2).last_node  # t=2
    cache.sanity_check()
    assert (a.state_slot, b.state_slot) == (1, 2)
    # evict_states: the LRU state is A's (internal): only the state goes, KV and SWA stay.
    cache.match_prefix(K[:6])  # B's state used at t=3; A's state still has its t=1 stamp
    assert cache.evict_states(1) == EvictResult(0, 1, 0)
    assert a.state_slot is None and not a.swa_tombstone and pool.snapshot().free_ids()[-1] == 1
    cache.sanity_check()
    # evict_swa: A (t=3, id 1) before B (t=3, id 2); A is internal: a tombstone (no state
    # left on it either way). B keeps its KV, SWA KV and state.
    assert cache.evict_swa(1) == EvictResult(0, 0, 4)
    m = cache.match_prefix(K[:6])
    assert (m.prefix_len, m.state_slot) == (6, 2)  # B's 2 live tokens fill W = 2
    # B (a leaf with a state) leaves whole: its KV, its SWA KV and its state; then A, a
    # stateless tombstone left childless, goes too.
    assert cache.evict_swa(1) == EvictResult(6, 1, 2)
    assert pool.snapshot().free_ids()[-1] == 2 and cache.stats()["num_nodes"] == 0
    assert (kv.full_available_size(), kv.swa_available_size(), pool.available_size()) == (16, 16, 4)
    cache.sanity_check()


def test_full_plus_state_cache_has_no_swa_side() -> None:
    from allocators import TokenAllocator

    kv = TokenAllocator(16)
    pool = tiny_state_pool(2)
    cache = Checked(RadixCache(kv_allocator=kv, state_allocator=pool))
    res = cache.insert(K[:4], kv.alloc(4), state_slot=int(pool.alloc(1)[0]))
    node = res.last_node
    assert cache.inc_lock_ref(node) is node  # without an SWA component the node is its lock
    assert swa_sizes(cache) == (0, 0)
    cache.dec_lock_ref(node)
    m = cache.match_prefix(K[:4])
    assert (m.prefix_len, m.swa_miss_tokens) == (4, 0)
    with pytest.raises(ValueError, match="sliding-window"):
        cache.evict_swa(1)
    req = CacheRequest(key=K[:4], kv_indices=m.device_indices, cached_len=4, last_node=cache.root)
    with pytest.raises(ValueError, match="sliding-window"):
        cache.release_swa(req, 4)
    cache.sanity_check()
