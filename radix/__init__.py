"""The radix tree and the engine-facing prefix cache (``RadixCache``)."""

from radix.cache import RadixCache
from radix.config import CacheConfig
from radix.node import TreeNode
from radix.policies import POLICY_REGISTRY, resolve_policy
from radix.results import CacheRequest, EvictResult, InsertResult, MatchResult
from radix.tree import RadixKey

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
