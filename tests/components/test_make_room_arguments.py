"""``make_room``'s arguments: the arena must be the cache's, and the learned target is bounded
by what the states can own.

Shapes as tests/components/test_unified_eviction.py: 64 B per KV token, page_size 2, a chunk of
3 pages = 6 tokens = 384 B.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocators.arena import MemoryArena
from components.compaction import compact_kv
from components.eviction.unified import UnifiedStrategy, make_room
from radix.cache import RadixCache
from tests.components.test_unified_eviction import CFG, KV, ST, P, Q, build, insert, tree

S = 384


def test_an_arena_that_is_not_the_caches_is_refused_and_nothing_changes() -> None:
    # The other arena is full (KV and states all handed out): served by the cache, it would
    # evict the cache's entries for memory they do not hold, then fail.
    cache, a = build(chunks=20, state_slots=4)
    for key in (P, Q):
        insert(cache, a, key)
    other = MemoryArena(19 * S, KV, ST, state_slots=4)
    assert other.kv_allocator.alloc(other.kv_allocator.available_size()) is not None
    assert other.state_pool.alloc(4) is not None
    before = (tree(cache), cache.stats(), a.kv_allocator.snapshot(), a.state_pool.snapshot(),
              other.kv_allocator.snapshot(), other.state_pool.snapshot(), other.owner.tobytes())
    for kwargs in ({"kv_tokens": 6}, {"states": 1}, {}):
        with pytest.raises(ValueError, match="arena: .*not this arena's views"):
            make_room(cache, other, **kwargs)
    after = (tree(cache), cache.stats(), a.kv_allocator.snapshot(), a.state_pool.snapshot(),
             other.kv_allocator.snapshot(), other.state_pool.snapshot(), other.owner.tobytes())
    assert after == before
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, UnifiedStrategy) and walk.boundary.target_bytes is None  # not bound
    # a cache over the arena's KV view but another state pool is refused too
    mixed = RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=other.state_pool)
    with pytest.raises(ValueError, match="arena"):
        make_room(mixed, a, states=1)
    cache.sanity_check()
    a.check()
    other.check()


def test_the_target_is_bounded_by_the_usable_chunks() -> None:
    # 2 usable chunks (768 B) and the padding chunk (384 B) on top: the states can own at
    # most 2 chunks, so the target cannot exceed 768 B.
    cache, a = build(chunks=3, state_slots=2)
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, UnifiedStrategy)
    assert a.state_pool.alloc(2) is not None  # both states held by requests
    assert make_room(cache, a, states=1) is False  # nothing to evict: refused
    b = walk.boundary
    assert b.capacity_bytes == 2 * S
    # refused 1 state: the target 2 chunks + 384 B = 1,152 B, clamped at 768 B
    assert b.target_bytes == 2 * S and b.target_chunks(a.chunk_bytes) == 2
    b.check()


def test_a_request_larger_than_the_arena_evicts_nothing() -> None:
    # 19 usable chunks of 6 tokens: 2 + 19 * 6 = 116 tokens, 20 states, or 60 tokens (10
    # chunks) with 10 states never fit, whatever is evicted: refused up front, the cache and
    # the learned target as they were.
    cache, a = build(chunks=20, state_slots=4)
    for key in (P, Q):
        insert(cache, a, key)
    assert make_room(cache, a)  # binds the target at the band: 4 chunks
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, UnifiedStrategy)
    before = (tree(cache), cache.stats(), a.kv_allocator.snapshot(), a.state_pool.snapshot(),
              a.owner.tobytes(), walk.boundary.target_bytes, walk.boundary.states_refused)
    for kwargs in ({"kv_tokens": 116}, {"states": 20}, {"kv_tokens": 60, "states": 10}):
        assert make_room(cache, a, **kwargs) is False
        assert (tree(cache), cache.stats(), a.kv_allocator.snapshot(), a.state_pool.snapshot(),
                a.owner.tobytes(), walk.boundary.target_bytes,
                walk.boundary.states_refused) == before
    cache.sanity_check()
    # 114 tokens (19 chunks) is no refusal up front: an arena all KV serves it
    kv_only, b = build(chunks=20, state_slots=0)
    assert make_room(kv_only, b, kv_tokens=114) is True
    a.check()


def test_counts_follow_the_librarys_int_rule() -> None:
    # as every count of the arena (kv_to_state, ensure_kv, ...): a numpy int is an int; a
    # bool or a float is the wrong kind (TypeError), a negative count out of range
    # (ValueError); each names the argument, nothing changes.
    cache, a = build(chunks=20, state_slots=4)
    insert(cache, a, P)
    before = (tree(cache), a.kv_allocator.snapshot(), a.state_pool.snapshot(),
              a.owner.tobytes())
    calls = {
        "states": lambda v: make_room(cache, a, states=v),
        "kv_tokens": lambda v: make_room(cache, a, kv_tokens=v),
        "num_chunks": lambda v: compact_kv(cache, a, v),
    }
    for name, call in calls.items():
        for bad, err in ((True, TypeError), (1.0, TypeError), ("1", TypeError),
                         (-1, ValueError), (np.int64(-1), ValueError)):
            with pytest.raises(err, match=name):
                call(bad)
        assert (tree(cache), a.kv_allocator.snapshot(), a.state_pool.snapshot(),
                a.owner.tobytes()) == before
    assert make_room(cache, a, states=np.int64(1), kv_tokens=np.int64(6)) is True
    assert compact_kv(cache, a, np.int64(0)) is True
    cache.sanity_check()
    a.check()


def test_kv_with_no_chunk_gets_one_back() -> None:
    # Every usable chunk a state (state_slots = all, or the states took the last KV chunk):
    # the target starts at the band, KV's share is 0 and KV has no evidence to lower it (a
    # KV ghost needs a KV leaf). KV is served from the free state chunks, lowest first.
    cache, a = build(chunks=20, state_slots=19)
    assert a.kv_allocator.available_size() == 0
    assert make_room(cache, a, kv_tokens=8) is True  # ceil(8 / 6) = 2 chunks: 1 and 2
    assert a.owner.tolist()[:4] == [0, 1, 1, 2] and a.num_kv_chunks == 2
    assert a.kv_allocator.available_size() == 12
    # with KV owning a chunk again, its share rule holds as before: no exception
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, UnifiedStrategy) and walk.boundary.target_chunks(S) == 19
    cache.sanity_check()
    a.check()


def test_a_bad_on_evict_is_refused_before_any_eviction() -> None:
    cache, a = build(chunks=20, state_slots=4)
    for key in (P, Q):
        insert(cache, a, key)
    assert a.kv_allocator.alloc(a.kv_allocator.available_size()) is not None  # KV full
    assert a.state_pool.alloc(2) is not None  # states full: room only by eviction
    before = tree(cache)
    with pytest.raises(TypeError, match="on_evict"):
        make_room(cache, a, kv_tokens=6, on_evict="print")
    assert tree(cache) == before  # nothing evicted for a call that could not report it


def test_arguments_of_the_wrong_kind_are_type_errors_naming_them() -> None:
    cache, a = build(chunks=20, state_slots=4)
    insert(cache, a, P)
    before = (tree(cache), a.kv_allocator.snapshot(), a.state_pool.snapshot())
    for call, name in (
        (lambda: make_room(None, a), "cache"),
        (lambda: make_room(cache, None), "arena"),
        (lambda: make_room(cache, "arena"), "arena"),
        (lambda: compact_kv(None, a, 1), "cache"),
        (lambda: compact_kv(cache, None, 1), "arena"),
        (lambda: compact_kv(cache, a.kv_allocator, 1), "arena"),  # a view, not the arena
    ):
        with pytest.raises(TypeError, match=f"^{name} must be"):
            call()
    assert (tree(cache), a.kv_allocator.snapshot(), a.state_pool.snapshot()) == before
