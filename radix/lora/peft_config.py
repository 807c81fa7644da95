"""``adapter_config.json`` of a PEFT LoRA adapter: parsed, validated, and PEFT's matching rules.

A PEFT adapter directory holds (the layout SGLang and vLLM read)::

    adapter_config.json          LoraConfig as JSON: peft_type "LORA", r, lora_alpha, ...
    adapter_model.safetensors    base_model.model.<module path>.lora_A.weight  [r, in]
                                 base_model.model.<module path>.lora_B.weight  [out, r]

Fields read, with PEFT's meaning:

* ``r`` (rank), ``lora_alpha``, ``use_rslora``: a module's scaling is ``lora_alpha / r``, or
  ``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski, 2023), as PEFT's LoRA layer computes it.
* ``rank_pattern`` / ``alpha_pattern``: per-module ``r`` / ``lora_alpha``; the first key ``k``
  (in file order) with ``re.match(rf"(.*\\.)?({k})$", path)`` applies, as in PEFT.
* ``target_modules``: a list of names (a path matches a name when it equals it or ends with
  ``"." + name``), a regular expression matched against the whole path, or ``"all-linear"``;
  ``exclude_modules`` likewise (list or regular expression).

Refused, each with the file and the field in the message: another ``peft_type`` (IA3, LoHa,
LoKr, AdaLoRA, ...), LoRA variants whose forward is not ``B @ A`` (DoRA, aLoRA, ...), trained
biases, ``modules_to_save`` (whole copies of base modules), trainable tokens, ``target_parameters``
and ``layer_replication``. Unknown fields are ignored (PEFT adds fields over time).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from allocators.lora import matches_module_name

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "LoraFormatError",
    "PeftLoraConfig",
    "parse_peft_config",
    "read_peft_config",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

ALL_LINEAR = "all-linear"
"""PEFT's ``target_modules`` shorthand for every linear layer but the output layer."""

# Fields that switch PEFT's LoRA layer to another forward (a "LoRA variant").
_VARIANT_FIELDS = {
    "use_dora": "DoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
}
# Fields that add trained tensors beyond lora_A / lora_B, or change the base model.
_EXTRA_FIELDS = {
    "modules_to_save": "whole copies of base modules are not served",
    "trainable_token_indices": "trained token embeddings are not served",
    "target_parameters": "LoRA on bare parameters (not linear modules) is not served",
    "layer_replication": "it changes the base model's layers",
}


class LoraFormatError(ValueError):
    """An adapter directory exists but is not a servable LoRA adapter; the message names the
    file and the field (or tensor) at fault."""


@dataclass(frozen=True, slots=True)
class PeftLoraConfig:
    """The fields of ``adapter_config.json`` that decide the served weights (validated).

    Attributes:
        r: default rank, ``>= 1``.
        lora_alpha: default alpha (finite).
        use_rslora: scaling ``alpha / sqrt(r)`` instead of ``alpha / r``.
        target_modules: names (list form) or one regular expression / ``"all-linear"``.
        rank_pattern: pattern -> rank (``>= 1``), in file order.
        alpha_pattern: pattern -> alpha (finite), in file order.
        exclude_modules: names or a regular expression; ``None`` = none.
        base_model_name_or_path: as recorded by PEFT (informative only).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    exclude_modules: tuple[str, ...] | str | None = None
    base_model_name_or_path: str | None = None

    def targets(self, path: str) -> bool:
        """Whether PEFT's ``target_modules`` / ``exclude_modules`` select module ``path``."""
        if _selects(self.exclude_modules, path):
            return False
        if isinstance(self.target_modules, str) and self.target_modules.lower() == ALL_LINEAR:
            return True
        return _selects(self.target_modules, path)

    def rank_of(self, path: str) -> tuple[int, str]:
        """``(r, field)`` for ``path``: the matching ``rank_pattern`` entry, else ``r``."""
        key = _pattern_key(self.rank_pattern, path)
        if key is None:
            return self.r, "r"
        return self.rank_pattern[key], f"rank_pattern[{key!r}]"

    def alpha_of(self, path: str) -> float:
        """``lora_alpha`` for ``path``: the matching ``alpha_pattern`` entry, else the default."""
        key = _pattern_key(self.alpha_pattern, path)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scaling_of(self, path: str) -> float:
        """PEFT's scaling of module ``path``: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
        r, _ = self.rank_of(path)
        alpha = self.alpha_of(path)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _selects(spec: tuple[str, ...] | str | None, path: str) -> bool:
    if spec is None:
        return False
    if isinstance(spec, str):
        return re.fullmatch(spec, path) is not None
    return any(matches_module_name(path, name) for name in spec)


def _pattern_key(patterns: Mapping[str, object], path: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", path):
            return key
    return None


def read_peft_config(directory: str | Path) -> PeftLoraConfig:
    """Parse ``directory/adapter_config.json``.

    Raises:
        FileNotFoundError: ``directory`` does not exist.
        LoraFormatError: not a directory, no ``adapter_config.json``, invalid JSON, or a field
            that is missing, malformed or unsupported (the message names the file and field).
    """
    path = Path(directory) / ADAPTER_CONFIG_NAME
    if not path.is_file():
        raise LoraFormatError(
            f"{str(Path(directory))!r} is not a PEFT adapter directory: {ADAPTER_CONFIG_NAME} "
            "is missing"
        )
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraFormatError(f"{str(path)!r}: not valid JSON ({exc})") from None
    return parse_peft_config(obj, str(path))


def parse_peft_config(obj: object, where: str = ADAPTER_CONFIG_NAME) -> PeftLoraConfig:
    """Validate a decoded ``adapter_config.json``; ``where`` names it in error messages.

    Raises:
        LoraFormatError: see :func:`read_peft_config`.
    """
    if not isinstance(obj, dict):
        raise LoraFormatError(f"{where!r}: must hold a JSON object, got {type(obj).__name__}")
    fields = _Fields(obj, where)
    peft_type = obj.get("peft_type")
    if peft_type != "LORA":
        if "peft_type" not in obj:
            raise LoraFormatError(f"{where!r}: peft_type is missing (a LoRA adapter has 'LORA')")
        raise fields.bad("peft_type", "only LoRA adapters (peft_type 'LORA') can be served")
    fields.refuse_unsupported()
    r = obj.get("r")
    if not _is_rank(r):
        raise fields.bad("r", "the rank must be an integer >= 1")
    assert isinstance(r, int)
    alpha = _number(obj.get("lora_alpha"))
    if alpha is None:
        raise fields.bad("lora_alpha", "must be a finite number")
    rslora = obj.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise fields.bad("use_rslora", "must be true or false")
    target_modules = fields.module_spec("target_modules")
    if target_modules is None:
        raise fields.bad("target_modules", "must list the modules (or be a regular expression)")
    return PeftLoraConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=target_modules,
        rank_pattern=fields.rank_pattern(),
        alpha_pattern=fields.alpha_pattern(),
        exclude_modules=fields.module_spec("exclude_modules"),
        base_model_name_or_path=_optional_str(obj.get("base_model_name_or_path")),
    )


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


class _Fields:
    """The raw JSON object with the checks of each kind of field; errors name the file."""

    def __init__(self, obj: dict[str, object], where: str) -> None:
        self.obj = obj
        self.where = where

    def bad(self, field: str, why: str) -> LoraFormatError:
        return LoraFormatError(f"{self.where!r}: {field}={self.obj.get(field)!r}: {why}")

    def refuse_unsupported(self) -> None:
        get = self.obj.get
        for field, variant in _VARIANT_FIELDS.items():
            if get(field):
                raise self.bad(field, f"{variant} adapters are not supported (plain LoRA only)")
        if get("init_lora_weights") == "mica":
            raise self.bad("init_lora_weights", "the MiCA variant is not supported")
        if get("bias", "none") not in ("none", None):
            raise self.bad("bias", "trained biases are not served (only bias 'none')")
        if get("lora_bias", False):
            raise self.bad("lora_bias", "a bias on lora_B is not served")
        for field, why in _EXTRA_FIELDS.items():
            if get(field):
                raise self.bad(field, why)

    def module_spec(self, field: str) -> tuple[str, ...] | str | None:
        value = self.obj.get(field)
        if value is None:
            return None
        if isinstance(value, str):
            if value.lower() != ALL_LINEAR:
                self._compile(value, field)
            return value
        if isinstance(value, list) and value and all(isinstance(n, str) and n for n in value):
            return tuple(value)
        raise self.bad(field, "must be a non-empty list of module names or one regular expression")

    def rank_pattern(self) -> Mapping[str, int]:
        out: dict[str, int] = {}
        for key, value in self._pattern_items("rank_pattern"):
            if not _is_rank(value):
                raise self.bad("rank_pattern", f"rank of {key!r} must be an integer >= 1")
            assert isinstance(value, int)
            out[key] = value
        return MappingProxyType(out)

    def alpha_pattern(self) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for key, value in self._pattern_items("alpha_pattern"):
            number = _number(value)
            if number is None:
                raise self.bad("alpha_pattern", f"alpha of {key!r} must be a finite number")
            out[key] = number
        return MappingProxyType(out)

    def _pattern_items(self, field: str) -> list[tuple[str, object]]:
        value = self.obj.get(field) or {}
        if not isinstance(value, dict):
            raise self.bad(field, "must map module patterns to values")
        for key in value:
            self._compile(key, field)
        return list(value.items())

    def _compile(self, pattern: str, field: str) -> None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise self.bad(field, f"{pattern!r} is not a valid regular expression ({exc})") from None
