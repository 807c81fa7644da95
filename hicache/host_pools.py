"""Host (L2) pools mirroring the device pools, registered per pool by name.

Each device pool gets a host counterpart of the same layout (layers, heads, head_dim, dtype;
conv / SSM state shapes), on the CPU. When the device is a GPU the host tensors are page-locked
where they are allocated (``allocators.staging.pin_in_place``: never a pageable pool pinned
afterwards, which would hold both copies at once). Sizes: ``hicache_ratio`` x the device pool,
or ``hicache_size`` GB.

    name     device                                        host
    "kv"     TokenAllocator/PagedAllocator + KVPool or     same allocator class, host size,
             KVBuffers (the engine's own K/V tensors)      KVPool on the CPU
    "state"  MambaStatePool                                MambaStatePool, host size, CPU

``hicache_mem_layout`` sets how the host tensors lie (``page_first``: a slot's rows of every
layer adjacent, so a run of consecutive host slots is one contiguous range; ``layer_first``: one
range per layer). Each pair names its tensors as :class:`Lane` s (``"kv"``: K and V;
``"state"``: conv and SSM): what the transfers move, the same way for every pair.

A KV allocator without a pool is an index-only model (replays that count slots and move no
data): allowed on the CPU, refused for a device allocator, whose KV data would silently not
be copied.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from allocators import (
    KVPool,
    KVStorage,
    MambaStatePool,
    PagedAllocator,
    SlotAllocator,
    TokenAllocator,
)
from allocators.free_list import free_list_bytes
from allocators.memory import available_host_memory
from hicache.config import HiCacheConfig


@dataclass(frozen=True)
class Lane:
    """One tensor of a pool pair, as the transfers move it.

    ``device``: one tensor per layer, ``[device_slots, *row]`` (views of the device pool, or an
    engine's own per-layer tensors); ``device_all``: ``[layers, device_slots, *row]`` when one
    tensor holds every layer (a gather is then one kernel), else ``None``; ``host_store``: the
    pinned host tensor itself, contiguous, ``[host_slots, layers, *row]`` (``slot_first``) or
    ``[layers, host_slots, *row]``; ``mapped``: ``host_store`` as a device tensor over the same
    memory (``hicache_io_backend="kernel"``), else ``None``."""

    name: str
    device: tuple[torch.Tensor, ...]
    device_all: torch.Tensor | None
    host_store: torch.Tensor
    slot_first: bool
    mapped: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.device)

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot over every layer."""
        s = self.host_store
        return s[0, 0].numel() * s.element_size() * self.num_layers


@dataclass(frozen=True)
class PoolPair:
    """One device pool and its host mirror (allocators; their ``pool`` holds the tensors),
    and the lanes a transfer moves (none for an index-only KV allocator)."""

    name: str
    device: SlotAllocator
    host: SlotAllocator
    lanes: tuple[Lane, ...] = field(default=(), compare=False)


def kv_lanes(device: SlotAllocator, host: SlotAllocator) -> tuple[Lane, ...]:
    """K and V of a KV pair (none when the allocators hold no tensors)."""
    dp: KVStorage | None = getattr(device, "pool", None)
    hp: KVPool | None = getattr(host, "pool", None)
    if dp is None or hp is None:
        return ()
    out = []
    for name, store in (("k", hp.k_store), ("v", hp.v_store)):
        if isinstance(dp, KVPool):
            every = dp.k_all if name == "k" else dp.v_all
            layers = tuple(every[i] for i in range(dp.num_layers))
            out.append(Lane(name, layers, every, store, hp.slot_first))
        else:
            bufs = dp.k_buffers if name == "k" else dp.v_buffers
            out.append(Lane(name, tuple(bufs), None, store, hp.slot_first))
    return tuple(out)


def state_lanes(device: MambaStatePool, host: MambaStatePool) -> tuple[Lane, ...]:
    """Conv and SSM state of a state pair."""
    return tuple(
        Lane(name, tuple(every[i] for i in range(device.num_layers)), every, store, host.slot_first)
        for name, every, store in (("conv", device.conv, host.conv_store),
                                   ("ssm", device.ssm, host.ssm_store)))


#: Host memory available to new pools [bytes] (``MemAvailable`` bounded by the cgroup's
#: ``memory.max``), ``None`` where not known: the one reading of ``allocators.memory``.
host_memory_budget = available_host_memory


def _host_size(device_size: int, page_size: int, cfg: HiCacheConfig, bytes_per_unit: int,
               by_size: bool = True) -> int:
    """Host units (tokens or state slots): ``hicache_size`` bytes (``by_size``), else
    ``hicache_ratio`` x ``device_size``, reduced to ``hicache_host_memory_fraction`` of
    :func:`host_memory_budget` (when both are known); whole pages."""
    host_bytes = cfg.host_size_bytes if by_size else None
    capped = False
    if host_bytes is not None and bytes_per_unit > 0:
        size = host_bytes // bytes_per_unit
    else:
        want = device_size * cfg.hicache_ratio
        if not math.isfinite(want):
            raise ValueError(f"hicache_ratio={cfg.hicache_ratio} x the device pool ({device_size} "
                             "units) is not a finite host pool size; give a smaller ratio")
        size = int(want)
        frac = None if cfg.hicache_size else cfg.hicache_host_memory_fraction
        budget = host_memory_budget() if frac is not None and bytes_per_unit > 0 else None
        if frac is not None and budget is not None:
            fit = int(budget * frac) // bytes_per_unit
            capped = fit < size
            size = min(size, fit)
    size -= size % page_size
    if size <= device_size:
        if capped:
            raise ValueError(
                f"hicache_host_memory_fraction={cfg.hicache_host_memory_fraction}: of the host "
                f"memory available ({host_memory_budget()} bytes) the host pool gets {size} "
                f"units, not more than the device pool ({device_size}); raise the fraction, "
                "set it to None or give hicache_size")
        raise ValueError(
            f"host pool of {size} units must be larger than the device pool ({device_size}); "
            "raise hicache_ratio or hicache_size"
        )
    return size


#: Host bytes one more id costs a host allocator's free list (``free_list_bytes``).
_FREE_ID_BYTES = free_list_bytes(2) - free_list_bytes(1)


def kv_demand(device: SlotAllocator) -> tuple[int, int, int]:
    """``(device tokens, page size, bytes per token)`` of a KV allocator (0 bytes without a
    pool: an index-only model, whose host mirror holds no tensors)."""
    pool: KVStorage | None = getattr(device, "pool", None)
    return device.size, device.page_size, pool.bytes_per_token if pool is not None else 0


def fit_host_ratio(cfg: HiCacheConfig, demands: Sequence[tuple[int, int, int]]) -> HiCacheConfig:
    """``cfg`` with ``hicache_ratio`` reduced so the host pools of every device pool in
    ``demands`` (``(device units, page size, bytes per unit)``, each mirrored by the ratio)
    take at most ``hicache_host_memory_fraction`` of :func:`host_memory_budget` together;
    ``cfg`` itself when they fit, when ``hicache_size`` sizes the pools, or with no fraction
    or budget. (Each pool alone is also capped where it is built: :func:`_host_size`.)

    Raises:
        ValueError: at the reduced ratio some host pool would not be larger than its device
            pool, naming ``hicache_host_memory_fraction``.
    """
    frac = cfg.hicache_host_memory_fraction
    # host bytes at ratio 1: the pools' rows and their allocators' free lists (one id a page)
    per_ratio = sum(units * bpu + units // page * _FREE_ID_BYTES for units, page, bpu in demands)
    if cfg.hicache_size or frac is None or per_ratio <= 0:
        return cfg
    budget = host_memory_budget()
    if budget is None:
        return cfg
    ratio = budget * frac / per_ratio
    if ratio >= cfg.hicache_ratio:
        return cfg
    for units, page, _ in demands:
        size = int(units * ratio)
        if size - size % page <= units:
            raise ValueError(
                f"hicache_host_memory_fraction={frac}: of the host memory available ({budget} "
                f"bytes) the host pools ({per_ratio} bytes per unit of hicache_ratio) fit at a "
                f"ratio of {ratio:.3f}, where a host pool ({size - size % page} units) is not "
                f"larger than its device pool ({units}); raise the fraction, set it to None or "
                "give hicache_size")
    fitted = copy.copy(cfg)
    object.__setattr__(fitted, "hicache_ratio", ratio)  # a frozen copy: the checks stand
    return fitted


def mirror_kv(device: SlotAllocator, cfg: HiCacheConfig) -> SlotAllocator:
    """A host allocator (and KVPool, when the device has a pool) mirroring ``device``.

    Raises:
        ValueError: the host pool would not be larger than the device pool, or ``device``
            lives on a GPU without a pool (``KVPool``, or ``KVBuffers`` over the engine's own
            K/V tensors): its backups would copy no data.
    """
    ps = device.page_size
    pool: KVStorage | None = getattr(device, "pool", None)
    if pool is None and device.device.type != "cpu":
        raise ValueError(
            f"hicache on {device.device} needs the KV tensors behind the KV allocator: give it "
            "pool=KVPool(...) or pool=KVBuffers(k_buffers, v_buffers) over the engine's own "
            "per-layer K/V tensors (without one, backups and load-backs would copy nothing)"
        )
    size = _host_size(device.size, ps, cfg, pool.bytes_per_token if pool is not None else 0)
    host_pool = None
    if pool is not None:
        host_pool = KVPool(size, pool.num_layers, pool.num_heads, pool.head_dim, pool.dtype,
                           "cpu", page_size=ps, pin_memory=pool.device.type == "cuda",
                           layout=cfg.hicache_mem_layout)
    if ps == 1:
        return TokenAllocator(size, pool=host_pool)
    return PagedAllocator(size, ps, pool=host_pool)


def mirror_state(device: MambaStatePool, cfg: HiCacheConfig) -> MambaStatePool:
    """A host state pool of the same shapes, ``hicache_ratio`` x the device slots (a slot's
    layers adjacent with ``hicache_mem_layout="page_first"``); its slots are not zeroed on
    ``alloc`` (a copy fills each one whole)."""
    size = _host_size(device.size, 1, cfg, device.bytes_per_slot, by_size=False)
    return MambaStatePool(size, device.num_layers, device.conv_state_shape,
                          device.ssm_state_shape, dtype=device.dtype, device="cpu",
                          pin_memory=device.device.type == "cuda",
                          slot_first=cfg.hicache_mem_layout == "page_first", zero_on_alloc=False)


def copy_kv(src: SlotAllocator, src_slots: torch.Tensor, dst: SlotAllocator,
            dst_slots: torch.Tensor) -> None:
    """Copy K and V of every layer ``src_slots[i] -> dst_slots[i]`` between two pools,
    synchronously (the CPU path of the transfers; on a GPU ``HiCacheController`` stages its
    copies asynchronously instead). One gather + one scatter per direction for all layers; a
    no-op when the allocators hold no tensors (index-only replays)."""
    sp: KVStorage | None = getattr(src, "pool", None)
    dp: KVStorage | None = getattr(dst, "pool", None)
    if sp is None or dp is None or src_slots.numel() == 0:
        return
    k, v = sp.gather(src_slots.to(sp.device))
    dp.scatter(dst_slots.to(dp.device), k.to(dp.device), v.to(dp.device))


def copy_state(src: MambaStatePool, src_slot: int, dst: MambaStatePool, dst_slot: int) -> None:
    """Copy every layer's conv and SSM state of one slot between two state pools,
    synchronously (see :func:`copy_kv`)."""
    dst.conv[:, dst_slot].copy_(src.conv[:, src_slot])
    dst.ssm[:, dst_slot].copy_(src.ssm[:, src_slot])
