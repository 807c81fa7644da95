"""A readable dump of the tree and the invariant check (``RadixCache.pretty_print`` /
``sanity_check``).

``sanity_check`` recomputes every counter from scratch and checks, on the tree: keys are whole
pages filed under the right child key, depths add up, one namespace per subtree, lock counts
are consistent and never negative, no unlocked dead leaf survives; then each component's and
tier's own invariants (``Component.check``: every allocator's slots held once and never free,
counters equal to their recomputation, eviction orders exact, the GDS lower bound, host copies
forming a prefix from the root); and that the GDS watermark never decreased.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radix.tree import namespace_key

if TYPE_CHECKING:
    from radix.cache import RadixCache
    from radix.node import TreeNode


def pretty_print(cache: RadixCache, file: Any = None) -> str:
    """One line per node: span, first tokens, locks, state, each component's part."""
    lines = [f"root  policy={cache.policy.name} page_size={cache.page_size}"]
    holders = cache.core.components + cache.core.per_node

    def rec(node: TreeNode, indent: int) -> None:
        for child in sorted(node.children.values(), key=lambda c: c.id):
            head = child.key[:6].tolist()
            extra = "".join(h.describe(child) for h in holders)
            lines.append(
                f"{'  ' * indent}[{child.start},{child.depth}) id={child.id} "
                f"key={head}{'...' if len(child.key) > 6 else ''} kv_lock={child.kv_lock} "
                f"state={child.state_slot} state_lock={child.state_lock}{extra} "
                f"t={child.last_access_time}"
            )
            rec(child, indent + 1)

    rec(cache.root, 1)
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text


def sanity_check(cache: RadixCache) -> None:
    """Raise ``AssertionError`` on the first broken invariant, with the printed tree."""
    try:
        check_cache(cache)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{pretty_print(cache)}") from None


def check_cache(cache: RadixCache) -> None:
    """Raise ``AssertionError`` on the first broken invariant."""
    core = cache.core
    tree = core.tree
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
        if not n.children and n.kv_lock == 0:
            assert not core.is_dead_leaf(n), f"unlocked dead leaf (no state / tombstone): {n}"
    for c in core.components + core.per_node:
        c.check(nodes)
    if not core.per_node:
        assert all(n.host_value is None and n.host_state_slot is None for n in nodes)
    wm = cache.watermark
    assert wm >= cache.checked_watermark, f"watermark fell {cache.checked_watermark} -> {wm}"
    cache.checked_watermark = wm
    total = sum(len(n.key) for n in nodes if n.kv_value is not None)
    assert cache.evictable_size() + cache.protected_size() == total, (
        f"evictable {cache.evictable_size()} + protected {cache.protected_size()} != held {total}"
    )
