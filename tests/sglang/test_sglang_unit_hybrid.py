"""SGLang's unit tests of its Mamba and SWA caches, reproduced against the front end.

Sources (SGLang's public repository, ``test/registered/radix_cache/``), the same calls and
expected values, written again here over this library's pools (``TokenAllocator`` /
``SWAAllocator`` in place of SGLang's KV allocators, ``MambaStatePool`` behind a
``ReqToTokenPool`` in place of ``HybridReqToTokenPool``):

* ``test_mamba_unittest.py``: ``test_mamba_radix_cache_1``, ``test_insert_prev_prefix_len``;
* ``test_unified_radix_cache`` (the unit file of ``UnifiedRadixCache``):
  ``TestUnifiedRadixCacheMamba`` (insert and match, evictions of full tokens and of states,
  a state eviction breaking the match, lock protection, result accounting,
  ``prev_prefix_len``, diagnostics) and ``TestUnifiedRadixCacheSWAMamba`` (match with a
  window, SWA / full evictions cascading, the window lock, ``cache_finished_req`` with and
  without insert, ``cache_unfinished_req``, evicting an empty tree and until empty, the
  copy-on-write of the matched state);
* ``test_swa_unittest.py``: ``test_swa_radix_cache_1``.

Not reproduced: the tests of SGLang's pools themselves (``test_hybrid_linear_kv_pool``,
``test_mamba_pool``, ``test_swa_memory_pool``: layer-id maps and pool sizes of SGLang's
classes), the EAGLE bigram variant (``test_swa_radix_cache_eagle``: bigram keys are refused
here), and ``_match_prefix_helper_readonly`` (a private helper). Where SGLang's copy-on-write
check compares untouched (all-zero) states, the reproduction writes distinct values first so
the check can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import MambaStatePool, SWAAllocator, TokenAllocator
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    EvictResult,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
    Req,
    ReqToTokenPool,
    UnifiedRadixCache,
)


def build(kv_size: int = 128, mamba: int = 20, reqs: int = 10, window: int | None = None,
          swa_size: int = 64) -> tuple[UnifiedRadixCache, Any, ReqToTokenPool]:
    alloc: Any = SWAAllocator(kv_size, swa_size) if window else TokenAllocator(kv_size)
    sp = MambaStatePool(mamba, num_layers=2, conv_state_shape=(3,), ssm_state_shape=(2, 2))
    rtp = ReqToTokenPool(reqs, 128, mamba_pool=sp)
    tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                             token_to_kv_pool_allocator=alloc, page_size=1,
                                             sliding_window_size=window))
    return tree, alloc, rtp


def make_req(rtp: ReqToTokenPool) -> Req:
    req = Req(rid=0, origin_input_ids=[])
    rtp.alloc([req])
    return req


def ins(tree: UnifiedRadixCache, alloc: Any, rtp: ReqToTokenPool, toks: list[int],
        **kw: Any) -> Any:
    req = make_req(rtp)
    assert req.mamba_pool_idx is not None
    return tree.insert(InsertParams(key=RadixKey(toks), value=alloc.alloc(len(toks)),
                                    mamba_value=req.mamba_pool_idx.unsqueeze(0), **kw))


def hit(tree: UnifiedRadixCache, toks: list[int], **kw: Any) -> MatchResult:
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(toks), **kw))


# ============================================================ test_mamba_unittest.py
def test_mamba_radix_cache_1() -> None:
    tree, alloc, rtp = build()
    sp = rtp.mamba_pool
    assert sp is not None
    ins(tree, alloc, rtp, [1, 2, 3])
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6, 7])
    ins(tree, alloc, rtp, [10, 11, 12])
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 60, 70])
    tree.pretty_print()
    assert tree.evict(EvictParams(num_tokens=1)).num_tokens_evicted >= 1
    assert tree.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted >= 1

    assert len(hit(tree, [1, 2, 3, 4, 5]).device_indices) == 0
    m = hit(tree, [1, 2, 3, 4, 5, 60, 70])
    assert len(m.device_indices) == 7 and len(m.last_device_node.key) == 2
    m = hit(tree, [1, 2, 3, 4, 5, 6, 7])
    assert len(m.device_indices) == 7 and len(m.last_device_node.key) == 2

    assert tree.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted >= 1
    m = hit(tree, [1, 2, 3, 4, 5, 60, 70])
    assert len(m.device_indices) == 0 and len(m.last_device_node.key) == 0

    req9 = make_req(rtp)
    src = hit(tree, [1, 2, 3, 4, 5, 6, 7]).last_device_node.mamba_value
    assert src is not None
    sp.set_state(int(src), 0, torch.full((3,), 7.0), torch.full((2, 2), 9.0))  # make it distinct
    m = hit(tree, [1, 2, 3, 4, 5, 6, 7], req=req9, cow_mamba=True)
    last = m.last_device_node
    assert req9.mamba_pool_idx is not None and int(req9.mamba_pool_idx) != int(src)
    for layer in range(2):
        mine = sp.get_state(int(req9.mamba_pool_idx), layer)
        theirs = sp.get_state(int(last.mamba_value[0]), layer)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert torch.equal(sp.get_state(int(req9.mamba_pool_idx), 0)[0], torch.full((3,), 7.0))
    assert "Available full tokens" in tree.available_and_evictable_str()
    tree.sanity_check()


def test_insert_prev_prefix_len_frees_exactly_the_callers_duplicates() -> None:
    tree, alloc, rtp = build()
    initial = alloc.available_size()
    ins(tree, alloc, rtp, [1, 2, 3])
    assert alloc.available_size() == initial - 3
    res = ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6, 7], prev_prefix_len=0)
    assert res.prefix_len == 3
    assert alloc.available_size() == initial - 3 - 4  # alloc 7, 3 duplicates freed
    after2 = alloc.available_size()
    res = ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6, 7, 8], prev_prefix_len=2)
    assert res.prefix_len == 7
    assert alloc.available_size() == after2 - 3  # alloc 8, [2, 7) freed, 1 stored
    after3 = alloc.available_size()
    res = ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6, 7, 8, 9], prev_prefix_len=8)
    assert res.prefix_len == 8
    assert alloc.available_size() == after3 - 9  # nothing freed
    tree.sanity_check()


# ============================================================ TestUnifiedRadixCacheMamba
def test_unified_mamba_insert_and_match_basic() -> None:
    tree, alloc, rtp = build()
    assert ins(tree, alloc, rtp, [1, 2, 3]).prefix_len == 0
    assert ins(tree, alloc, rtp, [1, 2, 3, 4, 5]).prefix_len == 3
    assert len(hit(tree, [1, 2, 3, 4, 5]).device_indices) == 5
    assert len(hit(tree, [1, 2, 3, 4, 5, 6]).device_indices) == 5
    assert len(hit(tree, [10, 11]).device_indices) == 0
    tree.sanity_check()


def test_unified_mamba_evict_full_tokens() -> None:
    tree, alloc, rtp = build()
    ins(tree, alloc, rtp, [1, 2, 3])
    ins(tree, alloc, rtp, [10, 11, 12])
    assert tree.full_evictable_size() == 6
    res = tree.evict(EvictParams(num_tokens=3))
    assert isinstance(res, EvictResult) and res.num_tokens_evicted >= 3
    assert tree.full_evictable_size() <= 3
    tree.sanity_check()


def test_unified_mamba_evict_states_only() -> None:
    tree, alloc, rtp = build()
    ins(tree, alloc, rtp, [1, 2, 3])
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6, 7])
    assert tree.mamba_evictable_size() == 2
    assert tree.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted >= 1
    assert tree.full_evictable_size() >= 0
    tree.sanity_check()


def test_unified_mamba_state_eviction_breaks_the_match() -> None:
    tree, alloc, rtp = build()
    ins(tree, alloc, rtp, [1, 2, 3])
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5])
    tree.evict(EvictParams(num_tokens=0, mamba_num=2))
    assert tree.mamba_evictable_size() == 0
    assert len(hit(tree, [1, 2, 3, 4, 5]).device_indices) == 0
    tree.sanity_check()


def test_unified_mamba_evict_respects_lock_ref() -> None:
    tree, alloc, rtp = build()
    ins(tree, alloc, rtp, [1, 2, 3])
    ins(tree, alloc, rtp, [10, 11, 12])
    locked = hit(tree, [1, 2, 3]).last_device_node
    tree.inc_lock_ref(locked)
    assert tree.evict(EvictParams(num_tokens=6)).num_tokens_evicted >= 3
    assert len(hit(tree, [1, 2, 3]).device_indices) == 3
    tree.dec_lock_ref(locked)
    assert tree.evict(EvictParams(num_tokens=3)).num_tokens_evicted >= 3
    tree.sanity_check()


def test_unified_mamba_evict_result_accounting() -> None:
    tree, alloc, rtp = build()
    ins(tree, alloc, rtp, [1, 2, 3])
    res = tree.evict(EvictParams(num_tokens=3))
    assert res.num_tokens_evicted >= 3 and res.mamba_num_evicted >= 1  # the leaf's state too
    tree.sanity_check()


def test_unified_mamba_insert_prev_prefix_len() -> None:
    tree, alloc, rtp = build()
    initial = alloc.available_size()
    ins(tree, alloc, rtp, [1, 2, 3])
    assert alloc.available_size() == initial - 3
    res = ins(tree, alloc, rtp, [1, 2, 3, 4, 5], prev_prefix_len=0)
    assert res.prefix_len == 3 and alloc.available_size() == initial - 3 - 2
    before = alloc.available_size()
    res = ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6], prev_prefix_len=5)
    assert res.prefix_len == 5 and alloc.available_size() == before - 6
    tree.sanity_check()


def test_unified_mamba_diagnostics(capsys: pytest.CaptureFixture[str]) -> None:
    tree, alloc, rtp = build()
    ins(tree, alloc, rtp, [1, 2, 3])
    diag = tree.available_and_evictable_str()
    assert "Available full tokens" in diag and "mamba" in diag.lower()
    tree.pretty_print()
    assert "[0,3)" in capsys.readouterr().out
    tree.sanity_check()


# ============================================================ TestUnifiedRadixCacheSWAMamba
def test_swa_mamba_match_needs_a_window() -> None:
    tree, alloc, rtp = build(window=4)
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5])
    assert len(hit(tree, [1, 2, 3, 4, 5]).device_indices) == 5
    tree.sanity_check()


def test_swa_mamba_swa_eviction_of_an_internal_node() -> None:
    tree, alloc, rtp = build(window=4)
    ins(tree, alloc, rtp, [1, 2, 3])
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5, 6, 7])
    res = tree.evict(EvictParams(num_tokens=0, swa_num_tokens=3))
    assert res.swa_num_tokens_evicted >= 0
    tree.sanity_check()


def test_swa_mamba_full_leaf_eviction_cascades_everything() -> None:
    tree, alloc, rtp = build(window=4)
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5])
    ins(tree, alloc, rtp, [10, 11, 12, 13, 14])
    assert tree.full_evictable_size() == 10
    res = tree.evict(EvictParams(num_tokens=5))
    assert res.num_tokens_evicted >= 5 and res.mamba_num_evicted >= 1
    assert res.swa_num_tokens_evicted >= 0
    tree.sanity_check()


def test_swa_mamba_lock_protects_from_eviction() -> None:
    tree, alloc, rtp = build(window=4)
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5])
    ins(tree, alloc, rtp, [10, 11, 12, 13, 14])
    m = hit(tree, [1, 2, 3, 4, 5])
    receipt = tree.inc_lock_ref(m.last_device_node)
    assert tree.evict(EvictParams(num_tokens=10)).num_tokens_evicted >= 5
    m = hit(tree, [1, 2, 3, 4, 5])
    assert len(m.device_indices) == 5
    tree.dec_lock_ref(m.last_device_node, receipt.to_dec_params())
    tree.sanity_check()


def finished_req(rtp: ReqToTokenPool, alloc: Any, prompt: list[int], out: list[int]) -> Req:
    req = make_req(rtp)
    req.origin_input_ids, req.output_ids = prompt, out
    n = len(prompt) + len(out)
    assert req.kv.req_pool_idx is not None
    rtp.write((req.kv.req_pool_idx, slice(0, n)), alloc.alloc(n))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    req.kv.cache_protected_len = 0
    return req


def test_swa_mamba_cache_finished_req_inserts() -> None:
    tree, alloc, rtp = build()
    req = finished_req(rtp, alloc, [1, 2, 3, 4, 5], [6, 7])
    req.last_node = tree.root_node
    req.finished_reason = "length"
    tree.cache_finished_req(req, is_insert=True)
    assert len(hit(tree, [1, 2, 3, 4, 5, 6, 7]).device_indices) == 7
    assert req.kv.req_pool_idx is None and req.lock is None
    tree.sanity_check()


def test_swa_mamba_cache_finished_req_without_insert_frees_everything() -> None:
    tree, alloc, rtp = build()
    req = finished_req(rtp, alloc, [1, 2, 3], [])
    req.last_node = tree.root_node
    req.finished_reason = "abort"
    before = alloc.available_size()
    tree.cache_finished_req(req, is_insert=False)
    assert alloc.available_size() == before + 3
    assert len(hit(tree, [1, 2, 3]).device_indices) == 0
    tree.sanity_check()


def test_swa_mamba_cache_unfinished_req_moves_the_lock() -> None:
    tree, alloc, rtp = build()
    req = finished_req(rtp, alloc, [1, 2, 3, 4, 5], [])
    req.last_node = tree.root_node
    tree.cache_unfinished_req(req)
    assert len(req.prefix_indices) > 0
    assert req.kv.cache_protected_len == len(req.prefix_indices) == 5
    assert req.last_node is not None and req.lock is not None
    tree.unlock(req.lock)
    tree.sanity_check()


def test_swa_mamba_evict_an_empty_tree() -> None:
    tree, _, _ = build()
    res = tree.evict(EvictParams(num_tokens=10, mamba_num=5))
    assert (res.num_tokens_evicted, res.mamba_num_evicted) == (0, 0)
    tree.sanity_check()


def test_swa_mamba_evict_until_empty() -> None:
    tree, alloc, rtp = build()
    for i in range(5):
        ins(tree, alloc, rtp, list(range(i * 10, i * 10 + 5)))
    assert tree.full_evictable_size() == 25
    assert tree.evict(EvictParams(num_tokens=100)).num_tokens_evicted >= 25
    assert tree.full_evictable_size() == 0 and tree.mamba_evictable_size() == 0
    assert len(hit(tree, [0, 1, 2, 3, 4]).device_indices) == 0
    tree.sanity_check()


def test_swa_mamba_cow_on_match() -> None:
    tree, alloc, rtp = build()
    sp = rtp.mamba_pool
    assert sp is not None
    ins(tree, alloc, rtp, [1, 2, 3, 4, 5])
    node = hit(tree, [1, 2, 3, 4, 5]).last_device_node
    src = int(node.mamba_value[0])
    sp.set_state(src, 1, torch.full((3,), 2.5), torch.full((2, 2), -1.0))
    req2 = make_req(rtp)
    assert req2.kv.mamba_pool_idx is not None
    own = int(req2.kv.mamba_pool_idx)
    m = hit(tree, [1, 2, 3, 4, 5], cow_mamba=True, req=req2)
    assert len(m.device_indices) == 5
    assert int(req2.kv.mamba_pool_idx) == own  # its own slot, now a copy
    for layer in range(2):
        assert all(torch.equal(a, b) for a, b in zip(
            sp.get_state(own, layer), sp.get_state(src, layer), strict=True))
    tree.sanity_check()


# ============================================================ test_swa_unittest.py
def test_swa_radix_cache_1() -> None:
    alloc = SWAAllocator(128, 64)
    tree = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=ReqToTokenPool(10, 128),
        token_to_kv_pool_allocator=alloc, page_size=1, sliding_window_size=4))
    for toks in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        value = alloc.alloc(len(toks))
        assert value is not None
        tree.insert(RadixKey(toks), value)
    tree.pretty_print()
    tree.evict(full_num_tokens=1, swa_num_tokens=0)
    tree.evict(full_num_tokens=0, swa_num_tokens=1)
    tree.evict(full_num_tokens=1, swa_num_tokens=2)
    assert len(hit(tree, [1, 2, 3, 4, 5]).device_indices) == 0
    m = hit(tree, [1, 2, 3, 4, 5, 60, 70])
    assert len(m.device_indices) == 7
    assert len(m.last_device_node.key) == 2
    assert list(m.last_device_node.key.token_ids) == [60, 70]
    tree.sanity_check()
