"""Recurrent-state slots (Mamba / GDN / KDA): an allocator and its tensors in one object.

Layout (slot 0 is padding, never handed out)::

    conv: [num_layers, size + 1, *conv_state_shape]     (dtype, device)
    ssm:  [num_layers, size + 1, *ssm_state_shape]

so ``pool.conv[layer]`` is ``[size + 1, *conv_state_shape]``. A request's running state
lives in one slot; the tree keeps checkpoints in other slots. Copy-on-write: before an
engine mutates a state it got from the tree, it allocates its own slot and
``copy(tree_slot, own_slot)``; the tree's slot stays bit-exact.

Allocator behaviour (free-list order, errors, ``snapshot``) is that of
:class:`~allocators.token_allocator.TokenAllocator`, with one addition: ``alloc`` zeroes the
conv and ssm state of every slot it hands out, so a fresh request starts from zero state.

On the CPU a one-slot copy or zeroing goes through numpy views of the same memory
(``alloc_slot``, ``free_slot`` and ``copy`` of two ints build no tensor: the per-request path
of an engine), at once.

On a CUDA device ``alloc``, ``free`` and ``copy`` issue no CUDA call and no host
synchronisation: the free list is on the host, slot arguments are read as ints or through
their host mirrors (``allocators.host_mirror``), ``alloc`` hands out a view of an id table
uploaded once (``ids``: read-only, like every slot tensor the library hands out), and the
zeroing and copies are *pending* work kept on the host: per slot written, where its state
comes from (zero, or a slot's state as it was when the pending work began; a copy from a slot
with pending work takes that slot's source, a copy into a slot replaces its pending work, so a
checkpoint's zeroing followed by its copy is one copy). The pending work is issued when the
states are next read, by :meth:`flush` (a forward step's first read of ``conv`` / ``ssm``
calls it): all copies in one gather and one scatter per tensor and all zeroing in one
``index_fill_`` per tensor, with one upload of the slot ids (a single copy or zeroing: two
slice kernels, no upload): at most 1 memcpy and 6 kernel launches per step, whatever the
number of requests.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._checks import (
    as_slot_tensor,
    check_device,
    check_float_dtype,
    check_int,
    check_positive_int,
    check_shape,
    check_tensor,
)
from .host_mirror import host_ids, host_int, mirrored
from .memory import check_memory
from .staging import pin_in_place, upload
from .token_allocator import _FreeListAllocator

__all__ = ["MambaStatePool"]

#: A pending write's source meaning zeros (see the module docstring).
_ZERO = -1

#: Pool dtypes with a numpy counterpart (``torch.Tensor.numpy`` views them).
_NUMPY_DTYPES = frozenset((torch.float16, torch.float32, torch.float64))


def _slot_arg(slot: object, name: str) -> int:
    """One slot given as an int or a one-element integer tensor: a device tensor is read
    through its host mirror (``allocators.host_mirror.host_int``), not with ``__index__`` (a
    device -> host copy the host waits for)."""
    if isinstance(slot, torch.Tensor):
        return host_int(slot, name)
    return check_int(slot, name, minimum=-(2**62))


class MambaStatePool(_FreeListAllocator):
    """A fixed number of state slots, each holding real conv and SSM state for every layer.

    Args:
        size: slots that can be handed out (ids ``1..size``), ``> 0``.
        num_layers: recurrent layers, ``> 0``.
        conv_state_shape: per-layer conv state shape of one slot, positive ints.
        ssm_state_shape: per-layer SSM (temporal) state shape of one slot, positive ints.
        dtype: floating-point ``torch.dtype`` of both states.
        device: ``str`` or ``torch.device``.
        pin_memory: page-lock the CPU tensors where they are allocated (a host pool mirroring
            a CUDA pool; see ``allocators.staging.pin_in_place``).
        slot_first: keep a slot's state of every layer adjacent in memory (``conv_store`` is
            ``[size + 1, num_layers, *conv_state_shape]``; ``conv`` a
            ``[num_layers, size + 1, ...]`` view of it): one slot is then one contiguous range,
            one copy (a host pool with ``hicache_mem_layout="page_first"``).
        zero_on_alloc: zero the slots ``alloc`` / ``alloc_slot`` hand out (default); a host
            mirror whose slots are always filled by a copy turns it off.

    Raises:
        TypeError / ValueError: a bad argument, naming it; a size whose states exceed the
            memory available (``allocators.memory.MemoryBudgetError``).

    Attributes:
        conv: ``torch.Tensor [num_layers, size + 1, *conv_state_shape]`` (``dtype``, on
            ``device``): the convolution state of every slot in every recurrent layer; row 0 is
            padding. A Mamba2 layer's is ``(conv_dim, d_conv - 1)`` (the last ``d_conv - 1``
            inputs of its causal conv1d, ``conv_dim = d_inner + 2 * n_groups * d_state``), as
            SGLang's ``MambaPool`` lays it out; a GDN / KDA layer's, its own conv's.
        ssm: ``torch.Tensor [num_layers, size + 1, *ssm_state_shape]``: the temporal (SSM /
            linear-attention) state; a Mamba2 layer's is ``(num_heads, head_dim, d_state)``,
            a GDN layer's ``(num_heads, head_k_dim, head_v_dim)``.

        ``pool.conv[layer][slot]`` / ``pool.ssm[layer][slot]`` are the views a model reads and
        writes in place (``alloc`` zeroed them); :meth:`get_state` / :meth:`set_state` copy one
        slot's pair out / in, :meth:`copy` copies whole slots (every layer, both tensors).

    Slot arguments of :meth:`copy`, :meth:`get_state`, :meth:`set_state` must be slots
    currently handed out: anything else raises ``ValueError`` (``foreign index`` for 0 or out
    of range, ``not allocated`` for a free slot), before anything is written.
    """

    def __init__(
        self,
        size: int,
        num_layers: int = 2,
        conv_state_shape: tuple[int, ...] = (4, 3),
        ssm_state_shape: tuple[int, ...] = (2, 4, 4),
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        pin_memory: bool = False,
        slot_first: bool = False,
        zero_on_alloc: bool = True,
    ) -> None:
        size = check_positive_int(size, "size")
        device = check_device(device, "device")
        if pin_memory and device.type != "cpu":
            raise ValueError(f"pin_memory is for a host pool, this one is on {device}")
        super().__init__(size, 1, device, "state slot")
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.conv_state_shape = check_shape(conv_state_shape, "conv_state_shape")
        self.ssm_state_shape = check_shape(ssm_state_shape, "ssm_state_shape")
        self.dtype = check_float_dtype(dtype, "dtype")
        rows = size + 1
        #: ``alloc`` zeroes the slots it hands out (``False``: a host mirror, whose slots a copy
        #: fills whole: zeroing them would be CPU work growing with the state's bytes)
        self.zero_on_alloc = bool(zero_on_alloc)
        self.slot_first = bool(slot_first)
        lead = (rows, self.num_layers) if self.slot_first else (self.num_layers, rows)
        check_memory(self.total_bytes, f"MambaStatePool(size={size:,}, num_layers={self.num_layers}"
                     f", conv_state_shape={self.conv_state_shape}, ssm_state_shape="
                     f"{self.ssm_state_shape}, dtype={self.dtype})", device)
        #: the contiguous tensors holding the states (slot-first or layer-first), allocated once
        #: (read or written directly only after :meth:`flush`)
        self.conv_store = torch.zeros((*lead, *self.conv_state_shape), dtype=self.dtype, device=device)
        self.ssm_store = torch.zeros((*lead, *self.ssm_state_shape), dtype=self.dtype, device=device)
        if pin_memory:
            pin_in_place(self.conv_store)
            pin_in_place(self.ssm_store)
        #: ``[num_layers, size + 1, *shape]`` views of the stores (:attr:`conv`, :attr:`ssm`
        #: after the pending work)
        self._conv = self.conv_store.transpose(0, 1) if self.slot_first else self.conv_store
        self._ssm = self.ssm_store.transpose(0, 1) if self.slot_first else self.ssm_store
        #: On a device: slot written -> where its state comes from (a slot, or ``_ZERO``),
        #: work not yet issued (see the module docstring). Always empty on the CPU.
        self._pending: dict[int, int] = {}
        #: On a device: ids ``0 .. size`` on the device (``alloc`` hands out views), mirrored.
        self.ids: torch.Tensor | None = None
        if device.type != "cpu":
            self.ids = mirrored(np.arange(rows, dtype=np.int64), device)
        #: numpy views of ``conv`` and ``ssm`` (same memory) for one-slot copies and zeroing
        #: on the CPU: a numpy row assignment costs ~1 us, a torch view and ``copy_`` ~5 us.
        #: ``None`` on a device, or for a dtype numpy lacks (``bfloat16``): torch views then.
        self._views: tuple[np.ndarray, np.ndarray] | None = None
        if device.type == "cpu" and self.dtype in _NUMPY_DTYPES:
            self._views = (self._conv.numpy(), self._ssm.numpy())

    @property
    def conv(self) -> torch.Tensor:
        """Conv states ``[num_layers, size + 1, *conv_state_shape]`` (pending work issued
        first: :meth:`flush`)."""
        if self._pending:
            self.flush()
        return self._conv

    @property
    def ssm(self) -> torch.Tensor:
        """SSM states ``[num_layers, size + 1, *ssm_state_shape]`` (pending work issued
        first: :meth:`flush`)."""
        if self._pending:
            self.flush()
        return self._ssm

    def overwrite(self, slot: int) -> None:
        """The caller writes every layer of both states of handed-out ``slot`` before anything
        reads it (e.g. a load from a host tier): the slot's pending zeroing or copy is dropped
        (no kernel; a slot another pending copy reads from keeps its state until the flush,
        which reads every source before it writes). No-op on the CPU."""
        self._pending.pop(slot, None)

    def flush(self) -> None:
        """Issue the pending zeroing and copies (a device only; see the module docstring): a
        single one as two slice kernels; else one upload of the slot ids, then per tensor one
        gather and one scatter for the copies (every source read before any slot is written)
        and one ``index_fill_`` for the zeroing. No host synchronisation."""
        pending = self._pending
        if not pending:
            return
        items = list(pending.items())
        pending.clear()
        tensors = (self._conv, self._ssm)
        if len(items) == 1:
            dst, src = items[0]
            for t in tensors:
                if src == _ZERO:
                    t[:, dst].zero_()
                else:
                    t[:, dst].copy_(t[:, src])
            return
        copies = [(d, s) for d, s in items if s != _ZERO]
        zeros = [d for d, s in items if s == _ZERO]
        k = len(copies)
        ids = np.array([s for _, s in copies] + [d for d, _ in copies] + zeros, dtype=np.int64)
        dev = upload(ids, self.device)
        for t in tensors:
            if k:
                t.index_copy_(1, dev[k:2 * k], t.index_select(1, dev[:k]))
            if zeros:
                t.index_fill_(1, dev[2 * k:], 0)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_slot(self) -> int:
        """Bytes of conv plus SSM state of one slot over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = math.prod(self.conv_state_shape) + math.prod(self.ssm_state_shape)
        return self.num_layers * per_layer * elem

    @property
    def total_bytes(self) -> int:
        """Bytes held by the conv and SSM tensors, padding slot included."""
        return self.bytes_per_slot * (self.size + 1)

    # ------------------------------------------------------------------ state access
    def copy(self, src: int | torch.Tensor, dst: int | torch.Tensor) -> None:
        """Copy every layer's conv and SSM state from ``src[i]`` to ``dst[i]``.

        Args:
            src, dst: an ``int`` slot or a 1-D (or 0-d) ``torch.int64`` tensor of slots, on any
                device, equal lengths, all currently handed out. ``src[i] == dst[i]`` is a
                no-op.

        Raises:
            TypeError: a wrong type or dtype.
            ValueError: lengths differ, a slot is foreign or free, or ``dst`` repeats a slot.
            Nothing is written when it raises.

        Validation reads host values only (ints, CPU tensors, host mirrors); on a device the
        copy is enqueued on the current stream without a host synchronisation.
        """
        if type(src) is int and type(dst) is int:  # the copy-on-write of one request: O(1)
            if not (self._pages.holds(src) and self._pages.holds(dst)):
                self._allocated(src, "src")  # raises, naming the bad one
                self._allocated(dst, "dst")
            self._copy_one(src, dst)
            return
        src_idx = self._allocated(src, "src")
        dst_idx = self._allocated(dst, "dst")
        n = src_idx.numel()
        if n != dst_idx.numel():
            raise ValueError(f"src has {n} slots but dst has {dst_idx.numel()}")
        if n == 1:  # one slot each (the copy-on-write of a request): views, no index tensors
            self._copy_one(int(src_idx[0]), int(dst_idx[0]))
            return
        if torch.unique(dst_idx).numel() != dst_idx.numel():
            raise ValueError("dst repeats a slot; the copy result would be unspecified")
        if self.ids is not None:  # a device: pending, every source as it is before the call
            pending = self._pending
            pairs = [(d, pending.get(s, s)) for s, d in zip(src_idx.tolist(), dst_idx.tolist(),
                                                             strict=True) if s != d]
            for d, s in pairs:
                self._put(d, s)
            return
        self._conv.index_copy_(1, dst_idx, self._conv.index_select(1, src_idx))
        self._ssm.index_copy_(1, dst_idx, self._ssm.index_select(1, src_idx))

    def alloc_slot(self) -> int | None:
        """One slot as a Python ``int``: ``int(alloc(1)[0])`` without building a tensor.

        Same free-list order as :meth:`alloc` (the front of the list) and the same zeroing of
        the slot's conv and SSM state in every layer; ``None`` (nothing changed) when no slot
        is free. On a device the zeroing is enqueued without a host synchronisation. O(1).
        """
        slot = self._pages.take_one()
        if slot is None:
            return None
        if self.zero_on_alloc:
            views = self._views
            if views is not None:
                views[0][:, slot] = 0
                views[1][:, slot] = 0
            elif self.ids is not None:
                self._pending[slot] = _ZERO
            else:
                self._conv[:, slot].zero_()
                self._ssm[:, slot].zero_()
        return slot

    def free_slot(self, slot: int | torch.Tensor) -> None:
        """Free one slot given as an ``int``: ``free(torch.tensor([slot]))`` by scalar checks.

        Appended to the back of the free list, as :meth:`free` does.

        ``slot`` may also be a one-element integer tensor (a device one is read through its
        host mirror: no host synchronisation for the ids the pool handed out).

        Raises:
            TypeError: ``slot`` is not an int or an integer tensor (``bool`` refused).
            ValueError: a tensor of several elements; ``foreign index`` (not in ``1..size``)
                or ``double free`` (already free); nothing changes then.
        """
        if type(slot) is not int:
            slot = _slot_arg(slot, "slot")
        self._pages.release_one(slot)

    def get_state(self, slot: int | torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies ``(conv, ssm)`` of one slot's state in one layer.

        Returns:
            ``conv`` of shape ``conv_state_shape`` and ``ssm`` of shape ``ssm_state_shape``,
            ``self.dtype`` on ``device``. (For in-place access use ``pool.conv[layer][slot]``.)

        Raises:
            TypeError / ValueError: a bad ``slot`` (foreign or free) or ``layer``.
        """
        s = self._single_slot(slot)
        layer = self._layer(layer)
        return self.conv[layer, s].clone(), self.ssm[layer, s].clone()

    def set_state(self, slot: int | torch.Tensor, layer: int, conv: torch.Tensor,
                  ssm: torch.Tensor) -> None:
        """Overwrite one slot's state in one layer with ``conv`` and ``ssm``.

        Args:
            conv: shape ``conv_state_shape``, dtype ``self.dtype``, any device.
            ssm: shape ``ssm_state_shape``, dtype ``self.dtype``, any device.

        Raises:
            TypeError: a non-tensor or wrong dtype.
            ValueError: a bad slot or layer, or a wrong shape. Nothing is written.
        """
        s = self._single_slot(slot)
        layer = self._layer(layer)
        check_tensor(conv, "conv", self.dtype, self.conv_state_shape)
        check_tensor(ssm, "ssm", self.dtype, self.ssm_state_shape)
        self.conv[layer, s] = conv.to(self.device)
        self.ssm[layer, s] = ssm.to(self.device)

    def __repr__(self) -> str:
        return (
            f"MambaStatePool(size={self.size}, available={self.available_size()},"
            f" num_layers={self.num_layers}, conv={self.conv_state_shape},"
            f" ssm={self.ssm_state_shape}, dtype={self.dtype}, device={self.device})"
        )

    # ------------------------------------------------------------------ helpers
    def _copy_one(self, src: int, dst: int) -> None:
        """Every layer's state of slot ``src`` into slot ``dst`` (both validated)."""
        views = self._views
        if views is not None:
            conv, ssm = views
            conv[:, dst] = conv[:, src]
            ssm[:, dst] = ssm[:, src]
        elif self.ids is not None:
            if src != dst:
                self._put(dst, self._pending.get(src, src))
        else:
            self._conv[:, dst].copy_(self._conv[:, src])
            self._ssm[:, dst].copy_(self._ssm[:, src])

    def _put(self, dst: int, src: int) -> None:
        """Pending: slot ``dst`` gets ``src``'s state as it was when the pending work began
        (``_ZERO``: zeros); a slot given its own state again has nothing pending."""
        if src == dst:
            self._pending.pop(dst, None)
        else:
            self._pending[dst] = src

    def _on_alloc(self, slots: torch.Tensor) -> None:
        if not self.zero_on_alloc:
            return
        if self.ids is not None:
            for s in host_ids(slots, "slots").tolist():
                self._pending[s] = _ZERO
            return
        self._conv.index_fill_(1, slots, 0)
        self._ssm.index_fill_(1, slots, 0)

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        """Slot ids ``host`` as a view of :attr:`ids` when consecutive (an ``alloc(1)``: no
        CUDA call), else uploaded."""
        ids = self.ids
        n = host.shape[0]
        if ids is not None and n and int(host[-1]) - int(host[0]) == n - 1 and (
                n == 1 or bool((np.diff(host) == 1).all())):
            return ids[int(host[0]):int(host[0]) + n]
        return super()._to_device(host)

    def _allocated(self, slots: int | torch.Tensor, name: str) -> torch.Tensor:
        """Validate ``slots`` as handed-out slot ids; return them as a CPU int64 1-D tensor."""
        idx = as_slot_tensor(slots, name)
        ok = self._pages.in_use(idx)
        if not ok.all():
            bad = int(idx[torch.from_numpy(~ok)][0])
            if 1 <= bad <= self.size:
                raise ValueError(f"{name}: state slot {bad} is not allocated (it is free)")
            raise ValueError(f"{name}: foreign index: state slot {bad} is not in 1..{self.size}")
        return idx

    def _single_slot(self, slot: int | torch.Tensor) -> int:
        return int(self._allocated(_slot_arg(slot, "slot"), "slot")[0])

    def _layer(self, layer: int) -> int:
        layer = check_int(layer, "layer", minimum=0)
        if layer >= self.num_layers:
            raise ValueError(f"layer={layer} is out of range for num_layers={self.num_layers}")
        return layer
