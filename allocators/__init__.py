"""Allocators and pools: ``n -> slots | None`` and ``slots -> tensors``.

See ``allocators/README.md`` for the contract of each layer. The LoRA adapter slots live in
the subpackage :mod:`allocators.lora` (import them from there).
"""

from __future__ import annotations

from ._checks import resolve_device
from .base import AllocatorSnapshot, SlotAllocator
from .host_mirror import cat_slots, host_ids, host_int, slot_copy
from .kv_pool import KVBuffers, KVPool, KVStorage
from .state_pool import MambaStatePool
from .swa import SWAAllocator, SWAAllocatorSnapshot
from .token_allocator import PagedAllocator, TokenAllocator
from .txn import AllocTxn, alloc_all

__all__ = [
    "AllocTxn",
    "AllocatorSnapshot",
    "KVBuffers",
    "KVPool",
    "KVStorage",
    "MambaStatePool",
    "PagedAllocator",
    "SWAAllocator",
    "SWAAllocatorSnapshot",
    "SlotAllocator",
    "TokenAllocator",
    "alloc_all",
    "cat_slots",
    "host_ids",
    "host_int",
    "resolve_device",
    "slot_copy",
]
