"""One memory arena for KV pages and recurrent states, with a boundary movable at run time.

A hybrid model's cache memory is one byte budget. The arena cuts it into **chunks** of one
size, each holding either ``pages_per_chunk`` KV pages or one recurrent-state slot::

    kv_page_bytes   = page_size * kv_bytes_per_token          (K + V, every attention layer)
    pages_per_chunk = ceil(state_bytes / kv_page_bytes)         (a state fits in one chunk)
    chunk_bytes     = pages_per_chunk * kv_page_bytes
    num_chunks      = budget_bytes // chunk_bytes + 1          (+ 1: the padding chunk)

    chunk:  0 (padding) | 1 .. num_kv_chunks: KV band ... | ... state band: num_chunks - 1
            KV page 0 and state slot 0 lie here; never handed out

Chunk 0 is the padding of both kinds (KV page 0, state slot 0). It is allocated on top of the
budget, as the fixed pools allocate their padding rows on top of their size (``KVPool``'s
``size + page_size`` rows, ``MambaStatePool``'s ``size + 1``): ``budget_bytes`` is the memory
the two kinds can use, so an arena and a fixed split of the same budget hold the same bytes. Chunks are owned by one kind
at a time: KV takes the low end, states the high end (SGLang's ``--enable-unified-memory``
bands), and a chunk moves from one kind to the other only while it is wholly free
(:meth:`MemoryArena.kv_to_state`, :meth:`MemoryArena.state_to_kv`; all or nothing). Free KV
pages scattered over partly used chunks are gathered into whole chunks by moving used pages
(:meth:`MemoryArena.relocate_kv_pages`: the bytes and the free-list state; the holders of the
page ids are rewritten by the caller, ``components.compaction``).

The two kinds are served by *views*, the same interfaces the cache uses today, over one
``torch.uint8`` buffer (nothing copied, no second allocation):

* :class:`ArenaKVAllocator` -- a paged KV allocator (``PagedAllocator``'s contract, except
  that ``alloc`` takes the lowest free pages: the KV band packs low) whose
  ``pool`` is a :class:`~allocators.kv_pool.KVBuffers` over the arena: KV slot ``s`` is the
  ``kv_bytes_per_token`` bytes at ``s * kv_bytes_per_token`` (every layer's K then V).
* :class:`ArenaStatePool` -- a :class:`~allocators.state_pool.MambaStatePool` whose ``conv``
  and ``ssm`` are views of the arena: state slot ``c`` is chunk ``c`` (conv of every layer,
  then SSM of every layer, from the chunk's first byte).

Each view's free list spans every id of the arena (``size`` is the whole id range); ids of
chunks the other kind owns are *withdrawn* (they count as used), so ``undo_alloc``,
:class:`~allocators.txn.AllocTxn` and ``snapshot`` behave exactly as in the fixed pools. The
state view keeps the FIFO order; the KV view hands out the lowest free pages (its free list is
a mask, ``snapshot`` lists it ascending). :meth:`SlotAllocator.available_size` is what the kind
can hand out now; ``owned_size()`` is what it owns.

Waste (bytes of the budget no kind can use, :meth:`MemoryArena.waste_bytes`): the budget's
tail past the last whole chunk and per state chunk ``chunk_bytes - state_bytes`` (the padding
chunk is not in the budget: :attr:`MemoryArena.padding_bytes`). Free
KV pages in a chunk that still holds used pages are usable by KV but not by a state until
the chunk empties: :meth:`MemoryArena.stranded_bytes` reports them apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._checks import (
    as_index_tensor,
    check_device,
    check_float_dtype,
    check_int,
    check_positive_int,
    check_shape,
)
from .free_list import FreeList, _release_c, _release_held_c
from .host_mirror import mirrored
from .kv_pool import KVBuffers
from .memory import check_memory
from .staging import upload
from .state_pool import _NUMPY_DTYPES, MambaStatePool, _slot_arg
from .token_allocator import _FreeListAllocator

try:  # the lowest free ids in one C pass (allocators/_release.c), built by ``pip install``
    from allocators._release import lowest_free as _lowest_free_c
except ImportError:  # pragma: no cover - no compiler at install time: the numpy path
    _lowest_free_c = None

__all__ = ["ArenaKVAllocator", "ArenaStatePool", "KVShape", "MemoryArena", "StateShape",
           "group_counts"]

#: Chunk owners (``MemoryArena.owner``).
PAD, KV, STATE = 0, 1, 2
_KINDS = ("the padding", "KV", "the states")


def group_counts(groups: np.ndarray, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct groups ascending, ids per group)`` of ``groups`` (int64 group ids in
    ``[0, num_groups)``, one per id, any order): ``np.unique(groups, return_counts=True)``,
    computed by ``np.bincount`` (O(ids + num_groups), no sort) when there are at least a
    quarter as many ids as groups."""
    if groups.size * 4 >= num_groups:
        per = np.bincount(groups, minlength=num_groups)
        nz = np.flatnonzero(per)
        return nz, per[nz]
    return np.unique(groups, return_counts=True)


def _elem(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (``dtype.itemsize``: no tensor made; a shape's
    ``page_bytes`` is read on every compaction)."""
    return dtype.itemsize


@dataclass(frozen=True)
class KVShape:
    """Shape of the full-attention KV of one token.

    Args:
        num_layers, num_heads, head_dim: attention layers, KV heads per layer, elements per
            head (each ``> 0``).
        dtype: floating-point ``torch.dtype`` of K and V.
        page_size: tokens per KV page (``> 0``): the cache's ``page_size``.

    Raises:
        TypeError / ValueError: a bad field, naming it.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_size"):  # kept as ints
            object.__setattr__(self, name, check_positive_int(getattr(self, name), name))
        check_float_dtype(self.dtype, "dtype")

    @property
    def bytes_per_token(self) -> int:
        """K plus V bytes of one token over every layer."""
        return 2 * self.num_layers * self.num_heads * self.head_dim * _elem(self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page (``page_size`` tokens)."""
        return self.page_size * self.bytes_per_token


@dataclass(frozen=True)
class StateShape:
    """Shape of one recurrent-state slot (``MambaStatePool``'s arguments).

    Args:
        num_layers: recurrent layers (``> 0``).
        conv_state_shape, ssm_state_shape: per-layer shapes of one slot, positive ints.
        dtype: floating-point ``torch.dtype`` of both states.

    Raises:
        TypeError / ValueError: a bad field, naming it.
    """

    num_layers: int
    conv_state_shape: tuple[int, ...]
    ssm_state_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_layers", check_positive_int(self.num_layers, "num_layers"))
        object.__setattr__(self, "conv_state_shape",
                           check_shape(self.conv_state_shape, "conv_state_shape"))
        object.__setattr__(self, "ssm_state_shape",
                           check_shape(self.ssm_state_shape, "ssm_state_shape"))
        check_float_dtype(self.dtype, "dtype")

    @property
    def conv_elems(self) -> int:
        """Elements of every layer's conv state of one slot."""
        return self.num_layers * math.prod(self.conv_state_shape)

    @property
    def bytes(self) -> int:
        """Bytes of one slot: conv plus SSM state of every layer."""
        per_layer = math.prod(self.conv_state_shape) + math.prod(self.ssm_state_shape)
        return self.num_layers * per_layer * _elem(self.dtype)


class _LowestFirst(FreeList):
    """A :class:`~allocators.free_list.FreeList` whose ``take`` hands out the *lowest* free
    ids (ascending) instead of the front of a FIFO ring: the arena's KV pages pack towards
    chunk 1, so that chunks at the high end empty and can become states. The ``is_free`` mask
    is the whole state (the ring is unused; :meth:`free_order` is the free ids ascending), so
    a release is a mask write and ``withdraw`` needs no ring rebuild. The C release paths
    (``allocators/_release.c``: checks, mask and held-mark writes in one pass) are taken
    with the ring as their scratch: they write the ids they free from ring position 0, and
    ``group_free`` is updated from there (:meth:`_counted_release`).

    Per group of ``group`` consecutive ids (an arena chunk: ids ``c * group .. c * group +
    group - 1``; ``capacity + 1`` is a whole number of groups), ``group_free[c]`` counts the
    free ids, kept by every mutation (O(ids changed + groups)), so that whole free chunks are
    found in O(chunks), not O(ids), and ``take(k)`` reads the mask of only the groups that
    hold the ``k`` lowest free ids (the groups with no free id passed over by their count,
    a wholly free one not read): O(groups + group * partly free groups read), not O(the used
    ids it passes)."""

    def __init__(self, capacity: int, unit: str, group: int) -> None:
        if (capacity + 1) % group:
            raise ValueError(f"capacity + 1 = {capacity + 1} is not a whole number of groups "
                             f"of {group} ids")
        self._group = group
        #: free ids per group of ``group`` ids (group 0 holds id 0, never free)
        self.group_free = np.zeros(capacity // group + 1, dtype=np.int64)
        self._group_free_at: int = self.group_free.ctypes.data  # (only written in place)
        super().__init__(capacity, unit)

    def reset(self) -> None:
        super().reset()
        self.group_free[:] = np.bincount(np.arange(1, self._capacity + 1) // self._group,
                                         minlength=self.group_free.size)

    def _count(self, ids: np.ndarray, sign: int) -> None:
        """``group_free`` of the groups of ``ids`` += ``sign`` per id: one ``np.bincount``
        over every group added in place when there are at least a quarter as many ids as
        groups, else ``np.add.at`` per id."""
        gf = self.group_free
        if ids.size * 4 >= gf.size:
            per = np.bincount(ids // self._group, minlength=gf.size)
            (np.add if sign > 0 else np.subtract)(gf, per, out=gf)
        else:
            np.add.at(gf, ids // self._group, sign)

    def lowest_free(self, k: int, skip: np.ndarray | None = None) -> np.ndarray:
        """The ``k`` lowest free ids outside the groups where ``skip`` (bool per group) is
        True, ascending (int64), taking nothing; the caller checked that enough are free
        there. Reads ``group_free``, and the mask of the groups holding the ids only (none
        of a wholly free group's): one C pass (``allocators/_release.c``: ``lowest_free``)
        when built, else :meth:`lowest_free_numpy`, its reference."""
        gf = self.group_free
        if _lowest_free_c is None or (skip is not None and (
                skip.dtype != np.bool_ or skip.shape != gf.shape
                or not skip.flags.c_contiguous)):
            return self.lowest_free_numpy(k, skip)
        out = np.empty(k, dtype=np.int64)
        n = _lowest_free_c(self._free_at, gf.size, self._group, self._group_free_at, 0, k,
                           0 if skip is None else skip.ctypes.data, out.ctypes.data)
        return out if n == k else out[:n]

    def lowest_free_numpy(self, k: int, skip: np.ndarray | None = None) -> np.ndarray:
        """:meth:`lowest_free` in numpy (the C pass's reference): ``group_free``'s running
        sum finds the groups that suffice, one ``flatnonzero`` per run of consecutive groups
        among them reads their mask."""
        per = self.group_free
        if skip is not None:
            per = np.where(skip, 0, per)
        last = int(np.searchsorted(np.cumsum(per), k))  # groups 0 .. last suffice
        groups = np.flatnonzero(per[:last + 1])
        if k == 0 or groups.size == 0:
            return np.empty(0, dtype=np.int64)
        # the mask of each run of consecutive groups in one flat scan (a 2-D nonzero of the
        # rows gathered costs about 10x more)
        ends = np.flatnonzero(np.diff(groups) != 1).tolist() + [groups.size - 1]
        group, free, parts, start = self._group, self._is_free, [], 0
        for end in ends:
            lo, hi = int(groups[start]) * group, (int(groups[end]) + 1) * group
            parts.append(np.flatnonzero(free[lo:hi]) + lo)
            start = end + 1
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out[:k].astype(np.int64, copy=False)

    def take(self, k: int) -> torch.Tensor | None:
        if k > self._num_free:
            return None
        out = self.lowest_free(k)
        if k:
            # every group but the last gives all its free ids: whole rows of the mask
            group = self._group
            first, last = int(out[0]) // group, int(out[-1]) // group
            gf = self.group_free
            full = np.flatnonzero(gf[first:last]) + first
            self._is_free.reshape(-1, group)[full] = False
            gf[full] = 0
            tail = out[np.searchsorted(out, last * group):]  # the last group's
            self._is_free[tail] = False
            gf[last] -= tail.size
        self._num_free -= k
        self._num_used += k
        return torch.from_numpy(out)

    def take_one(self) -> int | None:
        got = self.take(1)
        return None if got is None or not got.numel() else int(got[0])

    def _mark_free(self, arr: np.ndarray) -> None:
        super()._mark_free(arr)
        self._count(arr, 1)

    def release(self, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        self.validate_release(ids)
        self._mark_free(ids.numpy())

    restore = release

    def release_owned(self, arr: np.ndarray) -> None:
        if arr.size:
            self._mark_free(arr)

    def release_owned_at(self, src: int, n: int, page_size: int) -> bool:
        if _release_c is None:
            return False
        self._counted_release(_release_c(src, n, page_size, self._ring, 0, self._is_free))
        return True

    def release_held_at(self, src: int, n: int, page_size: int, held: int,
                        held_bytes: int) -> bool:
        if _release_held_c is None:
            return False
        k = _release_held_c(src, n, page_size, held, held_bytes, self._ring_at,
                            self._capacity, 0, self._free_at)
        if k < 0:
            return False
        self._counted_release(k)
        return True

    def _counted_release(self, k: int) -> None:
        """After a C release wrote ``k`` freed ids at ``_ring[:k]`` (and marked them free):
        the counters and ``group_free``."""
        ids = self._ring[:k]
        self._count(ids, 1)
        self._num_free += k
        self._num_used -= k

    def release_one(self, i: int) -> None:
        self.release(torch.tensor([i], dtype=torch.int64))

    def withdraw(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        if ((ids < 1) | (ids > self._capacity)).any():
            raise ValueError(f"withdraw: a {self._unit} id is outside 1..{self._capacity}")
        if not self._is_free[ids].all():
            raise ValueError(f"withdraw: {self._unit} {int(ids[~self._is_free[ids]][0])} is not free")
        pos = np.arange(ids.size, dtype=self._stamp.dtype)
        self._stamp[ids] = pos
        if (self._stamp[ids] != pos).any():
            raise ValueError(f"withdraw: a {self._unit} id is repeated")
        self.withdraw_owned(ids)

    def withdraw_owned(self, ids: np.ndarray) -> None:
        """:meth:`withdraw` without its checks, for ids the caller validated (distinct,
        in range, free: ``MemoryArena.relocate_kv_pages``), as ``release_owned`` is
        ``release`` without them. O(ids + groups)."""
        self._is_free[ids] = False
        self._count(ids, -1)
        self._num_free -= ids.size
        self._num_used += ids.size

    def withdraw_groups(self, groups: np.ndarray) -> None:
        """:meth:`withdraw` of every id of ``groups`` (distinct int64 group ids ``>= 1``, each
        wholly free: ``group_free[g] == group``), by whole rows of the mask: O(len(groups) *
        group) byte writes, no per-id checks. Raises ``ValueError``, nothing changed, when a
        group is not wholly free, is group 0 or is repeated."""
        self._set_groups(groups, False)

    def release_groups(self, groups: np.ndarray) -> None:
        """:meth:`release` of every id of ``groups`` (distinct int64 group ids ``>= 1``, each
        wholly used: ``group_free[g] == 0``, as after :meth:`withdraw_groups`), by whole rows
        of the mask. Raises ``ValueError``, nothing changed, when a group holds a free id, is
        group 0 or is repeated."""
        self._set_groups(groups, True)

    def _set_groups(self, groups: np.ndarray, free: bool) -> None:
        """Every id of ``groups`` becomes free (``free``) or used, each group wholly the
        other before (checked first: ``ValueError``, nothing changed)."""
        if groups.size == 0:
            return
        before = 0 if free else self._group
        if (groups < 1).any() or (self.group_free[groups] != before).any() \
                or np.unique(groups).size != groups.size:
            what = "holds free ids" if free else "is not wholly free"
            name = "release_groups" if free else "withdraw_groups"
            raise ValueError(f"{name}: a group of {groups.tolist()} {what}, or is repeated")
        self._is_free.reshape(-1, self._group)[groups] = free
        self.group_free[groups] = self._group - before
        n = groups.size * self._group if free else -groups.size * self._group
        self._num_free += n
        self._num_used -= n

    def free_order(self) -> np.ndarray:
        return np.flatnonzero(self._is_free).astype(np.int64)

    def dump(self, limit: int = 32) -> str:
        return (f"  capacity={self._capacity} unit={self._unit} num_free={self._num_free}"
                f" num_used={self._num_used}\n"
                f"  lowest free (first {limit})={self.free_order()[:limit].tolist()}")


class ArenaKVAllocator(_FreeListAllocator):
    """The arena's KV view: a paged KV allocator (``PagedAllocator``'s contract: whole pages,
    free-list order, errors, ``snapshot``) over the pages of the chunks KV owns.

    Built by :class:`MemoryArena` only. ``size`` is the whole KV id range
    (``(num_chunks * pages_per_chunk - 1) * page_size`` slots); pages of chunks KV does not
    own are withdrawn (counted in ``used_size()``); ``owned_size()`` is the slots KV owns.

    Attributes:
        pool: :class:`~allocators.kv_pool.KVBuffers` over the arena (``k_buffer(layer)`` is a
            ``[num_slots, num_heads, head_dim]`` strided view of the arena's bytes).
        arena: the owning :class:`MemoryArena`.
    """

    def __init__(self, arena: MemoryArena, num_pages: int, pool: KVBuffers) -> None:
        super().__init__(1, arena.kv_shape.page_size, arena.device, "page")
        #: the free list, typed as what it is (``_pages`` is the base class's name for it)
        self.lowest = _LowestFirst(num_pages, "page", arena.pages_per_chunk)
        self._pages = self.lowest
        self._free_mask = self._pages.free_mask()
        self.arena = arena
        self.pool = pool

    @property
    def num_pages(self) -> int:
        """Page ids ``1..num_pages`` (every chunk's pages, owned or not)."""
        return self._pages.capacity

    def owned_size(self) -> int:
        """Slots (tokens) in the chunks KV owns now. O(n chunks)."""
        return self.arena.num_kv_chunks * self.arena.pages_per_chunk * self._page_size

    def free(self, indices: torch.Tensor) -> None:
        """``PagedAllocator.free``, refusing too a page of a chunk KV does not own
        (``ValueError``, ``foreign index``; nothing changes). ``free_owned`` (the cache's
        own slots) skips the checks, as in every allocator."""
        pages = self.slots_to_pages(as_index_tensor(indices, "indices"))
        self.arena.check_owned(pages.numpy() // self.arena.pages_per_chunk, KV, "indices")
        self._pages.release(pages)

    def undo_alloc(self, indices: torch.Tensor) -> None:
        """``PagedAllocator.undo_alloc``, refusing too a page of a chunk KV does not own
        (as :meth:`free`; nothing changes)."""
        pages = self.slots_to_pages(as_index_tensor(indices, "indices"))
        self.arena.check_owned(pages.numpy() // self.arena.pages_per_chunk, KV, "indices")
        self._pages.restore(pages)

    def clear(self) -> None:
        """Every page of the chunks KV owns free, ascending; the pages of the other chunks
        (the padding chunk's, the states') stay withdrawn. O(pages)."""
        self._pages.reset()
        arena = self.arena
        self.lowest.withdraw(arena._pages_of(np.flatnonzero(arena.owner != KV)))

    def check_owned_slots(self, slots: np.ndarray, name: str) -> None:
        """Raise ``ValueError`` (``foreign index``, naming ``name``) when one of the KV
        ``slots`` (int64 numpy) lies in a chunk KV does not own: such a slot counts as
        handed out here (withdrawn) but is the other kind's. A cache checks the slots it
        adopts with it (``components.kv.KVComponent.claim``); slots outside the arena are
        left to the caller's range check. O(len(slots)): one gather of the owners (clipped:
        a slot outside the arena reads an edge chunk), the exact check only when it fails."""
        arena = self.arena
        chunks = slots // arena.tokens_per_chunk
        if not (arena.owner.take(chunks, mode="clip") == KV).all():
            arena.check_owned(chunks, KV, name)


class ArenaStatePool(MambaStatePool):
    """The arena's state view: a :class:`~allocators.state_pool.MambaStatePool` (same
    contract: ``alloc`` zeroes, ``copy``, ``get_state`` / ``set_state``, pending work on a
    device) whose state slot ``c`` is arena chunk ``c`` (``slot_first`` layout).

    Built by :class:`MemoryArena` only. ``size`` is ``num_chunks - 1``; chunks states do not
    own are withdrawn; ``owned_size()`` is the slots states own.
    """

    def __init__(self, arena: MemoryArena, conv_store: torch.Tensor,
                 ssm_store: torch.Tensor) -> None:
        shape = arena.state_shape
        rows = arena.num_chunks
        # (MambaStatePool's attributes, over the arena's memory instead of its own tensors)
        _FreeListAllocator.__init__(self, rows - 1, 1, arena.device, "state slot")
        self.arena = arena
        self.num_layers = shape.num_layers
        self.conv_state_shape = shape.conv_state_shape
        self.ssm_state_shape = shape.ssm_state_shape
        self.dtype = shape.dtype
        self.zero_on_alloc = True
        self.slot_first = True
        self.conv_store = conv_store
        self.ssm_store = ssm_store
        self._conv = conv_store.transpose(0, 1)
        self._ssm = ssm_store.transpose(0, 1)
        self._pending: dict[int, int] = {}
        self.ids: torch.Tensor | None = None
        if arena.device.type != "cpu":
            self.ids = mirrored(np.arange(rows, dtype=np.int64), arena.device)
        self._views: tuple[np.ndarray, np.ndarray] | None = None
        if arena.device.type == "cpu" and self.dtype in _NUMPY_DTYPES:
            self._views = (self._conv.numpy(), self._ssm.numpy())

    def owned_size(self) -> int:
        """State slots in the chunks states own now. O(n chunks)."""
        return self.arena.num_state_chunks

    def free(self, indices: torch.Tensor) -> None:
        """``MambaStatePool.free``, refusing too a slot of a chunk states do not own
        (``ValueError``, ``foreign index``; nothing changes)."""
        idx = as_index_tensor(indices, "indices")
        self.arena.check_owned(idx.numpy(), STATE, "indices")
        self._pages.release(idx)

    def undo_alloc(self, indices: torch.Tensor) -> None:
        """``MambaStatePool.undo_alloc``, refusing too a slot of a chunk states do not own
        (as :meth:`free`; nothing changes)."""
        idx = as_index_tensor(indices, "indices")
        self.arena.check_owned(idx.numpy(), STATE, "indices")
        self._pages.restore(idx)

    def clear(self) -> None:
        """Every chunk states own a free slot, in ascending order; the other chunks stay
        withdrawn. O(slots)."""
        self._pages.reset()
        self._pages.withdraw(np.flatnonzero(self.arena.owner[1:] != STATE) + 1)

    def check_owned_slots(self, slots: np.ndarray | int, name: str) -> None:
        """Raise ``ValueError`` (``foreign index``, naming ``name``) when one of the state
        ``slots`` (int64 numpy, or one ``int``: scalar compares) is a chunk states do not own
        (withdrawn here, it counts as handed out). A cache checks the slot it adopts with it
        (``components.state.StateComponent.check_insert``); ids outside the arena are left
        to the caller's range check."""
        if isinstance(slots, np.ndarray):
            self.arena.check_owned(slots, STATE, name)
            return
        owner, slot = self.arena.owner, int(slots)
        if 0 <= slot < owner.shape[0] and owner[slot] != STATE:
            self.arena.check_owned(np.array([slot], dtype=np.int64), STATE, name)

    def free_slot(self, slot: int | torch.Tensor) -> None:
        """``MambaStatePool.free_slot``, refusing too a chunk states do not own."""
        if type(slot) is not int:
            slot = _slot_arg(slot, "slot")
        self.arena.check_owned(np.array([slot], dtype=np.int64), STATE, "slot")
        self._pages.release_one(slot)

    def copy(self, src: int | torch.Tensor, dst: int | torch.Tensor) -> None:
        """``MambaStatePool.copy``, refusing too a chunk states do not own (it counts as
        handed out here, being withdrawn: its bytes are KV's). Two ints: scalar owner
        checks before the pool's own."""
        if type(src) is int and type(dst) is int:
            owner = self.arena.owner
            n = owner.shape[0]
            if not (0 <= src < n and 0 <= dst < n and owner[src] == STATE
                    and owner[dst] == STATE):
                self._allocated(src, "src")  # raises, naming the bad one
                self._allocated(dst, "dst")
        super().copy(src, dst)

    def _allocated(self, slots: int | torch.Tensor, name: str) -> torch.Tensor:
        """``MambaStatePool._allocated`` (handed out, else ``ValueError`` naming ``name``),
        and of a chunk states own (``foreign index``): what ``get_state``, ``set_state``
        and ``copy`` validate with."""
        idx = super()._allocated(slots, name)
        self.arena.check_owned(idx.numpy(), STATE, name)
        return idx

    @property
    def total_bytes(self) -> int:
        """Bytes of the chunks states own (padding excluded)."""
        return self.arena.num_state_chunks * self.arena.chunk_bytes


class MemoryArena:
    """One byte budget for KV pages and recurrent-state slots (module docstring: layout).

    Args:
        budget_bytes: the bytes the two kinds may use (``> 0``); ``budget_bytes //
            chunk_bytes`` usable chunks, at least 2 (one state, one KV chunk), and the padding
            chunk on top (module docstring).
        kv_shape: :class:`KVShape` of the attention KV.
        state_shape: :class:`StateShape` of one recurrent-state slot.
        state_slots: chunks states own at first (the high end), ``0 .. num_chunks - 1``; the
            rest (bar the padding chunk) are KV's. Default: half the usable chunks.
        device: where the buffer lives (``str`` or ``torch.device``).

    Raises:
        TypeError: an argument of the wrong type, naming it.
        ValueError: a budget below 2 chunks (``budget_bytes``, naming the minimum), a chunk
            whose bytes the state dtype does not divide, ``state_slots`` out of range.

    Attributes:
        kv_allocator: :class:`ArenaKVAllocator`, the KV view (pass as a cache's
            ``kv_allocator``).
        state_pool: :class:`ArenaStatePool`, the state view (``state_allocator``).
        buffer: the ``torch.uint8`` tensor of ``num_chunks * chunk_bytes`` bytes (the padding
            chunk included).
        owner: numpy ``int8`` per chunk: ``0`` padding, ``1`` KV, ``2`` state (read only).
    """

    def __init__(self, budget_bytes: int, kv_shape: KVShape, state_shape: StateShape, *,
                 state_slots: int | None = None, device: str | torch.device = "cpu") -> None:
        budget_bytes = check_positive_int(budget_bytes, "budget_bytes")
        if not isinstance(kv_shape, KVShape):
            raise TypeError(f"kv_shape must be a KVShape, got {type(kv_shape).__name__}")
        if not isinstance(state_shape, StateShape):
            raise TypeError(f"state_shape must be a StateShape, got {type(state_shape).__name__}")
        self.device = check_device(device, "device")
        self.budget_bytes = budget_bytes
        self.kv_shape = kv_shape
        self.state_shape = state_shape
        self.state_bytes = state_shape.bytes
        kv_page = kv_shape.page_bytes
        self.pages_per_chunk = ppc = -(-self.state_bytes // kv_page)
        self.chunk_bytes = chunk = ppc * kv_page
        s_elem = _elem(state_shape.dtype)
        if chunk % s_elem:
            raise ValueError(
                f"kv_shape and state_shape do not divide: a chunk of {chunk} bytes "
                f"({ppc} KV pages of {kv_page}) is not a whole number of "
                f"{state_shape.dtype} elements ({s_elem} bytes)")
        self.num_chunks = n = budget_bytes // chunk + 1
        if n < 3:
            raise ValueError(
                f"budget_bytes={budget_bytes} is below 2 chunks of {chunk} bytes (one state "
                f"slot, one KV chunk of {ppc} pages; the padding chunk comes on top): need "
                f">= {2 * chunk}")
        if state_slots is None:
            state_slots = (n - 1) // 2
        state_slots = check_int(state_slots, "state_slots", minimum=0)
        if state_slots > n - 1:
            raise ValueError(f"state_slots={state_slots} exceeds the {n - 1} usable chunks")
        check_memory(n * chunk, f"MemoryArena(budget_bytes={budget_bytes:,})", self.device)
        self.buffer = torch.zeros(n * chunk, dtype=torch.uint8, device=self.device)
        self._owner = np.full(n, KV, dtype=np.int8)
        self._owner[0] = PAD
        self._owner[n - state_slots:] = STATE
        #: chunks the states own (kept by ``kv_to_state`` / ``state_to_kv``; ``check``
        #: recounts it from ``owner``)
        self._num_state = state_slots
        self.owner = self._owner.view()
        self.owner.flags.writeable = False
        self.kv_allocator = ArenaKVAllocator(self, n * ppc - 1, self._kv_buffers())
        self.state_pool = ArenaStatePool(self, *self._state_stores())
        # Withdraw from each view the ids of chunks it does not own.
        self.kv_allocator.clear()
        self.state_pool.clear()

    # ------------------------------------------------------------------ views
    def _kv_buffers(self) -> KVBuffers:
        s = self.kv_shape
        rows = self.num_chunks * self.pages_per_chunk * s.page_size
        t = self.buffer.view(s.dtype).view(rows, 2, s.num_layers, s.num_heads, s.head_dim)
        return KVBuffers([t[:, 0, layer] for layer in range(s.num_layers)],
                         [t[:, 1, layer] for layer in range(s.num_layers)],
                         page_size=s.page_size)

    def _state_stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.state_shape
        per_chunk = self.chunk_bytes // _elem(s.dtype)
        t = self.buffer.view(s.dtype).view(self.num_chunks, per_chunk)
        ce = s.conv_elems
        se = s.num_layers * math.prod(s.ssm_state_shape)
        conv = t[:, :ce].view(self.num_chunks, s.num_layers, *s.conv_state_shape)
        ssm = t[:, ce:ce + se].view(self.num_chunks, s.num_layers, *s.ssm_state_shape)
        return conv, ssm

    def _pages_of(self, chunks: np.ndarray) -> np.ndarray:
        """KV page ids of ``chunks`` (page 0, the padding page, left out)."""
        ppc = self.pages_per_chunk
        pages = (chunks[:, None] * ppc + np.arange(ppc, dtype=np.int64)).reshape(-1)
        return pages[pages > 0].astype(np.int64)

    def check_owned(self, chunks: np.ndarray, kind: int, name: str) -> None:
        """Raise ``ValueError`` (``foreign index``, naming ``name``) when one of ``chunks``
        that lies in the arena is not owned by ``kind`` (ids outside are left to the free
        list's own range check)."""
        inside = chunks[(chunks >= 0) & (chunks < self.num_chunks)]
        bad = inside[self._owner[inside] != kind]
        if bad.size:
            c = int(bad[0])
            raise ValueError(f"{name}: foreign index: arena chunk {c} belongs to "
                             f"{_KINDS[self._owner[c]]}, not {_KINDS[kind]}")

    # ------------------------------------------------------------------ facts
    @property
    def num_kv_chunks(self) -> int:
        """Chunks KV owns now. O(1)."""
        return self.num_chunks - 1 - self._num_state

    @property
    def num_state_chunks(self) -> int:
        """Chunks (= slots) states own now. O(1)."""
        return self._num_state

    @property
    def arena_bytes(self) -> int:
        """Bytes allocated: ``num_chunks * chunk_bytes`` (the padding chunk included)."""
        return self.num_chunks * self.chunk_bytes

    @property
    def padding_bytes(self) -> int:
        """Bytes of the padding chunk (KV page 0, state slot 0), allocated on top of the
        budget: ``chunk_bytes``."""
        return self.chunk_bytes

    @property
    def tokens_per_chunk(self) -> int:
        """KV tokens one chunk holds (what one state slot is worth in KV tokens, rounded up
        to whole pages)."""
        return self.pages_per_chunk * self.kv_shape.page_size

    def waste_bytes(self) -> int:
        """Bytes of the budget no kind can use now: its tail past the last usable chunk and
        ``chunk_bytes - state_bytes`` per state chunk (the padding chunk is on top of the
        budget, :attr:`padding_bytes`)."""
        tail = self.budget_bytes - (self.num_chunks - 1) * self.chunk_bytes
        return tail + self.num_state_chunks * (self.chunk_bytes - self.state_bytes)

    def waste_fraction(self) -> float:
        """:meth:`waste_bytes` over ``budget_bytes`` (a fraction in ``[0, 1)``)."""
        return self.waste_bytes() / self.budget_bytes

    @property
    def kv_free_per_chunk(self) -> np.ndarray:
        """Free KV pages per chunk (numpy ``int64``, ``num_chunks`` entries, read only, kept
        by every allocation and free: O(1) to read). A chunk KV does not own has 0; chunk 0
        at most ``pages_per_chunk - 1`` (page 0 is padding)."""
        view = self.kv_allocator.lowest.group_free.view()
        view.flags.writeable = False
        return view

    def _kv_chunk_free(self) -> np.ndarray:
        """Per chunk: every one of its KV pages is free (so KV owns it; chunk 0: False).
        O(chunks)."""
        return self.kv_allocator.lowest.group_free == self.pages_per_chunk

    def stranded_bytes(self) -> int:
        """Bytes of free KV pages in KV chunks that also hold used pages: usable by KV, not by
        a state until the chunk empties or is compacted (:meth:`relocate_kv_pages`).
        O(chunks)."""
        free = self.kv_allocator.lowest.group_free
        partial = (self._owner == KV) & (free < self.pages_per_chunk)
        return int(free[partial].sum()) * self.kv_shape.page_bytes

    def movable_kv_chunks(self) -> int:
        """KV chunks wholly free now (what :meth:`kv_to_state` can move). O(chunks)."""
        return int(self._kv_chunk_free().sum())

    def movable_state_chunks(self) -> int:
        """State chunks free now (what :meth:`state_to_kv` can move)."""
        return int((self.state_pool.free_mask & (self._owner == STATE)).sum())

    # ------------------------------------------------------------------ the boundary
    def kv_to_state(self, n: int) -> bool:
        """Hand ``n`` wholly free KV chunks to the states (the highest chunk ids first, next to
        the state band): their pages leave KV's free list, the chunks join the back of the
        state free list. All or nothing.

        Returns:
            ``True`` when moved; ``False`` (nothing changed) when fewer than ``n`` KV chunks
            are wholly free.

        Raises:
            TypeError / ValueError: ``n`` not an int ``>= 0``.
        """
        n = check_int(n, "n", minimum=0)
        cand = np.flatnonzero(self._kv_chunk_free())
        if cand.size < n:
            return False
        if n == 0:
            return True
        chunks = cand[::-1][:n].astype(np.int64)
        self.kv_allocator.lowest.withdraw_groups(chunks)
        self._owner[chunks] = STATE
        self._num_state += n
        self.state_pool._pages.release(torch.from_numpy(chunks.copy()))
        return True

    def state_to_kv(self, n: int) -> bool:
        """Hand ``n`` free state chunks to KV (the lowest chunk ids first, next to the KV band):
        they leave the state free list, their pages join the back of KV's. All or nothing.

        Returns:
            ``True`` when moved; ``False`` (nothing changed) when fewer than ``n`` state
            slots are free.

        Raises:
            TypeError / ValueError: ``n`` not an int ``>= 0``.
        """
        n = check_int(n, "n", minimum=0)
        cand = np.flatnonzero(self.state_pool.free_mask & (self._owner == STATE))
        if cand.size < n:
            return False
        if n == 0:
            return True
        chunks = cand[:n].astype(np.int64)
        # On a device the state view's zeroing and copies wait for the next read of the
        # states: issued now, while the chunks are still states (a freed slot's pending work
        # would otherwise land on KV bytes, a pending copy would read them). No sync.
        self.state_pool.flush()
        self.state_pool._pages.withdraw(chunks)
        self._owner[chunks] = KV
        self._num_state -= n
        self.kv_allocator.lowest.release_groups(chunks)
        return True

    def ensure_kv(self, num_tokens: int) -> bool:
        """Make ``kv_allocator.available_size() >= num_tokens`` by moving free state chunks to
        KV (as few as needed). ``False``, moving nothing, when the free state chunks do not
        suffice. Raises like :meth:`kv_to_state` for a bad ``num_tokens``."""
        num_tokens = check_int(num_tokens, "num_tokens", minimum=0)
        short = num_tokens - self.kv_allocator.available_size()
        if short <= 0:
            return True
        return self.state_to_kv(-(-short // self.tokens_per_chunk))

    def ensure_states(self, num_slots: int) -> bool:
        """Make ``state_pool.available_size() >= num_slots`` by moving wholly free KV chunks
        to the states. ``False``, moving nothing, when too few KV chunks are wholly free."""
        num_slots = check_int(num_slots, "num_slots", minimum=0)
        short = num_slots - self.state_pool.available_size()
        return True if short <= 0 else self.kv_to_state(short)

    # ------------------------------------------------------------------ compaction
    def lowest_free_kv_pages(self, k: int, exclude: np.ndarray) -> np.ndarray | None:
        """The ``k`` lowest free KV pages outside chunks ``exclude`` (ascending, a new int64
        array), or ``None`` when fewer are free there. Reads only; scans the free mask in
        blocks from the lowest free page: O(k + the ids it passes).

        Raises:
            TypeError / ValueError: ``k`` not an int ``>= 0``; ``exclude`` not a 1-D numpy
                array of integer chunk ids in ``0 .. num_chunks - 1``.
        """
        k = check_int(k, "k", minimum=0)
        if not isinstance(exclude, np.ndarray) or exclude.dtype.kind not in "iu":
            raise TypeError(f"exclude must be a numpy array of integer chunk ids, got "
                            f"{type(exclude).__name__} {getattr(exclude, 'dtype', '')}")
        if exclude.ndim != 1:
            raise ValueError(f"exclude must be 1-D, got shape {exclude.shape}")
        if exclude.size and (int(exclude.min()) < 0 or int(exclude.max()) >= self.num_chunks):
            raise ValueError(f"exclude: a chunk id is outside 0..{self.num_chunks - 1}")
        pages = self.kv_allocator.lowest
        skip = np.zeros(self.num_chunks, dtype=np.bool_)
        skip[exclude] = True
        if int(pages.group_free[~skip].sum()) < k:
            return None
        return pages.lowest_free(k, skip)

    def relocate_kv_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move used KV pages ``src[i]`` to free KV pages ``dst[i]``: their bytes are copied
        (every layer's K and V: a page is ``kv_shape.page_bytes`` contiguous bytes of
        ``buffer``), ``dst`` become used and ``src`` free. The caller rewrites whatever holds
        the old page ids (the radix tree: ``components.compaction``). All or nothing.

        Args:
            src, dst: 1-D ``int64`` numpy arrays of page ids, equal lengths.

        Raises:
            TypeError / ValueError: not 1-D int64 arrays of one length; a ``src`` page that is
                free, a ``dst`` page that is used, a page of a chunk KV does not own, or a
                page repeated (nothing changes).
        """
        for name, a in (("src", src), ("dst", dst)):
            if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
                raise TypeError(f"{name} must be a 1-D int64 numpy array of KV page ids")
        if src.size != dst.size:
            raise ValueError(f"src and dst differ in length: {src.size} != {dst.size}")
        if src.size == 0:
            return
        pages = self.kv_allocator.lowest
        cap = pages.capacity
        for name, a in (("src", src), ("dst", dst)):
            if ((a < 1) | (a > cap)).any():
                raise ValueError(f"{name}: a KV page id is outside 1..{cap}")
            self.check_owned(a // self.pages_per_chunk, KV, name)
            if not (np.diff(a) > 0).all() and np.unique(a).size != a.size:
                raise ValueError(f"{name}: a KV page id is repeated")
        free = pages.free_mask()
        if free[src].any():
            raise ValueError(f"src: KV page {int(src[free[src]][0])} is free")
        if not free[dst].all():
            raise ValueError(f"dst: KV page {int(dst[~free[dst]][0])} is used")
        rows = self.buffer.view(-1, self.kv_shape.page_bytes)
        # the ids go up as one upload through pinned staging (no host synchronisation; a
        # pageable copy would make the host wait), src then dst
        ids = upload(np.concatenate((src, dst)), self.device)
        rows.index_copy_(0, ids[src.size:], rows.index_select(0, ids[:src.size]))
        pages.withdraw_owned(dst)  # now used (held by whoever held src); checked above
        pages.release_owned(src)

    # ------------------------------------------------------------------ checking
    def check(self) -> None:
        """Every invariant from scratch: each view's free list, each chunk's ids withdrawn from
        exactly the view that does not own it. Raises ``AssertionError``. O(arena ids)."""
        self.kv_allocator.check()
        self.state_pool.check()
        kv_free = self.kv_allocator.free_mask.reshape(self.num_chunks, self.pages_per_chunk)
        st_free = self.state_pool.free_mask
        problems = []
        for c in range(self.num_chunks):
            o = self._owner[c]
            if o != KV and kv_free[c].any():
                problems.append(f"chunk {c} (owner {o}) has free KV pages")
            if o != STATE and st_free[c]:
                problems.append(f"chunk {c} (owner {o}) is a free state slot")
        if self._owner[0] != PAD or (self._owner[1:] == PAD).any():
            problems.append("only chunk 0 is padding")
        if self._num_state != int((self._owner == STATE).sum()):
            problems.append(f"state chunks counted {self._num_state} != the owners' "
                            f"{int((self._owner == STATE).sum())}")
        counted = kv_free.sum(axis=1)
        if (counted != self.kv_allocator.lowest.group_free).any():
            problems.append(f"free KV pages per chunk {self.kv_allocator.lowest.group_free.tolist()}"
                            f" != the mask's {counted.tolist()}")
        if problems:
            raise AssertionError("MemoryArena invariant broken: " + "; ".join(problems))

    def stats(self) -> dict[str, Any]:
        """Sizes in bytes and chunks, for reports: budget, chunk size, chunks per kind, free
        and used per kind, waste (bytes and fraction), stranded KV bytes."""
        kv, st = self.kv_allocator, self.state_pool
        kv_owned = kv.owned_size()
        kv_free = kv.available_size()
        return {
            "budget_bytes": self.budget_bytes,
            "chunk_bytes": self.chunk_bytes,
            "pages_per_chunk": self.pages_per_chunk,
            "num_chunks": self.num_chunks,
            "kv_chunks": self.num_kv_chunks,
            "state_chunks": self.num_state_chunks,
            "kv_tokens_owned": kv_owned,
            "kv_tokens_used": kv_owned - kv_free,
            "state_slots_owned": st.owned_size(),
            "state_slots_used": st.owned_size() - st.available_size(),
            "waste_bytes": self.waste_bytes(),
            "waste_fraction": self.waste_fraction(),
            "stranded_bytes": self.stranded_bytes(),
        }

    def __repr__(self) -> str:
        return (f"MemoryArena(budget_bytes={self.budget_bytes}, chunk_bytes={self.chunk_bytes}, "
                f"kv_chunks={self.num_kv_chunks}, state_chunks={self.num_state_chunks}, "
                f"device={self.device})")
