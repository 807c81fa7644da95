"""LoRA adapter slots: the public names. Import from here, never from the modules below.

| module | what it holds |
|---|---|
| ``identity`` | which adapter a request runs with: ``LoraUid`` (one per load), ``BASE_MODEL`` |
| ``weights`` | ``LoraAdapter``: one adapter's A / B weights and scaling in host memory |
| ``modules`` | base-model module paths and shapes, target-module name matching |
| ``peft_config`` | ``adapter_config.json``: parsed, validated, PEFT's matching and scaling rules |
| ``peft_adapter`` | PEFT directories in and out (safetensors): ``read_peft_adapter`` / ``write_peft_adapter`` |
| ``eviction_policy`` | ``mark_used / select_victim / remove``: ``lru`` (default), ``fifo`` |
| ``slots`` | ``slots -> tensors``: A / B / scaling buffers, slot maps, batched ``apply`` |
| ``pool`` | ``uids -> slots``: host tier + device slots, pinning, ``prepare_batch`` |
| ``invariants`` | what ``LoraMemoryPool.check`` / ``check_weights`` recompute |
| ``serving_args`` | SGLang's serving arguments, ``lora_paths`` parsing |
| ``manager`` | names and PEFT directories over the pool: inference, dynamic load / unload / reload |
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
from .manager import LoraManager
from .modules import check_module_shapes, leaf_name, linear_module_shapes
from .peft_adapter import read_peft_adapter, write_peft_adapter
from .peft_config import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    LoraFormatError,
    PeftLoraConfig,
    parse_peft_config,
    read_peft_config,
)
from .pool import LoraBatch, LoraBatchError, LoraMemoryPool
from .serving_args import (
    DEFAULT_MAX_LORAS_PER_BATCH,
    LoraArgs,
    LoraPathSpec,
    effective_max_loaded_loras,
    parse_lora_path,
    parse_lora_paths,
)
from .slots import LoraSlots
from .weights import LoraAdapter

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "BASE_MODEL",
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "LORA_EVICTION_POLICIES",
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
    "PeftLoraConfig",
    "check_module_shapes",
    "effective_max_loaded_loras",
    "leaf_name",
    "linear_module_shapes",
    "lora_extra_key",
    "get_eviction_policy",
    "make_lora_eviction_policy",
    "parse_lora_path",
    "parse_lora_paths",
    "parse_peft_config",
    "read_peft_adapter",
    "read_peft_config",
    "write_peft_adapter",
]
