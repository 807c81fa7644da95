"""Allocators and pools: ``n -> slots | None`` and ``slots -> tensors``.

See ``allocators/README.md`` for the contract of each layer. The LoRA adapter slots live in
the subpackage :mod:`allocators.lora` (import them from there); PEFT directories, serving
arguments and the adapter manager over those slots in :mod:`radix.lora`.
"""

from __future__ import annotations

from ._checks import as_index_tensor, check_int, check_positive_int, check_range, resolve_device
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
    "as_index_tensor",
    "check_int",
    "check_positive_int",
    "check_range",
    "cat_slots",
    "host_ids",
    "host_int",
    "resolve_device",
    "slot_copy",
]
