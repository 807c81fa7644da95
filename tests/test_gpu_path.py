"""The CUDA path, proven on the CPU with the simulated device (bench/gpu/simcuda.py, strict: an
unordered copy, a mixed-device operation or a device value read by host code fails the test
where it happens): HiCache copies bit-exact through the pinned staging ring, ordered by
events, load-back asynchronous with the current stream waiting for it, an engine's own K/V
tensors copied through ``KVBuffers``, the host waiting only where the docstrings say, and the
host mirrors that keep device values off the host. The two bugs the audit found are in
``test_gpu_bugs.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from allocators import (
    KVBuffers,
    KVPool,
    MambaStatePool,
    TokenAllocator,
    cat_slots,
)
from allocators.host_mirror import MISSES, mirror_of
from bench.gpu.simcuda import OUTSIDE, SimCuda
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, RadixCache
from tests.cache_helpers import node_slots

L, H, D = 3, 2, 4  # KV layers, heads, head dim of the pools below


@contextmanager
def cuda(**kw: bool) -> Iterator[SimCuda]:
    """A strict simulator; the test also checks that no device tensor went without a mirror."""
    before = sum(MISSES.values())
    with SimCuda(**kw) as sim:
        yield sim
    assert sum(MISSES.values()) == before, f"device tensors read without a mirror: {MISSES}"


def tracked_syncs(sim: SimCuda) -> int:
    """Syncs inside tracked library calls (a test's own reads and checks are outside them)."""
    return sum(s.total for op, s in sim.ops.items() if op != OUTSIDE)


CACHE_CALLS = ["insert", "match_prefix", "evict", "evict_states", "load_back", "poll_transfers",
               "inc_lock_ref", "dec_lock_ref", "cache_finished_req", "cache_unfinished_req"]


def fill(pool: KVPool | KVBuffers, slots: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write random K/V into ``slots`` of every layer; return what was written (on the host)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, len(slots), H, D, generator=g).to(pool.dtype)
    v = torch.randn(L, len(slots), H, D, generator=g).to(pool.dtype)
    pool.scatter(slots, k.to(pool.device), v.to(pool.device))
    return k, v


def device_rows(pool: KVPool | KVBuffers, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = pool.gather(slots)
    return k.cpu(), v.cpu()  # a test's read: it synchronises, outside the cache's calls


# ======================================================================= HiCache
def hicache_cache(*, buffers: bool = False,
                  **cfg: Any) -> tuple[RadixCache, tuple[Any, TokenAllocator, MambaStatePool]]:
    """A hybrid cache with a host tier on the simulated device, its KV in a ``KVPool`` or in
    the engine's own per-layer tensors (``KVBuffers``)."""
    if buffers:  # the engine's own per-layer tensors, behind the pool interface
        pool: KVPool | KVBuffers = KVBuffers(
            [torch.zeros(65, H, D, device="cuda") for _ in range(L)],
            [torch.zeros(65, H, D, device="cuda") for _ in range(L)])
    else:
        pool = KVPool(64, L, H, D, torch.float32, "cuda")
    kv = TokenAllocator(64, pool=pool, device="cuda")
    sp = MambaStatePool(8, 2, (3, 2), (2, 2, 2), device="cuda")
    c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                   hicache=HiCacheConfig(load_back_threshold=1, **cfg))
    return c, (pool, kv, sp)


@pytest.mark.parametrize("buffers", [False, True], ids=["KVPool", "KVBuffers"])
def test_backup_and_load_back_are_bit_exact_ordered_and_never_wait(buffers: bool) -> None:
    with cuda() as sim:
        c, (pool, kv, sp) = hicache_cache(buffers=buffers)
        slots = kv.alloc(48)
        k, v = fill(pool, slots, 0)
        s = sp.alloc(1)
        sp.conv.index_copy_(1, s, torch.randn(2, 1, 3, 2).to("cuda"))
        conv = sp.conv[:, 1].cpu()
        res = c.insert(list(range(1, 49)), slots, state_slot=s)  # write_through: backed up
        node = res.last_node
        assert c.poll_transfers() == 0 and c.hicache is not None and c.hicache.num_inflight == 0
        hp = c.hicache.host_kv.pool
        hs = c.hicache.host_state
        assert torch.equal(hp.k_all[:, node.host_value], k)  # what was on device, bit for bit
        assert torch.equal(hp.v_all[:, node.host_value], v)
        assert hs is not None and torch.equal(hs.conv[:, node.host_state_slot], conv)
        c.evict(48)  # demoted: host-only
        assert node.kv_value is None
        for buf in ([pool.k_all, pool.v_all] if isinstance(pool, KVPool) else pool.k_buffers):
            buf.zero_()
        sp.conv.zero_()
        assert c.load_back(node) == 48
        got_k, got_v = device_rows(pool, node_slots(node))
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert torch.equal(sp.conv[:, node.state_slot].cpu(), conv)
        c.sanity_check()
    assert sim.errors == []  # strict: an unordered copy would have raised where it happened


def test_every_cache_call_of_a_backup_and_load_back_is_sync_free() -> None:
    with cuda() as sim:
        c, (pool, kv, sp) = hicache_cache()
        sim.track(c, CACHE_CALLS, "cache")
        sim.track(kv, ["alloc", "free"], "kv")
        sim.track(sp, ["alloc", "free", "copy"], "state")
        for i in range(3):
            slots = kv.alloc(16)
            fill(pool, slots, i)
            s = sp.alloc(1)
            c.insert(list(range(100 * i + 1, 100 * i + 17)), slots, state_slot=s)
        c.evict(48)
        m = c.match_prefix(list(range(1, 17)))
        assert m.host_hit_length == 16 and c.load_back(m.last_host_node) == 16
        m = c.match_prefix(list(range(1, 17)))
        lock = c.inc_lock_ref(m.last_device_node)
        mine = sp.alloc(1)
        sp.copy(m.state_slot, mine)
        c.dec_lock_ref(lock)
        sp.free(mine)
        hc = c.hicache
        assert hc is not None and hc.last_load is not None
        # the current stream waits for the load (on the GPU, not the host)
        cur = torch.cuda.current_stream()
        assert cur.waited[hc.last_load.event.stream] >= hc.last_load.event.seq
    assert sim.ops["cache.load_back"].calls == 1
    assert tracked_syncs(sim) == 0, sim.report()


def test_a_gpu_kv_allocator_without_its_tensors_is_refused() -> None:
    with cuda():
        with pytest.raises(ValueError, match="KVBuffers"):
            RadixCache(kv_allocator=TokenAllocator(64, device="cuda"),
                       hicache=HiCacheConfig())


def test_the_staging_ring_is_reused_not_allocated_per_copy() -> None:
    with cuda() as sim:
        c, (pool, kv, sp) = hicache_cache()
        hc = c.hicache
        assert hc is not None
        first = None
        for i in range(12):
            slots = kv.alloc(4)
            fill(pool, slots, i)
            c.insert(list(range(10 * i + 1, 10 * i + 5)), slots, state_slot=sp.alloc(1))
            c.evict(4)
            sp_free = sp.available_size()
            assert sp_free > 0
            if first is None:
                first = len(sim.pinned_allocs)
        assert len(sim.pinned_allocs) == first and hc.staging_waits == 0


def test_a_ring_smaller_than_the_copies_in_flight_waits_and_stays_exact() -> None:
    """Events never complete on their own: every reuse of the small ring is a counted wait,
    and the data still lands exactly."""
    with cuda(events_complete=False) as sim:
        pool = KVPool(64, L, H, D, torch.float32, "cuda")
        kv = TokenAllocator(64, pool=pool, device="cuda")
        c = RadixCache(kv_allocator=kv, hicache=HiCacheConfig(load_back_threshold=1))
        hc = c.hicache
        assert hc is not None
        hc._ring = type(hc._ring)(4096, on_full=hc._finish_oldest_chunk)  # a small ring
        written = []
        for i in range(6):
            slots = kv.alloc(8)
            written.append((fill(pool, slots, i), c.insert(list(range(10 * i + 1, 10 * i + 9)),
                                                           slots).last_node))
        assert hc.staging_waits > 0
        torch.cuda.synchronize()
        c.poll_transfers()
        hp = hc.host_kv.pool
        for (k, v), node in written:
            assert torch.equal(hp.k_all[:, node.host_value], k)
            assert torch.equal(hp.v_all[:, node.host_value], v)
    assert sim.errors == []


def test_a_load_of_a_state_still_being_written_waits_for_it() -> None:
    """Events never complete on their own. A state set on a node after its KV's backup is
    copied to the host asynchronously; its device state is then evicted while that copy is in
    flight; bringing the state back must wait for the copy (its only syncs) and get its data."""
    with cuda(events_complete=False) as sim:
        c, (pool, kv, sp) = hicache_cache()
        slots = kv.alloc(16)
        fill(pool, slots, 1)
        c.insert(list(range(1, 17)), slots, state_slot=sp.alloc(1))  # N16 (KV + state)
        torch.cuda.synchronize()
        c.poll_transfers()  # landed: N16 unlocked
        s = sp.alloc(1)
        sp.ssm.index_copy_(1, s, torch.full((2, 1, 2, 2, 2), 7.0).to("cuda"))
        c.insert(list(range(1, 9)), slots[:8], state_slot=s)  # splits: N8 takes the state
        n8 = c.match_prefix(list(range(1, 9))).last_device_node
        assert n8.host_value is not None and n8.host_state_slot is not None
        assert c.evict_states(2).num_states == 2  # N16 demoted, N8 loses its device state
        assert n8.state_slot is None and n8.kv_value is not None
        before = sim.total_syncs
        assert c.load_back(n8) == 0 and n8.state_slot is not None  # the state alone came back
        hc = c.hicache
        assert hc is not None and hc.load_waits == 2  # the write's two chunks: conv and SSM
        assert sim.total_syncs == before + 2  # those waits, nothing else
        assert (sp.ssm[:, n8.state_slot].cpu() == 7.0).all()
        c.sanity_check()
    assert sim.errors == []


# ============================================================ mirrors, engine rows
def test_request_rows_built_with_cat_slots_keep_their_mirrors() -> None:
    with cuda() as sim:
        kv = TokenAllocator(64, device="cuda")
        sp = MambaStatePool(4, device="cuda")
        c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp)
        sim.track(c, CACHE_CALLS, "cache")
        first = kv.alloc(8)
        c.insert(list(range(1, 9)), first, state_slot=sp.alloc(1))
        m = c.match_prefix(list(range(1, 13)))
        own = kv.alloc(4)
        row = cat_slots((m.device_indices, own))
        assert mirror_of(row) is not None and mirror_of(row[8:]) is not None
        assert mirror_of(torch.cat((m.device_indices, own))) is None  # torch.cat alone: none
        req = CacheRequest(key=list(range(1, 13)), kv_indices=row, cached_len=8,
                           last_node=m.last_device_node, lock=c.inc_lock_ref(m.last_device_node))
        res = c.cache_finished_req(req, state_slot=sp.alloc(1))
        assert res.inserted_len == 12
        c.sanity_check()
    assert tracked_syncs(sim) == 0 and sim.ops["cache.cache_finished_req"].calls == 1


def test_a_device_tensor_without_a_mirror_costs_one_sync_and_is_counted() -> None:
    with SimCuda() as sim:
        kv = TokenAllocator(64, device="cuda")
        c = RadixCache(CacheConfig(), kv_allocator=kv)
        slots = kv.alloc(8)
        assert slots is not None
        before = MISSES["value"]
        engine_row = slots.clone()  # the engine's own tensor: the library never saw it
        sim.track(c, ["insert"], "cache")
        c.insert(list(range(1, 9)), engine_row)
        assert sim.syncs_of("cache.insert") == 1 and MISSES["value"] == before + 1
        c.sanity_check()


def test_an_in_place_write_invalidates_the_mirror() -> None:
    with cuda():
        kv = TokenAllocator(16, device="cuda")
        slots = kv.alloc(4)
        assert slots is not None and mirror_of(slots) is not None
        slots[0:1].fill_(9)  # the engine rewrote it: the host copy is stale
        assert mirror_of(slots) is None and mirror_of(slots[1:]) is None


def test_a_strided_views_mirror_equals_the_view_on_the_host() -> None:
    """``mirror_of(t[::2])`` is the host copy of the strided view itself (every other slot,
    from the view's offset), not of the tensor it views."""
    with cuda():
        kv = TokenAllocator(16, device="cuda")
        slots = kv.alloc(8)
        assert slots is not None
        host = slots.cpu().tolist()
        views = (slots[::2], slots[1::2], slots[1:7:3], slots[5:6])
        expected = (host[::2], host[1::2], host[1:7:3], host[5:6])
        for view, want in zip(views, expected, strict=True):
            got = mirror_of(view)
            assert got is not None and got.tolist() == want
