"""PEFT adapter directories in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

Tensors are read with ``safetensors`` only; a pickle file (``adapter_model.bin``) is never
loaded. Each key of the weights file must be one of::

    base_model.model.<module path>.lora_A.weight     [r, in_features]
    base_model.model.<module path>.lora_B.weight     [out_features, r]
    base_model.model.<module path>.lora_embedding_A  [r, vocab_size]     (embedding LoRA)
    base_model.model.<module path>.lora_embedding_B  [hidden_size, r]

(the keys PEFT's ``save_pretrained`` writes for LoRA on linear modules, ``lm_head`` included,
and on an embedding, ``embed_tokens``; a module has one kind of pair). The tensors decide
which modules the adapter has; the config must agree with them: every module is selected by
``target_modules`` (and not by ``exclude_modules``), and its ``r`` is the one
``r`` / ``rank_pattern`` gives. A key of any other kind (DoRA magnitudes, biases, saved whole
modules: PEFT saves the base embedding / output layers beside embedding LoRA unless
``save_pretrained(..., save_embedding_layers=False)``) is refused with the key in the message.

Added tokens: as SGLang does, ``lora_added_tokens_size`` is the number of entries of the
directory's ``added_tokens.json`` whose id is ``>= base_vocab_size`` (every entry when it is
not given); an adapter that adds tokens to the vocabulary is refused, as SGLang refuses it.

Scaling: when every module has the same scaling (no ``rank_pattern`` / ``alpha_pattern``, or
patterns that keep ``alpha / r`` equal), it is the adapter's :attr:`LoraAdapter.scaling` and
the tensors are kept bit for bit. When modules differ, each module's scaling is folded into its
``B`` (computed in float64, rounded once to the file's dtype) and the adapter's scaling is 1, as
vLLM folds every scaling into ``B``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._checks import check_positive_int
from .peft_config import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    LoraFormatError,
    PeftLoraConfig,
    read_peft_config,
)
from .weights import LoraAdapter

__all__ = ["read_peft_adapter", "write_peft_adapter"]

_PREFIX = "base_model.model."
# key suffix -> (0 for A / 1 for B, whether the module is an embedding)
_SUFFIXES = {
    ".lora_A.weight": (0, False),
    ".lora_B.weight": (1, False),
    ".lora_embedding_A": (0, True),
    ".lora_embedding_B": (1, True),
}
ADDED_TOKENS_NAME = "added_tokens.json"
_INSTALL_HINT = "install safetensors (pip install 'hybrid-prefix-cache[lora]')"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(f"reading or writing PEFT adapters needs {_INSTALL_HINT}") from exc
    return safetensors


def _check_directory(path: object) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"lora_path must be a str or path, got {type(path).__name__}")
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(
            f"LoRA adapter directory not found: {str(directory)!r} (lora_path is a local PEFT "
            "directory; nothing is downloaded)"
        )
    if not directory.is_dir():
        raise LoraFormatError(
            f"{str(directory)!r} is not a directory: a LoRA adapter is a PEFT directory with "
            f"{ADAPTER_CONFIG_NAME} and {ADAPTER_WEIGHTS_NAME}"
        )
    return directory


def read_peft_adapter(
    path: str | os.PathLike[str], *, base_vocab_size: int | None = None
) -> LoraAdapter:
    """Read the LoRA adapter in PEFT directory ``path`` (see the module docstring).

    ``base_vocab_size``: the base model's vocabulary size; entries of ``added_tokens.json``
    below it are the base tokenizer's own tokens and add nothing (``None``: every entry adds
    a token).

    Returns:
        A :class:`LoraAdapter` keyed by module path (``model.layers.0.self_attn.q_proj``),
        in the file's dtype; embedding LoRA modules in ``embedding_modules``.

    Raises:
        TypeError: ``path`` is not a str or path; ``base_vocab_size`` not an int.
        FileNotFoundError: nothing at ``path``.
        ImportError: ``safetensors`` is not installed.
        LoraFormatError: not a directory, a missing file, an unsupported or malformed config
            field, a tensor of the wrong kind or shape, or a config that contradicts the
            tensors; an ``added_tokens.json`` that adds tokens (``lora_added_tokens_size >
            0``); the message names the file and the field or tensor.
        ValueError: ``base_vocab_size < 1``.
    """
    directory = _check_directory(path)
    if base_vocab_size is not None:
        check_positive_int(base_vocab_size, "base_vocab_size")
    config = read_peft_config(directory)
    _check_added_tokens(directory, base_vocab_size)
    weights_path = directory / ADAPTER_WEIGHTS_NAME
    tensors = _read_tensors(directory, weights_path)
    where = str(weights_path)
    pairs, embeddings = _pair_tensors(tensors, where)
    config_where = str(directory / ADAPTER_CONFIG_NAME)
    scalings = {}
    for module, (a, b) in pairs.items():
        _check_against_config(config, module, a, b, where, config_where)
        scalings[module] = config.scaling_of(module)
    try:
        return _build(pairs, scalings, embeddings)
    except (TypeError, ValueError) as exc:
        raise LoraFormatError(f"{where!r}: {exc}") from None


def _read_tensors(directory: Path, weights_path: Path) -> dict[str, torch.Tensor]:
    if not weights_path.is_file():
        pickled = directory / "adapter_model.bin"
        extra = (
            f"; {pickled.name} is a pickle file, which is never loaded: convert it to "
            f"{ADAPTER_WEIGHTS_NAME}"
            if pickled.exists()
            else ""
        )
        raise LoraFormatError(
            f"{str(directory)!r} is not a PEFT adapter directory: {ADAPTER_WEIGHTS_NAME} is "
            f"missing{extra}"
        )
    st = _safetensors()
    try:
        tensors: dict[str, torch.Tensor] = st.torch.load_file(str(weights_path), device="cpu")
    except (st.SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoraFormatError(
            f"{str(weights_path)!r}: not a readable safetensors file ({exc})"
        ) from None
    if not tensors:
        raise LoraFormatError(f"{str(weights_path)!r}: holds no tensors")
    return tensors


def _pair_tensors(
    tensors: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], frozenset[str]]:
    """``(module path -> (A, B), embedding modules)`` from the file's keys; any other kind of
    key is refused, and so is a module with both linear and embedding keys."""
    found: dict[str, dict[int, torch.Tensor]] = {}
    kinds: dict[str, set[bool]] = {}
    unservable = []
    for key in sorted(tensors):
        split = _split_key(key)
        if split is None:
            unservable.append(key)
        else:
            module, index, embedding = split
            found.setdefault(module, {})[index] = tensors[key]
            kinds.setdefault(module, set()).add(embedding)
    if unservable:
        raise _unservable(unservable, where)
    pairs = {}
    for module, ab in found.items():
        if len(kinds[module]) != 1:
            raise LoraFormatError(
                f"{where!r}: module {module!r} has both lora_A / lora_B and lora_embedding_A / "
                "lora_embedding_B tensors (one kind of pair per module)"
            )
        names = ("lora_embedding_A", "lora_embedding_B") if True in kinds[module] else (
            "lora_A.weight", "lora_B.weight")
        for index, name in enumerate(names):
            if index not in ab:
                raise LoraFormatError(
                    f"{where!r}: tensor {_PREFIX}{module}.{name} is missing (module "
                    f"{module!r} has only one of its A / B pair)"
                )
        pairs[module] = (ab[0], ab[1])
    return pairs, frozenset(m for m, k in kinds.items() if True in k)


def _split_key(key: str) -> tuple[str, int, bool] | None:
    """``(module path, 0 for A / 1 for B, embedding)``, or ``None`` for a key of another kind."""
    for suffix, (index, embedding) in _SUFFIXES.items():
        if key.startswith(_PREFIX) and key.endswith(suffix) and len(key) > len(_PREFIX + suffix):
            return key[len(_PREFIX) : -len(suffix)], index, embedding
    return None


def _check_added_tokens(directory: Path, base_vocab_size: int | None) -> None:
    """Refuse an adapter whose ``added_tokens.json`` adds tokens (SGLang's rule)."""
    added_path = directory / ADDED_TOKENS_NAME
    if not added_path.is_file():
        return
    where = str(added_path)
    try:
        added = json.loads(added_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraFormatError(f"{where!r}: not a readable JSON file ({exc})") from None
    if not isinstance(added, dict) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in added.values()
    ):
        raise LoraFormatError(f"{where!r}: must map token -> int id")
    new = sorted(t for t, i in added.items() if base_vocab_size is None or i >= base_vocab_size)
    if new:
        raise LoraFormatError(
            f"{where!r}: lora_added_tokens_size={len(new)} (tokens {new[:3]}"
            f"{' ...' if len(new) > 3 else ''} with ids >= base_vocab_size={base_vocab_size}): "
            "adapters that add tokens to the vocabulary are not served (extra vocabulary "
            f"embeddings are not supported); remove {ADDED_TOKENS_NAME} if the tokens are the "
            "base tokenizer's own"
        )


# What a key that is not lora_A / lora_B of a linear module holds, most telling first.
_KINDS = (
    ("lora_magnitude_vector", "a DoRA magnitude vector"),
    (
        ".base_layer.",
        "a weight of the base model saved with the adapter (for embed_tokens / lm_head LoRA, "
        "save it with save_pretrained(..., save_embedding_layers=False))",
    ),
    (".bias", "a bias"),
)


def _unservable(keys: list[str], where: str) -> LoraFormatError:
    ranked = [(i, k, kind) for k in keys for i, (marker, kind) in enumerate(_KINDS) if marker in k]
    _, key, kind = min(ranked) if ranked else (0, keys[0], "not a LoRA weight of a linear module")
    more = f" (and {len(keys) - 1} more keys that cannot be served)" if len(keys) > 1 else ""
    return LoraFormatError(
        f"{where!r}: tensor {key!r} is {kind}{more}; only {_PREFIX}<module>.lora_A.weight / "
        ".lora_B.weight (embeddings: .lora_embedding_A / .lora_embedding_B) can be served"
    )


def _check_against_config(
    config: PeftLoraConfig,
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    where: str,
    config_where: str,
) -> None:
    if not config.targets(module):
        raise LoraFormatError(
            f"{config_where!r}: target_modules={_show(config.target_modules)} "
            f"(exclude_modules={_show(config.exclude_modules)}) does not select {module!r}, "
            f"but {where!r} holds its weights"
        )
    if a.dim() != 2 or b.dim() != 2:
        raise LoraFormatError(
            f"{where!r}: {module!r}: lora_A / lora_B must be 2-D, got {list(a.shape)} / "
            f"{list(b.shape)}"
        )
    r, field = config.rank_of(module)
    if a.shape[0] != r or b.shape[1] != r:
        raise LoraFormatError(
            f"{config_where!r}: {field}={r}, but {where!r} holds {module!r} with rank "
            f"{a.shape[0]} (lora_A {list(a.shape)}, lora_B {list(b.shape)})"
        )


def _show(spec: object) -> str:
    return repr(list(spec) if isinstance(spec, tuple) else spec)


def _build(
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scalings: dict[str, float],
    embeddings: frozenset[str],
) -> LoraAdapter:
    values = list(scalings.values())
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12 * max(abs(lo), abs(hi)):
        return LoraAdapter(weights, values[0], embeddings)
    folded = {
        m: (a, (b.to(torch.float64) * scalings[m]).to(b.dtype)) for m, (a, b) in weights.items()
    }
    return LoraAdapter(folded, 1.0, embeddings)


def write_peft_adapter(
    path: str | os.PathLike[str],
    adapter: LoraAdapter,
    *,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``adapter`` as a PEFT LoRA directory that PEFT and :func:`read_peft_adapter` load.

    ``r`` is the adapter's largest rank; modules of another rank get ``rank_pattern`` and
    ``alpha_pattern`` entries (their full path) so that every module keeps ``scaling``;
    ``lora_alpha = scaling * r``; ``target_modules`` lists every module path. The directory is
    created if needed; existing files of the same names are replaced.

    Returns:
        The directory.

    Raises:
        TypeError: ``adapter`` is not a :class:`LoraAdapter`, or a bad ``path``.
        ImportError: ``safetensors`` is not installed.
        OSError: the files cannot be written.
    """
    if not isinstance(adapter, LoraAdapter):
        raise TypeError(f"adapter must be a LoraAdapter, got {type(adapter).__name__}")
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or path, got {type(path).__name__}")
    st = _safetensors()
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    r = adapter.rank
    others = {m: adapter.rank_of(m) for m in sorted(adapter.modules) if adapter.rank_of(m) != r}
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": adapter.scaling * r,
        "use_rslora": False,
        "target_modules": sorted(adapter.modules),
        "rank_pattern": others,
        "alpha_pattern": {m: adapter.scaling * rm for m, rm in others.items()},
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    tensors = {}
    for module, (a, b) in adapter.weights.items():
        kind = ("lora_embedding_A", "lora_embedding_B") if module in adapter.embedding_modules else (
            "lora_A.weight", "lora_B.weight")
        tensors[f"{_PREFIX}{module}.{kind[0]}"] = a.contiguous()
        tensors[f"{_PREFIX}{module}.{kind[1]}"] = b.contiguous()
    st.torch.save_file(tensors, str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True)
    (directory / ADAPTER_CONFIG_NAME).write_text(text + "\n", encoding="utf-8")
    return directory

