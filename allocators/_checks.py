"""Argument validation shared by the allocators and pools.

Every helper raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value
of the right kind but out of range, and names the offending argument in the message.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import SupportsIndex, cast

import torch

from .host_mirror import host_ids


def check_int(value: object, name: str, *, minimum: int) -> int:
    """Return ``value`` as a Python ``int`` that is ``>= minimum``.

    Accepts ``int`` and integer-like objects (``numpy.int64``, 0-d integer tensors via
    ``__index__``) but not ``bool``.

    Raises:
        TypeError: ``value`` is a ``bool`` or has no ``__index__``.
        ValueError: ``value < minimum``.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        result = operator.index(cast("SupportsIndex", value))
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` as an ``int > 0`` (see :func:`check_int`)."""
    return check_int(value, name, minimum=1)


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """Return ``dtype`` if it is a floating-point ``torch.dtype``.

    Raises:
        TypeError: not a ``torch.dtype`` (e.g. the string ``"float16"`` or a numpy dtype).
        ValueError: a ``torch.dtype`` that is not floating point (e.g. ``torch.int32``).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point torch.dtype, got {dtype}")
    return dtype


def check_device(device: object, name: str = "device") -> torch.device:
    """Return ``device`` as a ``torch.device`` with its index resolved (``"cuda"`` becomes
    ``cuda:<current device>``, as the tensors created there report it), so that devices compare
    by what they mean.

    Raises:
        TypeError: not a ``str`` or ``torch.device``.
        ValueError: an unparsable device string, or a CUDA device when CUDA is unavailable.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    try:
        result = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{name}: invalid device {device!r} ({exc})") from None
    if result.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {device!r} requested but CUDA is not available")
    return resolve_device(result)


def resolve_device(device: torch.device) -> torch.device:
    """``device`` with its index filled in: a CUDA device without one is the current device
    (``torch.device("cuda") != torch.device("cuda", 0)``, though they mean the same)."""
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_shape(shape: object, name: str) -> tuple[int, ...]:
    """Return ``shape`` as a tuple of positive ints (at least one dimension).

    Raises:
        TypeError: not a sequence of ints.
        ValueError: empty, or a dimension ``<= 0``.
    """
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise TypeError(f"{name} must be a tuple of ints, got {type(shape).__name__}")
    if len(shape) == 0:
        raise ValueError(f"{name} must have at least one dimension")
    return tuple(check_positive_int(d, f"{name}[{i}]") for i, d in enumerate(shape))


def check_tensor(t: object, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Raise unless ``t`` is a ``torch.Tensor`` of ``dtype`` (a pool's) and ``shape``, on any
    device (what a pool's ``set_*`` takes).

    Raises:
        TypeError: not a tensor, or another dtype.
        ValueError: another shape.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, pool dtype is {dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def as_index_tensor(indices: object, name: str = "indices") -> torch.Tensor:
    """Validate a 1-D ``torch.int64`` index tensor and return its values as a CPU tensor.

    A device tensor is read through its host mirror (``allocators.host_mirror``: no host
    synchronisation for the tensors the library made); one without a mirror is copied to the
    host. The result may share memory with ``indices`` or its mirror: callers must not write
    it, and must clone it to keep it. No value checks are made here (range, duplicates): those
    belong to the owner of the index space.

    Raises:
        TypeError: not a ``torch.Tensor``, or dtype other than ``torch.int64``.
        ValueError: not 1-D.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise TypeError(f"{name} must have dtype torch.int64, got {indices.dtype}")
    if indices.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.is_cpu:
        return indices
    return torch.from_numpy(host_ids(indices, name))


def as_slot_tensor(slots: object, name: str) -> torch.Tensor:
    """Like :func:`as_index_tensor`, but also accept a single ``int`` or a 0-d tensor (->
    shape ``[1]``)."""
    if isinstance(slots, torch.Tensor):
        return as_index_tensor(slots.reshape(1) if slots.dim() == 0 else slots, name)
    return torch.tensor([check_int(slots, name, minimum=-(2**62))], dtype=torch.int64)


def check_range(slots: torch.Tensor, name: str, *, low: int, high: int) -> None:
    """Raise ``ValueError`` unless every value of CPU tensor ``slots`` is in ``[low, high)``."""
    if slots.numel() == 0:
        return
    bad = (slots < low) | (slots >= high)
    if bool(bad.any()):
        first = int(slots[bad][0])
        raise ValueError(f"{name}: index {first} is outside [{low}, {high})")
