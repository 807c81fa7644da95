"""Pinned staging memory for asynchronous host <-> device copies, reused, never allocated per copy.

A ``non_blocking`` copy between the host and a GPU is asynchronous only from pinned host
memory, and the host memory must stay untouched until the copy has run: it may be reused only
once an event recorded after the copy has completed. :class:`PinnedRing` is one pinned buffer
handed out in ring order, each region tied to the event of the copies that use it::

    buffer   [ done | done | in flight (event e3) | in flight (e4) | free ...         ]
                                                                ^ cursor: next region
    take(n)  the next n bytes (from 0 again when they do not fit before the end); every region
             they overlap must be finished: its event complete (else the host waits for it:
             one synchronisation, counted in ``waits``) and not held by its owner (else
             ``on_full`` is asked to finish its owner's oldest copy first)

Regions are reused in the order they were taken (FIFO), so a copy that finished long ago is
never waited for. The buffer grows (doubling; a new buffer, the old one kept alive by the
regions still in flight in it) when one region is larger than it, and when the region to reuse
is still in flight and the ring is below ``max_bytes`` (what is in flight outgrew it); only a
ring at ``max_bytes`` waits.

:func:`upload` is the one host -> device copy of index tensors the allocators make (a fresh
``alloc`` result, ids for a device-side map): the ids go into the device's shared ring and are
copied on the current stream without a host synchronisation.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["PinnedRing", "Region", "pin_in_place", "reset_uploads", "upload", "uploads"]

_ALIGN = 256  # bytes: every region starts aligned for any dtype


class Region:
    """A part of a :class:`PinnedRing`: ``data`` is the pinned uint8 view of its bytes.

    ``event``: the copies using it are finished when this event is (``None`` until the owner
    records one); ``held``: the owner still needs the bytes after the event (a device -> host
    copy not yet read on the host); it calls :meth:`PinnedRing.release` when done."""

    __slots__ = ("buffer", "data", "end", "event", "held", "start")

    def __init__(self, buffer: torch.Tensor, start: int, end: int, held: bool) -> None:
        self.buffer = buffer
        self.start = start
        self.end = end
        self.data = buffer[start:end]
        self.event: Any = None
        self.held = held

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The first bytes of the region as a contiguous tensor of ``dtype`` and ``shape``."""
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return self.data[:n].view(dtype).view(shape)


class PinnedRing:
    """One pinned host buffer handed out in ring order (see the module docstring).

    Args:
        nbytes: initial size [bytes]; the buffer doubles when one region does not fit, or
            when the region to reuse is still in flight (up to ``max_bytes``).
        max_bytes: the size [bytes] past which the ring waits for a copy in flight instead of
            growing (64 MiB).
        on_full: called when a region to reuse is still held: must finish (and release) the
            owner's oldest held region and return True, or return False (then ``take`` raises
            ``RuntimeError``).

    Not thread-safe: one engine thread uses a ring.
    """

    def __init__(self, nbytes: int = 1 << 20,
                 on_full: Callable[[], bool] | None = None, max_bytes: int = 64 << 20) -> None:
        self._cap = max(_ALIGN, nbytes)
        self.max_bytes = max_bytes
        self._buf = torch.empty(self._cap, dtype=torch.uint8, pin_memory=True)
        self._cursor = 0
        self._busy: deque[Region] = deque()
        self.on_full = on_full
        #: regions the host had to wait for (each a synchronisation: the ring was too small)
        self.waits = 0

    @property
    def capacity(self) -> int:
        """Bytes of the current buffer."""
        return self._cap

    def take(self, nbytes: int, held: bool = False) -> Region:
        """``nbytes`` of pinned memory no copy is using (see the module docstring)."""
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        if size > self._cap:
            self._cap = max(2 * self._cap, 1 << (size - 1).bit_length())
            self._buf = torch.empty(self._cap, dtype=torch.uint8, pin_memory=True)
            self._cursor = 0
        self._retire()
        start = self._cursor if self._cursor + size <= self._cap else 0
        end = start + size
        while True:
            clash = self._clash(start, end)
            if clash is None:
                break
            if clash.held:
                if self.on_full is None or not self.on_full():
                    raise RuntimeError("staging ring: a region to reuse is held and its owner "
                                       "cannot release it")
                continue
            ev = clash.event
            if ev is None:
                raise RuntimeError("staging ring: a region taken earlier has no event recorded")
            if not ev.query():
                if self._cap < self.max_bytes:  # what is in flight outgrew the ring: grow it
                    self._cap *= 2
                    self._buf = torch.empty(self._cap, dtype=torch.uint8, pin_memory=True)
                    self._cursor = 0
                    start, end = 0, size
                    continue
                ev.synchronize()  # the ring is at its largest and all in flight: wait
                self.waits += 1
            self._busy.remove(clash)
        self._cursor = end
        region = Region(self._buf, start, end, held)
        self._busy.append(region)
        return region

    def release(self, region: Region) -> None:
        """The owner no longer needs ``region``'s bytes (reusable once its event completes)."""
        region.held = False

    def _clash(self, start: int, end: int) -> Region | None:
        buf = self._buf
        for r in self._busy:
            if r.buffer is buf and r.start < end and start < r.end:
                return r
        return None

    def _retire(self) -> None:
        """Forget finished regions at the front (they are reusable anyway; this keeps the
        overlap search short)."""
        busy = self._busy
        while busy:
            r = busy[0]
            if r.held or r.event is None or not r.event.query():
                return
            busy.popleft()


_UPLOADS: dict[torch.device, PinnedRing] = {}


def uploads(device: torch.device) -> PinnedRing:
    """The shared ring of index uploads to ``device`` (one per device, created on first use)."""
    ring = _UPLOADS.get(device)
    if ring is None:
        ring = _UPLOADS[device] = PinnedRing()
    return ring


def reset_uploads() -> None:
    """Drop the shared upload rings (a new ring is pinned on next use; for a test harness that
    swaps the device under the library)."""
    _UPLOADS.clear()


def upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A new int64 tensor on ``device`` equal to ``host`` (1-D int64 numpy), copied through the
    device's shared pinned ring on the current stream: no host synchronisation (the ring's
    region is reused only after the copy's event). On the CPU: a copy."""
    n = host.shape[0]
    if device.type == "cpu":
        return torch.from_numpy(host.copy())
    out = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return out
    region = uploads(device).take(8 * n)
    src = region.view(torch.int64, (n,))
    src.copy_(torch.from_numpy(host))
    out.copy_(src, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    region.event = ev
    return out


def pin_in_place(t: torch.Tensor) -> torch.Tensor:
    """Page-lock the memory of CPU tensor ``t`` where it is (``cudaHostRegister``), so copies
    between it and a GPU can be asynchronous. Unlike ``t.pin_memory()`` this copies nothing
    (no second buffer while both exist) and does not round the size up to a power of two (as
    PyTorch's pinned-memory allocator does). The registration is undone when ``t`` is
    collected. Returns ``t``.

    Raises:
        ValueError: ``t`` is not a contiguous CPU tensor. RuntimeError: the driver refused.
    """
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("pin_in_place needs a contiguous CPU tensor")
    size = t.numel() * t.element_size()
    if size == 0:
        return t
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    rc = int(cudart.cudaHostRegister(ptr, size, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed (error {rc})")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


class _DeviceArray:
    """A ``__cuda_array_interface__`` over ``nbytes`` bytes at ``ptr`` (device-addressable)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def mapped_on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Pinned host tensor ``t`` (contiguous, page-locked: ``pin_in_place`` or
    ``pin_memory=True``) as a tensor on CUDA ``device`` over the same memory, so GPU kernels read
    and write it directly (over the link). Page-locked memory is mapped into the device's
    address space at the same address on a system with unified addressing (64-bit Linux).
    ``t`` must outlive the result (the result does not own the memory).

    Raises:
        ValueError: ``t`` is not a contiguous CPU tensor.
    """
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("mapped_on_device needs a contiguous pinned CPU tensor")
    nbytes = t.numel() * t.element_size()
    raw = torch.as_tensor(_DeviceArray(t.data_ptr(), nbytes), device=device)
    return raw.view(t.dtype).view(t.shape)
