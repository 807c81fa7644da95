"""Per-chunk held / locked page counts and page holders (``components.kv_chunks``), kept by
the KV component's hooks, against a recount from the tree's nodes written here.

Shapes: 64 B per KV token, page_size 2 (128 B per page), 3 pages per chunk, budget 4000 B ->
10 chunks; ``state_slots=3``: chunks 7..9 states, 1..6 KV. Chunk c holds pages 3c .. 3c+2;
page p holds slots 2p, 2p+1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from allocators.arena import KVShape, MemoryArena, StateShape, group_counts
from components.compaction import compact_kv
from components.eviction.unified import make_room
from components.kv_chunks import ChunkHolders
from radix.cache import RadixCache
from radix.config import CacheConfig
from radix.node import TreeNode
from radix.results import LockRef

KV = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16, page_size=2)
ST = StateShape(num_layers=2, conv_state_shape=(4, 3), ssm_state_shape=(2, 4, 4))
CFG = CacheConfig(page_size=2, radix_eviction_policy="unified")
PPC = 3  # pages per chunk of these shapes


def make() -> tuple[RadixCache, MemoryArena]:
    a = MemoryArena(3616, KV, ST, state_slots=3)
    assert a.pages_per_chunk == PPC and a.num_chunks == 10
    return RadixCache(CFG, kv_allocator=a.kv_allocator, state_allocator=a.state_pool), a


def insert(cache: RadixCache, a: MemoryArena, key: list[int], room: bool = False) -> bool:
    """Insert ``key`` with fresh slots for its unmatched tail and a state; ``False`` (nothing
    inserted) when the arena is short. With ``room``, ``make_room`` first (it evicts, moves
    chunks, compacts)."""
    if room and not make_room(cache, a, kv_tokens=len(key), states=1):
        return False
    m = cache.match_prefix(key)
    new = a.kv_allocator.alloc(len(key) - m.prefix_len)
    if new is None:
        return False
    slot = a.state_pool.alloc_slot()
    if slot is None:
        a.kv_allocator.free(new)
        return False
    res = cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot)
    if res.duplicate_indices.numel():
        a.kv_allocator.free(res.duplicate_indices)
    return True


def recount(cache: RadixCache, num_chunks: int) -> tuple[list[int], list[int], dict[int, int]]:
    """Per chunk the pages the tree's nodes hold and those its locked nodes hold, and each
    held page's node id: counted page by page from every node's slots."""
    held = [0] * num_chunks
    locked = [0] * num_chunks
    holder: dict[int, int] = {}
    for node in cache.tree.iter_nodes():
        if node.kv_value is None:
            continue
        for slot in list(node.kv_value)[::2]:
            page = slot // 2
            held[page // PPC] += 1
            if node.kv_lock:
                locked[page // PPC] += 1
            holder[page] = node.id
    return held, locked, holder


def assert_matches(cache: RadixCache, a: MemoryArena) -> None:
    got = cache.kv.chunks
    assert got is not None
    held, locked, holder = recount(cache, a.num_chunks)
    assert got.held.tolist() == held
    assert got.locked.tolist() == locked
    assert {p: int(got.holder[p]) for p in holder} == holder
    assert set(got.nodes) == set(holder.values())
    got.check(cache.tree.iter_nodes())  # its own check agrees
    cache.sanity_check()
    a.check()


def test_counts_by_hand() -> None:
    cache, a = make()
    h = a.kv_allocator.alloc(4)  # pages 3, 4 (chunk 1): a request's, outside the tree
    assert h is not None
    assert insert(cache, a, [0, 1, 2, 3, 4, 5])  # pages 5, 6, 7 (chunks 1, 2)
    got = cache.kv.track_chunks(cache.tree, PPC)
    assert cache.kv.track_chunks(cache.tree, PPC) is got  # kept, not recounted
    assert got.held.tolist() == [0, 1, 2, 0, 0, 0, 0, 0, 0, 0]
    assert got.locked.tolist() == [0] * 10
    # splits A after 2 tokens; [0, 1] holds no state, so nothing matches: the insert's 4
    # fresh slots (pages 8, 9) lose their first page as a duplicate (freed), B keeps page 9
    assert insert(cache, a, [0, 1, 100, 101])
    by_key = {tuple(n.key): n for n in cache.tree.iter_nodes()}
    upper, b = by_key[(0, 1)], by_key[(100, 101)]
    assert got.held.tolist() == [0, 1, 2, 1, 0, 0, 0, 0, 0, 0]
    assert int(got.holder[5]) == upper.id and int(got.holder[9]) == b.id
    assert [int(got.holder[p]) for p in (6, 7)] == [by_key[(2, 3, 4, 5)].id] * 2
    lock = cache.inc_lock_ref(b)  # locks b (page 9) and the split's upper node (page 5)
    assert got.locked.tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert_matches(cache, a)
    cache.dec_lock_ref(lock)
    assert got.locked.tolist() == [0] * 10
    a.kv_allocator.free(h)
    # chunks 1 [. . upper] and 3 [B . .] hold one used page each: the tie goes to chunk 3,
    # B's page 9 moves to the lowest free page of the other partly used chunks, page 3
    assert compact_kv(cache, a, 1)
    assert list(b.kv_value or []) == [6, 7]
    assert got.held.tolist() == [0, 2, 2, 0, 0, 0, 0, 0, 0, 0]
    assert int(got.holder[3]) == b.id
    assert_matches(cache, a)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "insert", "insert", "lock", "evict",
                                           "compact", "request"]),
                          st.integers(0, 10 ** 6)), min_size=1, max_size=40))
def test_random_operations_against_a_recount(ops: list[tuple[str, int]]) -> None:
    """Inserts (half of them making room first: evictions, boundary moves, compactions),
    locks, evictions, compactions and a request's pages, checked against :func:`recount`
    after every step."""
    cache, a = make()
    cache.kv.track_chunks(cache.tree, PPC)  # kept from the empty tree on
    locks: list[TreeNode | LockRef] = []
    requests: list[torch.Tensor] = []
    for op, x in ops:
        rng = np.random.default_rng(x)
        if op == "insert":
            # 3 first tokens, 9 others: shared prefixes, splits, duplicates, distinct leaves
            n = 2 * int(rng.integers(1, 4))
            key = [int(rng.integers(0, 3))] + [int(t) for t in rng.integers(0, 9, size=n - 1)]
            insert(cache, a, key, room=x % 3 != 0)
        elif op == "lock":  # lock a node while fewer than 2 are locked, else unlock one
            nodes = [n for n in cache.tree.iter_nodes() if n.kv_value is not None]
            if nodes and len(locks) < 2:
                locks.append(cache.inc_lock_ref(nodes[x % len(nodes)]))
            elif locks:
                cache.dec_lock_ref(locks.pop(x % len(locks)))
        elif op == "evict":
            cache.evict_bytes(1 + x % 500)
        elif op == "compact":
            compact_kv(cache, a, 1 + x % 2)
        elif op == "request":  # a request's pages outside the tree, taken or given back
            if requests:
                a.kv_allocator.free(requests.pop())
            else:
                got = a.kv_allocator.alloc(2)
                if got is not None:
                    requests.append(got)
        assert_matches(cache, a)
    for lock in locks:
        cache.dec_lock_ref(lock)
    assert_matches(cache, a)


def test_group_counts_matches_unique() -> None:
    rng = np.random.default_rng(0)
    for size, groups in ((0, 5), (1, 100), (3, 100), (50, 10), (1000, 7)):
        g = rng.integers(0, groups, size=size).astype(np.int64)
        want = np.unique(g, return_counts=True)
        got = group_counts(g, groups)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_bad_sizes_are_refused() -> None:
    for kw in ({"num_ids": 0}, {"group": 0}, {"page_size": True}):
        args = {"num_ids": 8, "group": 2, "page_size": 1, **kw}
        with pytest.raises(ValueError, match=next(iter(kw))):
            ChunkHolders(**args)
