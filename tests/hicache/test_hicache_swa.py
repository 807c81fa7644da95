"""HiCache with a sliding-window component: the host SWA pool, load-back and host eviction.

A cache over an ``SWAAllocator`` (full pool 32 tokens, SWA pool 16, both with real K / V
tensors), window 4, and optionally a state pool. The host tier mirrors the three device pools
(``hicache.pools``: ``kv``, ``swa``, ``state``). What is checked, by hand:

* a backed-up live node's SWA KV goes to the host SWA pool, a tombstone's does not (there is
  nothing a later match could use); demoted, the node is live on host exactly when it has that
  copy, and a load-back brings back full KV, SWA KV and the state into *different* slots,
  every bit equal (random bit patterns: NaN payloads, infinities, -0.0);
* a tombstone comes back a tombstone (full slots without SWA slots);
* the host hit ends where the window rule, counting host copies, allows;
* load-back allocates the full side, the SWA side and the state at once: failing the k-th
  ``alloc`` (and every later one) leaves every pool's snapshot (free-list order and the
  full-to-SWA map included), every node and every counter as before;
* host eviction frees host SWA slots with the node's host KV;
* ``write_back``: a state that ``evict_states`` drops from an internal node is backed up first
  (its host copy holds exactly its value).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from allocators import SWAAllocator, TokenAllocator
from components.base import Component
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import bits, node_slots
from tests.helpers.swa_hicache import SWAHostRig
from tests.hicache.test_hicache_common import (
    FailAllocs,
    assert_same,
    make,
    node_at,
    put,
    read_state,
    write_state,
)

W = 4  # the sliding window [tokens]
KEY = list(range(1, 17))


class SWAH(SWAHostRig):
    """One SWA cache with a host tier and every pool around it."""

    def __init__(self, page_size: int = 1, states: int = 0, policy: str = "write_through") -> None:
        super().__init__(32, 16, page_size, W, dim=2, states=states, state_dims=((2,), (2, 2)),
                         policy=policy)

    def pools(self) -> dict[str, Any]:
        """Every allocator a load-back or a backup takes from, by name."""
        out = {"device full": self.kv.full_side, "device swa": self.kv.swa_side,
               "host kv": self.hc.pools["kv"].host, "host swa": self.hc.pools["swa"].host}
        if self.sp is not None:
            out["device state"] = self.sp
            out["host state"] = self.hc.pools["state"].host
        return out

    def insert_chain(self) -> tuple[Any, Any]:
        """Insert P = ``KEY[:8]`` and below it Q = ``KEY`` (fresh KV, states when the rig has
        a state pool); returns (P, Q)."""
        self.insert(KEY[:8])
        p = node_at(self.cache, KEY[:8])
        self.insert(KEY, prefix=self.cache.match_prefix(KEY[:8]).device_indices)
        return p, node_at(self.cache, KEY)

    def snapshot(self) -> dict[str, Any]:
        c = self.cache
        out = {name: a.snapshot() for name, a in self.pools().items()}
        out["swa allocator"] = self.kv.snapshot()
        out["pretty"] = c.pretty_print()
        out["stats"] = c.stats()
        out["sizes"] = (c.evictable_size(), c.protected_size(), c.swa_evictable_size(),
                        c.swa_protected_size(), c.host_size(), c.host_evictable_size())
        out["controller"] = (self.hc.backup_tokens, self.hc.load_tokens, self.hc.num_inflight)
        return out


def demote_all(h: SWAH) -> None:
    """Evict every device node (each is backed up: write-through): all host-only."""
    h.cache.evict(32)
    h.cache.sanity_check()
    assert all(n.kv_value is None for n in h.cache.tree.iter_nodes())


# ======================================================================== round trips
@pytest.mark.parametrize("page_size,states", [(1, 0), (1, 4), (4, 0), (4, 4)])
def test_kv_swa_kv_and_state_round_trip_bit_exact_into_different_slots(page_size: int,
                                                                       states: int) -> None:
    h = SWAH(page_size, states)
    c, kv = h.cache, h.kv
    fresh, fk, sk, st = h.insert(KEY[:8])
    node = node_at(c, KEY[:8])
    assert node.host_value is not None and node.host_swa_value is not None
    host_swa = h.hc.pools["swa"].host.pool
    assert torch.equal(bits(host_swa.k_all[:, node.host_swa_value]), bits(sk))  # the backup
    old_swa = kv.translate(fresh)
    demote_all(h)
    assert not node.swa_tombstone  # live on host: its SWA KV has a host copy
    taken = kv.alloc(4)  # the free lists move on: the load lands in other slots
    assert taken is not None
    m = c.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 8, node)
    assert c.load_back(node) == 8
    c.sanity_check()
    m = c.match_prefix(KEY[:8])
    assert m.prefix_len == 8
    new = m.device_indices
    new_swa = kv.translate(new)
    assert not set(new.tolist()) & set(taken.tolist())
    assert bool(kv.has_swa(new).all()) and set(new_swa.tolist()) != set(old_swa.tolist())
    assert torch.equal(bits(h.full.k_all[:, new]), bits(fk))
    assert torch.equal(bits(h.full.v_all[:, new]), bits(-fk))
    assert torch.equal(bits(h.swa.k_all[:, new_swa]), bits(sk))
    assert torch.equal(bits(h.swa.v_all[:, new_swa]), bits(-sk))
    if states:
        assert h.sp is not None and m.state_slot is not None and st is not None
        assert torch.equal(bits(h.sp.conv[:, m.state_slot]), bits(st))


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_tombstone_is_not_backed_up_and_comes_back_a_tombstone(page_size: int) -> None:
    h = SWAH(page_size)
    c, kv = h.cache, h.kv
    h.insert(KEY[:8], tombstone=4)  # [0, 4) out of the window: a tombstone, [4, 8) live
    a, b = node_at(c, KEY[:4]), node_at(c, KEY[:8])
    assert (a.swa_tombstone, b.swa_tombstone) == (True, False)
    assert a.host_value is not None and a.host_swa_value is None  # nothing usable to copy
    assert b.host_swa_value is not None and h.hc.pools["swa"].host.used_size() == 4
    demote_all(h)
    assert (a.swa_tombstone, b.swa_tombstone) == (True, False)
    m = c.match_prefix(KEY[:8])
    assert (m.host_hit_length, m.last_host_node) == (8, b)  # B's 4 live tokens fill the window
    assert c.load_back(b) == 8
    c.sanity_check()
    assert (a.swa_tombstone, b.swa_tombstone) == (True, False)
    assert not bool(kv.has_swa(node_slots(a)).any()) and bool(kv.has_swa(node_slots(b)).all())
    assert kv.swa_used_size() == 4  # only B's window took SWA slots
    assert c.match_prefix(KEY[:8]).prefix_len == 8


def test_the_host_hit_ends_where_the_window_rule_counting_host_copies_allows() -> None:
    h = SWAH(1)
    c = h.cache
    h.insert(KEY[:4])  # A [0, 4) live
    pa = c.match_prefix(KEY[:4]).device_indices
    h.insert(KEY[:8], prefix=pa, tombstone=2)  # B [4, 6) a tombstone, C [6, 8) live
    a, b, cc = node_at(c, KEY[:4]), node_at(c, KEY[:6]), node_at(c, KEY[:8])
    assert (a.swa_tombstone, b.swa_tombstone, cc.swa_tombstone) == (False, True, False)
    assert b.host_swa_value is None and cc.host_swa_value is not None
    assert c.match_prefix(KEY[:8]).prefix_len == 4  # on device: C's 2 live tokens < W
    demote_all(h)
    m = c.match_prefix(KEY[:8])
    assert (m.prefix_len, m.host_hit_length, m.last_host_node) == (0, 4, a)  # the same on host


# ======================================================================== faults
def chain_with_everything(page_size: int) -> tuple[SWAH, Any]:
    """P [0, 8) on device; Q [8, 16) host-only with host SWA KV and a host state. The step:
    ``load_back(Q)``: device full slots, SWA slots and a state slot."""
    h = SWAH(page_size, states=4)
    c = h.cache
    p, q = h.insert_chain()
    c.inc_lock_ref(p)
    assert c.evict(8).num_tokens == 8
    c.dec_lock_ref(c.inc_lock_ref(p))
    return h, (p, q)


def load_back_allocs(build: Callable[[], tuple[SWAH, Any]]) -> list[str]:
    """The pools (``SWAH.pools`` names) a load-back of ``build()``'s node allocates from, in
    order; that load-back brings all 8 tokens and leaves the cache consistent."""
    h, q = build()
    with FailAllocs(h.pools()) as f:
        assert h.cache.load_back(q) == 8
    h.cache.sanity_check()
    return f.names


def failed_load_backs(build: Callable[[], tuple[SWAH, Any]],
                      n: int) -> Iterator[tuple[SWAH, Any, dict[str, Any]]]:
    """For k = 1..``n``: a fresh ``build()`` whose node's load-back fails from its k-th
    allocation on (``FailAllocs`` mode ``"from"``), so loads nothing and leaves the cache
    consistent; yields (the rig, the node, the rig's snapshot before the load-back)."""
    for k in range(1, n + 1):
        h, q = build()
        before = h.snapshot()
        with FailAllocs(h.pools(), k, "from") as f:
            assert h.cache.load_back(q) == 0
        assert f.calls[k - 1][2]
        h.cache.sanity_check()
        yield h, q, before


@pytest.mark.parametrize("page_size", [1, 4])
def test_load_back_failing_at_any_pool_leaves_every_pool_as_before(page_size: int) -> None:
    def build() -> tuple[SWAH, Any]:
        h = SWAH(page_size, states=4)
        c = h.cache
        p, q = h.insert_chain()
        lock = c.inc_lock_ref(p)
        assert c.evict(8).num_tokens == 8
        c.dec_lock_ref(lock)
        # the device is full: a load-back must evict first, so every pool is asked
        filler = h.kv.alloc(h.kv.available_size())
        assert filler is not None and q.kv_value is None and q.host_swa_value is not None
        c.sanity_check()
        return h, q

    names = load_back_allocs(build)
    assert set(names) == {"device full", "device swa", "device state"}
    for h, q, before in failed_load_backs(build, len(names)):
        after = h.snapshot()
        # what the eviction freed to make room stays freed; nothing else moved
        for key in ("host kv", "host swa", "host state", "controller"):
            assert before[key] == after[key], key
        assert q.kv_value is None and q.host_swa_value is not None
        assert h.cache.load_back(q) == 8  # faults gone: the same chain loads
        h.cache.sanity_check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_load_back_that_cannot_get_some_pool_changes_nothing(page_size: int) -> None:
    """Room on device: no eviction runs, so a failure at any pool's ``alloc`` must leave
    every snapshot, node and counter exactly as it was."""
    def build() -> tuple[SWAH, Any]:
        h = SWAH(page_size, states=4)
        c = h.cache
        h.insert(KEY[:8])
        demote_all(h)
        q = node_at(c, KEY[:8])
        return h, q

    names = load_back_allocs(build)
    assert names == ["device full", "device state", "device swa"]  # component order
    for h, _, before in failed_load_backs(build, len(names)):
        assert_same(before, h.snapshot())


# ======================================================================== host eviction
def test_host_eviction_frees_the_host_swa_slots_with_the_host_kv() -> None:
    h = SWAH(1)
    c = h.cache
    h.insert(KEY[:8])
    demote_all(h)
    host_swa = h.hc.pools["swa"].host
    assert host_swa.used_size() == 8
    assert c.evict_host(8) == 8
    c.sanity_check()
    assert host_swa.used_size() == 0 and c.host_size() == 0 and c.tree.num_nodes == 0


# ======================================================================== write_back
def test_write_back_backs_up_a_state_evict_states_drops_from_an_internal_node() -> None:
    h = make(states=4, policy="write_back")
    c = h.cache
    assert h.sp is not None and h.host_state is not None
    put(h, KEY[:4])
    p = node_at(c, KEY[:4])
    assert p.state_slot is not None
    write_state(h.sp, p.state_slot, 1234)
    put(h, KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    assert p.children and p.host_value is None  # write_back: nothing on host yet
    res = c.evict_states(1)
    assert res.num_states == 1 and p.state_slot is None  # P's state was the oldest
    c.poll_transfers()
    c.sanity_check()
    assert p.host_state_slot is not None and p.host_value is not None
    assert read_state(h.host_state, p.host_state_slot) == 1234
    m = c.match_prefix(KEY[:4])
    assert (m.host_hit_length, m.last_host_node) == (4, p)
    c.load_back(p)  # the state alone comes back
    assert p.state_slot is not None and read_state(h.sp, p.state_slot) == 1234
    c.sanity_check()


# ======================================================================== bad components
class BacksUpOnly(Component):
    """Has host copies (``host_pool``, ``backup``) but cannot restore them."""

    name = "half"

    def host_pool(self, config: Any) -> tuple[Any, Any]:
        raise AssertionError("never asked: the cache is refused first")

    def backup_size(self, node: Any) -> int:
        return 0


class ClaimsTokens(Component):
    name = "tokens_too"
    evict_field = "num_tokens"

    def pop_victim(self) -> Any:
        return None


@pytest.mark.parametrize("hicache", [None, HiCacheConfig()])
def test_a_component_with_partial_tier_hooks_is_refused_naming_it(hicache: Any) -> None:
    kv = TokenAllocator(8)
    with pytest.raises(ValueError, match=r"component 'half' implements the tier hooks .*restore"):
        RadixCache(kv_allocator=kv, hicache=hicache, components=[BacksUpOnly()])
    assert kv.available_size() == 8


def test_two_components_claiming_one_evict_field_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"'kv' and 'tokens_too' both claim .*'num_tokens'"):
        RadixCache(kv_allocator=TokenAllocator(8), components=[ClaimsTokens()])


def test_l3_storage_with_a_sliding_window_stores_the_windows_swa_kv_at_page_ends(
        tmp_path: Any) -> None:
    """No longer refused: the SWA component is an L3 end component whose sections cover the
    window (``tests/hicache/test_hicache_swa_l3.py`` takes it through L3)."""
    kv = SWAAllocator(16, 8, 1)
    cfg = HiCacheConfig(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    cache = RadixCache(CacheConfig(sliding_window_size=4), kv_allocator=kv, hicache=cfg)
    st = cache.storage
    assert st is not None and st.tag.endswith(";swa=none,last=4")  # index-only: no bytes
    assert st.end_record_bytes == (0, 0)
    cache.close_storage()


def test_the_sglang_front_end_takes_swa_with_hicache() -> None:
    """``UnifiedRadixCache`` over an SWA allocator with a host tier: a prompt evicted from
    device is a host hit, ``init_load_back`` brings it back, and it matches on device."""
    from radix.sglang import (
        CacheInitParams,
        InitLoadBackParams,
        MatchPrefixParams,
        ReqToTokenPool,
        UnifiedRadixCache,
    )
    from radix.sglang import RadixKey as SKey

    alloc = SWAAllocator(64, 32)
    tree = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=ReqToTokenPool(4, 64), token_to_kv_pool_allocator=alloc,
        page_size=1, sliding_window_size=4,
        hicache=HiCacheConfig(hicache_ratio=2.0, load_back_threshold=1)))
    toks = list(range(1, 9))
    value = alloc.alloc(8)
    assert value is not None
    tree.insert(SKey(toks), value)
    tree.evict(full_num_tokens=8)
    assert alloc.full_available_size() == 64 and alloc.swa_available_size() == 32
    m = tree.match_prefix(MatchPrefixParams(key=SKey(toks)))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 8)
    got = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                 host_hit_length=m.host_hit_length))
    assert got is not None and got[0] == 8
    m = tree.match_prefix(MatchPrefixParams(key=SKey(toks)))
    assert m.device_prefix_len == 8 and bool(alloc.has_swa(m.device_indices).all())
    tree.sanity_check()


def test_evict_component_is_each_components_own_eviction_by_name() -> None:
    h = SWAH(1, states=4)
    c = h.cache
    h.insert(KEY[:4])
    h.insert(KEY[:8], prefix=c.match_prefix(KEY[:4]).device_indices)
    p = node_at(c, KEY[:4])
    res = c.evict_component("state", 1)  # the oldest state: P's, an internal node
    assert res.num_states == 1 and p.state_slot is None and p.kv_value is not None
    res = c.evict_component("swa", 4)  # P (least recently used) becomes a tombstone
    assert res.num_swa_tokens == 4 and p.swa_tombstone
    assert c.evict_component("kv", 4).num_tokens == 4  # the leaf leaves (demoted)
    c.sanity_check()
    with pytest.raises(ValueError, match="no component 'cross'"):
        c.evict_component("cross", 1)
    with pytest.raises(ValueError, match="component 'host' of this cache has no eviction walk|"
                                         "no component 'host'"):
        c.evict_component("host", 1)


# ======================================================================== random steps
def _sig(tokens: list[int]) -> list[float]:
    """A value per position that depends on the whole prefix (exact in float32)."""
    h, out = 17, []
    for t in tokens:
        h = (h * 1_000_003 + t + 7) % 8_388_593
        out.append(float(h))
    return out


def _check_contents(h: SWAH) -> None:
    """Every device and host copy in the tree (full KV, SWA KV, states) holds its prefix's
    values exactly."""
    c, kv = h.cache, h.kv
    host_kv = h.hc.pools["kv"].host.pool
    host_swa = h.hc.pools["swa"].host.pool
    host_st = h.hc.pools["state"].host if h.sp is not None else None
    stack = [(n, []) for n in c.root.children.values()]
    while stack:
        n, above = stack.pop()
        path = above + [int(x) for x in n.key]
        want = torch.tensor(_sig(path)[n.start:])
        if n.kv_value is not None:
            slots = node_slots(n)
            assert torch.equal(h.full.k_all[0, slots, 0, 0], want), f"device KV of {n}"
            if not n.swa_tombstone:
                assert torch.equal(h.swa.k_all[0, kv.translate(slots), 0, 0], want), n
        if n.host_value is not None:
            assert torch.equal(host_kv.k_all[0, n.host_value, 0, 0], want), f"host KV of {n}"
        if n.host_swa_value is not None:
            assert torch.equal(host_swa.k_all[0, n.host_swa_value, 0, 0], want), f"host SWA {n}"
        end = _sig(path)[-1]
        if n.state_slot is not None:
            assert h.sp is not None and float(h.sp.conv[0, n.state_slot, 0]) == end, n
        if n.host_state_slot is not None:
            assert host_st is not None and float(host_st.conv[0, n.host_state_slot, 0]) == end, n
        stack.extend((ch, path) for ch in n.children.values())


def request_step(h: SWAHostRig, rng: random.Random, key: list[int], ps: int) -> None:
    """One request of the random tests: match (load back 70 % of host hits), lock, allocate
    whole pages (evicting), write the prefix's values, free a random part past the window,
    insert with a state, free what the insert did not keep."""
    c, kv = h.cache, h.kv
    m = c.match_prefix(key)
    if m.host_hit_length and rng.random() < 0.7:
        c.load_back(m.last_host_node)
        m = c.match_prefix(key)
    need = len(key) - m.prefix_len
    lock = c.inc_lock_ref(m.last_device_node)
    pages = -(-need // ps) * ps
    if need == 0 or kv.available_size() < pages:
        c.evict(pages)
        c.evict_swa(max(pages - kv.swa_available_size(), 0))
    fresh = kv.alloc(pages) if pages else torch.empty(0, dtype=torch.int64)
    slot = h.sp.alloc(1) if h.sp is not None else None
    if fresh is None or slot is None:
        if fresh is not None and pages:
            kv.free(fresh)
        if slot is not None:
            h.sp.free(slot)  # type: ignore[union-attr]
        c.dec_lock_ref(lock)
        return
    mine = fresh[:need]
    vals = torch.tensor(_sig(key)[m.prefix_len:])
    h.full.k_all[:, mine] = vals[None, :, None, None]
    h.swa.k_all[:, kv.translate(mine)] = vals[None, :, None, None]
    dead = rng.randrange(0, need + 1) if need > W else 0
    dead -= dead % ps
    if dead:
        kv.free_swa(mine[:dead])  # out of the request's window
    s = int(slot[0])
    h.sp.conv[:, s] = _sig(key)[-1]  # type: ignore[union-attr]
    res = c.insert(key, torch.cat([m.device_indices, mine]), state_slot=s)
    if len(res.duplicate_indices):
        kv.free(res.duplicate_indices)
    rest = torch.cat([res.remainder_indices, fresh[need:]])
    if len(rest):
        kv.free(rest)
    if not res.state_adopted:
        h.sp.free(torch.tensor([s]))  # type: ignore[union-attr]
    c.dec_lock_ref(lock)


def random_step(h: SWAHostRig, rng: random.Random, op: float, key: Callable[[], list[int]],
                ps: int) -> None:
    """One step of the random tests, chosen by ``op`` in [0, 1): a request
    (:func:`request_step` on ``key()``), an eviction of each kind, or a poll of the copies;
    then ``sanity_check`` and every copy's contents."""
    c = h.cache
    if op < 0.45:
        request_step(h, rng, key(), ps)
    elif op < 0.6:
        c.evict(rng.randrange(1, 12))
    elif op < 0.7:
        c.evict_swa(rng.randrange(1, 8))
    elif op < 0.8:
        c.evict_states(1)
    elif op < 0.9:
        c.evict_host(rng.randrange(1, 12))
    else:
        c.poll_transfers()
    c.sanity_check()
    _check_contents(h)


@pytest.mark.parametrize("seed,policy", [(s, p) for s in range(12)
                                         for p in ("write_through", "write_back")])
def test_random_steps_keep_every_copy_exact_and_every_invariant(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    h = SWAH(1, states=4, policy=policy)
    keys = [[rng.randrange(1, 4) for _ in range(rng.randrange(4, 13))] for _ in range(12)]
    for _ in range(200):
        op = rng.random()
        key = rng.choice(keys)
        random_step(h, rng, op, key.copy, 1)


def test_an_internal_victim_whose_children_leave_while_it_is_saved_is_evicted_as_a_leaf() -> None:
    # write_back: P [0, 4) live, backed up (its state written back by evict_states, then a
    # new device state); Q [4, 8) a tombstone without state; R [8, 12) live with a state.
    # evict_swa pops R: its chain's backup copies Q (in flight) but finds no host room for R,
    # so R leaves; then P, internal: saving it first lands Q's copy, and Q, a tombstone leaf
    # now, leaves too. P must then be evicted as the leaf it has become (demoted: it has a
    # host copy), not tombstoned in place as an internal node: that left an unlocked
    # tombstone leaf (a dead leaf) in the tree.
    h = SWAH(1, states=4, policy="write_back")
    c = h.cache
    h.insert(KEY[:4])
    p = node_at(c, KEY[:4])
    h.insert(KEY[:12], prefix=c.match_prefix(KEY[:4]).device_indices, tombstone=4)
    q, r = node_at(c, KEY[:8]), node_at(c, KEY[:12])
    assert (q.swa_tombstone, q.state_slot, r.swa_tombstone) == (True, None, False)
    assert c.evict_states(1).num_states == 1  # P's state: P backed up first (write_back)
    assert p.host_value is not None and p.state_slot is None and p.host_state_slot is not None
    h.insert(KEY[:4], prefix=node_slots(p))  # a device state at P again
    assert p.state_slot is not None
    with FailAllocs(h.pools(), 2, "from") as f:  # host room for Q's copy only
        r_ = c.evict_swa(8)
    assert [n for n, _, failed in f.calls if not failed] == ["host kv"]  # Q's
    c.sanity_check()  # actual: "unlocked dead leaf (no state / tombstone)": P
    assert not c.tree.is_attached(q) and not c.tree.is_attached(r)
    assert p.kv_value is None and p.host_value is not None and not p.swa_tombstone  # demoted
    assert r_.num_swa_tokens == 8  # R's 4 and P's 4 live SWA tokens
    m = c.match_prefix(KEY[:4])
    assert (m.host_hit_length, m.last_host_node) == (4, p)  # still served from the host


def test_an_internal_victim_demoted_while_it_is_saved_is_not_evicted_again() -> None:
    # write_back: X [0, 8) is a write-back victim, its copy in flight; a match splits it into
    # P [0, 4) and X [4, 8), both in the copy's span. evict_swa pops P (internal, live):
    # saving it first lands the copy, which demotes X and then P (the span, deepest first).
    # P is host-only now: nothing is left to tombstone (actual: an AssertionError from the
    # tombstone, the eviction half done).
    h = SWAH(1, policy="write_back")
    c = h.cache
    h.insert(KEY[:8])
    h.hc.hold_completions = True
    assert c.evict(8).num_tokens == 0  # in flight: freed when it lands
    c.match_prefix(KEY[:4])  # splits the in-flight node
    p, x = node_at(c, KEY[:4]), node_at(c, KEY[:8])
    assert (p.kv_lock, x.kv_lock, p.host_value is not None) == (1, 1, True)
    h.hc.hold_completions = False
    h.hc.release_held()
    r = c.evict_swa(1)
    c.sanity_check()
    assert (p.kv_value, x.kv_value) == (None, None)  # both demoted by the landing copy
    assert r.num_swa_tokens == 8 and h.kv.swa_used_size() == 0
    m = c.match_prefix(KEY[:8])
    assert (m.host_hit_length, m.last_host_node) == (8, x)
