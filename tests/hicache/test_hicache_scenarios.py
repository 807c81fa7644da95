"""Narrated host-tier scenarios, part 1: host eviction, write_back, splits of nodes whose
copy is in flight, backup order, write_through_selective; exact slot ids, sizes and order.
Part 2 (load_back, match, inserts through host) is test_hicache_loadback.py.

Device slots come from ``TokenAllocator(16)`` (ids 1..16, FIFO reuse), host slots from its
mirror (``hicache_ratio`` 2: ids 1..32). ``load_back_threshold`` is 1 unless a test is about
the threshold.
"""

from __future__ import annotations

from tests.helpers.cache_helpers import free_slots, node_slots
from tests.hicache.test_hicache_common import (
    check_accounting,
    held,
    ids,
    make,
    node_at,
    put,
    t64,
)


# ======================================================================== host eviction
def test_evict_host_stops_at_its_target_and_cascades_to_a_parent_that_became_a_leaf() -> None:
    h = make()
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])  # device 1..6, host 1..6
    put(h, [1, 2, 3, 7, 8], prefix=t64(1, 2, 3))  # splits: U [1,2,3], A [4,5,6], B [7,8]
    put(h, [9, 10, 11, 12])  # D: device 9..12, host 9..12
    u, a, b, d = (node_at(c, k) for k in ([1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8],
                                          [9, 10, 11, 12]))
    assert (ids(u.host_value), ids(a.host_value), ids(b.host_value), ids(d.host_value)) == (
        [1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11, 12])
    assert c.evict(12).num_tokens == 12  # all host-only now
    assert c.host_size() == 12 and c.total_size() == 0
    # Host leaves, least recently used first: A and B (stamp 2; ids 1 < 3), then D (stamp 3).
    assert [n.id for n in c.host_leaves] == [a.id, b.id, d.id]
    assert (a.last_access_time, b.last_access_time, d.last_access_time) == (2, 2, 3)
    host_free = free_slots(h.host_kv)

    assert c.evict_host(2) == 3  # A is 3 tokens: the target is reached, B stays
    assert not c.tree.is_attached(a) and c.tree.is_attached(b)
    assert free_slots(h.host_kv) == host_free + [4, 5, 6]
    assert c.host_size() == 9 and c.stats()["host_evicted_tokens"] == 3
    c.sanity_check()

    # B (2) is not enough for 4: U, now a host-only leaf older than D, follows in the same call.
    assert c.evict_host(4) == 5
    assert not c.tree.is_attached(b) and not c.tree.is_attached(u) and c.tree.is_attached(d)
    assert free_slots(h.host_kv) == host_free + [4, 5, 6, 7, 8, 1, 2, 3]
    assert c.host_size() == 4 and c.stats()["host_evicted_tokens"] == 8
    assert [n.id for n in c.host_leaves] == [d.id] and c.tree.num_nodes == 1
    c.sanity_check()
    check_accounting(h)

    assert c.evict_host(0) == 0 and c.host_size() == 4  # a zero target frees nothing
    assert c.evict_host(100) == 4 and c.tree.num_nodes == 0  # more than there is: all of it
    assert h.host_kv.available_size() == h.host_kv.size


def test_evict_host_leaves_device_and_in_flight_copies_alone() -> None:
    h = make()
    c = h.cache
    put(h, [1, 2, 3, 4])  # device + host
    with held(h):
        put(h, [5, 6, 7])  # its copy in flight
    assert c.host_size() == 7 and c.host_evictable_size() == 0
    assert c.evict_host(7) == 0 and c.host_size() == 7
    h.hc.release_held()
    assert c.poll_transfers() == 1
    c.sanity_check()


# ======================================================================== write_back
def test_write_back_frees_device_slots_once_the_copy_lands() -> None:
    h = make(policy="write_back")
    c = h.cache
    put(h, [1, 2, 3, 4])
    x = node_at(c, [1, 2, 3, 4])
    assert x.host_value is None and c.host_size() == 0  # write_back: nothing at insert
    dev_free = free_slots(h.kv)
    assert dev_free == list(range(5, 17))
    h.hc.hold_completions = True
    r = c.evict(4)
    assert (r.num_tokens, r.num_states) == (0, 0)  # the copy is in flight: nothing freed yet
    assert ids(x.host_value) == [1, 2, 3, 4] and ids(node_slots(x)) == [1, 2, 3, 4]
    assert (x.kv_lock, c.protected_size(), c.evictable_size()) == (1, 4, 0)
    assert free_slots(h.kv) == dev_free and h.hc.num_inflight == 1
    st = c.stats()
    assert (st["backup_tokens"], st["evicted_tokens"], st["demoted_tokens"]) == (4, 0, 0)
    c.sanity_check()
    assert c.poll_transfers() == 0 and x.kv_value is not None  # held: not landed yet
    assert c.evict(4).num_tokens == 0  # nothing else to evict; X is locked

    h.hc.release_held()
    assert c.poll_transfers() == 1
    assert x.kv_value is None and ids(x.host_value) == [1, 2, 3, 4]  # host-only now
    assert free_slots(h.kv) == dev_free + [1, 2, 3, 4]
    assert (x.kv_lock, c.protected_size(), c.evictable_size(), h.hc.num_inflight) == (0, 0, 0, 0)
    st = c.stats()
    assert (st["backup_tokens"], st["evicted_tokens"], st["demoted_tokens"]) == (4, 4, 4)
    c.sanity_check()
    check_accounting(h)


def test_write_back_copy_landing_under_a_new_lock_keeps_the_node_on_device() -> None:
    h = make(policy="write_back")
    c = h.cache
    put(h, [1, 2, 3, 4])
    x = node_at(c, [1, 2, 3, 4])
    with held(h):
        c.evict(4)
    m = c.match_prefix([1, 2, 3, 4])
    assert m.last_device_node is x and m.prefix_len == 4
    c.inc_lock_ref(x)
    assert x.kv_lock == 2
    h.hc.release_held()
    assert c.poll_transfers() == 1
    assert ids(node_slots(x)) == [1, 2, 3, 4] and ids(x.host_value) == [1, 2, 3, 4]
    assert x.kv_lock == 1 and c.protected_size() == 4
    c.dec_lock_ref(x)
    assert c.evict(4).num_tokens == 4 and x.kv_value is None  # backed up: demoted at once
    assert c.stats()["backup_tokens"] == 4  # not copied twice
    c.sanity_check()


def test_write_back_eviction_backs_up_the_parent_first_and_demotes_only_the_leaf() -> None:
    h = make(policy="write_back")
    c = h.cache
    put(h, [1, 2, 3, 4])
    put(h, [1, 2, 3, 4, 5, 6], prefix=t64(1, 2, 3, 4))
    p, q = node_at(c, [1, 2, 3, 4]), node_at(c, [1, 2, 3, 4, 5, 6])
    r = c.evict(2)
    assert (r.num_tokens, r.num_states) == (2, 0)
    assert ids(p.host_value) == [1, 2, 3, 4] and ids(q.host_value) == [5, 6]  # parent first
    assert ids(node_slots(p)) == [1, 2, 3, 4] and q.kv_value is None
    assert c.stats()["backup_tokens"] == 6
    r = c.evict(4)  # P is backed up already: demoted without a copy
    assert r.num_tokens == 4 and p.kv_value is None and c.stats()["backup_tokens"] == 6
    c.sanity_check()
    check_accounting(h)


# ======================================================================== in-flight split
def test_split_while_the_backup_is_in_flight_backs_up_both_fragments_and_unlocks_once() -> None:
    h = make()
    c = h.cache
    h.hc.hold_completions = True
    put(h, [1, 2, 3, 4, 5, 6])
    x = node_at(c, [1, 2, 3, 4, 5, 6])
    assert (x.kv_lock, c.protected_size(), h.hc.num_inflight) == (1, 6, 1)
    res = put(h, [1, 2, 3, 9], prefix=t64(1, 2, 3))  # splits X at 3 while its copy flies
    u, y = node_at(c, [1, 2, 3]), res.last_node
    assert x.parent is u and ids(node_slots(u)) == [1, 2, 3] and ids(node_slots(x)) == [4, 5, 6]
    assert ids(u.host_value) == [1, 2, 3] and ids(x.host_value) == [4, 5, 6]
    assert ids(node_slots(y)) == [7] and ids(y.host_value) == [7]  # Y's own copy, also in flight
    # U carries X's in-flight lock (copied at the split) plus Y's.
    assert (u.kv_lock, x.kv_lock, y.kv_lock) == (2, 1, 1)
    assert (c.protected_size(), c.evictable_size(), h.hc.num_inflight) == (7, 0, 2)
    c.sanity_check()

    h.hc.release_held()
    assert c.poll_transfers() == 2
    assert (u.kv_lock, x.kv_lock, y.kv_lock) == (0, 0, 0)  # released exactly once each
    assert (c.protected_size(), c.evictable_size(), h.hc.num_inflight) == (0, 7, 0)
    assert c.poll_transfers() == 0 and (u.kv_lock, x.kv_lock) == (0, 0)
    assert c.host_size() == 7 and c.stats()["backup_tokens"] == 7
    c.sanity_check()
    assert c.evict(7).num_tokens == 7  # both fragments and Y demote: all are backed up
    assert (u.kv_value, x.kv_value, y.kv_value) == (None, None, None)
    assert (ids(u.host_value), ids(x.host_value), ids(y.host_value)) == ([1, 2, 3], [4, 5, 6], [7])
    c.sanity_check()
    check_accounting(h)


def test_split_of_an_in_flight_write_back_demotes_the_lower_fragment_only() -> None:
    h = make(policy="write_back")
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])
    x = node_at(c, [1, 2, 3, 4, 5, 6])
    with held(h):
        assert c.evict(6).num_tokens == 0
        put(h, [1, 2, 3, 9], prefix=t64(1, 2, 3))
    u = node_at(c, [1, 2, 3])
    assert (u.kv_lock, x.kv_lock, c.protected_size()) == (1, 1, 6)
    h.hc.release_held()
    assert c.poll_transfers() == 1
    # X (lower) was the node being evicted: it demotes. U stays, backed up, over device Y.
    assert x.kv_value is None and ids(x.host_value) == [4, 5, 6]
    assert ids(node_slots(u)) == [1, 2, 3] and ids(u.host_value) == [1, 2, 3]
    assert (u.kv_lock, x.kv_lock, c.protected_size()) == (0, 0, 0)
    assert free_slots(h.kv)[-3:] == [4, 5, 6]
    c.sanity_check()
    check_accounting(h)


# ======================================================================== backup order
def test_a_child_is_never_backed_up_before_its_parent() -> None:
    from tests.hicache.test_hicache_common import FailAllocs

    h = make()  # write_through
    c = h.cache
    with FailAllocs({"host kv": h.host_kv}, 1):
        put(h, [1, 2, 3, 4])  # its backup fails: P stays device-only
    p = node_at(c, [1, 2, 3, 4])
    assert p.host_value is None and c.host_size() == 0
    res = put(h, [1, 2, 3, 4, 5, 6], prefix=t64(1, 2, 3, 4))
    q = res.last_node
    # Backing up Q backs up P first (the lower host slots), then Q.
    assert ids(p.host_value) == [1, 2, 3, 4] and ids(q.host_value) == [5, 6]
    assert c.stats()["backup_tokens"] == 6
    c.evict(6)
    assert p.kv_value is None and q.kv_value is None  # both demote, the chain is on host
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 6, q)
    c.sanity_check()


def test_a_failed_parent_backup_stops_the_chain() -> None:
    from tests.hicache.test_hicache_common import FailAllocs

    h = make(policy="write_back")
    c = h.cache
    put(h, [1, 2, 3, 4])
    put(h, [1, 2, 3, 4, 5, 6], prefix=t64(1, 2, 3, 4))
    p, q = node_at(c, [1, 2, 3, 4]), node_at(c, [1, 2, 3, 4, 5, 6])
    with FailAllocs({"host kv": h.host_kv}, 1) as f:
        assert c._host.backup_chain(q) is False
    assert f.names == ["host kv", "host kv"]  # P's try and its retry after evict_host; Q none
    assert p.host_value is None and q.host_value is None and c.host_size() == 0
    c.sanity_check()


# ======================================================================== write_through_selective
def test_write_through_selective_backs_up_only_after_the_second_hit() -> None:
    h = make(policy="write_through_selective")
    c = h.cache
    put(h, [1, 2, 3, 4])
    x = node_at(c, [1, 2, 3, 4])
    assert (x.hit_count, x.host_value, c.stats()["backup_tokens"]) == (1, None, 0)
    for _ in range(3):  # matches are not hits
        assert c.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert x.host_value is None
    c.insert([1, 2, 3, 4], t64(1, 2, 3, 4))  # the second hit (an insert walking through)
    assert x.hit_count == 2 and ids(x.host_value) == [1, 2, 3, 4]
    assert c.stats()["backup_tokens"] == 4 and c.host_size() == 4
    c.insert([1, 2, 3, 4], t64(1, 2, 3, 4))  # third hit: already backed up, no new copy
    assert x.hit_count == 3 and c.stats()["backup_tokens"] == 4
    c.sanity_check()


def test_write_through_selective_counts_one_request_once() -> None:
    h = make(policy="write_through_selective")
    c = h.cache
    c.insert([1, 2, 3, 4], h.kv.alloc(4), rid="r")
    c.insert([1, 2, 3, 4], t64(1, 2, 3, 4), rid="r")  # chunked re-insert of the same request
    x = node_at(c, [1, 2, 3, 4])
    assert x.hit_count == 1 and x.host_value is None
    c.release_rid("r")
    c.insert([1, 2, 3, 4], t64(1, 2, 3, 4), rid="s")
    assert x.hit_count == 2 and ids(x.host_value) == [1, 2, 3, 4]
    c.sanity_check()
