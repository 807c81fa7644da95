"""One adapter's weights in host memory, and the file format.

An adapter adds ``scaling * B @ (A @ x)`` to the output of each target module::

    A: [rank, in_features]      B: [out_features, rank]      (one pair per module name)

File format (``torch.save`` of plain values, read back with ``weights_only=True``)::

    {"format": "hpc-lora-v1", "rank": int, "scaling": float,
     "weights": {module_name: {"A": Tensor[rank, in], "B": Tensor[out, rank]}}}
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import torch

__all__ = ["LORA_FILE_FORMAT", "LoraAdapter", "LoraFormatError", "read_adapter", "save_adapter"]

LORA_FILE_FORMAT: Final = "hpc-lora-v1"
"""The ``format`` tag written by :func:`save_adapter` and required by :func:`read_adapter`."""


class LoraFormatError(ValueError):
    """An adapter file exists but is not a valid adapter; the message names the file."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's weights in host memory (validated on construction).

    Attributes:
        weights: module name -> ``(A, B)``, ``A: [rank, in]``, ``B: [out, rank]``, 2-D
            floating-point CPU tensors of one dtype; at least one module. Stored as a
            read-only mapping (the tensors are not copied; the pool keeps its own copies).
        scaling: multiplier of ``B @ A`` (PEFT's ``lora_alpha / r``), finite float.
        rank: ``A.shape[0]`` of every module (derived).

    Raises:
        TypeError: a non-mapping ``weights``, a non-str module name, a non-tensor or
            non-float weight, a non-number ``scaling``.
        ValueError: no modules, a non-2-D weight, ranks that differ or do not match between
            ``A`` and ``B``, mixed dtypes, a non-CPU tensor, a non-finite ``scaling``.
    """

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float = 1.0
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Mapping):
            raise TypeError(f"weights must be a mapping, got {type(self.weights).__name__}")
        if not self.weights:
            raise ValueError("weights must name at least one module")
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, int | float):
            raise TypeError(f"scaling must be a float, got {type(self.scaling).__name__}")
        if not math.isfinite(self.scaling):
            raise ValueError(f"scaling must be finite, got {self.scaling}")
        ranks, dtypes, frozen = set(), set(), {}
        for module, pair in self.weights.items():
            if not isinstance(module, str) or not module:
                raise TypeError(f"module names must be non-empty str, got {module!r}")
            a, b = _check_pair(module, pair)
            ranks.add(a.shape[0])
            dtypes.add(a.dtype)
            dtypes.add(b.dtype)
            frozen[module] = (a, b)
        if len(ranks) != 1:
            raise ValueError(f"every module must have the same rank, got {sorted(ranks)}")
        if len(dtypes) != 1:
            raise ValueError(f"every weight must have one dtype, got {sorted(map(str, dtypes))}")
        object.__setattr__(self, "weights", MappingProxyType(frozen))
        object.__setattr__(self, "scaling", float(self.scaling))
        object.__setattr__(self, "rank", ranks.pop())

    @property
    def modules(self) -> frozenset[str]:
        """The target modules this adapter has weights for."""
        return frozenset(self.weights)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every weight."""
        return next(iter(self.weights.values()))[0].dtype

    def delta(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """Reference output ``scaling * x @ A.T @ B.T`` for ``x: [T, in]`` -> ``[T, out]``,
        computed in the adapter's dtype, without any slot or padding (for tests).

        Raises:
            KeyError: the adapter has no weights for ``module`` (its contribution is zero).
        """
        a, b = self.weights[module]
        return self.scaling * (x.to(a.dtype) @ a.T @ b.T)


def _check_pair(module: str, pair: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise TypeError(f"weights[{module!r}] must be a pair (A, B)")
    a, b = pair
    for name, w in (("A", a), ("B", b)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"weights[{module!r}].{name} must be a tensor, got {type(w).__name__}")
        if not w.dtype.is_floating_point:
            raise TypeError(f"weights[{module!r}].{name} must be floating point, got {w.dtype}")
        if w.dim() != 2:
            raise ValueError(f"weights[{module!r}].{name} must be 2-D, got {tuple(w.shape)}")
        if w.device.type != "cpu":
            raise ValueError(f"weights[{module!r}].{name} must be on the CPU, got {w.device}")
    if a.shape[0] < 1 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"weights[{module!r}]: A is [rank, in] and B is [out, rank] with rank >= 1, "
            f"got A {tuple(a.shape)} and B {tuple(b.shape)}"
        )
    return a.detach().contiguous(), b.detach().contiguous()


def save_adapter(path: str | os.PathLike[str], adapter: LoraAdapter) -> Path:
    """Write ``adapter`` to ``path`` in the format above; returns the path.

    Raises:
        TypeError: ``adapter`` is not a :class:`LoraAdapter`.
        OSError: the file cannot be written.
    """
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(f"adapter must be a LoraAdapter, got {type(adapter).__name__}")
    path = Path(path)
    payload = {
        "format": LORA_FILE_FORMAT,
        "rank": adapter.rank,
        "scaling": adapter.scaling,
        "weights": {m: {"A": a, "B": b} for m, (a, b) in adapter.weights.items()},
    }
    torch.save(payload, path)
    return path


def read_adapter(path: str | os.PathLike[str]) -> LoraAdapter:
    """Read an adapter written by :func:`save_adapter`.

    Raises:
        TypeError: ``path`` is not a str or path.
        FileNotFoundError: no file at ``path`` (the message names it).
        LoraFormatError: the file is not a valid adapter (wrong format tag, fields, shapes).
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"lora_path must be a str or path, got {type(path).__name__}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"LoRA adapter file not found: {str(p)!r}")
    try:
        payload = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a corrupt file
        raise LoraFormatError(f"{str(p)!r} is not a readable adapter file ({exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != LORA_FILE_FORMAT:
        raise LoraFormatError(f"{str(p)!r}: not a {LORA_FILE_FORMAT!r} adapter file")
    weights = payload.get("weights")
    if not isinstance(weights, dict) or not all(
        isinstance(v, dict) and set(v) == {"A", "B"} for v in weights.values()
    ):
        raise LoraFormatError(f"{str(p)!r}: 'weights' must map module -> {{'A', 'B'}}")
    try:
        adapter = LoraAdapter(
            {m: (v["A"], v["B"]) for m, v in weights.items()}, payload.get("scaling", 1.0)
        )
    except (TypeError, ValueError) as exc:
        raise LoraFormatError(f"{str(p)!r}: {exc}") from None
    if payload.get("rank") != adapter.rank:
        raise LoraFormatError(
            f"{str(p)!r}: recorded rank {payload.get('rank')!r} != weight rank {adapter.rank}"
        )
    return adapter
