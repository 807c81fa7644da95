"""Reliability round 3 (issue 36), the SGLang front end: the hybrid cache's page size, request
calls validated before anything changes, errors that name the argument."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    Req,
    ReqToTokenPool,
    UnifiedRadixCache,
)


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


def hybrid(window: int | None = None) -> tuple[UnifiedRadixCache, TokenAllocator, MambaStatePool,
                                               ReqToTokenPool]:
    kv, sp = TokenAllocator(64), states()
    rtp = ReqToTokenPool(4, 32, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1))
    return fe, kv, sp, rtp


def running(fe: UnifiedRadixCache, kv: TokenAllocator, rtp: ReqToTokenPool, prompt: list[int],
            rid: int = 0) -> tuple[Req, torch.Tensor]:
    req = Req(rid=rid, origin_input_ids=prompt)
    assert rtp.alloc([req]) is not None
    slots = kv.alloc(len(prompt))
    assert slots is not None and req.kv.req_pool_idx is not None
    rtp.write((req.kv.req_pool_idx, slice(0, len(prompt))), slots)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = len(prompt)
    req.last_node = fe.root_node
    return req, slots


def frozen(fe: UnifiedRadixCache, *pools: Any) -> tuple[Any, ...]:
    c = fe.cache
    return (c.pretty_print(), c.evictable_size(), c.protected_size(),
            *(p.snapshot() for p in pools))


# ============================================================================ items 3, 6
def test_request_calls_validate_the_request_before_anything_changes() -> None:
    """Bad requests are refused naming the field, the tree and both pools unchanged. Before: a
    request without a row released silently (its state freed), ``object()`` raised
    ``AttributeError``, an ``up_to`` past the row's slots was cut to the key silently."""
    fe, kv, sp, rtp = hybrid()
    req, _ = running(fe, kv, rtp, [1, 2, 3, 4, 5])
    before = frozen(fe, kv, sp)
    with pytest.raises(TypeError, match=r"req must be a scheduler request with a kv record"):
        fe.cache_finished_req(object())
    with pytest.raises(TypeError, match=r"req must be .* got int"):
        fe.checkpoint(7, up_to=1)
    with pytest.raises(ValueError, match=r"up_to must be in \[0, req.kv.kv_allocated_len = 5\]"):
        fe.checkpoint(req, up_to=6)
    with pytest.raises(TypeError, match=r"up_to must be an int"):
        fe.checkpoint(req, up_to=2.0)
    req.kv.cache_protected_len = 6
    with pytest.raises(ValueError, match=r"cache_protected_len <= kv_committed_len"):
        fe.release_kv_cache(req)
    req.kv.cache_protected_len = 0
    req.lock = "lock"
    with pytest.raises(TypeError, match=r"req.lock must be a TreeLock"):
        fe.release_kv_cache(req)
    req.lock = None
    req.last_node = "root"
    with pytest.raises(TypeError, match=r"req.last_node must be a TreeNode .* got str"):
        fe.cache_unfinished_req(req)
    req.last_node = fe.root_node
    assert frozen(fe, kv, sp) == before
    # a request whose row was given back
    row = req.kv.req_pool_idx
    rtp.free(req)
    with pytest.raises(ValueError, match=r"req.kv.req_pool_idx is None: request 0 holds no "
                                         r"req_to_token_pool row"):
        fe.release_kv_cache(req)
    assert frozen(fe, kv, sp) == before and req.kv.mamba_pool_idx is not None
    req.kv.req_pool_idx = row  # (its row back, as it was)
    rtp._free_rows.remove(row)
    req.finished_reason = "stop"
    fe.release_kv_cache(req)
    assert fe.match_prefix([1, 2, 3, 4, 5]).device_prefix_len == 5
    fe.sanity_check()


def test_a_checkpoint_whose_insert_is_refused_gives_its_state_copy_back() -> None:
    """A running request's checkpoint copies its state into a fresh slot for the tree; when
    the insert refuses the row (a slot free in the KV allocator) that copy goes back too.
    Before: the state pool lost one slot per refused checkpoint."""
    fe, kv, sp, rtp = hybrid()
    req, slots = running(fe, kv, rtp, [1, 2, 3, 4])
    kv.free(slots[2:])  # the row now holds two slots it does not own
    before = frozen(fe, kv, sp)
    with pytest.raises(ValueError, match="free"):
        fe.checkpoint(req, up_to=4)
    assert frozen(fe, kv, sp) == before
    assert sp.available_size() == 8 - 1  # only the request's own slot is out


def test_front_end_errors_name_the_argument() -> None:
    """The seven calls that raised ``KeyError`` / ``AttributeError`` or truncated, and a
    negative ``EvictParams`` that was ignored."""
    fe, kv, sp, rtp = hybrid()
    req, _ = running(fe, kv, rtp, [1, 2, 3])
    req.finished_reason = "stop"
    fe.release_kv_cache(req)
    before = frozen(fe, kv, sp)
    with pytest.raises(TypeError, match=r"node must be a TreeNode this cache handed out or a node "
                                        r"id \(int\), got str"):
        fe.inc_lock_ref("x")
    with pytest.raises(TypeError, match=r"node must be .* got NoneType"):
        fe.dec_lock_ref(None)
    with pytest.raises(ValueError, match=r"node: no node with id 12345 in this cache"):
        fe.inc_lock_ref(12345)
    with pytest.raises(TypeError, match=r"params must be the DecLockRefParams"):
        fe.dec_lock_ref(fe.root_node, "receipt")
    with pytest.raises(TypeError, match=r"params must be an InitLoadBackParams, got str"):
        fe.init_load_back("x")
    with pytest.raises(TypeError, match=r"num_tokens must be an int >= 0, got float"):
        fe.evict(1.5)
    with pytest.raises(ValueError, match=r"params.num_tokens must be an int >= 0, got -1"):
        fe.evict(EvictParams(num_tokens=-1))
    with pytest.raises(ValueError, match=r"params.mamba_num must be an int >= 0, got -2"):
        fe.evict(EvictParams(mamba_num=-2))
    with pytest.raises(TypeError, match=r"swa_num_tokens must be an int >= 0, got str"):
        fe.evict(swa_num_tokens="3")
    assert frozen(fe, kv, sp) == before
    assert fe.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 3


# ============================================================== missing assertions (front end)
def kv_paged(ps: int = 4, size: int = 64) -> tuple[UnifiedRadixCache, PagedAllocator,
                                                   ReqToTokenPool]:
    kv = PagedAllocator(size, ps)
    rtp = ReqToTokenPool(4, 32)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=ps))
    return fe, kv, rtp


def test_release_at_page_4_with_a_partial_last_page_frees_exactly_the_requests_pages() -> None:
    """10 tokens computed in 3 pages (12 slots allocated): the tree keeps 8 tokens (2 pages);
    exactly the third page goes back, each slot once (a double free raises)."""
    fe, kv, rtp = kv_paged()
    req = Req(rid=1, origin_input_ids=list(range(1, 11)))
    assert rtp.alloc([req]) is not None
    slots = kv.alloc(12)
    assert slots is not None and req.kv.req_pool_idx is not None
    rtp.write((req.kv.req_pool_idx, slice(0, 12)), slots)
    req.kv.kv_committed_len, req.kv.kv_allocated_len = 10, 12
    req.last_node, req.finished_reason = fe.root_node, "stop"
    fe.release_kv_cache(req)
    assert kv.available_size() == 64 - 8
    assert kv.is_free(slots).tolist() == [False] * 8 + [True] * 4
    assert fe.match_prefix(list(range(1, 11))).device_prefix_len == 8
    kv.check()


def test_a_shorter_second_checkpoint_keeps_cache_protected_len_and_abort_frees_only_own() -> None:
    fe, kv, rtp = kv_paged(ps=1)
    req = Req(rid=1, origin_input_ids=[1, 2, 3, 4, 5, 6])
    assert rtp.alloc([req]) is not None
    slots = kv.alloc(6)
    assert slots is not None and req.kv.req_pool_idx is not None
    rtp.write((req.kv.req_pool_idx, slice(0, 6)), slots)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 6
    req.last_node = fe.root_node
    fe.checkpoint(req, up_to=5)
    assert req.kv.cache_protected_len == 5
    fe.checkpoint(req, up_to=3)  # shorter: the tree already owns [0, 5)
    assert req.kv.cache_protected_len == 5
    req.finished_reason = "abort"
    fe.release_kv_cache(req, checkpoint=False)
    assert kv.is_free(slots).tolist() == [False] * 5 + [True]  # only its own slot 5
    assert fe.match_prefix([1, 2, 3, 4, 5, 6]).device_prefix_len == 5
    assert fe.protected_size() == 0
    kv.check()


def test_lock_deltas_are_the_tokens_newly_protected() -> None:
    fe, kv, rtp = kv_paged(ps=1)
    a = kv.alloc(6)
    assert a is not None
    fe.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6]), value=a))
    b = kv.alloc(2)
    assert b is not None
    fe.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 9, 9]),
                           value=torch.cat([a[:4], b])))
    m = fe.match_prefix([1, 2, 3, 4, 5, 6])
    r1 = fe.inc_lock_ref(m.last_device_node)
    assert r1.delta == -6  # [1..4] and [5, 6] newly protected
    m2 = fe.match_prefix([1, 2, 3, 4, 9, 9])
    r2 = fe.inc_lock_ref(m2.last_device_node)
    assert r2.delta == -2  # [1..4] was protected already
    assert fe.dec_lock_ref(m.last_device_node, r1.to_dec_params()).delta == 2
    assert fe.dec_lock_ref(m2.last_device_node, r2.to_dec_params()).delta == 6
    assert fe.evictable_size() == 8 and fe.protected_size() == 0


def test_radix_cache_insert_over_a_cached_key_frees_nothing_of_the_callers() -> None:
    """SGLang's ``RadixCache.insert`` leaves the caller's duplicate slots to the caller."""
    kv = TokenAllocator(32)
    fe = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                    token_to_kv_pool_allocator=kv, page_size=1))
    a = kv.alloc(4)
    assert a is not None
    fe.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=a))
    mine = kv.alloc(4)
    assert mine is not None
    before = kv.snapshot()
    res = fe.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=mine))
    assert res.prefix_len == 4 and kv.snapshot() == before
    assert not bool(kv.is_free(mine).any())


def test_evict_counts_a_state_freed_by_the_kv_walk_towards_mamba_num() -> None:
    """``evict(num_tokens=1, mamba_num=2)``: the KV walk removes the oldest leaf [1, 2, 3]
    and its state; the state walk then frees one more state, not two (the oldest left, on
    leaf [4, 5, 6], which leaves whole): exactly 2 states and 6 tokens in all."""
    fe, kv, sp, rtp = hybrid()
    for key in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        req, _ = running(fe, kv, rtp, key, rid=key[0])
        req.finished_reason = "stop"
        fe.release_kv_cache(req)
    assert fe.mamba_evictable_size() == 3
    r = fe.evict(EvictParams(num_tokens=1, mamba_num=2))
    assert (r.num_tokens_evicted, r.mamba_num_evicted) == (6, 2)
    assert fe.mamba_evictable_size() == 1
    assert [fe.match_prefix(k).device_prefix_len for k in ([1, 2, 3], [4, 5, 6], [7, 8, 9])] \
        == [0, 0, 3]
    fe.sanity_check()


def test_cache_init_params_defaults_are_sglang_0_5_23s() -> None:
    p = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                        page_size=1)
    assert (p.state_recency, p.stateless_leaf, p.match_recency) == ("consumed", "keep", "usable")
    assert (p.eviction_policy, p.is_eagle, p.enable_mamba_extra_buffer,
            p.enable_kv_cache_events, p.sliding_window_size) == ("lru", False, False, False, None)


def test_evict_sliding_windows_frees_only_the_requests_own_tokens_out_of_its_window() -> None:
    """Window 2: the tree owns [0, 6) (a checkpoint), the request computed [6, 12). Releasing
    the window at 12 frees the SWA KV of its own tokens [6, 12 - keep) only, never the
    tree's, and a second call frees nothing more."""
    from allocators import SWAAllocator
    from radix.config import SWA_RELEASE_EXTRA_PAGES

    kv = SWAAllocator(64, 64)
    rtp = ReqToTokenPool(2, 32)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           sliding_window_size=2))
    req = Req(rid=1, origin_input_ids=list(range(1, 13)))
    assert rtp.alloc([req]) is not None
    slots = kv.alloc(12)
    assert slots is not None and req.kv.req_pool_idx is not None
    rtp.write((req.kv.req_pool_idx, slice(0, 12)), slots)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 6
    req.last_node = fe.root_node
    fe.checkpoint(req, up_to=6)
    assert req.kv.cache_protected_len == 6
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 12
    fe.evict_sliding_windows(req, 12)
    keep = 2 + SWA_RELEASE_EXTRA_PAGES
    row = rtp.req_to_token[req.kv.req_pool_idx, :12]
    live = kv.has_swa(row).tolist()
    assert live == [True] * 6 + [False] * (6 - keep) + [True] * keep
    assert req.kv.swa_evicted_seqlen == 12 - keep
    fe.evict_sliding_windows(req, 12)
    assert kv.has_swa(row).tolist() == live
    fe.sanity_check()


def test_insert_arguments_are_checked_before_the_tree_changes() -> None:
    """A bad ``prev_prefix_len`` was read after the library insert (the tree took the key and
    the state, then ``int('a')`` raised); a bad ``mamba_value`` raised ``AttributeError``."""
    fe, kv, sp, rtp = hybrid()
    slots = kv.alloc(3)
    assert slots is not None
    state = sp.alloc(1)
    assert state is not None
    before = frozen(fe, kv, sp)
    key = RadixKey([1, 2, 3])
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"prev_prefix_len": "a"}, TypeError, r"params.prev_prefix_len must be an int >= 0"),
        ({"prev_prefix_len": -1}, ValueError, r"params.prev_prefix_len must be an int >= 0"),
        ({"mamba_value": "x"}, TypeError, r"params.mamba_value must be tensor\(\[slot\]\) .* got str"),
        ({"mamba_value": torch.tensor([1.0])}, TypeError, r"params.mamba_value .* got torch.float32"),
        ({"priority": "hi"}, TypeError, r"params.priority must be an int, got str"),
    ]
    for kw, err, match in bad:
        args: dict[str, Any] = {"mamba_value": state, **kw}
        with pytest.raises(err, match=match):
            fe.insert(InsertParams(key=key, value=slots, **args))
        assert frozen(fe, kv, sp) == before
    with pytest.raises(TypeError, match=r"lock must be a TreeLock from lock\(\) or None, got str"):
        fe.unlock("x")
    with pytest.raises(TypeError, match=r"key"):
        fe.touch_prefix(object())
    res = fe.insert(InsertParams(key=key, value=slots, mamba_value=state, priority=2))
    assert (res.prefix_len, res.total_len, res.mamba_exist) == (0, 3, False)


def test_cow_mamba_without_a_request_is_refused_even_when_nothing_matches() -> None:
    """Before: accepted silently whenever no state matched (the copy was never reached), and
    ``ValueError`` / ``AttributeError`` only when one did."""
    fe, kv, sp, rtp = hybrid()
    for req in (None, "x"):
        with pytest.raises(TypeError, match=r"cow_mamba=True needs params.req"):
            fe.match_prefix(MatchPrefixParams(key=RadixKey([1, 2]), cow_mamba=True, req=req))
    fe.match_prefix(MatchPrefixParams(key=RadixKey([1, 2]), cow_mamba=False, req=None))
