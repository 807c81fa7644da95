"""Serving arguments around the LoRA pool, with SGLang's names and defaults.

``lora_paths`` entries come in three forms (SGLang's ``--lora-paths``)::

    PATH                                              name = PATH, not pinned
    NAME=PATH                                         split at the first '='
    {"lora_name": str, "lora_path": str, "pinned": bool}   JSON text or a mapping

Every entry is parsed into a :class:`LoraPathSpec`; a malformed one raises ``ValueError``
(``TypeError`` for a value of the wrong kind) naming ``lora_paths[i]`` and the accepted forms.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from allocators import check_positive_int
from allocators.lora import effective_max_loaded_loras, make_lora_eviction_policy

__all__ = [
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "LoraArgs",
    "LoraPathSpec",
    "parse_lora_path",
    "parse_lora_paths",
]

DEFAULT_MAX_LORAS_PER_BATCH = 8
"""SGLang's ``--max-loras-per-batch`` default."""

_FORMS = 'PATH, NAME=PATH, or JSON {"lora_name": str, "lora_path": str, "pinned": bool}'
_JSON_KEYS = frozenset({"lora_name", "lora_path", "pinned"})


@dataclass(frozen=True, slots=True)
class LoraPathSpec:
    """One parsed ``lora_paths`` entry: the adapter's serving name, its PEFT directory (a
    local path), its pin."""

    name: str
    path: str
    pinned: bool = False


def parse_lora_path(entry: object, where: str = "lora_paths entry") -> LoraPathSpec:
    """Parse one ``lora_paths`` entry (see the module docstring for the forms).

    Raises:
        TypeError: ``entry`` is neither a str, a mapping nor a ``LoraPathSpec``; a JSON field
            of the wrong type.
        ValueError: empty text, an empty name or path, bad JSON, missing or unknown JSON keys.
    """
    if isinstance(entry, LoraPathSpec):
        entry = {"lora_name": entry.name, "lora_path": entry.path, "pinned": entry.pinned}
    if isinstance(entry, Mapping):
        return _from_mapping(entry, where)
    if not isinstance(entry, str):
        raise TypeError(f"{where} must be a str or mapping ({_FORMS}), got {type(entry).__name__}")
    text = entry.strip()
    if not text:
        raise ValueError(f"{where} is empty; expected {_FORMS}")
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg}): {text!r}") from None
        return _from_mapping(obj, where)  # text starting with '{' decodes to a dict or fails
    if "=" in text:
        name, path = (part.strip() for part in text.split("=", 1))
        if not name or not path:
            raise ValueError(f"{where}: NAME=PATH needs both a name and a path, got {text!r}")
        return LoraPathSpec(name, path)
    return LoraPathSpec(text, text)


def _from_mapping(obj: Mapping[object, object], where: str) -> LoraPathSpec:
    unknown = sorted(map(str, set(obj).difference(_JSON_KEYS)))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; expected {_FORMS}")
    missing = sorted(_JSON_KEYS.difference(obj) - {"pinned"})
    if missing:
        raise ValueError(f"{where}: missing keys {missing}; expected {_FORMS}")
    name, path, pinned = obj["lora_name"], obj["lora_path"], obj.get("pinned", False)
    for key, value in (("lora_name", name), ("lora_path", path)):
        if not isinstance(value, str):
            raise TypeError(f"{where}: {key} must be a str, got {type(value).__name__}")
        if not value.strip():
            raise ValueError(f"{where}: {key} must not be empty")
    if not isinstance(pinned, bool):
        raise TypeError(f"{where}: pinned must be a bool, got {type(pinned).__name__}")
    assert isinstance(name, str) and isinstance(path, str)  # checked in the loop above
    return LoraPathSpec(name.strip(), path.strip(), pinned)


def parse_lora_paths(entries: object) -> tuple[LoraPathSpec, ...]:
    """Parse a list of ``lora_paths`` entries; names must be distinct.

    Raises:
        TypeError: ``entries`` is a bare str or not a sequence; an entry of the wrong kind.
        ValueError: a malformed entry (naming its index) or a repeated name.
    """
    if isinstance(entries, str | bytes) or not isinstance(entries, Sequence):
        raise TypeError(
            f"lora_paths must be a list of entries ({_FORMS}), got {type(entries).__name__}"
        )
    specs = tuple(parse_lora_path(e, f"lora_paths[{i}]") for i, e in enumerate(entries))
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ValueError(
                f"lora_paths[{i}]: adapter name {spec.name!r} already used by "
                f"lora_paths[{seen[spec.name]}]"
            )
        seen[spec.name] = i
    return specs


TargetModules = frozenset[str] | Literal["all"] | None


@dataclass(frozen=True)
class LoraArgs:
    """The LoRA serving arguments, validated; SGLang's names, defaults as in SGLang.

    Attributes:
        enable_lora: ``None`` -> ``True`` exactly when ``lora_paths`` is non-empty.
        lora_paths: entries in any of the three forms; stored parsed (``LoraPathSpec``).
        max_loras_per_batch: device slots, ``>= 1`` (default 8).
        max_loaded_loras: host-tier capacity, ``None`` = unlimited (see
            :func:`effective_max_loaded_loras`; stored resolved).
        lora_eviction_policy: ``"lru"`` (default) or ``"fifo"``.
        max_lora_rank: ``None`` -> the largest rank among the initial adapters.
        lora_target_modules: module names (``q_proj``, ``embed_tokens``, ``lm_head``; a path
            matches a name it equals or ends with), or ``"all"`` (every module of the base
            model, ``embed_tokens`` and ``lm_head`` included; ``"all-linear"`` is
            taken as ``"all"``, as SGLang does), or ``None`` -> the leaf names of the initial
            adapters' modules. Stored as a frozenset or ``"all"``.
        enable_lora_overlap_loading: asynchronous host->device fills from pinned memory.
        lora_drain_wait_threshold: seconds a request may wait for a non-resident adapter
            before the scheduler drains one running adapter; ``0`` = off (default). The
            engine's scheduler acts on it, not the pool (the pool admits no requests; as in
            SGLang, whose scheduler's LoRA drainer does it): at each scheduling step, an
            adapter whose oldest waiting request waited longer than this and that
            ``LoraMemoryPool.validate_batch(running | {adapter})`` refuses is starving; one
            running adapter (the one whose requests end soonest) then admits no new request
            until its last one finishes, which frees its slot for the starving one at the next
            ``prepare_batch``. ``bench.lora.sched.LoraScheduler`` is that scheduler for the
            replay (``--lora-drain-wait-threshold``).

    Raises:
        TypeError / ValueError: naming the argument. Also: ``lora_paths`` with
        ``enable_lora=False``; LoRA enabled without ``lora_paths`` and without both
        ``max_lora_rank`` and ``lora_target_modules`` (nothing to infer them from); more
        initial adapters than ``max_loaded_loras``; more pinned than
        ``max_loras_per_batch - 1``.
    """

    enable_lora: bool | None = None
    lora_paths: Sequence[str | Mapping[str, object] | LoraPathSpec] | None = None
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None
    lora_eviction_policy: str = "lru"
    max_lora_rank: int | None = None
    lora_target_modules: str | Sequence[str] | None = None
    enable_lora_overlap_loading: bool = False
    lora_drain_wait_threshold: float = 0.0

    def __post_init__(self) -> None:
        put = object.__setattr__
        specs = () if self.lora_paths is None else parse_lora_paths(self.lora_paths)
        put(self, "lora_paths", specs)
        enable = self.enable_lora
        if enable is None:
            enable = bool(specs)
        if not isinstance(enable, bool):
            raise TypeError(f"enable_lora must be a bool or None, got {type(enable).__name__}")
        if specs and not enable:
            raise ValueError("lora_paths given but enable_lora=False")
        put(self, "enable_lora", enable)
        k = check_positive_int(self.max_loras_per_batch, "max_loras_per_batch")
        overlap = self.enable_lora_overlap_loading
        if not isinstance(overlap, bool):
            raise TypeError(
                f"enable_lora_overlap_loading must be a bool, got {type(overlap).__name__}"
            )
        cap = effective_max_loaded_loras(k, self.max_loaded_loras, overlap)
        put(self, "max_loaded_loras", cap)
        make_lora_eviction_policy(self.lora_eviction_policy)  # validates the name
        if self.max_lora_rank is not None:
            check_positive_int(self.max_lora_rank, "max_lora_rank")
        put(self, "lora_target_modules", _parse_target_modules(self.lora_target_modules))
        put(self, "lora_drain_wait_threshold", _check_seconds(self.lora_drain_wait_threshold))
        self._check_counts(specs, k, cap)

    def _check_counts(self, specs: tuple[LoraPathSpec, ...], k: int, cap: int | None) -> None:
        if (
            self.enable_lora
            and not specs
            and (self.max_lora_rank is None or self.lora_target_modules is None)
        ):
            raise ValueError(
                "LoRA is enabled without lora_paths: give max_lora_rank and "
                "lora_target_modules (they cannot be inferred from initial adapters)"
            )
        if cap is not None and len(specs) > cap:
            raise ValueError(f"lora_paths lists {len(specs)} adapters > max_loaded_loras={cap}")
        pinned = sum(s.pinned for s in specs)
        if pinned > k - 1:
            raise ValueError(
                f"lora_paths pins {pinned} adapters > max_loras_per_batch - 1 = {k - 1}"
            )


def _parse_target_modules(value: object) -> TargetModules:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, Sequence | frozenset | set) or isinstance(names, bytes):
        raise TypeError(
            f"lora_target_modules must be 'all' or a list of str, got {type(value).__name__}"
        )
    names = list(names)
    for i, n in enumerate(names):
        if not isinstance(n, str):
            raise TypeError(f"lora_target_modules[{i}] must be a str, got {type(n).__name__}")
    if not names or not all(n.strip() for n in names):
        raise ValueError(f"lora_target_modules must be 'all' or non-empty names, got {value!r}")
    if "all" in names or "all-linear" in names:
        if len(names) != 1:
            raise ValueError("lora_target_modules: 'all' cannot be combined with other names")
        return "all"
    return frozenset(n.strip() for n in names)


def _check_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"lora_drain_wait_threshold must be a number of seconds, got {type(value).__name__}"
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"lora_drain_wait_threshold must be finite and >= 0, got {value}")
    return float(value)
