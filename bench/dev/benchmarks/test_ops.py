"""Per-operation cost of the radix cache versus tree size and page size (pytest-benchmark).

    python -m pytest bench/dev/benchmarks/test_ops.py --benchmark-only \
        --benchmark-group-by=func,param:page_size,param:hybrid

The tree: ``nodes`` leaves of ``LEAF_LEN`` tokens under ``PREFIXES`` shared prefixes of
``PREFIX_LEN`` tokens (a depth-2 tree, like many requests under a few system prompts); with
``hybrid`` every leaf holds a recurrent state (and, for the GDS state walk, every prefix too).
Page sizes 1 and 16 (every length here is a multiple of 16). Each timed round does ``BATCH``
operations; ``extra_info["ops_per_round"]`` says how many, so time / ops is the cost of one.

* ``match``: ``match_prefix`` of keys that hit a whole cached path (+ an uncached tail).
* ``match_split``: keys leaving inside a leaf (the match splits it): fresh tree per round.
* ``insert_cached``: ``insert`` of keys whose pages are all cached (walk + stamps only).
* ``insert_new``: ``insert`` adding one new leaf per key: fresh tree per round.
* ``lock``: ``inc_lock_ref`` + ``dec_lock_ref`` pairs on leaves.
* ``evict_kv``: ``evict(1)`` calls (one whole leaf each, its state with it), fresh tree per round.
* ``evict_states_gds``: ``evict_states(1)`` under ``gds`` (internal prefix states and leaf
  states), fresh tree per round.
"""

from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator, TokenAllocator
from radix import CacheConfig, RadixCache, RadixKey

PREFIXES = 64
PREFIX_LEN = 256
LEAF_LEN = 64
BATCH = 500
SIZES = [1_000, 10_000, 100_000]
PAGES = [1, 16]


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1 << 20) for _ in range(n)]


class Tree:
    """A built cache plus what the benchmarks need to drive it."""

    def __init__(self, nodes: int, page_size: int, hybrid: bool, policy: str = "lru") -> None:
        rng = random.Random(nodes * 31 + page_size)
        self.rng = rng
        self.page_size = page_size
        head_room = 4 * BATCH * (PREFIX_LEN + LEAF_LEN + page_size)
        size = nodes * LEAF_LEN + PREFIXES * PREFIX_LEN + head_room
        size = (size + page_size - 1) // page_size * page_size
        self.kv = TokenAllocator(size) if page_size == 1 else PagedAllocator(size, page_size)
        self.states = (
            MambaStatePool(nodes + PREFIXES + 4 * BATCH, num_layers=1, conv_state_shape=(1,),
                           ssm_state_shape=(1,))
            if hybrid else None
        )
        self.cache = RadixCache(CacheConfig(page_size=page_size, radix_eviction_policy=policy),
                                kv_allocator=self.kv, state_allocator=self.states)
        self.prefixes = [_rand(rng, PREFIX_LEN) for _ in range(PREFIXES)]
        if hybrid and policy == "gds":  # internal states: GDS has ancestors to measure from
            for p in self.prefixes:
                self.insert(RadixKey(p))
        self.leaf_keys = []
        for i in range(nodes):
            key = RadixKey(self.prefixes[i % PREFIXES] + _rand(rng, LEAF_LEN))
            self.insert(key)
            self.leaf_keys.append(key)

    def state_slot(self) -> int | None:
        if self.states is None:
            return None
        out = self.states.alloc(1)
        assert out is not None
        return int(out[0])

    def insert(self, key: RadixKey) -> None:
        cache = self.cache
        m = cache.match_prefix(key)
        new = self.kv.alloc(len(key) - m.prefix_len)
        assert new is not None, self.kv
        value = torch.cat([m.device_indices, new])
        slot = self.state_slot()
        res = cache.insert(key, value, state_slot=slot)
        if res.prefix_len > m.prefix_len:
            self.kv.free(value[m.prefix_len:res.prefix_len])
        if slot is not None and not res.state_adopted:
            assert self.states is not None  # a state slot came from it
            self.states.free(torch.tensor([slot]))

    def new_value(self, key: RadixKey, m_len: int, m_idx: torch.Tensor) -> torch.Tensor:
        new = self.kv.alloc(len(key) - m_len)
        assert new is not None
        return torch.cat([m_idx, new])


@lru_cache(maxsize=2)
def shared_tree(nodes: int, page_size: int, hybrid: bool) -> Tree:
    """Trees reused by the benchmarks that leave the tree's shape as it was."""
    return Tree(nodes, page_size, hybrid)


def _sample(tree: Tree, n: int) -> list[RadixKey]:
    return tree.rng.sample(tree.leaf_keys, min(n, len(tree.leaf_keys)))


params = pytest.mark.parametrize
hybrid_param = params("hybrid", [False, True], ids=["kv", "kv+state"])
page_param = params("page_size", PAGES)
size_param = params("nodes", SIZES)


@hybrid_param
@page_param
@size_param
def test_match(benchmark, nodes: int, page_size: int, hybrid: bool) -> None:
    tree = shared_tree(nodes, page_size, hybrid)
    tail = _rand(tree.rng, 16)
    keys = [RadixKey(list(k.token_ids) + tail) for k in _sample(tree, BATCH)]
    match = tree.cache.match_prefix

    def run() -> None:
        for k in keys:
            match(k)

    benchmark.extra_info["ops_per_round"] = len(keys)
    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)


@hybrid_param
@page_param
@params("nodes", SIZES[:2])
def test_match_split(benchmark, nodes: int, page_size: int, hybrid: bool) -> None:
    def setup():
        tree = Tree(nodes, page_size, hybrid)
        cut = PREFIX_LEN + LEAF_LEN // 2  # a page multiple inside every leaf
        keys = [RadixKey(list(k.token_ids[:cut]) + _rand(tree.rng, 16))
                for k in _sample(tree, BATCH)]
        return (tree, keys), {}

    def run(tree: Tree, keys: list[RadixKey]) -> None:
        match = tree.cache.match_prefix
        for k in keys:
            match(k)

    benchmark.extra_info["ops_per_round"] = BATCH
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)


@hybrid_param
@page_param
@size_param
def test_insert_cached(benchmark, nodes: int, page_size: int, hybrid: bool) -> None:
    tree = shared_tree(nodes, page_size, hybrid)
    cache = tree.cache
    work = []
    for k in _sample(tree, BATCH):
        m = cache.match_prefix(k)
        work.append((k, m.device_indices))  # the tree's own slots: nothing to free after

    def run() -> None:
        for k, v in work:
            cache.insert(k, v)

    benchmark.extra_info["ops_per_round"] = len(work)
    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)


@hybrid_param
@page_param
@params("nodes", SIZES[:2])
def test_insert_new(benchmark, nodes: int, page_size: int, hybrid: bool) -> None:
    def setup():
        tree = Tree(nodes, page_size, hybrid)
        work = []
        for i in range(BATCH):
            key = RadixKey(tree.prefixes[i % PREFIXES] + _rand(tree.rng, LEAF_LEN))
            m = tree.cache.match_prefix(key)
            work.append((key, tree.new_value(key, m.prefix_len, m.device_indices),
                         tree.state_slot()))
        return (tree, work), {}

    def run(tree: Tree, work: list) -> None:
        insert = tree.cache.insert
        for key, value, slot in work:
            insert(key, value, state_slot=slot)

    benchmark.extra_info["ops_per_round"] = BATCH
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)


@hybrid_param
@page_param
@size_param
def test_lock(benchmark, nodes: int, page_size: int, hybrid: bool) -> None:
    tree = shared_tree(nodes, page_size, hybrid)
    cache = tree.cache
    targets = [cache.match_prefix(k).last_device_node for k in _sample(tree, BATCH)]
    inc, dec = cache.inc_lock_ref, cache.dec_lock_ref

    def run() -> None:
        for n in targets:
            inc(n)
            dec(n)

    benchmark.extra_info["ops_per_round"] = len(targets)
    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=1)


@hybrid_param
@page_param
@size_param
def test_evict_kv(benchmark, nodes: int, page_size: int, hybrid: bool) -> None:
    def setup():
        return (Tree(nodes, page_size, hybrid).cache,), {}

    def run(cache: RadixCache) -> None:
        for _ in range(BATCH):
            cache.evict(1)

    benchmark.extra_info["ops_per_round"] = BATCH
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)


@page_param
@size_param
def test_evict_states_gds(benchmark, nodes: int, page_size: int) -> None:
    def setup():
        return (Tree(nodes, page_size, True, policy="gds").cache,), {}

    def run(cache: RadixCache) -> None:
        for _ in range(BATCH):
            cache.evict_states(1)

    benchmark.extra_info["ops_per_round"] = BATCH
    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1)
