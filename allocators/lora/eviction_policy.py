"""LoRA slot eviction policies (SGLang's ``lora_eviction_policy``): ``lru`` (default), ``fifo``.

Contract (:class:`LoraEvictionPolicy`): the policy orders the adapters that *may* be evicted
-- in :class:`~allocators.lora.LoraMemoryPool`, exactly the resident unpinned ones,
the base-model slot included -- and picks one victim among the candidates it is given.

* ``mark_used(uid)``: ``uid`` was used by a batch (tracked from now on if it was not).
* ``select_victim(candidates) -> uid``: the candidate that goes first; counts one eviction
  (``eviction_count``), which the caller then performs (and reports with ``remove``).
* ``remove(uid)``: ``uid`` left the slots (evicted, unloaded or pinned); forget it.

``lru`` evicts the candidate used least recently; ``fifo`` the candidate that became
tracked earliest (``mark_used`` on a tracked uid does not move it). Ties cannot happen: both
keep one total order. Every call is O(tracked) at most (tracked <= ``max_loras_per_batch``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import ClassVar

__all__ = [
    "LORA_EVICTION_POLICIES",
    "FifoLoraPolicy",
    "LoraEvictionPolicy",
    "LruLoraPolicy",
    "make_lora_eviction_policy",
]


class LoraEvictionPolicy(ABC):
    """Orders evictable adapter ids; subclasses decide what ``mark_used`` does to the order.

    Ids are any hashable values (``LoraUid`` or ``BASE_MODEL`` in the pool).

    Errors: ``select_victim`` with no candidates, or with a candidate that is not tracked,
    raises ``ValueError`` and changes nothing (the count included); ``remove`` of an id that is
    not tracked raises ``ValueError``.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # first = next victim
        self.eviction_count = 0
        """Victims selected so far (one per ``select_victim`` call that returned)."""

    @abstractmethod
    def mark_used(self, uid: Hashable) -> None:
        """Record a use of ``uid`` (start tracking it if needed). O(1)."""

    def select_victim(self, candidates: Collection[Hashable]) -> Hashable:
        """The first candidate in the policy's order; ``eviction_count += 1``.

        Args:
            candidates: tracked ids that may be evicted now (non-empty).

        Raises:
            ValueError: ``candidates`` is empty or holds an id that is not tracked.

        Complexity: O(tracked + len(candidates)).
        """
        wanted = set(candidates)
        if not wanted:
            raise ValueError("select_victim: no candidates to evict")
        unknown = wanted.difference(self._order)
        if unknown:
            raise ValueError(f"select_victim: candidates not tracked by the policy: {unknown}")
        for uid in self._order:
            if uid in wanted:
                self.eviction_count += 1
                return uid
        raise AssertionError("unreachable: every candidate is tracked")

    def remove(self, uid: Hashable) -> None:
        """Stop tracking ``uid``. O(1).

        Raises:
            ValueError: ``uid`` is not tracked.
        """
        try:
            del self._order[uid]
        except KeyError:
            raise ValueError(f"remove: {uid!r} is not tracked by the {self.name} policy") from None

    def tracked(self) -> tuple[Hashable, ...]:
        """Every tracked id, next victim first. O(tracked); for checks and tests."""
        return tuple(self._order)

    def __contains__(self, uid: object) -> bool:
        return uid in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(order={list(self._order)}, evictions={self.eviction_count})"


class LruLoraPolicy(LoraEvictionPolicy):
    """Least recently used first: ``mark_used`` moves the id to the back (most recent)."""

    name = "lru"

    def mark_used(self, uid: Hashable) -> None:
        self._order[uid] = None
        self._order.move_to_end(uid)


class FifoLoraPolicy(LoraEvictionPolicy):
    """First in, first out: ``mark_used`` appends an untracked id and leaves a tracked one."""

    name = "fifo"

    def mark_used(self, uid: Hashable) -> None:
        if uid not in self._order:
            self._order[uid] = None


LORA_EVICTION_POLICIES: dict[str, type[LoraEvictionPolicy]] = {
    "lru": LruLoraPolicy,
    "fifo": FifoLoraPolicy,
}
"""Policy classes by ``lora_eviction_policy`` name."""


def make_lora_eviction_policy(
    name: object, arg: str = "lora_eviction_policy"
) -> LoraEvictionPolicy:
    """A fresh policy for ``name`` (``"lru"`` or ``"fifo"``); ``arg`` names the argument in
    error messages.

    Raises:
        TypeError: ``name`` is not a str.
        ValueError: an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a str, got {type(name).__name__}")
    try:
        return LORA_EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"{arg} must be one of {sorted(LORA_EVICTION_POLICIES)}, got {name!r}"
        ) from None
