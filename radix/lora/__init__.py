"""LoRA adapters as an engine serves them: PEFT directories, SGLang's serving arguments and
the adapter manager (names and directories over the slot pool of :mod:`allocators.lora`).
Import from here, never from the modules below.

| module | what it holds |
|---|---|
| ``peft_config`` | ``adapter_config.json``: parsed, validated, PEFT's matching and scaling rules |
| ``peft_adapter`` | PEFT directories in and out (safetensors): ``read_peft_adapter`` / ``write_peft_adapter`` |
| ``serving_args`` | SGLang's serving arguments (``LoraArgs``), ``lora_paths`` parsing |
| ``manager`` | ``LoraManager``: names and PEFT directories over the pool: inference, dynamic load / unload / reload |

The slot pool itself (``LoraMemoryPool``, ``LoraAdapter``, ``LoraUid``, the eviction policies)
is an allocator: :mod:`allocators.lora`.
"""

from __future__ import annotations

from .manager import LoraManager
from .peft_adapter import read_peft_adapter, write_peft_adapter
from .peft_config import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    LoraFormatError,
    PeftLoraConfig,
    parse_peft_config,
    read_peft_config,
)
from .serving_args import (
    DEFAULT_MAX_LORAS_PER_BATCH,
    LoraArgs,
    LoraPathSpec,
    parse_lora_path,
    parse_lora_paths,
)

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "LoraArgs",
    "LoraFormatError",
    "LoraManager",
    "LoraPathSpec",
    "PeftLoraConfig",
    "parse_lora_path",
    "parse_lora_paths",
    "parse_peft_config",
    "read_peft_adapter",
    "read_peft_config",
    "write_peft_adapter",
]
