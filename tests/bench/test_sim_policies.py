"""Replay-only state walks (bench/policies/strategies.py): the offline reference's victim order on
a tiny trace with hand-computed next uses, and the Marconi utility's normalisation."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from allocators import MambaStatePool, TokenAllocator
from bench.engine.presets import ModelPreset
from bench.policies.strategies import (
    NEVER,
    BeladyStrategy,
    MarconiStrategy,
    NextUseIndex,
    StateStrategy,
    minmax,
    state_walk_factory,
)
from bench.traces.loader import TraceRequest
from radix import CacheConfig, RadixCache
from radix.node import TreeNode


def req(ids: list[int], length: int) -> TraceRequest:
    runs = tuple((h * 4 + 1, min(4, length - j * 4)) for j, h in enumerate(ids))
    return TraceRequest(0.0, length, 1, 4, tuple(ids), runs)


# Prefixes of 8 tokens (2 blocks): A = blocks 0,1 (tokens 1..8), B = 2,3, C = 4,5, D = 6,7.
TRACE = [
    req([0, 1, 90], 12),  # 0: creates A
    req([2, 3, 91], 12),  # 1: B
    req([4, 5, 92], 12),  # 2: C
    req([6, 7, 93], 12),  # 3: D
    req([4, 5, 94], 12),  # 4: needs C
    req([0, 1, 95], 12),  # 5: needs A
    req([2, 3, 96], 12),  # 6: needs B
    req([4, 5, 97], 12),  # 7: needs C again
    req([6, 7], 8),       # 8: shares D's 8 tokens but matches only prompt[:-1] = 7: no need
]
PREFIX = {"A": 1, "B": 9, "C": 17, "D": 25}  # first token of each prefix


def belady_cache(now: int) -> tuple[RadixCache, BeladyStrategy, dict[int, str]]:
    """A gds cache with the offline walk; states on A, B, C, D (depth 8) set at ``now``."""
    index = NextUseIndex(TRACE)
    built: list[StateStrategy] = []
    cache = RadixCache(CacheConfig(page_size=1, radix_eviction_policy="gds"),
                       kv_allocator=TokenAllocator(100),
                       state_allocator=MambaStatePool(8, 1, (1,), (1,)),
                       state_walk=state_walk_factory(lambda ok: BeladyStrategy(ok, index), built))
    strategy = built[-1]
    assert isinstance(strategy, BeladyStrategy) and cache.state.gds is strategy  # type: ignore[union-attr]
    strategy.before_admit(now)
    slot_name = {}
    for name, first in PREFIX.items():
        slot = int(cache.state.allocator.alloc(1)[0])  # type: ignore[union-attr]
        cache.insert(list(range(first, first + 8)), cache.kv.allocator.alloc(8), state_slot=slot)
        slot_name[slot] = name
    cache.sanity_check()
    return cache, strategy, slot_name


def victim_order(cache: RadixCache, slot_name: dict[int, str]) -> list[str]:
    state = cache.state
    assert state is not None
    order = []
    while state.slot_to_node:
        before = set(state.slot_to_node)
        assert cache.evict_states(1).num_states == 1
        cache.sanity_check()
        (gone,) = before - set(state.slot_to_node)
        order.append(slot_name[gone])
    return order


def test_belady_next_uses_and_victim_order() -> None:
    # now = 3: A -> 5, B -> 6, C -> 4, D -> never (request 8 is one token short).
    cache, strategy, names = belady_cache(3)
    uses = {names[s]: strategy.next_use(n) for s, n in cache.state.slot_to_node.items()}  # type: ignore[union-attr]
    assert uses == {"A": 5, "B": 6, "C": 4, "D": NEVER}
    assert victim_order(cache, names) == ["D", "B", "A", "C"]


def test_belady_entries_move_on_when_their_use_passes() -> None:
    # Set at 3, then request 4 (which needs C) is served: C's next use becomes 7.
    cache, strategy, names = belady_cache(3)
    strategy.before_admit(4)
    assert victim_order(cache, names) == ["D", "C", "B", "A"]


def test_belady_holds_locked_states_back() -> None:
    cache, _, names = belady_cache(3)
    d_node = next(n for s, n in cache.state.slot_to_node.items() if names[s] == "D")  # type: ignore[union-attr]
    cache.inc_lock_ref(d_node)
    assert cache.evict_states(1).num_states == 1
    cache.dec_lock_ref(d_node)
    assert victim_order(cache, names) == ["D", "A", "C"]  # B went first, D waited for its lock


def test_next_use_inside_a_block() -> None:
    # a prefix of 6 tokens ends inside block 1: requests 0 and 5 share it (caps 11 >= 6)
    index = NextUseIndex(TRACE)
    t = index.child(index.child(0, 1), 5)  # trie node of blocks (0, 1): first tokens 1 and 5
    assert t is not None
    assert index.next_use(t, 6, now=0) == 5
    assert index.next_use(t, 8, now=5) == NEVER
    assert index.block_first_tokens(req([3, 9, 2], 10)) == [13, 37, 9]


def test_state_walk_factory_rebuilt_by_reset() -> None:
    """The hook builds the walk at construction and again on reset (a fresh walk, the same
    factory); the baseline then drives the latest one."""
    built: list[StateStrategy] = []
    cache = RadixCache(CacheConfig(page_size=1, radix_eviction_policy="lru"),
                       kv_allocator=TokenAllocator(100), state_allocator=MambaStatePool(4, 1, (1,), (1,)),
                       state_walk=state_walk_factory(lambda ok: BeladyStrategy(ok, NextUseIndex(TRACE)),
                                                     built))
    assert len(built) == 1 and cache.state.gds is built[0] and cache.state.walk == "custom"  # type: ignore[union-attr]
    slot = int(cache.state.allocator.alloc(1)[0])  # type: ignore[union-attr]
    cache.insert(list(range(1, 9)), cache.kv.allocator.alloc(8), state_slot=slot)
    cache.sanity_check()
    cache.reset()
    assert len(built) == 2 and cache.state.gds is built[1]  # type: ignore[union-attr]
    cache.sanity_check()
    assert cache.state.gds.pop_victim() is None  # type: ignore[union-attr]


# ----------------------------------------------------------------------- Marconi
MODEL = ModelPreset("tiny", 1, 1, kv_bytes_per_token=10, state_bytes_per_slot=100, source="test")


def node(nid: int, stamp: int, depth: int, length: int) -> TreeNode:
    n = TreeNode(nid, stamp)
    n.state_access_time = stamp
    n.depth = depth
    n.key = array("q", range(length))
    n.parent = TreeNode(1000 + nid, 0)
    return n


def marconi(alpha: float) -> tuple[MarconiStrategy, list[TreeNode]]:
    # efficiency = depth / (100 + 10 * len) with d = 1, e = 0:
    #   A: 300 / 200 = 1.5      B: 10 / 200 = 0.05      C: 100 / 1100 = 0.0909
    # recency (stamps 10, 20, 30) normalises to 0, 0.5, 1; efficiency to 1, 0, 0.0282.
    s = MarconiStrategy(lambda n: True, MODEL, alpha, d=1.0, e=0.0)
    nodes = [node(1, 10, 300, 10), node(2, 20, 10, 10), node(3, 30, 100, 100)]
    for n in nodes:
        s.on_set(n)
    return s, nodes


def test_minmax() -> None:
    assert minmax(np.array([1.0, 2.0, 3.0])).tolist() == [0.0, 0.5, 1.0]
    assert minmax(np.array([3.0, 3.0])).tolist() == [0.0, 0.0]
    assert minmax(np.array([])).size == 0


def test_marconi_scores_are_normalised_recency_plus_alpha_efficiency() -> None:
    s, nodes = marconi(2.0)
    eff_c = (100 / 1100 - 0.05) / 1.45
    assert s.scores(nodes) == pytest.approx([2.0, 0.5, 1.0 + 2 * eff_c])
    assert s.efficiency(nodes[0]) == pytest.approx(1.5)


@pytest.mark.parametrize(("alpha", "victim"), [(0.0, 1), (0.25, 1), (2.0, 2)])
def test_marconi_victim_depends_on_alpha(alpha: float, victim: int) -> None:
    # alpha 0 is LRU (A, the oldest); alpha 2 keeps the efficient A and evicts B
    s, _ = marconi(alpha)
    v = s.pop_victim()
    assert v is not None and v.id == victim


def test_marconi_prefers_nodes_with_at_most_one_child() -> None:
    # B has two children: only A and C compete, normalised between themselves:
    # A = 0 + 2 * 1 = 2, C = 1 + 2 * 0 = 1 -> C goes.
    s, nodes = marconi(2.0)
    nodes[1].children = {1: node(7, 0, 1, 1), 2: node(8, 0, 1, 1)}
    v = s.pop_victim()
    assert v is not None and v.id == 3
    with pytest.raises(ValueError, match="alpha"):
        MarconiStrategy(lambda n: True, MODEL, -1.0)


def test_marconi_on_a_cache_evicts_and_checks() -> None:
    built: list[StateStrategy] = []
    cache = RadixCache(CacheConfig(page_size=1, radix_eviction_policy="gds"),
                       kv_allocator=TokenAllocator(100),
                       state_allocator=MambaStatePool(4, 1, (1,), (1,)),
                       state_walk=state_walk_factory(lambda ok: MarconiStrategy(ok, MODEL, 1.0), built))
    s = built[-1]
    assert isinstance(s, MarconiStrategy)
    for first in (1, 20, 40):
        slot = int(cache.state.allocator.alloc(1)[0])  # type: ignore[union-attr]
        cache.insert(list(range(first, first + 5)), cache.kv.allocator.alloc(5), state_slot=slot)
    assert cache.evict_states(2).num_states == 2
    cache.sanity_check()
    assert s.evictions == 2 and cache.state_evictable_size() == 1
    # equal efficiencies normalise to 0: recency alone decides, the two oldest went
    assert cache.match_prefix([40, 41, 42, 43, 44, 99]).prefix_len == 5
    assert cache.match_prefix([1, 2, 3, 4, 5, 99]).prefix_len == 0


def test_hit_breakdown_counts_every_consumed_state() -> None:
    """bench.dev.policies.hit_breakdown: the recorder sees every consumed state (its tokens add up to the
    depth of the states the matches used) and passes the walk's decisions through."""
    from bench.dev.policies.hit_breakdown import breakdown
    from bench.engine.simulator import SimConfig
    from bench.traces.loader import load_trace

    trace = load_trace(None, max_requests=120)
    for policy in ("gds_adaptive", "belady"):
        hit, rec = breakdown(trace, SimConfig.of(policy, kv_tokens=2_000_000, state_slots=16,
                                                 concurrency=4))
        assert 0 < hit < 1
        assert sum(rec.count.values()) > 0 and sum(rec.tokens.values()) > 0
        assert all(first in ("first", "again") and where in ("leaf", "below") and b in (0, 1, 2)
                   for first, where, b in rec.tokens)


def test_return_class_recorder_passes_the_walk_through() -> None:
    """bench.dev.policies.return_class: the recorded run scores what a plain run of the same
    configuration scores (the recorder and the engine wrappers change no decision), every
    class takes its documented values, and no class has more resumed states than stored."""
    from bench.dev.policies.return_class import classify, run_point
    from bench.engine.simulator import SimConfig, Simulator
    from bench.traces.loader import load_trace

    trace = load_trace(None, max_requests=120)
    for policy in ("gds_adaptive", "belady"):
        cfg = SimConfig.of(policy, kv_tokens=2_000_000, state_slots=16, concurrency=4)
        plain = Simulator(trace, cfg)
        plain.run()
        hit, rec = run_point(trace, cfg)
        assert hit == plain.result(0.0).metrics.token_hit_rate
        assert sum(rec.stored.values()) > 0 and not rec.open
        for (store, frm, br, guess, bucket), n in rec.stored.items():
            assert store in ("end", "chunk") and frm in ("end", "chunk", "fresh")
            assert br in ("yes", "no") and guess in ("continued", "inner", "fresh")
            assert bucket in ("0", "1", "2") and 0 <= rec.resumed[store, frm, br, guess, bucket] <= n
        by_store = {key[0]: n for key, n, _ in classify(rec, (0,))}
        assert sum(by_store.values()) == sum(rec.stored.values())


def test_return_class_table() -> None:
    """bench.dev.policies.return_class.return_class, every case by hand."""
    from bench.dev.policies.return_class import CONTINUED, FRESH, INNER, return_class

    assert return_class(None, False, False) == FRESH  # no live state above
    assert return_class(None, True, True) == FRESH
    assert return_class(FRESH, True, True) == CONTINUED  # resumed at a leaf: a next turn
    assert return_class(INNER, True, True) == CONTINUED
    assert return_class(FRESH, True, False) == INNER  # resumed at a state with states below
    assert return_class(CONTINUED, True, False) == INNER
    for c in (FRESH, CONTINUED, INNER):  # not consumed: the same request went on
        assert return_class(c, False, False) == c
        assert return_class(c, False, True) == c
