"""The radix tree and the engine-facing prefix cache (``RadixCache``).

Two floors: the tree core (``node``, ``tree``: tokens -> matched path; no tensors, no pools,
no policies) and the facade that composes the components of ``components`` over it (``cache``,
``core``, ``insert``, ``requests``, ``config``, ``results``, ``diagnostics``; the host and
storage tiers in ``radix.tiers``). Front ends: ``radix.sglang`` (SGLang's interface),
``radix.lora`` (LoRA adapters as an engine serves them).

:func:`compiled` says which of the three optional C loops are in use; importing ``radix``
without one of them warns once, in one line.
"""

from __future__ import annotations

import importlib
import warnings
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

#: The optional C loops ``pip install`` builds (``setup.py``) -> what each runs.
COMPILED_LOOPS = {
    "components._claim": "the insert's slot claim",
    "radix._match": "the tree walk's loop",
    "allocators._release": "the allocators' frees",
}


def compiled() -> dict[str, bool]:
    """Which of :data:`COMPILED_LOOPS` are in use (built and importable). Where one is not,
    the numpy / pure-Python code it is tested against runs instead, with the same results,
    slower (about 1.7x per insert without all three)."""
    out = {}
    for name in COMPILED_LOOPS:
        try:
            importlib.import_module(name)
        except ImportError:
            out[name] = False
        else:
            out[name] = True
    return out


def _warn_if_not_compiled() -> None:
    missing = [name for name, ok in compiled().items() if not ok]
    if missing:  # one line: no source line to show under it
        warnings.warn_explicit(
            f"hybrid-prefix-cache: {', '.join(missing)} not built (no C compiler at install?): "
            "the Python fallbacks run, same results, ~1.7x slower per insert; radix.compiled() "
            "lists the loops", RuntimeWarning, filename="radix", lineno=0, module="radix")


_warn_if_not_compiled()

__all__ = [
    "COMPILED_LOOPS",
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
    "compiled",
    "resolve_policy",
]
