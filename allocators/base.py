"""The allocator contract: ``n -> slots | None``.

Every allocator in this package (:class:`~allocators.token_allocator.TokenAllocator`,
:class:`~allocators.token_allocator.PagedAllocator`,
:class:`~allocators.state_pool.MambaStatePool`) implements :class:`SlotAllocator`, and
:class:`~allocators.txn.AllocTxn` works over any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .free_list import AllocatorSnapshot

__all__ = ["AllocatorSnapshot", "SlotAllocator"]


class SlotAllocator(ABC):
    """Hands out slot ids of a fixed pool; the pool's tensors are indexed by those ids.

    Index meaning: a slot id is a row of the pool's tensors (``[size + page_size, ...]`` rows
    for KV, ``[size + 1, ...]`` for states). Slot 0 (page 0 when paged) is the padding slot:
    it is never handed out, and freeing it is a ``foreign index`` error.

    Units: ``n``, ``size``, ``available_size()``, ``used_size()`` are in slots (= tokens for
    KV allocators). ``page_size`` is tokens per page (1 unless paged).

    Ownership: slots returned by ``alloc`` belong to the caller until it passes them to
    ``free`` or ``undo_alloc``; the allocator never reclaims them on its own, and the pool
    never overwrites them (except :class:`MambaStatePool`, which zeroes a slot's state when
    it hands it out). Returned tensors are new tensors the allocator does not keep; tensors
    passed to ``free`` are copied, so the caller may reuse them afterwards.

    Errors: shortage is expected and returns ``None`` (nothing taken, never a partial result).
    Misuse raises: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a bad value
    (negative ``n``, 2-D indices, ``foreign index``, ``double free``, partial page). A call
    that raises changes nothing (``snapshot()`` is unchanged).
    """

    # ------------------------------------------------------------------ facts
    @property
    @abstractmethod
    def size(self) -> int:
        """Capacity in slots (tokens for KV): the number of slots that can be handed out."""

    @property
    @abstractmethod
    def page_size(self) -> int:
        """Tokens per page: ``alloc``/``free`` work in whole pages of this many slots."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device of the index tensors returned by ``alloc``."""

    # ------------------------------------------------------------------ queries
    @abstractmethod
    def available_size(self) -> int:
        """Free slots right now. O(1)."""

    @abstractmethod
    def used_size(self) -> int:
        """Slots handed out and not yet freed. ``available_size() + used_size() == size``. O(1)."""

    @abstractmethod
    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed now. O(1). Raises exactly as ``alloc`` would."""

    # ------------------------------------------------------------------ actions
    @abstractmethod
    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` slots.

        Returns:
            A 1-D ``torch.int64`` tensor of ``n`` distinct slot ids on ``device``, or ``None``
            when fewer than ``n`` are free (then nothing is taken). ``alloc(0)`` returns an
            empty tensor.

        Raises:
            TypeError: ``n`` is not an int.
            ValueError: ``n < 0`` (or, paged, ``n`` not a multiple of ``page_size``).

        Complexity: O(n), vectorised.
        """

    @abstractmethod
    def free(self, indices: torch.Tensor) -> None:
        """Give slots back; they are reused after every slot already free (FIFO order).

        Args:
            indices: 1-D ``torch.int64`` tensor of slot ids currently handed out, any device.
                An empty tensor is a no-op.

        Raises:
            TypeError: not a tensor, or dtype other than ``torch.int64``.
            ValueError: not 1-D; ``foreign index`` (0 or out of range); ``double free``
                (already free, or repeated within ``indices``); paged: not whole pages.
            Nothing changes when it raises.

        Complexity: O(n), vectorised.
        """

    def free_owned(self, indices: torch.Tensor | int) -> None:
        """Free slots the caller provably holds. Subclasses may skip the boundary checks
        (foreign / double free) here; this default runs them (:meth:`free`)."""
        if isinstance(indices, int):
            indices = torch.tensor([indices], dtype=torch.int64)
        self.free(indices)

    @abstractmethod
    def undo_alloc(self, indices: torch.Tensor) -> None:
        """Give back slots from a recent ``alloc`` to the *front* of the free list.

        Undoing allocs in reverse order, with no other ``alloc`` in between, restores the
        allocator exactly (``snapshot()`` equal to before the allocs). Used by
        :class:`~allocators.txn.AllocTxn` to roll back. Validates and raises like ``free``.
        """

    @abstractmethod
    def clear(self) -> None:
        """Free every slot and restore the initial free order. O(size)."""

    # ------------------------------------------------------------------ checking
    @abstractmethod
    def check(self) -> None:
        """Recompute every invariant from scratch (free + used == capacity, no duplicate free
        id, mask agrees with the free list, padding slot never free).

        Raises:
            AssertionError: with a dump of the state. O(size log size); for tests.
        """

    @abstractmethod
    def snapshot(self) -> AllocatorSnapshot:
        """The full bookkeeping state as a hashable value; equal snapshots mean identical
        future behaviour. Pool tensor contents are not included. O(size); for tests."""
