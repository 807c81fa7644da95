"""Per-layer K and V tensors indexed by slot id: ``slots -> tensors``.

Layout: one tensor per direction holding every layer, so that a copy across all layers is a
single gather/scatter::

    k_all: [num_layers, num_slots, num_heads, head_dim]    (dtype, device)
    v_all: [num_layers, num_slots, num_heads, head_dim]
    num_slots = size + page_size     # slot 0 (page 0 when paged) is padding

``k_buffer(layer)`` / ``v_buffer(layer)`` are views ``[num_slots, num_heads, head_dim]`` of one
layer, as an attention kernel would take them. All tensors start zeroed.

The pool does not know which slots are in use: that is the allocator's job
(:class:`~allocators.token_allocator.TokenAllocator`). It only checks that slot ids are rows
of its tensors.

An engine that already has its K and V tensors (one per layer, allocated its own way) puts them
behind the same interface with :class:`KVBuffers` (nothing copied), so the host tier moves
their data: ``gather(slots) -> (k, v)`` and ``scatter(slots, k, v)`` over all layers are what
copies use. Slot arguments are read on the host through their host mirrors
(``allocators.host_mirror``) and used on the device as given: no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import (
    as_index_tensor,
    check_device,
    check_float_dtype,
    check_int,
    check_positive_int,
    check_range,
    check_tensor,
    resolve_device,
)
from .memory import check_memory
from .staging import pin_in_place, upload

__all__ = ["LAYOUTS", "KVBuffers", "KVPool", "KVStorage"]

#: Memory layouts of a :class:`KVPool` (SGLang's ``hicache_mem_layout`` names).
LAYOUTS = ("layer_first", "page_first")


class _KVLayout:
    """What :class:`KVPool` and :class:`KVBuffers` share: ``num_layers`` layers of
    ``[num_slots, num_heads, head_dim]`` K and V rows of ``dtype``."""

    num_layers: int
    num_heads: int
    head_dim: int
    num_slots: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V for one token slot over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_heads * self.head_dim * elem

    @property
    def total_bytes(self) -> int:
        """Bytes held by the K and V tensors, padding rows included."""
        return self.bytes_per_token * self.num_slots

    def _layer(self, layer: int) -> int:
        layer = check_int(layer, "layer", minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer={layer} is out of range for num_layers={self.num_layers}")
        return layer

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K and V rows ``slots`` (each storage implements it)."""
        raise NotImplementedError

    def scatter(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write :meth:`gather`'s ``k``, ``v`` into rows ``slots`` (each storage implements it)."""
        raise NotImplementedError

    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K and V of every layer from ``src_slots[i]`` to ``dst_slots[i]``.

        One gather and one scatter per direction (no per-token or per-layer Python loop).
        Reads happen before writes, so overlapping ``src``/``dst`` behave as a simultaneous
        copy.

        Raises:
            TypeError: not 1-D int64 tensors (dtype).
            ValueError: not 1-D, lengths differ, a slot out of ``[0, num_slots)``, or a
                repeated destination slot. Nothing is written.
        """
        src_host, src = self._slots(src_slots, "src_slots")
        dst_host, dst = self._slots(dst_slots, "dst_slots")
        if src_host.numel() != dst_host.numel():
            raise ValueError(
                f"src_slots has {src_host.numel()} slots but dst_slots has {dst_host.numel()}"
            )
        if torch.unique(dst_host).numel() != dst_host.numel():
            raise ValueError("dst_slots repeats a slot; the copy result would be unspecified")
        k, v = self.gather(src)
        self.scatter(dst, k, v)

    def _slots(self, slots: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return slot_args(slots, name, self.num_slots, self.device)


class KVPool(_KVLayout):
    """Real K/V storage for ``size`` token slots across ``num_layers`` layers.

    Args:
        size: slots an allocator may hand out (``> 0``).
        num_layers: attention layers (``> 0``).
        num_heads: KV heads per layer (``> 0``).
        head_dim: elements per head (``> 0``).
        dtype: floating-point ``torch.dtype`` of K and V.
        device: ``str`` or ``torch.device``; CUDA only when available.
        page_size: padding rows at the front (``> 0``); a paged allocator with page size P
            needs ``page_size=P`` so that page ids ``1..size/P`` fit.
        pin_memory: page-lock the CPU tensors where they are allocated (``cudaHostRegister``:
            no pageable copy pinned afterwards, no rounding up), so copies to and from a GPU
            can be asynchronous; a host pool mirroring a CUDA pool is built so.
        layout: where the memory of one slot lies: ``"layer_first"`` (default: ``k_store`` is
            ``[num_layers, num_slots, num_heads, head_dim]``, a slot's rows one per layer) or
            ``"page_first"`` (``k_store`` is ``[num_slots, num_layers, num_heads, head_dim]``:
            a run of consecutive slots, every layer, is one contiguous range: what a host pool
            takes so that a run is one copy). ``k_all`` / ``v_all`` are
            ``[num_layers, num_slots, ...]`` views either way.

    Raises:
        TypeError: an argument of the wrong type (names it).
        ValueError: a non-positive size, non-float dtype, unavailable device or unknown
            layout (names it); ``pin_memory`` on a device other than the CPU; K and V tensors
            larger than the memory available (``allocators.memory.MemoryBudgetError``).
    """

    def __init__(
        self,
        size: int,
        num_layers: int = 2,
        num_heads: int = 2,
        head_dim: int = 8,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        *,
        pin_memory: bool = False,
        layout: str = "layer_first",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is unknown; expected one of {list(LAYOUTS)}")
        self.size = check_positive_int(size, "size")
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.dtype = check_float_dtype(dtype, "dtype")
        self.device = check_device(device, "device")
        if pin_memory and self.device.type != "cpu":
            raise ValueError(f"pin_memory is for a host pool, this one is on {self.device}")
        self.page_size = check_positive_int(page_size, "page_size")
        self.num_slots = self.size + self.page_size
        self.layout = layout
        #: ``page_first``: a slot's rows of every layer are adjacent (``k_store[slot]``)
        self.slot_first = layout == "page_first"
        dims = [self.num_layers, self.num_slots, self.num_heads, self.head_dim]
        if self.slot_first:
            dims[0], dims[1] = dims[1], dims[0]
        check_memory(self.total_bytes, f"KVPool(size={self.size:,}, num_layers={self.num_layers}, "
                     f"num_heads={self.num_heads}, head_dim={self.head_dim}, dtype={self.dtype})",
                     self.device)
        #: the contiguous tensors holding the data (``layout`` order), allocated once
        self.k_store = torch.zeros(dims, dtype=self.dtype, device=self.device)
        self.v_store = torch.zeros(dims, dtype=self.dtype, device=self.device)
        if pin_memory:
            pin_in_place(self.k_store)
            pin_in_place(self.v_store)
        #: ``[num_layers, num_slots, num_heads, head_dim]`` views of the stores
        self.k_all = self.k_store.transpose(0, 1) if self.slot_first else self.k_store
        self.v_all = self.v_store.transpose(0, 1) if self.slot_first else self.v_store

    # ------------------------------------------------------------------ access
    def k_buffer(self, layer: int) -> torch.Tensor:
        """View of layer ``layer``'s K: ``[num_slots, num_heads, head_dim]``. Raises ValueError."""
        return self.k_all[self._layer(layer)]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """View of layer ``layer``'s V: ``[num_slots, num_heads, head_dim]``. Raises ValueError."""
        return self.v_all[self._layer(layer)]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k[i]``, ``v[i]`` into slot ``slots[i]`` of layer ``layer``.

        Args:
            layer: ``0 <= layer < num_layers``.
            slots: 1-D ``torch.int64``, values in ``[0, num_slots)`` (slot 0, the padding
                slot, may be written, as engines do for padded tokens). If a slot repeats,
                which write lands is unspecified.
            k, v: ``[len(slots), num_heads, head_dim]``, dtype ``self.dtype``, any device.

        Raises:
            TypeError: wrong tensor types or dtypes.
            ValueError: bad layer, slot out of range, or shape mismatch. Nothing is written.
        """
        layer = self._layer(layer)
        host, idx = self._slots(slots, "slots")
        shape = (host.numel(), self.num_heads, self.head_dim)
        check_tensor(k, "k", self.dtype, shape)
        check_tensor(v, "v", self.dtype, shape)
        self.k_all[layer, idx] = k.to(self.device)
        self.v_all[layer, idx] = v.to(self.device)

    def get_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies ``(k, v)`` of slots ``slots`` in layer ``layer``.

        Returns:
            Two tensors ``[len(slots), num_heads, head_dim]`` of ``self.dtype`` on ``device``.

        Raises:
            TypeError / ValueError: as :meth:`set_kv` for ``layer`` and ``slots``.
        """
        layer = self._layer(layer)
        _, idx = self._slots(slots, "slots")
        return self.k_all[layer, idx], self.v_all[layer, idx]

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tensors ``(k, v)``, each ``[num_layers, len(slots), num_heads, head_dim]``: the
        rows ``slots`` (1-D int64 on ``device``, unchecked) of every layer. One gather each."""
        return self.k_all.index_select(1, slots), self.v_all.index_select(1, slots)

    def scatter(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` (as :meth:`gather` returns them, on ``device``) into the rows
        ``slots`` (1-D int64 on ``device``, unchecked, distinct) of every layer."""
        self.k_all.index_copy_(1, slots, k)
        self.v_all.index_copy_(1, slots, v)

    def __repr__(self) -> str:
        return (
            f"KVPool(size={self.size}, num_layers={self.num_layers}, num_heads={self.num_heads},"
            f" head_dim={self.head_dim}, dtype={self.dtype}, device={self.device},"
            f" page_size={self.page_size}"
            + (f", layout={self.layout!r})" if self.slot_first else ")")
        )

    # ------------------------------------------------------------------ helpers


def slot_args(slots: torch.Tensor, name: str, num_slots: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(host values, the same ids on device)`` of a slot argument, range-checked against
    ``[0, num_slots)`` on the host (through the host mirror: no device read); the device ids
    are ``slots`` itself when it is there already, else uploaded."""
    idx = as_index_tensor(slots, name)
    check_range(idx, name, low=0, high=num_slots)
    if slots.device == device:
        return idx, slots
    if device.type == "cpu":
        return idx, idx
    return idx, upload(idx.numpy(), device)


class KVBuffers(_KVLayout):
    """An engine's own K and V tensors, one pair per layer, behind the pool interface
    (``slots -> tensors``): what the host tier copies when the engine allocated its KV cache
    itself. Nothing is copied here; the tensors stay the engine's.

    Args:
        k_buffers, v_buffers: one tensor per layer each, ``[num_slots, num_heads, head_dim]``,
            all of one floating-point dtype, shape and device.
        page_size: padding rows at the front (as :class:`KVPool`'s): the allocator hands out
            rows ``page_size .. num_slots - 1``.

    Raises:
        TypeError: not sequences of tensors, or a non-float dtype.
        ValueError: empty or unequal lists, a shape, dtype or device that differs between
            tensors, not 3-D, or fewer rows than one page plus one.
    """

    def __init__(self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                 page_size: int = 1) -> None:
        for name, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
            if isinstance(bufs, torch.Tensor) or not isinstance(bufs, Sequence) or not all(
                    isinstance(b, torch.Tensor) for b in bufs):
                raise TypeError(f"{name} must be a sequence of tensors (one per layer)")
        if not k_buffers or len(k_buffers) != len(v_buffers):
            raise ValueError(f"k_buffers and v_buffers need one tensor per layer each, got "
                             f"{len(k_buffers)} and {len(v_buffers)}")
        first = k_buffers[0]
        if first.dim() != 3:
            raise ValueError(f"k_buffers[0] must be [num_slots, num_heads, head_dim], got shape "
                             f"{tuple(first.shape)}")
        for name, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
            for i, b in enumerate(bufs):
                if b.shape != first.shape or b.dtype != first.dtype or b.device != first.device:
                    raise ValueError(
                        f"{name}[{i}] is {tuple(b.shape)} {b.dtype} on {b.device}; every buffer "
                        f"must be {tuple(first.shape)} {first.dtype} on {first.device}"
                    )
        self.dtype = check_float_dtype(first.dtype, "k_buffers[0].dtype")
        self.page_size = check_positive_int(page_size, "page_size")
        self.num_slots, self.num_heads, self.head_dim = (int(x) for x in first.shape)
        if self.num_slots <= self.page_size:
            raise ValueError(f"buffers of {self.num_slots} rows hold no slot past the "
                             f"{self.page_size} padding rows")
        self.size = self.num_slots - self.page_size
        self.num_layers = len(k_buffers)
        self.device = resolve_device(first.device)
        self.k_buffers = list(k_buffers)
        self.v_buffers = list(v_buffers)

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K tensor (the engine's own)."""
        return self.k_buffers[self._layer(layer)]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V tensor (the engine's own)."""
        return self.v_buffers[self._layer(layer)]

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`KVPool.gather`: ``[num_layers, len(slots), num_heads, head_dim]`` each
        (one gather per layer, stacked)."""
        return (torch.stack([b.index_select(0, slots) for b in self.k_buffers]),
                torch.stack([b.index_select(0, slots) for b in self.v_buffers]))

    def scatter(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """As :meth:`KVPool.scatter` (one scatter per layer)."""
        for layer, (kb, vb) in enumerate(zip(self.k_buffers, self.v_buffers, strict=True)):
            kb.index_copy_(0, slots, k[layer])
            vb.index_copy_(0, slots, v[layer])

    def __repr__(self) -> str:
        return (f"KVBuffers(size={self.size}, num_layers={self.num_layers}, "
                f"num_heads={self.num_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device}, page_size={self.page_size})")


#: What an allocator's ``pool`` may be: the library's pool or an engine's own buffers.
KVStorage = KVPool | KVBuffers
