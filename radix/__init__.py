"""The radix tree and the engine-facing prefix cache (``RadixCache``).

Names are resolved lazily (PEP 562) so that ``components`` can import the tree core
(``radix.node``, ``radix.ordered``) without pulling in the facade that imports them back.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RadixCache": "radix.cache",
    "CacheConfig": "radix.config",
    "TreeNode": "radix.node",
    "POLICY_REGISTRY": "radix.policies",
    "resolve_policy": "radix.policies",
    "CacheRequest": "radix.results",
    "EvictResult": "radix.results",
    "InsertResult": "radix.results",
    "MatchResult": "radix.results",
    "RadixKey": "radix.tree",
}

__all__ = [
    "POLICY_REGISTRY",
    "CacheConfig",
    "CacheRequest",
    "EvictResult",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "TreeNode",
    "resolve_policy",
]

if TYPE_CHECKING:
    from radix.cache import RadixCache
    from radix.config import CacheConfig
    from radix.node import TreeNode
    from radix.policies import POLICY_REGISTRY, resolve_policy
    from radix.results import CacheRequest, EvictResult, InsertResult, MatchResult
    from radix.tree import RadixKey


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radix' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
