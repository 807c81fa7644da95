"""Every invariant of SPEC section 6, recomputed from scratch (``RadixCache.sanity_check``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from radix.tree import namespace_key

if TYPE_CHECKING:
    from allocators.token_allocator import _FreeListAllocator
    from radix.cache import RadixCache


def check_cache(cache: RadixCache) -> None:
    """Raise ``AssertionError`` on the first broken invariant."""
    tree = cache.tree
    ps = cache.page_size
    root = tree.root
    assert root.kv_value is None and root.state_slot is None and not root.key
    nodes = tree.iter_nodes()
    assert len(nodes) == tree.num_nodes, f"num_nodes {tree.num_nodes} != {len(nodes)}"
    for n in nodes:
        p = n.parent
        assert p is not None
        assert n.key and len(n.key) % ps == 0, f"{n}: key of {len(n.key)} tokens, page {ps}"
        assert n.depth == p.depth + len(n.key), f"{n}: depth {n.depth} != parent {p.depth} + len"
        ck = tree.child_key(p, n.key, 0, n.extra_key)
        assert p.children.get(ck) is n, f"{n} filed under the wrong child key in {p}"
        if p is not root:
            assert namespace_key(n.extra_key) == namespace_key(p.extra_key), (
                f"{n}: extra_key differs from its parent"
            )
        assert 0 <= n.lock_ref <= n.kv_lock, f"direct locks {n.lock_ref} vs kv_lock {n.kv_lock}: {n}"
        if cache.state is not None:
            assert n.state_lock == n.lock_ref, f"state_lock differs from direct locks: {n}"
        if not n.children and n.kv_lock == 0:
            assert not cache._dead_leaf(n), f"unlocked dead leaf (no state / tombstone): {n}"
        if cache.state is not None:
            if n.state_lock > 0:
                assert n.kv_lock > 0, f"state locked but KV not: {n}"

    # Slots: no slot held twice, none of them free in the allocator.
    dev_nodes = [n for n in nodes if n.kv_value is not None]
    if dev_nodes:
        held = torch.cat([n.kv_value for n in dev_nodes])  # type: ignore[misc]
        assert held.unique().numel() == held.numel(), "a KV slot is held by two nodes"
        is_free = getattr(cache.kv.allocator, "is_free", None)
        if callable(is_free):
            assert not bool(is_free(held).any()), "a KV slot held by the tree is free in the allocator"
    cache.kv.check(nodes)
    if cache.state is not None:
        slots = [n.state_slot for n in nodes if n.state_slot is not None]
        assert len(set(slots)) == len(slots), "a state slot is held by two nodes"
        is_free = getattr(cache.state.allocator, "is_free", None)
        if slots and callable(is_free):
            assert not bool(is_free(torch.tensor(slots, dtype=torch.int64)).any()), (
                "a state slot held by the tree is free in the pool"
            )
        cache.state.check(nodes)
        wm = cache.watermark
        assert wm >= cache._last_watermark, f"watermark fell {cache._last_watermark} -> {wm}"
        cache._last_watermark = wm
    if cache.swa is not None:
        cache.swa.check(nodes)
    if cache.hicache is not None:
        _check_host(cache, nodes)
    else:
        assert all(n.host_value is None and n.host_state_slot is None for n in nodes)
    total = sum(len(n.key) for n in dev_nodes)
    assert cache.evictable_size() + cache.protected_size() == total, (
        f"evictable {cache.evictable_size()} + protected {cache.protected_size()} != held {total}"
    )


def _check_host(cache: RadixCache, nodes: list) -> None:
    hc = cache.hicache
    assert hc is not None
    host_tokens = 0
    host_slots = []
    host_states = []
    expected_leaves = set()
    for n in nodes:
        hv = n.host_value
        assert n.kv_value is not None or hv is not None, f"node with no KV anywhere: {n}"
        if n.kv_value is None:
            assert n.state_slot is None, f"device state on a host-only node: {n}"
            if not n.children:
                expected_leaves.add(n.id)
        if hv is None:
            assert n.host_state_slot is None, f"host state without host KV: {n}"
            continue
        assert len(hv) == len(n.key), f"{n}: {len(hv)} host slots for {len(n.key)} tokens"
        p = n.parent
        assert p is not None
        if p.parent is not None:
            assert p.host_value is not None, f"backed up before its parent: {n}"
        host_tokens += len(hv)
        host_slots.append(hv)
        if n.host_state_slot is not None:
            host_states.append(n.host_state_slot)
    assert host_tokens == cache.host_size(), f"host tokens {cache.host_size()} != {host_tokens}"
    if host_slots:
        held = torch.cat(host_slots)
        assert held.unique().numel() == held.numel(), "a host slot is held by two nodes"
        host_kv = cast("_FreeListAllocator", hc.host_kv)  # mirror_kv: a Token/PagedAllocator
        assert not bool(host_kv.is_free(held).any()), "a host slot held by the tree is free"
    assert len(set(host_states)) == len(host_states), "a host state slot is held twice"
    if host_states and hc.host_state is not None:
        assert not bool(hc.host_state.is_free(torch.tensor(host_states)).any()), (
            "a host state slot held by the tree is free"
        )
    got = {n.id for n in cache.host_leaves}
    assert got == expected_leaves, f"host eviction set differs: {got ^ expected_leaves}"
    cache.host_leaves.check()
