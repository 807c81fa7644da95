"""Narrated host-tier scenarios, part 2: load_back, inserts through host-only nodes, what
match reports, hybrid host-only leaves, reset, the host pools; exact slot ids and sizes.

Device slots come from ``TokenAllocator(16)`` (ids 1..16, FIFO reuse), host slots from its
mirror (``hicache_ratio`` 2: ids 1..32). ``load_back_threshold`` is 1 unless a test is about
the threshold.
"""

from __future__ import annotations

import pytest
import torch

from radix import CacheRequest
from tests.helpers.cache_helpers import free_slots, node_slots
from tests.hicache.test_hicache_common import (
    assert_same,
    check_accounting,
    dump,
    held,
    ids,
    make,
    node_at,
    put,
    t64,
)


# ======================================================================== load_back
def test_load_back_is_skipped_below_the_threshold() -> None:
    h = make(threshold=10)  # SGLang's default
    c = h.cache
    assert h.hc.config.load_back_threshold == 10
    put(h, list(range(1, 9)))  # A: 8 tokens
    c.evict(8)
    put(h, list(range(20, 26)))  # 6 tokens
    put(h, list(range(20, 30)), prefix=t64(9, 10, 11, 12, 13, 14))  # + 4: chain of 6 + 4
    c.evict(100)
    a = node_at(c, list(range(1, 9)))
    b = node_at(c, list(range(20, 30)))
    m = c.match_prefix(list(range(1, 9)))
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 8, a)
    before = dump(h)
    assert c.load_back(a) == 0  # 8 < 10: recomputing is cheaper
    assert_same(before, dump(h))
    m = c.match_prefix(list(range(20, 30)))
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 10, b)
    assert c.load_back(b) == 10  # two nodes of 6 + 4: the chain counts, not each node
    assert c.match_prefix(list(range(20, 30))).prefix_len == 10
    assert c.stats()["load_back_tokens"] == 10
    c.sanity_check()


def test_load_back_counts_only_the_host_part_of_the_chain() -> None:
    h = make(threshold=5)
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])
    put(h, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], prefix=t64(1, 2, 3, 4, 5, 6))
    p, q = node_at(c, [1, 2, 3, 4, 5, 6]), node_at(c, list(range(1, 11)))
    c.inc_lock_ref(p)
    c.evict(4)
    c.dec_lock_ref(p)
    assert p.kv_value is not None and q.kv_value is None
    m = c.match_prefix(list(range(1, 11)))
    assert (m.prefix_len, m.host_hit_length) == (6, 4)
    assert c.load_back(q) == 0  # 4 host tokens < 5, though the match is 10 long
    assert c.load_back(p) == 0 and c.load_back(c.root) == 0  # on device / root: nothing
    c.sanity_check()


def test_load_back_evicts_on_device_to_make_room() -> None:
    h = make(size=8)
    c = h.cache
    put(h, [1, 2, 3, 4])  # X: device 1..4
    x = node_at(c, [1, 2, 3, 4])
    c.evict(4)  # X host-only; device free list 5..8, 1..4
    put(h, list(range(10, 18)))  # Y takes all 8: 5, 6, 7, 8, 1, 2, 3, 4
    y = node_at(c, list(range(10, 18)))
    assert ids(node_slots(y)) == [5, 6, 7, 8, 1, 2, 3, 4] and h.kv.available_size() == 0
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.prefix_len, m.host_hit_length) == (0, 4)
    assert c.load_back(x) == 4
    assert y.kv_value is None and ids(y.host_value) == [5, 6, 7, 8, 9, 10, 11, 12]
    assert ids(node_slots(x)) == [5, 6, 7, 8] and free_slots(h.kv) == [1, 2, 3, 4]
    st = c.stats()
    assert (st["evicted_tokens"], st["demoted_tokens"], st["load_back_tokens"]) == (12, 12, 4)
    c.sanity_check()
    check_accounting(h)


def test_load_back_never_evicts_the_device_node_it_hangs_below() -> None:
    h = make(size=8)
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])  # device 1..6
    put(h, [1, 2, 9], prefix=t64(1, 2))  # U [1,2], X [3..6], Z [9] (slot 7)
    u, x, z = node_at(c, [1, 2]), node_at(c, [1, 2, 3, 4, 5, 6]), node_at(c, [1, 2, 9])
    c.inc_lock_ref(z)
    assert c.evict(1).num_tokens == 4 and x.kv_value is None  # X: the only candidate
    c.dec_lock_ref(z)
    assert c.evict(1).num_tokens == 1 and z.kv_value is None  # then Z; U is a device leaf
    assert free_slots(h.kv) == [8, 3, 4, 5, 6, 7]
    put(h, list(range(30, 36)))  # W: the six free slots; device full, W newer than U
    w = node_at(c, list(range(30, 36)))
    assert ids(node_slots(w)) == [8, 3, 4, 5, 6, 7]
    assert [n.id for n in c.kv.leaves] == [u.id, w.id]  # U would go first...
    assert c.load_back(x) == 4  # ...but it anchors the chain: W is evicted instead
    assert ids(node_slots(u)) == [1, 2] and w.kv_value is None
    assert ids(node_slots(x)) == [8, 3, 4, 5] and free_slots(h.kv) == [6, 7]
    assert u.kv_lock == 0 and c.protected_size() == 0
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.prefix_len, m.host_hit_length) == (6, 0)
    c.sanity_check()
    check_accounting(h)


def test_load_back_fails_cleanly_when_everything_on_device_is_locked() -> None:
    h = make(size=8)
    c = h.cache
    put(h, [1, 2, 3, 4])
    x = node_at(c, [1, 2, 3, 4])
    c.evict(4)
    put(h, list(range(10, 18)))
    y = node_at(c, list(range(10, 18)))
    c.inc_lock_ref(y)
    before = dump(h)
    assert c.load_back(x) == 0
    assert_same(before, dump(h))
    c.dec_lock_ref(y)
    assert c.load_back(x) == 4
    c.sanity_check()


# ======================================================================== insert through host
def test_insert_through_a_host_only_node_adopts_the_callers_slots_and_keeps_the_host_copy() -> None:
    h = make()
    c = h.cache
    put(h, [1, 2, 3, 4])  # device 1..4, host 1..4
    x = node_at(c, [1, 2, 3, 4])
    c.evict(4)
    assert x.kv_value is None and ids(x.host_value) == [1, 2, 3, 4]
    fresh = h.kv.alloc(6)
    assert ids(fresh) == [5, 6, 7, 8, 9, 10]
    res = c.insert([1, 2, 3, 4, 5, 6], fresh)
    assert (res.prefix_len, res.inserted_len) == (4, 6)
    assert ids(res.revived_indices) == [5, 6, 7, 8]  # X took the caller's slots
    assert ids(res.adopted_indices) == [9, 10] and ids(res.duplicate_indices) == []
    assert ids(res.remainder_indices) == []
    assert ids(node_slots(x)) == [5, 6, 7, 8] and ids(x.host_value) == [1, 2, 3, 4]
    leaf = res.last_node
    assert leaf.parent is x and ids(leaf.host_value) == [5, 6]  # write_through: new leaf
    assert c.host_size() == 6 and c.total_size() == 6 and h.kv.available_size() == 10
    assert c.stats()["load_back_tokens"] == 0
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.prefix_len, m.host_hit_length) == (6, 0)
    assert ids(m.device_indices) == [5, 6, 7, 8, 9, 10]
    c.sanity_check()
    check_accounting(h)


def test_insert_ending_inside_a_host_only_node_revives_the_upper_part_only() -> None:
    h = make()
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])
    x = node_at(c, [1, 2, 3, 4, 5, 6])
    c.evict(6)
    fresh = h.kv.alloc(3)
    res = c.insert([1, 2, 3], fresh)
    u = res.last_node
    assert x.parent is u and u.parent is c.root
    assert (res.prefix_len, res.inserted_len, ids(res.revived_indices)) == (3, 3, ids(fresh))
    assert ids(node_slots(u)) == ids(fresh) and ids(u.host_value) == [1, 2, 3]
    assert x.kv_value is None and ids(x.host_value) == [4, 5, 6]
    c.sanity_check()
    check_accounting(h)


@pytest.mark.parametrize("helper", ["cache_finished_req", "cache_unfinished_req"])
def test_request_helpers_keep_the_slots_an_insert_revived(helper: str) -> None:
    """A request that recomputed a host-only prefix (its chain was below the threshold) and
    is cached through the request helpers: the tree keeps the request's slots there, they are
    not freed as duplicates. (A library bug until 05d37df.)"""
    h = make(size=16, threshold=10)
    c = h.cache
    put(h, [1, 2, 3, 4])
    c.evict(4)  # X host-only
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.prefix_len, m.host_hit_length) == (0, 4)
    assert c.load_back(m.last_host_node) == 0  # below the threshold: the engine recomputes
    slots = h.kv.alloc(6)
    assert ids(slots) == [5, 6, 7, 8, 9, 10]
    req = CacheRequest(key=[1, 2, 3, 4, 5, 6], kv_indices=slots, cached_len=0, last_node=c.root)
    res = getattr(c, helper)(req)
    assert ids(res.revived_indices) == [5, 6, 7, 8] and ids(res.adopted_indices) == [9, 10]
    x = node_at(c, [1, 2, 3, 4])
    assert ids(node_slots(x)) == [5, 6, 7, 8] and ids(x.host_value) == [1, 2, 3, 4]
    assert not bool(h.kv.is_free(torch.tensor([5, 6, 7, 8, 9, 10])).any())
    if helper == "cache_unfinished_req":
        assert ids(req.kv_indices) == [5, 6, 7, 8, 9, 10] and req.cached_len == 6
        c.dec_lock_ref(req.last_node)
    assert h.kv.available_size() == 10
    c.sanity_check()
    check_accounting(h)


# ======================================================================== match
def test_match_reports_the_host_part_of_the_path_exactly() -> None:
    h = make(size=16)
    c = h.cache
    put(h, [1, 2, 3, 4])
    put(h, list(range(1, 9)), prefix=t64(1, 2, 3, 4))
    put(h, list(range(1, 13)), prefix=t64(*range(1, 9)))
    a, b, d = node_at(c, [1, 2, 3, 4]), node_at(c, list(range(1, 9))), node_at(c, list(range(1, 13)))
    c.inc_lock_ref(a)
    c.evict(8)
    c.dec_lock_ref(a)
    assert (a.kv_value is not None, b.kv_value, d.kv_value) == (True, None, None)
    host_hits = c.stats()["host_hit_tokens"]

    m = c.match_prefix(list(range(1, 13)) + [99])
    assert (m.prefix_len, m.kv_hit_length, m.host_hit_length) == (4, 12, 8)
    assert m.last_device_node is a and m.last_host_node is d
    assert ids(m.device_indices) == [1, 2, 3, 4]
    m = c.match_prefix([1, 2, 3, 4, 5, 6])  # ends inside B: B splits at 6
    b_up = node_at(c, [1, 2, 3, 4, 5, 6])
    assert b_up.parent is a and b.parent is b_up and b_up.kv_value is None
    assert ids(b_up.host_value) == [5, 6] and ids(b.host_value) == [7, 8]
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (4, 2, b_up)
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (4, 0, a)
    m = c.match_prefix([50, 51])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 0, c.root)
    assert c.stats()["host_hit_tokens"] == host_hits + 8 + 2
    c.sanity_check()


def test_match_hybrid_host_part_ends_at_the_deepest_host_state() -> None:
    h = make(size=16, states=4)
    c = h.cache
    put(h, [1, 2, 3, 4])  # A: state 1, host state 1
    put(h, list(range(1, 13)), prefix=t64(1, 2, 3, 4))  # B [5, 13): state 2, host state 2
    a, b = node_at(c, [1, 2, 3, 4]), node_at(c, list(range(1, 13)))
    assert (a.host_state_slot, b.host_state_slot) == (1, 2)
    c.inc_lock_ref(a)
    c.evict(8)
    c.dec_lock_ref(a)
    assert (b.kv_value, b.state_slot, b.host_state_slot) == (None, None, 2)
    # A match ending inside B splits it: the upper part has no state anywhere.
    m = c.match_prefix(list(range(1, 9)) + [99])
    b_up = node_at(c, list(range(1, 9)))
    assert b.parent is b_up and (b_up.state_slot, b_up.host_state_slot) == (None, None)
    assert (m.prefix_len, m.kv_hit_length, m.host_hit_length) == (4, 8, 0)
    assert m.last_host_node is a and m.state_slot == 1
    m = c.match_prefix(list(range(1, 13)))
    assert (m.prefix_len, m.kv_hit_length, m.host_hit_length) == (4, 12, 8)
    assert m.last_host_node is b
    assert c.load_back(b) == 8  # B's upper part and B, with B's state
    assert (b_up.state_slot, b.state_slot) == (None, 3)
    m = c.match_prefix(list(range(1, 13)))
    assert (m.prefix_len, m.host_hit_length, m.state_slot) == (12, 0, 3)
    m = c.match_prefix(list(range(1, 9)) + [99])
    assert (m.prefix_len, m.kv_hit_length, m.host_hit_length) == (4, 8, 0)
    c.sanity_check()
    check_accounting(h)


@pytest.mark.parametrize("route", ["evict_states", "revival"])
def test_a_state_only_on_host_below_device_kv_is_loaded_back_alone(route: str) -> None:
    """A node on device whose state lives only on host (its device state was evicted, or an
    insert revived it): the match reports the host hit, load_back brings the state alone
    (returns 0 KV tokens, counts a state), and the next match uses it. (A library bug
    until bf6d0af: the host hit could never be used.)"""
    h = make(size=16, states=4)
    c = h.cache
    sp, hs = h.sp, h.host_state
    assert sp is not None and hs is not None
    put(h, [1, 2, 3, 4])  # X: state 1, host state 1
    x = node_at(c, [1, 2, 3, 4])
    hs.conv[:, 1] = 2.25
    hs.ssm[:, 1] = -2.25
    if route == "evict_states":
        put(h, [1, 2, 3, 4, 5, 6], prefix=t64(1, 2, 3, 4))  # state 2
        assert c.evict_states(1).num_states == 1  # X's (the oldest) device state
        assert free_slots(sp) == [3, 4, 1]
    else:
        c.evict(4)  # X host-only with its host state; device state 1 freed
        put(h, [1, 2, 3, 4, 5, 6])  # through X: X takes the caller's slots; state 2 below
        assert free_slots(sp) == [3, 4, 1]
    assert x.kv_value is not None and x.state_slot is None and x.host_state_slot == 1
    m = c.match_prefix([1, 2, 3, 4, 9])
    assert (m.prefix_len, m.kv_hit_length, m.host_hit_length, m.last_host_node) == (0, 4, 4, x)
    kv_before = free_slots(h.kv)
    assert c.load_back(x) == 0  # no KV moved
    assert x.state_slot == 3 and free_slots(h.kv) == kv_before
    assert bool((sp.conv[:, 3] == 2.25).all()) and bool((sp.ssm[:, 3] == -2.25).all())
    st = c.stats()
    assert (st["load_back_tokens"], st["load_back_states"]) == (0, 1)
    m2 = c.match_prefix([1, 2, 3, 4, 9])
    assert (m2.prefix_len, m2.state_slot, m2.host_hit_length) == (4, 3, 0)
    c.sanity_check()
    check_accounting(h)


# ======================================================================== hybrid host-only leaf
def test_a_hybrid_host_only_leaf_keeps_its_host_state_and_load_back_restores_it() -> None:
    h = make(size=16, states=4)
    c = h.cache
    sp, hs = h.sp, h.host_state
    assert sp is not None and hs is not None
    res = put(h, [1, 2, 3, 4])
    x = res.last_node
    assert (x.state_slot, x.host_state_slot) == (1, 1)
    sp.conv[:, 1] = 4.5
    sp.ssm[:, 1] = -4.5
    h.hc.save_state(1, 1)  # the state's final value, as an engine would have it
    r = c.evict(4)
    assert (r.num_tokens, r.num_states) == (4, 1)
    assert c.tree.is_attached(x) and x.kv_value is None and x.state_slot is None
    assert x.host_state_slot == 1 and not c.core.is_dead_leaf(x)
    assert [n.id for n in c.host_leaves] == [x.id]
    assert c.evict_states(1).num_states == 0  # a host state is not a device state
    assert x.host_state_slot == 1
    sp.conv.zero_()
    sp.ssm.zero_()
    assert ids(sp.alloc(1)) == [2]  # the caller holds slot 2: the reload gets another
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 4, x)
    assert c.load_back(x) == 4
    assert x.state_slot == 3 and x.host_state_slot == 1
    assert bool((sp.conv[:, 3] == 4.5).all()) and bool((sp.ssm[:, 3] == -4.5).all())
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.prefix_len, m.state_slot, m.host_hit_length) == (4, 3, 0)
    c.sanity_check()
    check_accounting(h, held_states=1)


def test_a_hybrid_leaf_whose_state_cannot_reach_host_leaves_the_tree() -> None:
    from tests.hicache.test_hicache_common import FailAllocs

    h = make(size=16, states=4, policy="write_back")
    c = h.cache
    put(h, [1, 2, 3, 4])
    x = node_at(c, [1, 2, 3, 4])
    # KV gets host room, the state never does: the leaf would be host-only without any state,
    # a dead leaf, so it goes.
    with FailAllocs({"host state": h.host_state}, 1):
        r = c.evict(4)
    assert (r.num_tokens, r.num_states) == (4, 1)
    assert not c.tree.is_attached(x) and c.tree.num_nodes == 0
    assert c.host_size() == 0 and h.host_kv.available_size() == h.host_kv.size
    assert c.stats()["host_evicted_tokens"] == 4  # its host copy was freed again
    c.sanity_check()
    check_accounting(h)


def test_reset_frees_host_copies_too() -> None:
    h = make(size=16, states=4)
    c = h.cache
    put(h, [1, 2, 3, 4])
    put(h, [5, 6, 7, 8])
    c.evict(4)
    assert c.host_size() == 8 and c.total_size() == 4
    c.reset()
    assert c.host_size() == 0 and c.tree.num_nodes == 0
    for name, a in h.pools().items():
        assert a.available_size() == a.size, name
    c.sanity_check()


def test_reset_refuses_while_a_copy_is_in_flight() -> None:
    h = make()
    c = h.cache
    with held(h):
        put(h, [1, 2, 3, 4])
        before = dump(h)
        with pytest.raises(ValueError, match="in flight"):
            c.reset()
        assert_same(before, dump(h))
    h.hc.release_held()
    c.reset()
    assert c.host_size() == 0 and h.host_kv.available_size() == h.host_kv.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_pools_mirror_the_device_pools(page_size: int) -> None:
    h = make(page_size=page_size, size=16, states=3, ratio=2.5, layers=3, heads=2, head_dim=4)
    hk, dk = h.host_kv, h.kv
    assert (type(hk), hk.page_size, hk.size) == (type(dk), page_size, 40)
    hp, dp = hk.pool, dk.pool
    assert (hp.num_layers, hp.num_heads, hp.head_dim, hp.dtype, hp.device.type) == (
        3, 2, 4, torch.float32, "cpu")
    assert dp.num_layers == 3
    hs = h.host_state
    assert hs is not None and hs.size == 7  # int(3 * 2.5)
    assert (hs.conv_state_shape, hs.ssm_state_shape, hs.num_layers) == ((2,), (2, 2), 3)
    assert set(h.hc.pools) == {"kv", "state"}


def test_a_load_back_with_device_and_host_full_under_write_back_brings_the_chain_back_whole(
) -> None:
    """Device 8, host 16, write_back. The chain A [1..4] -> B [5..8] and then Z [20..27] are
    host-only (host full, the chain the oldest there); Y [30..37] fills the device. Loading B
    back evicts Y, whose write-back copy needs host room: the host evicts Z, never the chain
    it is loading (pinned while room is made). Exactly: 8 tokens loaded, A on device slots
    5..8 and B on 1..4, Z gone, Y host-only."""
    h = make(size=8, policy="write_back", ratio=2.0)
    c = h.cache
    put(h, [1, 2, 3, 4])
    put(h, list(range(1, 9)), prefix=node_slots(node_at(c, [1, 2, 3, 4])))
    a, b = node_at(c, [1, 2, 3, 4]), node_at(c, list(range(1, 9)))
    assert c.evict(8).num_tokens == 8 and a.kv_value is None and b.kv_value is None
    c.poll_transfers()
    put(h, list(range(20, 28)))
    assert c.evict(8).num_tokens == 8
    c.poll_transfers()
    put(h, list(range(30, 38)))
    assert h.kv.available_size() == 0 and c.host_size() == 16
    assert c.load_back(b) == 8  # (no match first: the chain stays the host's oldest)
    c.poll_transfers()
    assert (ids(node_slots(a)), ids(node_slots(b))) == ([5, 6, 7, 8], [1, 2, 3, 4])
    assert c.match_prefix(list(range(1, 9))).prefix_len == 8
    z = c.match_prefix(list(range(20, 28)))
    assert (z.prefix_len, z.host_hit_length) == (0, 0)
    y = c.match_prefix(list(range(30, 38)))
    assert (y.prefix_len, y.host_hit_length) == (0, 8)
    c.sanity_check()
    check_accounting(h)
