"""Compaction of the arena's KV band (``components.compaction.compact_kv``), the per-chunk free
counters and ``MemoryArena.relocate_kv_pages``.

Shapes as tests/allocators/test_arena.py: 64 B per KV token, page_size 2 (128 B per page), 3
pages per chunk, budget 4000 B -> 10 chunks; ``state_slots=3``: chunks 7..9 states, 1..6 KV.
Chunk c holds pages 3c, 3c+1, 3c+2; page p holds slots 2p, 2p+1 (token rows of 64 B).

Scenario of the hand-built tests (``build``)::

    h = alloc(4)           pages 3, 4                  (chunk 1)
    A = 0..5, alloc(6)     pages 5, 6, 7   -> node A   (chunks 1, 2)
    B = A + 100, 101       page 8          -> node B   (chunk 2)
    C = 200, 201           page 9          -> node C   (chunk 3)
    free(h)
    chunk 1: [.  .  A]   chunk 2: [A  A  B]   chunk 3: [C  .  .]   chunks 4..6 wholly free
"""

from __future__ import annotations

import random
from typing import cast

import numpy as np
import pytest
import torch

from allocators.arena import KVShape, MemoryArena, StateShape
from components.compaction import compact_kv
from radix.cache import RadixCache
from radix.config import CacheConfig
from radix.node import TreeNode

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))
CFG = CacheConfig(page_size=2, radix_eviction_policy="unified")
A = [0, 1, 2, 3, 4, 5]
B = A + [100, 101]
C = [200, 201]


def rows(a: MemoryArena) -> torch.Tensor:
    """The arena's KV bytes, one row of 64 B per token slot."""
    return a.buffer.view(-1, KV.bytes_per_token)


def fill(a: MemoryArena, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    a.buffer.copy_(torch.randint(0, 256, a.buffer.shape, dtype=torch.uint8, generator=g))


def node_of(cache: RadixCache, key: list[int]) -> TreeNode:
    m = cache.match_prefix(key)
    assert m.prefix_len == len(key)
    return m.last_device_node


def slots(node: TreeNode) -> list[int]:
    assert node.kv_value is not None
    return list(node.kv_value)


def insert(cache: RadixCache, a: MemoryArena, key: list[int]) -> None:
    m = cache.match_prefix(key)
    new = a.kv_allocator.alloc(len(key) - m.prefix_len)
    slot = a.state_pool.alloc_slot()
    assert new is not None and slot is not None
    cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot)


def build() -> tuple[RadixCache, MemoryArena]:
    a = MemoryArena(3616, KV, ST, state_slots=3)
    fill(a)
    cache = RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    h = a.kv_allocator.alloc(4)
    assert h is not None and h.tolist() == [6, 7, 8, 9]
    for key in (A, B, C):
        insert(cache, a, key)
    a.kv_allocator.free(h)
    return cache, a


def snaps(a: MemoryArena) -> tuple[object, ...]:
    return (a.kv_allocator.snapshot(), a.state_pool.snapshot(), a.owner.tobytes(),
            a.kv_free_per_chunk.tobytes(), a.buffer.clone())


def same(x: tuple[object, ...], y: tuple[object, ...]) -> bool:
    return x[:4] == y[:4] and torch.equal(cast(torch.Tensor, x[4]), cast(torch.Tensor, y[4]))


def test_free_counters_per_chunk_by_hand() -> None:
    cache, a = build()
    assert a.kv_free_per_chunk.tolist() == [0, 2, 0, 2, 3, 3, 3, 0, 0, 0]
    assert a.movable_kv_chunks() == 3
    assert a.stranded_bytes() == 4 * 128  # pages 3, 4 and 10, 11
    assert a.kv_to_state(1)  # chunk 6 (the highest wholly free)
    assert a.kv_free_per_chunk.tolist() == [0, 2, 0, 2, 3, 3, 0, 0, 0, 0]
    assert not a.state_to_kv(2)  # chunks 7..9 hold A's, B's and C's states
    assert a.state_to_kv(1)  # chunk 6 back
    assert a.kv_free_per_chunk.tolist() == [0, 2, 0, 2, 3, 3, 3, 0, 0, 0]
    with pytest.raises(AssertionError):
        a.kv_allocator.lowest.group_free[1] += 1
        a.check()
    a.kv_allocator.lowest.group_free[1] -= 1
    a.check()
    cache.sanity_check()


def test_compaction_moves_exactly_the_cheapest_chunk_and_data_follows() -> None:
    cache, a = build()
    c = node_of(cache, C)
    assert slots(c) == [18, 19]
    before = rows(a)[[18, 19]].clone()
    # chunks 1 and 3 hold one used page each; the tie goes to the higher, chunk 3: page 9
    # moves to the lowest free page of the other partly used chunks, page 3 (slots 6, 7)
    assert compact_kv(cache, a, 1)
    assert slots(c) == [6, 7]
    assert torch.equal(rows(a)[[6, 7]], before)
    assert a.kv_free_per_chunk.tolist() == [0, 1, 0, 3, 3, 3, 3, 0, 0, 0]
    assert a.movable_kv_chunks() == 4
    assert slots(node_of(cache, A)) == [10, 11, 12, 13, 14, 15]  # untouched
    assert cache.match_prefix(C).device_indices.tolist() == [6, 7]
    a.check()
    cache.sanity_check()
    # a second compaction: chunk 1 (pages 3 C, 4 free, 5 A) empties into... nowhere: chunk 2
    # is full, the rest wholly free -> refused, nothing changed
    s0 = snaps(a)
    assert not compact_kv(cache, a, 1)
    assert same(snaps(a), s0)


def test_locked_and_request_pages_are_never_moved() -> None:
    cache, a = build()
    c = node_of(cache, C)
    lock = cache.inc_lock_ref(c)
    s0 = snaps(a)
    # chunk 3 holds C (locked); chunk 1 and 2 hold A's page 5 across them: emptying chunk 1
    # needs one free page elsewhere in a partly used chunk: pages 10, 11 of chunk 3
    assert compact_kv(cache, a, 1)
    assert slots(c) == [18, 19]
    assert slots(node_of(cache, A)) == [20, 21, 12, 13, 14, 15]  # its page 5 -> page 10
    assert a.kv_free_per_chunk.tolist() == [0, 3, 0, 1, 3, 3, 3, 0, 0, 0]
    assert not same(snaps(a), s0)
    cache.dec_lock_ref(lock)
    cache.sanity_check()
    a.check()

    # a page a request holds outside the tree pins its chunk
    cache, a = build()
    held = a.kv_allocator.alloc(2)
    assert held is not None and held.tolist() == [6, 7]  # page 3, chunk 1
    lock_b = cache.inc_lock_ref(node_of(cache, B))  # locks A and B
    s0 = snaps(a)
    assert compact_kv(cache, a, 1)  # only chunk 3 (C) can empty: into page 4
    assert slots(node_of(cache, C)) == [8, 9]
    lock_c = cache.inc_lock_ref(node_of(cache, C))
    s0 = snaps(a)
    # chunk 1: the request's page 3 (and A, C); chunk 2: A, B locked; the rest wholly free
    assert not compact_kv(cache, a, 1)
    assert same(snaps(a), s0)
    cache.dec_lock_ref(lock_b)
    cache.dec_lock_ref(lock_c)
    # unlocked, chunk 2 (3 used pages) still cannot empty: 0 free pages in partly used chunks
    assert not compact_kv(cache, a, 1)
    assert same(snaps(a), s0)
    a.kv_allocator.free(held)
    # chunk 1 [. C A] would need 2 free pages in another partly used chunk (chunk 2 is
    # full); wholly free chunks are never filled (the states can take them already)
    s0 = snaps(a)
    assert not compact_kv(cache, a, 1)
    assert same(snaps(a), s0)
    a.check()
    cache.sanity_check()


def test_relocate_refuses_misuse_and_changes_nothing() -> None:
    cache, a = build()
    s0 = snaps(a)
    i64 = np.int64
    for src, dst, err in (
        (np.array([9], i64), np.array([4, 3], i64), ValueError),  # lengths
        (np.array([9], np.int32), np.array([3], i64), TypeError),
        (np.array([10], i64), np.array([3], i64), ValueError),  # src free
        (np.array([9], i64), np.array([5], i64), ValueError),  # dst used
        (np.array([9], i64), np.array([21], i64), ValueError),  # dst in a state chunk
        (np.array([9, 9], i64), np.array([3, 4], i64), ValueError),  # repeated
        (np.array([9], i64), np.array([0], i64), ValueError),  # the padding page
    ):
        with pytest.raises(err):
            a.relocate_kv_pages(src, dst)
        assert same(snaps(a), s0)
    with pytest.raises(ValueError, match="num_chunks"):
        compact_kv(cache, a, -1)
    other = MemoryArena(3616, KV, ST, state_slots=3)
    with pytest.raises(ValueError, match="cache"):
        compact_kv(cache, other, 1)


def test_make_room_for_states_compacts_instead_of_evicting() -> None:
    from components.eviction.unified import make_room

    cache, a = build()
    assert a.kv_to_state(3)  # the wholly free chunks go to the states: 6 state slots, A, B
    slots_taken = [a.state_pool.alloc_slot() for _ in range(3)]  # and C hold 3
    assert None not in slots_taken and a.state_pool.available_size() == 0
    before = rows(a)[[18, 19]].clone()
    # one more state: KV has 4 free pages over chunks 1 and 3 -> chunk 3 compacted, moved
    assert make_room(cache, a, states=1)
    assert a.state_pool.available_size() == 1 and a.owner[3] == 2
    assert slots(node_of(cache, C)) == [6, 7] and torch.equal(rows(a)[[6, 7]], before)
    assert cache.evictable_size() == 10  # nothing evicted: A (6) + B (2) + C (2) tokens
    a.check()
    cache.sanity_check()


def test_seeded_stress_against_the_data_written() -> None:
    """Random inserts, evictions, locks and compactions; after each step every cached
    token's KV row (read through its node's slots) equals the row written for it, and
    every invariant holds."""
    rng = random.Random(7)
    a = MemoryArena(63 * 384, KV, ST, state_slots=20)
    cache = RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool)
    rowv = rows(a)
    expect: dict[int, torch.Tensor] = {}  # token id -> its KV row (a token has one position)
    keys: list[list[int]] = []
    locks = []
    next_tok = 0
    moved = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            head = rng.choice(keys)[: 2 * rng.randint(1, 4)] if keys and rng.random() < 0.5 else []
            n = 2 * rng.randint(1, 6)
            key = head + list(range(next_tok, next_tok + n))
            next_tok += n
            m = cache.match_prefix(key)
            new = a.kv_allocator.alloc(len(key) - m.prefix_len)
            slot = a.state_pool.alloc_slot()
            if slot is None:
                cache.evict_states(1)
                slot = a.state_pool.alloc_slot()
            if new is None or slot is None:
                if new is not None:
                    a.kv_allocator.free(new)
                if slot is not None:
                    a.state_pool.free_slot(slot)
                continue
            data = torch.randint(0, 256, (len(new), KV.bytes_per_token), dtype=torch.uint8)
            rowv[new] = data
            res = cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot)
            # (a match stops at the last state: the tree may hold more of the key than the
            # match gave; those of the caller's slots are duplicates, the tree keeps its own)
            for tok, r in zip(key[res.prefix_len:], data[res.prefix_len - m.prefix_len:],
                              strict=True):
                expect[tok] = r
            dup = res.duplicate_indices
            if dup.numel():
                a.kv_allocator.free(dup)
            if not res.state_adopted:
                a.state_pool.free_slot(slot)
            keys.append(key)
        elif op < 0.6:
            cache.evict(2 * rng.randint(1, 4))
        elif op < 0.7:
            nodes = cache.tree.iter_nodes()
            if nodes:
                locks.append(cache.inc_lock_ref(rng.choice(nodes)))
        elif op < 0.8 and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            s0 = snaps(a)
            if compact_kv(cache, a, rng.randint(1, 3)):
                moved += 1
            else:
                assert same(snaps(a), s0)
        for node in cache.tree.iter_nodes():
            if node.kv_value is None:
                continue
            got = rowv[torch.tensor(list(node.kv_value))]
            want = torch.stack([expect[t] for t in node.key])
            assert torch.equal(got, want), node
        a.check()
        cache.sanity_check()
    assert moved >= 5  # the stress did compact
