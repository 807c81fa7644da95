"""LoRA slot eviction policies (SGLang's ``lora_eviction_policy``): ``lru`` (default), ``fifo``.

Contract (:class:`LoraEvictionPolicy`), with SGLang's semantics, so that code written against
SGLang's policies runs unchanged:

* ``mark_used(uid)``: ``uid`` was used by a batch (tracked from now on if it was not). The base
  model is never tracked: ``mark_used`` of it does nothing.
* ``select_victim(candidates) -> uid``: the tracked candidate that goes first; when no
  candidate is tracked, the base model if it is a candidate (a batch made only of adapters
  may take the base model's slot). Candidates the policy does not track (never used, or
  already removed) are passed over. Counts one eviction (``eviction_count``), which the
  caller then performs (and reports with ``remove``).
* ``remove(uid)``: ``uid`` left the slots (evicted, unloaded or pinned); forget it. An id that
  is not tracked, the base model included, is ignored.

The base model is spelled :data:`~allocators.lora.BASE_MODEL` in this library and ``None`` in
SGLang; the policy takes both spellings for it (it never sees an empty slot, so ``None`` means
nothing else here).

``lru`` evicts the tracked candidate used least recently; ``fifo`` the one that became tracked
earliest (``mark_used`` on a tracked uid does not move it). Ties cannot happen: both keep one
total order. Every call is O(tracked + candidates) at most (tracked <= ``max_loras_per_batch``).

What keeps the pool sound is not the policy but what it is offered: the pool passes only
resident adapters that are neither pinned nor needed by the batch, so a pinned or in-batch
adapter is never a victim whatever the policy's order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import ClassVar

from .identity import BASE_MODEL, BaseModel

__all__ = [
    "LORA_EVICTION_POLICIES",
    "FifoLoraPolicy",
    "LoraEvictionPolicy",
    "LruLoraPolicy",
    "get_eviction_policy",
    "make_lora_eviction_policy",
]


def _is_base_model(uid: object) -> bool:
    return uid is None or isinstance(uid, BaseModel)


class LoraEvictionPolicy(ABC):
    """Orders evictable adapter ids; subclasses decide what ``mark_used`` does to the order.

    Ids are any hashable values (``LoraUid`` in the pool); ``BASE_MODEL`` and ``None`` are the
    base model, which is never tracked.

    Errors: ``select_victim`` with no candidates, or with candidates none of which is tracked
    or the base model, raises ``ValueError`` and changes nothing (the count included).
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # first = next victim
        self.eviction_count = 0
        """Victims selected so far (one per ``select_victim`` call that returned)."""

    @abstractmethod
    def mark_used(self, uid: Hashable) -> None:
        """Record a use of ``uid`` (start tracking it if needed); the base model is ignored.
        O(1)."""

    def select_victim(self, candidates: Collection[Hashable]) -> Hashable:
        """The first tracked candidate in the policy's order, else the base model if it is a
        candidate; ``eviction_count += 1``.

        Args:
            candidates: ids that may be evicted now (non-empty); untracked ones other than the
                base model are passed over.

        Returns:
            One of ``candidates`` (``BASE_MODEL`` or ``None`` as spelled there for the base).

        Raises:
            ValueError: ``candidates`` is empty, or holds neither a tracked id nor the base
                model (nothing to choose from).

        Complexity: O(tracked + len(candidates)).
        """
        wanted = set(candidates)
        if not wanted:
            raise ValueError("select_victim: no candidates to evict")
        for uid in self._order:
            if uid in wanted:
                self.eviction_count += 1
                return uid
        for base in (BASE_MODEL, None):
            if base in wanted:
                self.eviction_count += 1
                return base
        raise ValueError(
            f"select_victim: none of the candidates {wanted} is tracked by the {self.name} "
            "policy, and the base model is not among them"
        )

    def remove(self, uid: Hashable) -> None:
        """Stop tracking ``uid``; an untracked id (or the base model) is ignored. O(1)."""
        self._order.pop(uid, None)

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
        if _is_base_model(uid):
            return
        self._order[uid] = None
        self._order.move_to_end(uid)


class FifoLoraPolicy(LoraEvictionPolicy):
    """First in, first out: ``mark_used`` appends an untracked id and leaves a tracked one."""

    name = "fifo"

    def mark_used(self, uid: Hashable) -> None:
        if not _is_base_model(uid) and uid not in self._order:
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


def get_eviction_policy(policy_name: str) -> LoraEvictionPolicy:
    """SGLang's factory name (``sglang.srt.lora.eviction_policy``): a fresh policy for
    ``policy_name`` (``"lru"`` or ``"fifo"``).

    Raises:
        TypeError / ValueError: as :func:`make_lora_eviction_policy`, naming ``policy_name``.
    """
    return make_lora_eviction_policy(policy_name, "policy_name")
