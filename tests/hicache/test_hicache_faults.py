"""Fault injection into the multi-pool steps of the host tier.

``load_back`` takes device KV slots and a device state slot; a backup takes host KV slots and a
host state slot. For every ``k`` up to the number of ``alloc`` calls a step makes:

* ``mode="from"`` (the k-th call and every later one fail: a shortage that eviction cannot
  cure): the step fails cleanly and every pool's ``snapshot()`` (free list order included),
  every node's values, locks and stamps, ``pretty_print``, ``stats()``, every size, every
  eviction order and the controller's counters equal a snapshot taken before the step;
* ``mode="once"`` (only the k-th call fails; the step's retry succeeds): the outcome equals the
  outcome of the same step without a fault, byte for byte of the bookkeeping.

Each case is built afresh by a deterministic builder, so "the same step without a fault" is
the same step on an identical cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.hicache.test_hicache_common import (
    HC,
    FailAllocs,
    assert_same,
    check_accounting,
    dump,
    ids,
    make,
    node_at,
    put,
)

KEY = list(range(1, 13))  # 12 tokens: P = [0, 4), Q = [4, 8), R = [8, 12)


# ======================================================================== builders
def chain_on_host(page_size: int, hybrid: bool) -> tuple[HC, Callable[[], Any]]:
    """P on device; Q and R below it host-only (with host states when hybrid). The step:
    ``load_back(R)`` (chain Q R, 8 tokens, P locked meanwhile)."""
    h = make(page_size=page_size, size=24, states=4 if hybrid else 0)
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    put(h, KEY[:12], prefix=c.match_prefix(KEY[:8]).device_indices)
    p, q, r = node_at(c, KEY[:4]), node_at(c, KEY[:8]), node_at(c, KEY)
    c.inc_lock_ref(p)
    assert c.evict(8).num_tokens == 8
    c.dec_lock_ref(p)
    m = c.match_prefix(KEY)
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (4, 8, r)
    assert (p.kv_value is not None, q.kv_value, r.kv_value) == (True, None, None)
    c.sanity_check()
    return h, lambda: c.load_back(r)


def unbacked_leaf(page_size: int, hybrid: bool) -> tuple[HC, Callable[[], Any]]:
    """write_back: P backed up (device + host), leaf Q below it on device only. The step:
    ``_backup_chain(Q)`` (one node: host KV + a host state when hybrid)."""
    h = make(page_size=page_size, size=24, states=4 if hybrid else 0, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p, q = node_at(c, KEY[:4]), node_at(c, KEY[:8])
    assert c._host.backup_chain(p) and p.host_value is not None
    assert q.host_value is None and not q.children
    c.sanity_check()
    return h, lambda: c._host.backup_chain(q)


def unbacked_pair(page_size: int, hybrid: bool) -> tuple[HC, Callable[[], Any]]:
    """write_back: P and its leaf Q both on device only. The step: ``_backup_chain(Q)``
    (P first, then Q)."""
    h = make(page_size=page_size, size=24, states=4 if hybrid else 0, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    c.sanity_check()
    return h, lambda: c._host.backup_chain(node_at(c, KEY[:8]))


def state_only_on_host(page_size: int, hybrid: bool) -> tuple[HC, Callable[[], Any]]:
    """Hybrid: P on device, its state evicted from device but kept on host. The step:
    ``load_back(P)`` (the state alone: a device state slot, no KV)."""
    assert hybrid
    h = make(page_size=page_size, size=24, states=4)
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p = node_at(c, KEY[:4])
    assert c.evict_states(1).num_states == 1 and p.state_slot is None
    m = c.match_prefix(KEY[:4])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 4, p)
    c.sanity_check()
    return h, lambda: (c.load_back(p), p.state_slot)


CASES = [(ps, hybrid) for ps in (1, 4) for hybrid in (False, True)]


def calls_of(builder: Callable[..., tuple[HC, Callable[[], Any]]], ps: int, hybrid: bool
             ) -> tuple[list[str], Any, dict[str, Any]]:
    """Run the step once without faults: the alloc calls it makes, its result, the dump."""
    h, step = builder(ps, hybrid)
    with FailAllocs(h.pools()) as f:
        result = step()
    h.cache.sanity_check()
    check_accounting(h)
    return f.names, result, dump(h)


def run_faulty(builder: Callable[..., tuple[HC, Callable[[], Any]]], ps: int, hybrid: bool,
               k: int, mode: str) -> tuple[HC, Any, dict[str, Any], FailAllocs]:
    h, step = builder(ps, hybrid)
    before = dump(h)
    with FailAllocs(h.pools(), k, mode) as f:
        result = step()
    h.cache.sanity_check()
    check_accounting(h)
    return h, result, before, f


# ======================================================================== load_back
@pytest.mark.parametrize("page_size,hybrid", CASES)
def test_load_back_allocations_are_all_or_nothing(page_size: int, hybrid: bool) -> None:
    names, result, after = calls_of(chain_on_host, page_size, hybrid)
    assert result == 8
    assert names == (["device kv", "device state"] if hybrid else ["device kv"])
    for k in range(1, len(names) + 1):
        h, res, before, f = run_faulty(chain_on_host, page_size, hybrid, k, "from")
        assert res == 0
        assert f.calls[k - 1][2]  # the k-th call did fail
        assert_same(before, dump(h))
        # once: the retry after the (empty) eviction succeeds exactly as without a fault
        h, res, before, f = run_faulty(chain_on_host, page_size, hybrid, k, "once")
        assert res == 8 and f.names == names[:k] + names
        assert_same(after, dump(h))


@pytest.mark.parametrize("page_size,hybrid", CASES)
def test_load_back_failure_keeps_the_host_copies_loadable(page_size: int, hybrid: bool) -> None:
    h, res, before, _ = run_faulty(chain_on_host, page_size, hybrid, 1, "from")
    assert res == 0
    c = h.cache
    r = node_at(c, KEY)
    assert c.load_back(r) == 8  # faults gone: the same chain loads
    m = c.match_prefix(KEY)
    assert (m.prefix_len, m.host_hit_length) == (12, 0)
    assert m.state_slot == (r.state_slot if hybrid else None)
    c.sanity_check()
    check_accounting(h)


@pytest.mark.parametrize("page_size", [1, 4])
def test_load_back_of_a_state_alone_is_all_or_nothing(page_size: int) -> None:
    names, result, after = calls_of(state_only_on_host, page_size, True)
    assert result == (0, 3)  # no KV tokens; the state came back into slot 3
    assert names == ["device state"]  # (no KV to load: only the state pool is asked)
    for k in range(1, len(names) + 1):
        h, res, before, _ = run_faulty(state_only_on_host, page_size, True, k, "from")
        assert res == (0, None)
        assert_same(before, dump(h))
        h, res, before, f = run_faulty(state_only_on_host, page_size, True, k, "once")
        assert res == (0, 3) and f.names == names[:k] + names
        assert_same(after, dump(h))


# ======================================================================== backups
@pytest.mark.parametrize("page_size,hybrid", CASES)
def test_backup_allocations_are_all_or_nothing(page_size: int, hybrid: bool) -> None:
    names, result, after = calls_of(unbacked_leaf, page_size, hybrid)
    assert result is True
    assert names == (["host kv", "host state"] if hybrid else ["host kv"])
    # From k on everything fails: first try, retry after evict_host, retry without a state.
    retries = ["host kv", "host kv", "host kv"] if hybrid else ["host kv", "host kv"]
    for k in range(1, len(names) + 1):
        h, res, before, f = run_faulty(unbacked_leaf, page_size, hybrid, k, "from")
        assert res is False
        assert f.names == names[:k] + retries[1:]
        assert_same(before, dump(h))
        h, res, before, f = run_faulty(unbacked_leaf, page_size, hybrid, k, "once")
        assert res is True and f.names == names[:k] + names
        assert_same(after, dump(h))


@pytest.mark.parametrize("page_size,hybrid", CASES)
def test_backup_of_a_chain_keeps_the_parent_when_the_child_fails(page_size: int,
                                                                 hybrid: bool) -> None:
    """Parent first; the parent's completed backup is valid progress (a backed-up prefix),
    the child's failed one leaves no trace."""
    names, result, after = calls_of(unbacked_pair, page_size, hybrid)
    per_node = ["host kv", "host state"] if hybrid else ["host kv"]
    assert result is True and names == per_node * 2
    first = len(per_node)
    for k in range(1, len(names) + 1):
        h, res, before, _ = run_faulty(unbacked_pair, page_size, hybrid, k, "from")
        assert res is False
        c = h.cache
        p, q = node_at(c, KEY[:4]), node_at(c, KEY[:8])
        assert q.host_value is None and q.host_state_slot is None
        if k <= first:  # the parent's own step failed: nothing changed at all
            assert_same(before, dump(h))
            continue
        ps = page_size
        assert ids(p.host_value) == list(range(ps, ps + 4))
        assert p.host_state_slot == (1 if hybrid else None)
        assert c.host_size() == 4 and h.host_kv.available_size() == h.host_kv.size - 4
        assert c.stats()["backup_tokens"] == 4
        if hybrid:
            assert h.host_state.available_size() == h.host_state.size - 1  # type: ignore[union-attr]


@pytest.mark.parametrize("hybrid", [False, True])
def test_write_back_eviction_with_no_host_room_drops_the_leaf_and_takes_nothing(hybrid: bool) -> None:
    """A write-back eviction whose backup cannot get host slots removes the leaf as a cache
    without a host tier would; no host slot is taken."""
    h, _ = unbacked_pair(1, hybrid)
    c = h.cache
    host_before = {n: a.snapshot() for n, a in h.pools().items() if n.startswith("host")}
    dev_free = h.kv.available_size()
    with FailAllocs({n: a for n, a in h.pools().items() if n.startswith("host")}, 1) as f:
        r = c.evict(4)
    assert set(f.names) <= {"host kv", "host state"} and all(fail for *_, fail in f.calls)
    assert (r.num_tokens, r.num_states) == (4, 1 if hybrid else 0)
    assert {n: a.snapshot() for n, a in h.pools().items() if n.startswith("host")} == host_before
    assert h.kv.available_size() == dev_free + r.num_tokens
    assert c.host_size() == 0 and c.stats()["backup_tokens"] == 0
    c.sanity_check()
    check_accounting(h)


@pytest.mark.parametrize("hybrid", [False, True])
def test_write_through_insert_without_host_room_caches_on_device_only(hybrid: bool) -> None:
    h = make(size=16, states=4 if hybrid else 0)
    c = h.cache
    host = {n: a for n, a in h.pools().items() if n.startswith("host")}
    before = {n: a.snapshot() for n, a in host.items()}
    with FailAllocs(host, 1):
        res = put(h, KEY[:8])
    assert res.inserted_len == 8 and res.last_node.host_value is None
    assert {n: a.snapshot() for n, a in host.items()} == before
    assert c.host_size() == 0 and c.stats()["backup_tokens"] == 0
    m = c.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length) == (8, 0)
    check_accounting(h)


# ======================================================================== a copy that cannot start
class CopyRefused(RuntimeError):
    pass


def refuse_copy(h: HC, k: int) -> None:
    """The controller's ``k``-th ``write_rows`` raises before enqueuing anything (a copy that
    cannot start: a CUDA error on a GPU)."""
    orig, calls = h.hc.write_rows, [0]

    def write_rows(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            raise CopyRefused(f"write {k}")
        return orig(*args, **kwargs)

    h.hc.write_rows = write_rows  # type: ignore[method-assign]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("states", [0, 4])
def test_a_write_back_copy_that_cannot_start_leaves_its_victim_evictable(page_size: int,
                                                                       states: int) -> None:
    # write_back: evicting leaf Q (below P, neither backed up) backs up P, then Q. Q's copy
    # refuses to start: Q must stay on device, unbacked, and still first in the eviction
    # order, with every host unit given back; P's copy was enqueued and lands at the next poll.
    h = make(page_size=page_size, size=16, states=states, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p, q = node_at(c, KEY[:4]), node_at(c, KEY[:8])
    q_slots = ids(q.kv_value)
    refuse_copy(h, 2)
    with pytest.raises(CopyRefused):
        c.evict(4)
    c.sanity_check()  # actual: "kv eviction set differs: missing {Q}"
    check_accounting(h, 0)
    assert (ids(q.kv_value), q.host_value, q.kv_lock) == (q_slots, None, 0)
    assert [n.id for n in c.kv.leaves] == [q.id]
    assert c.host_size() == 4 and ids(p.host_value) is not None
    h.hc.write_rows = type(h.hc).write_rows.__get__(h.hc)  # type: ignore[method-assign]
    c.poll_transfers()  # P's copy lands: P unlocked
    assert p.kv_lock == 0
    r = c.evict(4)  # the retry evicts Q as it would have
    assert r.num_tokens == 4 and q.kv_value is None and q.host_value is not None
    c.sanity_check()
    check_accounting(h, 0)


@pytest.mark.parametrize("states", [0, 4])
def test_a_write_back_copy_that_cannot_start_leaves_the_cache_as_before(states: int) -> None:
    # the first copy (P's, the chain's first) refuses: nothing at all changed
    h = make(size=16, states=states, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    before = dump(h)
    refuse_copy(h, 1)
    with pytest.raises(CopyRefused):
        c.evict(4)
    c.sanity_check()
    assert_same(before, dump(h))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_load_back_copy_that_cannot_start_leaves_the_cache_as_before(page_size: int,
                                                                      hybrid: bool) -> None:
    # room on device (no eviction): the device units the load-back took go back where they
    # were in every free list, and every node, lock and counter is as before
    h, step = chain_on_host(page_size, hybrid)
    before = dump(h)
    orig = h.hc.load_rows

    def load_rows(*args: Any) -> Any:
        raise CopyRefused("load")

    h.hc.load_rows = load_rows  # type: ignore[method-assign]
    with pytest.raises(CopyRefused):
        step()
    h.cache.sanity_check()
    assert_same(before, dump(h))  # actual: the device units went to the back of the lists
    h.hc.load_rows = orig  # type: ignore[method-assign]
    assert step() == 8
    h.cache.sanity_check()
    check_accounting(h)
