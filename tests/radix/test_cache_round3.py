"""Reliability round 3 (issue 36), the library's own API: a state lands only on the node ending
at its position; request helpers validate before anything changes; namespaces are values."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocators import MambaStatePool, PagedAllocator
from radix import CacheConfig, CacheRequest, RadixCache


def states(n: int = 8) -> MambaStatePool:
    return MambaStatePool(n, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,))


def paged_hybrid(size: int = 64, ps: int = 4) -> tuple[RadixCache, PagedAllocator, MambaStatePool]:
    kv, sp = PagedAllocator(size, ps), states()
    return RadixCache(CacheConfig(page_size=ps), kv_allocator=kv, state_allocator=sp), kv, sp


def frozen(cache: RadixCache, *pools: Any) -> tuple[Any, ...]:
    return (cache.pretty_print(), cache.evictable_size(), cache.protected_size(),
            *(p.snapshot() for p in pools))


# ============================================================================ item 2
def test_a_state_after_a_partial_page_is_refused_and_nothing_changes() -> None:
    """Page 4, a 10-token key with the state valid after token 10: the node the insert would
    end at holds tokens [0, 8), so the state does not belong there (before: inserted_len=8,
    state_adopted=True, and a later 8-token match resumed from a state that holds 9 and 10)."""
    cache, kv, sp = paged_hybrid()
    slots = kv.alloc(12)
    assert slots is not None
    slot = int(sp.alloc(1)[0])
    key = list(range(1, 11))
    before = frozen(cache, kv, sp)
    with pytest.raises(ValueError, match=r"state_slot .* 10 tokens.* ends at token 8") as info:
        cache.insert(key, slots[:10], state_slot=slot)
    assert "page_size=4" in str(info.value)
    assert frozen(cache, kv, sp) == before
    assert cache.match_prefix(key).prefix_len == 0
    # the same state at a page end is adopted where it belongs
    res = cache.insert(key[:8], slots[:8], state_slot=slot)
    assert (res.prefix_len, res.inserted_len, res.state_adopted) == (0, 8, True)
    assert res.last_node.depth == 8 and res.last_node.state_slot == slot
    m = cache.match_prefix(key)
    assert (m.prefix_len, m.state_slot) == (8, slot)
    kv.free(slots[8:])
    cache.sanity_check()


def test_a_state_after_a_partial_page_is_refused_over_a_cached_prefix_too() -> None:
    """The 8 tokens are cached already (with their own state); a 10-token insert with a state
    would hand back state_adopted=False before, but the refusal is the same one check."""
    cache, kv, sp = paged_hybrid()
    slots = kv.alloc(8)
    assert slots is not None
    first = int(sp.alloc(1)[0])
    cache.insert(list(range(1, 9)), slots, state_slot=first)
    other = int(sp.alloc(1)[0])
    mine = kv.alloc(12)
    assert mine is not None
    before = frozen(cache, kv, sp)
    with pytest.raises(ValueError, match="state_slot"):
        cache.insert(list(range(1, 11)), mine[:10], state_slot=other)
    assert frozen(cache, kv, sp) == before
    cache.sanity_check()


# ============================================================================ item 3
def kv_only_paged(size: int = 64, ps: int = 4) -> tuple[RadixCache, PagedAllocator]:
    kv = PagedAllocator(size, ps)
    return RadixCache(CacheConfig(page_size=ps), kv_allocator=kv), kv


def new_req(cache: RadixCache, kv: PagedAllocator, n: int) -> tuple[CacheRequest, torch.Tensor]:
    """A request of ``n`` tokens holding whole pages, its row the first ``n`` slots."""
    pages = kv.alloc(-(-n // kv.page_size) * kv.page_size)
    assert pages is not None
    key = list(range(1, n + 1))
    return CacheRequest(key=key, kv_indices=pages[:n], cached_len=0, last_node=cache.root), pages


def test_finished_request_whose_row_ends_inside_a_page_frees_that_whole_page() -> None:
    """A 10-token row at page 4 (the request holds 3 pages): the tree keeps 8 tokens and the
    request's third page (slots 9..12 of its allocation) goes back whole. Before: the tree
    kept 8 tokens, then ``partial page: 2 slots`` was raised with the tree already changed."""
    cache, kv = kv_only_paged()
    req, pages = new_req(cache, kv, 10)
    assert kv.available_size() == 64 - 12
    res = cache.cache_finished_req(req)
    assert (res.prefix_len, res.inserted_len) == (0, 8)
    assert kv.available_size() == 64 - 8
    assert kv.is_free(pages).tolist() == [False] * 8 + [True] * 4
    m = cache.match_prefix(list(range(1, 11)))
    assert m.prefix_len == 8 and m.device_indices.tolist() == pages[:8].tolist()
    assert (req.cached_len, len(req.kv_indices), req.last_node) == (0, 0, cache.root)
    cache.sanity_check()
    kv.check()


def test_unfinished_then_finished_with_a_partial_last_page() -> None:
    """The running request keeps its partial page [8, 10); finishing it frees that page whole."""
    cache, kv = kv_only_paged()
    req, pages = new_req(cache, kv, 10)
    res = cache.cache_unfinished_req(req)
    assert (res.inserted_len, req.cached_len, req.kv_indices.tolist()) == (8, 8, pages[:10].tolist())
    assert req.last_node.depth == 8 and req.last_node.lock_ref == 1
    cache.cache_finished_req(req)
    assert kv.available_size() == 64 - 8 and cache.protected_size() == 0
    cache.sanity_check()


def test_hybrid_finished_request_ending_inside_a_page_is_refused_before_anything_changes() -> None:
    """Page 4 with states: a finished 10-token request with its end state cannot be cached at
    token 8 (the state holds tokens 9 and 10): refused, tree, pools and request unchanged.
    Before: the tree took 8 tokens and the state, then the tail free raised."""
    cache, kv, sp = paged_hybrid()
    req, pages = new_req(cache, kv, 10)
    slot = int(sp.alloc(1)[0])
    before = frozen(cache, kv, sp)
    fields = (req.cached_len, req.kv_indices.tolist(), req.last_node, req.lock)
    with pytest.raises(ValueError, match="state_slot"):
        cache.cache_finished_req(req, state_slot=slot)
    assert frozen(cache, kv, sp) == before
    assert (req.cached_len, req.kv_indices.tolist(), req.last_node, req.lock) == fields
    # the request's state after token 8 (a checkpoint) is what the tree takes
    res = cache.cache_finished_req(req, state_slot=slot, upto=8)
    assert (res.inserted_len, res.state_adopted) == (8, True)
    assert kv.available_size() == 64 - 8 and res.last_node.state_slot == slot
    cache.sanity_check()


@pytest.mark.parametrize("helper", ["cache_finished_req", "cache_unfinished_req"])
def test_requests_that_cannot_be_freed_in_pages_are_refused_first(helper: str) -> None:
    """A ``cached_len`` inside a page, or a last page not starting at a page boundary: the
    duplicates' or the tail's free would raise after the insert; both are refused first."""
    cache, kv = kv_only_paged()
    held, _ = new_req(cache, kv, 8)
    cache.cache_unfinished_req(held)  # [1..8] cached, locked by ``held``
    req, pages = new_req(cache, kv, 10)
    call = getattr(cache, helper)
    m = cache.match_prefix(list(range(1, 11)))
    before = frozen(cache, kv)
    req.last_node, req.cached_len = m.last_device_node, 6
    req.lock = cache.inc_lock_ref(m.last_device_node)
    locked = frozen(cache, kv)
    with pytest.raises(ValueError, match=r"req.cached_len must be whole pages of page_size=4"):
        call(req)
    assert frozen(cache, kv) == locked
    req.cached_len = 0
    req.kv_indices = torch.cat([pages[:8], pages[9:11]])  # last "page" from its second slot
    with pytest.raises(ValueError, match=r"req.kv_indices must be whole pages .* \[.*\]"):
        call(req)
    assert frozen(cache, kv) == locked
    cache.dec_lock_ref(req.lock)
    assert frozen(cache, kv) == before


# ============================================================================ item 5
@pytest.mark.parametrize("ns", [torch.tensor([7]), object(), (1, torch.tensor(2)),
                                frozenset({1, object()})], ids=["tensor", "object", "tuple",
                                                                "frozenset"])
def test_an_identity_hashed_namespace_is_refused_naming_extra_key(ns: Any) -> None:
    """A tensor (or any object hashed by identity) as ``extra_key``: an engine that builds it
    per request never got a hit, silently. Now a ``TypeError`` naming ``extra_key``, on the
    match, the insert and the ``RadixKey``; nothing changes."""
    from radix import RadixKey

    cache, kv = kv_only_paged(ps=1)
    slots = kv.alloc(4)
    assert slots is not None
    before = frozen(cache, kv)
    with pytest.raises(TypeError, match=r"extra_key must be a value .* got (Tensor|object)"):
        cache.insert([1, 2, 3, 4], slots, ns)
    with pytest.raises(TypeError, match=r"extra_key must be a value"):
        cache.match_prefix([1, 2, 3, 4], ns)
    with pytest.raises(TypeError, match=r"extra_key must be a value"):
        RadixKey([1, 2, 3, 4], ns)
    assert frozen(cache, kv) == before
    # values are namespaces: one built again per request hits
    for value in ((1, "a"), frozenset({1, 2}), 2.5):
        cache.insert([1, 2, 3, 4], slots, value)
        again = value if not isinstance(value, tuple) else tuple(list(value))
        assert cache.match_prefix([1, 2, 3, 4], again).prefix_len == 4
        cache.evict(4)
        slots = kv.alloc(4)
        assert slots is not None


# ============================================================================ item 8
def test_a_request_whose_last_node_is_not_a_node_names_req_last_node() -> None:
    cache, kv = kv_only_paged(ps=1)
    req, _ = new_req(cache, kv, 3)
    root: Any = "root"
    req.last_node = root
    with pytest.raises(TypeError, match=r"^req.last_node must be a TreeNode .* got str$"):
        cache.cache_finished_req(req)


def test_from_namespace_with_a_bad_policy_config_json_names_it() -> None:
    import argparse

    ns = argparse.Namespace(radix_eviction_policy="gds", radix_eviction_policy_config="{d: 1")
    with pytest.raises(ValueError, match=r"^radix_eviction_policy_config is not valid JSON .* "
                                         r"got '\{d: 1'$"):
        CacheConfig.from_namespace(ns)
    ns.radix_eviction_policy_config = '{"d": 2.0, "e": 1.0}'
    assert dict(CacheConfig.from_namespace(ns).radix_eviction_policy_config or {}) == {"d": 2.0,
                                                                                        "e": 1.0}


# ============================================================== missing assertions (core)
def test_with_limit_live_rids_the_oldest_is_forgotten_not_the_newest() -> None:
    from radix.insert import RidDepths

    d = RidDepths(limit=2)
    assert d.counted("a", 4) == 0 and d.counted("b", 6) == 0
    assert d.counted("c", 8) == 0  # a third rid: "a" (the oldest) is forgotten
    assert d.counted("b", 7) == 6 and d.counted("c", 9) == 8  # the newer two are kept
    assert d.counted("a", 5) == 0  # counts again, as a new request


def test_a_locked_leaf_left_without_a_state_is_pruned_on_its_last_unlock() -> None:
    """``stateless_leaf="prune"``: a leaf whose state went while it was locked (a
    ``evict_states`` skips it while locked, so the state is removed by a forced path: its
    request released it) stays while locked and leaves at its last unlock."""
    from allocators import TokenAllocator

    sp = states(4)
    kv = TokenAllocator(32)
    cache = RadixCache(CacheConfig(), kv_allocator=kv, state_allocator=sp)
    slot = int(sp.alloc(1)[0])
    res = cache.insert([1, 2, 3], kv.alloc(3), state_slot=slot)
    leaf = res.last_node
    lock1 = cache.inc_lock_ref(leaf)
    lock2 = cache.inc_lock_ref(leaf)
    assert cache.state is not None
    # the state leaves while the leaf is locked (as a demotion would: remove_state needs an
    # unlocked state, so the state lock is dropped and taken back around it)
    leaf.state_lock -= 2
    cache.state._protected -= 1
    cache.state._evictable += 1
    cache.state.remove_state(leaf)
    leaf.state_lock += 2
    cache.dec_lock_ref(lock1)
    assert leaf.parent is not None and cache.tree.is_attached(leaf)  # still locked once
    cache.dec_lock_ref(lock2)
    assert not cache.tree.is_attached(leaf) and kv.available_size() == 32
    cache.sanity_check()


def test_history_len_rises_when_a_longer_key_walks_the_path_again() -> None:
    from allocators import TokenAllocator

    kv = TokenAllocator(32)
    cache = RadixCache(CacheConfig(), kv_allocator=kv)
    a = kv.alloc(4)
    assert a is not None
    node = cache.insert([1, 2, 3, 4], a).last_node
    assert node.history_len == 4
    b = kv.alloc(3)
    assert b is not None
    cache.insert([1, 2, 3, 4, 5, 6, 7], torch.cat([a, b]))
    assert node.history_len == 7  # the re-walk reached token 7 through it
    cache.insert([1, 2, 3, 4], a)
    assert node.history_len == 7  # a shorter one never lowers it
