"""``gds_adaptive``'s return classes (:func:`components.eviction.adaptive.return_class`) and the
learned ``continued`` weight of leaf states: classes and weights by hand."""

from __future__ import annotations

import math

import pytest

from components.eviction.adaptive import (
    CONTINUED,
    FRESH,
    INNER,
    LEAF,
    RATE_PRIOR,
    AdaptiveGDSStrategy,
    return_class,
)
from components.eviction.sessions import quantised
from tests.helpers.gds_helpers import make, put


def test_return_class_table() -> None:
    assert return_class(None, False, False) == FRESH  # no live state above
    assert return_class(None, True, True) == FRESH
    assert return_class(FRESH, True, True) == CONTINUED  # resumed at a leaf: a next turn
    assert return_class(INNER, True, True) == CONTINUED
    assert return_class(FRESH, True, False) == INNER  # resumed at a state with states below
    assert return_class(CONTINUED, True, False) == INNER
    for c in (FRESH, CONTINUED, INNER):  # not consumed: the same request went on
        assert return_class(c, False, False) == c
        assert return_class(c, False, True) == c


def test_walk_assigns_return_classes() -> None:
    """A conversation: turn 1 stores A (fresh); turn 2 resumes from A while A is a leaf and
    stores B (continued), then its next checkpoint C below B with no hit on B in between
    (continued, B's class). A document: chunk states D1, D2 (fresh); a question resumes from
    D1 while D2 lies below it and stores Q on a branch (inner)."""
    cache, kv, pool = make(policy="gds_adaptive", size=2000, states=8)
    walk = cache.state.gds
    assert isinstance(walk, AdaptiveGDSStrategy)
    P = list(range(1, 401))
    a, sa = put(cache, kv, pool, P[:100])
    assert walk.returns[a.id] == FRESH
    assert cache.match_prefix(P[:150]).state_slot == sa
    assert walk.hit_as_leaf[a.id]
    b, _ = put(cache, kv, pool, P[:200])
    c, _ = put(cache, kv, pool, P[:300])
    assert (walk.returns[b.id], walk.returns[c.id]) == (CONTINUED, CONTINUED)
    D = list(range(1001, 1301))
    d1, sd1 = put(cache, kv, pool, D[:100])
    d2, _ = put(cache, kv, pool, D[:200])
    assert (walk.returns[d1.id], walk.returns[d2.id]) == (FRESH, FRESH)
    assert cache.match_prefix(D[:150] + [5000]).state_slot == sd1
    assert not walk.hit_as_leaf[d1.id]
    q, _ = put(cache, kv, pool, D[:100] + [5000] * 30)
    assert walk.returns[q.id] == INNER
    # leaf counts per class: A is a chain now, D1 a hub; B and D1 are not leaves
    assert walk.leaf_returns == [1, 1, 1]  # D2 fresh, C continued, Q inner
    cache.sanity_check()


def test_continued_weight_by_hand() -> None:
    """Turn 1 stores A, turn 2 resumes from it and stores B: live A (a chain) and B (a leaf
    of class continued); decay off. Leaves: 9 hits over 99 state-stores, rate (9 + 1) / (99
    + 1) = 0.1. Continued: 6 hits over 11 state-stores, 12 after this store (B); prior
    RATE_PRIOR x 2 live = 8 state-stores at 0.1: rate (6 + 0.8) / (12 + 8) = 0.34, 3.4 x the
    leaves': 4 x log2(3.4) = 7.06 -> 2 ** (7 / 4) = 3.3636. B's signals weight: its bucket
    weight (no outcome yet: 1) x (1 + 0 hits) x 3.3636. With no continued hits the rate is
    (0 + 0.8) / (13 + 8), 0.38 x the leaves': the weight stays 1, not below."""
    cache, kv, pool = make(policy="gds_adaptive")
    walk = cache.state.gds
    assert isinstance(walk, AdaptiveGDSStrategy)
    P = list(range(1, 301))
    a, sa = put(cache, kv, pool, P[:100])
    assert cache.match_prefix(P[:150]).state_slot == sa
    b, _ = put(cache, kv, pool, P[:200])
    assert walk.kind[b.id] == LEAF and walk.returns[b.id] == CONTINUED
    assert walk.leaf_returns[CONTINUED] == 1 and len(walk._live) == 2
    assert RATE_PRIOR == 4.0
    walk._decay = 1.0
    walk.rate_hits[LEAF], walk.exposure[LEAF] = 9.0, 99.0
    walk.return_hits[CONTINUED], walk.return_exposure[CONTINUED] = 6.0, 11.0
    walk._learn_returns()
    assert walk.rate(LEAF) == pytest.approx(0.1)
    assert walk.return_rate(CONTINUED) == pytest.approx(0.34)
    assert walk.return_weights[CONTINUED] == pytest.approx(2 ** 1.75)
    assert walk.return_weights[FRESH] == walk.return_weights[INNER] == 1.0
    assert walk.bucket_weight(walk.bucket[b.id]) == 1.0
    signals = walk.orders[0]
    assert signals.w[b.id] == pytest.approx(2 ** 1.75)
    walk.return_hits[CONTINUED] = 0.0
    walk._learn_returns()
    assert walk.return_rate(CONTINUED) == pytest.approx(0.8 / 21)
    assert quantised(0.8 / 21 / 0.1) < 1.0
    assert walk.return_weights[CONTINUED] == 1.0
    assert signals.w[b.id] == 1.0
    cache.sanity_check()


def test_quantised_by_hand() -> None:
    assert quantised(1.0) == 1.0
    assert quantised(2.0) == 2.0
    assert quantised(3.2) == pytest.approx(2 ** 1.75)  # 4 x log2(3.2) = 6.71 -> 7
    assert quantised(1e6) == 64.0 and quantised(1e-6) == 1 / 64
    assert math.isclose(quantised(0.5), 0.5)
