"""GreedyDual-Size eviction of recurrent states (``components.gds``): the cost function by
hand, the worked example on a real cache, re-seeding, stamps, the lower-bound invariant and
the watermark, and knob validation at build time."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from allocators import TokenAllocator
from radix import CacheConfig, EvictResult, RadixCache
from tests.helpers.cache_helpers import tiny_state_pool
from tests.helpers.gds_helpers import draw_key, make, put, state_nodes


def t64(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def true_priority(node, d: float, e: float) -> float:
    """Independent: stamp + cost from the nearest shallower surviving state (0 if none)."""
    a = 0
    p = node.parent
    while p is not None and p.parent is not None:
        if p.state_slot is not None:
            a = p.depth
            break
        p = p.parent
    b = node.depth
    return node.gds_stamp + d * (b - a) + e * (b * b - a * a) / 200000.0


def assert_lower_bounds(cache: RadixCache, d: float, e: float) -> None:
    """Each state's current heap entry (``gds_prio``) is <= its true priority, computed here
    independently and by the strategy itself (which must agree)."""
    gds = cache.state.gds
    assert gds is not None
    for n in state_nodes(cache):
        true = true_priority(n, d, e)
        assert gds.true_priority(n) == pytest.approx(true, rel=1e-12, abs=1e-12)
        assert n.gds_prio <= true + 1e-9, (n, n.gds_prio)
        assert n.gds_stamp <= cache.watermark + 1e-12


# ====================================================================== cost
def test_cost_function_by_hand() -> None:
    from components.gds import gds_cost

    assert gds_cost(0, 100, 1.0, 0.0) == 100.0
    assert gds_cost(100, 300, 1.0, 0.0) == 200.0
    assert gds_cost(0, 1000, 0.0, 1.0) == 5.0  # 1000^2 / 2e5
    assert gds_cost(1000, 2000, 0.0, 1.0) == 15.0  # (4e6 - 1e6) / 2e5
    assert gds_cost(7, 7, 1.0, 1.0) == 0.0
    # Defaults (GLM fit), position 8192 from 0: 0.15253504 + 0.0011173625856.
    assert gds_cost(0, 8192, 1.862e-5, 3.33e-6) == pytest.approx(0.1536524025856, rel=1e-12)
    # Only the ratio matters: scaling both scales every cost.
    assert gds_cost(300, 900, 2.0, 4.0) == pytest.approx(2 * gds_cost(300, 900, 1.0, 2.0))


@pytest.mark.parametrize("module", ["components.gds", "components.state", "components.kv"])
def test_components_import_on_their_own(module: str) -> None:
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-400:]


# ====================================================================== worked example
def test_worked_example_from_policies_md() -> None:
    d, e = 1.0, 0.0
    cache, kv, pool = make(d, e)
    P = list(range(1, 301))  # one path: A at 100, B at 300
    C = list(range(1001, 1251))  # another branch: C at 250
    a_node, a = put(cache, kv, pool, P[:100])
    b_node, b = put(cache, kv, pool, P)
    c_node, c = put(cache, kv, pool, C)
    assert (a, b, c) == (1, 2, 3)
    assert cache.watermark == 0.0
    assert (a_node.gds_prio, b_node.gds_prio, c_node.gds_prio) == (100.0, 200.0, 250.0)
    assert_lower_bounds(cache, d, e)

    # Evict one: A (100), an internal node: its KV stays. L := 100.
    assert cache.evict_states(1) == EvictResult(0, 1)
    cache.sanity_check()
    assert pool.snapshot().free_ids()[-1] == a and a_node.state_slot is None
    assert cache.watermark == 100.0
    assert b_node.gds_prio == 200.0  # the stale entry is a lower bound ...
    assert true_priority(b_node, d, e) == 300.0  # ... of its true priority from the root
    assert_lower_bounds(cache, d, e)

    # Evict another: B's 200 is recomputed to 300 and pushed back; C (250) goes, whole leaf.
    assert cache.evict_states(1) == EvictResult(250, 1)
    cache.sanity_check()
    assert pool.snapshot().free_ids()[-1] == c
    assert cache.watermark == 250.0
    assert b_node.state_slot == b and b_node.gds_prio == 300.0
    assert cache.total_size() == 300
    assert cache.match_prefix(P).state_slot == b
    assert_lower_bounds(cache, d, e)

    # The match stamped B at L = 250: priority 250 + 300. Evicting it takes its leaf and the
    # stateless [0, 100) above it.
    assert b_node.gds_stamp == 250.0
    assert cache.evict_states(1) == EvictResult(300, 1)
    assert cache.watermark == 550.0
    cache.sanity_check()
    assert cache.total_size() == 0 and pool.available_size() == 8


def test_matched_state_is_stamped_at_the_watermark() -> None:
    d, e = 1.0, 0.0
    cache, kv, pool = make(d, e)
    put(cache, kv, pool, [1] * 10)  # prio 10
    y_node, y = put(cache, kv, pool, [2] * 45)  # prio 45
    z_node, z = put(cache, kv, pool, [3] * 30)  # prio 30
    assert cache.evict_states(1) == EvictResult(10, 1)
    assert cache.watermark == 10.0
    cache.match_prefix([3] * 30)  # z used: stamped at 10, true priority 40; its entry 30 stays
    assert z_node.gds_stamp == 10.0 and z_node.gds_prio == 30.0
    assert true_priority(z_node, d, e) == 40.0
    assert y_node.gds_stamp == 0.0
    assert_lower_bounds(cache, d, e)
    # z's entry pops first, is recomputed to 40 (< y's 45), and z goes.
    assert cache.evict_states(1) == EvictResult(30, 1)
    assert pool.snapshot().free_ids()[-1] == z
    assert cache.watermark == 40.0
    assert y_node.state_slot == y
    cache.sanity_check()


def test_release_by_last_request_stamps_the_state() -> None:
    d, e = 1.0, 0.0
    cache, kv, pool = make(d, e)
    a_node, _ = put(cache, kv, pool, [1] * 20)
    put(cache, kv, pool, [2] * 5)
    cache.inc_lock_ref(a_node)
    cache.inc_lock_ref(a_node)
    assert cache.evict_states(5) == EvictResult(5, 1)  # the locked state is skipped
    assert cache.watermark == 5.0 and a_node.gds_stamp == 0.0
    cache.dec_lock_ref(a_node)
    assert a_node.gds_stamp == 0.0  # still held by one request
    cache.dec_lock_ref(a_node)
    assert a_node.gds_stamp == 5.0  # released by its last request
    assert_lower_bounds(cache, d, e)
    assert cache.evict_states(1) == EvictResult(20, 1)
    assert cache.watermark == 25.0
    cache.sanity_check()


# ====================================================================== re-seeding
def test_a_new_state_above_existing_ones_lowers_their_entries() -> None:
    d, e = 1.0, 0.0
    cache, kv, pool = make(d, e)
    P = list(range(1, 451))
    b_node, b = put(cache, kv, pool, P[:300])
    assert b_node.gds_prio == 300.0
    d_node, dd = put(cache, kv, pool, P)  # D at 450 below B
    assert d_node.gds_prio == 150.0
    a_node, a = put(cache, kv, pool, P[:100])  # A at 100: splits B's node, sits above B
    assert a_node.depth == 100 and a_node.gds_prio == 100.0
    assert b_node.gds_prio == 200.0  # re-seeded: its nearest shallower state is now at 100
    assert d_node.gds_prio == 150.0  # below B: untouched
    assert_lower_bounds(cache, d, e)
    # A (100, internal: tombstone), then D (150; B's entry 200 < true 300), then B (300).
    order = []
    for tokens in (0, 150, 300):
        assert cache.evict_states(1) == EvictResult(tokens, 1)
        cache.sanity_check()
        assert_lower_bounds(cache, d, e)
        order.append((pool.snapshot().free_ids()[-1], cache.watermark))
    assert order == [(a, 100.0), (dd, 150.0), (b, 300.0)]
    assert cache.total_size() == 0


# ====================================================================== random invariants
@pytest.mark.parametrize(("d", "e"), [(1.0, 0.0), (0.0, 1.0), (1.862e-5, 3.33e-6)])
def test_watermark_monotone_and_entries_lower_bounds_under_random_ops(d: float, e: float) -> None:
    rng = random.Random(7)
    cache, kv, pool = make(d, e, size=120, states=6)
    keys: list[list[int]] = []
    marks = [cache.watermark]
    for _ in range(300):
        r = rng.random()
        if r < 0.5:
            key = draw_key(rng, keys)
            if pool.available_size() == 0:
                cache.evict_states(1)
            if kv.available_size() < len(key):
                cache.evict(len(key) - kv.available_size())
            m = cache.match_prefix(key)
            need = len(key) - m.prefix_len
            fresh = kv.alloc(need)
            slot = pool.alloc(1)
            if fresh is None or slot is None:
                if fresh is not None:
                    kv.free(fresh)
                if slot is not None:
                    pool.free(slot)
                continue
            res = cache.insert(key, torch.cat([m.device_indices, fresh]), state_slot=int(slot[0]))
            if len(res.duplicate_indices):
                kv.free(res.duplicate_indices)
            if not res.state_adopted:
                pool.free(slot)
        elif r < 0.7 and keys:
            cache.match_prefix(rng.choice(keys))
        elif r < 0.9:
            cache.evict_states(rng.randint(1, 2))
        else:
            cache.evict(rng.randint(1, 6))
        cache.sanity_check()
        assert_lower_bounds(cache, d, e)
        marks.append(cache.watermark)
    assert all(x <= y for x, y in zip(marks, marks[1:], strict=False))
    assert marks[-1] > 0


# ====================================================================== validation
@pytest.mark.parametrize(
    ("knobs", "names"),
    [
        ({"d": -1.0}, ["d"]),
        ({"e": -0.5}, ["e"]),
        ({"d": math.nan}, ["d"]),
        ({"e": math.inf}, ["e"]),
        ({"d": -math.inf}, ["d"]),
        ({"d": 0.0, "e": 0.0}, ["d", "e"]),
        ({"d": 0, "e": 0}, ["d", "e"]),
        ({"d": "1"}, ["d"]),
        ({"e": None}, ["e"]),
        ({"d": True}, ["d"]),
        ({"d": [1.0]}, ["d"]),
        ({"f": 1.0}, ["f"]),
        ({"threshold": 3}, ["threshold"]),
    ],
)
def test_bad_gds_knobs_fail_when_the_config_is_built(knobs: dict, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        CacheConfig(radix_eviction_policy="gds", radix_eviction_policy_config=knobs)
    msg = str(info.value)
    for n in names:
        assert f"'{n}'" in msg, msg


def test_gds_is_opt_in_and_other_policies_use_the_lru_state_walk() -> None:
    kv, pool = TokenAllocator(8), tiny_state_pool(2)
    cache = RadixCache(kv_allocator=kv, state_allocator=pool)
    assert cache.policy.name == "lru" and cache.state.gds is None and cache.watermark == 0.0
    cache.insert([1, 2], kv.alloc(2), state_slot=int(pool.alloc(1)[0]))
    assert cache.evict_states(1) == EvictResult(2, 1)
    assert cache.watermark == 0.0
