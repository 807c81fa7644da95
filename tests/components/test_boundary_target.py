"""The arena boundary's learned target (``components.eviction.boundary.BoundaryTarget``) and the
``make_room`` rule that holds the boundary to it.

Shapes as tests/components/test_unified_eviction.py: 64 B per KV token (``K``), page_size 2, a
chunk of 3 pages = 6 tokens = 384 B (``S``); ``build()``: 20 chunks (7,680 B), chunk 0 padding,
15 KV chunks (90 tokens), 4 state chunks. Keys (GDS ``d = 1, e = 0``: cost = tokens rebuilt)::

    P = 0..3            node P, depth 4, state
    Q = P + 4..39       node Q, depth 40, state       (a child of P)
    R = P + 100..103    node R, depth 8, state        (a child of P)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators.arena import MemoryArena
from components.eviction.boundary import BoundaryTarget
from components.eviction.unified import UnifiedStrategy, make_room
from radix.cache import RadixCache
from radix.node import TreeNode
from tests.components.test_unified_eviction import CFG, KV, ST, P, Q, R

K, S = 64, 384


def build() -> tuple[RadixCache, MemoryArena, BoundaryTarget]:
    a = MemoryArena(19 * S, KV, ST, state_slots=4)
    cache = RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    for key in (P, Q, R):
        m = cache.match_prefix(key)
        new = a.kv_allocator.alloc(len(key) - len(m.device_indices))
        slot = a.state_pool.alloc_slot()
        assert new is not None and slot is not None
        assert cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot).state_adopted
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, UnifiedStrategy)
    assert walk.boundary.target_bytes is None  # not bound before make_room
    assert make_room(cache, a)  # nothing asked: binds the target at the band, 4 * S
    assert walk.boundary.target_bytes == 4 * S and walk.boundary.band_bytes == 4 * S
    return cache, a, walk.boundary


def node(cache: RadixCache, key: list[int]) -> TreeNode:
    m = cache.match_prefix(key)
    assert m.kv_hit_length == len(key)
    return m.last_device_node


def tree(cache: RadixCache) -> list[tuple[int, bool]]:
    return sorted((n.depth, n.state_slot is not None) for n in cache.tree.iter_nodes()
                  if n.parent is not None)


def test_evidence_in_target_out_by_hand() -> None:
    b = BoundaryTarget(K, S)
    with pytest.raises(RuntimeError, match="before observe"):
        b.target_chunks(S)
    b.on_state_refused(1)  # not bound: no evidence
    assert b.states_refused == 0
    b.observe(20 * S, 4 * S, 2)
    b.observe(20 * S, 6 * S, 2)  # a second call moves the band, not the target
    assert (b.target_bytes, b.band_bytes, b.target_chunks(S)) == (4 * S, 6 * S, 4)
    b.on_state_refused(2)  # + 2 S
    assert b.target_bytes == 6 * S and b.target_chunks(S) == 6
    b._move(-3 * K)  # 2304 - 192 = 2112 B = 5.5 chunks: rounds to 6
    assert b.target_chunks(S) == 6
    b._move(-10**9)
    assert b.target_bytes == 0.0  # clamped at 0
    b.on_state_refused(100)
    assert b.target_bytes == 20 * S  # clamped at the capacity
    b.check()
    bads: list[Any] = [0, True, 1.5]
    for bad in bads:
        with pytest.raises(ValueError, match="kv_bytes_per_token"):
            BoundaryTarget(bad, S)
    with pytest.raises(ValueError, match="band_bytes"):
        b.observe(20 * S, 21 * S, 2)
    with pytest.raises(ValueError, match="page_size"):
        b.observe(20 * S, S, 0)


def test_state_ghost_hit_moves_the_target_up() -> None:
    cache, a, b = build()
    assert cache.evict_states(1).num_states == 1  # P's state (internal, cheapest)
    assert tree(cache) == [(4, False), (8, True), (40, True)]
    # A match of P + 4..9 ends inside Q (split at 10, no state below): usable 0; P's state,
    # evicted, would have made 4 tokens usable: + 4 K.
    m = cache.match_prefix(Q[:10])
    assert (m.prefix_len, m.kv_hit_length) == (0, 10)
    assert b.target_bytes == 4 * S + 4 * K and (b.state_ghost_hits, b.state_ghost_tokens) == (1, 4)
    cache.match_prefix(Q[:10])  # the ghost entry left on its hit
    assert b.target_bytes == 4 * S + 4 * K
    cache.sanity_check()


def test_kv_ghost_hit_moves_the_target_down_and_is_bounded() -> None:
    cache, a, b = build()
    # Everything goes: R (4 tokens), Q (36), then P (4), leaves with their states. The KV
    # ghost holds at most the state band's bytes: 4 S / K = 24 tokens, so Q (36) is forgotten
    # with R (the oldest) at once, and P stays.
    assert cache.evict(44).num_tokens == 44 and tree(cache) == []
    assert b._kv_ghost_tokens == 4
    m = cache.match_prefix(Q)  # nothing cached; P's 4 tokens would have been: - 4 K
    assert m.kv_hit_length == 0
    assert b.target_bytes == 4 * S - 4 * K and (b.kv_ghost_hits, b.kv_ghost_tokens) == (1, 4)
    cache.match_prefix(R)  # P's entry left on its hit; R and Q were forgotten
    assert b.target_bytes == 4 * S - 4 * K and b.kv_ghost_hits == 1
    cache.sanity_check()


def test_kv_ghost_needs_the_whole_leaf() -> None:
    cache, a, b = build()
    assert cache.evict(1).num_tokens == 4  # R, with its state
    cache.match_prefix(P + [100, 101, 7, 7])  # diverges inside R's tokens: no hit
    assert b.kv_ghost_hits == 0 and b.target_bytes == 4 * S
    cache.match_prefix(R)  # R's tokens in full: the hit, - 4 K
    assert b.kv_ghost_hits == 1 and b.target_bytes == 4 * S - 4 * K
    cache.sanity_check()


def depth_id(cache: RadixCache, depth: int) -> int:
    """The id of the node ending at ``depth`` (found without a match, which would feed the
    ghosts)."""
    (n,) = [n for n in cache.tree.iter_nodes() if n.parent is not None and n.depth == depth]
    return n.id


def test_leaf_state_evicted_with_its_leaf_is_a_state_ghost_hit() -> None:
    cache, a, b = build()
    # P's state (internal, 4 tokens to rebuild), then R's (8: P's is gone); R is a leaf and
    # leaves with its state (a stateless leaf is pruned): its tokens go to the leaf ghost,
    # not to the KV ghost (no KV eviction chose it).
    assert cache.evict_states(2).num_states == 2
    assert tree(cache) == [(4, False), (40, True)]
    assert list(b._leaf_ghost) == [(depth_id(cache, 4), (100, 101))] and not b._kv_ghost
    # R again: the match ends at P (4 tokens, usable 0); R's state and KV would have made
    # all 8 usable: + 8 K, and P's node entry (shallower) is not looked at.
    m = cache.match_prefix(R)
    assert (m.prefix_len, m.kv_hit_length) == (0, 4)
    assert b.target_bytes == 4 * S + 8 * K
    assert (b.state_ghost_hits, b.state_ghost_tokens, b.kv_ghost_hits) == (1, 8, 0)
    # The leaf entry left on its hit; P's node entry gives its 4 tokens next: + 4 K.
    cache.match_prefix(R)
    assert b.target_bytes == 4 * S + 12 * K and (b.state_ghost_hits, b.state_ghost_tokens) == (2, 12)
    cache.match_prefix(R)  # both entries gone
    assert b.target_bytes == 4 * S + 12 * K
    cache.sanity_check()


def test_leaf_ghost_and_kv_ghost_are_disjoint() -> None:
    cache, a, b = build()
    assert cache.evict(1).num_tokens == 4  # R, with its state, by the KV order: KV ghost
    assert list(b._kv_ghost) == [(depth_id(cache, 4), (100, 101))] and not b._leaf_ghost
    # R back with a state (inserted without a match: no ghost look-up), then its state goes
    # by the state order and takes the leaf along: the key moves to the leaf ghost.
    new = a.kv_allocator.alloc(8)
    slot = a.state_pool.alloc_slot()
    assert new is not None and slot is not None
    res = cache.insert(R, new, state_slot=slot)
    assert res.state_adopted
    a.kv_allocator.free(res.duplicate_indices)  # P's 4, already cached
    assert cache.evict_states(2).num_states == 2  # P's (internal), then R's with its leaf
    assert tree(cache) == [(4, False), (40, True)]
    assert list(b._leaf_ghost) == [(depth_id(cache, 4), (100, 101))] and not b._kv_ghost
    assert b._kv_ghost_tokens == 0
    # R again: usable 0, R's state would have made 8: + 8 K; no KV ghost hit (- 4 K).
    m = cache.match_prefix(R)
    assert (m.prefix_len, m.kv_hit_length) == (0, 4)
    assert b.target_bytes == 4 * S + 8 * K and (b.state_ghost_hits, b.kv_ghost_hits) == (1, 0)
    cache.sanity_check()


def test_make_room_kv_short_at_its_share_evicts_kv_then_fails() -> None:
    cache, a, b = build()
    kv, st = a.kv_allocator, a.state_pool
    lock = cache.inc_lock_ref(node(cache, Q))  # P and Q locked: 40 KV tokens
    assert (kv.available_size(), st.available_size()) == (46, 1)
    # 52 tokens: one chunk more than free. The band is at the target (4) and KV's locked
    # 40 + 52 > its share 15 * 6 = 90: KV frees its own (R, 4 tokens, and R's state), then
    # has nothing left to evict. The free state chunks stay states.
    assert make_room(cache, a, kv_tokens=52) is False
    assert tree(cache) == [(4, True), (40, True)] and a.num_state_chunks == 4
    assert st.available_size() == 2 and kv.available_size() == 50
    # Target one chunk lower: the free state chunk is KV's to take.
    b.target_bytes = 3 * S
    assert make_room(cache, a, kv_tokens=52) is True
    assert a.num_state_chunks == 3 and kv.available_size() == 56
    cache.dec_lock_ref(lock)
    # Nothing locked: KV may pass its share (0 + 60 <= (19 - 3) * 6 = 96), and takes a chunk.
    assert make_room(cache, a, kv_tokens=60) is True and a.num_state_chunks == 2
    cache.sanity_check()
    a.check()


def test_make_room_states_short_at_their_share_evict_states_or_refuse() -> None:
    cache, a, b = build()
    st = a.state_pool
    held = st.alloc_slot()  # the last free slot, a request's: in use
    assert held is not None and st.available_size() == 0
    # In use 1 (+ 1 asked) fits the target 4: a wholly free KV chunk moves.
    assert make_room(cache, a, states=1) is True and a.num_state_chunks == 5
    b.target_bytes = 2 * S
    held2 = st.alloc_slot()
    assert held2 is not None and st.available_size() == 0
    # Band 5 >= target 2 and in use 2 + 1 > 2: the states free their own (P's, cheapest).
    assert make_room(cache, a, states=1) is True and a.num_state_chunks == 5
    assert tree(cache) == [(4, False), (8, True), (40, True)]
    lock_q = cache.inc_lock_ref(node(cache, Q))
    lock_r = cache.inc_lock_ref(node(cache, R))
    held3 = st.alloc_slot()
    assert held3 is not None
    # Every state in use: refused; the target rises by one state's bytes.
    assert make_room(cache, a, states=1) is False
    assert b.target_bytes == 3 * S and b.states_refused == 1 and a.num_state_chunks == 5
    cache.dec_lock_ref(lock_q)
    cache.dec_lock_ref(lock_r)
    for s in (held, held2, held3):
        st.free_slot(s)
    cache.sanity_check()
    a.check()


def test_seeded_stress_make_room_keeps_its_contract() -> None:
    """Random requests (match, lock, make_room, alloc, insert, unlock) on a small arena:
    ``make_room`` True -> the room is there; False -> the boundary did not move; every
    structure checks after each step."""
    import random

    rng = random.Random(7)
    a = MemoryArena(29 * S, KV, ST, state_slots=6)
    cache = RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, UnifiedStrategy)
    kv, st = a.kv_allocator, a.state_pool
    running: list[tuple[Any, int]] = []
    outcomes = {True: 0, False: 0}
    # 24 keys over 4 shared prefixes (2..8 tokens), which are keys too (states on internal
    # nodes): they repeat, so evicted KV and states are asked for again
    pool = [[p] * (2 + 2 * p) + [p * 50 + j] * (2 * (j % 6) + 2) for p in range(4)
            for j in range(6)] + [[p] * (2 + 2 * p) for p in range(4)]
    for _ in range(400):
        if running and (len(running) > 4 or rng.random() < 0.3):
            lock, slot = running.pop(rng.randrange(len(running)))
            cache.dec_lock_ref(lock)
            st.free_slot(slot)
        else:
            key = pool[rng.randrange(len(pool))]
            m = cache.match_prefix(key)
            lock = cache.inc_lock_ref(m.last_device_node)
            n = len(key) - m.prefix_len
            band = a.num_state_chunks
            ok = make_room(cache, a, kv_tokens=n, states=2)
            outcomes[ok] += 1
            if ok:
                assert kv.available_size() >= n and st.available_size() >= 2
                new = kv.alloc(n)
                slot, snap = st.alloc_slot(), st.alloc_slot()
                assert new is not None and slot is not None and snap is not None
                res = cache.insert(key, torch.cat([m.device_indices, new]), state_slot=snap)
                if not res.state_adopted:
                    st.free_slot(snap)
                if len(res.duplicate_indices):
                    kv.free(res.duplicate_indices)
                cache.dec_lock_ref(lock)
                m2 = cache.match_prefix(key)
                running.append((cache.inc_lock_ref(m2.last_device_node), slot))
            else:
                assert a.num_state_chunks == band
                cache.dec_lock_ref(lock)
        cache.sanity_check()
        a.check()
        walk.boundary.check()
    assert outcomes[True] > 0 and outcomes[False] > 0, outcomes
    b = walk.boundary
    assert b.kv_ghost_hits > 0 and b.state_ghost_hits > 0 and b.target_bytes != 6 * S
