"""Device slots of LoRA weights: ``slots -> tensors`` (the layer below the LoRA pool).

Layout (``K`` slots, ``R = max_lora_rank``)::

    A_buffer[module]: [K, R, in_features]       B_buffer[module]: [K, out_features, R]
    scaling:          [K]
    slot_to_uid[slot]: LoraUid | BASE_MODEL | None      (None = empty, and nothing else)
    uid_to_slot[uid]:  slot                             (the inverse, resident ids only)

A slot holds exactly its occupant's weights: rank ``r < R`` zero-padded, a module the adapter
lacks all zero, the base model all zero with scaling 0. Every fill zeroes the slot first, so
nothing of a previous occupant survives. :class:`LoraSlots` knows nothing of pins or policy;
:class:`~allocators.lora.LoraMemoryPool` decides who goes where.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..memory import check_memory
from .identity import AdapterId
from .weights import LoraAdapter

__all__ = ["LoraSlots"]


class LoraSlots:
    """``num_slots`` slots of A / B / scaling buffers and the two slot maps.

    Args are validated by the owner (:class:`~allocators.lora.LoraMemoryPool`).
    ``non_blocking``: issue fills as ``non_blocking`` copies (asynchronous from pinned host
    memory on CUDA; stream order keeps them before any later kernel on the same stream).
    """

    def __init__(
        self,
        target_modules: dict[str, tuple[int, int]],
        max_lora_rank: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        non_blocking: bool,
    ) -> None:
        self.target_modules = target_modules
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.non_blocking = non_blocking
        k, r = num_slots, max_lora_rank
        check_memory(k * (1 + r * sum(i + o for i, o in target_modules.values())) * dtype.itemsize,
                     f"LoraMemoryPool(max_loras_per_batch={k}, max_lora_rank={r})", device)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.A_buffer = {m: torch.zeros((k, r, i), **kw) for m, (i, _) in target_modules.items()}
        self.B_buffer = {m: torch.zeros((k, o, r), **kw) for m, (_, o) in target_modules.items()}
        self.scaling = torch.zeros(k, **kw)
        self.slot_to_uid: list[AdapterId | None] = [None] * k
        self.uid_to_slot: dict[AdapterId, int] = {}

    @property
    def num_slots(self) -> int:
        return len(self.slot_to_uid)

    def first_empty(self) -> int | None:
        """The lowest empty slot, or ``None`` when every slot is taken. O(K)."""
        for slot, occupant in enumerate(self.slot_to_uid):
            if occupant is None:
                return slot
        return None

    def fill(self, slot: int, uid: AdapterId, adapter: LoraAdapter | None) -> None:
        """Write ``adapter``'s weights (``None``: the base model's zeros) into an empty
        ``slot`` and record ``uid`` there. O(slot size)."""
        assert self.slot_to_uid[slot] is None and uid not in self.uid_to_slot
        self._write(slot, adapter)
        self.slot_to_uid[slot] = uid
        self.uid_to_slot[uid] = slot

    def vacate(self, uid: AdapterId) -> int:
        """Forget where ``uid`` is (its weights stay until the next fill); returns its slot."""
        slot = self.uid_to_slot.pop(uid)
        self.slot_to_uid[slot] = None
        return slot

    def clear(self, uid: AdapterId) -> int:
        """:meth:`vacate` and zero the slot (used on unload); returns the slot."""
        slot = self.vacate(uid)
        self._write(slot, None)
        return slot

    def _write(self, slot: int, adapter: LoraAdapter | None) -> None:
        weights = {} if adapter is None else adapter.weights
        nb = self.non_blocking
        for module, a_buf in self.A_buffer.items():
            b_buf = self.B_buffer[module]
            a_buf[slot].zero_()
            b_buf[slot].zero_()
            if module in weights:
                a, b = weights[module]
                r = a.shape[0]
                a_buf[slot, :r].copy_(a, non_blocking=nb)
                b_buf[slot, :, :r].copy_(b, non_blocking=nb)
        self.scaling[slot] = 0.0 if adapter is None else adapter.scaling

    def check_compatible(self, name: str, adapter: object) -> None:
        """Raise unless ``adapter`` fits the buffers; the message names the argument to raise.

        Raises:
            TypeError: not a :class:`LoraAdapter`.
            ValueError: rank above ``max_lora_rank``; a module outside
                ``lora_target_modules``; a module whose shapes differ from the base model's.
        """
        if not isinstance(adapter, LoraAdapter):
            raise TypeError(f"adapter must be a LoraAdapter, got {type(adapter).__name__}")
        if adapter.rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {name!r} has rank {adapter.rank} > max_lora_rank={self.max_lora_rank}; "
                f"start with max_lora_rank >= {adapter.rank} to load it"
            )
        extra = sorted(adapter.modules.difference(self.target_modules))
        if extra:
            raise ValueError(
                f"adapter {name!r} targets {extra}, not in lora_target_modules="
                f"{sorted(self.target_modules)}; start with lora_target_modules including "
                "them (or 'all')"
            )
        for module, (a, b) in adapter.weights.items():
            in_f, out_f = self.target_modules[module]
            if a.shape[1] != in_f or b.shape[0] != out_f:
                raise ValueError(
                    f"adapter {name!r} module {module!r}: A {tuple(a.shape)} / B "
                    f"{tuple(b.shape)} do not fit in_features={in_f}, out_features={out_f}"
                )

    def apply(self, module: str, x: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
        """Batched LoRA delta: ``out[t] = scaling[s] * B[s] @ (A[s] @ x[t])``, ``s`` the row's
        slot; ``x`` may be ``[T]`` int64 token ids (an embedding: ``A[s][:, x[t]]``). See
        :meth:`LoraMemoryPool.apply <allocators.lora.LoraMemoryPool.apply>`."""
        if not isinstance(module, str):
            raise TypeError(f"module must be a str, got {type(module).__name__}")
        if module not in self.A_buffer:
            raise ValueError(f"module must be one of {sorted(self.A_buffer)}, got {module!r}")
        in_f, out_f = self.target_modules[module]
        ids = isinstance(x, torch.Tensor) and not x.dtype.is_floating_point
        if ids:
            _check_tensor(x, "x", (None,), torch.int64, self.device)
            if x.shape[0] and not bool(((x >= 0) & (x < in_f)).all()):
                raise ValueError(f"x (token ids) must lie in [0, {in_f}) for module {module!r}")
        else:
            _check_tensor(x, "x", (None, in_f), self.dtype, self.device)
        _check_tensor(weight_indices, "weight_indices", (x.shape[0],), torch.int64, self.device)
        k = self.num_slots
        if x.shape[0] and not bool(((weight_indices >= 0) & (weight_indices < k)).all()):
            raise ValueError(f"weight_indices must lie in [0, {k})")
        out = torch.zeros((x.shape[0], out_f), dtype=self.dtype, device=self.device)
        a_buf, b_buf = self.A_buffer[module], self.B_buffer[module]
        for slot in torch.unique(weight_indices).tolist():
            rows = (weight_indices == slot).nonzero().squeeze(1)
            picked = x.index_select(0, rows)
            after_a = a_buf[slot].T.index_select(0, picked) if ids else picked @ a_buf[slot].T
            out.index_copy_(0, rows, (after_a @ b_buf[slot].T) * self.scaling[slot])
        return out


def _check_tensor(
    t: object,
    name: str,
    shape: Sequence[int | None],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    dims = tuple(t.shape)
    if len(dims) != len(shape) or any(
        s is not None and s != d for s, d in zip(shape, dims, strict=True)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(dims)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
