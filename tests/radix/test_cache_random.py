"""Seeded random-operation stress of RadixCache against the brute-force model in refmodel.py.

Every step: the library's answer equals the model's (match fields, insert fields, eviction
counts, which nodes and states survive), ``sanity_check()`` passes, the counters equal the
model's, and every slot is accounted for exactly once: tree-held + caller-held + free ==
capacity, for the KV allocator and the state pool.

A second family checks each registered radix eviction policy against the oracle "sort every
evictable leaf (unlocked, childless) by the policy key and take the first".
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from allocators import PagedAllocator, TokenAllocator
from components.eviction.registry import POLICY_REGISTRY
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import (
    draw_key,
    draw_tokens,
    free_leftovers,
    free_slots,
    node_slots,
    tiny_state_pool,
)
from tests.helpers.gds_helpers import gds_entry, gds_stamp
from tests.helpers.refmodel import RefCache


def t64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def library_view(cache: RadixCache) -> dict[tuple, tuple[list[int], int | None, int, int]]:
    """Node end (extra_key, tokens from the root) -> (slots, state, KV lock, state lock)."""
    out = {}
    stack = [(c, ()) for c in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        toks = above + tuple(int(x) for x in node.key)
        out[(node.extra_key, toks)] = (
            node_slots(node).tolist(),
            node.state_slot,
            node.kv_lock,
            node.state_lock,
        )
        stack.extend((c, toks) for c in node.children.values())
    return out


class Harness:
    """Drives one cache and one model with the same engine-like operations."""

    def __init__(self, seed: int, page_size: int, hybrid: bool, policy: str | None,
                 knobs: dict[str, Any] | None = None, kv_size: int = 48, states: int = 8) -> None:
        self.rng = random.Random(seed)
        self.ps = page_size
        self.kv = TokenAllocator(kv_size) if page_size == 1 else PagedAllocator(kv_size, page_size)
        self.pool = (
            tiny_state_pool(states)
            if hybrid
            else None
        )
        cfg = CacheConfig(page_size=page_size, radix_eviction_policy=policy,
                          radix_eviction_policy_config=knobs)
        self.cache = RadixCache(cfg, kv_allocator=self.kv, state_allocator=self.pool)
        walk = {"gds": "gds", "joint_lru": "joint"}.get(policy or "lru", "lru")
        d = float((knobs or {}).get("d", 1.862e-5))
        e = float((knobs or {}).get("e", 3.33e-6))
        self.model = RefCache(page_size, hybrid, walk, d, e)
        self.hybrid = hybrid
        self.walk = walk
        self.keys: list[tuple[list[int], Any]] = []
        self.locks: list[tuple[Any, Any]] = []  # (library node, model prefix)
        self.held_kv: list[torch.Tensor] = []
        self.held_states: list[int] = []
        self.steps = 0
        self.resets = 0

    # ------------------------------------------------------------------ helpers
    def gen_key(self) -> tuple[list[int], Any]:
        return draw_key(self.rng, self.keys, recent=12, grow=(0, 5), fresh=(0, 10), cap=14,
                        extras=[None, None, "lora"], switch=0.1)

    def match(self, toks: list[int], extra: Any):
        m = self.cache.match_prefix(toks, extra)
        e = self.model.match(toks, extra)
        assert m.prefix_len == e.prefix_len
        assert m.kv_hit_length == e.kv_hit_length
        assert m.device_indices.dtype == torch.int64
        assert m.device_indices.tolist() == e.device_indices
        assert m.state_slot == e.state_slot
        assert m.branching_seqlen == e.branching_seqlen
        if e.node is None:
            assert m.last_device_node is self.cache.root
        else:
            assert m.last_device_node.depth == m.prefix_len
        return m, e

    def evict(self, n: int) -> None:
        before = len(self.kv.snapshot().free_ids())
        r = self.cache.evict(n)
        freed = free_slots(self.kv)[before * self.ps:]  # appended in the order freed

        def choose(tied: list[Any], out: Any) -> Any:
            at = len(out.freed_slots)
            hits = [p for p in tied
                    if freed[at : at + len(self.model.node_slots(p))] == self.model.node_slots(p)]
            assert len(hits) == 1, f"the library freed {freed[at:]}, none of the oldest {tied}"
            return hits[0]

        e = self.model.evict(n, choose)
        assert (r.num_tokens, r.num_states) == (e.num_tokens, e.num_states)
        assert freed == e.freed_slots  # the same nodes, in the same order

    def evict_states(self, n: int) -> None:
        if self.walk == "lru":
            r = self.cache.evict_states(n)
            e = self.model.evict_states(n)
            assert (r.num_tokens, r.num_states) == (e.num_tokens, e.num_states)
            return
        for _ in range(n):  # ties may be broken either way: learn the library's pick
            r = self.cache.evict_states(1)
            left = {v[1] for v in library_view(self.cache).values()}
            e = self.model.evict_states(1, choose=lambda tied, left=left: self._picked(tied, left))
            assert (r.num_tokens, r.num_states) == (e.num_tokens, e.num_states)
            if r.num_states == 0:
                return

    def _picked(self, tied: list[Any], left: set[Any]) -> Any:
        gone = [p for p in tied if self.model.pages[p].state not in left]
        assert len(gone) == 1, f"the library evicted none of the minimal states {tied}"
        return gone[0]

    def ensure_kv(self, n: int) -> torch.Tensor | None:
        if self.kv.available_size() < n:
            self.evict(n - self.kv.available_size())
        return self.kv.alloc(n)

    def ensure_state(self) -> int | None:
        assert self.pool is not None
        if self.pool.available_size() < 1:
            self.evict_states(1)
        got = self.pool.alloc(1)
        return None if got is None else int(got[0])

    # ------------------------------------------------------------------ operations
    def op_insert(self) -> None:
        toks, extra = self.gen_key()
        if self.hybrid:  # the state is valid at a page end (insert refuses others)
            toks = toks[: len(toks) // self.ps * self.ps]
        rng = self.rng
        prefix: list[int] = []
        locked = None
        if rng.random() < 0.5:  # engine style: reuse the matched slots, lock them meanwhile
            m, e = self.match(toks, extra)
            prefix = m.device_indices.tolist()
            self.cache.inc_lock_ref(m.last_device_node)
            self.model.lock(e.node)
            locked = (m.last_device_node, e.node)
        need = len(toks) - len(prefix)
        n_alloc = -(-need // self.ps) * self.ps
        fresh = self.ensure_kv(n_alloc)
        slot = None
        if fresh is not None and self.hybrid:
            slot = self.ensure_state()
            if slot is None:
                self.kv.free(fresh)
                fresh = None
        if fresh is not None:
            value = prefix + fresh.tolist()[:need]
            res = self.cache.insert(toks, t64(value), extra, state_slot=slot)
            e = self.model.insert(toks, value, extra, state_slot=slot)
            assert res.prefix_len == e.prefix_len
            assert res.inserted_len == e.inserted_len
            assert res.duplicate_indices.tolist() == e.duplicate_indices
            assert res.adopted_indices.tolist() == e.adopted_indices
            assert res.remainder_indices.tolist() == e.remainder_indices
            assert res.state_adopted == e.state_adopted
            # The caller frees its duplicates and its unkept tail (whole pages).
            if len(res.duplicate_indices):
                self.kv.free(res.duplicate_indices)
            tail = value[res.inserted_len:] + fresh.tolist()[need:]
            if tail:
                self.kv.free(t64(tail))
            if slot is not None and not res.state_adopted:
                if rng.random() < 0.7:
                    self.pool.free(t64([slot]))  # type: ignore[union-attr]
                else:
                    self.held_states.append(slot)
        if locked is not None:
            self.cache.dec_lock_ref(locked[0])
            self.model.unlock(locked[1])

    def op_match(self) -> None:
        toks, extra = self.gen_key()
        m, e = self.match(toks, extra)
        if self.rng.random() < 0.4:
            self.cache.inc_lock_ref(m.last_device_node)
            self.model.lock(e.node)
            self.locks.append((m.last_device_node, e.node))

    def op_unlock(self) -> None:
        if self.locks:
            node, pref = self.locks.pop(self.rng.randrange(len(self.locks)))
            self.cache.dec_lock_ref(node)
            self.model.unlock(pref)

    def op_evict(self) -> None:
        self.evict(self.rng.randint(0, 8))

    def op_evict_states(self) -> None:
        if self.hybrid:
            self.evict_states(self.rng.randint(0, 3))

    def op_hold(self) -> None:
        got = self.kv.alloc(self.ps * self.rng.randint(1, 3))
        if got is not None:
            self.held_kv.append(got)

    def op_release(self) -> None:
        if self.held_kv:
            self.kv.free(self.held_kv.pop(self.rng.randrange(len(self.held_kv))))
        if self.held_states:
            self.pool.free(t64([self.held_states.pop()]))  # type: ignore[union-attr]

    def op_reset(self) -> None:
        if not self.locks:
            self.cache.reset()
            self.model.reset()
            self.resets += 1

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        cache, model = self.cache, self.model
        cache.sanity_check()
        model.check()
        assert library_view(cache) == model.view(), f"step {self.steps}\n{cache.pretty_print()}"
        ev, pr, sev, spr = model.sizes()
        assert (cache.evictable_size(), cache.protected_size()) == (ev, pr)
        assert (cache.state_evictable_size(), cache.state_protected_size()) == (sev, spr)
        # KV accounting: tree + caller + free == capacity, no slot counted twice.
        tree = model.held_slots()
        held = [s for t in self.held_kv for s in t.tolist()]
        free = free_slots(self.kv)
        assert len(tree) + len(held) + len(free) == self.kv.size
        assert set(tree) | set(held) | set(free) == set(range(self.ps, self.ps + self.kv.size))
        assert self.kv.available_size() == len(free)
        if self.pool is not None:
            st = model.held_states()
            sfree = self.pool.snapshot().free_ids()
            assert len(st) + len(self.held_states) + len(sfree) == self.pool.size
            assert set(st) | set(self.held_states) | set(sfree) == set(range(1, self.pool.size + 1))
        self.check_stamp_order()
        gds = cache.state.gds if cache.state is not None else None
        if gds is not None:
            assert cache.watermark == pytest.approx(model.watermark, abs=1e-12)
            for node_end, page in model.pages.items():
                if page.state is None:
                    continue
                true = model.true_priority(node_end)
                lib = next(n for n in _nodes(cache) if n.state_slot == page.state)
                assert gds_stamp(cache, lib) == pytest.approx(page.stamp, abs=1e-12)
                assert gds_entry(cache, lib) <= true + 1e-9, (lib, gds_entry(cache, lib), true)

    def check_stamp_order(self) -> None:
        """Access stamps order the nodes (and the states) exactly as the model's clock does."""
        lib = {}
        for n in _nodes(self.cache):
            toks: tuple[int, ...] = ()
            for a in reversed(n.path_to_root()):
                toks += tuple(int(x) for x in a.key)
            lib[(n.extra_key, toks)] = n
        pairs = [(pg.t, lib[p].last_access_time) for p, pg in self.model.pages.items() if pg.boundary]
        spairs = [
            (pg.state_t, lib[p].state_access_time)
            for p, pg in self.model.pages.items()
            if pg.state is not None
        ]
        for ps_ in (pairs, spairs):
            ps_.sort()
            for (ma, la), (mb, lb) in zip(ps_, ps_[1:], strict=False):
                assert (ma == mb) == (la == lb) and (ma < mb) <= (la < lb), (
                    f"stamp order differs from the model: {ps_}"
                )

    def run(self, steps: int) -> None:
        ops = [
            (self.op_insert, 35),
            (self.op_match, 20),
            (self.op_unlock, 12),
            (self.op_evict, 8),
            (self.op_evict_states, 8),
            (self.op_hold, 4),
            (self.op_release, 4),
            (self.op_reset, 1),
        ]
        fns = [f for f, _ in ops]
        weights = [w for _, w in ops]
        self.check()
        for i in range(steps):
            self.steps = i
            self.rng.choices(fns, weights)[0]()
            self.check()
        # Drain: release every lock, evict everything, every slot back.
        while self.locks:
            self.op_unlock()
            self.check()
        self.evict(10**6)
        if self.hybrid:
            self.evict_states(10**6)
        self.check()
        assert self.cache.total_size() == 0 and not self.model.pages
        for t in self.held_kv:
            self.kv.free(t)
        assert self.kv.available_size() == self.kv.size


def _nodes(cache: RadixCache) -> list[Any]:
    out = []
    stack = list(cache.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


# ====================================================================== model tests
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [1, 2])
def test_random_kv_only_against_model(seed: int, page_size: int) -> None:
    Harness(seed, page_size, hybrid=False, policy=None).run(250)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy", ["lru", "joint_lru"])
def test_random_hybrid_against_model(seed: int, page_size: int, policy: str) -> None:
    Harness(100 + seed, page_size, hybrid=True, policy=policy).run(250)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("knobs", [{"d": 1.0, "e": 0.0}, {"d": 1.0, "e": 2000.0}, None])
def test_random_hybrid_gds_against_model(seed: int, knobs: dict[str, float] | None) -> None:
    """GDS: the lazy heap must evict a minimal-priority state (exact min over all candidates),
    keep every entry a lower bound of the true priority, and raise the watermark to it."""
    h = Harness(200 + seed, 1, hybrid=True, policy="gds", knobs=knobs)
    marks: list[tuple[int, float]] = []  # (resets so far, watermark); reset() restarts L at 0
    orig = h.check

    def check() -> None:
        orig()
        marks.append((h.resets, h.cache.watermark))

    h.check = check  # type: ignore[method-assign]
    h.run(250)
    assert all(a <= b for a, b in zip(marks, marks[1:], strict=False))
    assert marks[-1][1] > 0


# ====================================================================== policy oracles
def _oracle_key(name: str, knobs: dict[str, Any]) -> Any:
    thr = knobs.get("threshold", 0)
    nps = knobs.get("next_prompt_estimate", 0)
    pt = knobs.get("protected_threshold", 2)
    keys = {
        "lru": lambda s: (s["t"],),
        "lfu": lambda s: (s["hits"], s["t"]),
        "slru": lambda s: (1 if s["hits"] >= pt else 0, s["t"]),
        "priority": lambda s: (s["prio"], s["t"]),
        "tlru": lambda s: (-1 if s["start"] >= max(s["history"] + nps - thr, 0) else 0, s["t"]),
        "joint_lru": lambda s: (s["t"],),
        "gds": lambda s: (s["t"],),  # KV leaves follow lru under gds
        "gdsf": lambda s: (s["t"],),  # ... and under its variants
        "gds_adaptive": lambda s: (s["t"],),
        "unified": lambda s: (s["t"],),  # without states: lru on KV leaves, as gds
        "fifo": lambda s: (s["created"],),
        "mru": lambda s: (-s["t"],),
        "filo": lambda s: (-s["created"],),
    }
    if name not in keys:
        pytest.fail(f"policy {name!r} is registered but this test has no oracle for it")
    return keys[name]


_KNOBS: dict[str, dict[str, Any]] = {
    "tlru": {"threshold": 5, "next_prompt_estimate": 1},
    "slru": {"protected_threshold": 3},
}


def _leaf_snapshot(cache: RadixCache) -> list[dict[str, Any]]:
    out = []
    for n in _nodes(cache):
        if not n.children and n.kv_lock == 0:
            out.append(
                dict(id=n.id, t=n.last_access_time, hits=n.hit_count, prio=n.priority,
                     created=n.creation_time, history=n.history_len, start=n.depth - len(n.key))
            )
    return out


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("policy", sorted(POLICY_REGISTRY))
def test_policy_victims_match_brute_force_oracle(policy: str, page_size: int) -> None:
    rng = random.Random(sum(map(ord, policy)) * 10 + page_size)
    knobs = _KNOBS.get(policy, {})
    key_fn = _oracle_key(policy, knobs)
    kv = TokenAllocator(60) if page_size == 1 else PagedAllocator(60, page_size)
    cache = RadixCache(
        CacheConfig(page_size=page_size, radix_eviction_policy=policy,
                    radix_eviction_policy_config=knobs or None),
        kv_allocator=kv,
    )
    keys: list[list[int]] = []
    locks: list[Any] = []
    victims_checked = 0
    for _step in range(300):
        r = rng.random()
        if r < 0.45:
            toks = draw_tokens(rng, keys, min_cut=0, grow=(1, 5), fresh=(1, 8))
            n = -(-len(toks) // page_size) * page_size
            if kv.available_size() < n:
                continue
            fresh = kv.alloc(n)
            assert fresh is not None
            res = cache.insert(toks, fresh[: len(toks)], rid=rng.randint(0, 4),
                               priority=rng.randint(0, 3))
            free_leftovers(kv, res, fresh, len(toks))
        elif r < 0.65 and keys:
            m = cache.match_prefix(rng.choice(keys)[: rng.randint(0, 8)])
            if rng.random() < 0.3 and m.last_device_node is not cache.root:
                cache.inc_lock_ref(m.last_device_node)
                locks.append(m.last_device_node)
        elif r < 0.72 and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            for _ in range(rng.randint(1, 4)):
                snap = _leaf_snapshot(cache)
                before = {n.id for n in _nodes(cache)}
                res_e = cache.evict(1)
                cache.sanity_check()
                gone = before - {n.id for n in _nodes(cache)}
                if not snap:
                    assert res_e.num_tokens == 0 and not gone
                    break
                keyed = sorted((key_fn(s), s["id"]) for s in snap)
                # Equal keys (one walk stamps both halves of a node it splits) may go either way.
                first = {nid for k, nid in keyed if k == keyed[0][0]}
                assert len(gone) == 1 and gone <= first, (
                    f"{policy}: evicted {gone}, oracle says one of {first}; candidates {keyed}"
                )
                victims_checked += 1
        cache.sanity_check()
    assert victims_checked >= 20


# ====================================================================== hypothesis
class CacheMachine(RuleBasedStateMachine):
    """Hypothesis picks the operation sequence (and shrinks a failure); each rule's argument
    seeds the key and size choices, the model check runs after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(0, 2, hybrid=True, policy="gds", knobs={"d": 1.0, "e": 1.0},
                         kv_size=24, states=4)

    def _run(self, op: Any, seed: int) -> None:
        self.h.rng.seed(seed)
        op()

    @rule(seed=st.integers(0, 2**16))
    def insert(self, seed: int) -> None:
        self._run(self.h.op_insert, seed)

    @rule(seed=st.integers(0, 2**16))
    def match(self, seed: int) -> None:
        self._run(self.h.op_match, seed)

    @rule(seed=st.integers(0, 2**16))
    def unlock(self, seed: int) -> None:
        self._run(self.h.op_unlock, seed)

    @rule(seed=st.integers(0, 2**16))
    def evict(self, seed: int) -> None:
        self._run(self.h.op_evict, seed)

    @rule(seed=st.integers(0, 2**16))
    def evict_states(self, seed: int) -> None:
        self._run(self.h.op_evict_states, seed)

    @rule(seed=st.integers(0, 2**16))
    def hold_or_release(self, seed: int) -> None:
        self._run(self.h.op_hold if seed % 2 else self.h.op_release, seed)

    @invariant()
    def agrees_with_model(self) -> None:
        self.h.check()


CacheMachine.TestCase.settings = settings(
    max_examples=12, stateful_step_count=30, derandomize=True, deadline=None,
    suppress_health_check=list(HealthCheck),
)
test_cache_state_machine = CacheMachine.TestCase
