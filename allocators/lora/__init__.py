"""LoRA adapter slots: the public names. Import from here, never from the modules below.

| module | what it holds |
|---|---|
| ``identity`` | which adapter a request runs with: ``LoraUid`` (one per load), ``BASE_MODEL`` |
| ``weights`` | ``LoraAdapter``: one adapter's A / B weights and scaling in host memory |
| ``eviction_policy`` | ``mark_used / select_victim / remove``: ``lru`` (default), ``fifo`` |
| ``slots`` | ``slots -> tensors``: A / B / scaling buffers, slot maps, batched ``apply`` |
| ``pool`` | ``uids -> slots``: host tier + device slots, pinning, ``prepare_batch`` |
| ``invariants`` | what ``LoraMemoryPool.check`` / ``check_weights`` recompute |
| ``serving_args`` | SGLang's serving arguments, ``lora_paths`` parsing |
| ``manager`` | names and files over the pool: dynamic load / unload / reload |
"""

from __future__ import annotations

from .eviction_policy import (
    LORA_EVICTION_POLICIES,
    FifoLoraPolicy,
    LoraEvictionPolicy,
    LruLoraPolicy,
    make_lora_eviction_policy,
)
from .identity import BASE_MODEL, AdapterId, BaseModel, LoraUid, lora_extra_key
from .manager import LoraManager
from .pool import LoraBatch, LoraBatchError, LoraMemoryPool
from .serving_args import (
    DEFAULT_MAX_LORAS_PER_BATCH,
    LoraArgs,
    LoraPathSpec,
    effective_max_loaded_loras,
    parse_lora_path,
    parse_lora_paths,
)
from .slots import LoraSlots, check_module_shapes
from .weights import LORA_FILE_FORMAT, LoraAdapter, LoraFormatError, read_adapter, save_adapter

__all__ = [
    "BASE_MODEL",
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "LORA_EVICTION_POLICIES",
    "LORA_FILE_FORMAT",
    "AdapterId",
    "BaseModel",
    "FifoLoraPolicy",
    "LoraAdapter",
    "LoraArgs",
    "LoraBatch",
    "LoraBatchError",
    "LoraEvictionPolicy",
    "LoraFormatError",
    "LoraManager",
    "LoraMemoryPool",
    "LoraPathSpec",
    "LoraSlots",
    "LoraUid",
    "LruLoraPolicy",
    "check_module_shapes",
    "effective_max_loaded_loras",
    "lora_extra_key",
    "make_lora_eviction_policy",
    "parse_lora_path",
    "parse_lora_paths",
    "read_adapter",
    "save_adapter",
]
