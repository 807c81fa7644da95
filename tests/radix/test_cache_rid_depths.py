"""A request counts once per node in ``hit_count``, whatever order its re-inserts come in.

``insert(rid=...)`` remembers how deep a request already counted. A re-insert by the same
request that is *shorter* than an earlier one (an engine re-caching a prefix, a chunk that ends
before the last one) must not lower that depth: otherwise the next longer re-insert counts the
request a second time on the nodes below the short one, and ``lfu`` keeps a node that only one
request ever used over a node two requests used. The depth recorded is where the insert really
ended (a component may keep the new tail out of the tree), so the request still counts on the
nodes it creates later.
"""

from __future__ import annotations

import torch

from allocators import TokenAllocator
from components.base import Component, InsertPlan
from radix import CacheConfig, RadixCache


def make(components: tuple[Component, ...] = ()) -> tuple[RadixCache, TokenAllocator]:
    kv = TokenAllocator(64)
    cache = RadixCache(CacheConfig(radix_eviction_policy="lfu"), kv_allocator=kv,
                       components=components)
    return cache, kv


def put(cache: RadixCache, kv: TokenAllocator, key: list[int], rid: object) -> None:
    m = cache.match_prefix(key)
    fresh = kv.alloc(len(key) - m.prefix_len)
    assert fresh is not None
    res = cache.insert(key, torch.cat([m.device_indices, fresh]), rid=rid)
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()


def hits(cache: RadixCache) -> dict[tuple[int, int], int]:
    """``(start, end) -> hit_count`` of every node."""
    return {(n.start, n.depth): n.hit_count for n in cache.tree.iter_nodes()}


A = list(range(100, 108))  # 8 tokens
B = list(range(200, 208))


def test_a_shorter_reinsert_does_not_lower_the_counted_depth() -> None:
    cache, kv = make()
    put(cache, kv, A, rid="r")          # [0, 8): 1
    put(cache, kv, A[:4], rid="r")      # split at 4; nothing new counted
    put(cache, kv, A, rid="r")          # the same request again: still once per node
    assert hits(cache) == {(0, 4): 1, (4, 8): 1}
    put(cache, kv, A, rid="s")          # a second request: twice
    assert hits(cache) == {(0, 4): 2, (4, 8): 2}


def test_lfu_evicts_the_node_one_request_used_before_the_node_two_used() -> None:
    cache, kv = make()
    put(cache, kv, A, rid="r")
    put(cache, kv, A[:4], rid="r")
    put(cache, kv, A, rid="r")          # A[4:8] still counts one request
    put(cache, kv, B, rid="s")
    put(cache, kv, B, rid="t")          # B counts two
    cache.match_prefix(A)               # A most recent: lfu still evicts it first (1 hit < 2)
    res = cache.evict(1)
    assert res.num_tokens == 4
    assert hits(cache) == {(0, 4): 1, (0, 8): 2}  # A[4:8] left, B whole
    assert cache.match_prefix(A).prefix_len == 4 and cache.match_prefix(B).prefix_len == 8


class HoldBackOnce(Component):
    """Keeps the first insert's new tail out of the tree (as the SWA component does when none
    of the caller's slots is live), lets every later one through."""

    name = "hold_back_once"

    def __init__(self) -> None:
        self.held = False

    def plan_insert(self, plan: InsertPlan) -> None:
        if not self.held and plan.prefix_len < plan.insert_end:
            self.held = True
            plan.insert_end = plan.prefix_len


def test_a_request_counts_on_nodes_it_creates_after_an_insert_that_cached_nothing() -> None:
    cache, kv = make((HoldBackOnce(),))
    slots = kv.alloc(8)
    assert slots is not None
    res = cache.insert(A, slots, rid="r")  # held back: nothing cached, the depth stays 0
    assert res.inserted_len == 0 and cache.tree.num_nodes == 0
    put(cache, kv, A, rid="r")             # now the request creates [0, 8) and counts there
    kv.free(slots)
    assert hits(cache) == {(0, 8): 1}
    put(cache, kv, A, rid="r")
    assert hits(cache) == {(0, 8): 1}
