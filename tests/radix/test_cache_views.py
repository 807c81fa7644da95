"""The facade's public views an engine front end decides frees and copies with
(``RadixCache.has_swa`` / ``has_host_tier`` / ``holds`` / ``device_slots`` / ``path_slots`` /
``swa_kept_mask`` / ``release_swa_slots``) and the host hit lengths of ``MatchResult``
(``swa_host_hit_length``, ``state_host_hit_length``).

Every expected value is computed by hand from the slots the test itself allocated and inserted,
or read from the allocators (free counts, which slots still have SWA slots), never from the
view under test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import MambaStatePool, SWAAllocator, TokenAllocator
from hicache import HiCacheConfig
from radix import CacheConfig, RadixCache
from radix.node import TreeNode

W = 4  # the sliding window [tokens]
KEY = list(range(1, 17))


class SWAH:
    """An SWA cache (full pool 32 tokens, SWA pool 16, window 4, page 1) with a write-through
    host tier, and a state pool when ``states``."""

    def __init__(self, page_size: int = 1, states: int = 0) -> None:
        self.kv = SWAAllocator(32, 16, page_size)
        self.sp = (MambaStatePool(states, num_layers=1, conv_state_shape=(2,),
                                  ssm_state_shape=(2,)) if states else None)
        self.cache = RadixCache(
            CacheConfig(page_size=page_size, sliding_window_size=W), kv_allocator=self.kv,
            state_allocator=self.sp,
            hicache=HiCacheConfig(hicache_ratio=2.0, hicache_write_policy="write_through",
                                  load_back_threshold=1))

    def insert(self, key: list[int], prefix: torch.Tensor | None = None,
               tombstone: int = 0) -> tuple[torch.Tensor]:
        """Insert ``key`` with fresh slots after ``prefix`` (the first ``tombstone`` new
        tokens' SWA KV released before, as a request's out-of-window KV) and, on a hybrid
        cache, a fresh state. Returns ``(fresh slots,)``."""
        prefix = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
        fresh = _take(self.kv, len(key) - len(prefix))
        if tombstone:
            self.kv.free_swa(fresh[:tombstone])
        slot = None
        if self.sp is not None:
            got = self.sp.alloc(1)
            assert got is not None
            slot = int(got[0])
        res = self.cache.insert(key, torch.cat([prefix, fresh]), state_slot=slot)
        assert len(res.duplicate_indices) == 0 and res.state_adopted == (slot is not None)
        self.cache.sanity_check()
        return (fresh,)


def demote_all(h: SWAH) -> None:
    """Evict every device node (each backed up first: write-through): all host-only."""
    h.cache.evict(32)
    h.cache.sanity_check()
    assert all(n.kv_value is None for n in h.cache.tree.iter_nodes())


def node_at(cache: RadixCache, key: list[int]) -> TreeNode:
    """The node whose path from the root spells exactly ``key`` (no match: no stamps, no
    splits)."""
    for n in cache.tree.iter_nodes():
        path = list(reversed(n.path_to_root()))
        tokens = [int(t) for p in path for t in p.key]
        if tokens == key:
            return n
    raise AssertionError(f"no node ends at {key}")


def _plain(size: int = 32) -> tuple[RadixCache, TokenAllocator]:
    alloc = TokenAllocator(size)
    return RadixCache(CacheConfig(), kv_allocator=alloc), alloc


def _take(alloc: TokenAllocator | SWAAllocator, n: int) -> torch.Tensor:
    got = alloc.alloc(n)
    assert got is not None
    return got


# ======================================================================== flags, holds
def test_the_flags_say_which_components_and_tiers_the_cache_has() -> None:
    plain, _ = _plain()
    assert (plain.hybrid, plain.has_swa, plain.has_host_tier) == (False, False, False)
    hybrid = RadixCache(CacheConfig(), kv_allocator=TokenAllocator(8),
                        state_allocator=MambaStatePool(2, num_layers=1, conv_state_shape=(1,),
                                                       ssm_state_shape=(1,)))
    assert (hybrid.hybrid, hybrid.has_swa, hybrid.has_host_tier) == (True, False, False)
    h = SWAH(1, states=2)
    assert (h.cache.hybrid, h.cache.has_swa, h.cache.has_host_tier) == (True, True, True)


def test_holds_answers_for_this_trees_nodes_only() -> None:
    cache, alloc = _plain()
    other, other_alloc = _plain()
    node = cache.insert([1, 2, 3, 4], _take(alloc, 4)).last_node
    foreign = other.insert([1, 2, 3, 4], _take(other_alloc, 4)).last_node
    assert cache.holds(cache.root) and cache.holds(node)
    assert not cache.holds(foreign) and not cache.holds(other.root)
    assert not cache.holds("node") and not cache.holds(None)
    assert cache.evict(4).num_tokens == 4  # the leaf leaves the tree
    assert not cache.holds(node)


# ======================================================================== slots
def test_path_slots_and_device_slots_are_the_slots_inserted_along_the_path() -> None:
    cache, alloc = _plain()
    a, b = _take(alloc, 4), _take(alloc, 4)
    long = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.cat([a, b])).last_node
    c = _take(alloc, 2)
    fork = cache.insert([1, 2, 9, 9], torch.cat([a[:2], c])).last_node  # splits at 2
    assert cache.path_slots(long).tolist() == a.tolist() + b.tolist()
    assert cache.path_slots(fork).tolist() == a[:2].tolist() + c.tolist()
    assert cache.path_slots(cache.root).tolist() == []
    path = list(reversed(long.path_to_root()))
    joined = cache.device_slots([n.kv_value for n in path])
    assert joined.dtype == torch.int64 and joined.tolist() == a.tolist() + b.tolist()
    empty = cache.device_slots([])
    assert empty.dtype == torch.int64 and len(empty) == 0


def test_path_slots_refuses_what_is_not_a_node_of_this_cache() -> None:
    cache, _ = _plain()
    other, other_alloc = _plain()
    foreign = other.insert([1, 2], _take(other_alloc, 2)).last_node
    not_a_node: Any = "node"
    with pytest.raises(TypeError, match="node must be a TreeNode"):
        cache.path_slots(not_a_node)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.path_slots(foreign)


def test_path_slots_of_a_host_only_chain_is_its_device_part() -> None:
    h = SWAH(1)
    c = h.cache
    p_fresh = h.insert(KEY[:8])[0]
    h.insert(KEY, prefix=p_fresh)
    p, q = node_at(c, KEY[:8]), node_at(c, KEY)
    lock = c.inc_lock_ref(p)
    assert c.evict(8).num_tokens == 8  # Q demoted (backed up: write-through)
    c.dec_lock_ref(lock)
    assert q.kv_value is None
    assert c.path_slots(q).tolist() == p_fresh.tolist()
    demote_all(h)
    assert c.path_slots(q).tolist() == []


# ======================================================================== SWA
def test_swa_kept_mask_keeps_the_requests_live_copy_over_a_tombstone() -> None:
    h = SWAH(1)
    c, kv = h.cache, h.kv
    tree = h.insert(KEY[:8], tombstone=4)[0]  # the tree: [0, 4) tombstoned, [4, 8) live
    mine = _take(kv, 8)  # a running request's own copy: all live
    kv.free_swa(mine[6:7])  # ... but position 6 slid out of its window
    caller = torch.cat([tree[:2], mine[2:]])  # positions 0, 1: the tree's own slots
    want = [False, False, True, True, False, False, False, False]
    assert c.swa_kept_mask(caller, tree).tolist() == want
    assert c.swa_kept_mask(caller, tree).dtype == torch.bool
    with pytest.raises(ValueError, match="same tokens"):
        c.swa_kept_mask(caller[:7], tree)
    plain, alloc = _plain()
    s = _take(alloc, 3)
    assert plain.swa_kept_mask(s, s.flip(0)).tolist() == [False, False, False]


def test_release_swa_slots_frees_what_slid_out_of_the_window() -> None:
    h = SWAH(1)
    c, kv = h.cache, h.kv
    own = _take(kv, 12)  # a request's own slots, all with SWA KV
    margin = W + c.config.swa_release_extra_pages  # window 4 (> page 1), extra pages
    before = kv.swa_available_size()
    upto = c.release_swa_slots(own, 0, 12)
    assert upto == 12 - margin
    assert kv.swa_available_size() == before + upto
    assert kv.has_swa(own).tolist() == [False] * upto + [True] * (12 - upto)
    assert c.release_swa_slots(own, upto, 12) == upto  # nothing more to free
    assert kv.swa_available_size() == before + upto
    with pytest.raises(ValueError, match="seq_len"):
        c.release_swa_slots(own, 0, 13)
    with pytest.raises(ValueError, match="start"):
        c.release_swa_slots(own, -1, 12)
    plain, alloc = _plain()
    with pytest.raises(ValueError, match="without a sliding-window component"):
        plain.release_swa_slots(_take(alloc, 4), 0, 4)


# ======================================================================== host hits
def _device_use(h: SWAH) -> tuple[int, int, int]:
    """Full KV tokens, SWA KV tokens and states in use on device (the allocators' counts)."""
    states = 0 if h.sp is None else h.sp.size - h.sp.available_size()
    return (h.kv.full_side.size - h.kv.full_side.available_size(),
            h.kv.swa_side.size - h.kv.swa_side.available_size(), states)


@pytest.mark.parametrize("states", [0, 4])
def test_host_hit_lengths_count_what_the_load_back_brings(states: int) -> None:
    h = SWAH(1, states=states)
    c = h.cache
    h.insert(KEY[:8], tombstone=4)  # A [0, 4) a tombstone, B [4, 8) live (host SWA copy)
    b = node_at(c, KEY[:8])
    m = c.match_prefix(KEY[:8])
    assert (m.host_hit_length, m.swa_host_hit_length, m.state_host_hit_length) == (0, 0, 0)
    demote_all(h)
    m = c.match_prefix(KEY[:8])
    assert (m.prefix_len, m.last_host_node, m.host_hit_length) == (0, b, 8)
    # full KV of A and B, SWA KV of B only (A's tombstone has none), B's state
    assert (m.swa_host_hit_length, m.state_host_hit_length) == (4, 1 if states else 0)
    before = _device_use(h)
    assert c.load_back(b) == 8
    after = _device_use(h)
    assert tuple(x - y for x, y in zip(after, before, strict=True)) == (
        8, m.swa_host_hit_length, m.state_host_hit_length)


def test_a_state_on_host_alone_is_a_state_host_hit_without_kv() -> None:
    h = SWAH(1, states=4)
    c = h.cache
    p_fresh = h.insert(KEY[:8])[0]
    h.insert(KEY, prefix=p_fresh)  # P [0, 8) and Q [8, 16), each with a state
    p = node_at(c, KEY[:8])
    assert p.host_state_slot is not None  # write-through backed it up
    assert c.evict_states(1).num_states == 1  # P, the older: internal, keeps its KV
    assert p.state_slot is None and p.kv_value is not None
    m = c.match_prefix(KEY[:8])
    assert (m.prefix_len, m.last_host_node, m.host_hit_length) == (0, p, 8)
    assert (m.swa_host_hit_length, m.state_host_hit_length) == (0, 1)
    before = _device_use(h)
    assert c.load_back(p) == 0  # the state alone
    after = _device_use(h)
    assert tuple(x - y for x, y in zip(after, before, strict=True)) == (0, 0, 1)
    assert c.match_prefix(KEY[:8]).prefix_len == 8
