"""Pools on different devices under one host tier (the simulated device, ``SimCuda``).

The host tier copies every pool pair with the streams and index tensors of one device, the
KV pool's. A state pool on another device used to be accepted and the first backup failed
inside the copy (a GPU's "indices on cuda, tensor on cpu" error, in ``_gather``); it is
refused when the cache is built, naming ``state_allocator``, before anything is allocated.
"""

from __future__ import annotations

import pytest
import torch

from allocators import KVPool, MambaStatePool, TokenAllocator
from bench.dev.gpu.simcuda import SimCuda
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache


@pytest.mark.parametrize(("kv_device", "state_device"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_state_pool_on_another_device_than_the_kv_pool_is_refused(kv_device: str,
                                                                    state_device: str) -> None:
    with SimCuda() as sim:
        pool = KVPool(32, 2, 2, 4, torch.float32, kv_device)
        kv = TokenAllocator(32, pool=pool, device=kv_device)
        sp = MambaStatePool(4, 2, (3, 2), (2, 2, 2), device=state_device)
        with pytest.raises(ValueError, match="state_allocator"):
            RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                       hicache=HiCacheConfig(load_back_threshold=1))
        assert (kv.available_size(), sp.available_size()) == (32, 4)
    assert sim.errors == []


def test_pools_on_one_device_with_an_allocator_handing_out_cpu_ids_still_work() -> None:
    """(What the check must not refuse: the allocator's ``device`` is where its ids go, not
    where the data is; a KV pool and a state pool on the GPU are one device.)"""
    with SimCuda() as sim:
        pool = KVPool(32, 2, 2, 4, torch.float32, "cuda")
        kv = TokenAllocator(32, pool=pool)  # ids on the CPU
        sp = MambaStatePool(4, 2, (3, 2), (2, 2, 2), device="cuda")
        c = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp,
                       hicache=HiCacheConfig(load_back_threshold=1))
        slots = kv.alloc(8)
        assert slots is not None
        k = torch.arange(64, dtype=torch.float32).view(8, 2, 4)
        pool.set_kv(0, slots, k.to("cuda"), -k.to("cuda"))
        node = c.insert(list(range(1, 9)), slots, state_slot=sp.alloc_slot()).last_node
        c.evict(8)
        assert node.kv_value is None and c.load_back(node) == 8
        got = pool.get_kv(0, c.match_prefix(list(range(1, 9))).device_indices)[0]
        assert torch.equal(got.cpu(), k)
    assert sim.errors == []
