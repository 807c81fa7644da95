"""SGLang 0.5.23's KV event classes (``sglang.srt.disaggregation.kv_events``): msgspec structs
in SGLang's wire shape (``components.event_wire``; needs msgspec, as SGLang does).

``UnifiedRadixCache.take_events()`` returns instances of these when msgspec is installed, so an
engine that puts them in its own ``KVEventBatch`` and hands that to its own publisher sends
what SGLang's and vLLM's decoders read (every field they require, tagged maps). They carry the
fields SGLang declares (``lora_id``, ``medium``, ``lora_name``, ``cache_salt``) plus vLLM's
``group_idx``, which SGLang's decoder ignores; state checkpoints (group 1) are not among them,
since SGLang's schema cannot tell them from KV pages.
"""

from __future__ import annotations

from components.event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    encode_batch,
)

#: SGLang's base batch class name.
EventBatch = KVEventBatch

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVCacheEvent",
           "KVEventBatch", "encode_batch"]
