"""SGLang's eviction-strategy classes (``sglang.srt.mem_cache.evict_policy``, 0.5.23), one per
``radix_eviction_policy``, over this library's policies.

``get_priority(node)`` gives the key SGLang's strategy gives (smaller: evicted first), in
SGLang's shape (a number for ``lru`` / ``fifo`` / ``mru`` / ``filo``, a tuple otherwise). It is
computed by the library policy of the same name (``components.eviction.registry.POLICY_REGISTRY``), the order
the cache's own eviction follows, so ordering nodes by it is ordering them as the cache does.
``node``: a ``radix.sglang`` node view or a library ``TreeNode``.
"""

from __future__ import annotations

from typing import Any

from components.eviction.registry import POLICY_REGISTRY
from radix.node import TreeNode as LibNode

__all__ = [
    "EVICTION_STRATEGIES",
    "EvictionStrategy",
    "FIFOStrategy",
    "FILOStrategy",
    "LFUStrategy",
    "LRUStrategy",
    "MRUStrategy",
    "PriorityStrategy",
    "SLRUStrategy",
    "TLRUStrategy",
]


class EvictionStrategy:
    """Base class (not instantiable itself): ``policy`` names the ``radix_eviction_policy``
    the strategy is.

    Raises:
        TypeError: instantiating the base class, or a knob the policy does not have.
        ValueError: a bad knob value (the policy's own check), naming it.
    """

    policy = ""

    def __init__(self, **knobs: Any) -> None:
        spec = POLICY_REGISTRY.get(self.policy)
        if spec is None:
            raise TypeError("EvictionStrategy is abstract: use one of EVICTION_STRATEGIES")
        for name, value in knobs.items():
            if name not in spec.knobs:
                raise TypeError(f"{type(self).__name__} got an unexpected keyword argument "
                                f"{name!r}")
            err = spec.knobs[name].check(value)
            if err:
                raise ValueError(f"{name} {err}")
        # (no cross-check of the knobs: SGLang accepts TLRUStrategy(0, 0))
        self._key = spec.make_key(knobs)

    def get_priority(self, node: Any) -> float | tuple[Any, ...]:
        """The eviction key of ``node`` (smaller first), as SGLang's strategy returns it."""
        lib = node if isinstance(node, LibNode) else node.library_node
        key = self._key(lib)
        return key[0] if len(key) == 1 else key


class LRUStrategy(EvictionStrategy):
    """``last_access_time``."""

    policy = "lru"


class LFUStrategy(EvictionStrategy):
    """``(hit_count, last_access_time)``."""

    policy = "lfu"


class FIFOStrategy(EvictionStrategy):
    """``creation_time``."""

    policy = "fifo"


class MRUStrategy(EvictionStrategy):
    """``-last_access_time``."""

    policy = "mru"


class FILOStrategy(EvictionStrategy):
    """``-creation_time``."""

    policy = "filo"


class PriorityStrategy(EvictionStrategy):
    """``(priority, last_access_time)``: lower priority first, then LRU."""

    policy = "priority"


class SLRUStrategy(EvictionStrategy):
    """``(protected, last_access_time)``: ``protected`` is 1 once ``hit_count`` reaches
    ``protected_threshold``."""

    policy = "slru"

    def __init__(self, protected_threshold: int = 2) -> None:
        super().__init__(protected_threshold=protected_threshold)
        self.protected_threshold = protected_threshold


class TLRUStrategy(EvictionStrategy):
    """``(-1 if tail-safe else 0, last_access_time)`` (tail-optimized LRU; ``threshold`` and
    ``next_prompt_estimate`` in tokens)."""

    policy = "tlru"

    def __init__(self, threshold: int = 0, next_prompt_estimate: int = 0) -> None:
        super().__init__(threshold=threshold, next_prompt_estimate=next_prompt_estimate)
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate


#: ``radix_eviction_policy`` name -> SGLang's strategy class.
EVICTION_STRATEGIES: dict[str, type[EvictionStrategy]] = {
    c.policy: c for c in (LRUStrategy, LFUStrategy, FIFOStrategy, MRUStrategy, FILOStrategy,
                          PriorityStrategy, SLRUStrategy, TLRUStrategy)
}
