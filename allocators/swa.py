"""Sliding-window-attention (SWA) allocator: a full KV pool and a smaller SWA KV pool behind
one ``alloc``, with a full-to-SWA slot mapping.

A hybrid model has full-attention layers (need the KV of every token) and SWA layers (need
only the last ``sliding_window_size`` tokens). Each token therefore gets a slot in the full
pool and, while it may still be inside someone's window, a slot in the (smaller) SWA pool.
Ids handed out and taken back are always **full-pool slot ids**; the SWA slot of a full slot
is found through :attr:`SWAAllocator.full_to_swa`. The idea follows SGLang's
``SWATokenToKVPoolAllocator``.

Index spaces (``P = page_size``)::

    full slot ids: P .. full_size + P - 1   (TokenAllocator / PagedAllocator of full_size)
    SWA  slot ids: P .. swa_size  + P - 1   (TokenAllocator / PagedAllocator of swa_size)
    slot 0 (page 0 when paged) is padding in both pools and is never handed out

    full_to_swa: int64 CPU tensor, full_size + P entries
        full_to_swa[f] = s   full slot f (allocated) owns the live SWA slot s
        full_to_swa[f] = 0   f is free, or its SWA slot was released by free_swa ("tombstone")

Life of a slot::

    alloc(n)        -> n full slots + n SWA slots, mapped element-wise
    free_swa(full)  -> SWA side freed, mapping cleared; full KV stays (tombstone)
    free(full)      -> full side freed, plus the SWA side where still mapped; mapping cleared

Because ``free_swa`` and ``free`` clear the mapping, a stale entry can never free an SWA slot
that was reused by a later ``alloc``. Paged: ``alloc`` maps full page ``k`` to an SWA page
``j`` slot by slot (``k*P + i -> j*P + i``), and ``free_swa`` works on whole pages, so a full
page is always either wholly mapped to one SWA page or wholly tombstoned.

Free-list order on each side is that of the inner allocators (see
:mod:`allocators.token_allocator`): initially ascending, ``alloc`` takes from the front,
``free``/``free_swa`` append to the back in the order given, ``undo_alloc`` prepends.
Example (``SWAAllocator(6, 4)``)::

    alloc(3)            # full [1, 2, 3] -> SWA [1, 2, 3]      SWA free list: [4]
    free_swa([1, 2])    # full 1, 2 tombstoned                  SWA free list: [4, 1, 2]
    alloc(2)            # full [4, 5]    -> SWA [4, 1]          SWA free list: [2]
    free([1])           # frees full slot 1 only; SWA slot 1 stays with full slot 5

Bookkeeping stays on the host (numpy free lists, the CPU mapping ``full_to_swa``). On a CUDA
``device`` the mapping also lives there (``full_to_swa_device``, what ``translate`` gathers
from, what an engine's SWA layers read once per forward step), brought up to date when it is
read: ``alloc`` / ``free`` / ``free_swa`` / ``undo_alloc`` only note on the host which full
slots changed (no CUDA call; ``alloc`` uploads its result, one memcpy), and the first read of
``full_to_swa_device`` after changes writes them all from the host mapping in one upload and
one ``index_copy_``. Ids are read on the host through their mirrors
(``allocators.host_mirror``), uploads go through pinned staging: zero host synchronisations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ._checks import as_index_tensor, check_device, check_positive_int, check_range
from .base import AllocatorSnapshot, SlotAllocator
from .host_mirror import host_ids, register
from .kv_pool import KVStorage
from .memory import HOST, check_memory
from .staging import upload
from .token_allocator import PagedAllocator, TokenAllocator, _check_pool, _FreeListAllocator

__all__ = ["SWAAllocator", "SWAAllocatorSnapshot"]

_NEVER = "SWA indices never allocated or already freed"


@dataclass(frozen=True)
class SWAAllocatorSnapshot(AllocatorSnapshot):
    """Snapshot of an :class:`SWAAllocator`: hashable, comparable with ``==``.

    The inherited fields describe the **full** side (``kind`` is ``"SWAAllocator"``;
    ``capacity`` is in pages when paged, as for :class:`PagedAllocator`), so ``free_ids()``
    is the full free list.

    Attributes:
        swa: snapshot of the inner SWA allocator (``swa.free_ids()`` is the SWA free list).
        full_to_swa: the mapping as little-endian int64 bytes (``full_size + page_size``
            entries).
    """

    swa: AllocatorSnapshot
    full_to_swa: bytes

    def mapping(self) -> list[int]:
        """The full-to-SWA mapping as Python ints (index = full slot id; 0 = none)."""
        return np.frombuffer(self.full_to_swa, dtype="<i8").tolist()


def _validated_release_pages(alloc: _FreeListAllocator, slots: torch.Tensor) -> torch.Tensor:
    """Validate ``slots`` (CPU int64) exactly as ``alloc.free`` would; return their page ids.

    Raises ``ValueError`` (``foreign index``, ``partial page``, ``double free``); no mutation.
    """
    pages = alloc.slots_to_pages(slots)
    alloc.pages.validate_release(pages)
    return pages


class SWAAllocator(SlotAllocator):
    """Full + SWA KV slot allocator; its ids are full-pool slot ids.

    Args:
        full_size: full-pool slots (tokens) that can be handed out; a positive multiple of
            ``page_size``.
        swa_size: SWA-pool slots (tokens) that can be handed out; a positive multiple of
            ``page_size`` and ``<= full_size``.
        page_size: tokens per page (``> 0``); ``1`` uses :class:`TokenAllocator` inside,
            otherwise :class:`PagedAllocator`.
        full_pool: optional :class:`KVPool` of the full-attention layers (needs
            ``>= full_size + page_size`` rows); kept as ``self.full_pool`` (alias
            ``self.pool``), indexed by full slot ids. Not touched by the allocator.
        swa_pool: optional :class:`KVPool` of the SWA layers (needs ``>= swa_size + page_size``
            rows); kept as ``self.swa_pool``, indexed by SWA slot ids (:meth:`translate`).
        device: device of the index tensors returned by :meth:`alloc` and :meth:`translate`.

    Raises:
        TypeError: an argument of the wrong type (names it).
        ValueError: a non-positive size, a size not a multiple of ``page_size``,
            ``swa_size > full_size``, a pool with too few rows (names ``full_pool`` /
            ``swa_pool``), or an unavailable device.

    Units: every size and count is in tokens (slots), never pages. ``available_size()`` is
    ``min(full_available_size(), swa_available_size())``: what one ``alloc`` can get. Unlike
    the other allocators, ``available_size() + used_size() <= size`` (equality holds only
    while the SWA side is not the tighter one), because ``used_size()`` counts full slots.
    Cost: ``alloc(n)`` O(n), ``free``/``free_swa``/``undo_alloc`` O(len) (vectorised);
    ``check``/``snapshot``/``clear`` O(full_size).
    """

    def __init__(
        self,
        full_size: int,
        swa_size: int,
        page_size: int = 1,
        full_pool: KVStorage | None = None,
        swa_pool: KVStorage | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        full_size = check_positive_int(full_size, "full_size")
        swa_size = check_positive_int(swa_size, "swa_size")
        page_size = check_positive_int(page_size, "page_size")
        for name, value in (("full_size", full_size), ("swa_size", swa_size)):
            if value % page_size:
                raise ValueError(f"{name}={value} is not a multiple of page_size={page_size}")
        if swa_size > full_size:
            raise ValueError(
                f"swa_size={swa_size} must be <= full_size={full_size}"
                " (the SWA pool is the smaller one)"
            )
        self._device = check_device(device, "device")
        for name, pool, size in (
            ("full_pool", full_pool, full_size),
            ("swa_pool", swa_pool, swa_size),
        ):
            try:
                _check_pool(pool, size + page_size)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{name}: {exc}") from None
        check_memory(8 * (full_size + page_size), f"SWAAllocator(full_size={full_size:,})", HOST)
        self._page_size = page_size
        self._full: _FreeListAllocator
        self._swa: _FreeListAllocator
        if page_size == 1:
            self._full = TokenAllocator(full_size, pool=full_pool)
            self._swa = TokenAllocator(swa_size, pool=swa_pool)
        else:
            self._full = PagedAllocator(full_size, page_size, pool=full_pool)
            self._swa = PagedAllocator(swa_size, page_size, pool=swa_pool)
        self.full_pool = full_pool
        self.pool = full_pool
        self.swa_pool = swa_pool
        #: ``full_to_swa[f]``: SWA slot of full slot ``f``, 0 when none (free or tombstoned).
        #: CPU ``torch.int64``, ``full_size + page_size`` entries. Read-only for callers.
        self.full_to_swa = torch.zeros(full_size + page_size, dtype=torch.int64)
        self._map = self.full_to_swa.numpy()  # shares memory
        #: The inverse of ``_map``: ``_owner[s]`` is the full slot holding SWA slot ``s``, 0
        #: when none (free, or taken from ``swa_side`` and not mapped yet): what
        #: :meth:`map_swa` checks an SWA slot against.
        self._owner = np.zeros(swa_size + page_size, dtype=np.int64)
        self._arange_page = np.arange(page_size, dtype=np.int64)
        #: The mapping on ``device`` as last written (``None`` on the CPU: ``full_to_swa`` is
        #: there already); read it through :attr:`full_to_swa_device`.
        self._dev_map: torch.Tensor | None = None
        #: Full slots whose mapping changed since the device one was written: a mask over
        #: slots and the ids in the order noted (each once).
        self._stale = np.zeros(0, dtype=np.bool_)
        self._stale_ids: list[np.ndarray] = []
        if self._device.type != "cpu":
            self._dev_map = torch.zeros(full_size + page_size, dtype=torch.int64,
                                        device=self._device)
            self._stale = np.zeros(full_size + page_size, dtype=np.bool_)

    # ------------------------------------------------------------------ facts
    @property
    def size(self) -> int:
        """Full-pool capacity in tokens (``full_size``)."""
        return self._full.size

    @property
    def swa_size(self) -> int:
        """SWA-pool capacity in tokens."""
        return self._swa.size

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def full_side(self) -> SlotAllocator:
        """The full pool's allocator: its ``alloc`` hands out full slot ids with no SWA slot
        (born tombstoned: what a load-back of SWA-less tokens takes; :meth:`map_swa` may give
        them one later). CPU ids; :meth:`free` takes them back as any full slot."""
        return self._full

    @property
    def swa_side(self) -> SlotAllocator:
        """The SWA pool's allocator (SWA slot ids; its ``pool`` is ``swa_pool``): what a
        host tier mirrors, and what :meth:`map_swa` takes slots from."""
        return self._swa

    def map_swa(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """Give allocated full slots ``full`` that hold no SWA slot the SWA slots ``swa``
        (taken from :attr:`swa_side` and held by no full slot), element-wise.

        Paged: both are whole pages, so each full page maps to one SWA page slot by slot.

        Raises:
            ValueError: different lengths; a slot outside its pool; a partial page; a slot
                repeated; a full slot that is free or already mapped; an SWA slot that is free
                or already held by a full slot. Nothing changes then.
        """
        f, w = (torch.from_numpy(np.ascontiguousarray(host_ids(as_index_tensor(x, name), name)))
                for x, name in ((full, "full"), (swa, "swa")))  # their host mirrors: no sync
        if f.numel() != w.numel():
            raise ValueError(f"map_swa: {f.numel()} full slots for {w.numel()} SWA slots")
        if f.numel() == 0:
            return
        p = self._page_size
        check_range(f, "full", low=p, high=self.size + p)
        check_range(w, "swa", low=p, high=self.swa_size + p)
        self._full.slots_to_pages(f)  # paged: whole, aligned pages (raises)
        self._swa.slots_to_pages(w)
        fa, wa = f.numpy(), w.numpy()
        for what, arr in (("full", fa), ("SWA", wa)):
            uniq, counts = np.unique(arr, return_counts=True)
            if uniq.size != arr.size:
                bad = int(uniq[counts > 1][0])
                raise ValueError(f"map_swa: {what} slot {bad} appears more than once")
        if bool(self._full.is_free(f).any()) or bool((self.full_to_swa[f] != 0).any()):
            raise ValueError("map_swa: a full slot is free or already holds an SWA slot")
        free = self._swa.is_free(w).numpy()
        if free.any():
            raise ValueError(f"map_swa: SWA slot {int(wa[free.argmax()])} is free (take it "
                             "from swa_side first)")
        owner = self._owner[wa]
        if owner.any():
            k = int((owner != 0).argmax())
            raise ValueError(f"map_swa: SWA slot {int(wa[k])} is already held by full slot "
                             f"{int(owner[k])}")
        self._map[fa] = wa
        self._owner[wa] = fa
        dev_map = self.full_to_swa_device
        if dev_map is not None:
            both = np.concatenate((f.numpy(), w.numpy()))
            dev = upload(both, self._device)
            dev_map.index_copy_(0, dev[: f.numel()], dev[f.numel():])

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        """Tokens one ``alloc`` can get now: ``min(full, SWA)`` free tokens. O(1)."""
        return min(self._full.available_size(), self._swa.available_size())

    def used_size(self) -> int:
        """Full slots (tokens) handed out and not yet freed, tombstoned ones included. O(1)."""
        return self._full.used_size()

    def full_available_size(self) -> int:
        """Free tokens in the full pool. ``full_available_size() + used_size() == size``."""
        return self._full.available_size()

    def swa_available_size(self) -> int:
        """Free tokens in the SWA pool. ``swa_available_size() + swa_used_size() == swa_size``."""
        return self._swa.available_size()

    def swa_used_size(self) -> int:
        """SWA slots (tokens) held, i.e. full slots with a non-zero mapping. O(1)."""
        return self._swa.used_size()

    def can_alloc(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed now (both pools have ``n`` free). Raises as
        ``alloc`` does."""
        return self._full.can_alloc(n) and self._swa.can_alloc(n)

    def is_free(self, indices: torch.Tensor) -> torch.Tensor:
        """CPU bool tensor: which of ``indices`` (full slot ids) are free on the full side.

        A tombstoned slot (SWA freed, full kept) is *not* free. Use :meth:`has_swa` for the
        SWA side.

        Raises:
            TypeError: not an int64 tensor. ValueError: not 1-D, or an id outside
            ``[0, full_size + page_size)``.
        """
        idx = as_index_tensor(indices, "indices")
        check_range(idx, "indices", low=0, high=self.size + self._page_size)
        return self._full.is_free(idx)

    @property
    def free_mask(self) -> np.ndarray:
        """The full side's read-only live free mask over ids (pages when paged); see
        :attr:`TokenAllocator.free_mask`. A tombstoned slot is not free."""
        return self._full.free_mask

    def translate(self, indices: torch.Tensor) -> torch.Tensor:
        """SWA slot ids of full slot ids ``indices`` (0 where there is none: a tombstone, a
        free slot, or the padding slot), as an int64 tensor on ``device``.

        This is what SWA layers index their KV pool with; the result is a new tensor.

        Raises:
            TypeError: not an int64 tensor. ValueError: not 1-D, or an id outside
            ``[0, full_size + page_size)``. O(len).
        """
        idx = as_index_tensor(indices, "indices")
        check_range(idx, "indices", low=0, high=self.size + self._page_size)
        dev_map = self.full_to_swa_device
        if dev_map is None:
            return self.full_to_swa[idx]
        out = dev_map.index_select(0, self._on_device(indices, idx))
        return register(out, self._map[idx.numpy()])

    def has_swa(self, indices: torch.Tensor) -> torch.Tensor:
        """Bool tensor on ``device``: which full slots still hold a live SWA slot.
        Raises as :meth:`translate`."""
        return self.translate(indices) != 0

    def has_swa_host(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`has_swa` on the host: ``ids`` are full slot ids (int64 numpy, in
        ``[0, full_size + page_size)``, unchecked); a new bool array. For the cache's planning,
        which must not read the device."""
        return self._map[ids] != 0

    @property
    def full_to_swa_device(self) -> torch.Tensor | None:
        """The mapping on ``device`` (``None`` on the CPU), int64 ``[full_size + page_size]``,
        equal to ``full_to_swa``: changes since the last read are written first (one upload
        of the changed ids and their values, one ``index_copy_``; nothing when none). Read-only
        for callers."""
        dev_map = self._dev_map
        if dev_map is not None and self._stale_ids:
            ids = np.concatenate(self._stale_ids)
            self._stale_ids.clear()
            self._stale[ids] = False
            both = np.concatenate((ids, self._map[ids]))
            up = upload(both, self._device)
            dev_map.index_copy_(0, up[:ids.shape[0]], up[ids.shape[0]:])
        return dev_map

    def _on_device(self, given: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Slot ids (validated, values ``host``) on ``device``: ``given`` itself when it is
        there, else ``host`` uploaded."""
        if given.device == self._device:
            return given
        return upload(host.numpy(), self._device)

    def _changed(self, ids: np.ndarray) -> None:
        """Note that the mapping of full slots ``ids`` changed (the device one is written
        when next read); nothing on the CPU."""
        if self._dev_map is not None and ids.shape[0]:
            new = ids[~self._stale[ids]]
            if new.shape[0]:
                self._stale[new] = True
                self._stale_ids.append(new)

    # ------------------------------------------------------------------ actions
    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` slots from *both* pools and map them element-wise.

        Returns:
            The ``n`` full slot ids (1-D int64 on ``device``), or ``None`` when either pool
            has fewer than ``n`` free tokens (then nothing is taken from either).

        Raises:
            TypeError: ``n`` not an int. ValueError: ``n < 0``, or not a multiple of
            ``page_size``.
        """
        if not self.can_alloc(n):
            return None
        full = self._full.alloc(n)
        swa = self._swa.alloc(n)
        assert full is not None and swa is not None
        host = full.numpy()
        self._map[host] = swa.numpy()
        self._owner[swa.numpy()] = host
        if self._dev_map is None:
            return full
        self._changed(host)
        return register(upload(host, self._device), host)

    def free(self, indices: torch.Tensor) -> None:
        """Free full slots and, where still mapped, their SWA slots; clear their mapping.

        Both sides go to the back of their free lists, in the order of ``indices`` (SWA
        slots of tombstoned entries are skipped: they were freed by :meth:`free_swa`, and an
        SWA slot reused since is left alone).

        Args:
            indices: 1-D ``torch.int64`` full slot ids currently handed out (tombstoned or
                not), any device; whole pages when paged. Empty: no-op.

        Raises:
            TypeError: not a tensor, or dtype other than ``torch.int64``.
            ValueError: not 1-D; ``foreign index``; ``double free``; ``partial page``.
            Everything is validated before anything changes: on error nothing changes.
        """
        idx = as_index_tensor(indices, "indices")
        if idx.numel() == 0:
            return
        full_pages = _validated_release_pages(self._full, idx)
        swa = self.full_to_swa[idx]
        swa_pages = _validated_release_pages(self._swa, swa[swa != 0])
        self._full.pages.release(full_pages)
        self._swa.pages.release(swa_pages)
        self._owner[swa.numpy()] = 0  # (entry 0 of a tombstone: padding, never owned)
        ids = idx.numpy()
        self._map[ids] = 0
        self._changed(ids)

    def free_swa(self, indices: torch.Tensor) -> None:
        """Free only the SWA side of full slots ``indices`` (tombstone them); clear their
        mapping. The full slots stay allocated and must later be passed to :meth:`free`.

        The SWA slots go to the back of the SWA free list in the order of ``indices``.

        Args:
            indices: 1-D ``torch.int64`` full slot ids that are allocated and still hold a
                live SWA slot, any device; whole pages when paged. Empty: no-op.

        Raises:
            TypeError: not a tensor, or dtype other than ``torch.int64``.
            ValueError: not 1-D; ``foreign index`` (0 or out of range); ``partial page``;
                ``"SWA indices never allocated or already freed"`` naming the slot, when a
                full slot is free or already tombstoned; ``double free`` when a slot is
                repeated within ``indices``. Nothing changes on error.
        """
        idx = as_index_tensor(indices, "indices")
        if idx.numel() == 0:
            return
        p = self._page_size
        pages = self._full.slots_to_pages(idx)  # paged: foreign index / partial page
        arr = pages.numpy()
        if p == 1:
            out_of_range = (arr < 1) | (arr > self.size)
            if out_of_range.any():
                bad = int(arr[out_of_range.argmax()])
                raise ValueError(
                    f"foreign index: slot {bad} is not in 1..{self.size}"
                    " (0 is the padding slot and is never allocated)"
                )
        unused = ~self._full.pages.in_use(pages)
        if unused.any():
            bad = int(arr[unused.argmax()]) * p
            raise ValueError(f"{_NEVER}: slot {bad} is not allocated")
        swa = self.full_to_swa[idx]
        dead = (swa == 0).numpy()
        if dead.any():
            bad = int(idx[int(dead.argmax())])
            raise ValueError(f"{_NEVER}: slot {bad} has no live SWA slot (already tombstoned)")
        order = np.argsort(arr, kind="stable")
        ordered = arr[order]
        repeated = ordered[1:] == ordered[:-1]
        if repeated.any():
            bad = int(ordered[1:][repeated.argmax()]) * p
            raise ValueError(f"double free: slot {bad} appears more than once in one call")
        swa_pages = _validated_release_pages(self._swa, swa)
        self._swa.pages.release(swa_pages)
        self._owner[swa.numpy()] = 0
        ids = idx.numpy()
        self._map[ids] = 0
        self._changed(ids)

    def undo_alloc(self, indices: torch.Tensor) -> None:
        """Give back the result of a recent :meth:`alloc`: both sides to the *front* of their
        free lists, mapping cleared.

        Undoing allocs in reverse order, with no other ``alloc`` and no ``free_swa`` of those
        slots in between, restores ``snapshot()`` exactly (used by
        :class:`~allocators.txn.AllocTxn`).

        Raises:
            TypeError / ValueError: as :meth:`free`; also ``ValueError`` when a slot has no
            SWA slot (it was tombstoned, so it is not an intact ``alloc`` result).
            Nothing changes on error.
        """
        idx = as_index_tensor(indices, "indices")
        if idx.numel() == 0:
            return
        full_pages = _validated_release_pages(self._full, idx)
        swa = self.full_to_swa[idx]
        dead = (swa == 0).numpy()
        if dead.any():
            bad = int(idx[int(dead.argmax())])
            raise ValueError(
                f"undo_alloc: slot {bad} has no SWA slot (tombstoned by free_swa);"
                " only an intact alloc result can be undone"
            )
        swa_pages = _validated_release_pages(self._swa, swa)
        self._full.pages.restore(full_pages)
        self._swa.pages.restore(swa_pages)
        self._owner[swa.numpy()] = 0
        ids = idx.numpy()
        self._map[ids] = 0
        self._changed(ids)

    def clear(self) -> None:
        """Free every slot on both sides, clear the mapping, restore the initial free order."""
        self._full.clear()
        self._swa.clear()
        self._map[:] = 0
        self._owner[:] = 0
        if self._dev_map is not None:
            self._stale_ids.clear()
            self._stale[:] = False
            self._dev_map.zero_()

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Both inner checks, plus the mapping invariants: the padding page maps to 0; only
        allocated full slots map; every non-zero entry is an allocated SWA slot used by
        exactly one full slot, and the inverse map (SWA -> full) agrees; the number of non-zero
        entries equals ``swa_used_size()``; paged: each full page maps wholly to one
        page-aligned SWA page, slot by slot, or not at all.

        Raises:
            AssertionError: with a dump of the state. O(full_size log full_size); for tests.
        """
        self._full.check()
        self._swa.check()
        p = self._page_size
        m = self._map
        problems: list[str] = []
        if m[:p].any():
            problems.append(f"padding slots map to SWA slots {m[:p].tolist()}")
        nz = np.flatnonzero(m)
        vals = m[nz]
        full_free = self._full.pages.free_mask()[nz // p]
        if full_free.any():
            f = int(nz[full_free.argmax()])
            problems.append(f"free full slot {f} still maps to SWA slot {int(m[f])}")
        high = self.swa_size + p
        out = (vals < p) | (vals >= high)
        if out.any():
            f = int(nz[out.argmax()])
            problems.append(f"full slot {f} maps to {int(m[f])}, outside [{p}, {high})")
        else:
            swa_free = self._swa.pages.free_mask()[vals // p]
            if swa_free.any():
                f = int(nz[swa_free.argmax()])
                problems.append(f"full slot {f} maps to free SWA slot {int(m[f])}")
            uniq, counts = np.unique(vals, return_counts=True)
            if uniq.size != vals.size:
                problems.append(f"SWA slots used by several full slots: {uniq[counts > 1][:16]}")
            wrong = self._owner[vals] != nz
            if wrong.any() or np.count_nonzero(self._owner) != nz.size:
                problems.append("the SWA-to-full inverse map disagrees with full_to_swa")
        if nz.size != self._swa.used_size():
            problems.append(
                f"{nz.size} non-zero mappings but {self._swa.used_size()} SWA slots used"
            )
        dev_map = self.full_to_swa_device
        if dev_map is not None:  # reads the device: for tests
            differ = np.flatnonzero(dev_map.cpu().numpy() != m)
            if differ.size:
                problems.append(f"the device mapping differs from the host one at full slots "
                                f"{differ[:16].tolist()}")
        if p > 1:
            rows = m.reshape(-1, p)
            live = rows != 0
            mixed = live.any(axis=1) & ~live.all(axis=1)
            if mixed.any():
                problems.append(f"full page {int(mixed.argmax())} is only partly mapped")
            starts = rows[:, :1]
            whole = live.all(axis=1) & (
                (starts[:, 0] % p != 0) | (rows != starts + self._arange_page).any(axis=1)
            )
            if whole.any():
                k = int(whole.argmax())
                problems.append(f"full page {k} maps to {rows[k].tolist()}, not one SWA page")
        if problems:
            raise AssertionError(
                f"SWAAllocator invariant broken: {'; '.join(problems)}\n{self.dump()}"
            )

    def dump(self, limit: int = 32) -> str:
        """A short human-readable description of both sides and the mapping."""
        nz = np.flatnonzero(self._map)[:limit]
        pairs = [(int(f), int(self._map[f])) for f in nz]
        return (
            f"  full side:\n{self._full.pages.dump(limit)}\n"
            f"  SWA side:\n{self._swa.pages.dump(limit)}\n"
            f"  full_to_swa (first {limit} non-zero, full -> SWA)={pairs}"
        )

    def snapshot(self) -> SWAAllocatorSnapshot:
        """Both sides' bookkeeping plus the mapping (see :class:`SWAAllocatorSnapshot`)."""
        full = self._full.snapshot()
        return SWAAllocatorSnapshot(
            kind=type(self).__name__,
            capacity=full.capacity,
            page_size=full.page_size,
            num_used=full.num_used,
            free_order=full.free_order,
            free_mask=full.free_mask,
            swa=self._swa.snapshot(),
            full_to_swa=self._map.astype("<i8").tobytes(),
        )

    def __repr__(self) -> str:
        return (
            f"SWAAllocator(full_size={self.size}, swa_size={self.swa_size},"
            f" page_size={self._page_size}, full_available={self.full_available_size()},"
            f" swa_available={self.swa_available_size()}, device={self._device})"
        )
