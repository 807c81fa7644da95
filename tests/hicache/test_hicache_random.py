"""Seeded random operations on a cache with a host tier, for every write policy, KV-only and
hybrid, pages of 1 and 4 tokens.

Operations: insert (engine style: match, maybe load back, lock, allocate, insert, free what
the result leaves to the caller), match + lock, unlock, evict, evict_states, evict_host,
load_back, poll (with copies held in flight for a while), and the caller holding device
memory of its own. After every step:

* ``sanity_check()``;
* per-pool accounting: device KV free + tree device tokens + caller-held == capacity; host KV
  free + ``host_size()`` == host capacity; likewise for device and host states;
* contents: every slot the tree holds, on device or on host, KV or state, holds the value of
  its own prefix (``sig``), so every copy (backup, load back, revival) moved the right data.

``load_back`` is checked against the match it serves: a chain below ``load_back_threshold``
is never loaded; a loaded chain makes the next match usable up to ``last_host_node``
(``prefix_len + host_hit_length``), KV-only: exactly ``host_hit_length`` tokens were loaded.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from radix.node import TreeNode
from tests.helpers.cache_helpers import draw_key, free_leftovers
from tests.hicache.test_hicache_common import (
    HC,
    check_accounting,
    check_contents,
    make,
    read_kv,
    read_state,
    sig,
    write_kv,
    write_state,
)

POLICIES = ("write_through", "write_through_selective", "write_back")


class Harness:
    def __init__(self, seed: int, policy: str, hybrid: bool, page_size: int,
                 ratio: float = 1.5, threshold: int = 3, hold: bool = True,
                 eviction: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.hold = hold
        self.ps = page_size
        self.hybrid = hybrid
        self.threshold = threshold
        self.h: HC = make(page_size=page_size, size=32, states=6 if hybrid else 0, policy=policy,
                          ratio=ratio, threshold=threshold, eviction=eviction, layers=1, heads=1,
                          head_dim=1)
        self.c = self.h.cache
        self.keys: list[tuple[list[int], Any]] = []
        self.locks: list[TreeNode] = []
        self.held_kv: list[torch.Tensor] = []
        self.held_states: list[int] = []
        self.loaded = 0

    # ------------------------------------------------------------------ helpers
    def gen_key(self) -> tuple[list[int], Any]:
        return draw_key(self.rng, self.keys, recent=10, grow=(0, 6), fresh=(1, 12), cap=14,
                        extras=[None, None, "a"])

    def match(self, toks: list[int], extra: Any) -> Any:
        m = self.c.match_prefix(toks, extra)
        want = sig(extra, toks)
        assert read_kv(self.h.kv.pool, m.device_indices) == want[:m.prefix_len]
        if m.state_slot is not None:
            assert read_state(self.h.sp, m.state_slot) == want[m.prefix_len - 1]  # type: ignore[arg-type]
        if self.hybrid and m.prefix_len:
            assert m.state_slot is not None
        lh = m.last_host_node
        assert lh is not None
        if m.host_hit_length == 0:
            assert lh is m.last_device_node
        else:
            assert lh.depth == m.prefix_len + m.host_hit_length <= m.kv_hit_length
        return m

    def ensure_kv(self, n: int) -> torch.Tensor | None:
        kv = self.h.kv
        if kv.available_size() < n:
            self.c.evict(n - kv.available_size())
        return kv.alloc(n)

    def ensure_state(self) -> int | None:
        sp = self.h.sp
        assert sp is not None
        if sp.available_size() < 1:
            self.c.evict_states(1)
        got = sp.alloc(1)
        return None if got is None else int(got[0])

    def load_back(self, m: Any, toks: list[int], extra: Any) -> Any:
        """Load back what ``m`` found on host; check the outcome; return the new match."""
        if m.host_hit_length == 0:
            return m
        before = self.c.stats()["load_back_tokens"]
        t = self.c.load_back(m.last_host_node)
        assert self.c.stats()["load_back_tokens"] == before + t
        self.loaded += t
        if m.host_hit_length < self.threshold:
            assert t == 0
        if not self.hybrid:
            assert t in (0, m.host_hit_length)
        m2 = self.match(toks, extra)
        lh = m.last_host_node
        if t or (lh.kv_value is not None and lh.state_slot is not None):  # KV, or a state alone
            assert m2.prefix_len == m.prefix_len + m.host_hit_length
        return m2

    # ------------------------------------------------------------------ operations
    def op_insert(self) -> None:
        rng, c, h = self.rng, self.c, self.h
        toks, extra = self.gen_key()
        if self.hybrid:  # the state is valid at a page end (insert refuses others)
            toks = toks[: len(toks) // self.ps * self.ps]
        m = self.match(toks, extra)
        if rng.random() < 0.5:
            m = self.load_back(m, toks, extra)
        node = m.last_device_node
        c.inc_lock_ref(node)
        prefix = m.prefix_len
        ps = self.ps
        end = len(toks) // ps * ps
        need = len(toks) - prefix
        fresh = self.ensure_kv(-(-need // ps) * ps)
        slot = None
        if fresh is not None and self.hybrid and end > prefix:
            slot = self.ensure_state()
            if slot is None:
                h.kv.free(fresh)
                fresh = None
        if fresh is None:
            c.dec_lock_ref(node)
            return
        want = sig(extra, toks)
        write_kv(h.kv.pool, fresh[:need], want[prefix:])
        if slot is not None:
            write_state(h.sp, slot, want[end - 1])  # type: ignore[arg-type]
        value = torch.cat([m.device_indices, fresh[:need]])
        res = c.insert(toks, value, extra, state_slot=slot)
        assert res.inserted_len == end and res.prefix_len >= prefix
        # Host-only nodes are the tail of the walked path: they take the caller's slots there.
        r = len(res.revived_indices)
        assert res.revived_indices.tolist() == value[res.prefix_len - r:res.prefix_len].tolist()
        assert set(res.revived_indices.tolist()) <= set(fresh.tolist())
        free_leftovers(h.kv, res, fresh, need)
        if slot is not None and not res.state_adopted:
            h.sp.free(torch.tensor([slot], dtype=torch.int64))  # type: ignore[union-attr]
        c.dec_lock_ref(node)

    def op_lock(self) -> None:
        toks, extra = self.gen_key()
        m = self.match(toks, extra)
        if m.last_device_node is not self.c.root:
            self.c.inc_lock_ref(m.last_device_node)
            self.locks.append(m.last_device_node)

    def op_unlock(self) -> None:
        if self.locks:
            self.c.dec_lock_ref(self.locks.pop(self.rng.randrange(len(self.locks))))

    def op_evict(self) -> None:
        r = self.c.evict(self.rng.randint(1, 16))
        assert r.num_tokens >= 0 and r.num_swa_tokens == 0

    def op_evict_states(self) -> None:
        if self.hybrid:
            self.c.evict_states(self.rng.randint(1, 3))

    def op_evict_host(self) -> None:
        c = self.c
        n = self.rng.randint(1, 16)
        size, evictable = c.host_size(), c.host_evictable_size()
        freed = c.evict_host(n)
        assert freed >= min(n, evictable)
        if not self.hybrid:  # hybrid: test_hicache_bugs (a dead device parent's host copy)
            assert freed == size - c.host_size()

    def op_load_back(self) -> None:
        toks, extra = self.gen_key()
        self.load_back(self.match(toks, extra), toks, extra)

    def op_poll(self) -> None:
        hc = self.h.hc
        if self.rng.random() < 0.5:
            hc.release_held()
        hc.hold_completions = self.hold and self.rng.random() < 0.3
        self.c.poll_transfers()

    def op_hold(self) -> None:
        rng = self.rng
        if self.held_kv and rng.random() < 0.5:
            self.h.kv.free(self.held_kv.pop(rng.randrange(len(self.held_kv))))
        elif len(self.held_kv) < 3:
            got = self.ensure_kv(self.ps * rng.randint(1, 4))
            if got is not None:
                self.held_kv.append(got)
        if self.hybrid:
            if self.held_states and rng.random() < 0.5:
                self.h.sp.free(torch.tensor([self.held_states.pop()], dtype=torch.int64))  # type: ignore[union-attr]
            elif len(self.held_states) < 2:
                s = self.ensure_state()
                if s is not None:
                    self.held_states.append(s)

    OPS = (
        ("op_insert", 30), ("op_lock", 8), ("op_unlock", 8), ("op_evict", 8),
        ("op_evict_states", 5), ("op_evict_host", 7), ("op_load_back", 14), ("op_poll", 8),
        ("op_hold", 5),
    )

    def check(self) -> None:
        self.c.sanity_check()
        check_accounting(self.h, sum(len(t) for t in self.held_kv), len(self.held_states))
        check_contents(self.h)

    def run(self, steps: int) -> None:
        names = [n for n, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        for _ in range(steps):
            getattr(self, self.rng.choices(names, weights)[0])()
            self.check()
        self.finish()

    def finish(self) -> None:
        """Land every copy, release every lock and caller slot; then the whole tree can be
        evicted from device and from host, leaving every pool full."""
        c, h = self.c, self.h
        h.hc.release_held()
        h.hc.hold_completions = False
        c.poll_transfers()
        assert h.hc.num_inflight == 0
        while self.locks:
            c.dec_lock_ref(self.locks.pop())
        for t in self.held_kv:
            h.kv.free(t)
        self.held_kv.clear()
        if self.hybrid:
            h.sp.free(torch.tensor(self.held_states, dtype=torch.int64))  # type: ignore[union-attr]
            self.held_states.clear()
        self.check()
        assert c.protected_size() == 0 and c.state_protected_size() == 0
        c.evict(10**6)
        c.poll_transfers()
        self.check()
        assert h.kv.available_size() == h.kv.size
        c.evict_host(10**6)
        self.check()
        assert c.host_size() == 0 and c.tree.num_nodes == 0
        for name, a in h.pools().items():
            assert a.available_size() == a.size, name


CASES = [
    (policy, hybrid, ps)
    for policy in POLICIES
    for hybrid in (False, True)
    for ps in (1, 4)
]


@pytest.mark.parametrize("policy,hybrid,page_size", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations(policy: str, hybrid: bool, page_size: int, seed: int) -> None:
    # Hybrid write_through_selective with copies held in flight trips the library bug pinned
    # by test_hicache_bugs.test_stateless_node_whose_copy_lands_childless_is_pruned (a node
    # backed up without a state loses its children while in flight and stays as an unlocked
    # dead leaf); until it is fixed that one combination runs with copies landing at once.
    hold = not (hybrid and policy == "write_through_selective")
    hz = Harness(seed * 1000 + 7, policy, hybrid, page_size, hold=hold)
    hz.run(300)
    st = hz.c.stats()
    assert st["backup_tokens"] > 0 and st["demoted_tokens"] > 0  # the host tier was exercised
    assert st["host_evicted_tokens"] > 0
    assert st["load_back_tokens"] > 0 or (hybrid and policy == "write_through_selective")


@pytest.mark.parametrize("eviction", ["gds", "joint_lru", "mru", "lfu"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_operations_under_other_eviction_policies(eviction: str, policy: str) -> None:
    # Copies held in flight (the GDS write-back bug is fixed); an evict under write_back
    # now counts copies in flight, so fewer nodes reach host: two seeds, some load-back.
    loaded = 0
    for seed in (31, 32):
        hz = Harness(seed, policy, True, 1, eviction=eviction, hold=True)
        hz.run(200)
        loaded += hz.c.stats()["load_back_tokens"]
    assert loaded > 0
