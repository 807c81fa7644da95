"""The remembered walk of a ``RadixKey`` and the storage each node owns.

An engine matches a request's key and then inserts it: with a ``RadixKey`` (built once per
request) the insert takes the walk its match remembered, as long as the tree's structure has
not changed in between. These scenarios change the tree between the two calls in every way
that can (a split, a new leaf, an eviction, a reset) and check the insert's exact answer;
the walk counts show when the remembered walk is taken.

A split gives each half its own slot storage: a half is never a view that keeps the other's
storage alive after it leaves.
"""

from __future__ import annotations

import pytest

import radix.tree as tree_mod
from allocators import TokenAllocator
from radix import CacheConfig, RadixCache, RadixKey


def make(size: int = 64) -> tuple[RadixCache, TokenAllocator]:
    kv = TokenAllocator(size)
    return RadixCache(CacheConfig(page_size=1), kv_allocator=kv), kv


def insert(cache: RadixCache, kv: TokenAllocator, key: RadixKey | list[int]) -> tuple[int, int]:
    """Insert ``key`` with fresh slots, free the caller's duplicates; (prefix_len,
    inserted_len)."""
    value = kv.alloc(len(key))
    assert value is not None
    res = cache.insert(key, value)
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()
    return res.prefix_len, res.inserted_len


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the node segments the walks compare (a remembered walk compares none): the
    walk runs its Python loop (the C loop's reference) over a counting comparison."""
    count = [0]
    real = tree_mod.common_prefix_len

    def counted(seg: tree_mod.Tokens, key: tree_mod.Tokens, pos: int, limit: int) -> int:
        count[0] += 1
        return real(seg, key, pos, limit)

    monkeypatch.setattr(tree_mod, "common_prefix_len", counted)
    monkeypatch.setattr(tree_mod, "walk_from", tree_mod._walk_from_py)
    return count


def test_match_then_insert_of_one_radix_key_walks_once(walks: list[int]) -> None:
    cache, kv = make()
    insert(cache, kv, [1, 2, 3, 4])
    key = RadixKey([1, 2, 3, 4, 5, 6])
    walks[0] = 0
    m = cache.match_prefix(key)
    assert m.prefix_len == 4
    assert walks[0] == 1  # one node compared
    assert insert(cache, kv, key) == (4, 6)  # the match's walk: 4 tokens cached
    assert walks[0] == 1  # none compared again
    # a plain list is validated and walked on every call: [1..4] then [5, 6], twice
    walks[0] = 0
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert insert(cache, kv, [1, 2, 3, 4, 5, 6, 7]) == (6, 7)
    assert walks[0] == 4
    # the namespace is part of the walk: the same tokens under another extra_key miss
    nskey = RadixKey([1, 2, 3, 4, 5, 6], extra_key="lora-a")
    cache.match_prefix(nskey)
    assert insert(cache, kv, nskey) == (0, 6)


def test_a_split_between_match_and_insert_retires_the_remembered_walk(walks: list[int]) -> None:
    cache, kv = make()
    insert(cache, kv, [1, 2, 3, 4, 5, 6])
    key = RadixKey([1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match_prefix(key).prefix_len == 6  # remembered: one node [1..6], whole
    # another request splits that node at 3 and adds a branch
    assert insert(cache, kv, [1, 2, 3, 9]) == (3, 4)
    walks[0] = 0
    assert insert(cache, kv, key) == (6, 8)  # walked again over [1,2,3] -> [4,5,6]
    assert walks[0] == 2
    path = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).last_device_node.path_to_root()
    assert [list(n.key) for n in reversed(path)] == [[1, 2, 3], [4, 5, 6], [7, 8]]


def test_an_eviction_between_match_and_insert_retires_the_remembered_walk() -> None:
    cache, kv = make()
    insert(cache, kv, [1, 2, 3])
    insert(cache, kv, [7, 8])
    key = RadixKey([1, 2, 3, 4])
    assert cache.match_prefix(key).prefix_len == 3
    cache.evict(3)  # LRU: [7, 8] (2 tokens), then [1, 2, 3] go
    assert cache.total_size() == 0
    assert insert(cache, kv, key) == (0, 4)  # nothing cached any more: all four are new
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 4
    cache.reset()
    assert insert(cache, kv, key) == (0, 4)  # after a reset too


def test_a_new_leaf_between_match_and_insert_is_seen() -> None:
    cache, kv = make()
    key = RadixKey([5, 6, 7, 8])
    assert cache.match_prefix(key).prefix_len == 0  # remembered: nothing cached
    assert insert(cache, kv, [5, 6]) == (0, 2)  # another request caches [5, 6]
    assert insert(cache, kv, key) == (2, 4)  # the insert finds them
    assert cache.tree.num_nodes == 2
