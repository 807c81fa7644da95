"""All-or-nothing allocation over several allocators.

One engine step may need slots from several pools (full KV, SWA KV, a state slot). Either it
gets all of them, or every allocator is left exactly as before (``snapshot()`` equal) and the
caller sees a clean failure.

The rule::

    with AllocTxn() as t:
        kv = t.alloc(kv_allocator, n)      # tensor, or None on shortage
        st = t.alloc(state_pool, 1)
        if kv is None or st is None:
            return None                    # leaving without commit(): everything given back
        kv, st = t.commit()                # the slots now belong to the caller

* Leaving the ``with`` block without a successful ``commit()`` -- normally, by ``return``, or
  by an exception -- gives back everything the transaction took (``rollback()``); an
  exception still propagates.
* Once one ``t.alloc`` returns ``None`` the transaction has *failed*: later ``t.alloc`` calls
  return ``None`` without touching any allocator, and ``commit()`` raises ``RuntimeError``. To
  retry after evicting, start a new transaction.
* ``commit()`` returns the tensors in ``t.alloc`` call order. After ``commit()`` or
  ``rollback()`` the transaction is closed: ``alloc``/``commit`` raise ``RuntimeError``,
  ``rollback()`` after a rollback is a no-op, after a commit raises ``RuntimeError``.

Rollback uses :meth:`SlotAllocator.undo_alloc` in reverse order, which puts the slots back at
the front of each free list, so the allocators' states (including free-list order) are
exactly restored -- provided nobody else allocated from them inside the block.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import torch

from .base import SlotAllocator

__all__ = ["AllocTxn", "alloc_all"]

_OPEN, _COMMITTED, _ROLLED_BACK = "open", "committed", "rolled back"


class AllocTxn:
    """A transaction collecting ``alloc`` results from any :class:`SlotAllocator`.

    Use it as a context manager (see the module docstring for the rule). Outside a ``with``
    block nothing is rolled back automatically.
    """

    def __init__(self) -> None:
        self._taken: list[tuple[SlotAllocator, torch.Tensor]] = []
        self._failed = False
        self._state = _OPEN

    @property
    def failed(self) -> bool:
        """True once an ``alloc`` in this transaction returned ``None``."""
        return self._failed

    @property
    def state(self) -> str:
        """``"open"``, ``"committed"`` or ``"rolled back"``."""
        return self._state

    def alloc(self, allocator: SlotAllocator, n: int) -> torch.Tensor | None:
        """``allocator.alloc(n)``, remembered for rollback.

        Returns:
            The slot tensor, or ``None`` on shortage or if the transaction already failed
            (then no allocator is touched).

        Raises:
            TypeError: ``allocator`` is not a :class:`SlotAllocator`.
            RuntimeError: the transaction is closed.
            Whatever ``allocator.alloc`` raises for a bad ``n`` (inside a ``with`` block this
            then rolls everything back).
        """
        if not isinstance(allocator, SlotAllocator):
            raise TypeError(f"allocator must be a SlotAllocator, got {type(allocator).__name__}")
        self._require_open("alloc")
        if self._failed:
            return None
        slots = allocator.alloc(n)
        if slots is None:
            self._failed = True
            return None
        self._taken.append((allocator, slots))
        return slots

    def commit(self) -> list[torch.Tensor]:
        """Keep everything taken; return the tensors in ``alloc`` call order.

        Raises:
            RuntimeError: an ``alloc`` failed (nothing may be committed), or the transaction
                is closed.
        """
        self._require_open("commit")
        if self._failed:
            raise RuntimeError("cannot commit: an alloc in this transaction returned None")
        self._state = _COMMITTED
        return [slots for _, slots in self._taken]

    def rollback(self) -> None:
        """Give back everything taken, newest first, restoring each allocator exactly.

        No-op if already rolled back. If an ``undo_alloc`` raises (someone freed those slots
        meanwhile), the remaining ones are still undone and the first error is re-raised as
        ``RuntimeError``.

        Raises:
            RuntimeError: the transaction was committed, or an undo failed.
        """
        if self._state == _ROLLED_BACK:
            return
        if self._state == _COMMITTED:
            raise RuntimeError("cannot roll back a committed transaction")
        self._state = _ROLLED_BACK
        first_error: Exception | None = None
        while self._taken:
            allocator, slots = self._taken.pop()
            try:
                allocator.undo_alloc(slots)
            except (TypeError, ValueError) as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise RuntimeError(f"rollback could not give back some slots: {first_error}") from (
                first_error
            )

    def __enter__(self) -> AllocTxn:
        self._require_open("enter")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == _OPEN:
            self.rollback()

    def __repr__(self) -> str:
        return f"AllocTxn(state={self._state!r}, failed={self._failed}, allocs={len(self._taken)})"

    def _require_open(self, action: str) -> None:
        if self._state != _OPEN:
            raise RuntimeError(f"cannot {action}: transaction is {self._state}")


def alloc_all(requests: Sequence[tuple[SlotAllocator, int]]) -> list[torch.Tensor] | None:
    """Atomically ``alloc`` from several allocators.

    Args:
        requests: ``(allocator, n)`` pairs; an allocator may appear more than once.

    Returns:
        One tensor per request, in order; or ``None`` if any allocation fails, in which case
        every allocator is exactly as before.

    Raises:
        Whatever an ``alloc`` raises for a bad argument; everything is given back first.
    """
    with AllocTxn() as txn:
        for allocator, n in requests:
            if txn.alloc(allocator, n) is None:
                return None
        return txn.commit()
    raise AssertionError("unreachable")  # pragma: no cover - the with block always returns
