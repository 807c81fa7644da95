"""Argument checks shared by the engine-facing calls (the facade and the request helpers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radix.core import NO_PARTS
from radix.node import TreeNode
from radix.results import LockRef

if TYPE_CHECKING:
    from radix.core import CacheCore


def check_count(n: Any, name: str) -> int:
    """``n`` if it is an int >= 0; ``TypeError`` / ``ValueError`` naming ``name`` otherwise."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int >= 0, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n}")
    return n


def check_node(core: CacheCore, node: Any, device: bool = True, name: str = "node") -> TreeNode:
    """Validate a node handle (the argument ``name``); ``device``: it must also be on device
    (lockable)."""
    if not isinstance(node, TreeNode):
        raise TypeError(f"{name} must be a TreeNode from match_prefix/insert, got "
                        f"{type(node).__name__}")
    label = f"node {node.id}" if name == "node" else f"{name} (node {node.id})"
    if not core.tree.is_attached(node):
        raise ValueError(f"{label} is not in this cache (removed, reset, or another cache's)")
    if device and node.parent is not None and node.kv_value is None:
        raise ValueError(f"{label} is host-only; load_back it before locking it")
    return node


def check_lock(core: CacheCore, lock: Any, name: str) -> tuple[TreeNode, dict[str, Any]]:
    """Raise unless ``RadixCache.dec_lock_ref`` may release ``lock`` (``name`` says where it came
    from); return its node and the components' lock data."""
    if isinstance(lock, LockRef):
        if lock.released:
            raise ValueError(f"{name} {lock!r} was released already")
        node, parts = lock.node, lock.parts
    elif isinstance(lock, TreeNode):
        node, parts = lock, NO_PARTS
    else:
        raise TypeError(
            f"{name} must be what inc_lock_ref returned (a LockRef or a TreeNode), got "
            f"{type(lock).__name__}"
        )
    node = check_node(core, node)
    if node.parent is None:
        return node, parts
    if core.lock_data and not isinstance(lock, LockRef):
        raise ValueError(
            f"{name}: pass the LockRef inc_lock_ref returned for node {node.id} (this cache's "
            "sliding-window locks record where they start), not the node"
        )
    if node.lock_ref <= 0:
        raise ValueError(
            f"{name}: node {node.id} holds no lock of its own: released already, or not the "
            "node inc_lock_ref was given"
        )
    for component, check in core.unlock_checks:
        err = check(node, parts.get(component))
        if err is not None:
            raise ValueError(f"{name}: {err}")
    return node, parts
