"""Streaming sessions in the SGLang front end (``radix.sglang.session``), driven the way
SGLang 0.5.23's scheduler drives them: match -> lock -> row allocation (the session takes the
record) -> checkpoints -> release; the next turn borrows the record; the session's end gives
everything back. And the build-time rule: GreedyDual-Size policies are refused with
streaming sessions on a model with recurrent state.

Sizes are small and every count is worked out by hand in the comments.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from allocators import TokenAllocator
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    MatchPrefixParams,
    RadixKey,
    Req,
    ReqToTokenPool,
    UnifiedRadixCache,
)
from tests.helpers.cache_helpers import tiny_state_pool

P1 = list(range(1, 9))  # 8 prompt tokens
O1 = [50, 51]
P2 = [60, 61, 62, 63]


class Engine:
    """The scheduler's side: admission, allocation, checkpoints, release."""

    def __init__(self, sessions: bool = True) -> None:
        self.kv = TokenAllocator(64)
        self.sp = tiny_state_pool(8)
        self.rtp = ReqToTokenPool(4, 64, mamba_pool=self.sp)
        self.cache = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.kv,
            page_size=1, enable_streaming_session=sessions))

    def admit(self, req: Req) -> int:
        """Match, lock, allocate the row for the uncached tokens; returns the prefix length."""
        c = self.cache
        ids = req.full_untruncated_fill_ids
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(ids), req=req, cow_mamba=True))
        req.prefix_len = m.device_prefix_len
        req.last_node = m.last_device_node
        if m.cache_protected_len is None:  # a tree match; a lent record keeps its own
            req.kv.cache_protected_len = m.device_prefix_len
        req.lock = c.lock(req.last_node)
        if req.kv.req_pool_idx is None:
            assert self.rtp.alloc([req]) is not None
            row = req.kv.req_pool_idx
            assert row is not None
            self.rtp.write((row, slice(0, req.prefix_len)), m.device_indices)
        fresh = self.kv.alloc(len(ids) - req.prefix_len)
        assert fresh is not None
        row = req.kv.req_pool_idx
        self.rtp.write((row, slice(req.prefix_len, len(ids))), fresh)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(ids)
        c.maybe_hand_to_session(req)
        return req.prefix_len

    def decode(self, req: Req, tokens: list[int]) -> None:
        fresh = self.kv.alloc(len(tokens))
        assert fresh is not None
        n = req.kv.kv_committed_len
        self.rtp.write((req.kv.req_pool_idx, slice(n, n + len(tokens))), fresh)
        req.output_ids += tokens
        req.kv.kv_committed_len = req.kv.kv_allocated_len = n + len(tokens)

    def finish(self, req: Req) -> None:
        req.finished_reason = "stop"
        self.cache.release_kv_cache(req, checkpoint=True)


def session(sid: str) -> Any:
    return SimpleNamespace(session_id=sid, streaming=True)


def test_a_session_holds_its_kv_and_state_between_turns_and_gives_them_back() -> None:
    e = Engine()
    c = e.cache
    r1 = Req("t1", P1, session=session("s"))
    assert e.admit(r1) == 0
    assert e.rtp.available_size() == 3  # the session's row
    c.checkpoint(r1, up_to=len(P1))  # the first prompt is published: 8 tokens + a state copy
    e.decode(r1, O1)
    e.finish(r1)
    assert c.session_records()["s"].kv_committed_len == 10
    assert e.kv.available_size() == 64 - 10  # 8 in the tree + 2 the session still holds
    assert e.sp.available_size() == 8 - 2  # the tree's copy + the session's running state
    assert (c.protected_size(), c.evictable_size()) == (8, 0)  # the session locks its prompt
    assert c.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 0

    # another request shares the published prompt through the tree
    other = Req("o", P1 + [99])
    assert e.admit(other) == 8
    e.finish(other)

    r2 = Req("t2", P1 + O1 + P2, session=session("s"))
    assert e.admit(r2) == 10  # the session's record: everything it computed
    assert r2.kv is c.session_records()["s"]
    assert r2.kv.cache_protected_len == 8
    c.checkpoint(r2, up_to=14)  # a later turn publishes nothing
    assert c.total_size() == 9  # the prompt, and the other request's extra token
    e.finish(r2)
    assert c.session_records()["s"].kv_committed_len == 14

    c.release_session("s")
    assert c.session_records() == {}
    assert e.rtp.available_size() == 4
    assert e.sp.available_size() == 8 - 2  # the tree's two states (prompt, other request)
    assert e.kv.available_size() == 64 - 9  # only the tree's tokens
    assert c.protected_size() == 0
    c.evict(EvictParams(num_tokens=100))
    assert e.kv.available_size() == 64 and e.sp.available_size() == 8
    c.sanity_check()


def test_an_aborted_turn_is_released_as_any_request() -> None:
    e = Engine()
    c = e.cache
    r1 = Req("t1", P1, session=session("s"))
    e.admit(r1)
    c.checkpoint(r1, up_to=len(P1))
    r1.finished_reason = SimpleNamespace(is_abort=True)
    c.release_kv_cache(r1, checkpoint=False)
    assert c.session_records() == {}
    assert e.kv.available_size() == 64 - 8  # the published prompt stays in the tree
    assert c.protected_size() == 0
    assert e.sp.available_size() == 8 - 1  # the tree's state; the request's own went back
    c.sanity_check()


@pytest.mark.parametrize("policy", ["gds", "gdsf", "gds_adaptive"])
def test_gds_is_refused_with_streaming_sessions_on_a_model_with_recurrent_state(policy: str) -> None:
    kv = TokenAllocator(16)
    sp = tiny_state_pool(4)
    rtp = ReqToTokenPool(2, 16, mamba_pool=sp)
    with pytest.raises(ValueError, match="enable_streaming_session"):
        UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                          token_to_kv_pool_allocator=kv, page_size=1,
                                          eviction_policy=policy, enable_streaming_session=True))
    # without sessions, or without recurrent state, the policy is accepted
    UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                      token_to_kv_pool_allocator=kv, page_size=1,
                                      eviction_policy=policy))
    UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(2, 16),
                                      token_to_kv_pool_allocator=TokenAllocator(16),
                                      page_size=1, eviction_policy=policy,
                                      enable_streaming_session=True))


def test_without_sessions_a_streaming_request_is_an_ordinary_one() -> None:
    e = Engine(sessions=False)
    r1 = Req("t1", P1, session=session("s"))
    e.admit(r1)
    e.decode(r1, O1)
    e.finish(r1)
    assert e.cache.session_records() == {}
    assert e.cache.total_size() == 10 and e.rtp.available_size() == 4
    assert torch.equal(e.cache.path_device_indices(
        e.cache.match_prefix(MatchPrefixParams(key=RadixKey(P1 + O1))).last_device_node),
        e.cache.all_values_flatten())
