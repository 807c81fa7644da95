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
import torch

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


def without_counter(d: dict[str, Any]) -> dict[str, Any]:
    """``dump`` less the copy-failure counter (a failed copy counts itself)."""
    out = dict(d)
    out["stats"] = {k: v for k, v in d["stats"].items() if k != "copy_failures"}
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("states", [0, 4])
def test_a_write_back_copy_that_cannot_start_is_a_backup_without_host_room(page_size: int,
                                                                          states: int) -> None:
    # write_back: evicting leaf Q (below P, neither backed up) backs up P, then Q. Q's copy
    # refuses to start: Q's host units go back and Q leaves the tree as a write-back victim
    # without host room does; the evict frees what it was asked and nothing is left half done.
    h = make(page_size=page_size, size=16, states=states, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p, q = node_at(c, KEY[:4]), node_at(c, KEY[:8])
    refuse_copy(h, 2)
    r = c.evict(4)  # actual: raised, and Q was gone from the eviction order for good
    assert r.num_tokens == 4 and not c.tree.is_attached(q)
    assert c.stats()["copy_failures"] == 1
    c.sanity_check()
    check_accounting(h, 0)
    assert c.host_size() == 4 and p.host_value is not None  # P's copy was enqueued
    c.poll_transfers()  # it lands: P unlocked
    assert p.kv_lock == 0
    c.sanity_check()


@pytest.mark.parametrize("states", [0, 4])
def test_a_refused_first_copy_of_a_chain_takes_no_host_unit(states: int) -> None:
    # the first copy (P's, the chain's first) refuses: Q leaves as without host room, the
    # host pools (free-list order included) and P are exactly as before
    h = make(size=16, states=states, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p = node_at(c, KEY[:4])
    before = dump(h)
    refuse_copy(h, 1)
    assert c.evict(4).num_tokens == 4
    c.sanity_check()
    after = dump(h)
    for name in ("host kv", "host state"):
        assert after.get(name) == before.get(name), name  # actual: the units at the back
    assert (p.host_value, p.kv_lock, p.children) == (None, 0, {})


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
@pytest.mark.parametrize("states", [0, 4])
def test_an_insert_whose_backup_cannot_start_stands_and_returns_its_result(policy: str,
                                                                           states: int) -> None:
    # the insert's write-through backup refuses to start: the insert is not undone and not
    # turned into an error (the caller would lose which slots are duplicates, and a request
    # helper its lock); the node stays device-only, as without host room
    h = make(size=16, states=states, policy=policy)
    c = h.cache
    put(h, KEY[:4])
    if policy == "write_through_selective":  # P hit twice: the next insert backs it up
        c.match_prefix(KEY[:4])
    before_host = h.host_kv.snapshot()
    refuse_copy(h, 1)
    res = put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    assert res.prefix_len == 4 and c.stats()["copy_failures"] == 1
    q = node_at(c, KEY[:8])
    assert q.kv_value is not None and q.host_value is None and q.kv_lock == 0
    assert h.host_kv.snapshot() == before_host  # the refused copy took no host unit
    if policy == "write_through_selective":  # the copy refused was P's
        assert node_at(c, KEY[:4]).host_value is None
    c.sanity_check()
    check_accounting(h, 0)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_load_back_copy_that_cannot_start_leaves_the_cache_as_before(page_size: int,
                                                                      hybrid: bool) -> None:
    # room on device (no eviction): the load-back returns 0, the device units it took go
    # back where they were in every free list, and every node, lock and counter is as before
    h, step = chain_on_host(page_size, hybrid)
    before = dump(h)
    orig = h.hc.load_rows

    def load_rows(*args: Any) -> Any:
        raise CopyRefused("load")

    h.hc.load_rows = load_rows  # type: ignore[method-assign]
    assert step() == 0  # as without device room; actual: raised, the units at the back
    h.cache.sanity_check()
    assert_same(without_counter(before), without_counter(dump(h)))
    assert h.cache.stats()["copy_failures"] == 1
    h.hc.load_rows = orig  # type: ignore[method-assign]
    assert step() == 8
    h.cache.sanity_check()
    check_accounting(h)


def test_a_finished_request_whose_backup_cannot_start_releases_its_lock() -> None:
    from radix import CacheRequest

    h = make(size=16, states=4)
    c = h.cache
    put(h, KEY[:4])
    m = c.match_prefix(KEY[:8])
    p = m.last_device_node
    lock = c.inc_lock_ref(p)
    fresh = h.kv.alloc(4)
    assert fresh is not None and p.kv_lock == 1
    req = CacheRequest(key=KEY[:8], kv_indices=torch.cat([m.device_indices, fresh]),
                       cached_len=m.prefix_len, last_node=p, lock=lock)
    refuse_copy(h, 1)
    c.cache_finished_req(req, state_slot=h.state())  # actual: raised, P stayed locked
    assert p.kv_lock == 0 and c.protected_size() == 0
    assert node_at(c, KEY[:8]).host_value is None
    c.sanity_check()
    check_accounting(h)


@pytest.mark.parametrize("states", [0, 4])
def test_a_write_back_eviction_goes_on_to_the_parent_it_backed_up_before_a_shortfall(
        states: int) -> None:
    # write_back, P [0, 4) and leaf Q [4, 8) on device, no host copies; host room for one
    # node only. evict(16): Q's chain backs up P (the copy lands at once on the CPU), then
    # finds no room for Q, which leaves. P, backed up, must then be demoted in the same call,
    # as it is when Q's backup succeeds (actual: P stayed locked until a later poll, and the
    # eviction stopped at 4 of the 8 evictable tokens).
    h = make(size=16, states=states, policy="write_back")
    c = h.cache
    put(h, KEY[:4])
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p = node_at(c, KEY[:4])
    with FailAllocs({"host kv": h.host_kv}, 2, "from"):
        r = c.evict(16)
    assert r.num_tokens == 8 and h.kv.available_size() == 16
    assert p.kv_value is None and p.host_value is not None and p.kv_lock == 0  # demoted
    assert c.host_size() == 4
    c.sanity_check()
    check_accounting(h)
