"""The SGLang-equivalence options of ``CacheConfig``: ``stateless_leaf``, ``state_recency``,
``match_recency`` (narrated scenarios, every victim worked out by hand), and their
validation when the config is built.

Stamps are the cache's logical clock: every match and insert is one tick, so "older" below
means "touched by an earlier call".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import TokenAllocator
from radix import CacheConfig, RadixCache
from tests.helpers.cache_helpers import tiny_state_pool


class Hybrid:
    """A KV + state cache with helpers that allocate and free like an engine."""

    def __init__(self, **cfg: Any) -> None:
        self.kv = TokenAllocator(64)
        self.sp = tiny_state_pool(8)
        self.cache = RadixCache(CacheConfig(**cfg), kv_allocator=self.kv, state_allocator=self.sp)

    def put(self, key: list[int]) -> None:
        m = self.cache.match_prefix(key)
        fresh = self.kv.alloc(len(key) - m.prefix_len)
        slot = self.sp.alloc(1)
        assert fresh is not None and slot is not None
        res = self.cache.insert(key, torch.cat([m.device_indices, fresh]), state_slot=int(slot[0]))
        if len(res.duplicate_indices):
            self.kv.free(res.duplicate_indices)
        if not res.state_adopted:
            self.sp.free(slot)
        self.cache.sanity_check()

    def states(self) -> dict[tuple[int, ...], int]:
        """Token prefix ending at a node -> its state slot."""
        out = {}
        stack = [(c, ()) for c in self.cache.root.children.values()]
        while stack:
            n, above = stack.pop()
            toks = above + tuple(n.key.tolist())
            if n.state_slot is not None:
                out[toks] = n.state_slot
            stack.extend((c, toks) for c in n.children.values())
        return out


# ================================================================ stateless_leaf
@pytest.mark.parametrize(("rule", "freed", "left"), [("prune", 5, 0), ("keep", 2, 3)])
def test_a_leaf_left_without_state_is_pruned_or_kept(rule: str, freed: int, left: int) -> None:
    h = Hybrid(stateless_leaf=rule)
    h.put([1, 2, 3])           # A [0,3) state 1
    h.put([1, 2, 3, 4, 5])     # B [3,5) state 2 (A is internal now)
    assert h.cache.evict_states(1).num_states == 1  # the older state: A's (A keeps its KV)
    assert h.states() == {(1, 2, 3, 4, 5): 2}
    res = h.cache.evict(2)     # B leaves with its state; A is a childless, stateless node
    assert (res.num_tokens, res.num_states) == (freed, 1)
    assert h.cache.total_size() == left
    m = h.cache.match_prefix([1, 2, 3, 9])
    assert (m.prefix_len, m.kv_hit_length) == (0, left)  # KV only: a match cannot end there
    if rule == "keep":  # a KV eviction frees it like any leaf
        assert h.cache.evict(1).num_tokens == 3 and h.cache.total_size() == 0
    assert h.kv.available_size() == 64 and h.sp.available_size() == 8
    h.cache.sanity_check()


@pytest.mark.parametrize(("rule", "left"), [("prune", 0), ("keep", 3)])
def test_the_rule_applies_when_the_last_lock_of_a_stateless_leaf_goes(rule: str,
                                                                       left: int) -> None:
    h = Hybrid(stateless_leaf=rule)
    h.put([1, 2, 3])
    h.put([1, 2, 3, 4, 5])
    a = h.cache.match_prefix([1, 2, 3, 4, 5]).last_device_node.parent  # the node [0,3)
    h.cache.evict_states(1)                  # A's state (older); A keeps its KV
    lock = h.cache.inc_lock_ref(a)           # a request holds A's KV
    assert h.cache.evict(5).num_tokens == 2  # only B can go; A is locked
    assert h.cache.total_size() == 3
    h.cache.dec_lock_ref(lock)               # A: unlocked, childless, stateless
    assert h.cache.total_size() == left
    h.cache.sanity_check()


# ================================================================ state_recency
@pytest.mark.parametrize(("recency", "victim"), [("consumed", (1, 2, 3)), ("path", (10, 11))])
def test_path_recency_refreshes_every_state_on_the_matched_path(recency: str,
                                                                victim: tuple[int, ...]) -> None:
    h = Hybrid(state_recency=recency)
    h.put([1, 2, 3])                  # state 1 at [0,3)
    h.put([1, 2, 3, 4, 5, 6, 7])      # state 2 at [3,7)
    h.put([10, 11])                   # state 3
    assert h.cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).prefix_len == 7  # consumes state 2
    # consumed: state 1 (stamped when cached) is the least recent; path: state 1 moved with
    # the match, so state 3 is
    h.cache.evict_states(1)
    assert victim not in h.states()
    assert len(h.states()) == 2


@pytest.mark.parametrize(("recency", "victim"), [("consumed", (1, 2, 3, 4)), ("path", (9, 9))])
def test_path_recency_refreshes_the_lower_half_of_a_split(recency: str,
                                                          victim: tuple[int, ...]) -> None:
    h = Hybrid(state_recency=recency)
    h.put([1, 2, 3, 4])               # state 1
    h.put([9, 9])                     # state 2
    m = h.cache.match_prefix([1, 2, 5])  # splits [0,4) at 2; no state at 2: nothing usable
    assert m.prefix_len == 0 and m.kv_hit_length == 2
    h.cache.evict_states(1)
    assert victim not in h.states()


def test_path_recency_refreshes_the_states_an_insert_passes() -> None:
    h = Hybrid(state_recency="path")
    h.put([1, 2, 3])                  # state 1
    h.put([10, 11])                   # state 2
    h.put([1, 2, 3, 4])               # passes [0,3): state 1 moves; state 3 at [3,4)
    h.cache.evict_states(1)
    assert h.states() == {(1, 2, 3): 1, (1, 2, 3, 4): 3}


# ================================================================ match_recency
@pytest.mark.parametrize(("recency", "victim_len"), [("matched", 2), ("usable", 3)])
def test_usable_recency_leaves_an_unusable_match_unstamped(recency: str, victim_len: int) -> None:
    h = Hybrid(stateless_leaf="keep", match_recency=recency)
    h.put([1, 2, 3])                  # A, state 1
    h.put([1, 2, 3, 4, 5])            # B, state 2
    h.cache.evict_states(1)           # A's state (older)
    h.cache.evict_states(1)           # B's: B leaves whole; A stays, KV only
    h.put([7, 8])                     # C, a newer leaf
    m = h.cache.match_prefix([1, 2, 3, 9])  # A's KV matches, nothing usable
    assert (m.prefix_len, m.kv_hit_length) == (0, 3)
    # matched: A was stamped by this match, so C is the least recent leaf; usable: A wasn't
    assert h.cache.evict(1).num_tokens == victim_len


def test_usable_recency_still_stamps_a_usable_match() -> None:
    h = Hybrid(match_recency="usable")
    h.put([1, 2, 3])
    h.put([7, 8])
    h.cache.match_prefix([1, 2, 3])   # usable up to 3: A is stamped
    assert h.cache.evict(1).num_tokens == 2  # C [7, 8] is the least recent


# ================================================================ validation
@pytest.mark.parametrize(("kw", "err", "match"), [
    (dict(state_recency="all"), ValueError, "state_recency"),
    (dict(state_recency=1), TypeError, "state_recency"),
    (dict(stateless_leaf="drop"), ValueError, "stateless_leaf"),
    (dict(match_recency="some"), ValueError, "match_recency"),
    (dict(state_recency="path", radix_eviction_policy="gds"), ValueError, "state LRU"),
    (dict(state_recency="path", radix_eviction_policy="joint_lru"), ValueError, "state LRU"),
])
def test_bad_options_fail_when_the_config_is_built(kw: dict[str, Any], err: type,
                                                   match: str) -> None:
    with pytest.raises(err, match=match):
        CacheConfig(**kw)


def test_options_round_trip_through_a_dict() -> None:
    cfg = CacheConfig(state_recency="path", stateless_leaf="keep", match_recency="usable",
                      enable_kv_cache_events=True)
    d = {k: v for k, v in cfg.to_dict().items() if k in (
        "state_recency", "stateless_leaf", "match_recency", "enable_kv_cache_events")}
    assert CacheConfig.from_dict(d) == cfg
