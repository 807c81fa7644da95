"""Allocators and pools: ``n -> slots | None`` and ``slots -> tensors``.

See ``allocators/README.md`` for the contract of each layer.
"""

from __future__ import annotations

from .base import AllocatorSnapshot, SlotAllocator
from .kv_pool import KVPool
from .lora import (
    BASE_MODEL,
    LoraAdapter,
    LoraArgs,
    LoraBatch,
    LoraBatchError,
    LoraManager,
    LoraMemoryPool,
    LoraUid,
    lora_extra_key,
)
from .state_pool import MambaStatePool
from .swa import SWAAllocator, SWAAllocatorSnapshot
from .token_allocator import PagedAllocator, TokenAllocator
from .txn import AllocTxn, alloc_all

__all__ = [
    "AllocTxn",
    "AllocatorSnapshot",
    "BASE_MODEL",
    "KVPool",
    "LoraAdapter",
    "LoraArgs",
    "LoraBatch",
    "LoraBatchError",
    "LoraManager",
    "LoraMemoryPool",
    "LoraUid",
    "MambaStatePool",
    "PagedAllocator",
    "SWAAllocator",
    "SWAAllocatorSnapshot",
    "SlotAllocator",
    "TokenAllocator",
    "alloc_all",
    "lora_extra_key",
]
