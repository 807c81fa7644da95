"""``radix.sglang``'s ``take_events()`` handed to an engine's own publisher, as SGLang's
scheduler does (``KVEventBatch(ts=..., events=cache.take_events())`` encoded by msgspec): the
bytes decode with SGLang 0.5.23's and vLLM's schemas (``tests/helpers/engine_kv_schemas.py``)
and carry the library's events field for field."""

from __future__ import annotations

from typing import Any, cast

import msgspec

from components.events import STATE_GROUP
from radix.sglang import RadixCache as SgRadixCache
from radix.sglang import RadixKey
from radix.sglang.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.helpers.engine_kv_schemas import DECODERS, SgBatch


def test_an_engines_own_batch_of_take_events_decodes() -> None:
    cache = SgRadixCache.create_simulated(page_size=2, enable_kv_cache_events=True)
    cache.insert(RadixKey([1, 2, 3, 4, 5]), None)
    cache.insert(RadixKey([1, 2, 7, 8], "salt"), None)
    cache.evict(2)
    cache.reset()
    events = cache.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    # the engine's batch class (SGLang's schema, written from its documentation), its encoder
    payload = msgspec.msgpack.encode(SgBatch(1.5, cast(Any, events), 0))
    for schema in ("sglang", "vllm"):
        got = DECODERS[schema].decode(payload)
        assert len(got.events) == 4
        first = got.events[0]
        assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size,
                first.lora_id, first.medium, first.lora_name) == (
                    events[0].block_hashes, None, [1, 2, 3, 4], 2, None, "GPU", None)
    assert DECODERS["sglang"].decode(payload).events[1].cache_salt == "salt"
    # the library's own batch type gives the same bytes
    assert msgspec.msgpack.encode(KVEventBatch(1.5, events, 0)) == payload


def test_state_checkpoints_are_left_out_for_sglangs_schema() -> None:
    from allocators import MambaStatePool, TokenAllocator
    from radix.sglang import CacheInitParams, UnifiedRadixCache
    from radix.sglang.requests import ReqToTokenPool

    kv = TokenAllocator(16)
    sp = MambaStatePool(2, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=ReqToTokenPool(2, 16, mamba_pool=sp),
        token_to_kv_pool_allocator=kv, page_size=1, enable_kv_cache_events=True))
    lib = cache.cache
    lib.insert([1, 2, 3], kv.alloc(3), state_slot=int(sp.alloc(1)[0]))
    lib_events = lib.kv_events
    assert lib_events is not None and lib_events.emitted == 2  # the KV store and the checkpoint
    got = cache.take_events()
    assert [(type(e).__name__, e.group_idx) for e in got] == [("BlockStored", 0)]
    assert all(e.group_idx != STATE_GROUP for e in got)

