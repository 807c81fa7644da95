"""The engines' KV-event schemas, written here from their documentation, to decode what the
library encodes the way a router would (independently of ``components.event_wire``).

Three decoders, each a ``msgspec.msgpack.Decoder`` of one engine's batch type:

* ``sglang``: SGLang 0.5.23 (``sglang.srt.disaggregation.kv_events``). A batch is a positional
  array ``[ts, events, attn_dp_rank]``; an event is a map tagged by ``type`` (the class name).
  ``BlockStored`` requires ``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size`` and ``lora_id`` (no default: nil must be written); ``medium``,
  ``cache_salt``, ``session_id`` and ``lora_name`` default to nil. ``BlockRemoved`` requires
  ``block_hashes``; ``medium`` defaults to nil.
* ``vllm``: vLLM's current schema (``vllm.distributed.kv_events``): the same batch array
  ``[ts, events, data_parallel_rank]`` and tagged maps, with ``medium`` and ``lora_name`` also
  required on ``BlockStored`` and ``medium`` on ``BlockRemoved``; ``group_idx`` (the KV cache
  group), ``extra_keys`` and the cache-spec fields are optional.
* ``vllm_array``: vLLM's older schema: every event a tagged positional array
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``; batch
  ``[ts, events(, data_parallel_rank)]``.

Unknown map keys are ignored by msgspec's default decoders (as in the engines).
"""

from __future__ import annotations

from typing import Any

import msgspec

# ----------------------------------------------------------------- SGLang 0.5.23


class SgEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class SgBlockStored(SgEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SgBlockRemoved(SgEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SgAllBlocksCleared(SgEvent, tag="AllBlocksCleared"):
    pass


class SgBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[SgBlockStored | SgBlockRemoved | SgAllBlocksCleared]
    attn_dp_rank: int | None = None


# ----------------------------------------------------------------- vLLM (current)


class VlEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class VlBlockStored(VlEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VlBlockRemoved(VlEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class VlAllBlocksCleared(VlEvent, tag="AllBlocksCleared"):
    pass


class VlBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VlBlockStored | VlBlockRemoved | VlAllBlocksCleared]
    data_parallel_rank: int | None = None


# ----------------------------------------------------------------- vLLM (older, arrays)


class VoEvent(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    pass


class VoBlockStored(VoEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VoBlockRemoved(VoEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VoAllBlocksCleared(VoEvent, tag="AllBlocksCleared"):
    pass


class VoBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VoBlockStored | VoBlockRemoved | VoAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "sglang": msgspec.msgpack.Decoder(SgBatch),
    "vllm": msgspec.msgpack.Decoder(VlBatch),
    "vllm_array": msgspec.msgpack.Decoder(VoBatch),
}

KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def decodes(schema: str, payload: bytes) -> str | None:
    """``None`` when ``schema`` decodes ``payload``, else msgspec's error message."""
    try:
        DECODERS[schema].decode(payload)
    except msgspec.ValidationError as e:
        return str(e)
    return None
