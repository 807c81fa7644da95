"""Full-attention KV component: per-node KV slot indices; any prefix of a cached path is usable.

Eviction candidates are unlocked leaves, ordered by the radix eviction policy's key
(``components.eviction.registry``) in one exact ordered set.

Ownership: the component marks every id (slot, or page when paged) its nodes hold in
``_held``, one bit per id, so :meth:`KVComponent.claim` can refuse, in one C pass (or a few
vectorised gathers), slots the tree is about to adopt that are free in the allocator, already
held by a node, or repeated::

    bit id of _held (byte id >> 3, bit id & 7) == 0    not the tree's (free, or a caller's)
                                               == 1    held by a node

(1 bit per id of the pool: 1/8 byte per cached token when the pool is full; :meth:`held_mask`
unpacks it.)

A node's slots (``node.kv_value``, a :data:`KVValue`): an ``array('q')`` of its own on the
host, one int64 slot per token of ``node.key`` (about 64 bytes of header per node, against
about 450 for a tensor's object, TensorImpl, StorageImpl and allocation), on every device. A
node's array is never resized or written after :meth:`KVComponent.attach` (a split slices it
into two new arrays, each its own memory), so zero-copy tensor views of it
(``torch.frombuffer``, which keeps a reference to the array) stay valid and equal to it.

On a GPU the tree's bookkeeping is the CPU's: the caller's slot tensors are read through
their host mirrors (``allocators.host_mirror``: ``alloc`` results, slices and
``cat_slots`` of them), a node keeps the host array (an insert, a split, a free or an eviction
issues no CUDA call at all), and device tensors are made only where a caller needs slots on
the device: :meth:`KVComponent.device_slots` (a match's ``device_indices``, a backup's slots)
joins the arrays on the host and uploads them once (one memcpy from pinned staging, no host
synchronisation), mirrored; the uploads of single node values are kept for the last
:data:`DEVICE_CACHE` of them (a system prompt's node matched again costs nothing).

Every other module reads node slots through the component: :meth:`KVComponent.slots` (one
node's, as a 1-D int64 tensor), :meth:`KVComponent.path_slots` (a path's, one tensor) and
:meth:`KVComponent.host_slots` (a value's slots as a numpy array on the host); the
module-level :func:`slot_tensor` / :func:`cat_values` (one value, several values as one new
tensor) are the same for code holding values but not the component.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np
import torch

from allocators import resolve_device
from allocators.host_mirror import cat_slots, host_ids, mirrored
from components.base import Component
from components.ordered import OrderedNodeSet

try:  # the insert's slot claim in C (components/_claim.c), built by ``pip install``
    from components._claim import claim as _claim_c
    from components._claim import unmark as _unmark_c
except ImportError:  # pragma: no cover - no compiler at install time: the numpy path
    _claim_c = None
    _unmark_c = None

if TYPE_CHECKING:
    from allocators import SlotAllocator
    from components.kv_chunks import ChunkHolders
    from hicache.storage import Page
    from radix.node import TreeNode
    from radix.tree import RadixTree

#: A radix eviction policy's key (``components.eviction.registry``): smaller is evicted first.
KeyFn = Callable[["TreeNode"], tuple[Any, ...]]

#: A node's KV slots (``node.kv_value``): an ``array('q')`` of the node's own on the host
#: (never resized or written after attach), on every device. (A tensor is accepted where a
#: value is passed in, and kept as an array.)
KVValue: TypeAlias = "array[int] | torch.Tensor"

#: Uploads of single node values a device KV component keeps (see the module docstring).
DEVICE_CACHE = 64

#: One zero slot: ``_ZERO * n`` is a node's new array of ``n`` (written by the C claim).
_ZERO = array("q", [0])
#: A 0-slot tensor (``torch.frombuffer`` refuses an empty buffer).
_NO_SLOTS = torch.empty(0, dtype=torch.int64)
#: ``torch.int64`` (one global read in the hot paths)
_I64 = torch.int64


def slot_tensor(value: KVValue) -> torch.Tensor:
    """A node value's slots as a 1-D int64 tensor: a zero-copy view of a CPU node's array (it
    keeps a reference to it), a device node's own tensor. Not to be written."""
    if type(value) is array:
        return torch.frombuffer(value, dtype=_I64) if value else _NO_SLOTS.clone()
    assert isinstance(value, torch.Tensor)
    return value


def cat_values(values: list[KVValue]) -> torch.Tensor:
    """The concatenation of node values ``values`` (all of one kind), a new 1-D int64 tensor
    (mirrored on a device). CPU arrays are joined into one bytearray and viewed once
    (``bytearray().join`` + ``torch.frombuffer``: about 1.0 us for two nodes of 1,000 and 50
    slots here, against 3.3 us for ``torch.cat`` of their ``frombuffer`` views and 2.4 us for
    ``np.concatenate``; ``timeit``, one core)."""
    if not values:
        return _NO_SLOTS.clone()
    if type(values[0]) is array:
        joined = bytearray().join(cast("list[array[int]]", values))
        return torch.frombuffer(joined, dtype=_I64) if joined else _NO_SLOTS.clone()
    return cat_slots(cast("list[torch.Tensor]", values))


def to_value(value: KVValue) -> array[int]:
    """The value a node keeps for ``value`` (its own memory, never a view): a node's array
    as it is; a slot tensor's values (a device tensor's host mirror) copied into a new
    ``array('q')``."""
    if type(value) is array:
        return value
    return _array_of(host_ids(cast("torch.Tensor", value), "value"))


class KVComponent(Component):
    """Owns ``node.kv_value`` (a :data:`KVValue`: one int64 slot per token, an ``array('q')`` on
    the CPU, a device tensor on a device) and ``node.kv_lock``; other modules read a node's
    slots as a tensor through :meth:`slots` / :meth:`path_slots`.

    Counters (tokens): ``evictable_size`` = tokens of nodes with ``kv_lock == 0``,
    ``protected_size`` = tokens of nodes with ``kv_lock > 0``; ``evicted`` = tokens freed by
    :meth:`on_remove` (evictions and demotions); ``inserted`` = tokens the inserts added.
    """

    name = "kv"
    evict_field = "num_tokens"

    def __init__(self, allocator: SlotAllocator, key_fn: KeyFn, host_tier: bool = False) -> None:
        """Args:
            allocator: device KV slots.
            key_fn: the radix eviction policy's key.
            host_tier: nodes may be host-only (HiCache): an eviction candidate is then a
                *device* leaf (on device, no child on device) rather than a childless node.
        """
        self.allocator = allocator
        #: What a load-back allocates this component's slots from (a sliding-window
        #: component makes it the full-attention side: ``components.swa``).
        self.restore_allocator: Any = allocator
        self.key_fn = key_fn
        # Resolved: ``cuda`` means the current device; tensors always report their index.
        self.device = resolve_device(torch.device(getattr(allocator, "device", "cpu")))
        self._cpu = self.device.type == "cpu"
        self.evicted = 0
        self.inserted = 0
        # The tree frees only slots its nodes hold: skip the allocator's boundary checks.
        self._free = getattr(allocator, "free_owned", allocator.free)
        self.host_tier = host_tier
        self.leaves = OrderedNodeSet(key_fn)
        self._evictable = 0
        self._protected = 0
        self.page_size: int = allocator.page_size
        #: The allocator's live free mask over ids (``None``: an allocator without one; then
        #: :meth:`claim` checks only the range).
        self._free_mask: np.ndarray | None = getattr(allocator, "free_mask", None)
        #: Ids ``1 .. _num_ids`` (0 is the padding id, never handed out).
        self._num_ids = len(self._free_mask) - 1 if self._free_mask is not None else 0
        self._held: np.ndarray | None = None
        if self._free_mask is not None:
            self._held = np.zeros((self._num_ids + 8) // 8, dtype=np.uint8)  # 1 bit per id
        #: The allocator's free of a node's slots that also clears their held marks, in one
        #: pass (``TokenAllocator.owned_release``; ``None``: unmark, then ``free_owned``).
        #: ``f(src, n, page_size, held address, held bytes)`` returns ``False``, changing
        #: nothing, when it cannot.
        owned = getattr(allocator, "owned_release", None) if self._held is not None else None
        self._release: Callable[[int, int, int, int, int], bool] | None = (
            owned() if callable(owned) else None)
        #: ``_held``'s address and size, as ``_release`` takes them (``_held`` is only ever
        #: written in place)
        self._marks_at, self._marks_len = (
            (self._held.ctypes.data, len(self._held)) if self._held is not None else (0, 0))
        #: :meth:`_repeats` scratch: stamps per id, positions 1..k (numpy path only: made on
        #: its first use, so a cache claiming in C holds neither)
        self._stamps: np.ndarray | None = None
        self._pos: np.ndarray | None = None
        #: One past the pool's last slot (the pool holds slots ``[page_size, _slot_end)``).
        self._slot_end: int = allocator.size + self.page_size
        #: The allocator's check that slots lie in memory it owns (a memory arena's view:
        #: ``ArenaKVAllocator.check_owned_slots``, whose ids of the other kind's chunks count
        #: as handed out); ``None``: every id in range is the allocator's.
        self._check_owned: Callable[[np.ndarray, str], None] | None = getattr(
            allocator, "check_owned_slots", None)
        #: 0, 1, .., page_size - 1, repeated (page structure checks); grown on demand
        self._page_offsets = np.tile(np.arange(self.page_size, dtype=np.int64), 64)
        #: :meth:`slots`' last CPU view and the array it views (``None``: none kept)
        self._view_of: array[int] | None = None
        self._view = _NO_SLOTS
        #: a device's uploads of single node values: id(array) -> (array, tensor), oldest
        #: first (the entry keeps the array, so its id is not reused while it is there)
        self._uploads: dict[int, tuple[array[int], torch.Tensor]] = {}
        #: Per group of ids, the ids held and held locked, and each id's holder, kept by the
        #: hooks below once :meth:`track_chunks` installs it (``None``: not kept)
        self.chunks: ChunkHolders | None = None

    # ------------------------------------------------------------------ access
    def slots(self, node: TreeNode) -> torch.Tensor:
        """Device node ``node``'s KV slots as a 1-D int64 tensor (one per token of its key) on
        the component's device: a zero-copy view of its array on the CPU
        (``torch.frombuffer``), an upload of it on a device (:meth:`device_slots`). Not to be
        written. Raises ``ValueError`` for a node without device KV.

        The last CPU view made is kept with its array (one entry): asking again for the same
        array returns the same tensor, as a node's own tensor was returned before (a
        single-node match of a shared prefix, the common case of a system prompt, makes no
        tensor; ``torch.frombuffer`` is about 0.65 us). The entry can outlive its node until
        the next view or :meth:`reset`: one array, never handed out for another node (an array
        is never written, and the entry keeps it, so its identity is not reused)."""
        value = node.kv_value
        if value is self._view_of:
            return self._view
        if value is None:
            raise ValueError(f"node has no device KV slots: {node}")
        if not self._cpu:
            return self.device_slots([value])
        view = slot_tensor(value)
        if type(value) is array:
            self._view, self._view_of = view, value
        return view

    def host_path_slots(self, nodes: list[TreeNode]) -> torch.Tensor:
        """The KV slots of the device nodes among ``nodes``, in order, as one 1-D int64 CPU
        tensor (one node's own view when only one holds slots, else their concatenation): what
        :meth:`path_slots` is on the CPU, on the host on every device (no CUDA call)."""
        vals = [n.kv_value for n in nodes if n.kv_value is not None]
        return slot_tensor(vals[0]) if len(vals) == 1 else cat_values(vals)

    def path_slots(self, nodes: list[TreeNode]) -> torch.Tensor:
        """The KV slots of the device nodes among ``nodes``, in order, as one 1-D int64 tensor
        on the component's device: on the CPU one node's own view when only one holds slots,
        else their concatenation; on a device :meth:`device_slots`."""
        vals = [n.kv_value for n in nodes if n.kv_value is not None]
        if not self._cpu:
            return self.device_slots(vals)
        return slot_tensor(vals[0]) if len(vals) == 1 else cat_values(vals)

    def device_slots(self, values: list[KVValue]) -> torch.Tensor:
        """The concatenation of node values ``values`` as a new 1-D int64 tensor on the
        component's device, mirrored (a CPU component: :func:`cat_values`). On a device the
        arrays are joined on the host and uploaded in one copy (``host_mirror.mirrored``: one
        memcpy, no host synchronisation; none for no slots); a single value's upload is kept
        (the last :data:`DEVICE_CACHE`) and handed out again while its array lives in it.
        Not to be written."""
        if self._cpu:
            return cat_values(values)
        if len(values) == 1:
            value = values[0]
            got = self._uploads.get(id(value))
            if got is not None and got[0] is value:
                return got[1]
            out = mirrored(self.host_slots(value).copy(), self.device)
            if type(value) is array:
                ups = self._uploads
                if len(ups) >= DEVICE_CACHE:
                    del ups[next(iter(ups))]
                ups[id(value)] = (value, out)
            return out
        hosts = [self.host_slots(v) for v in values]
        return mirrored(np.concatenate(hosts) if hosts else np.empty(0, dtype=np.int64),
                        self.device)

    # --------------------------------------------------------------- ownership
    def claim(self, value: torch.Tensor, lo: int = 0, hi: int | None = None, *,
              copy: bool = False) -> KVValue | None:
        """Validate the caller's slots ``value[lo:hi]`` the tree is about to adopt and mark them
        held; with ``copy``, also return the tree's own copy of them.

        Every slot must lie in the pool, be handed out by the allocator (not free), be held by
        no node, and appear once; when paged, the slots must be whole pages, each page's slots
        in order (what ``free`` takes back). The caller attaches exactly these slots to nodes
        in the same step, with nothing that can fail in between; :meth:`on_remove` and
        :meth:`replace` clear the marks. An allocator without a free mask gets the range check
        only.

        Args:
            value: 1-D int64 tensor of the caller's slots, on the CPU or the allocator's
                device (read through its host mirror: see :meth:`claim_device`).
            lo, hi: the range to adopt [positions in ``value``]; ``hi`` defaults to its end.
            copy: return a new node value equal to ``value[lo:hi]``: what a node keeps (a
                view would pin the caller's whole tensor and see its later writes).

        Returns:
            The copy with ``copy`` (an ``array('q')``: a :data:`KVValue`), else ``None``.

        Raises:
            ValueError: naming ``value`` and the first bad slot; nothing is marked then.
            TypeError: ``value`` is not a 1-D int64 tensor on the CPU or the device.

        Complexity: O(hi - lo). One C pass (``components/_claim.c``: checks, marks and copy
        in one loop) when the extension is built; else vectorised numpy (:meth:`_claim_numpy`,
        the reference the C pass is tested against).
        """
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1 \
                or not (value.is_cpu or value.device == self.device):
            where = "CPU tensor" if self._cpu else f"tensor on the CPU or {self.device}"
            raise TypeError(f"value must be a 1-D int64 {where} of KV slots")
        n = value.shape[0]
        if hi is None:
            hi = n
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"claim range [{lo}, {hi}) is outside value's {n} slots")
        if not value.is_cpu:
            return self.claim_device(value, lo, hi, copy)
        return self.claim_trusted(value, lo, hi, copy)

    def claim_device(self, value: torch.Tensor, lo: int, hi: int,
                     copy: bool) -> array[int] | None:
        """:meth:`claim` of a checked device tensor: the checks and marks run on its host
        mirror (no host synchronisation and no CUDA call; a tensor without a mirror is copied
        to the host once, ``allocators.host_mirror.host_ids``). With ``copy``, returns the
        node's ``array('q')`` of ``value[lo:hi]``, as on the CPU."""
        host = torch.from_numpy(np.ascontiguousarray(host_ids(value, "value")))
        return self.claim_trusted(host, lo, hi, copy)

    def host_slots(self, value: KVValue) -> np.ndarray:
        """The values of slot tensor or node value ``value`` on the host (its memory on the
        CPU, its mirror on a device; see ``allocators.host_mirror.host_ids``). Not to be
        written."""
        if type(value) is array:
            return np.frombuffer(value, dtype=np.int64)
        assert isinstance(value, torch.Tensor)
        return value.numpy() if value.is_cpu else host_ids(value, "value")

    def claim_trusted(self, value: torch.Tensor, lo: int, hi: int,
                      copy: bool) -> array[int] | None:
        """:meth:`claim` for a caller that has already checked ``value`` (a 1-D int64 CPU
        tensor) and ``0 <= lo <= hi <= len(value)``: the insert's path. The slots themselves
        are still checked. With ``copy``, returns the node's own ``array('q')`` of them."""
        if self._check_owned is not None:
            self._check_owned(value.numpy()[lo:hi], "value")
        if _claim_c is None:
            return self._claim_numpy(value.numpy()[lo:hi], copy)
        if not value.is_contiguous():
            value = value.contiguous()
        ps = self.page_size
        # The copy: the node's own array, zeros written by the C pass (``array * n``: about
        # 0.2 us for 1,000 slots, against 0.9 us for ``Tensor.new_empty``; a slice of a kept
        # zero array is as fast but is scratch memory the cache holds).
        own = _ZERO * (hi - lo) if copy else None
        got = _claim_c(value.data_ptr() + 8 * lo, hi - lo, 0 if own is None else own,
                       ps, ps, self._slot_end, self._held, self._free_mask)
        if got >= 0:  # the position of the first bad slot
            slots = value.numpy()[lo:hi]
            if self._held is None:
                self.check_range(slots)
            else:
                self._refuse(slots, slots if ps == 1 else self._page_ids(slots))
            raise AssertionError(f"claim refused position {got} it cannot explain")  # pragma: no cover
        return own

    def _claim_numpy(self, slots: np.ndarray, copy: bool) -> array[int] | None:
        """:meth:`claim` in numpy (the fallback without the C extension, and its reference):
        with held marks, the range check, two gathers (the marks' bits, the allocator's free
        mask), the repeat check (:meth:`_repeats`) and a scatter of the bits; without, the
        range check."""
        held, free = self._held, self._free_mask
        own = slots.copy() if copy else slots
        if held is None or free is None:
            self.check_range(own)
            return _array_of(own) if copy else None
        ids = own if self.page_size == 1 else self._page_ids(own)
        if len(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if (lo < 1 or hi > self._num_ids or own.min() < self.page_size
                    or own.max() >= self._slot_end or self._bits(ids).any()
                    or free.take(ids).any() or self._repeats(ids)):
                self._refuse(own, ids)
            np.bitwise_or.at(held, ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8))
        return _array_of(own) if copy else None

    def _bits(self, ids: np.ndarray) -> np.ndarray:
        """The held bits (0 or 1, uint8) of in-range ``ids``."""
        assert self._held is not None
        return (self._held[ids >> 3] >> (ids & 7).astype(np.uint8)) & 1

    def held_mask(self) -> np.ndarray | None:
        """A new bool array, one entry per id ``0 .. num ids``: whether a node holds it
        (``None`` for an allocator without a free mask, whose claims keep no marks)."""
        if self._held is None:
            return None
        return np.unpackbits(self._held, bitorder="little")[: self._num_ids + 1].astype(bool)

    def _repeats(self, ids: np.ndarray) -> bool:
        """Whether an id appears twice in ``ids`` (all in range), in O(len): scatter positions
        1..k into a scratch array and gather them back; an earlier occurrence of a repeated id
        reads back its last position. The scratch (4 bytes per id, never cleared: every call
        writes before it reads) exists only on the numpy path; ``np.unique`` would sort."""
        k = len(ids)
        if self._stamps is None:
            assert self._held is not None  # only the held-mark path checks repeats
            self._stamps = np.zeros(self._num_ids + 1, dtype=np.int32)
        if self._pos is None or k > len(self._pos):
            self._pos = np.arange(1, max(2 * k, 1024) + 1, dtype=np.int32)
        pos = self._pos[:k]
        self._stamps[ids] = pos
        return self._stamps.take(ids).tobytes() != pos.tobytes()

    def _page_ids(self, slots: np.ndarray) -> np.ndarray:
        """Page ids of whole, in-order pages of ``slots``; raises ``ValueError`` otherwise."""
        ps = self.page_size
        if slots.shape[0] % ps:
            raise ValueError(
                f"value: {slots.shape[0]} slots to adopt is not a whole number of pages ({ps})"
            )
        n = slots.shape[0]
        if n > len(self._page_offsets):
            self._page_offsets = np.tile(np.arange(ps, dtype=np.int64), 2 * n // ps)
        ids = slots[::ps] // ps
        # page p's slots minus their offsets in the page are p*ps, p*ps, ...: one comparison
        # (a misaligned first slot fails it too)
        within = slots - self._page_offsets[:n]
        expect = (ids * ps).repeat(ps)
        if within.tobytes() != expect.tobytes():
            bad = int(np.flatnonzero(within != expect)[0]) // ps * ps
            raise ValueError(
                f"value: slots from position {bad} ({slots[bad:bad + ps].tolist()}) are not the "
                f"{ps} slots of one page in order (page p holds slots p*{ps} .. p*{ps}+{ps - 1})"
            )
        return ids

    def check_range(self, slots: np.ndarray) -> None:
        """Raise ``ValueError`` naming ``value`` unless every slot lies in the pool."""
        if slots.shape[0] == 0:
            return
        ps = self.page_size
        limit = self._slot_end
        lo, hi = int(slots.min()), int(slots.max())
        if lo < ps or hi >= limit:
            bad = int(slots[(slots < ps) | (slots >= limit)][0])
            raise ValueError(
                f"value holds slot {bad}, outside the KV pool's slots [{ps}, {limit})"
            )

    def _refuse(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Raise the ``ValueError`` that names the first slot :meth:`claim` cannot adopt."""
        self.check_range(slots)
        ps = self.page_size
        held = self._held
        free = self._free_mask
        assert held is not None and free is not None
        def what(i: int, pid: int) -> str:  # "slot 7", or "page 3 (slot 12)"
            return f"slot {pid}" if ps == 1 else f"page {pid} (slot {slots[i * ps]})"

        for i, pid in enumerate(ids.tolist()):
            if free[pid]:
                raise ValueError(
                    f"value holds {what(i, pid)}, which is free in the KV "
                    "allocator: the tree adopts only slots the caller got from alloc"
                )
            if held[pid >> 3] >> (pid & 7) & 1:
                raise ValueError(
                    f"value holds {what(i, pid)} for new tokens, but a node "
                    "of the tree already holds it (pass the tree's slots only for the cached "
                    "prefix)"
                )
        seen: dict[int, int] = {}
        for i, pid in enumerate(ids.tolist()):
            if pid in seen:
                raise ValueError(
                    f"value repeats {what(i, pid)} at positions "
                    f"{seen[pid] * ps} and {i * ps}: two tokens cannot share a KV slot"
                )
            seen[pid] = i
        raise AssertionError("claim refused slots it cannot explain")  # pragma: no cover

    def _unmark(self, value: KVValue) -> None:
        """Clear the held marks of a node's slots ``value`` (they leave the tree)."""
        held = self._held
        if held is None:
            return
        if _unmark_c is not None and type(value) is array:
            _unmark_c(value.buffer_info()[0], len(value), self.page_size, held)
            return
        arr = self.host_slots(value)
        ids = arr if self.page_size == 1 else arr[:: self.page_size] // self.page_size
        np.bitwise_and.at(held, ids >> 3, ~np.left_shift(1, ids & 7).astype(np.uint8))

    # ------------------------------------------------------------------ values
    def attach(self, node: TreeNode, value: KVValue) -> None:
        """Give a node (``kv_lock == 0``) its slots, already :meth:`claim`-ed. The node keeps
        a value of its own: :meth:`claim`'s copy is kept as it is; a slot tensor's values are
        copied into a new ``array('q')`` (:func:`to_value`: a device tensor's host mirror)."""
        own = node.kv_value = value if type(value) is array else to_value(value)
        self._evictable += len(node.key)  # (one slot per token: cheaper than the value's size)
        if self.chunks is not None:
            self.chunks.add(node, own)

    def replace(self, node: TreeNode, value: KVValue) -> None:
        """``node`` (unlocked) takes claimed ``value`` instead of its slots, which are freed
        (kept as :meth:`attach` keeps a value)."""
        old = node.kv_value
        assert old is not None and node.kv_lock == 0 and len(old) == len(value), node
        if self.chunks is not None:
            self.chunks.remove(node)
        self._release_value(old)
        own = node.kv_value = to_value(value)
        if self.chunks is not None:
            self.chunks.add(node, own)

    def relocate(self, moves: Sequence[tuple[TreeNode, np.ndarray]], src: np.ndarray,
                 dst: np.ndarray) -> None:
        """Nodes whose data moved to other slots (an arena's compaction,
        ``components.compaction``): each ``(node, slots)`` pair gives an unlocked node new
        slots (int64, one per token of its key: the old ones with every id ``src[i]``
        replaced by ``dst[i]``), kept as a new array of its own (a node's array is never
        written); the held marks of ids ``src`` (pages when paged) move to ``dst``. Nothing is
        freed or allocated here (the allocator's side is the caller's). O(ids moved + the
        nodes' slots)."""
        for node, slots in moves:
            assert node.kv_lock == 0 and node.kv_value is not None, node
            assert len(slots) == len(node.kv_value), node
        held = self._held
        if held is not None and src.size:
            np.bitwise_and.at(held, src >> 3, ~np.left_shift(1, src & 7).astype(np.uint8))
            np.bitwise_or.at(held, dst >> 3, np.left_shift(1, dst & 7).astype(np.uint8))
        if self.chunks is not None:
            self.chunks.move(src, dst)
        for node, slots in moves:
            node.kv_value = _array_of(slots)

    def _release_value(self, value: KVValue) -> None:
        """Clear the held marks of a node's slots ``value`` and free them (they leave the
        tree): one C pass (``owned_release``, given the array's address and length) for a
        CPU value whose slots are all held, else :meth:`_unmark` and the allocator's
        ``free_owned``."""
        rel = self._release
        if rel is not None and type(value) is array and rel(
                value.buffer_info()[0], len(value), self.page_size, self._marks_at,
                self._marks_len):
            return
        self._unmark(value)
        self._free(slot_tensor(value))

    def on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        value = lower.kv_value
        if value is None:  # a host-only node (HiCache)
            return
        # An array's slices are copies (each half its own memory).
        upper.kv_value = value[:split_len]
        lower.kv_value = value[split_len:]
        if self.chunks is not None:
            self.chunks.split(upper)
        if lower in self.leaves:  # its key may depend on its start (tlru)
            self.leaves.update(lower)

    def on_remove(self, node: TreeNode) -> int:
        """Free ``node``'s device KV (it leaves the tree, or is demoted to host); returns the
        tokens freed (0 for a host-only node)."""
        value = node.kv_value
        if value is None:
            return 0
        assert node.kv_lock == 0, node
        self.leaves.discard(node)
        n = len(value)
        self._evictable -= n
        self.evicted += n
        if self.chunks is not None:
            self.chunks.remove(node)
        self._release_value(value)
        node.kv_value = None
        return n

    def evict_leaves(self, target: int, tree: RadixTree) -> int:
        """Evict whole unlocked leaves in policy order until ``target`` tokens are freed, when
        this component is the tree's only one and nothing else watches a removal (no host
        tier, no per-node data, no removal or refresh hooks but this component's; the caller,
        ``radix.core.CacheCore.evict``, checks that). Returns the tokens freed.

        The same result, node for node, as the general walk (pop a victim, ``on_remove``,
        detach it, re-file its parent), with the per-node steps inline: one ordered-set pop,
        the allocator's one-pass free that also clears the node's held marks
        (``owned_release``; else the C unmark and ``free_owned``), the detach, and the parent
        filed as a candidate when it became an unlocked leaf. The counters are updated for
        every node freed, also if a free raises.

        Complexity: O(log n) per freed node (the ordered set).
        """
        leaves = self.leaves
        pop, update, free = leaves.pop_first, leaves.update, self._free
        detach, root = tree.remove_leaf, tree.root
        marks, nmarks, ps = self._marks_at, self._marks_len, self.page_size
        rel = self._release
        chunks = self.chunks
        freed = 0
        try:
            while freed < target:
                node = pop()
                if node is None:
                    break
                # (every node value is an array)
                value: Any = node.kv_value
                assert value is not None and node.kv_lock == 0, node
                n = len(value)
                if chunks is not None:
                    chunks.remove(node)
                if rel is None or not rel(value.buffer_info()[0], n, ps, marks, nmarks):
                    self._unmark(value)
                    free(slot_tensor(value))
                node.kv_value = None
                freed += n
                parent = detach(node)
                if parent is not root and not parent.children and not parent.kv_lock:
                    update(parent)  # (as refresh: it is now an unlocked leaf)
        finally:
            self._evictable -= freed
            self.evicted += freed
        return freed

    def is_candidate(self, node: TreeNode) -> bool:
        """An unlocked device leaf."""
        if node.parent is None or node.kv_lock or node.kv_value is None:
            return False
        if not self.host_tier:
            return not node.children
        return not any(c.kv_value is not None for c in node.children.values())

    def refresh(self, node: TreeNode) -> None:
        # (is_candidate inlined: called on every node a match, insert or unlock re-files)
        if node.kv_lock or node.kv_value is None or node.parent is None or (
                node.children and (not self.host_tier or any(
                    c.kv_value is not None for c in node.children.values()))):
            self.leaves.discard(node)
        else:
            self.leaves.update(node)

    def pop_victim(self) -> TreeNode | None:
        """The unlocked device leaf first in policy order (removed from the order)."""
        return self.leaves.pop_first()

    # ------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors (root excluded)."""
        n = node
        chunks = self.chunks
        while n.parent is not None:
            if n.kv_lock == 0:
                size = len(n.key)
                self._evictable -= size
                self._protected += size
                n.kv_lock = 1
                if chunks is not None:
                    chunks.set_locked(n, 1)
            else:
                n.kv_lock += 1
            n = n.parent
        self.leaves.discard(node)

    def unlock(self, node: TreeNode, data: Any = None) -> None:
        """Release one lock on ``node`` and its ancestors; the caller checked ``kv_lock > 0``
        and re-files ``node`` afterwards."""
        n = node
        chunks = self.chunks
        while n.parent is not None:
            n.kv_lock -= 1
            if n.kv_lock == 0:
                size = len(n.key)
                self._evictable += size
                self._protected -= size
                if chunks is not None:
                    chunks.set_locked(n, -1)
            n = n.parent

    def track_chunks(self, tree: RadixTree, group: int) -> ChunkHolders:
        """Keep, from now on, per group of ``group`` consecutive ids the ids held and held by
        locked nodes, and each id's holder (``components.kv_chunks.ChunkHolders``, counted
        from ``tree``'s nodes on the first call; ``self.chunks``). Returns
        it; a later call with the same ``group`` returns the same object, O(1); another
        ``group`` recounts.

        Raises:
            ValueError: ``group`` not an int ``>= 1``; an allocator without a free mask (its
                ids are unknown).

        Complexity: O(slots held) on the first call; then each hook O(ids it changes), a
        lock change O(groups the node touches).
        """
        from components.kv_chunks import ChunkHolders

        got = self.chunks
        if got is not None and got.group == group:
            return got
        if self._free_mask is None:
            raise ValueError("track_chunks: the KV allocator has no free mask (ids unknown)")
        got = self.chunks = ChunkHolders.build(tree.iter_nodes(), self._num_ids, group,
                                               self.page_size)
        return got

    # ---------------------------------------------------------------- counters
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def stats(self) -> dict[str, Any]:
        return {"evicted_tokens": self.evicted, "inserted_tokens": self.inserted,
                "kv_evictable": self._evictable, "kv_protected": self._protected}

    def reset(self) -> None:
        """Every node is gone (their slots unmarked by :meth:`on_remove`)."""
        self.leaves.clear()
        self._evictable = self._protected = self.evicted = self.inserted = 0
        self._view_of, self._view = None, _NO_SLOTS
        self._uploads.clear()
        self.chunks = None  # (rebuilt from the tree by the next track_chunks)

    # ------------------------------------------------------------------- tiers
    # The primary component of a host tier (``components.base``): ``node.host_value`` holds
    # the host KV slots of a backed-up node, one per token of its key.
    def host_pool(self, config: Any) -> tuple[Any, Any, Any]:
        from hicache.host_pools import kv_lanes, mirror_kv

        host = mirror_kv(self.allocator, config)
        return self.allocator, host, kv_lanes(self.allocator, host)

    def host_demand(self) -> tuple[int, int, int]:
        from hicache.host_pools import kv_demand

        return kv_demand(self.allocator)

    def has_device(self, node: TreeNode) -> bool:
        return node.kv_value is not None

    def host_copy(self, node: TreeNode) -> torch.Tensor | None:
        return node.host_value

    def backup_size(self, node: TreeNode) -> int:
        return len(node.key) if node.kv_value is not None and node.host_value is None else 0

    def backup(self, node: TreeNode, host: torch.Tensor) -> torch.Tensor:
        node.host_value = host
        return self.slots(node)

    def adopt_host(self, node: TreeNode, host: torch.Tensor) -> None:
        """A host-only ``node`` (L3 pages just unpacked into ``host``) keeps ``host``."""
        node.host_value = host

    def restore_size(self, node: TreeNode, last: bool) -> int:
        return len(node.key) if node.kv_value is None and node.host_value is not None else 0

    def restore(self, node: TreeNode, device: torch.Tensor, now: int) -> torch.Tensor:
        """``node`` takes ``device`` (fresh from the allocator: claimed here) as its KV."""
        own = self.claim(device, copy=True)
        assert own is not None and node.host_value is not None
        self.attach(node, own)
        return node.host_value

    def drop_host(self, node: TreeNode) -> None:
        hv = node.host_value
        if hv is not None:
            self.host_allocator.free_owned(hv)
            node.host_value = None

    def undo_host(self, node: TreeNode) -> None:
        hv = node.host_value
        if hv is not None:
            node.host_value = None
            self.host_allocator.undo_alloc(hv)

    def split_host(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        hv = lower.host_value
        if hv is not None:
            upper.host_value = hv[:split_len]
            lower.host_value = hv[split_len:]

    def revive_host(self, node: TreeNode, slots: KVValue) -> None:
        self.attach(node, slots)  # the node keeps ``slots`` (as its own) as its kv_value

    # L3 (the primary component): a record per page of the host copy, sections ``(K, V)``,
    # each every layer's rows of the page's tokens (empty for a host allocator without a pool)
    def _host_pool(self) -> Any:
        return getattr(self.host_allocator, "pool", None)

    def l3_layout(self) -> str:
        from hicache.storage.keys import kv_layout

        return kv_layout(self._host_pool())

    def l3_sections(self) -> tuple[int, int]:
        pool = self._host_pool()
        if pool is None:
            return (0, 0)
        elem = torch.empty((), dtype=pool.dtype).element_size()
        n = pool.num_layers * self.page_size * pool.num_heads * pool.head_dim * elem
        return (n, n)

    def pack_pages(self, host: torch.Tensor) -> list[tuple[bytes, bytes]]:
        npages = len(host) // self.page_size
        pool = self._host_pool()
        if pool is None:
            return [(b"", b"")] * npages
        idx = host.to(pool.device)
        out_k = _pages_bytes(pool.k_all[:, idx], npages)
        out_v = _pages_bytes(pool.v_all[:, idx], npages)
        return list(zip(out_k, out_v, strict=True))

    def unpack_pages(self, host: torch.Tensor, pages: Sequence[Page]) -> None:
        pool = self._host_pool()
        if pool is None or not pages:
            return
        ps = self.page_size
        npages, layers = len(pages), pool.num_layers
        shape = (npages, layers, ps, pool.num_heads, pool.head_dim)
        idx = host.to(pool.device)
        for target, sections in ((pool.k_all, [p.a for p in pages]),
                                 (pool.v_all, [p.b for p in pages])):
            buf = bytearray(b"".join(sections))
            t = torch.frombuffer(buf, dtype=torch.uint8).view(pool.dtype).reshape(shape)
            target[:, idx] = t.transpose(0, 1).reshape(layers, npages * ps, pool.num_heads,
                                                       pool.head_dim)

    def check_host(self, nodes: list[TreeNode]) -> None:
        """Host KV: one slot per token, backed-up nodes a prefix from the root, every host
        slot held once and not free."""
        held = []
        for n in nodes:
            hv = n.host_value
            if hv is None:
                continue
            assert len(hv) == len(n.key), f"{n}: {len(hv)} host slots for {len(n.key)} tokens"
            p = n.parent
            assert p is not None
            if p.parent is not None:
                assert p.host_value is not None, f"backed up before its parent: {n}"
            held.append(hv)
        if held:
            slots = torch.cat(held)
            assert slots.unique().numel() == slots.numel(), "a host slot is held by two nodes"
            assert not bool(self.host_allocator.is_free(slots).any()), (
                "a host slot held by the tree is free")

    # ------------------------------------------------------------------ insert
    def check_insert(self, n: int, value: Any, state_slot: int | None) -> None:
        """Raise unless ``value`` is a 1-D int64 tensor of ``n`` KV slots on the allocator's
        device."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"value must be a 1-D torch.int64 tensor of KV slots, got {type(value).__name__}"
            )
        if value.dtype != torch.int64:
            raise TypeError(f"value must have dtype torch.int64, got {value.dtype}")
        if value.shape != (n,):
            if value.dim() != 1:
                raise ValueError(f"value must be 1-D, got shape {tuple(value.shape)}")
            raise ValueError(
                f"value has {value.shape[0]} slots but key has {n} tokens; lengths must match"
            )
        if value.is_cpu if self._cpu else value.device == self.device:  # both indices resolved
            return
        raise ValueError(f"value is on {value.device}, the KV allocator on {self.device}")

    def check(self, nodes: list[TreeNode]) -> None:
        dev = [n.kv_value for n in nodes if n.kv_value is not None]
        if dev:
            slots = cat_values(dev).cpu()  # the true device values (a check may read them)
            assert slots.unique().numel() == slots.numel(), "a KV slot is held by two nodes"
            is_free = getattr(self.allocator, "is_free", None)
            if callable(is_free):
                assert not bool(is_free(slots).any()), (
                    "a KV slot held by the tree is free in the allocator"
                )
        ev = pr = 0
        expected_leaves = set()
        for n in nodes:
            v = n.kv_value
            if v is None:
                assert self.host_tier and n.host_value is not None, f"node with no KV anywhere: {n}"
                assert n.kv_lock == 0, f"host-only node locked: {n}"
                assert all(c.kv_value is None for c in n.children.values()), (
                    f"device node below a host-only one: {n}"
                )
                continue
            assert type(v) is array and v.typecode == "q", f"{n}: slots not an array('q')"
            assert len(v) == len(n.key), f"{n}: {len(v)} slots for {len(n.key)} tokens"
            assert n.kv_lock >= 0, n
            p = n.parent
            assert p is not None
            if p.parent is not None:
                assert p.kv_lock >= n.kv_lock, f"parent less locked than child: {p} / {n}"
            if n.kv_lock == 0:
                ev += len(v)
            else:
                pr += len(v)
            if self.is_candidate(n):
                expected_leaves.add(n.id)
        held = self._held
        if held is not None:
            ps = self.page_size
            want = np.zeros(self._num_ids + 1, dtype=np.bool_)
            for n in nodes:
                if n.kv_value is not None:
                    arr = slot_tensor(n.kv_value).cpu().numpy()
                    want[arr if ps == 1 else arr[::ps] // ps] = True
            marked = self.held_mask()
            assert marked is not None
            assert not marked[0], "the padding id is marked held"
            pad = np.unpackbits(held, bitorder="little")[self._num_ids + 1:]
            assert not pad.any(), "a held bit set past the last id"
            assert bool((marked == want).all()), (
                f"held marks differ from the nodes' slots at ids "
                f"{np.flatnonzero(marked != want)[:16].tolist()}"
            )
        assert ev == self._evictable, f"kv evictable {self._evictable} != recomputed {ev}"
        assert pr == self._protected, f"kv protected {self._protected} != recomputed {pr}"
        got = {n.id for n in self.leaves}
        assert got == expected_leaves, (
            f"kv eviction set differs: extra {got - expected_leaves}, missing {expected_leaves - got}"
        )
        self.leaves.check()
        if self.chunks is not None:
            self.chunks.check(nodes)


def _array_of(slots: np.ndarray) -> array[int]:
    """A new ``array('q')`` holding int64 ``slots``."""
    out = array("q")
    out.frombytes(np.ascontiguousarray(slots, dtype=np.int64).data.cast("B"))
    return out


def _pages_bytes(x: torch.Tensor, npages: int) -> list[bytes]:
    """Each page's bytes of ``x`` (``[layers, npages * page_size, ...]``), layers outermost."""
    layers = x.shape[0]
    per_page = x.reshape(layers, npages, -1).transpose(0, 1).contiguous()
    raw = per_page.view(torch.uint8).reshape(npages, -1).cpu().numpy()
    return [raw[i].tobytes() for i in range(npages)]
