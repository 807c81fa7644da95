"""The plain KV cache's inline eviction walk (``KVComponent.evict_leaves``) against the
general one it replaces (``CacheCore.evict``'s loop over the component hooks).

A narrated case pins the victims, the tokens freed and the allocator's free order by hand; a
seeded random run drives twin caches (inline walk and general walk) through the same inserts,
matches, locks and evictions and requires the same result after every eviction: the same
``EvictResult``, the same nodes, the same allocator state (free order included), and both
caches' ``sanity_check``. The configurations that need the general walk (a state component,
a host tier) are checked not to take the inline one.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import allocators.free_list as free_list_mod
from allocators import PagedAllocator, TokenAllocator
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import draw_tokens, free_leftovers, free_slots, tiny_state_pool


def _cache(alloc: TokenAllocator | PagedAllocator, policy: str = "lru") -> RadixCache:
    return RadixCache(CacheConfig(page_size=alloc.page_size, radix_eviction_policy=policy),
                      kv_allocator=alloc)


def _insert(cache: RadixCache, alloc: TokenAllocator | PagedAllocator, toks: list[int]) -> None:
    m = cache.match_prefix(toks)
    need = len(toks) - m.prefix_len
    fresh = alloc.alloc(-(-need // alloc.page_size) * alloc.page_size)
    assert fresh is not None
    res = cache.insert(toks, torch.cat([m.device_indices, fresh[:need]]))
    free_leftovers(alloc, res, fresh, need)


def test_inline_walk_by_hand() -> None:
    # tree: root - [1,1] (slots 1-2) - [2,2,2] (3-5) and [3] (6); then [4,4] (7-8) at the
    # root. LRU order of the leaves: [2,2,2] (inserted first), [3], [4,4].
    alloc = TokenAllocator(8)
    cache = _cache(alloc)
    assert cache.core._evict_inline is not None  # the plain KV cache takes the inline walk
    for toks in ([1, 1, 2, 2, 2], [1, 1, 3], [4, 4]):
        _insert(cache, alloc, toks)
    assert alloc.available_size() == 0
    # one token asked: the oldest leaf goes whole (3 tokens, slots 3-5)
    res = cache.evict(1)
    assert (res.num_tokens, res.num_states, res.num_swa_tokens) == (3, 0, 0)
    assert free_slots(alloc) == [3, 4, 5]
    # 2 tokens: [3] (1 token, slot 6), then its parent [1,1], now an unlocked leaf whose
    # stamp (the insert of [1,1,3]) is older than [4,4]'s: 3 tokens freed in all
    res = cache.evict(2)
    assert res.num_tokens == 3
    assert free_slots(alloc) == [3, 4, 5, 6, 1, 2]
    assert cache.evictable_size() == 2 and cache.total_size() == 2
    cache.sanity_check()
    alloc.check()
    # a locked leaf is never a victim: nothing left to free
    m = cache.match_prefix([4, 4])
    lock = cache.inc_lock_ref(m.last_device_node)
    assert cache.evict(10).num_tokens == 0
    cache.dec_lock_ref(lock)
    assert cache.evict(10).num_tokens == 2
    assert free_slots(alloc) == [3, 4, 5, 6, 1, 2, 7, 8]
    cache.sanity_check()
    alloc.check()


def test_general_walk_when_other_components_watch() -> None:
    alloc = TokenAllocator(16)
    hybrid = RadixCache(CacheConfig(), kv_allocator=alloc, state_allocator=tiny_state_pool(4))
    assert hybrid.core._evict_inline is None  # a state component: the general walk


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "lfu", "gds", "priority"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("one_pass", [True, False])
def test_inline_walk_matches_the_general_walk(ps: int, policy: str, seed: int,
                                              one_pass: bool) -> None:
    # one_pass=False: the twin also frees without the allocator's one-pass free that clears
    # the held marks (``owned_release``): the C unmark, then ``free_owned`` (its reference)
    rng = random.Random(seed * 31 + ps)
    size = 96 * ps
    allocs = [TokenAllocator(size) if ps == 1 else PagedAllocator(size, ps) for _ in range(2)]
    caches = [_cache(a, policy) for a in allocs]
    caches[1].core._evict_inline = None  # the twin runs the general walk
    assert caches[0].core._evict_inline is not None
    assert caches[0].kv._release is not None or free_list_mod._release_held_c is None
    if not one_pass:
        caches[1].kv._release = None
    keys: list[list[int]] = []
    locks: list[list[Any]] = [[], []]
    for _ in range(150):
        toks = draw_tokens(rng, keys, min_cut=1, grow=(1, 3 * ps), fresh=(ps, 6 * ps))
        op = rng.random()
        if op < 0.15 and any(locks):
            i = rng.randrange(len(locks[0]))
            for c, held in zip(caches, locks, strict=True):
                c.dec_lock_ref(held.pop(i))
        elif op < 0.3:
            for c, held in zip(caches, locks, strict=True):
                m = c.match_prefix(toks)
                if m.prefix_len:
                    held.append(c.inc_lock_ref(m.last_device_node))
        else:
            need = len(toks) // ps * ps + ps
            for c, a in zip(caches, allocs, strict=True):
                if a.available_size() < need:
                    c.evict(need - a.available_size())
            ask = rng.randint(0, 4 * ps)
            got = [c.evict(ask) for c in caches]
            assert got[0] == got[1]
            if allocs[0].available_size() >= need:
                for c, a in zip(caches, allocs, strict=True):
                    _insert(c, a, toks)
        assert allocs[0].snapshot() == allocs[1].snapshot()
        assert (caches[0].kv._held == caches[1].kv._held).all()  # the same held marks
        assert caches[0].total_size() == caches[1].total_size()
        assert caches[0].evictable_size() == caches[1].evictable_size()
    for c, a in zip(caches, allocs, strict=True):
        c.sanity_check()
        a.check()


def test_inline_walk_without_the_one_pass_free(monkeypatch: pytest.MonkeyPatch) -> None:
    # no C pass (no compiler at install time): the one-pass free refuses, changing nothing,
    # and the walk frees through the unmark and free_owned: the same victims and free order
    monkeypatch.setattr(free_list_mod, "_release_held_c", None)
    test_inline_walk_by_hand()
