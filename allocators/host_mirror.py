"""Host mirrors: the host copy of every device index tensor the library makes.

On a GPU an engine's slot indices live on the device, and reading one of them on the host (to
validate it, mark it held, put it back on a free list) stalls the host until the stream drains.
The library never needs to: every slot tensor it hands out (``alloc`` results, a node's KV slots,
a match's ``device_indices``) it built from ids it already held on the host, so it keeps that
host copy beside the device tensor and reads the copy instead::

    alloc(n)     host ids (free list) --upload, non_blocking--> device tensor   + mirror
    node value   device copy of the caller's slots                              + mirror
    match        torch.cat of node values (device)                              + mirror (numpy)
    free(t)      mirror(t) -> host free list; the device is never read

A mirror belongs to one tensor *object* that is not a view (its base) and covers every 1-D
int64 view of it (a slice keeps the base, its offset and stride say where in the mirror it
starts). It is valid while the tensor's version counter (bumped by every in-place write, also
through views) is the one recorded: a tensor written in place after it was mirrored has no
mirror. It lives as long as the tensor (a weak reference drops it). Host (CPU) tensors are
their own mirror.

A device tensor without a mirror (one the engine built itself, e.g. a row of its own
request-to-token table) is read with one device -> host copy: :func:`host_ids` documents that as
the one place such a sync happens, and counts it in :data:`MISSES`. An engine that builds
request rows with :func:`cat_slots` (and slices) keeps the mirrors.

Threading: engine calls are single-threaded; the weak-reference callbacks only remove entries.
"""

from __future__ import annotations

import weakref
from collections import Counter
from functools import partial

import numpy as np
import torch

from .staging import upload

__all__ = ["MISSES", "cat_mirrored", "cat_slots", "host_ids", "host_int", "mirror_of", "mirrored",
           "register", "slot_copy"]


class _Mirror:
    __slots__ = ("host", "offset", "ref", "version")

    def __init__(self, ref: weakref.ref[torch.Tensor], version: int, host: np.ndarray,
                 offset: int) -> None:
        self.ref = ref
        self.version = version
        self.host = host
        self.offset = offset


_MIRRORS: dict[int, _Mirror] = {}

#: Device index tensors read on the host because they had no mirror, by where they were read
#: (the ``name`` given to :func:`host_ids`): each one cost a device -> host copy.
MISSES: Counter[str] = Counter()


def _drop(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    m = _MIRRORS.get(key)
    if m is not None and m.ref is ref:
        del _MIRRORS[key]


def register(dev: torch.Tensor, host: np.ndarray) -> torch.Tensor:
    """Record that device tensor ``dev`` holds the values ``host``; returns ``dev``.

    Args:
        dev: a 1-D int64 tensor that is not a view (``dev._base is None``), on any device
            (CPU tensors need no mirror: nothing is recorded for them).
        host: int64 numpy array, ``len(host) == len(dev)``, owned by the mirror from now on
            (the caller must not write it).

    Raises:
        ValueError: ``dev`` is a view, or the lengths differ.
    """
    if dev.is_cpu:
        return dev
    if dev._base is not None:
        raise ValueError("register: mirror the base tensor, not a view of it")
    if host.shape != (dev.numel(),):
        raise ValueError(f"register: host has shape {host.shape}, the tensor {dev.numel()} ids")
    key = id(dev)
    ref = weakref.ref(dev, partial(_drop, key))
    _MIRRORS[key] = _Mirror(ref, dev._version, host, int(dev.storage_offset()))
    return dev


def mirror_of(t: torch.Tensor) -> np.ndarray | None:
    """The host copy of device tensor ``t`` (a numpy view, not to be written), or ``None`` when
    it has none: not an int64 tensor of at most one dimension, not (a view of) a mirrored
    tensor, or written in place since. O(1)."""
    base = t._base
    if base is None:
        base = t
    m = _MIRRORS.get(id(base))
    if m is None or m.ref() is not base or base._version != m.version:
        return None
    if t.dtype != torch.int64 or t.dim() > 1:
        return None
    n = t.numel()
    off = int(t.storage_offset()) - m.offset
    if n <= 1 or t.stride(0) == 1:
        return m.host[off:off + n]
    step = t.stride(0)
    return m.host[off:off + (n - 1) * step + 1:step] if step > 0 else None


def host_ids(t: torch.Tensor, name: str = "indices") -> np.ndarray:
    """The values of index tensor ``t`` on the host, without a host synchronisation whenever
    the library knows them: a CPU tensor's own memory, or the mirror of a device tensor.

    A device tensor without a mirror is copied to the host (a device -> host copy: the host
    waits for the stream; counted in ``MISSES[name]``): the only sync of the bookkeeping, for
    tensors the engine built itself. The result must not be written."""
    if t.is_cpu:
        return t.numpy()
    got = mirror_of(t)
    if got is not None:
        return got
    MISSES[name] += 1
    return t.detach().cpu().numpy()  # the documented sync: a tensor the library never saw


def host_int(t: int | torch.Tensor, name: str) -> int:
    """A slot given as an ``int`` or a one-element integer tensor (a device tensor's mirror is
    read; without one, one device -> host copy as in :func:`host_ids`).

    Raises:
        TypeError: not an int or an integer tensor. ValueError: a tensor of several elements.
    """
    if isinstance(t, torch.Tensor):
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int or a one-element integer tensor, got a "
                            f"{t.dtype} tensor")
        if t.numel() != 1:
            raise ValueError(f"{name} must be one slot, got a tensor of shape {tuple(t.shape)}")
        return int(host_ids(t.reshape(-1).to(torch.int64), name)[0])
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"{name} must be an int or a one-element integer tensor, got {type(t).__name__}")
    return t


def mirrored(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (a 1-D int64 numpy array, owned by the result from now on: the caller must not
    write it) as a tensor on ``device``: on the CPU a zero-copy tensor of it; on a device one
    upload (``allocators.staging.upload``: a ``non_blocking`` copy through pinned staging, no
    host synchronisation) with ``host`` as its mirror. An empty array uploads nothing."""
    if device.type == "cpu":
        return torch.from_numpy(host)
    return register(upload(host, device), host)


def cat_mirrored(parts: list[torch.Tensor] | tuple[torch.Tensor, ...],
                 device: torch.device) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D int64 slot tensors (CPU ones, or device ones with host
    mirrors) as a new tensor on ``device``: joined on the host and uploaded once
    (:func:`mirrored`: one memcpy, no kernel, no host synchronisation), mirrored. A device
    part without a mirror is read once (:func:`host_ids`)."""
    hosts = [host_ids(p, "parts") for p in parts]
    return mirrored(np.concatenate(hosts) if hosts else np.empty(0, dtype=np.int64), device)


def cat_slots(parts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D int64 slot tensors that keeps the host mirror (the mirrors'
    concatenation) when every part has one. What an engine builds request rows with on a GPU."""
    out = torch.cat(parts)
    if out.is_cpu:
        return out
    hosts = []
    for p in parts:
        h = mirror_of(p)
        if h is None:
            return out
        hosts.append(h)
    return register(out, np.concatenate(hosts) if hosts else np.empty(0, dtype=np.int64))


def slot_copy(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A new tensor equal to ``t[lo:hi]`` (not a view: a node keeps it), with the mirror of
    ``t[lo:hi]`` when ``t`` has one."""
    out = t[lo:hi].clone()
    if out.is_cpu:
        return out
    h = mirror_of(t)
    return register(out, h[lo:hi].copy()) if h is not None else out
