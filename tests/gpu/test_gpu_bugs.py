"""Regressions of the CUDA path, each a minimal repro in the simulated device (bench/dev/gpu/simcuda.py,
strict), each failing before its fix. They use only the API that existed before the fix, so
they can be run against the old code.

* ``torch.device("cuda") != torch.device("cuda", 0)``: an allocator built on ``"cuda"`` kept
  the unresolved device, slots arrive on ``cuda:0``, and every insert was refused ("value is on
  cuda:0, the KV allocator on cuda").
* HiCache backups copied device -> host ``non_blocking`` into a fresh pinned temporary and read
  it at once into the host pool (the event covered only the copy into the temporary): the host
  pool got whatever the temporary held. The host pools were pinned by copying pageable ones
  (both copies alive at once).
"""

from __future__ import annotations

import torch

from allocators import KVPool, MambaStatePool, TokenAllocator
from bench.dev.gpu.simcuda import SimCuda
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache


def test_an_allocator_built_on_cuda_accepts_its_own_slots() -> None:
    with SimCuda():
        kv = TokenAllocator(64, device="cuda")
        c = RadixCache(CacheConfig(), kv_allocator=kv)
        slots = kv.alloc(8)
        assert slots is not None
        res = c.insert(list(range(1, 9)), slots)  # before: ValueError, cuda:0 vs cuda
        m = c.match_prefix(list(range(1, 9)))
        assert (res.inserted_len, m.prefix_len) == (8, 8)
        assert m.device_indices.cpu().tolist() == list(range(1, 9))
        c.sanity_check()


def test_a_backup_reaches_the_host_pool_only_after_its_copy_landed_and_is_bit_exact() -> None:
    with SimCuda(strict=True) as sim:
        pool = KVPool(64, 2, 2, 4, torch.float32, "cuda:0")
        kv = TokenAllocator(64, pool=pool, device="cuda:0")
        sp = MambaStatePool(8, 2, (3, 2), (2, 2, 2), device="cuda:0")
        c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                       hicache=HiCacheConfig(load_back_threshold=1))
        slots = kv.alloc(24)
        assert slots is not None
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(2, 24, 2, 4, generator=g), torch.randn(2, 24, 2, 4, generator=g)
        pool.k_all[:, slots] = k.to("cuda:0")
        pool.v_all[:, slots] = v.to("cuda:0")
        got = sp.alloc(1)
        assert got is not None
        state = int(got[0])
        conv = torch.randn(2, 3, 2, generator=g)
        sp.conv[:, state] = conv.to("cuda:0")
        # before: AssertionError "read or write of a non_blocking copy's destination before
        # the event that covers it" inside the backup
        node = c.insert(list(range(1, 25)), slots, state_slot=state).last_node
        torch.cuda.synchronize()
        c.poll_transfers()
        hc = c.hicache
        assert hc is not None and hc.host_state is not None
        hp = hc.host_kv.pool
        assert torch.equal(hp.k_all[:, node.host_value], k)
        assert torch.equal(hp.v_all[:, node.host_value], v)
        assert torch.equal(hc.host_state.conv[:, node.host_state_slot], conv)
        c.evict(24)
        pool.k_all.zero_()
        assert c.load_back(node) == 24
        assert torch.equal(pool.k_all[:, c.kv.slots(node)].cpu(), k)
        assert torch.equal(sp.conv[:, node.state_slot].cpu(), conv)
    assert sim.errors == []


def test_host_pools_are_pinned_where_they_are_allocated() -> None:
    with SimCuda() as sim:
        pool = KVPool(64, 2, 2, 4, torch.float32, "cuda:0")
        kv = TokenAllocator(64, pool=pool, device="cuda:0")
        sp = MambaStatePool(8, 2, (3, 2), (2, 2, 2), device="cuda:0")
        c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp, hicache=HiCacheConfig())
        hc = c.hicache
        assert hc is not None and hc.host_state is not None
        hp = hc.host_kv.pool
        assert hp.k_all.is_pinned() and hp.v_all.is_pinned()
        assert hc.host_state.conv.is_pinned() and hc.host_state.ssm.is_pinned()
    assert sim.pinned_copies == []  # before: four pin_memory() copies of pageable pools
