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
"""

from __future__ import annotations

import torch

from ._checks import (
    as_index_tensor,
    check_device,
    check_float_dtype,
    check_int,
    check_positive_int,
    check_range,
)

__all__ = ["KVPool"]


class KVPool:
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

    Raises:
        TypeError: an argument of the wrong type (names it).
        ValueError: a non-positive size, non-float dtype or unavailable device (names it).
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
    ) -> None:
        self.size = check_positive_int(size, "size")
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.dtype = check_float_dtype(dtype, "dtype")
        self.device = check_device(device, "device")
        self.page_size = check_positive_int(page_size, "page_size")
        self.num_slots = self.size + self.page_size
        shape = (self.num_layers, self.num_slots, self.num_heads, self.head_dim)
        self.k_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V for one token slot over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_heads * self.head_dim * elem

    @property
    def total_bytes(self) -> int:
        """Bytes held by the K and V tensors, padding rows included."""
        return self.bytes_per_token * self.num_slots

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
        idx = self._slots(slots, "slots")
        shape = (idx.numel(), self.num_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {t.dtype}, pool dtype is {self.dtype}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
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
        idx = self._slots(slots, "slots")
        return self.k_all[layer, idx], self.v_all[layer, idx]

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
        src = self._slots(src_slots, "src_slots")
        dst = self._slots(dst_slots, "dst_slots")
        if src.numel() != dst.numel():
            raise ValueError(f"src_slots has {src.numel()} slots but dst_slots has {dst.numel()}")
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError("dst_slots repeats a slot; the copy result would be unspecified")
        self.k_all[:, dst] = self.k_all[:, src]
        self.v_all[:, dst] = self.v_all[:, src]

    def __repr__(self) -> str:
        return (
            f"KVPool(size={self.size}, num_layers={self.num_layers}, num_heads={self.num_heads},"
            f" head_dim={self.head_dim}, dtype={self.dtype}, device={self.device},"
            f" page_size={self.page_size})"
        )

    # ------------------------------------------------------------------ helpers
    def _layer(self, layer: int) -> int:
        layer = check_int(layer, "layer", minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer={layer} is out of range for num_layers={self.num_layers}")
        return layer

    def _slots(self, slots: torch.Tensor, name: str) -> torch.Tensor:
        idx = as_index_tensor(slots, name)
        check_range(idx, name, low=0, high=self.num_slots)
        return idx.to(self.device)
