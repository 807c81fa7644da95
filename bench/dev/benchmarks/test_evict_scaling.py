"""Cost of evicting one node versus tree size, per policy (pytest-benchmark).

    pytest bench/dev/benchmarks/test_evict_scaling.py --benchmark-only --benchmark-group-by=param:policy

Each round builds a KV-only tree (+ states for the hybrid policies) of ``nodes`` leaves under
64 shared 64-token prefixes, then times evicting ``EVICTIONS`` single leaves (``evict(1)`` frees
one whole leaf). The reported time divided by ``EVICTIONS`` is the cost of freeing one node;
it must grow at most logarithmically from 1k to 100k nodes (every walk is an ordered set or a
lazy heap: no heap is rebuilt per call).
"""

from __future__ import annotations

import random

import pytest
import torch

from allocators import KVPool, MambaStatePool, TokenAllocator
from radix import POLICY_REGISTRY, CacheConfig, RadixCache, RadixKey

EVICTIONS = 500
LEAF_LEN = 8
PREFIX_LEN = 64
POLICIES = sorted(POLICY_REGISTRY)
KNOBS = {"tlru": {"threshold": 32, "next_prompt_estimate": 0}}


def build(policy: str, nodes: int, hybrid: bool) -> RadixCache:
    rng = random.Random(nodes)
    size = nodes * (LEAF_LEN + PREFIX_LEN) + 16
    # (unified weighs bytes: its KV allocator needs a pool that says how many per token)
    kv = TokenAllocator(size, pool=KVPool(size, 1, 1, 1) if policy == "unified" else None)
    states = MambaStatePool(nodes + 64, num_layers=1, conv_state_shape=(1, 1),
                            ssm_state_shape=(1, 1, 1)) if hybrid else None
    cache = RadixCache(
        CacheConfig(radix_eviction_policy=policy, radix_eviction_policy_config=KNOBS.get(policy)),
        kv_allocator=kv,
        state_allocator=states,
    )
    prefixes = [[rng.randrange(1 << 20) for _ in range(PREFIX_LEN)] for _ in range(64)]
    for i in range(nodes):
        toks = prefixes[i % 64] + [rng.randrange(1 << 20) for _ in range(LEAF_LEN)]
        key = RadixKey(toks)
        m = cache.match_prefix(key)
        new = kv.alloc(len(toks) - m.prefix_len)
        assert new is not None
        got = states.alloc(1) if states is not None else None
        slot = int(got[0]) if got is not None else None
        res = cache.insert(key, torch.cat([m.device_indices, new]), state_slot=slot,
                           priority=rng.randrange(4))
        kv.free(res.duplicate_indices)
        if i % 3 == 0:  # vary stamps, hit counts and priorities
            cache.match_prefix(key)
    return cache


def time_evictions(benchmark, policy: str, nodes: int, evict: str) -> None:
    """Time ``EVICTIONS`` calls of ``cache.<evict>(1)`` on a fresh hybrid tree per round."""
    def setup():
        return (build(policy, nodes, True),), {}

    def run(cache: RadixCache) -> None:
        one = getattr(cache, evict)
        for _ in range(EVICTIONS):
            one(1)

    benchmark.extra_info["evictions_per_round"] = EVICTIONS
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)


@pytest.mark.parametrize("nodes", [1_000, 10_000, 100_000])
@pytest.mark.parametrize("policy", POLICIES)
def test_evict_one_node(benchmark, policy: str, nodes: int) -> None:
    time_evictions(benchmark, policy, nodes, "evict")


@pytest.mark.parametrize("nodes", [1_000, 10_000, 100_000])
@pytest.mark.parametrize("policy", ["lru", "joint_lru", "gds"])
def test_evict_one_state(benchmark, policy: str, nodes: int) -> None:
    time_evictions(benchmark, policy, nodes, "evict_states")
