"""FIFO free list over the ids ``1..capacity`` with vectorised misuse detection.

This is the single owner of "which ids are free" for every allocator in this package: the
token allocator (ids are KV slots), the paged allocator (ids are pages) and the state pool
(ids are state slots). Id 0 is never handed out (padding).

Order rule (what callers may rely on)::

    free list = [f_0, f_1, ..., f_{num_free-1}]     (front first; a ring buffer)

    take(k)     removes and returns f_0 .. f_{k-1}, in order          (front)
    take_one()  take(1) as an int; release_one(i): release of one int  (no tensors)
    release(x)  appends x, in the order given                         (back: FIFO reuse)
    restore(x)  prepends x, in the order given                        (front: exact undo)

Initially the order is ``1, 2, ..., capacity``. A ``take`` followed by ``restore`` of the
same ids (undone in reverse order, with no other ``take`` in between) leaves the free list
exactly as before, which is what makes a rolled-back transaction invisible.

Costs: ``take(k)`` is O(k); ``release``/``restore`` of n ids are O(n); all numpy-vectorised,
no Python loop per id, no allocation besides the result. Only ``reset``, ``free_order``,
``check`` and ``snapshot`` are O(capacity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:  # frees in one C pass (allocators/_release.c), built by ``pip install``
    from allocators._release import checked as _checked_c
    from allocators._release import release as _release_c
    from allocators._release import release_held as _release_held_c
except ImportError:  # pragma: no cover - no compiler at install time: the numpy path
    _checked_c = None
    _release_c = None
    _release_held_c = None


def free_list_bytes(capacity: int) -> int:
    """Bytes a :class:`FreeList` of ``capacity`` ids allocates: the int64 ring, the free mask
    and the int32 (int64 from 2**31 ids) duplicate-detection stamps."""
    return 8 * capacity + (1 + (8 if capacity >= 2**31 else 4)) * (capacity + 1)


@dataclass(frozen=True)
class AllocatorSnapshot:
    """The complete bookkeeping state of an allocator, hashable and comparable with ``==``.

    Two snapshots are equal iff the allocators would answer every future call identically.
    Tensor contents of pools (KV data, Mamba states) are not part of a snapshot.

    Attributes:
        kind: the allocator class name.
        capacity: number of ids managed (pages for a paged allocator, else slots).
        page_size: tokens per id (1 unless paged).
        num_used: ids currently handed out (counter).
        free_order: the logical free list as little-endian int64 bytes, front first.
        free_mask: the ``is_free`` mask (``capacity + 1`` bools) as bytes.
    """

    kind: str
    capacity: int
    page_size: int
    num_used: int
    free_order: bytes
    free_mask: bytes

    def free_ids(self) -> list[int]:
        """The free list as Python ints, front first (for messages and tests)."""
        return np.frombuffer(self.free_order, dtype="<i8").tolist()


class FreeList:
    """Free ids ``1..capacity`` kept in FIFO order, plus an ``is_free`` mask.

    Storage: a ring buffer of ``capacity`` int64 entries (the free list can never be longer)
    holding the free ids from ``head`` for ``num_free`` entries, wrapping around. Memory is
    fixed at ``capacity * (8 + 1 + 4)`` bytes: ring, mask, duplicate-detection scratch.

    Args:
        capacity: number of ids (``> 0``; validated by the owner).
        unit: what an id is, for messages (``"slot"``, ``"page"``).

    All tensors given to or returned by this class are CPU ``torch.int64`` 1-D tensors.
    """

    def __init__(self, capacity: int, unit: str) -> None:
        self._capacity = capacity
        self._unit = unit
        self._ring = np.empty(capacity, dtype=np.int64)
        self._head = 0
        self._is_free = np.zeros(capacity + 1, dtype=np.bool_)
        # Scratch for O(n) duplicate detection; its contents are never part of the state.
        self._stamp = np.empty(capacity + 1, dtype=np.int64 if capacity >= 2**31 else np.int32)
        #: The ring's and the mask's addresses (:meth:`release_held_at`; both arrays live as
        #: long as the free list and are only ever written in place)
        self._ring_at: int = self._ring.ctypes.data
        self._free_at: int = self._is_free.ctypes.data
        self._num_free = 0
        self._num_used = 0
        self.reset()

    # ---------------------------------------------------------------- counters
    @property
    def capacity(self) -> int:
        """Number of ids managed."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """Ids currently free. O(1)."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Ids currently handed out. O(1)."""
        return self._num_used

    # ---------------------------------------------------------------- mutation
    def reset(self) -> None:
        """Make every id free again, in the initial order ``1..capacity``. O(capacity)."""
        self._ring[:] = np.arange(1, self._capacity + 1, dtype=np.int64)
        self._head = 0
        self._is_free[:] = True
        self._is_free[0] = False
        self._num_free = self._capacity
        self._num_used = 0

    def take(self, k: int) -> torch.Tensor | None:
        """Remove and return the first ``k`` free ids (``k >= 0``), or ``None`` if fewer are free.

        On ``None`` nothing changes. The result is a new tensor the free list does not keep.
        """
        if k > self._num_free:
            return None
        out = self._read(self._head, k)
        self._head = (self._head + k) % self._capacity
        self._is_free[out] = False
        self._num_free -= k
        self._num_used += k
        return torch.from_numpy(out)

    def release(self, ids: torch.Tensor) -> None:
        """Free ``ids`` by appending them (in the given order) to the back of the free list.

        Raises:
            ValueError: ``foreign index`` (outside ``1..capacity``) or ``double free``
                (already free, or repeated within ``ids``). Nothing changes on error.
        """
        n = ids.numel()
        if n == 0:
            return
        if _checked_c is not None and ids.dtype is torch.int64 and ids.is_contiguous() \
                and ids.is_cpu:
            # One C pass: checks, marks and the ring write (-1: a bad id, nothing changed).
            k = _checked_c(ids.data_ptr(), n, self._ring,
                           (self._head + self._num_free) % self._capacity, self._is_free)
            if k == n:
                self._num_free += n
                self._num_used -= n
                return
            self.validate_release(ids)  # names the bad id (the C pass only refuses it)
            raise AssertionError(f"the C release refused ids the numpy check accepts: {ids}")
        arr = ids.numpy()
        self.validate_release(ids)
        self._write((self._head + self._num_free) % self._capacity, arr)
        self._mark_free(arr)

    def release_owned(self, arr: np.ndarray) -> None:
        """Free ids the caller provably holds (the cache freeing its own nodes' slots):
        like :meth:`release` without the checks. Misuse is caught by ``check()`` and the
        cache's ``sanity_check``, not here."""
        if arr.size == 0:
            return
        self._write((self._head + self._num_free) % self._capacity, arr)
        self._mark_free(arr)

    def release_owned_at(self, src: int, n: int, page_size: int) -> bool:
        """:meth:`release_owned` of the ids of ``n`` int64 slots at address ``src`` (a CPU,
        contiguous tensor's ``data_ptr()``, kept alive by the caller): the id of each page
        of ``page_size`` slots is its first slot // ``page_size``, as the allocators' pages.
        One C pass writes the ring and the mask (``allocators/_release.c``).

        Returns ``False``, changing nothing, when the C extension is not built (the caller
        then frees through :meth:`release_owned`).

        Raises:
            ValueError: an id outside ``1..capacity`` (nothing changes): the memory is not
                what the caller said.
        """
        if _release_c is None:
            return False
        k = _release_c(src, n, page_size, self._ring,
                       (self._head + self._num_free) % self._capacity, self._is_free)
        self._num_free += k
        self._num_used -= k
        return True

    def release_held_at(self, src: int, n: int, page_size: int, held: int,
                        held_bytes: int) -> bool:
        """:meth:`release_owned_at` together with the clearing of the owner's held marks (at
        address ``held``, ``held_bytes`` bytes of a live array: one bit per id, bit ``id & 7``
        of byte ``id >> 3``): a node's slots leaving the radix tree, in one C call
        (``allocators/_release.c`` ``release_held``), appended at the back in the node's
        order like :meth:`release`.

        Returns ``False``, changing nothing, when the C extension is not built or when an id
        is outside ``1..capacity`` or the marks, not marked held, already free or repeated:
        the caller then takes its general path (clear the marks, :meth:`release_owned`),
        whose behaviour on such ids is the reference.
        """
        if _release_held_c is None:
            return False
        cap = self._capacity
        k = _release_held_c(src, n, page_size, held, held_bytes, self._ring_at, cap,
                            (self._head + self._num_free) % cap, self._free_at)
        if k < 0:
            return False
        self._num_free += k
        self._num_used -= k
        return True

    def restore(self, ids: torch.Tensor) -> None:
        """Undo a ``take``: prepend ``ids`` (in the given order) to the front of the free list.

        Raises the same errors as :meth:`release`, changing nothing on error.
        """
        if ids.numel() == 0:
            return
        arr = ids.numpy()
        self.validate_release(ids)
        self._head = (self._head - arr.size) % self._capacity
        self._write(self._head, arr)
        self._mark_free(arr)

    def withdraw(self, ids: np.ndarray) -> None:
        """Remove the free ``ids`` from wherever they are in the free list (the rest keep
        their order); from then on they count as used until :meth:`release` gives them back
        (at the back). What an arena does when it hands ids' memory to another pool
        (``allocators.arena``). O(num_free).

        Raises:
            ValueError: an id outside ``1..capacity``, not free, or repeated (nothing changes).
        """
        if ids.size == 0:
            return
        if ((ids < 1) | (ids > self._capacity)).any():
            raise ValueError(f"withdraw: a {self._unit} id is outside 1..{self._capacity}")
        if not self._is_free[ids].all():
            bad = int(ids[~self._is_free[ids]][0])
            raise ValueError(f"withdraw: {self._unit} {bad} is not free")
        pos = np.arange(ids.size, dtype=self._stamp.dtype)
        self._stamp[ids] = pos
        if (self._stamp[ids] != pos).any():
            raise ValueError(f"withdraw: a {self._unit} id is repeated")
        order = self.free_order()
        self._is_free[ids] = False
        keep = order[self._is_free[order]]
        self._ring[: keep.size] = keep
        self._head = 0
        self._num_free = keep.size
        self._num_used += ids.size

    def take_one(self) -> int | None:
        """``take(1)`` as a Python ``int`` (no tensor, no array): the front id, or ``None``
        when none is free. O(1)."""
        if not self._num_free:
            return None
        i = int(self._ring[self._head])
        self._head = (self._head + 1) % self._capacity
        self._is_free[i] = False
        self._num_free -= 1
        self._num_used += 1
        return i

    def release_one(self, i: int) -> None:
        """``release`` of the single id ``i`` (a Python ``int``): appended to the back, with
        the same checks and messages as :meth:`release`, as scalar comparisons. O(1).

        Raises:
            ValueError: ``foreign index`` or ``double free``; nothing changes then.
        """
        if not 1 <= i <= self._capacity:
            raise ValueError(
                f"foreign index: {self._unit} {i} is not in 1..{self._capacity}"
                f" (0 is the padding {self._unit} and is never allocated)"
            )
        if self._is_free[i]:
            raise ValueError(f"double free: {self._unit} {i} is already free")
        self._ring[(self._head + self._num_free) % self._capacity] = i
        self._is_free[i] = True
        self._num_free += 1
        self._num_used -= 1

    def _mark_free(self, arr: np.ndarray) -> None:
        self._is_free[arr] = True
        self._num_free += arr.size
        self._num_used -= arr.size

    def _read(self, start: int, k: int) -> np.ndarray:
        """Copy ``k`` ring entries from ``start``, wrapping around."""
        end = start + k
        if end <= self._capacity:
            return self._ring[start:end].copy()
        return np.concatenate((self._ring[start:], self._ring[: end - self._capacity]))

    def _write(self, start: int, arr: np.ndarray) -> None:
        """Write ``arr`` into the ring from ``start``, wrapping around."""
        first = self._capacity - start
        if arr.size <= first:
            self._ring[start : start + arr.size] = arr
            return
        self._ring[start:] = arr[:first]
        self._ring[: arr.size - first] = arr[first:]

    # ---------------------------------------------------------------- queries
    def validate_release(self, ids: torch.Tensor) -> None:
        """Raise ``ValueError`` unless every id is in use and appears once. O(n), no mutation."""
        arr = ids.numpy()
        if arr.size == 0:
            return
        if arr.size == 1:  # one id (a state slot, a page): the same checks as scalars
            i = int(arr[0])
            if 1 <= i <= self._capacity and not self._is_free[i]:
                return
        out_of_range = (arr < 1) | (arr > self._capacity)
        if out_of_range.any():
            bad = int(arr[out_of_range.argmax()])
            raise ValueError(
                f"foreign index: {self._unit} {bad} is not in 1..{self._capacity}"
                f" (0 is the padding {self._unit} and is never allocated)"
            )
        already = self._is_free[arr]
        if already.any():
            bad = int(arr[already.argmax()])
            raise ValueError(f"double free: {self._unit} {bad} is already free")
        pos = np.arange(arr.size, dtype=self._stamp.dtype)
        self._stamp[arr] = pos
        repeated = self._stamp[arr] != pos
        if repeated.any():
            bad = int(arr[repeated.argmax()])
            raise ValueError(f"double free: {self._unit} {bad} appears more than once in one call")

    def holds(self, i: int) -> bool:
        """Whether id ``i`` (a Python int) is in ``1..capacity`` and handed out. O(1)."""
        return 1 <= i <= self._capacity and not self._is_free[i]

    def in_use(self, ids: torch.Tensor) -> np.ndarray:
        """Boolean array: which of ``ids`` are in ``1..capacity`` and currently handed out."""
        arr = ids.numpy()
        ok = (arr >= 1) & (arr <= self._capacity)
        ok[ok] = ~self._is_free[arr[ok]]
        return ok

    def free_mask(self) -> np.ndarray:
        """A read-only live view of the ``is_free`` mask (``capacity + 1`` bools, index 0
        never free): it follows every later ``take`` / ``release``. O(1)."""
        view = self._is_free.view()
        view.flags.writeable = False
        return view

    def free_order(self) -> np.ndarray:
        """The logical free list, front first, as a new int64 numpy array. O(num_free)."""
        return self._read(self._head, self._num_free)

    def snapshot(self, kind: str, page_size: int) -> AllocatorSnapshot:
        """Full bookkeeping state (see :class:`AllocatorSnapshot`). O(capacity)."""
        return AllocatorSnapshot(
            kind=kind,
            capacity=self._capacity,
            page_size=page_size,
            num_used=self._num_used,
            free_order=self.free_order().astype("<i8").tobytes(),
            free_mask=self._is_free.tobytes(),
        )

    def check(self, owner: str) -> None:
        """Recompute every invariant from scratch. O(capacity log capacity).

        Invariants: ``num_free + num_used == capacity``; the free list holds ids in
        ``1..capacity`` with no duplicate; the mask marks exactly the listed ids free (never 0);
        the counters match the list and the mask; the ring head is in range.

        Raises:
            AssertionError: with a dump of the state, naming each broken invariant.
        """
        problems: list[str] = []
        if not 0 <= self._head < self._capacity or not 0 <= self._num_free <= self._capacity:
            problems.append(f"ring head={self._head} / num_free={self._num_free} out of range")
            order = np.empty(0, dtype=np.int64)
        else:
            order = self.free_order()
        if self._num_free + self._num_used != self._capacity:
            problems.append("num_free + num_used != capacity")
        if order.size != self._num_free:
            problems.append(f"free list holds {order.size} ids but num_free={self._num_free}")
        if order.size and (order.min() < 1 or order.max() > self._capacity):
            problems.append("free list holds an id outside 1..capacity")
        elif order.size:
            uniq, counts = np.unique(order, return_counts=True)
            if uniq.size != order.size:
                problems.append(f"duplicate free ids {uniq[counts > 1][:16].tolist()}")
            if not self._is_free[order].all():
                problems.append("a listed id is not marked free in the mask")
        mask_free = int(self._is_free.sum())
        if self._is_free[0]:
            problems.append(f"padding {self._unit} 0 is marked free")
        if mask_free != order.size:
            problems.append(f"mask marks {mask_free} ids free, list holds {order.size}")
        if self._capacity - mask_free != self._num_used:
            problems.append(
                f"mask implies {self._capacity - mask_free} used, num_used={self._num_used}"
            )
        if problems:
            raise AssertionError(f"{owner} invariant broken: {'; '.join(problems)}\n{self.dump()}")

    def dump(self, limit: int = 32) -> str:
        """A short human-readable description of the state, for failure messages."""
        ok = 0 <= self._head < self._capacity and 0 <= self._num_free <= self._capacity
        head = self._read(self._head, min(limit, self._num_free)).tolist() if ok else "?"
        return (
            f"  capacity={self._capacity} unit={self._unit} num_free={self._num_free}"
            f" num_used={self._num_used} mask_free={int(self._is_free.sum())}\n"
            f"  ring head={self._head}\n"
            f"  free order (first {limit})={head}"
        )
