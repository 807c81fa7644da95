"""An SWA cache with a host tier (and, optionally, L3) and every pool around it, for the tests.

:class:`SWAHostRig` builds the full and SWA KV pools (float32 on the CPU), the
``SWAAllocator`` over them, an optional ``MambaStatePool`` and the ``RadixCache`` with its
``HiCacheController``; :meth:`SWAHostRig.insert` caches a key with fresh random KV.
"""

from __future__ import annotations

from typing import Any

import torch

from allocators import KVPool, MambaStatePool, SWAAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import random_bits


class SWAHostRig:
    """One SWA cache with a host tier, and every pool around it.

    ``full`` / ``swa_size``: the device full and SWA pool sizes [tokens]; ``dim``: layers
    and head size of both pools, one head (and the state pool's layers); ``states``: the state
    pool's size (0: no state pool); ``state_dims``: its (conv, ssm) state shapes; ``gen``:
    the generator of the random KV; ``hicache`` adds to the ``HiCacheConfig`` (L3 keys).
    """

    def __init__(self, full: int, swa_size: int, page_size: int, window: int, *,
                 dim: int, states: int, state_dims: tuple[tuple[int, ...], tuple[int, ...]],
                 policy: str, gen: torch.Generator | None = None, **hicache: Any) -> None:
        self.full = KVPool(full, dim, 1, dim, torch.float32, "cpu", page_size=page_size)
        self.swa = KVPool(swa_size, dim, 1, dim, torch.float32, "cpu", page_size=page_size)
        self.kv = SWAAllocator(full, swa_size, page_size, full_pool=self.full, swa_pool=self.swa)
        self.sp = (MambaStatePool(states, num_layers=dim, conv_state_shape=state_dims[0],
                                  ssm_state_shape=state_dims[1]) if states else None)
        self.cache = RadixCache(
            CacheConfig(page_size=page_size, sliding_window_size=window), kv_allocator=self.kv,
            state_allocator=self.sp,
            hicache=HiCacheConfig(hicache_ratio=2.0, hicache_write_policy=policy,
                                  load_back_threshold=1, **hicache))
        hc = self.cache.hicache
        assert hc is not None
        self.hc = hc
        self.gen = gen if gen is not None else torch.Generator().manual_seed(37)

    def insert(self, key: list[int], prefix: torch.Tensor | None = None,
               tombstone: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Insert ``key``: fresh slots (random full and SWA KV; V is -K) after ``prefix``; the
        first ``tombstone`` new tokens' SWA KV released before (as a request's out-of-window
        KV); a fresh state (random) on a hybrid cache. Returns (fresh slots, full K bits, SWA
        K bits, state conv bits or None) for the new tokens."""
        prefix = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
        fresh = self.kv.alloc(len(key) - len(prefix))
        assert fresh is not None
        shape = (self.full.k_all.shape[0], len(fresh), *self.full.k_all.shape[2:])
        fk = random_bits(shape, torch.float32, self.gen)
        sk = random_bits(shape, torch.float32, self.gen)
        self.full.k_all[:, fresh] = fk
        self.full.v_all[:, fresh] = -fk
        self.swa.k_all[:, self.kv.translate(fresh)] = sk
        self.swa.v_all[:, self.kv.translate(fresh)] = -sk
        if tombstone:
            self.kv.free_swa(fresh[:tombstone])
        slot = st = None
        if self.sp is not None:
            got = self.sp.alloc(1)
            assert got is not None
            slot = int(got[0])
            st = random_bits(tuple(self.sp.conv[:, slot].shape), torch.float32, self.gen)
            self.sp.conv[:, slot] = st
        res = self.cache.insert(key, torch.cat([prefix, fresh]), state_slot=slot)
        assert len(res.duplicate_indices) == 0
        self.cache.sanity_check()
        return fresh, fk, sk, st
