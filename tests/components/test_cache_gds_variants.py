"""The ``state_walk=`` hook and the GDS variants: ``gdsf`` (GDS with the cost x (1 + hits))
and ``gds_adaptive`` (the duel of GreedyDual orders; its ``signals`` order's kinds and weights
here, the duel itself in ``tests/components/test_gds_duel.py``). Expected eviction orders are
computed by hand, or by a brute-force reference that re-derives every priority from the tree
and from hit counts the test keeps itself."""

from __future__ import annotations

import math
import random

import pytest
import torch

from allocators import TokenAllocator
from components.gds import GDSFStrategy, GDSStrategy, gds_cost
from components.gds_adaptive import (
    CHAIN,
    HUB,
    HUB0,
    LEAF,
    SPINE,
    AdaptiveGDSStrategy,
    seen_bucket,
)
from radix import CacheConfig, EvictResult, RadixCache
from radix.node import TreeNode
from tests.helpers.cache_helpers import tiny_state_pool
from tests.helpers.gds_helpers import draw_key, make, put, state_nodes


def shallower_pos(node: TreeNode) -> int:
    p = node.parent
    while p is not None and p.parent is not None:
        if p.state_slot is not None:
            return p.depth
        p = p.parent
    return 0


def evicted_slot(pool, before: set[int]) -> int:
    freed = set(pool.snapshot().free_ids()) - before
    assert len(freed) == 1, freed
    return freed.pop()


# ====================================================================== the hook
class CountingWalk:
    """A minimal custom walk: FIFO over set order; counts events."""

    def __init__(self, is_candidate) -> None:
        self.ok = is_candidate
        self.watermark = 7.5
        self.order: list[TreeNode] = []
        self.events: list[str] = []

    def on_set(self, node):
        self.order.append(node)
        self.events.append("set")

    def on_hit(self, node):
        self.events.append("hit")

    def on_use(self, node):
        self.events.append("use")

    def on_remove(self, node):
        self.order = [n for n in self.order if n is not node]
        self.events.append("remove")

    def requeue(self, node):
        pass

    def pop_victim(self):
        return next((n for n in self.order if self.ok(n)), None)

    def check(self, state_nodes):
        assert {n.id for n in state_nodes} == {n.id for n in self.order}


def test_state_walk_hook_drives_evictions_and_survives_reset() -> None:
    built: list[CountingWalk] = []

    def factory(ok):
        built.append(CountingWalk(ok))
        return built[-1]

    kv = TokenAllocator(100)
    pool = tiny_state_pool(4)
    cache = RadixCache(CacheConfig(radix_eviction_policy="gds"), kv_allocator=kv,
                       state_allocator=pool, state_walk=factory)
    assert cache.state is not None
    assert len(built) == 1 and cache.state.gds is built[0] and cache.state.walk == "custom"
    assert cache.watermark == 7.5  # read from the custom walk
    a, _ = put(cache, kv, pool, [1, 2, 3])
    b, _ = put(cache, kv, pool, [5, 6, 7, 8, 9, 10])  # GDS would evict a (cheaper) first ...
    cache.match_prefix([5, 6, 7, 8, 9, 10, 11])
    cache.match_prefix([1, 2, 3, 4])
    assert built[0].events == ["set", "set", "hit", "hit"]
    assert cache.evict_states(1) == EvictResult(3, 1)  # ... FIFO evicts a, the first set
    assert a.parent is None and b.state_slot is not None
    cache.sanity_check()
    cache.reset()
    assert len(built) == 2 and cache.state.gds is built[1] and built[1].order == []  # type: ignore[union-attr]
    put(cache, kv, pool, [4, 4])
    assert built[1].events == ["set"]
    cache.sanity_check()


@pytest.mark.parametrize("bad", [5, "walk", [None]])
def test_state_walk_must_be_callable(bad) -> None:
    pool = tiny_state_pool(2)
    with pytest.raises(TypeError, match="state_walk"):
        RadixCache(kv_allocator=TokenAllocator(8), state_allocator=pool, state_walk=bad)


def test_state_walk_factory_must_build_a_walk() -> None:
    pool = tiny_state_pool(2)
    with pytest.raises(TypeError, match="state_walk built a object without on_set"):
        RadixCache(kv_allocator=TokenAllocator(8), state_allocator=pool,
                   state_walk=lambda ok: object())  # type: ignore[arg-type,return-value]


def test_state_walk_needs_a_state_pool() -> None:
    with pytest.raises(ValueError, match="state_walk needs a state_allocator"):
        RadixCache(kv_allocator=TokenAllocator(8), state_walk=CountingWalk)


@pytest.mark.parametrize(
    ("policy", "cls"),
    [("gds", GDSStrategy), ("gdsf", GDSFStrategy), ("gds_adaptive", AdaptiveGDSStrategy)],
)
def test_gds_family_walks_by_name_and_rebuilt_by_reset(policy: str, cls: type) -> None:
    cache, kv, pool = make(policy=policy)
    assert type(cache.state.gds) is cls and cache.state.walk == policy
    put(cache, kv, pool, [1, 2, 3])
    first = cache.state.gds
    cache.reset()
    assert type(cache.state.gds) is cls and cache.state.gds is not first
    cache.sanity_check()


# ====================================================================== gdsf
@pytest.mark.parametrize("policy", ["gdsf", "gds_adaptive"])
@pytest.mark.parametrize(
    ("knobs", "names"),
    [({"d": -1.0}, ["d"]), ({"e": math.nan}, ["e"]), ({"d": 0, "e": 0}, ["d", "e"]),
     ({"d": "1"}, ["d"]), ({"d": True}, ["d"]), ({"f": 1.0}, ["f"])],
)
def test_bad_knobs_fail_when_the_config_is_built(policy: str, knobs: dict, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        CacheConfig(radix_eviction_policy=policy, radix_eviction_policy_config=knobs)
    for n in names:
        assert f"'{n}'" in str(info.value)


def test_gdsf_worked_example() -> None:
    """d = 1, e = 0. A at 100 (hit twice), B at 250, C at 120, all stamped at L = 0.
    GDS order: A (100), C (120), B (250). GDSF: A = 100 x 3 = 300 outlives both."""
    cache, kv, pool = make(policy="gdsf")
    a, sa = put(cache, kv, pool, list(range(1, 101)))
    b, sb = put(cache, kv, pool, list(range(1001, 1251)))
    c, sc = put(cache, kv, pool, list(range(2001, 2121)))
    for _ in range(2):
        assert cache.match_prefix(list(range(1, 102))).state_slot == sa
    walk = cache.state.gds
    assert isinstance(walk, GDSFStrategy) and walk.hits[a.id] == 2
    assert walk.true_priority(a) == 300.0
    before = set(pool.snapshot().free_ids())
    assert cache.evict_states(1) == EvictResult(120, 1)
    assert evicted_slot(pool, before) == sc and cache.watermark == 120.0
    assert cache.evict_states(1) == EvictResult(250, 1)
    assert cache.watermark == 250.0 and a.state_slot == sa
    # A is the last; a new state D (cost 80, stamped at 250) goes before it: 330 < 300 + ...
    # A's stamp is still 0 (hits at L = 0): priority 300 > L, D = 250 + 80 = 330 > 300.
    d_node, sd = put(cache, kv, pool, list(range(3001, 3081)))
    before = set(pool.snapshot().free_ids())
    assert cache.evict_states(1) == EvictResult(100, 1)
    assert evicted_slot(pool, before) == sa and cache.watermark == 300.0
    assert d_node.state_slot == sd and walk.hits == {d_node.id: 0}
    cache.sanity_check()


def test_gdsf_release_is_not_a_hit() -> None:
    cache, kv, pool = make(policy="gdsf")
    a, _ = put(cache, kv, pool, [1] * 20)
    cache.inc_lock_ref(a)
    cache.dec_lock_ref(a)
    assert cache.state.gds.hits[a.id] == 0


def _run_random(policy: str, seed: int, steps: int = 300):
    """Random inserts (shared prefixes), matches, state and KV evictions; yields after each
    step the cache, its pools and the test's own record of hits per slot."""
    rng = random.Random(seed)
    cache, kv, pool = make(1.0, 0.5, size=150, states=6, policy=policy)
    keys: list[list[int]] = []
    hits: dict[int, int] = {}
    for _ in range(steps):
        r = rng.random()
        action = None
        if r < 0.45:
            key = draw_key(rng, keys)
            if pool.available_size() == 0:
                action = ("states", 1)
            elif kv.available_size() < len(key):
                action = ("kv", len(key) - kv.available_size())
            else:
                m = cache.match_prefix(key)
                if m.state_slot is not None:
                    hits[m.state_slot] = hits.get(m.state_slot, 0) + 1
                yield cache, kv, pool, hits, ("match", m)
                fresh = kv.alloc(len(key) - m.prefix_len)
                slot = pool.alloc(1)
                res = cache.insert(key, torch.cat([m.device_indices, fresh]), state_slot=int(slot[0]))
                if len(res.duplicate_indices):
                    kv.free(res.duplicate_indices)
                if res.state_adopted:
                    hits[int(slot[0])] = 0
                else:
                    pool.free(slot)
                yield cache, kv, pool, hits, ("insert", res)
                continue
        elif r < 0.7 and keys:
            m = cache.match_prefix(rng.choice(keys))
            if m.state_slot is not None:
                hits[m.state_slot] = hits.get(m.state_slot, 0) + 1
            yield cache, kv, pool, hits, ("match", m)
            continue
        elif r < 0.9:
            action = ("states", 1)
        else:
            action = ("kv", rng.randint(1, 6))
        yield cache, kv, pool, hits, action


def test_gdsf_matches_a_brute_force_reference_under_random_ops() -> None:
    """Every state victim has the least ``stamp + cost(a, b) x (1 + hits)`` over the states
    (none is locked here), with hits counted by the test from the matches' consumed slots."""
    pops = 0
    for cache, _kv, pool, hits, action in _run_random("gdsf", 11, 400):
        if action[0] == "states" and state_nodes(cache):
            nodes = state_nodes(cache)
            want = {n.state_slot: n.gds_stamp + gds_cost(shallower_pos(n), n.depth, 1.0, 0.5)
                    * (1 + hits[n.state_slot]) for n in nodes}
            before = set(pool.snapshot().free_ids())
            mark = cache.watermark
            assert cache.evict_states(1).num_states == 1
            got = evicted_slot(pool, before)
            assert want[got] == pytest.approx(min(want.values()), abs=1e-9)
            assert cache.watermark == pytest.approx(max(mark, want[got]), abs=1e-9)
            pops += 1
        elif action[0] == "kv":
            cache.evict(action[1])
        walk = cache.state.gds
        for n in state_nodes(cache):
            assert walk.hits[n.id] == hits[n.state_slot]
        cache.sanity_check()
    assert pops > 30


# ====================================================================== gds_adaptive
def test_seen_bucket_by_hand() -> None:
    cache, kv, pool = make(policy="gds_adaptive")
    a, _ = put(cache, kv, pool, list(range(1, 101)))
    assert a.hit_count == 1 and seen_bucket(a) == 0  # nothing seen by another request
    b, _ = put(cache, kv, pool, list(range(1, 121)))  # 100 of 120 seen before: 83 %
    assert seen_bucket(b) == 1
    c, _ = put(cache, kv, pool, list(range(1, 111)))  # splits b's node: 110 of 110 seen
    assert c.hit_count == 2 and seen_bucket(c) == 2
    d, _ = put(cache, kv, pool, list(range(1, 31)) + [999] * 70)  # 30 of 100 seen: 30 %
    assert seen_bucket(d) == 1


def test_adaptive_evicts_the_chain_state_a_continued_turn_left_behind() -> None:
    """d = 1, e = 0. Turn 1 caches A at 300; turn 2 resumes from A (a hit) and caches B at
    400 below it; another conversation caches C at 250. GDS: B (100 over A) goes first, then
    C (250), then A. gds_adaptive (its ``signals`` order leads until another order is charged
    less): A was consumed and then moved past, a chain; chains are not hit more often than
    leaves (A's hit counted as a leaf's), so their weight is 0 and A's priority is its stamp,
    0: first. Then B's cost is 400 from the root (a leaf at the prior bucket weight 1), so C
    (250) goes, then B."""
    P = list(range(1, 401))
    C = list(range(1001, 1251))
    orders = {}
    for policy in ("gds", "gds_adaptive"):
        cache, kv, pool = make(policy=policy)
        a, sa = put(cache, kv, pool, P[:300])
        assert cache.match_prefix(P[:350]).state_slot == sa  # turn 2 resumes from A
        b, sb = put(cache, kv, pool, P)
        c, sc = put(cache, kv, pool, C)
        if policy == "gds_adaptive":
            walk = cache.state.gds
            assert isinstance(walk, AdaptiveGDSStrategy)
            assert (walk.kind[a.id], walk.kind[b.id], walk.kind[c.id]) == (CHAIN, LEAF, LEAF)
            assert walk.superseded[a.id] and not walk.consumed[a.id]
            assert walk.chain_weight == 0.0  # the chain rate is below the leaves' after A's hit
            signals = walk.orders[0]
            assert walk.leader == 0 and signals.name == "signals"
            assert signals.w[a.id] == 0.0
            assert signals.w[b.id] == pytest.approx(1.0) and signals.w[c.id] == pytest.approx(1.0)
            assert walk.true_priority(a) == 0.0
            assert walk.true_priority(b) == pytest.approx(100.0)  # 400 - 300 while A lives
        order = []
        for _ in range(3):
            before = set(pool.snapshot().free_ids())
            assert cache.evict_states(1).num_states == 1
            order.append({sa: "A", sb: "B", sc: "C"}[evicted_slot(pool, before)])
            cache.sanity_check()
        orders[policy] = order
    assert orders == {"gds": ["B", "C", "A"], "gds_adaptive": ["A", "C", "B"]}


def test_adaptive_kinds_spine_chain_fork_and_hub() -> None:
    """One request's chunk checkpoints (states cached one below the other with no hit in
    between) make a spine, not a chain; a hit and then a deeper state make a chain; a state
    cached above existing ones is born a fork (hub0); a hit while states lie below makes a
    hub of weight 1 + hits below. The spine and chain rules flip with the learned rates."""
    cache, kv, pool = make(policy="gds_adaptive")
    walk = cache.state.gds
    D = list(range(1, 301))
    s1, _ = put(cache, kv, pool, D[:100])  # chunk end
    s2, _ = put(cache, kv, pool, D[:200])  # chunk end, no hit on s1 in between
    e1, _ = put(cache, kv, pool, D)  # the prompt's end
    assert walk.kind[s1.id] == SPINE and walk.kind[s2.id] == SPINE and walk.kind[e1.id] == LEAF
    f, sf = put(cache, kv, pool, D[:250])  # a fork checkpoint above e1
    assert walk.kind[f.id] == HUB0 and walk.born_below[f.id] and walk.below[f.id] == 1
    assert walk.orders[0].w[f.id] == 1.0
    assert cache.match_prefix(D[:260] + [900]).state_slot == sf  # consumed with e1 below
    assert walk.kind[f.id] == HUB and walk.orders[0].w[f.id] == 2.0
    assert cache.match_prefix(D + [901]).state_slot == pool_slot(e1)  # e1 consumed ...
    x, _ = put(cache, kv, pool, D + [901, 902])  # ... and moved past: a chain
    assert walk.kind[e1.id] == CHAIN and walk.superseded[e1.id]
    # rules: chains 0 while hit less often than leaves, else 1; spines their rate over the
    # leaves', capped at 1. Prior: 4 stores of the live pool (6 states) at the leaves' rate.
    walk.rate_hits[SPINE] += 50.0
    put(cache, kv, pool, [700])
    assert walk.spine_weight == 1.0 and walk.orders[0].w[s1.id] == 1.0
    assert len(state_nodes(cache)) == 6
    walk.rate_hits[LEAF], walk.exposure[LEAF] = 9.0, 99.0  # leaves: 10 / 100 = 0.1
    walk.rate_hits[SPINE], walk.exposure[SPINE] = 2.6, 76.0  # (2.6 + 24 x 0.1) / 100 = 0.05
    walk.rate_hits[CHAIN], walk.exposure[CHAIN] = 8.0, 76.0  # (8 + 2.4) / 100 = 0.104
    walk._rules()
    assert walk.spine_weight == pytest.approx(0.5) and walk.chain_weight == 1.0
    assert walk.orders[0].w[s1.id] == pytest.approx(0.5) and walk.orders[0].w[e1.id] == 1.0
    walk.rate_hits[CHAIN] = 6.0  # (6 + 2.4) / 100 = 0.084, below the leaves' 0.1
    walk.rate_hits[SPINE] = 0.6  # (0.6 + 2.4) / 100 = 0.03: weight 0.3
    walk._rules()
    assert walk.chain_weight == 0.0 and walk.orders[0].w[e1.id] == 0.0
    assert walk.spine_weight == pytest.approx(0.3) and walk.orders[0].w[s2.id] == pytest.approx(0.3)
    walk.rate_hits[SPINE] = 20.0  # hit more often than leaves: capped at 1
    walk._rules()
    assert walk.spine_weight == 1.0
    cache.sanity_check()


def test_adaptive_leaf_weight_counts_its_own_hits() -> None:
    """A leaf consumed and not extended (a shared prompt's end state asked again) gains
    GDSF's frequency in the signals order: weight = bucket weight x (1 + hits). With no
    bucket outcome resolved yet, the bucket weight is its prior, exactly 1: weights 1, 2, 3."""
    cache, kv, pool = make(policy="gds_adaptive")
    walk = cache.state.gds
    assert isinstance(walk, AdaptiveGDSStrategy)
    P = list(range(1, 201))
    leaf, slot = put(cache, kv, pool, P)
    put(cache, kv, pool, list(range(1001, 1101)))
    assert walk.bucket_weight(walk.bucket[leaf.id]) == 1.0
    assert walk.orders[0].w[leaf.id] == 1.0
    for k in (1, 2):
        assert cache.match_prefix(P + [9000 + k]).state_slot == slot
        assert walk.kind[leaf.id] == LEAF and walk.hits[leaf.id] == k
        assert walk.orders[0].w[leaf.id] == 1.0 + k
        assert walk.orders[2].w[leaf.id] == 1.0 + k  # gdsf agrees on a leaf at the prior
    cache.sanity_check()


def pool_slot(node: TreeNode) -> int:
    assert node.state_slot is not None
    return node.state_slot


def test_adaptive_bucket_outcomes_are_resolved_from_kv_reuse() -> None:
    """A stored state's outcome comes due after 2 x (live states) stores: reused when another
    request inserted through its node, whether or not its state survived."""
    cache, kv, pool = make(states=16, policy="gds_adaptive")
    walk = cache.state.gds
    a, _ = put(cache, kv, pool, list(range(1, 51)))  # store 1, bucket 0, live 1
    assert cache.evict_states(1).num_states == 1  # a's state (and leaf) gone ...
    put(cache, kv, pool, list(range(1, 61)))  # ... but a request passes its prefix again
    assert walk.outcomes == [0.0, 0.0, 0.0]  # store 2, live 1: a due at store 3
    put(cache, kv, pool, [900, 901])  # store 3: resolves a (its node left the tree with the
    # leaf, so its own hit_count stayed: not reused) and store 2 waits for store 5
    assert walk.outcomes[0] == pytest.approx(1.0) and walk.reuses == [0.0, 0.0, 0.0]
    b, _ = put(cache, kv, pool, list(range(2001, 2041)))  # store 4, bucket 0
    put(cache, kv, pool, list(range(2001, 2041)) + [7, 7])  # store 5 inserts through b
    assert b.hit_count == 2
    for i in range(12):  # b (store 4) comes due once 2 x live stores passed
        assert walk.reuses[0] == 0.0
        put(cache, kv, pool, [3000 + i])
        while len(state_nodes(cache)) > 3:
            cache.evict_states(1)
        if walk.reuses[0]:
            break
    assert walk.reuses[0] == pytest.approx(1.0, abs=0.01) and walk.stores < 17
    cache.sanity_check()


def test_adaptive_matches_a_brute_force_reference_under_random_ops() -> None:
    """The test keeps its own record of which states were consumed, moved past (a state
    cached below them after a hit), born above others and hit while states lay below; kinds
    derived from it and from the tree equal the walk's, the signals order's hub weights are
    1 + hits below, gdsf's 1 + hits, and every victim has the least ``stamp + weight x
    cost(a, b)`` of the leading order."""
    consumed: dict[int, bool] = {}
    superseded: dict[int, bool] = {}
    born: dict[int, bool] = {}
    hits_below: dict[int, int] = {}
    pops = 0
    for cache, _kv, pool, hits, action in _run_random("gds_adaptive", 5, 500):
        walk = cache.state.gds
        if action[0] == "states" and state_nodes(cache):
            lead = walk.orders[walk.leader]
            want = {n.state_slot: lead.stamp[n.id] + lead.w[n.id]
                    * gds_cost(shallower_pos(n), n.depth, 1.0, 0.5) for n in state_nodes(cache)}
            before = set(pool.snapshot().free_ids())
            assert cache.evict_states(1).num_states == 1
            got = evicted_slot(pool, before)
            assert want[got] == pytest.approx(min(want.values()), abs=1e-9)
            pops += 1
        elif action[0] == "kv":
            cache.evict(action[1])
        elif action[0] == "insert" and action[1].state_adopted:
            node = action[1].last_node
            consumed[node.id] = superseded[node.id] = False
            born[node.id] = any(True for _ in _states_strictly_below(node))
            hits_below[node.id] = 0
            p = node.parent
            while p is not None and p.state_slot is None:
                p = p.parent
            if p is not None and p.parent is not None and consumed[p.id]:
                superseded[p.id], consumed[p.id] = True, False
        elif action[0] == "match" and action[1].state_slot is not None:
            node = action[1].last_device_node
            while node.state_slot != action[1].state_slot:
                node = node.parent
            consumed[node.id] = True
            if any(True for _ in _states_strictly_below(node)):
                hits_below[node.id] += 1
        live = state_nodes(cache)
        ids = {n.id for n in live}
        for d in (consumed, superseded, born, hits_below):
            for k in list(d):
                if k not in ids:
                    del d[k]
        signals, _, gdsf = walk.orders
        for n in live:
            below = any(True for _ in _states_strictly_below(n))
            kind = (LEAF if not below else HUB if hits_below[n.id] else CHAIN
                    if superseded[n.id] else HUB0 if born[n.id] else SPINE)
            assert walk.kind[n.id] == kind, (n, kind)
            w = signals.w[n.id]
            if kind == HUB:
                assert w == 1.0 + hits_below[n.id]
            elif kind == HUB0:
                assert w == 1.0
            elif kind in (CHAIN, SPINE):
                assert w in (0.0, 1.0)
            else:
                assert w > 0
            assert gdsf.w[n.id] == 1.0 + hits[n.state_slot]
        cache.sanity_check()
    assert pops > 30


def _states_strictly_below(node: TreeNode):
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        if n.state_slot is not None:
            yield n
        stack.extend(n.children.values())
