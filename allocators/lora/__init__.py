"""LoRA adapter slots: the public names. Import from here, never from the modules below.
PEFT directories, SGLang's serving arguments and the adapter manager over this pool live in
:mod:`radix.lora`.

| module | what it holds |
|---|---|
| ``identity`` | which adapter a request runs with: ``LoraUid`` (one per load), ``BASE_MODEL`` |
| ``weights`` | ``LoraAdapter``: one adapter's A / B weights and scaling in host memory |
| ``modules`` | base-model module paths and shapes, target-module name matching |
| ``eviction_policy`` | ``mark_used / select_victim / remove``: ``lru`` (default), ``fifo`` |
| ``slots`` | ``slots -> tensors``: A / B / scaling buffers, slot maps, batched ``apply`` |
| ``pool`` | ``uids -> slots``: host tier + device slots, pinning, ``prepare_batch``; the host tier's capacity rule |
| ``invariants`` | what ``LoraMemoryPool.check`` / ``check_weights`` recompute |
"""

from __future__ import annotations

from .eviction_policy import (
    LORA_EVICTION_POLICIES,
    FifoLoraPolicy,
    LoraEvictionPolicy,
    LruLoraPolicy,
    get_eviction_policy,
    make_lora_eviction_policy,
)
from .identity import BASE_MODEL, AdapterId, BaseModel, LoraUid, lora_extra_key
from .modules import check_module_shapes, leaf_name, linear_module_shapes, matches_module_name
from .pool import LoraBatch, LoraBatchError, LoraMemoryPool, effective_max_loaded_loras
from .slots import LoraSlots
from .weights import LoraAdapter

__all__ = [
    "BASE_MODEL",
    "LORA_EVICTION_POLICIES",
    "AdapterId",
    "BaseModel",
    "FifoLoraPolicy",
    "LoraAdapter",
    "LoraBatch",
    "LoraBatchError",
    "LoraEvictionPolicy",
    "LoraMemoryPool",
    "LoraSlots",
    "LoraUid",
    "LruLoraPolicy",
    "check_module_shapes",
    "effective_max_loaded_loras",
    "leaf_name",
    "linear_module_shapes",
    "lora_extra_key",
    "get_eviction_policy",
    "make_lora_eviction_policy",
    "matches_module_name",
]
