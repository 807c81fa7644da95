"""Reliability round 3 (issue 36), the SGLang front end: the hybrid cache's page size, request
calls validated before anything changes, errors that name the argument."""

from __future__ import annotations

import pytest

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix.sglang import CacheInitParams, ReqToTokenPool, UnifiedRadixCache


def states(n: int = 8) -> MambaStatePool:
    return MambaStatePool(n, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))


# ============================================================================ item 1
def test_a_hybrid_cache_at_page_4_is_refused_as_sglang_refuses_it() -> None:
    """SGLang 0.5.23 refuses page > 1 with a Mamba pool (without its extra buffer, which this
    front end refuses too); before, a finished 10-token request left its end state on the node
    ending at token 8."""
    sp = states()
    kv = PagedAllocator(64, 4)
    before = (kv.snapshot(), sp.snapshot())
    with pytest.raises(ValueError, match=r"page_size=4 with a recurrent-state pool"):
        UnifiedRadixCache(CacheInitParams(disable=False, token_to_kv_pool_allocator=kv,
                                          req_to_token_pool=ReqToTokenPool(2, 16, mamba_pool=sp),
                                          page_size=4))
    assert (kv.snapshot(), sp.snapshot()) == before
    # page 1 with states, and page 4 without, are built
    UnifiedRadixCache(CacheInitParams(disable=False, token_to_kv_pool_allocator=TokenAllocator(64),
                                      req_to_token_pool=ReqToTokenPool(2, 16, mamba_pool=sp),
                                      page_size=1))
    UnifiedRadixCache(CacheInitParams(disable=False, token_to_kv_pool_allocator=kv,
                                      req_to_token_pool=ReqToTokenPool(2, 16), page_size=4))
