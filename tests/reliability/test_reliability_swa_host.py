"""Stateful property test of SWA + HiCache: a sliding window and a host tier on one cache.

Hypothesis drives requests and maintenance over a cache with full KV and SWA KV
(``SWAAllocator`` over real pools), optionally recurrent states, and a host tier mirroring
every device pool (page size, window, write policy and states drawn per example). Rules:

* ``request``: match, load back the host part (or not), lock, compute the rest with fresh
  slots, release the SWA KV of some of them as a request whose window slid does (keeping the
  last ``max(window, page)`` tokens live), insert, free what the result leaves the caller;
* ``odd_request``: the same with the SWA KV released anywhere (not only what slid out of a
  window): an insert over host-only nodes must cut them and stop where the window rule says;
* ``match``, ``load_back``, ``pin`` / ``unpin``, every eviction (``evict``, ``evict_swa``,
  ``evict_states``), ``evict_host``, ``poll``.

The reference model is independent of the library's bookkeeping:

* ``seen``: every prefix an insert reported cached (``key[:inserted_len]``); the tree never
  holds a token whose prefix is not in it;
* every device copy (full KV; SWA KV of live nodes), host copy (KV, SWA KV) and state (device
  and host) holds the value of its prefix exactly (``sig``: a value per prefix);
* a match's usable prefix is recomputed from the tree's nodes with the window rule (and, with
  states, a state at the end) and must be what the library answered; the served slots hold
  the key's values and the last ``window`` of them live SWA KV with those values;
* a request whose SWA KV slid out of its window is cached whole and matches whole after;
* the ledger of every pool (device full, device SWA, device states, host KV, host SWA, host
  states): free + held by the tree == capacity between steps;
* ``sanity_check()`` after every rule; at teardown everything evicted, every pool whole.

About 100 examples in a few seconds (``SWA_HOST_EXAMPLES`` to change).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from allocators import KVPool, MambaStatePool, SWAAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import node_slots

KEYS = st.lists(st.integers(1, 3), min_size=1, max_size=12)
SIZE = st.integers(0, 16)
FULL, SWA_SIZE, STATES = 32, 16, 4
#: What the run exercised (checked at the end: each happened at least once).
EVENTS: Counter[str] = Counter()


def sig(tokens: tuple[int, ...]) -> list[float]:
    """A value per position that depends on the whole prefix (exact in float32)."""
    h, out = 17, []
    for t in tokens:
        h = (h * 1_000_003 + t + 7) % 8_388_593
        out.append(float(h))
    return out


class SWAHostMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: RadixCache | None = None
        self.pins: list[tuple[Any, Any]] = []
        self.seen: set[tuple[int, ...]] = set()
        self.keys: list[list[int]] = []  # what inserts cached, for later turns

    @initialize(ps=st.sampled_from([1, 2]), window=st.integers(1, 4),
                policy=st.sampled_from(["write_through", "write_through_selective",
                                        "write_back"]),
                states=st.booleans())
    def build(self, ps: int, window: int, policy: str, states: bool) -> None:
        self.ps, self.window = ps, window
        self.full = KVPool(FULL, 1, 1, 1, torch.float32, "cpu", page_size=ps)
        self.swa = KVPool(SWA_SIZE, 1, 1, 1, torch.float32, "cpu", page_size=ps)
        self.kv = SWAAllocator(FULL, SWA_SIZE, ps, full_pool=self.full, swa_pool=self.swa)
        self.sp = (MambaStatePool(STATES, num_layers=1, conv_state_shape=(1,),
                                  ssm_state_shape=(1,)) if states else None)
        self.cache = RadixCache(
            CacheConfig(page_size=ps, sliding_window_size=window), kv_allocator=self.kv,
            state_allocator=self.sp,
            hicache=HiCacheConfig(hicache_ratio=2.0, hicache_write_policy=policy,
                                  load_back_threshold=1))
        hc = self.cache.hicache
        assert hc is not None
        self.hc = hc

    # ------------------------------------------------------------ helpers
    @property
    def c(self) -> RadixCache:
        assert self.cache is not None
        return self.cache

    def cut(self, key: list[int]) -> list[int]:
        return key[: len(key) - len(key) % self.ps]

    def _request(self, key: list[int], load: bool, dead: int, realistic: bool) -> None:
        c, kv, ps = self.c, self.kv, self.ps
        key = self.cut(key)
        if not key:
            return
        m = c.match_prefix(key)
        EVENTS["request host hit"] += m.host_hit_length > 0
        EVENTS["request"] += 1
        if load and m.host_hit_length:
            c.load_back(m.last_host_node)
            m = c.match_prefix(key)
        lock = c.inc_lock_ref(m.last_device_node)
        try:
            need = len(key) - m.prefix_len
            if need and kv.available_size() < need:
                c.evict(max(need - kv.full_available_size(), 0))
                c.evict_swa(max(need - kv.swa_available_size(), 0))
            fresh = kv.alloc(need) if need else torch.empty(0, dtype=torch.int64)
            slot = None
            if self.sp is not None and fresh is not None:
                got = self.sp.alloc(1)
                if got is None:
                    c.evict_states(1)
                    got = self.sp.alloc(1)
                slot = None if got is None else int(got[0])
                if slot is None:
                    kv.free(fresh)
                    return
            if fresh is None:
                return
            vals = torch.tensor(sig(tuple(key))[m.prefix_len:])
            self.full.k_all[0, fresh, 0, 0] = vals
            self.swa.k_all[0, kv.translate(fresh), 0, 0] = vals
            if realistic:  # what slid out of the window: the last max(window, page) stay live
                dead = min(dead, max(need - max(self.window, ps), 0))
            else:
                dead = min(dead, need)
            dead -= dead % ps
            if dead:
                kv.free_swa(fresh[:dead])
            if slot is not None:
                assert self.sp is not None
                self.sp.conv[0, slot, 0] = sig(tuple(key))[-1]
            value = torch.cat([m.device_indices, fresh])
            over_host = m.host_hit_length > 0
            res = c.insert(key, value, state_slot=slot)
            EVENTS["insert over host-only nodes"] += over_host
            EVENTS["revived"] += len(res.revived_indices) > 0
            EVENTS["stopped above host-only nodes"] += over_host and res.inserted_len < min(
                len(key), m.prefix_len + m.host_hit_length)
            EVENTS["released SWA KV"] += dead > 0
            for spare in (res.duplicate_indices, res.remainder_indices):
                if len(spare):
                    kv.free(spare)
            if slot is not None and not res.state_adopted:
                assert self.sp is not None
                self.sp.free(torch.tensor([slot]))
            for j in range(1, res.inserted_len + 1):
                self.seen.add(tuple(key[:j]))
            if res.inserted_len:
                self.keys.append(key[:res.inserted_len])
            if realistic:  # the window before the end is live: the whole key is cached
                assert res.inserted_len == len(key), (res.prefix_len, res.inserted_len, key)
                c.sanity_check()
                assert self.match_checked(key).prefix_len == len(key), key
        finally:
            c.dec_lock_ref(lock)

    # ------------------------------------------------------------- rules
    @rule(key=KEYS, load=st.booleans(), dead=SIZE)
    def request(self, key: list[int], load: bool, dead: int) -> None:
        self._request(key, load, dead, realistic=True)

    @rule(key=KEYS, load=st.booleans(), dead=SIZE)
    def odd_request(self, key: list[int], load: bool, dead: int) -> None:
        self._request(key, load, dead, realistic=False)

    @precondition(lambda self: bool(self.keys))
    @rule(i=SIZE, cut=SIZE, tail=st.lists(st.integers(1, 3), max_size=4), load=st.booleans(),
          dead=SIZE, realistic=st.booleans())
    def request_again(self, i: int, cut: int, tail: list[int], load: bool, dead: int,
                      realistic: bool) -> None:
        """A later turn: a key inserted before, cut somewhere, with a tail of its own."""
        key = self.keys[i % len(self.keys)]
        self._request(key[:max(len(key) - cut % 4, 1)] + tail, load, dead, realistic)

    @rule()
    def flush(self) -> None:
        """Evict every device node (the backed-up ones stay host-only)."""
        self.c.evict(FULL)
        self.c.poll_transfers()

    @rule(key=KEYS)
    def match(self, key: list[int]) -> None:
        self.match_checked(self.cut(key))

    @rule(key=KEYS)
    def load_back(self, key: list[int]) -> None:
        key = self.cut(key)
        m = self.match_checked(key)
        if m.host_hit_length:
            got = self.c.load_back(m.last_host_node)
            EVENTS["load_back"] += got > 0
            assert got in (0, sum(len(n.key) for n in _host_chain(m.last_host_node))) or got > 0
            after = self.match_checked(key)
            assert after.prefix_len >= m.prefix_len

    @precondition(lambda self: len(self.pins) < 2)
    @rule(key=KEYS)
    def pin(self, key: list[int]) -> None:
        m = self.c.match_prefix(self.cut(key))
        self.pins.append((m.last_device_node, self.c.inc_lock_ref(m.last_device_node)))

    @precondition(lambda self: bool(self.pins))
    @rule(i=SIZE)
    def unpin(self, i: int) -> None:
        _, lock = self.pins.pop(i % len(self.pins))
        self.c.dec_lock_ref(lock)

    @rule(n=SIZE)
    def evict(self, n: int) -> None:
        self.c.evict(n)

    @rule(n=SIZE)
    def evict_swa(self, n: int) -> None:
        self.c.evict_swa(n)

    @precondition(lambda self: self.sp is not None)
    @rule(n=st.integers(0, 3))
    def evict_states(self, n: int) -> None:
        self.c.evict_states(n)

    @rule(n=SIZE)
    def evict_host(self, n: int) -> None:
        self.c.evict_host(n)

    @rule()
    def poll(self) -> None:
        self.c.poll_transfers()

    # ------------------------------------------------------------ checks
    def match_checked(self, key: list[int]) -> Any:
        c = self.c
        want = self.usable_prefix(key)
        m = c.match_prefix(key)
        assert m.prefix_len == want, f"match {key}: library {m.prefix_len}, model {want}"
        EVENTS["match host hit"] += m.host_hit_length > 0
        EVENTS["match"] += 1
        n = m.prefix_len
        vals = sig(tuple(key))
        if n:
            idx = m.device_indices
            assert self.full.k_all[0, idx, 0, 0].tolist() == vals[:n]
            w = idx[max(n - self.window, 0):]
            assert bool(self.kv.has_swa(w).all()), f"window of {key[:n]} not live"
            assert self.swa.k_all[0, self.kv.translate(w), 0, 0].tolist() == vals[n - len(w):n]
        if self.sp is not None and m.state_slot is not None:
            assert float(self.sp.conv[0, m.state_slot, 0]) == vals[n - 1]
        return m

    def usable_prefix(self, key: list[int]) -> int:
        """The model's usable prefix: walk the key through the device nodes (page by page),
        then the window rule (a tombstone before the end needs ``window`` live tokens after
        it) and, with states, a state at the end (a node end holding one)."""
        c, ps = self.c, self.ps
        node, pos = c.root, 0
        ends: list[tuple[int, bool, bool]] = []  # (end, tombstone, state at a node end)
        while pos < len(key):
            page = key[pos:pos + ps]
            child = next((ch for ch in node.children.values()
                          if ch.kv_value is not None and [int(x) for x in ch.key[:ps]] == page),
                         None)
            if child is None:
                break
            k = [int(x) for x in child.key]
            same = 0
            while same < len(k) and pos + same < len(key) and k[same] == key[pos + same]:
                same += 1
            same -= same % ps
            if same == 0:
                break
            whole = same == len(k)
            ends.append((pos + same, child.swa_tombstone,
                         whole and child.state_slot is not None))
            pos += same
            if not whole:
                break
            node = child
        best, run, seen_tomb, start = 0, 0, False, 0
        for end, tomb, state in ends:
            if tomb:
                seen_tomb, run = True, 0
            else:
                for e in range(start + ps, end + 1, ps):  # any page end inside a live node
                    r = run + e - start
                    if (not seen_tomb or r >= self.window) and (self.sp is None or (
                            e == end and state)):
                        best = e
                run += end - start
            start = end
        return best

    @invariant()
    def consistent(self) -> None:
        if self.cache is None:
            return
        c, kv = self.c, self.kv
        c.sanity_check()
        host_kv = self.hc.pools["kv"].host
        host_swa = self.hc.pools["swa"].host
        host_st = self.hc.pools["state"].host if self.sp is not None else None
        dev_tokens = live_tokens = host_tokens = host_swa_tokens = dstates = hstates = 0
        stack = [(n, ()) for n in c.root.children.values()]
        while stack:
            n, above = stack.pop()
            path = above + tuple(int(x) for x in n.key)
            assert path in self.seen, f"the tree holds {path}, never inserted"
            want = torch.tensor(sig(path)[n.start:])
            EVENTS["host-only live node" if n.kv_value is None and not n.swa_tombstone
                   else "device tombstone" if n.swa_tombstone and n.kv_value is not None
                   else "other"] += 1
            if n.kv_value is not None:
                slots = node_slots(n)
                dev_tokens += len(slots)
                assert torch.equal(self.full.k_all[0, slots, 0, 0], want), f"device KV {n}"
                if not n.swa_tombstone:
                    live_tokens += len(slots)
                    assert torch.equal(self.swa.k_all[0, kv.translate(slots), 0, 0], want), n
            if n.host_value is not None:
                host_tokens += len(n.host_value)
                assert torch.equal(host_kv.pool.k_all[0, n.host_value, 0, 0], want), n
            if n.host_swa_value is not None:
                host_swa_tokens += len(n.host_swa_value)
                assert torch.equal(host_swa.pool.k_all[0, n.host_swa_value, 0, 0], want), n
            end = sig(path)[-1]
            if n.state_slot is not None:
                assert self.sp is not None and float(self.sp.conv[0, n.state_slot, 0]) == end
                dstates += 1
            if n.host_state_slot is not None:
                assert host_st is not None
                assert float(host_st.conv[0, n.host_state_slot, 0]) == end, n
                hstates += 1
            stack.extend((ch, path) for ch in n.children.values())
        # the ledger of every pool: free + the tree's == capacity (no request holds any now)
        assert kv.full_available_size() + dev_tokens == FULL
        assert kv.swa_available_size() + live_tokens == SWA_SIZE
        assert host_kv.available_size() + host_tokens == host_kv.size
        assert host_swa.available_size() + host_swa_tokens == host_swa.size
        if self.sp is not None:
            assert host_st is not None
            assert self.sp.available_size() + dstates == STATES
            assert host_st.available_size() + hstates == host_st.size

    def teardown(self) -> None:
        if self.cache is None:
            return
        c = self.c
        for _, lock in self.pins:
            c.dec_lock_ref(lock)
        self.pins.clear()
        c.poll_transfers()
        for _ in range(4):
            c.evict(FULL)
            if self.sp is not None:
                c.evict_states(STATES)
            c.evict_swa(SWA_SIZE)
            c.poll_transfers()
            c.evict_host(10 * FULL)
        c.sanity_check()
        assert c.tree.num_nodes == 0
        assert self.kv.full_available_size() == FULL and self.kv.swa_available_size() == SWA_SIZE
        for pair in self.hc.pools.values():
            assert pair.host.available_size() == pair.host.size


def _host_chain(node: Any) -> list[Any]:
    out = []
    while node.parent is not None and node.kv_value is None:
        out.append(node)
        node = node.parent
    return out


def test_swa_with_a_host_tier_against_the_model() -> None:
    EVENTS.clear()
    run_state_machine_as_test(SWAHostMachine, settings=settings(
        max_examples=int(os.environ.get("SWA_HOST_EXAMPLES", "100")), stateful_step_count=30,
        derandomize=True, database=None, deadline=None, report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck)))
    print("\nexercised: " + ", ".join(f"{k} {v}" for k, v in sorted(EVENTS.items())))
    missing = [k for k in ("insert over host-only nodes", "revived", "stopped above host-only "
                           "nodes", "released SWA KV", "load_back", "host-only live node",
                           "device tombstone") if not EVENTS[k]]
    assert not missing, f"the run never exercised {missing}"
