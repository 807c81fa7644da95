"""Layer-by-layer loads (``HiCacheController.layerwise``) and eviction, on the simulated
device with events that never complete on their own (strict: an unordered access raises
where it happens).

A layerwise load leaves the current stream free: the engine waits per layer before it reads
the loaded rows. If the loaded node is evicted before that (its request went away), its
device rows and state slot go back to the allocators while the load stream may still write
them; the next owner writes them on the current stream, and on a GPU the stale load could
land on top. Before the fix the strict simulator refused the next owner's write ("touches
device memory ... wrote without waiting for it"); now an eviction first makes the current
stream wait, on the GPU, for the loads still in flight (no host synchronisation).
"""

from __future__ import annotations

import torch

from allocators import KVPool, MambaStatePool, TokenAllocator
from allocators.host_mirror import host_ids
from bench.dev.gpu.simcuda import OUTSIDE, SimCuda
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache


def _cache(layout: str) -> tuple[RadixCache, KVPool, TokenAllocator, MambaStatePool]:
    pool = KVPool(16, 2, 1, 2, torch.float32, "cuda")
    kv = TokenAllocator(16, pool=pool, device="cuda")
    sp = MambaStatePool(2, 2, (2,), (2,), device="cuda")
    c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                   hicache=HiCacheConfig(load_back_threshold=1, hicache_mem_layout=layout))
    assert c.hicache is not None
    c.hicache.layerwise = True
    return c, pool, kv, sp


def _put(c: RadixCache, pool: KVPool, kv: TokenAllocator, sp: MambaStatePool,
         key: list[int], value: float) -> object:
    slots = kv.alloc(len(key))
    assert slots is not None
    k = torch.full((len(key), 1, 2), value, device="cuda")
    for layer in range(2):
        pool.set_kv(layer, slots, k, k)
    s = sp.alloc_slot()
    assert s is not None
    for layer in range(2):
        sp.set_state(s, layer, torch.full((2,), value, device="cuda"),
                     torch.full((2,), value, device="cuda"))
    return c.insert(key, slots, state_slot=s).last_node


def test_rows_freed_under_a_layerwise_load_reach_their_next_owner_after_it() -> None:
    for layout in ("page_first", "layer_first"):
        with SimCuda(events_complete=False) as sim:
            c, pool, kv, sp = _cache(layout)
            sim.track(c, ["evict", "evict_states", "load_back"], "cache")
            n = _put(c, pool, kv, sp, list(range(1, 9)), 1.0)
            torch.cuda.synchronize()
            c.poll_transfers()
            c.evict(8)
            assert c.load_back(n) == 8  # in flight: nobody waited for it
            hc = c.hicache
            assert hc is not None and hc.last_load is not None
            load = hc.last_load
            rows = host_ids(c.kv.slots(n)).tolist()
            other = kv.alloc(kv.available_size())  # a running request's: the rows left
            assert other is not None
            c.evict(8)  # the request went away before its forward step
            cur = torch.cuda.current_stream()
            assert cur.waited[load.event.stream] >= load.event.seq  # on the GPU
            m = _put(c, pool, kv, sp, list(range(101, 109)), 2.0)  # reuses the rows
            assert host_ids(c.kv.slots(m)).tolist() == rows
            torch.cuda.synchronize()
            assert bool((pool.k_all[:, c.kv.slots(m)].cpu() == 2.0).all())
            assert sim.total_syncs - sim.syncs_of(OUTSIDE) == 0, sim.report()
        assert sim.errors == []


def test_a_state_freed_under_a_layerwise_load_reaches_its_next_owner_after_it() -> None:
    with SimCuda(events_complete=False) as sim:
        c, pool, kv, sp = _cache("page_first")
        n = _put(c, pool, kv, sp, list(range(1, 9)), 1.0)
        torch.cuda.synchronize()
        c.poll_transfers()
        c.evict(8)
        assert c.load_back(n) == 8
        assert c.evict_states(1).num_states == 1  # the loaded state goes with its leaf
        s = sp.alloc_slot()
        t = sp.alloc_slot()
        assert s is not None and t is not None
        for slot in (s, t):  # one of them is the loaded state's slot
            sp.set_state(slot, 0, torch.full((2,), 3.0, device="cuda"),
                         torch.full((2,), 3.0, device="cuda"))
    assert sim.errors == []
