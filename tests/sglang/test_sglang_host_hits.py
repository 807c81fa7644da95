"""The SGLang front end's host hit lengths come from the library's ``MatchResult``
(``swa_host_hit_length``, ``state_host_hit_length``): a hybrid SWA model with a host tier,
one request's tokens demoted to host, matched, loaded back. Expected values by hand: 8 tokens
of full KV, the last 4 of them with live SWA KV (the first 4 slid out of the window before the
insert), one state."""

from __future__ import annotations

from typing import Any

from allocators import MambaStatePool, SWAAllocator
from hicache import HiCacheConfig
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    ReqToTokenPool,
    UnifiedRadixCache,
)


def test_host_hit_lengths_of_a_demoted_request() -> None:
    alloc: Any = SWAAllocator(32, 16)
    sp = MambaStatePool(4, num_layers=1, conv_state_shape=(2,), ssm_state_shape=(2,))
    rtp = ReqToTokenPool(2, 32, mamba_pool=sp)
    tree = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1,
        sliding_window_size=4,
        hicache=HiCacheConfig(hicache_ratio=2.0, hicache_write_policy="write_through",
                              load_back_threshold=1)))
    req = Req(rid=0, origin_input_ids=[])
    rtp.alloc([req])
    assert req.mamba_pool_idx is not None
    toks = list(range(1, 9))
    slots = alloc.alloc(8)
    alloc.free_swa(slots[:4])  # out of the window before the insert
    tree.insert(InsertParams(key=RadixKey(toks), value=slots,
                             mamba_value=req.mamba_pool_idx.unsqueeze(0)))
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
    assert (m.device_prefix_len, m.host_hit_length, m.swa_host_hit_length,
            m.mamba_host_hit_length) == (8, 0, 0, 0)
    assert tree.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8  # backed up first
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
    assert (m.device_prefix_len, m.host_hit_length, m.swa_host_hit_length,
            m.mamba_host_hit_length) == (0, 8, 4, 1)
    swa_free, states_free = alloc.swa_available_size(), sp.available_size()
    loaded, node = tree.init_load_back(InitLoadBackParams(
        best_match_node=m.best_match_node, host_hit_length=m.host_hit_length))
    assert loaded == 8
    assert (swa_free - alloc.swa_available_size(), states_free - sp.available_size()) == (4, 1)
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
    assert m.device_prefix_len == 8 and m.last_device_node is node
    tree.sanity_check()
