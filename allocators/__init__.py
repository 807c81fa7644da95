"""Allocators and pools: ``n -> slots | None`` and ``slots -> tensors``.

See ``allocators/README.md`` for the contract of each layer. The LoRA adapter slots live in
the subpackage :mod:`allocators.lora` (import them from there).
"""

from __future__ import annotations

from .base import AllocatorSnapshot, SlotAllocator
from .kv_pool import KVPool
from .state_pool import MambaStatePool
from .swa import SWAAllocator, SWAAllocatorSnapshot
from .token_allocator import PagedAllocator, TokenAllocator
from .txn import AllocTxn, alloc_all

__all__ = [
    "AllocTxn",
    "AllocatorSnapshot",
    "KVPool",
    "MambaStatePool",
    "PagedAllocator",
    "SWAAllocator",
    "SWAAllocatorSnapshot",
    "SlotAllocator",
    "TokenAllocator",
    "alloc_all",
]
