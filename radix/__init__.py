"""The radix tree and the engine-facing prefix cache (``RadixCache``).

Two floors: the tree core (``node``, ``tree``, ``policies``: tokens -> matched path, node ->
sort key; no tensors, no pools) and the facade that composes the components of
``components`` over it (``cache``, ``core``, ``insert``, ``requests``, ``config``,
``results``, ``diagnostics``; the host and storage tiers in ``radix.tiers``).
"""

from __future__ import annotations

from importlib import metadata

from components.eviction.registry import POLICY_REGISTRY, resolve_policy
from radix.cache import RadixCache
from radix.config import CacheConfig
from radix.node import TreeNode
from radix.results import CacheRequest, EvictResult, InsertResult, LockRef, MatchResult
from radix.tree import RadixKey

try:
    #: The installed distribution's version (``hybrid-prefix-cache``).
    __version__ = metadata.version("hybrid-prefix-cache")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "POLICY_REGISTRY",
    "__version__",
    "CacheConfig",
    "CacheRequest",
    "EvictResult",
    "InsertResult",
    "LockRef",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "TreeNode",
    "resolve_policy",
]
