"""Sizes checked against memory before allocation: ``bytes -> refused | None``.

A pool sized past what the machine has would otherwise fail deep inside numpy or torch (a raw
``_ArrayMemoryError`` or ``OutOfMemoryError`` after seconds of zero-filling), or, with
overcommit, later still. Every pool constructor (:class:`~allocators.kv_pool.KVPool`,
:class:`~allocators.state_pool.MambaStatePool`, the free lists of every allocator,
:class:`~allocators.swa.SWAAllocator`'s slot maps, the LoRA slots) calls :func:`check_memory`
with the bytes it is about to allocate, before allocating anything, and so refuses a size
that cannot fit with a :class:`MemoryBudgetError` naming the arguments that set it.

What counts as available:

* host (``cpu``): ``MemAvailable`` of ``/proc/meminfo``, bounded by the cgroup v2 limit
  (``/sys/fs/cgroup/memory.max`` less ``memory.current``) when one is set;
* a CUDA device: the driver's free memory (``torch.cuda.mem_get_info``) plus what torch's
  caching allocator holds reserved but unused (it hands that out first);
* anything unknown (no ``/proc``, another device type): nothing is refused.

Allocations below :data:`UNCHECKED_BYTES` are not checked: reading the figures costs ~50 us,
more than building a small pool, and no machine this runs on lacks that much.

The check is a ceiling, not a reservation: two pools that each fit may still not fit together.
"""

from __future__ import annotations

import torch

__all__ = ["HOST", "MemoryBudgetError", "available_host_memory", "available_memory",
           "check_memory"]

#: The host, as :func:`check_memory` takes it (host-side arrays: free lists, slot maps).
HOST = torch.device("cpu")

#: Allocations of fewer bytes than this are never refused (64 MiB).
UNCHECKED_BYTES = 1 << 26

#: Where the host and cgroup figures are read (module attributes so a test can point them at
#: files of its own).
MEMINFO = "/proc/meminfo"
CGROUP_MAX = "/sys/fs/cgroup/memory.max"
CGROUP_CURRENT = "/sys/fs/cgroup/memory.current"


class MemoryBudgetError(ValueError):
    """A size whose allocation cannot fit in the memory available (raised before anything
    is allocated)."""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def available_host_memory() -> int | None:
    """Host memory a new allocation may take now [bytes]: ``MemAvailable`` of
    ``/proc/meminfo``, bounded by the cgroup v2 ``memory.max`` less ``memory.current`` when a
    limit is set; ``None`` where neither can be read."""
    avail: int | None = None
    for line in (_read(MEMINFO) or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            avail = int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
            break
    limit, current = _read(CGROUP_MAX), _read(CGROUP_CURRENT)
    if limit is not None and current is not None and limit.strip().isdigit() \
            and current.strip().isdigit():
        left = max(0, int(limit) - int(current))
        avail = left if avail is None else min(avail, left)
    return avail


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` may take now: :func:`available_host_memory` for
    the CPU; for CUDA the device's free memory plus torch's reserved-but-unused cache;
    ``None`` (not known) for any other device."""
    if device.type == "cpu":
        return available_host_memory()
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def check_memory(nbytes: int, what: str, device: torch.device) -> None:
    """Refuse an allocation of ``nbytes`` on ``device`` that cannot fit.

    Args:
        nbytes: bytes about to be allocated (all of the constructor's tensors / arrays).
        what: the arguments that set the size, as the caller was given them
            (``"KVPool(size=..., num_layers=...)"``): the error names them.
        device: where the allocation goes.

    Raises:
        MemoryBudgetError: (a ``ValueError``) ``nbytes`` exceeds :func:`available_memory`
            of ``device`` (never below :data:`UNCHECKED_BYTES`). Nothing has been allocated.
    """
    if nbytes < UNCHECKED_BYTES:
        return
    avail = available_memory(device)
    if avail is not None and nbytes > avail:
        raise MemoryBudgetError(
            f"{what} needs {_gib(nbytes)} ({nbytes:,} bytes) on {device}, more than the "
            f"{_gib(avail)} available there; give a smaller size")
