"""One adapter's weights in host memory.

An adapter adds ``scaling * B @ (A @ x)`` to the output of each module it targets::

    A: [r, in_features]      B: [out_features, r]      (one pair per module path)

which is PEFT's LoRA forward (``lora_B(lora_A(x)) * scaling``). An *embedding* module
(``embed_tokens``: PEFT's ``lora_embedding_A`` / ``lora_embedding_B``) has the same pair with
``in_features`` the vocabulary size and ``out_features`` the hidden size; its input is a token
id, and ``A @ x`` of the one-hot ``x`` is the lookup ``A[:, id]``. ``lm_head`` is a linear
module like any other (``in`` = hidden, ``out`` = vocabulary). Adapters are read from and
written to PEFT directories by :func:`~allocators.lora.read_peft_adapter` /
:func:`~allocators.lora.write_peft_adapter`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["LoraAdapter"]


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's weights in host memory (validated on construction).

    Attributes:
        weights: module path -> ``(A, B)``, ``A: [r, in]``, ``B: [out, r]``, 2-D
            floating-point CPU tensors of one dtype; at least one module. ``r`` may differ
            between modules (PEFT's ``rank_pattern``). Stored as a read-only mapping (the
            tensors are not copied; the pool keeps its own copies).
        scaling: multiplier of ``B @ A`` for every module (PEFT's ``lora_alpha / r``),
            finite float.
        embedding_modules: the modules of ``weights`` whose input is a token id (PEFT's
            embedding LoRA: ``A`` is ``[r, vocab_size]``, ``B`` is ``[hidden, r]``); they are
            written back as ``lora_embedding_A`` / ``lora_embedding_B``. Empty by default.
        rank: the largest ``r`` of any module (derived): what ``max_lora_rank`` must admit.

    Raises:
        TypeError: a non-mapping ``weights``, a non-str module name, a non-tensor or
            non-float weight, a non-number ``scaling``, ``embedding_modules`` not a set of str.
        ValueError: no modules, an embedding module ``weights`` lacks, a non-2-D weight, ranks that do not match between ``A`` and
            ``B``, mixed dtypes, a non-CPU tensor, a non-finite ``scaling`` or weight (NaN,
            inf).
    """

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float = 1.0
    embedding_modules: frozenset[str] = frozenset()
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
        if len(dtypes) != 1:
            raise ValueError(f"every weight must have one dtype, got {sorted(map(str, dtypes))}")
        if not isinstance(self.embedding_modules, set | frozenset) or not all(
            isinstance(m, str) for m in self.embedding_modules
        ):
            raise TypeError("embedding_modules must be a set of module names (str)")
        missing = sorted(set(self.embedding_modules).difference(frozen))
        if missing:
            raise ValueError(f"embedding_modules {missing} have no weights")
        object.__setattr__(self, "embedding_modules", frozenset(self.embedding_modules))
        object.__setattr__(self, "weights", MappingProxyType(frozen))
        object.__setattr__(self, "scaling", float(self.scaling))
        object.__setattr__(self, "rank", max(ranks))

    def digest(self) -> str:
        """SHA-256 (hex) of the adapter's content: ``scaling`` and, per module in name
        order, its name, whether it is an embedding, dtype, shapes and the bytes of ``A`` and
        ``B``. Two adapters with
        equal digests compute the same deltas; any change of a weight changes it. O(bytes)."""
        h = hashlib.sha256(b"hpc-lora/1\0" + float(self.scaling).hex().encode() + b";")
        for module in sorted(self.weights):
            a, b = self.weights[module]
            name = module.encode("utf-8", "surrogatepass")
            kind = b"E" if module in self.embedding_modules else b""
            h.update(b"%d:" % len(name) + name + kind + str(a.dtype).encode()
                     + b"%r%r" % (tuple(a.shape), tuple(b.shape)))
            for w in (a, b):
                h.update(w.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    @property
    def modules(self) -> frozenset[str]:
        """The target modules this adapter has weights for."""
        return frozenset(self.weights)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every weight."""
        return next(iter(self.weights.values()))[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of every A and B tensor (the host memory the weights take)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def rank_of(self, module: str) -> int:
        """``r`` of ``module`` (``A.shape[0]``). Raises ``KeyError`` if it has no weights."""
        return int(self.weights[module][0].shape[0])

    def delta(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """Reference output ``scaling * x @ A.T @ B.T`` for ``x: [T, in]`` -> ``[T, out]``,
        computed in the adapter's dtype, without any slot or padding (for tests). ``x`` may
        be ``[T]`` integer token ids (each row one-hot: ``A[:, id]``), as an embedding takes.

        Raises:
            KeyError: the adapter has no weights for ``module`` (its contribution is zero).
        """
        a, b = self.weights[module]
        after_a = a.T[x] if not x.dtype.is_floating_point else x.to(a.dtype) @ a.T
        return self.scaling * (after_a @ b.T)


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
        # float8 has no CPU isfinite kernel: check it widened to float32 (exact).
        finite = torch.isfinite(w if w.element_size() > 1 else w.to(torch.float32))
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise ValueError(f"weights[{module!r}].{name} must be finite, got {bad} NaN / inf "
                             "values (a corrupt or diverged adapter)")
    if a.shape[0] < 1 or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"weights[{module!r}]: A is [rank, in] and B is [out, rank] with rank >= 1, "
            f"got A {tuple(a.shape)} and B {tuple(b.shape)}"
        )
    return a.detach().contiguous(), b.detach().contiguous()
