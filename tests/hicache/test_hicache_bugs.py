"""Regressions: host-tier bugs found by these tests, each a minimal repro, now fixed."""

from __future__ import annotations

import pytest
import torch

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


def test_load_back_under_write_back_does_not_host_evict_its_own_chain() -> None:
    h = make(size=8, policy="write_back", ratio=1.5)  # host: 12 slots
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])
    x = node_at(c, [1, 2, 3, 4, 5, 6])
    c.evict(6)  # written back, host-only: host 6 of 12
    put(h, list(range(10, 18)))  # Y fills the device, not backed up
    assert h.kv.available_size() == 0 and c.host_size() == 6
    m = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.host_hit_length, m.last_host_node) == (6, x)
    # Making room evicts Y, whose write-back needs 8 host slots; the only host leaf is X.
    loaded = c.load_back(x)
    c.sanity_check()
    check_accounting(h)
    assert loaded in (0, 6)
    if loaded:
        assert x.kv_value is not None and c.match_prefix([1, 2, 3, 4, 5, 6]).prefix_len == 6


def test_stateless_node_whose_copy_lands_childless_is_pruned() -> None:
    h = make(size=16, states=4, policy="write_through_selective")
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])
    with held(h):
        put(h, [1, 2, 3, 4, 9, 9])  # splits: U [1..4] (no state) hit twice -> its copy flies
        u = node_at(c, [1, 2, 3, 4])
        assert (u.state_slot, u.host_state_slot, u.kv_lock, ids(u.host_value)) == (
            None, None, 1, [1, 2, 3, 4])
        r = c.evict(4)  # both children: not backed up, removed; U is locked, stays
        assert (r.num_tokens, r.num_states) == (4, 2) and not u.children
        c.sanity_check()
    h.hc.release_held()
    assert c.poll_transfers() == 1
    c.sanity_check()  # actual: "unlocked dead leaf (no state / tombstone)"
    check_accounting(h)


def test_write_back_eviction_in_flight_stops_at_its_target() -> None:
    h = make(size=16, policy="write_back")
    c = h.cache
    for k in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        put(h, k)
    h.hc.hold_completions = True
    c.evict(4)
    # actual: 3 copies in flight (12 tokens), all three leaves demoted when they land
    assert h.hc.num_inflight == 1 and c.stats()["backup_tokens"] == 4
    h.hc.release_held()
    c.poll_transfers()
    assert free_slots(h.kv)[-4:] == [1, 2, 3, 4] and h.kv.available_size() == 8


def test_gds_state_popped_for_an_in_flight_write_back_stays_evictable() -> None:
    h = make(size=16, states=4, policy="write_back", eviction="gds")
    c = h.cache
    put(h, [1, 2, 3, 4])
    x = node_at(c, [1, 2, 3, 4])
    h.hc.hold_completions = True
    assert c.evict_states(1).num_states == 0  # the copy is in flight
    assert (h.hc.num_inflight, x.state_slot, x.kv_lock) == (1, 1, 1)
    c.match_prefix([1, 2, 3, 4])
    c.inc_lock_ref(x)  # a request takes X before the copy lands: X stays on device
    h.hc.release_held()
    assert c.poll_transfers() == 1
    c.dec_lock_ref(x)
    assert (ids(node_slots(x)), x.state_slot, c.state_evictable_size()) == ([1, 2, 3, 4], 1, 1)
    r = c.evict_states(1)
    assert (r.num_states, x.state_slot) == (1, None)  # actual: 0 states freed, state 1 stays
    c.sanity_check()  # actual: "state on ... has no current GDS heap entry"


def test_evict_host_counts_every_host_token_it_frees() -> None:
    h = make(size=16, states=4)
    c = h.cache
    put(h, [1, 2, 3, 4, 5, 6])
    put(h, [1, 2, 3, 7], prefix=t64(1, 2, 3))  # U [1,2,3]: no state, host copy 1..3
    u = node_at(c, [1, 2, 3])
    c.inc_lock_ref(u)
    c.evict(16)  # both leaves demote (host-only, host states); U stays on device
    c.dec_lock_ref(u)
    assert c.evict_host(3) == 3 and c.host_size() == 4  # [4,5,6]
    size = c.host_size()
    freed = c.evict_host(1)  # [7]; then U, a dead leaf, leaves with its host copy
    assert c.host_size() == 0 and not c.tree.is_attached(u)
    assert freed == size  # actual: 1, though 4 host tokens were freed
    assert c.stats()["host_evicted_tokens"] == 7  # actual: 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backup_copies_the_data_that_was_on_device() -> None:
    """Backups on CUDA run on a side stream into pinned host memory; what lands on host must
    be the device data (a CPU-side scatter must not read a non-blocking copy before it lands)."""
    from allocators import KVPool, MambaStatePool, TokenAllocator
    from hicache import HiCacheConfig
    from radix import CacheConfig, RadixCache

    pool = KVPool(64, 4, 8, 128, torch.float16, "cuda")
    kv = TokenAllocator(64, pool=pool, device="cuda")
    sp = MambaStatePool(8, 4, (64, 4), (8, 64, 64), device="cuda")
    c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                   hicache=HiCacheConfig(load_back_threshold=1))
    slots = kv.alloc(48)
    pool.k_all[:, slots] = torch.randn(4, 48, 8, 128, device="cuda", dtype=torch.float16)
    pool.v_all[:, slots] = torch.randn(4, 48, 8, 128, device="cuda", dtype=torch.float16)
    s = int(sp.alloc(1)[0])
    sp.conv[:, s] = torch.randn_like(sp.conv[:, s])
    sp.ssm[:, s] = torch.randn_like(sp.ssm[:, s])
    k, v = pool.k_all[:, slots].cpu(), pool.v_all[:, slots].cpu()
    conv, ssm = sp.conv[:, s].cpu(), sp.ssm[:, s].cpu()
    res = c.insert(list(range(1, 49)), slots, state_slot=s)
    torch.cuda.synchronize()
    c.poll_transfers()
    node = res.last_node
    hk, hs = c.hicache.host_kv.pool, c.hicache.host_state  # type: ignore[union-attr]
    assert torch.equal(hk.k_all[:, node.host_value], k) and torch.equal(hk.v_all[:, node.host_value], v)
    assert torch.equal(hs.conv[:, node.host_state_slot], conv)
    assert torch.equal(hs.ssm[:, node.host_state_slot], ssm)
    c.evict(48)
    pool.k_all.zero_()
    assert c.load_back(node) == 48
    assert torch.equal(pool.k_all[:, c.kv.slots(node)].cpu(), k)
    assert torch.equal(sp.conv[:, node.state_slot].cpu(), conv)
