"""Radix eviction policies on a real cache: hand-made scenarios with the exact victim order
(``radix.policies``), the per-node fields the keys read (hit_count, priority, history), and the
configuration's provenance. Victims are read from the allocator's free list: ``free`` appends
to the back, so its tail is exactly what the last eviction gave back."""

from __future__ import annotations

import json

import pytest
import torch

from allocators import TokenAllocator
from radix import CacheConfig, EvictResult, RadixCache


def make(policy: str | None, knobs: dict | None = None, size: int = 32):
    kv = TokenAllocator(size)
    cfg = CacheConfig(radix_eviction_policy=policy, radix_eviction_policy_config=knobs)
    return RadixCache(cfg, kv_allocator=kv), kv


def put(cache: RadixCache, kv, key: list[int], **kw):
    value = kv.alloc(len(key))
    res = cache.insert(key, value, **kw)
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    cache.sanity_check()
    return res


def evict_order(cache: RadixCache, kv, sizes: list[int]) -> list[list[int]]:
    """Evict one node at a time; return the slots each call gave back."""
    out = []
    for n in sizes:
        assert cache.evict(1).num_tokens == n
        cache.sanity_check()
        out.append(kv.snapshot().free_ids()[-n:])
    assert cache.evict(1) == EvictResult(0, 0)
    return out


def node_of(cache: RadixCache, key: list[int]):
    m = cache.match_prefix(key)
    assert m.prefix_len == len(key)
    return m.last_device_node


# ====================================================================== hit_count (lfu)
def test_lfu_counts_requests_on_insert_and_evicts_fewest_hits_first() -> None:
    cache, kv = make("lfu")
    put(cache, kv, [1, 1], rid="a")  # slots 1, 2: one request
    put(cache, kv, [2, 2], rid="b")  # slots 3, 4
    put(cache, kv, [2, 2], rid="c")  # a second request through [2, 2] (dups 5, 6 freed)
    cache.match_prefix([1, 1])  # matches stamp but do not count
    assert evict_order(cache, kv, [2, 2]) == [[1, 2], [3, 4]]


def test_hit_count_once_per_request_and_per_insert_without_rid() -> None:
    cache, kv = make("lfu")
    put(cache, kv, [1, 2], rid="a")
    put(cache, kv, [1, 2, 3, 4], rid="a")  # chunked-prefill re-insert of the same request
    upper = node_of(cache, [1, 2])
    assert upper.hit_count == 1
    assert node_of(cache, [1, 2, 3, 4]).hit_count == 1
    put(cache, kv, [1, 2, 3, 4], rid="b")
    assert upper.hit_count == 2 and node_of(cache, [1, 2, 3, 4]).hit_count == 2
    put(cache, kv, [7, 7])
    put(cache, kv, [7, 7])  # no rid: every insert counts
    assert node_of(cache, [7, 7]).hit_count == 2
    # A split copies the count to the new upper node.
    m = cache.match_prefix([1])
    assert m.last_device_node.hit_count == 2
    cache.sanity_check()


def test_hit_count_never_counts_one_request_twice_when_requests_interleave() -> None:
    cache, kv = make("lfu")
    put(cache, kv, [5, 5], rid="a")
    put(cache, kv, [5, 5], rid="b")
    put(cache, kv, [5, 5, 6], rid="a")  # a's next chunk walks through [5, 5] again
    assert node_of(cache, [5, 5]).hit_count == 2  # requests a and b


# ====================================================================== priority
def test_priority_evicts_lowest_priority_then_lru_and_split_parent_inherits() -> None:
    cache, kv = make("priority")
    put(cache, kv, [1, 1], priority=5)  # slots 1, 2
    put(cache, kv, [2, 2], priority=1)  # slots 3, 4
    put(cache, kv, [3, 3], priority=1)  # slots 5, 6
    cache.match_prefix([3, 3])
    cache.match_prefix([2, 2])  # [2, 2] more recent than [3, 3] now
    assert evict_order(cache, kv, [2, 2, 2]) == [[5, 6], [3, 4], [1, 2]]

    put(cache, kv, [4, 4, 4, 4], priority=7)
    upper = cache.match_prefix([4, 4]).last_device_node  # split
    assert upper.priority == 7 and next(iter(upper.children.values())).priority == 7
    put(cache, kv, [4, 4, 9], priority=2)
    assert upper.priority == 7  # the max of the requests through it
    assert node_of(cache, [4, 4, 9]).priority == 2
    put(cache, kv, [4, 4, 9], priority=3)
    assert node_of(cache, [4, 4, 9]).priority == 3


# ====================================================================== slru
def test_slru_evicts_probation_before_protected() -> None:
    cache, kv = make("slru")
    put(cache, kv, [1, 1], rid="a")  # slots 1, 2
    put(cache, kv, [1, 1], rid="b")  # hit by a second request: protected (dups 3, 4 freed)
    put(cache, kv, [2, 2], rid="c")  # slots 5, 6: probation
    put(cache, kv, [3, 3], rid="d")  # slots 7, 8: probation
    # Probation first in LRU order, the protected (and oldest) [1, 1] last.
    assert evict_order(cache, kv, [2, 2, 2]) == [[5, 6], [7, 8], [1, 2]]


def test_slru_threshold_knob() -> None:
    cache, kv = make("slru", {"protected_threshold": 3})
    put(cache, kv, [1, 1], rid="a")
    put(cache, kv, [1, 1], rid="b")  # 2 hits < 3: still probation, and older
    put(cache, kv, [2, 2], rid="c")
    assert evict_order(cache, kv, [2, 2])[0] == [1, 2]


# ====================================================================== tlru
def test_tlru_evicts_tail_safe_leaves_first() -> None:
    # threshold 4, next_prompt_estimate 0: budget = max(history_len - 4, 0); a leaf is
    # tail-safe when its start >= budget.
    cache, kv = make("tlru", {"threshold": 4, "next_prompt_estimate": 0})
    put(cache, kv, [1, 2, 3, 4, 5, 6])  # slots 1..6: start 0, history 6 -> budget 2: not safe
    put(cache, kv, list(range(10, 16)))  # slots 7..12
    value = torch.cat([torch.arange(7, 13), kv.alloc(2)])  # tokens 16, 17 -> slots 13, 14
    cache.insert(list(range(10, 18)), value)
    cache.sanity_check()
    # [16, 17]: start 6, history 8 -> budget 4 -> tail-safe: first although most recent.
    # Then LRU among the rest: [1..6] (older), then [10..15] (history 8, start 0: not safe).
    assert evict_order(cache, kv, [2, 6, 6]) == [[13, 14], [1, 2, 3, 4, 5, 6], list(range(7, 13))]


def test_lru_on_the_same_tree_evicts_the_oldest_leaf_first() -> None:
    cache, kv = make("lru")
    put(cache, kv, [1, 2, 3, 4, 5, 6])
    put(cache, kv, list(range(10, 16)))
    cache.insert(list(range(10, 18)), torch.cat([torch.arange(7, 13), kv.alloc(2)]))
    assert evict_order(cache, kv, [6, 2, 6]) == [[1, 2, 3, 4, 5, 6], [13, 14], list(range(7, 13))]


def test_tlru_history_never_shrinks() -> None:
    cache, kv = make("tlru", {"threshold": 4})
    put(cache, kv, [1, 2, 3, 4, 5, 6, 7, 8])
    upper = cache.match_prefix([1, 2, 3, 4]).last_device_node
    assert upper.history_len == 8
    assert cache.evict(1) == EvictResult(4, 0)  # the tail [5..8]
    assert upper.history_len == 8 and not upper.children
    cache.sanity_check()


# ====================================================================== fifo / mru / filo
@pytest.mark.parametrize(
    ("policy", "order"),
    [
        ("fifo", [[1, 2], [3, 4], [5, 6]]),  # creation order
        ("filo", [[5, 6], [3, 4], [1, 2]]),  # newest creation first
        ("mru", [[1, 2], [5, 6], [3, 4]]),  # most recent first
        ("lru", [[3, 4], [5, 6], [1, 2]]),
        ("lfu", [[3, 4], [5, 6], [1, 2]]),  # equal hits: LRU
    ],
)
def test_creation_and_recency_orders(policy: str, order: list[list[int]]) -> None:
    cache, kv = make(policy)
    put(cache, kv, [1, 1])  # created first (slots 1, 2)
    put(cache, kv, [2, 2])  # slots 3, 4
    put(cache, kv, [3, 3])  # created last (slots 5, 6)
    cache.match_prefix([3, 3])
    cache.match_prefix([1, 1])  # touched last
    assert evict_order(cache, kv, [2, 2, 2]) == order


# ====================================================================== config
def test_default_policy_is_lru_and_provenance_is_kept_apart() -> None:
    default = CacheConfig()
    explicit = CacheConfig(radix_eviction_policy="lru")
    assert default.policy_name == explicit.policy_name == "lru"
    assert default.policy_explicit is False and explicit.policy_explicit is True
    same = [
        CacheConfig(page_size=4, radix_eviction_policy="gds",
                    radix_eviction_policy_config={"d": 1.0, "e": 0.0}),
        CacheConfig.from_dict({"page_size": 4, "radix_eviction_policy": "gds",
                               "radix_eviction_policy_config": {"d": 1.0, "e": 0.0}}),
        CacheConfig.from_json(json.dumps({"page_size": 4, "radix_eviction_policy": "gds",
                                          "radix_eviction_policy_config": {"d": 1.0, "e": 0.0}})),
    ]
    assert len({json.dumps(c.to_dict(), sort_keys=True) for c in same}) == 1
    assert same[0].to_dict()["resolved_knobs"] == {"d": 1.0, "e": 0.0}
    gds_default = CacheConfig(radix_eviction_policy="gds").to_dict()
    assert gds_default["resolved_knobs"] == {"d": 1.862e-5, "e": 3.33e-6}
