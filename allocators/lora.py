"""LoRA adapter slots (SPEC section 5): one import point for the pieces.

| module | contract |
|---|---|
| :mod:`~allocators.lora_adapter` | adapter identity (``LoraUid``, ``BASE_MODEL``), weights, file format |
| :mod:`~allocators.lora_policy` | ``mark_used / select_victim / remove``: ``lru`` (default), ``fifo`` |
| :mod:`~allocators.lora_slots` | ``slots -> tensors``: A / B / scaling buffers, slot maps, batched ``apply`` |
| :mod:`~allocators.lora_pool` | ``uids -> slots``: host tier + device slots, pinning, ``prepare_batch`` |
| :mod:`~allocators.lora_invariants` | what ``LoraMemoryPool.check`` / ``check_weights`` recompute |
| :mod:`~allocators.lora_args` | SGLang's serving arguments, ``lora_paths`` parsing |
| :mod:`~allocators.lora_manager` | names and files over the pool: dynamic load / unload / reload |
"""

from __future__ import annotations

from .lora_adapter import (
    BASE_MODEL,
    LORA_FILE_FORMAT,
    AdapterId,
    BaseModel,
    LoraAdapter,
    LoraFormatError,
    LoraUid,
    lora_extra_key,
    read_adapter,
    save_adapter,
)
from .lora_args import (
    DEFAULT_MAX_LORAS_PER_BATCH,
    LoraArgs,
    LoraPathSpec,
    effective_max_loaded_loras,
    parse_lora_path,
    parse_lora_paths,
)
from .lora_manager import LoraManager
from .lora_policy import (
    LORA_EVICTION_POLICIES,
    FifoLoraPolicy,
    LoraEvictionPolicy,
    LruLoraPolicy,
    make_lora_eviction_policy,
)
from .lora_pool import LoraBatch, LoraBatchError, LoraMemoryPool
from .lora_slots import LoraSlots, check_module_shapes

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
