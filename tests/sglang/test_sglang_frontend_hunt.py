"""Bugs a new embedder found in the SGLang front end (``radix.sglang``), each with the
scenario that showed it; every expected count is worked out by hand in the test's comments."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from allocators import PagedAllocator, SWAAllocator, TokenAllocator
from hicache import HiCacheConfig
from radix.sglang import (
    CacheInitParams,
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    Req,
    ReqToTokenPool,
    UnifiedRadixCache,
)
from radix.sglang.evict_policy import LFUStrategy, LRUStrategy
from tests.helpers.cache_helpers import tiny_state_pool


def kv_cache(cls: type[UnifiedRadixCache], page: int, size: int = 64,
             ) -> tuple[UnifiedRadixCache, Any, ReqToTokenPool]:
    kv: Any = TokenAllocator(size) if page == 1 else PagedAllocator(size, page)
    rtp = ReqToTokenPool(4, 32)
    fe = cls(CacheInitParams(disable=False, req_to_token_pool=rtp,
                             token_to_kv_pool_allocator=kv, page_size=page))
    return fe, kv, rtp


def admit(fe: UnifiedRadixCache, kv: Any, rtp: ReqToTokenPool, prompt: list[int],
          rid: int) -> Req:
    """The scheduler's admission: match, take a row, put the matched slots and fresh ones
    (whole pages) in it, lock the matched node."""
    req = Req(rid=rid, origin_input_ids=prompt)
    m = fe.match_prefix(MatchPrefixParams(key=req.radix_key()))
    assert rtp.alloc([req]) is not None and req.kv.req_pool_idx is not None
    row, p, ps = req.kv.req_pool_idx, m.device_prefix_len, fe.page_size
    alloc_len = -(-len(prompt) // ps) * ps
    fresh = kv.alloc(alloc_len - p)
    assert fresh is not None
    rtp.req_to_token[row, :p] = m.device_indices
    rtp.req_to_token[row, p:alloc_len] = fresh
    req.kv.cache_protected_len = p
    req.kv.kv_committed_len = len(prompt)
    req.kv.kv_allocated_len = alloc_len
    req.last_node = m.last_device_node
    req.lock = fe.lock(m.last_device_node)
    return req


def take_row(fe: UnifiedRadixCache, kv: Any, rtp: ReqToTokenPool, req: Req, node: Any,
             total: int, matched: torch.Tensor | None = None) -> torch.Tensor:
    """A session turn's admission: lock ``node`` for ``req``, take a row, write the matched
    slots and then fresh ones up to ``total`` tokens (all computed); returns the fresh."""
    req.last_node = node
    req.lock = fe.lock(node)
    assert rtp.alloc([req]) is not None and req.kv.req_pool_idx is not None
    row, p = req.kv.req_pool_idx, 0 if matched is None else len(matched)
    if matched is not None and p:
        rtp.write((row, slice(0, p)), matched)
    fresh = kv.alloc(total - p)
    assert fresh is not None
    rtp.write((row, slice(p, total)), fresh)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = total
    return fresh


# ======================================================= duplicates of a racing request
@pytest.mark.parametrize("cls", [RadixCache, UnifiedRadixCache])
@pytest.mark.parametrize("page", [1, 4])
def test_a_racing_requests_duplicate_slots_go_back_on_release(
        cls: type[UnifiedRadixCache], page: int) -> None:
    """Two requests with the same 8-token head run together (neither matched the other).
    The first to finish puts its 8 tokens in the tree; the second's 8 slots for them are
    duplicates, which SGLang's ``checkpoint`` frees (``free_segment(row[protected:prefix])``)
    for ``RadixCache`` as for the unified cache. Before, ``RadixCache``'s checkpoint
    overwrote them in the row and never freed them: 8 slots leaked per race."""
    fe, kv, rtp = kv_cache(cls, page)
    head = list(range(1, 9))
    a = admit(fe, kv, rtp, head + [50, 51], rid=0)  # 10 tokens
    b = admit(fe, kv, rtp, head + [60, 61, 62, 63], rid=1)  # 12 tokens
    a.finished_reason = b.finished_reason = "stop"
    fe.cache_finished_req(a)
    fe.cache_finished_req(b)
    fe.sanity_check()
    # tree: a's 10 tokens cut to whole pages (page 1: 10, page 4: 8), then b's tail after
    # the shared head, [8, 12) (4 tokens at either page size): page 1: 10 + 4 = 14; page 4:
    # 8 + 4 = 12. Every allocated slot is the tree's; nothing else is held.
    tree = 14 if page == 1 else 12
    assert fe.total_size() == tree
    assert kv.used_size() == tree
    assert fe.match_prefix(MatchPrefixParams(key=b.radix_key())).device_prefix_len == 12


# ======================================================= a checkpoint below the protected prefix
@pytest.mark.parametrize("up_to", [0, 2, 4])
def test_a_shorter_checkpoint_keeps_the_protected_prefix_locked(up_to: int) -> None:
    """``b`` matched 5 cached tokens (``cache_protected_len`` 5, locked at the node ending
    at 5). A checkpoint up to fewer tokens keeps ``cache_protected_len`` at 5 (the tree
    already owns them; ``test_sglang_round3``), so it must keep the lock covering them too.
    Before, the lock moved up to the node ending at ``up_to`` while ``cache_protected_len``
    stayed 5: an eviction freed 5 - up_to tree slots the request's row still read (and the
    allocator could hand them to another request). Now the lock stays; an eviction of
    everything leaves b's 5 protected tokens in the tree."""
    fe, kv, rtp = kv_cache(UnifiedRadixCache, 1)
    a = admit(fe, kv, rtp, [1, 2, 3, 4, 5], rid=0)
    a.finished_reason = "stop"
    fe.cache_finished_req(a)
    b = admit(fe, kv, rtp, [1, 2, 3, 4, 5, 6, 7], rid=1)
    assert b.kv.cache_protected_len == 5 and fe.protected_size() == 5
    fe.checkpoint(b, up_to=up_to)
    assert b.kv.cache_protected_len == 5 and fe.protected_size() == 5
    fe.evict(10**6)
    # b's 5 protected tokens stay in the tree (locked) and allocated; its own 2 stay with it
    assert b.req_pool_idx is not None
    row = rtp.req_to_token[b.req_pool_idx, :7]
    assert kv.is_free(row).tolist() == [False] * 7
    assert fe.total_size() == 5 and kv.used_size() == 7
    fe.checkpoint(b, up_to=7)  # past the protected prefix: the lock moves down
    assert b.kv.cache_protected_len == 7 and fe.protected_size() == 7
    b.finished_reason = "stop"
    fe.cache_finished_req(b)
    assert fe.protected_size() == 0 and fe.total_size() == 7 and kv.used_size() == 7
    fe.sanity_check()


# ======================================================= reset with an open streaming session
@pytest.mark.parametrize("published", [True, False])
def test_reset_ends_open_streaming_sessions_and_gives_their_memory_back(published: bool) -> None:
    """SGLang's ``flush_cache`` resets the tree cache while a streaming session is idle
    between turns; its ``reset`` drops the session slots with the tree. Before, the front
    end's ``reset`` raised "reset while requests hold locks" when the session had published
    its prompt (the session's lock), and otherwise dropped the session's record without
    giving back its KV row, its 10 slots and its state slot (leaked). Now the sessions are
    released first: every pool is back to full."""
    kv, sp = TokenAllocator(64), tiny_state_pool(8)
    rtp = ReqToTokenPool(4, 64, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           enable_streaming_session=True))
    prompt = list(range(1, 9))
    req = Req("t1", prompt, session=SimpleNamespace(session_id="s", streaming=True))
    m = fe.match_prefix(MatchPrefixParams(key=req.radix_key(), req=req, cow_mamba=True))
    take_row(fe, kv, rtp, req, m.last_device_node, 10)
    req.output_ids = [50, 51]
    fe.maybe_hand_to_session(req)
    if published:
        fe.checkpoint(req, up_to=8)  # 8 tokens and a state copy into the tree, locked
    req.finished_reason = "stop"
    fe.release_kv_cache(req, checkpoint=True)
    assert fe.session_records()["s"].kv_committed_len == 10
    # held: the session's row; its 10 slots (8 of them the tree's when published); its
    # running state, and the tree's copy when published
    assert rtp.available_size() == 3
    assert kv.used_size() == 10 and sp.used_size() == (2 if published else 1)
    fe.reset()
    assert fe.session_records() == {}
    assert fe.total_size() == 0 and fe.protected_size() == 0
    assert kv.used_size() == 0 and sp.used_size() == 0 and rtp.available_size() == 4
    fe.sanity_check()


def test_reset_with_a_running_requests_lock_is_refused_and_keeps_the_sessions() -> None:
    """A running (non-session) request's lock still refuses the reset, and the open session
    is left as it was: its record, its lock on the published prompt."""
    kv, sp = TokenAllocator(64), tiny_state_pool(8)
    rtp = ReqToTokenPool(4, 64, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           enable_streaming_session=True))
    req = Req("t1", [1, 2, 3, 4], session=SimpleNamespace(session_id="s", streaming=True))
    fe.match_prefix(MatchPrefixParams(key=req.radix_key(), req=req, cow_mamba=True))
    take_row(fe, kv, rtp, req, fe.root_node, 4)
    fe.maybe_hand_to_session(req)
    fe.checkpoint(req, up_to=4)
    req.finished_reason = "stop"
    fe.release_kv_cache(req, checkpoint=True)
    other = fe.lock(fe.match_prefix([1, 2, 3, 4]).last_device_node)  # a running request's
    assert fe.protected_size() == 4
    with pytest.raises(ValueError, match="reset while requests hold locks"):
        fe.reset()
    assert fe.session_records()["s"].kv_committed_len == 4
    fe.unlock(other)
    assert fe.protected_size() == 4  # the session's lock, still held
    fe.reset()
    assert kv.used_size() == 0 and sp.used_size() == 0 and rtp.available_size() == 4
    fe.sanity_check()


# ======================================================= a session checkpoint that fails
def test_a_failed_session_checkpoint_leaves_the_lock_with_the_session() -> None:
    """A streaming turn's checkpoint that raises (here: no state slot for the tree's copy,
    every state held) must leave the session's lock with the session. Before, the lock had
    been moved onto the request for the insert and stayed there: the finished turn left
    it behind (the session keeps the record, not the request's lock) and ``release_session``
    released nothing, so the 4 matched tokens stayed protected for ever."""
    kv, sp = TokenAllocator(64), tiny_state_pool(3)
    rtp = ReqToTokenPool(4, 64, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           enable_streaming_session=True))
    fe.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=kv.alloc(4), mamba_value=sp.alloc(1)))
    held = sp.alloc(1)  # another request's running state
    assert held is not None
    req = Req("t1", list(range(1, 9)), session=SimpleNamespace(session_id="s", streaming=True))
    m = fe.match_prefix(MatchPrefixParams(key=req.radix_key(), req=req, cow_mamba=True))
    assert m.device_prefix_len == 4 and sp.available_size() == 0  # the copy took the last
    take_row(fe, kv, rtp, req, m.last_device_node, 8, matched=m.device_indices)
    req.kv.cache_protected_len = 4
    fe.maybe_hand_to_session(req)
    assert fe.protected_size() == 4
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        fe.checkpoint(req, up_to=8)  # the tree's only state is the locked one
    req.finished_reason = "stop"
    fe.release_kv_cache(req, checkpoint=True)  # the session keeps the record
    assert fe.protected_size() == 4  # the session's lock on its matched prefix
    fe.release_session("s")
    assert fe.protected_size() == 0 and fe.session_records() == {}
    sp.free(held)
    fe.evict(EvictParams(num_tokens=100))
    assert kv.used_size() == 0 and sp.used_size() == 0 and rtp.available_size() == 4
    fe.sanity_check()


def test_a_refused_session_turn_does_not_borrow_the_sessions_record() -> None:
    """A turn whose key is shorter than what its session published is refused
    (``ValueError``: sessions are append-only). Before, the request had already been handed
    the session's KV record when the error was raised, so releasing the refused request as
    an abort ended the session and freed its row. Now the request keeps its own (empty)
    record and the session is untouched."""
    kv = TokenAllocator(64)
    rtp = ReqToTokenPool(4, 64)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           enable_streaming_session=True))
    s = SimpleNamespace(session_id="s", streaming=True)
    t1 = Req("t1", list(range(1, 9)), session=s)
    m = fe.match_prefix(MatchPrefixParams(key=t1.radix_key(), req=t1))
    take_row(fe, kv, rtp, t1, m.last_device_node, 8)
    fe.maybe_hand_to_session(t1)
    fe.checkpoint(t1, up_to=8)  # publishes the 8 prompt tokens
    t1.finished_reason = "stop"
    fe.release_kv_cache(t1, checkpoint=True)
    record = fe.session_records()["s"]
    t2 = Req("t2", list(range(1, 6)), session=s)  # 5 < 8 published tokens
    own = t2.kv
    with pytest.raises(ValueError, match="sessions are append-only"):
        fe.match_prefix(MatchPrefixParams(key=t2.radix_key(), req=t2))
    assert t2.kv is own and not t2.kv.holds_kv
    assert fe.session_records()["s"] is record and record.kv_committed_len == 8
    assert fe.protected_size() == 8 and rtp.available_size() == 3
    fe.release_session("s")
    assert fe.protected_size() == 0 and kv.used_size() == 8 and rtp.available_size() == 4
    fe.sanity_check()


# ======================================================= SWA copies a session keeps
@pytest.mark.parametrize("end", ["release_session", "reset"])
def test_a_sessions_swa_copies_over_a_locked_tombstone_go_back_when_it_ends(end: str) -> None:
    """Window 4. The tree holds ``head`` (8 tokens) as a tombstone (SWA evicted) that
    another reader keeps locked, so a session's first turn over ``head + [20, 21]`` cannot
    hand its live copies of ``head`` to the tree: its row keeps its own 8 slots below
    ``cache_protected_len`` (10). A request frees such copies when it is released
    (``release_kv_cache``); a session keeps its row past its turns, and ``release_session``
    freed only ``[cache_protected_len, kv_allocated_len)``: the 8 copies leaked (and so
    did ``reset``, which ends the open sessions). Now they go back when the session ends."""
    kv = SWAAllocator(64, 32)
    rtp = ReqToTokenPool(4, 64)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           enable_streaming_session=True, sliding_window_size=4))
    head = list(range(1, 9))
    first = kv.alloc(8)
    assert first is not None
    fe.insert(InsertParams(key=RadixKey(head), value=first))
    tail = kv.alloc(2)
    assert tail is not None
    fe.insert(InsertParams(key=RadixKey(head + [9, 10]), value=torch.cat([first, tail])))
    assert fe.evict(EvictParams(num_tokens=0, swa_num_tokens=8)).swa_num_tokens_evicted == 8
    (node,) = fe.root_node.children.values()  # head: internal, a tombstone now
    reader = fe.inc_lock_ref(node)
    req = Req("t1", head + [20, 21], session=SimpleNamespace(session_id="s", streaming=True))
    m = fe.match_prefix(MatchPrefixParams(key=req.radix_key(), req=req))
    assert m.device_prefix_len == 0  # no live window over the tombstone
    take_row(fe, kv, rtp, req, m.last_device_node, 10)
    fe.maybe_hand_to_session(req)
    fe.checkpoint(req, up_to=10)  # publishes: the tree takes [20, 21]; head's copies kept
    req.finished_reason = "stop"
    fe.release_kv_cache(req, checkpoint=True)  # the session keeps its row
    # tree: head 8 + [9, 10] + [20, 21] = 12; the session's kept copies of head: 8
    assert fe.total_size() == 12 and kv.used_size() == 20
    if end == "release_session":
        fe.release_session("s")
        assert kv.used_size() == 12 and kv.swa_used_size() == 4  # live SWA: [9, 10], [20, 21]
        fe.dec_lock_ref(node, reader.to_dec_params())
        fe.evict(EvictParams(num_tokens=100))
    else:
        fe.dec_lock_ref(node, reader.to_dec_params())
        fe.reset()
        assert fe.session_records() == {}
    assert kv.used_size() == 0 and kv.swa_used_size() == 0 and rtp.available_size() == 4
    fe.sanity_check()


# ======================================================= the session hint of gds_adaptive
def test_the_requests_session_reaches_the_library_as_its_hint() -> None:
    """``gds_adaptive`` reads each request's session (``radix.hints``: ``extra={"session_id":
    ...}``, SGLang's ``Req.session_id``) as evidence. SGLang hands it over as
    ``InsertParams.session_id`` (its checkpoint fills it from the request) and the match
    has the request in ``MatchPrefixParams.req``. Before, the front end dropped both, so
    under SGLang the walk never saw a session. Now the match, the insert and the checkpoint
    pass ``{"session_id": ...}``; a request without a session passes ``None``."""
    kv, sp = TokenAllocator(64), tiny_state_pool(4)
    rtp = ReqToTokenPool(4, 64, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           eviction_policy="gds_adaptive"))
    match = mock.patch.object(fe.cache, "match_prefix", wraps=fe.cache.match_prefix)
    insert = mock.patch.object(fe.cache, "insert", wraps=fe.cache.insert)
    with match as lib_match, insert as lib_insert:
        run_the_calls(fe, kv, sp, rtp)
    hint = {"session_id": "conv-7"}
    assert [c.kwargs["extra"] for c in lib_match.call_args_list] == [hint, None]
    assert [c.kwargs["extra"] for c in lib_insert.call_args_list] == [hint,
                                                                      {"session_id": "conv-8"}]
    bad: Any = 1.5
    with pytest.raises(TypeError, match=r"params.session_id must be a str or an int"):
        fe.insert(InsertParams(key=RadixKey([9]), value=kv.alloc(1), mamba_value=sp.alloc(1),
                               session_id=bad))


def run_the_calls(fe: UnifiedRadixCache, kv: TokenAllocator, sp: Any,
                  rtp: ReqToTokenPool) -> None:
    """A session request's match and checkpoint, an insert naming a session, a bare match."""
    req = Req("r", [1, 2, 3, 4], session=SimpleNamespace(session_id="conv-7", streaming=False))
    m = fe.match_prefix(MatchPrefixParams(key=req.radix_key(), req=req))
    fresh = take_row(fe, kv, rtp, req, m.last_device_node, 4)
    fe.checkpoint(req, up_to=4)
    state = sp.alloc(1)
    fe.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=torch.cat([fresh, kv.alloc(1)]),
                           mamba_value=state, session_id="conv-8"))
    fe.match_prefix(RadixKey([1, 2, 3]))  # no request: no hint


# ======================================================= SGLang's flush_cache
def test_sglangs_flush_cache_sequence_runs_and_leaves_every_pool_full() -> None:
    """SGLang's scheduler flushes an idle cache with ``tree_cache.reset()``,
    ``req_to_token_pool.clear()``, ``token_to_kv_pool_allocator.clear()``. The front end's
    ``ReqToTokenPool`` had no ``clear`` (``AttributeError``); it now frees every row and, as
    SGLang's hybrid pool does, the state pool. A request admitted afterwards runs as on a
    fresh cache."""
    kv, sp = TokenAllocator(32), tiny_state_pool(4)
    rtp = ReqToTokenPool(2, 32, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1))
    req = Req("r", [1, 2, 3, 4, 5])
    assert rtp.alloc([req]) is not None and req.kv.req_pool_idx is not None
    fresh = kv.alloc(5)
    assert fresh is not None
    rtp.write((req.kv.req_pool_idx, slice(0, 5)), fresh)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = 5
    req.last_node = fe.root_node
    req.finished_reason = "stop"
    fe.release_kv_cache(req)
    assert fe.total_size() == 5 and sp.used_size() == 1  # the tree's tokens and state
    fe.reset()
    rtp.clear()
    kv.clear()
    assert fe.total_size() == 0 and kv.used_size() == 0 and sp.used_size() == 0
    assert rtp.available_size() == 2
    again = Req("r2", [1, 2, 3])
    assert rtp.alloc([again]) is not None and again.kv.req_pool_idx is not None
    assert again.kv.mamba_pool_idx is not None and sp.used_size() == 1
    assert fe.match_prefix([1, 2, 3]).device_prefix_len == 0
    fe.sanity_check()


# ======================================================= SGLang's strategy classes
@pytest.mark.parametrize(("cls", "knob"), [(LRUStrategy, "bogus"), (LFUStrategy, "decay")])
def test_a_strategy_refuses_an_unknown_knob_with_a_type_error_naming_it(cls: Any,
                                                                        knob: str) -> None:
    """SGLang's ``LRUStrategy()`` takes no knob: an unknown one is Python's ``TypeError``
    for an unexpected keyword. Before, the registry lookup raised ``KeyError``."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{knob}'"):
        cls(**{knob: 1})


# ======================================================= init_load_back's count
def host_tree(threshold: int = 1) -> tuple[UnifiedRadixCache, TokenAllocator]:
    """``a`` (8 tokens): KV on device, its state only on host; ``b`` = ``a`` + 4 tokens:
    KV and state only on host (write-through backups, then device evictions)."""
    kv, sp = TokenAllocator(64), tiny_state_pool(4)
    rtp = ReqToTokenPool(2, 32, mamba_pool=sp)
    fe = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=kv, page_size=1,
        hicache=HiCacheConfig(hicache_ratio=2.0, hicache_write_policy="write_through",
                              load_back_threshold=threshold)))
    a = list(range(1, 9))
    fe.insert(InsertParams(key=RadixKey(a), value=kv.alloc(8), mamba_value=sp.alloc(1)))
    head = fe.match_prefix(RadixKey(a)).device_indices
    tail = kv.alloc(4)
    assert tail is not None
    fe.insert(InsertParams(key=RadixKey(a + [20, 21, 22, 23]), value=torch.cat([head, tail]),
                           mamba_value=sp.alloc(1)))
    fe.check_hicache_events()
    assert fe.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4  # b's leaf: to host
    assert fe.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1  # a's state
    return fe, kv


@pytest.mark.parametrize(("extra", "promised", "end"), [([20, 21, 22, 23, 30], 12, 12),
                                                         ([30], 8, 8)])
def test_init_load_back_reports_the_tokens_the_prefix_grew_by(extra: list[int], promised: int,
                                                              end: int) -> None:
    """SGLang's scheduler reads ``init_load_back``'s count as the tokens its prefix grew by
    (``collect_full_device_indices(best, last device node)``) and raises when it is between
    0 and the promised ``host_hit_length`` ("must commit all promised FULL tokens or
    none"). The library's ``host_hit_length`` also counts device KV behind a host-only
    state, but ``load_back`` returns only the KV tokens it copied: b's load reported 4 of 12
    promised (SGLang's scheduler raises), a's state-only load reported 0 of 8 (the
    scheduler recomputes 8 cached tokens). Now the count is the promise once the load went
    through."""
    fe, kv = host_tree()
    key = RadixKey(list(range(1, 9)) + extra)
    m = fe.match_prefix(MatchPrefixParams(key=key))
    assert (m.device_prefix_len, m.host_hit_length) == (0, promised)
    loaded, node = fe.init_load_back(InitLoadBackParams(
        best_match_node=m.best_match_node, host_hit_length=m.host_hit_length))
    assert loaded == promised and node is m.best_match_node
    after = fe.match_prefix(MatchPrefixParams(key=key))
    assert after.device_prefix_len == end and after.last_device_node is node
    fe.sanity_check()


def test_init_load_back_that_does_not_happen_leaves_the_request_where_it_was() -> None:
    """A load below ``load_back_threshold`` does nothing: 0 tokens, and the node the request
    ends at is still its last device node (SGLang returns ``req.last_node``), not the
    host-only node it asked for. Before, the host-only node came back."""
    fe, kv = host_tree(threshold=100)
    key = RadixKey(list(range(1, 9)) + [20, 21, 22, 23, 30])
    m = fe.match_prefix(MatchPrefixParams(key=key))
    req = Req("r", key.token_ids)
    req.last_node = m.last_device_node
    loaded, node = fe.init_load_back(InitLoadBackParams(
        best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req))
    assert loaded == 0 and node is m.last_device_node and fe.is_root(node)
    assert fe.match_prefix(MatchPrefixParams(key=key)).device_prefix_len == 0
    fe.sanity_check()


# ======================================================= a checkpoint past the computed KV
def test_a_checkpoint_past_the_computed_kv_is_refused() -> None:
    """5 slots allocated, 3 computed (``kv_committed_len``). A checkpoint up to 5 put the
    2 uncomputed slots in the tree for other requests to match, and set
    ``cache_protected_len`` to 5 > ``kv_committed_len``, after which ``release_kv_cache``
    refused the request ("lengths out of order"): its lock and row could never be given
    back. Now: ``ValueError`` naming ``up_to``, nothing changed; up to 3 is accepted and
    the request is released normally."""
    fe, kv, rtp = kv_cache(UnifiedRadixCache, 1)
    r = admit(fe, kv, rtp, [1, 2, 3, 4, 5], rid=0)
    r.kv.kv_committed_len = 3
    before = (fe.cache.pretty_print(), kv.snapshot(), r.kv.cache_protected_len)
    with pytest.raises(ValueError, match=r"up_to must be <= req.kv.kv_committed_len = 3"):
        fe.checkpoint(r, up_to=5)
    assert (fe.cache.pretty_print(), kv.snapshot(), r.kv.cache_protected_len) == before
    fe.checkpoint(r, up_to=3)
    assert r.kv.cache_protected_len == 3 and fe.total_size() == 3
    r.finished_reason = "stop"
    fe.release_kv_cache(r)  # tree keeps its 3 tokens; the 2 uncomputed slots go back
    assert fe.total_size() == 3 and kv.used_size() == 3 and fe.protected_size() == 0
    fe.sanity_check()


def test_a_window_slide_past_the_computed_kv_is_refused() -> None:
    """Window 4; 10 tokens computed, 16 slots allocated. ``evict_sliding_windows(req, 16)``
    freed the SWA KV of every token more than a window before 16, the request's live window
    ``[6, 10)`` among them, which its next step attends to. Now: ``ValueError`` naming
    ``pre_len``, nothing freed; a slide at 10 frees ``[0, 6)`` and keeps the window."""
    kv = SWAAllocator(64, 32)
    rtp = ReqToTokenPool(2, 32)
    fe = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtp,
                                           token_to_kv_pool_allocator=kv, page_size=1,
                                           sliding_window_size=4))
    r = Req("r", list(range(1, 11)))
    assert rtp.alloc([r]) is not None and r.kv.req_pool_idx is not None
    slots = kv.alloc(16)
    assert slots is not None
    rtp.write((r.kv.req_pool_idx, slice(0, 16)), slots)
    r.kv.kv_committed_len, r.kv.kv_allocated_len = 10, 16
    r.last_node = fe.root_node
    with pytest.raises(ValueError, match=r"pre_len must be <= req.kv.kv_committed_len = 10"):
        fe.evict_sliding_windows(r, 16)
    assert kv.has_swa(slots).tolist() == [True] * 16 and r.kv.swa_evicted_seqlen == 0
    fe.evict_sliding_windows(r, 10)
    assert kv.has_swa(slots[:10]).tolist() == [False] * 6 + [True] * 4
