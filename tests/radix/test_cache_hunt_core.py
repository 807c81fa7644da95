"""Bugs found by the hunt over the engine-facing API (``hunt-core``): each test fails on the
commit before its fix. Expected values are worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch

from allocators import TokenAllocator
from radix import CacheConfig, RadixCache


def _priority_cache() -> tuple[RadixCache, TokenAllocator]:
    kv = TokenAllocator(32)
    return RadixCache(CacheConfig(radix_eviction_policy="priority"), kv_allocator=kv), kv


def test_a_negative_priority_is_kept_on_the_nodes_it_creates() -> None:
    # "priority: max priority of the requests that inserted through this node": a node only a
    # priority -5 request inserted has priority -5, not 0.
    cache, kv = _priority_cache()
    cache.insert([2, 2], kv.alloc(2), priority=-5)
    assert cache.match_prefix([2, 2]).last_device_node.priority == -5
    # one insert creating two nodes (a split of the new tail is not needed: a child of [2, 2])
    cache.insert([2, 2, 3, 3], torch.cat([cache.match_prefix([2, 2]).device_indices,
                                          kv.alloc(2)]), priority=-3)
    assert cache.match_prefix([2, 2]).last_device_node.priority == -3  # max(-5, -3)
    assert cache.match_prefix([2, 2, 3, 3]).last_device_node.priority == -3
    cache.sanity_check()


def test_the_priority_policy_evicts_a_negative_priority_leaf_before_a_priority_0_one() -> None:
    cache, kv = _priority_cache()
    cache.insert([1, 1], kv.alloc(2), priority=0)  # slots 1, 2
    cache.insert([2, 2], kv.alloc(2), priority=-5)  # slots 3, 4
    cache.match_prefix([1, 1])
    cache.match_prefix([2, 2])  # [2, 2] is the more recent, but its priority is lower
    assert cache.evict(1).num_tokens == 2
    assert cache.match_prefix([1, 1]).prefix_len == 2
    assert cache.match_prefix([2, 2]).prefix_len == 0
    assert kv.snapshot().free_ids()[-2:] == [3, 4]
    cache.sanity_check()


def test_release_rid_names_an_unhashable_rid() -> None:
    kv = TokenAllocator(8)
    cache = RadixCache(kv_allocator=kv)
    cache.insert([1, 2], kv.alloc(2), rid="a")
    with pytest.raises(TypeError, match="rid"):
        cache.release_rid([1])
    cache.release_rid("a")  # a hashable one, known or not, is fine
    cache.release_rid("never seen")
    cache.sanity_check()


@pytest.mark.parametrize(("policy", "knob"), [("gds", "d"), ("gdsf", "e"), ("tlru", "threshold"),
                                              ("tlru", "next_prompt_estimate")])
def test_an_int_knob_past_the_float_range_is_refused_naming_it(policy: str, knob: str) -> None:
    # math.isfinite(10**400) raises OverflowError: the check must answer ValueError instead.
    knobs: dict[str, int] = {"threshold": 8} if policy == "tlru" else {}
    knobs[knob] = 10**400
    with pytest.raises(ValueError, match=knob):
        CacheConfig(radix_eviction_policy=policy, radix_eviction_policy_config=knobs)


def test_the_config_keeps_its_own_copy_of_the_knobs() -> None:
    # CacheConfig is frozen and resolves its policy when built; a later change to the
    # caller's dict must change neither what it reports nor what it resolved.
    knobs = {"d": 1.0, "e": 0.0}
    cfg = CacheConfig(radix_eviction_policy="gds", radix_eviction_policy_config=knobs)
    knobs["d"] = 5.0
    assert cfg.to_dict()["radix_eviction_policy_config"] == {"d": 1.0, "e": 0.0}
    assert cfg.to_dict()["resolved_knobs"] == {"d": 1.0, "e": 0.0}
    assert cfg == CacheConfig(radix_eviction_policy="gds",
                              radix_eviction_policy_config={"d": 1.0, "e": 0.0})
    assert cfg.radix_eviction_policy_config is not knobs
