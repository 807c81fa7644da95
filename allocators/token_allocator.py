"""Token-level and paged KV slot allocators over a fixed pool.

Index space (``page_size = P``, ``num_pages = size // P``)::

    slot id:  0 .. P-1 | P .. 2P-1 | 2P .. 3P-1 | ... | num_pages*P .. (num_pages+1)*P - 1
    page id:  0 (pad)  | 1         | 2          | ... | num_pages
              never handed out        handed out as whole pages

    TokenAllocator is the case P = 1: slot ids 1..size, slot 0 is padding.

Free-list order (both classes; see :mod:`allocators.free_list`): initially ascending;
``alloc`` takes from the front; ``free`` appends to the back in the order given (so freed
slots are reused only after every slot that was already free); ``undo_alloc`` puts slots back
at the front. Example::

    a = TokenAllocator(4)
    a.alloc(3)                    # tensor([1, 2, 3])     free list: [4]
    a.free(torch.tensor([2]))     #                       free list: [4, 2]
    a.alloc(2)                    # tensor([4, 2])        free list: []

Bookkeeping stays on the host (numpy ring buffer + ``is_free`` mask), also for a CUDA
``device``, and never reads the device: ``alloc`` uploads the ids it took through pinned
staging (``allocators.staging.upload``: a ``non_blocking`` copy on the current stream) and
keeps their host mirror (``allocators.host_mirror``); ``free`` / ``free_owned`` /
``undo_alloc`` of a tensor the library made (an ``alloc`` result, a node's slots, slices and
:func:`~allocators.host_mirror.cat_slots` of them) read that mirror. Zero host
synchronisations per call; a device tensor without a mirror costs one device -> host copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ._checks import as_index_tensor, check_device, check_int, check_positive_int
from .base import AllocatorSnapshot, SlotAllocator
from .free_list import FreeList, free_list_bytes
from .host_mirror import host_ids, register
from .kv_pool import KVBuffers, KVPool, KVStorage
from .memory import HOST, check_memory
from .staging import upload

__all__ = ["PagedAllocator", "SlotAllocator", "TokenAllocator"]


class _FreeListAllocator(SlotAllocator):
    """A :class:`SlotAllocator` handing out whole pages from a :class:`FreeList` of page ids.

    Args:
        num_pages: pages that can be handed out (page ids ``1..num_pages``).
        page_size: slots per page (1 for token-level and state allocators).
        device: where ``alloc`` results are placed.
        unit: the name of an id in error messages.
    """

    def __init__(self, num_pages: int, page_size: int, device: torch.device, unit: str) -> None:
        check_memory(free_list_bytes(num_pages),
                     f"{type(self).__name__}(size={num_pages * page_size:,})", HOST)
        self._page_size = page_size
        self._device = device
        self._pages = FreeList(num_pages, unit)
        self._free_mask = self._pages.free_mask()
        self._arange_page = torch.arange(page_size, dtype=torch.int64)
        #: ``alloc`` results go to a device other than the host (uploaded, mirrored)
        self._on_device = device.type != "cpu"

    # ------------------------------------------------------------------ facts
    @property
    def pages(self) -> FreeList:
        """The free list of page ids (``1..num_pages``) this allocator hands out: the page level
        a composite allocator (``allocators.swa.SWAAllocator``: two of them freed together)
        validates, releases and restores through, and a test inspects."""
        return self._pages

    @property
    def size(self) -> int:
        return self._pages.capacity * self._page_size

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def device(self) -> torch.device:
        return self._device

    def available_size(self) -> int:
        return self._pages.num_free * self._page_size

    def used_size(self) -> int:
        return self._pages.num_used * self._page_size

    # ------------------------------------------------------------------ actions
    def can_alloc(self, n: int) -> bool:
        return self._num_pages_for(n) <= self._pages.num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        pages = self._pages.take(self._num_pages_for(n))
        if pages is None:
            return None
        slots = self._pages_to_slots(pages)
        if not self._on_device:
            self._on_alloc(slots)
            return slots
        dev = self._to_device(slots.numpy())  # a fresh array: the mirror owns it from here on
        self._on_alloc(dev)
        return dev

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        """Slot ids ``host`` just taken as a tensor on ``device``: uploaded, mirrored."""
        return register(upload(host, self._device), host)

    def free(self, indices: torch.Tensor) -> None:
        pages = self.slots_to_pages(as_index_tensor(indices, "indices"))
        self._pages.release(pages)

    def free_owned(self, indices: torch.Tensor | int) -> None:
        """Free slots the caller provably holds, skipping the foreign / double-free checks
        (the radix cache frees its own nodes' slots this way). Same order as :meth:`free`.
        One ``int`` id (a state slot) keeps the two checks: as scalar compares they cost
        less than the array they would spare. A CPU tensor's memory is read in one C pass
        (``FreeList.release_owned_at``); a device tensor's host mirror, or a tensor of
        another layout, goes through numpy. Not a 1-D int64 tensor or an int: ``TypeError`` /
        ``ValueError`` naming ``indices``, nothing freed."""
        if type(indices) is int and self._page_size == 1:  # one state slot: no array
            self._pages.release_one(indices)
            return
        if type(indices) is torch.Tensor and indices.is_cpu and indices.dtype is torch.int64 \
                and indices.is_contiguous() and indices.dim() == 1 and self._pages.release_owned_at(
                    indices.data_ptr(), indices.shape[0], self._page_size):
            return
        if isinstance(indices, int) and not isinstance(indices, bool):
            arr = np.array([indices], dtype=np.int64)
        else:  # the argument's kind is checked (cheap), its values are trusted
            arr = as_index_tensor(indices, "indices").numpy()
        if self._page_size != 1:
            arr = arr[:: self._page_size] // self._page_size
        self._pages.release_owned(arr)

    def owned_release(self) -> Callable[[int, int, int, int, int], bool] | None:
        """The free list's :meth:`FreeList.release_held_at`: ``f(src, n, page_size, held,
        held_bytes)`` frees the ``n`` int64 slots at address ``src`` that a cache holds (a
        CPU node's ``array('q')``: ``buffer_info()[0]``; or a contiguous tensor's
        ``data_ptr()``) and clears their bits in the cache's held
        marks (a uint8 array at address ``held``, ``held_bytes`` long, one bit per id: slots,
        or pages when paged; kept alive by the caller), in one C call; it returns ``False``,
        changing nothing, when it cannot (no C extension; an id not held, free, repeated or
        outside): the caller then clears its marks itself and calls :meth:`free_owned`. Page
        ids are the first slot of each page // ``page_size``, as in :meth:`free_owned`.

        ``None`` when this allocator's ``free_owned`` is not this class's own (a subclass or
        an instance that replaced it must see every free)."""
        if getattr(self.free_owned, "__func__", None) is not _FreeListAllocator.free_owned:
            return None
        return self._pages.release_held_at

    def undo_alloc(self, indices: torch.Tensor) -> None:
        pages = self.slots_to_pages(as_index_tensor(indices, "indices"))
        self._pages.restore(pages)

    def clear(self) -> None:
        self._pages.reset()

    @property
    def free_mask(self) -> np.ndarray:
        """Read-only live view: ``free_mask[i]`` is True while id ``i`` is free, ids being
        pages when paged (slot ``s`` is in page ``s // page_size``) and slots otherwise;
        ``num ids + 1`` entries, index 0 (padding) never free.

        For vectorised ownership checks on hot paths (the radix cache checks that slots it
        adopts are handed out with one gather). O(1); the view follows every later call.
        """
        return self._free_mask

    def is_free(self, indices: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which of ``indices`` (in-range slot ids) are currently free.

        Used by cache invariant checks (a slot the tree holds must not be free). O(len).
        """
        pages = host_ids(indices, "indices") // self._page_size
        return torch.from_numpy(self._free_mask[pages])

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        self._pages.check(type(self).__name__)

    def snapshot(self) -> AllocatorSnapshot:
        return self._pages.snapshot(type(self).__name__, self._page_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self._page_size},"
            f" available={self.available_size()}, device={self._device})"
        )

    # ------------------------------------------------------------------ hooks
    def _on_alloc(self, slots: torch.Tensor) -> None:
        """Called with the slot ids just taken, on ``device``, before they are returned."""

    # ------------------------------------------------------------------ page <-> slot
    def _num_pages_for(self, n: int) -> int:
        n = check_int(n, "n", minimum=0)
        if n % self._page_size:
            raise ValueError(f"n={n} is not a multiple of page_size={self._page_size}")
        return n // self._page_size

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self._page_size == 1:
            return pages
        return (pages[:, None] * self._page_size + self._arange_page).reshape(-1)

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Validate slot ids (a 1-D CPU int64 tensor) as whole pages and return their page ids
        (CPU int64); no mutation. Raises ``ValueError`` naming a foreign slot or a partial page.

        Range errors are reported here in slot terms (``foreign index``); ``double free`` is
        detected by the free list on the page ids.
        """
        p = self._page_size
        if p == 1 or slots.numel() == 0:
            return slots
        high = (self._pages.capacity + 1) * p
        out_of_range = (slots < p) | (slots >= high)
        if bool(out_of_range.any()):
            bad = int(slots[out_of_range][0])
            raise ValueError(
                f"foreign index: slot {bad} is not in [{p}, {high}) (page 0 is padding)"
            )
        if slots.numel() % p:
            raise ValueError(
                f"partial page: {slots.numel()} slots is not a multiple of page_size={p}"
            )
        rows = slots.view(-1, p)
        starts = rows[:, 0]
        misaligned = starts % p != 0
        if bool(misaligned.any()):
            bad = int(starts[misaligned][0])
            raise ValueError(f"partial page: run starting at slot {bad} is not page-aligned")
        broken = (rows != starts[:, None] + self._arange_page).any(dim=1)
        if bool(broken.any()):
            bad = int(starts[broken][0])
            raise ValueError(
                f"partial page: slots from {bad} are not the {p} contiguous slots of one page"
            )
        return starts // p


def _check_pool(pool: object, rows_needed: int) -> KVStorage | None:
    if pool is None:
        return None
    if not isinstance(pool, (KVPool, KVBuffers)):
        raise TypeError(
            f"pool must be a KVPool, a KVBuffers (an engine's own per-layer K/V tensors) or "
            f"None, got {type(pool).__name__}"
        )
    if pool.num_slots < rows_needed:
        raise ValueError(
            f"pool has {pool.num_slots} slot rows but the allocator hands out ids up to"
            f" {rows_needed - 1}; build it as KVPool(size, ..., page_size=page_size)"
        )
    return pool


class TokenAllocator(_FreeListAllocator):
    """Token-level (``page_size == 1``) KV slot allocator: slot ids ``1..size``.

    Args:
        size: slots that can be handed out (``> 0``).
        pool: optional :class:`KVPool` these slots index (needs ``>= size + 1`` rows), or
            :class:`KVBuffers` over the engine's own per-layer tensors; kept as ``self.pool``
            so the cache can find the tensors (the host tier copies them). Not touched by the
            allocator.
        device: device of returned index tensors (``str`` or ``torch.device``).

    Raises:
        TypeError / ValueError: bad argument, naming it.

    ``alloc(n)`` is O(n) and ``free(t)`` is O(len(t)), both vectorised: suitable for pools
    of tens of millions of slots.
    """

    def __init__(
        self, size: int, pool: KVStorage | None = None, device: str | torch.device = "cpu"
    ) -> None:
        size = check_positive_int(size, "size")
        super().__init__(size, 1, check_device(device), "slot")
        self.pool = _check_pool(pool, size + 1)


class PagedAllocator(_FreeListAllocator):
    """Paged KV slot allocator: hands out whole pages of ``page_size`` contiguous slots.

    Page ``k`` (``1 <= k <= size // page_size``) is the slots
    ``k*page_size .. k*page_size + page_size - 1``; page 0 is padding. ``alloc(n)`` returns the
    slots of ``n // page_size`` pages, each page ascending, pages in free-list order.

    Args:
        size: slots that can be handed out; a positive multiple of ``page_size``.
        page_size: slots per page (``> 0``).
        pool: optional :class:`KVPool` (needs ``>= size + page_size`` rows, i.e.
            ``KVPool(size, ..., page_size=page_size)``), kept as ``self.pool``.
        device: device of returned index tensors.

    Raises:
        TypeError / ValueError: bad argument (``size`` not a multiple of ``page_size``, ...).

    ``alloc(n)`` raises ``ValueError`` unless ``n % page_size == 0``; ``free(indices)``
    raises ``ValueError("partial page: ...")`` unless ``indices`` is a concatenation of whole
    pages, each page's slots contiguous and ascending from a page-aligned start.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        pool: KVStorage | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        size = check_positive_int(size, "size")
        page_size = check_positive_int(page_size, "page_size")
        if size % page_size:
            raise ValueError(f"size={size} is not a multiple of page_size={page_size}")
        super().__init__(size // page_size, page_size, check_device(device), "page")
        self.pool = _check_pool(pool, size + page_size)

    @property
    def num_pages(self) -> int:
        """Pages that can be handed out (page ids ``1..num_pages``)."""
        return self._pages.capacity
