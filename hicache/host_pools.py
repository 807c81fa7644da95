"""Host (L2) pools mirroring the device pools, registered per pool by name.

Each device pool gets a host counterpart of the same layout (layers, heads, head_dim, dtype;
conv / SSM state shapes), on the CPU, in pinned memory when the device is CUDA (so copies can
be asynchronous). Sizes: ``hicache_ratio`` x the device pool, or ``hicache_size`` GB.

    name     device                       host
    "kv"     TokenAllocator/PagedAllocator + KVPool    same class, host size, CPU tensors
    "state"  MambaStatePool               MambaStatePool, host size, CPU tensors
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from allocators import KVPool, MambaStatePool, PagedAllocator, SlotAllocator, TokenAllocator
from hicache.config import HiCacheConfig


@dataclass(frozen=True)
class PoolPair:
    """One device pool and its host mirror (allocators; their ``pool`` holds the tensors)."""

    name: str
    device: SlotAllocator
    host: SlotAllocator


def _host_size(device_size: int, page_size: int, cfg: HiCacheConfig, bytes_per_unit: int) -> int:
    host_bytes = cfg.host_size_bytes
    if host_bytes is not None and bytes_per_unit > 0:
        size = host_bytes // bytes_per_unit
    else:
        size = int(device_size * cfg.hicache_ratio)
    size -= size % page_size
    if size <= device_size:
        raise ValueError(
            f"host pool of {size} units must be larger than the device pool ({device_size}); "
            "raise hicache_ratio or hicache_size"
        )
    return size


def mirror_kv(device: SlotAllocator, cfg: HiCacheConfig) -> SlotAllocator:
    """A host allocator (and KVPool, when the device has one) mirroring ``device``."""
    ps = device.page_size
    pool: KVPool | None = getattr(device, "pool", None)
    size = _host_size(device.size, ps, cfg, pool.bytes_per_token if pool is not None else 0)
    host_pool = None
    if pool is not None:
        host_pool = KVPool(size, pool.num_layers, pool.num_heads, pool.head_dim, pool.dtype,
                           "cpu", page_size=ps)
        if pool.device.type == "cuda":
            host_pool.k_all = host_pool.k_all.pin_memory()
            host_pool.v_all = host_pool.v_all.pin_memory()
    if ps == 1:
        return TokenAllocator(size, pool=host_pool)
    return PagedAllocator(size, ps, pool=host_pool)


def mirror_state(device: MambaStatePool, cfg: HiCacheConfig) -> MambaStatePool:
    """A host state pool of the same shapes, ``hicache_ratio`` x the device slots."""
    size = _host_size(device.size, 1, cfg, 0)
    host = MambaStatePool(size, device.num_layers, device.conv_state_shape,
                          device.ssm_state_shape, dtype=device.dtype, device="cpu")
    if device.device.type == "cuda":
        host.conv = host.conv.pin_memory()
        host.ssm = host.ssm.pin_memory()
    return host


def copy_kv(src: SlotAllocator, src_slots: torch.Tensor, dst: SlotAllocator,
            dst_slots: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy K and V of every layer ``src_slots[i] -> dst_slots[i]`` between two pools.

    One gather + one scatter per direction for all layers; a no-op when the allocators hold
    no tensors (index-only replays).
    """
    sp: KVPool | None = getattr(src, "pool", None)
    dp: KVPool | None = getattr(dst, "pool", None)
    if sp is None or dp is None or src_slots.numel() == 0:
        return
    s = src_slots.to(sp.device)
    d = dst_slots.to(dp.device)
    dp.k_all[:, d] = sp.k_all[:, s].to(dp.device, non_blocking=non_blocking)
    dp.v_all[:, d] = sp.v_all[:, s].to(dp.device, non_blocking=non_blocking)


def copy_state(src: MambaStatePool, src_slot: int, dst: MambaStatePool, dst_slot: int,
               non_blocking: bool = False) -> None:
    """Copy every layer's conv and SSM state of one slot between two state pools."""
    dst.conv[:, dst_slot] = src.conv[:, src_slot].to(dst.device, non_blocking=non_blocking)
    dst.ssm[:, dst_slot] = src.ssm[:, src_slot].to(dst.device, non_blocking=non_blocking)
