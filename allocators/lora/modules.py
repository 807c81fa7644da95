"""The base model's modules as LoRA sees them: names, shapes, target-module matching.

LoRA targets linear modules (``q_proj`` ... ``down_proj``, ``lm_head``: ``(in_features,
out_features)``) and embeddings (``embed_tokens``: ``(vocab_size, hidden_size)``, its input a
token id), as SGLang's ``--lora-target-modules`` does (``all`` includes ``embed_tokens`` and
``lm_head``).

A module is named by its path in the model, as ``torch.nn.Module.named_modules`` reports it
on the model PEFT wrapped (``model.layers.0.self_attn.q_proj`` for a transformers causal
LM); adapters key their weights by the same paths. Serving arguments name target modules
the short way, as SGLang's ``--lora-target-modules`` and PEFT's list form of
``target_modules`` do::

    name "q_proj"            matches  "q_proj", "model.layers.7.self_attn.q_proj"
    name "self_attn.q_proj"  matches  "model.layers.7.self_attn.q_proj"       (not "q_proj")

that is, a path matches a name when it equals it or ends with ``"." + name``. The *leaf* of a
path is its last component (``q_proj``); ``max_lora_rank`` / ``lora_target_modules`` inferred
from adapters are reported as leaf names and cover that module in every layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .._checks import check_positive_int

__all__ = [
    "check_module_shapes",
    "leaf_name",
    "linear_module_shapes",
    "matches_module_name",
    "modules_matching",
]


def check_module_shapes(
    modules: object, name: str = "target_modules"
) -> dict[str, tuple[int, int]]:
    """Validate ``module path -> (in_features, out_features)``; returns a plain dict copy.

    Raises:
        TypeError: not a mapping, a non-str name, a value that is not a pair of ints.
        ValueError: empty, or a feature count ``< 1``.
    """
    if not isinstance(modules, Mapping):
        raise TypeError(
            f"{name} must map module name -> (in_features, out_features), "
            f"got {type(modules).__name__}"
        )
    if not modules:
        raise ValueError(f"{name} must name at least one module")
    out = {}
    for module, dims in modules.items():
        if not isinstance(module, str) or not module:
            raise TypeError(f"{name} keys must be non-empty str, got {module!r}")
        if not isinstance(dims, tuple | list) or len(dims) != 2:
            raise TypeError(f"{name}[{module!r}] must be (in_features, out_features)")
        out[module] = (
            check_positive_int(dims[0], f"{name}[{module!r}].in_features"),
            check_positive_int(dims[1], f"{name}[{module!r}].out_features"),
        )
    return out


def leaf_name(path: str) -> str:
    """The last component of a module path: ``"model.layers.0.mlp.up_proj"`` -> ``"up_proj"``."""
    return path.rsplit(".", 1)[-1]


def matches_module_name(path: str, name: str) -> bool:
    """Whether module ``path`` is ``name`` or ends with ``"." + name`` (PEFT's list rule)."""
    return path == name or path.endswith("." + name)


def modules_matching(paths: Iterable[str], names: Iterable[str]) -> list[str]:
    """The paths (in their order) that match at least one of ``names``."""
    wanted = tuple(names)
    return [p for p in paths if any(matches_module_name(p, n) for n in wanted)]


def linear_module_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Every ``torch.nn.Linear`` of ``model``: path -> ``(in_features, out_features)``, and
    every ``torch.nn.Embedding``: path -> ``(num_embeddings, embedding_dim)`` (the shapes of
    embedding LoRA: ``A`` is ``[r, num_embeddings]``, ``B`` is ``[embedding_dim, r]``).

    The ``base_modules`` of :class:`~allocators.lora.LoraManager` for a torch model; pass the
    model PEFT would wrap (for a transformers causal LM, the ``*ForCausalLM`` object).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    shapes = {}
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            shapes[path] = (m.in_features, m.out_features)
        elif isinstance(m, torch.nn.Embedding):
            shapes[path] = (m.num_embeddings, m.embedding_dim)
    return shapes
