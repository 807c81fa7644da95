"""The per-request hint ``extra`` (radix/hints.py): checked at the boundary, never part of a
key, handed to the state walk before the call's state events, and read by ``gds_adaptive``
as session evidence (components/eviction/sessions.py): a hand-built scenario where the hint
changes the victim the way the learned weights predict."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from allocators import TokenAllocator
from components.eviction.adaptive import AdaptiveGDSStrategy
from components.eviction.sessions import LATEST, NONE, STALE, SessionEvidence
from radix import CacheConfig, CacheRequest, RadixCache
from tests.helpers.cache_helpers import tiny_state_pool
from tests.helpers.gds_helpers import make, put


class HintWalk:
    """A FIFO custom walk that logs every hint and state event in order."""

    def __init__(self, is_candidate: Any) -> None:
        self.ok = is_candidate
        self.watermark = 0.0
        self.order: list[Any] = []
        self.log: list[tuple[str, Any]] = []

    def on_hint(self, extra: Any) -> None:
        self.log.append(("hint", None if extra is None else dict(extra)))

    def on_set(self, node: Any) -> None:
        self.order.append(node)
        self.log.append(("set", node.depth))

    def on_hit(self, node: Any) -> None:
        self.log.append(("hit", node.depth))

    def on_use(self, node: Any) -> None:
        pass

    def on_remove(self, node: Any) -> None:
        self.order = [n for n in self.order if n is not node]

    def requeue(self, node: Any) -> None:
        pass

    def pop_victim(self) -> Any:
        return next((n for n in self.order if self.ok(n)), None)

    def check(self, state_nodes: Any) -> None:
        assert {n.id for n in state_nodes} == {n.id for n in self.order}


def hint_cache() -> tuple[RadixCache, TokenAllocator, Any, HintWalk]:
    kv = TokenAllocator(64)
    pool = tiny_state_pool(4)
    walks: list[HintWalk] = []

    def factory(ok: Any) -> HintWalk:
        walks.append(HintWalk(ok))
        return walks[-1]

    cache = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=pool, state_walk=factory)
    return cache, kv, pool, walks[-1]


@pytest.mark.parametrize("bad, exc, words", [
    (5, TypeError, "extra must be a mapping"),
    ("s1", TypeError, "extra must be a mapping"),
    ({"session": 1}, ValueError, "unknown hint 'session'"),
    ({"session_id": True}, TypeError, "extra['session_id'] must be a str or an int"),
    ({"session_id": 1.5}, TypeError, "extra['session_id'] must be a str or an int"),
    ({"session_id": ("a",)}, TypeError, "extra['session_id'] must be a str or an int"),
])
def test_bad_hints_are_refused_and_change_nothing(bad: Any, exc: type, words: str) -> None:
    cache, kv, pool, walk = hint_cache()
    slots = kv.alloc(8)
    free_before = kv.available_size()
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        cache.match_prefix([1, 2, 3], extra=bad)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        cache.insert(list(range(1, 9)), slots, state_slot=int(pool.alloc(1)[0]), extra=bad)
    assert cache.total_size() == 0 and kv.available_size() == free_before
    assert walk.log == [] and walk.order == []
    cache.sanity_check()


def test_hint_is_never_part_of_the_key() -> None:
    """Two sessions inserting the same tokens share one node; a match under any hint (or
    none) finds it; the cached size counts the tokens once."""
    cache, kv, pool, _ = hint_cache()
    key = list(range(1, 9))
    r1 = cache.insert(key, kv.alloc(8), state_slot=int(pool.alloc(1)[0]),
                      extra={"session_id": "a"})
    dup = kv.alloc(8)
    s2 = int(pool.alloc(1)[0])
    r2 = cache.insert(key, dup, state_slot=s2, extra={"session_id": 7})
    assert r2.last_node is r1.last_node and r2.prefix_len == 8 and not r2.state_adopted
    assert torch.equal(r2.duplicate_indices, dup)
    assert cache.total_size() == 8
    for extra in ({"session_id": "b"}, {}, None):
        m = cache.match_prefix(key, extra=extra)
        assert m.prefix_len == 8 and m.last_device_node is r1.last_node
    kv.free(dup)
    pool.free_slot(s2)
    cache.sanity_check()


def test_hints_reach_the_walk_before_the_call_s_state_events() -> None:
    """``match_prefix`` / ``insert`` / ``cache_finished_req`` hand the hint (or ``None``) to the
    walk's ``on_hint`` first; the state set or hit by the call follows it."""
    cache, kv, pool, walk = hint_cache()
    key = list(range(1, 9))
    cache.insert(key, kv.alloc(8), state_slot=int(pool.alloc(1)[0]), extra={"session_id": "a"})
    cache.match_prefix(key + [9], extra={"session_id": "b"})
    cache.match_prefix(key + [9])
    m = cache.match_prefix(key + [9, 10], extra={"session_id": 3})
    lock = cache.inc_lock_ref(m.last_device_node)
    longer = key + [9, 10, 11, 12]
    req = CacheRequest(key=longer, kv_indices=torch.cat([m.device_indices, kv.alloc(4)]),
                       cached_len=8, last_node=m.last_device_node, lock=lock,
                       extra={"session_id": 3})
    cache.cache_finished_req(req, state_slot=int(pool.alloc(1)[0]))
    assert walk.log == [
        ("hint", {"session_id": "a"}), ("set", 8),
        ("hint", {"session_id": "b"}), ("hit", 8),
        ("hint", None), ("hit", 8),
        ("hint", {"session_id": 3}), ("hit", 8),
        ("hint", {"session_id": 3}), ("set", 12),
    ]
    cache.sanity_check()


def test_walks_without_on_hint_are_not_called() -> None:
    """A walk without ``on_hint`` (``gds``) gets no hook; hints are still checked."""
    cache, kv, pool = make(policy="gds")
    assert cache.core.hint_hooks == ()
    put(cache, kv, pool, list(range(1, 11)), extra={"session_id": "a"})
    with pytest.raises(TypeError, match="extra must be a mapping"):
        cache.match_prefix([1, 2], extra=["session_id"])


def test_session_evidence_tags_by_hand() -> None:
    """Per session the latest state is ``latest``, the earlier ones ``stale``; without a
    session ``none``; when the latest leaves, the one stored before it is promoted."""
    ev = SessionEvidence(decay=1.0)
    ev.on_hint({"session_id": "a"})
    assert ev.on_set(1) is None
    assert ev.on_set(2) == 1  # 1 turned stale
    ev.on_hint(None)
    assert ev.on_set(3) is None
    ev.on_hint({"session_id": "b"})
    assert ev.on_set(4) is None
    assert [ev.tag(n) for n in (1, 2, 3, 4)] == [STALE, LATEST, NONE, LATEST]
    assert ev.count == [1, 2, 1]
    assert ev.on_remove(2) == 1  # a's latest left: 1 is a's latest again
    assert ev.tag(1) == LATEST and ev.count == [1, 2, 0]
    assert ev.on_remove(1) is None and "a" not in ev.states
    ev.check({3, 4})


def test_session_weights_learn_from_hits_by_hand() -> None:
    """Exposure adds each tag's live count per store; with ``prior`` p the rate of tag t is
    ``(hits_t + p * tagged) / (exposure_t + p)``, ``tagged = (hits + 1) / (exposure + 1)``
    over both tags; the weight is the rate over ``tagged`` in quarter octaves."""
    ev = SessionEvidence(decay=1.0)
    ev.on_hint({"session_id": "a"})
    ev.on_set(1)
    ev.on_set(2)  # 1 stale, 2 latest
    for _ in range(7):
        ev.tick(prior=1.0)  # exposure 7 each
    ev.on_hit(2)
    ev.on_hit(2)
    ev.on_hit(2)
    changed = ev.tick(prior=1.0)  # exposure 8 each; hits: latest 3, stale 0
    tagged = 4 / 17
    latest = (3 + tagged) / 9
    stale = tagged / 9
    q = [2 ** (round(4 * math.log2(r / tagged)) / 4) for r in (latest, stale)]
    assert ev.weights[LATEST] == pytest.approx(q[0]) and ev.weights[STALE] == pytest.approx(q[1])
    assert q[0] > 1 > q[1] and set(changed) == {LATEST, STALE}


def _scenario(hint: bool) -> tuple[str, AdaptiveGDSStrategy]:
    """Four sessions each store L (500 tokens) then M (600, another branch: L turns stale)
    and come back to M (a hit on their latest state). With hints the ``sessions`` order has
    joined the duel; it is made the leader (its charges set below the others', as a run of
    mistakes by the others would). Then session x stores Q1 (300) and Q2 (200, another
    branch). One state is evicted."""
    cache, kv, pool = make(policy="gds_adaptive", size=20_000, states=16)
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, AdaptiveGDSStrategy)

    def h(s: object) -> dict[str, object] | None:
        return {"session_id": s} if hint else None

    base = 10_000
    for i in range(4):
        lk, mk = list(range(base, base + 500)), list(range(base + 1000, base + 1600))
        base += 2000
        put(cache, kv, pool, lk, extra=h(i))
        put(cache, kv, pool, mk, extra=h(i))
        assert cache.match_prefix(mk + [1], extra=h(i)).prefix_len == 600
    names = [o.name for o in walk.orders]
    assert names == ["signals", "gds", "gdsf"] + (["sessions"] if hint else [])
    walk.regret = [1e9] * (len(names) - 1) + [0.0 if hint else 1e9]
    q1, sq1 = put(cache, kv, pool, list(range(1, 301)), extra=h("x"))  # a store: the switch
    q2, sq2 = put(cache, kv, pool, list(range(501, 701)), extra=h("x"))
    assert walk.leader == (3 if hint else 0)
    signals = walk.orders[0]
    assert signals.w[q1.id] == signals.w[q2.id]  # the kinds alone cannot tell them apart
    if hint:  # learned: latest states are hit, stale ones never
        ws = walk.sessions.weights
        assert ws[STALE] < 2 / 3 < ws[LATEST]
        w = walk.orders[3].w
        assert w[q1.id] == pytest.approx(signals.w[q1.id] * ws[STALE])
        assert w[q2.id] == pytest.approx(signals.w[q2.id] * ws[LATEST])
    before = set(pool.snapshot().free_ids())
    assert cache.evict_states(1).num_states == 1
    (freed,) = set(pool.snapshot().free_ids()) - before
    cache.sanity_check()
    return {sq1: "Q1", sq2: "Q2"}.get(freed, "other"), walk


def test_session_hint_changes_the_victim_as_predicted() -> None:
    """Both leaves have the same kind weight and no history, watermark 0: priority = weight
    x rebuild cost. Without the hint (the ``signals`` order) Q2 (200) goes before Q1 (300).
    With it, the ``sessions`` order sees Q1 stale: 300 x w_stale < 200 x w_latest once
    w_stale / w_latest < 2/3, which the learning phase gives (asserted), so Q1 goes."""
    assert _scenario(hint=False)[0] == "Q2"
    assert _scenario(hint=True)[0] == "Q1"


def test_no_hint_no_sessions_order() -> None:
    """Hints with no session (``{}``) or none at all never add the ``sessions`` order."""
    cache, kv, pool = make(policy="gds_adaptive")
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, AdaptiveGDSStrategy)
    put(cache, kv, pool, list(range(1, 11)), extra={})
    put(cache, kv, pool, list(range(21, 31)))
    assert len(walk.orders) == 3 and walk.sessions.count == [2, 0, 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_session_evidence_stays_exact_under_random_ops(seed: int) -> None:
    """Random matches, inserts (shared prefixes), state and KV evictions under random
    session hints (three sessions or none), the lead moved at random among the four orders:
    ``sanity_check`` (every order's heap and the session tags and counts recomputed) after
    every step; the session lists hold exactly the live states stored with a session."""
    rng = random.Random(seed)
    cache, kv, pool = make(1.0, 0.5, size=150, states=6, policy="gds_adaptive")
    walk = cache.state.gds if cache.state is not None else None
    assert isinstance(walk, AdaptiveGDSStrategy)
    keys: list[list[int]] = []
    stored_with: dict[int, object] = {}
    for step in range(400):
        sid = rng.choice([None, "a", "b", 7])
        extra = None if sid is None else {"session_id": sid}
        r = rng.random()
        if r < 0.5:
            if keys and rng.random() < 0.7:
                base = rng.choice(keys)
                key = base[: rng.randint(1, len(base))] + [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
            else:
                key = [rng.randint(1, 3) for _ in range(rng.randint(2, 12))]
            keys.append(key)
            if pool.available_size() == 0:
                cache.evict_states(1)
            if kv.available_size() < len(key):
                cache.evict(len(key))
            m = cache.match_prefix(key, extra=extra)
            fresh = kv.alloc(len(key) - m.prefix_len)
            if fresh is None or pool.available_size() == 0:
                continue
            slot = int(pool.alloc(1)[0])
            res = cache.insert(key, torch.cat([m.device_indices, fresh]), state_slot=slot,
                               extra=extra)
            if len(res.duplicate_indices):
                kv.free(res.duplicate_indices)
            if res.state_adopted:
                stored_with[res.last_node.id] = sid
            else:
                pool.free_slot(slot)
        elif r < 0.75 and keys:
            cache.match_prefix(rng.choice(keys), extra=extra)
        elif r < 0.9:
            cache.evict_states(1)
        else:
            cache.evict(rng.randint(1, 6))
        if step % 50 == 25:
            walk.regret = [rng.random() * 1e6 for _ in walk.regret]
        cache.sanity_check()
        live = {n.id for n in cache.state.slot_to_node.values()} if cache.state else set()
        assert set(walk.sessions.session_of) == {n for n in live if stored_with.get(n) is not None}
    assert len(walk.orders) == 4 and walk.switches > 0
