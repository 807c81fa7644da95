"""The serving-side surface of the LoRA pool: names, adapter files and SGLang's arguments.

:class:`LoraManager` turns :class:`~allocators.lora.LoraArgs` into a
:class:`~allocators.lora.LoraMemoryPool`: it reads the initial ``lora_paths``, infers
``max_lora_rank`` (largest initial rank) and ``lora_target_modules`` (union of the initial
adapters' modules) when they are not given, and then serves dynamic ``load_adapter`` /
``unload_adapter`` / ``reload_adapter`` and pinning by name. The batch path
(``prepare_batch``, ``apply``) is the pool's, in uids: ``manager.pool.prepare_batch(...)``.

Names are the serving names (``lora_name``); each load issues a new :class:`LoraUid`, so
a request resolved to a uid keeps meaning exactly the weights it was resolved against.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import cast

import torch

from .identity import LoraUid
from .pool import LoraMemoryPool
from .serving_args import LoraArgs, LoraPathSpec
from .slots import check_module_shapes
from .weights import LoraAdapter, read_adapter

__all__ = ["LoraManager"]


class LoraManager:
    """Adapters by name over one :class:`LoraMemoryPool`.

    Args:
        args: validated serving arguments (``enable_lora`` must be true).
        base_modules: every linear module of the base model a LoRA could target,
            name -> ``(in_features, out_features)``; ``lora_target_modules="all"`` means these.
        dtype, device: of the pool's buffers (see :class:`LoraMemoryPool`).

    Raises:
        TypeError / ValueError: a bad argument; ``lora_target_modules`` naming a module the
            base model lacks; an initial adapter that does not fit the arguments (the message
            names the argument to raise).
        FileNotFoundError / LoraFormatError: an initial adapter file is missing or invalid.
    """

    def __init__(
        self,
        args: LoraArgs,
        base_modules: Mapping[str, tuple[int, int]],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if not isinstance(args, LoraArgs):
            raise TypeError(f"args must be LoraArgs, got {type(args).__name__}")
        if not args.enable_lora:
            raise ValueError("LoRA is disabled (enable_lora=False): nothing to manage")
        self.args = args
        self.base_modules = check_module_shapes(base_modules, "base_modules")
        # LoraArgs.__post_init__ stores lora_paths parsed: a tuple of LoraPathSpec.
        specs = cast(tuple[LoraPathSpec, ...], args.lora_paths)
        initial = [(spec, read_adapter(spec.path)) for spec in specs]
        for spec, adapter in initial:
            self._check_base_modules(spec.name, adapter)
        rank = args.max_lora_rank
        if rank is None:
            rank = max(adapter.rank for _, adapter in initial)
        targets = self._resolve_targets([adapter for _, adapter in initial])
        self.pool = LoraMemoryPool(
            {m: self.base_modules[m] for m in sorted(targets)},
            rank,
            args.max_loras_per_batch,
            max_loaded_loras=args.max_loaded_loras,
            eviction_policy=args.lora_eviction_policy,
            dtype=dtype,
            device=device,
            overlap_loading=args.enable_lora_overlap_loading,
        )
        self._name_to_uid: dict[str, LoraUid] = {}
        self._name_to_path: dict[str, str] = {}
        for spec, adapter in initial:
            self._name_to_uid[spec.name] = self.pool.add_adapter(
                spec.name, adapter, pinned=spec.pinned
            )
            self._name_to_path[spec.name] = spec.path

    # ------------------------------------------------------------------ queries
    @property
    def name_to_uid(self) -> Mapping[str, LoraUid]:
        """Loaded serving name -> the uid of its current load (read-only view)."""
        return MappingProxyType(self._name_to_uid)

    def uid_of(self, name: str) -> LoraUid:
        """The current uid of a loaded adapter. Raises ``ValueError`` if ``name`` is not loaded."""
        return self._name_to_uid[self._check_loaded_name(name)]

    def path_of(self, name: str) -> str:
        """The file the current load of ``name`` was read from."""
        return self._name_to_path[self._check_loaded_name(name)]

    # ------------------------------------------------------------------ dynamic loading
    def load_adapter(
        self, name: str, path: str | os.PathLike[str], *, pinned: bool = False
    ) -> LoraUid:
        """Read ``path`` and load it as ``name`` (SGLang's ``load_lora_adapter``).

        Raises:
            TypeError: bad argument types.
            ValueError: ``name`` already loaded (unload it or use :meth:`reload_adapter`), a
                module the base model lacks, or as ``LoraMemoryPool.add_adapter`` (rank above
                ``max_lora_rank``, modules outside ``lora_target_modules``,
                ``max_loaded_loras`` reached, the pin limit).
            FileNotFoundError / LoraFormatError: the file is missing or not an adapter.
            Nothing changes when it raises.
        """
        name = _check_str(name, "name")
        if name in self._name_to_uid:
            raise ValueError(
                f"adapter {name!r} is already loaded ({self._name_to_uid[name]}); unload it "
                "first or use reload_adapter"
            )
        adapter = self._read(name, path)
        uid = self.pool.add_adapter(name, adapter, pinned=pinned)
        self._name_to_uid[name] = uid
        self._name_to_path[name] = os.fspath(path)
        return uid

    def unload_adapter(self, name: str) -> LoraUid:
        """Unload ``name`` (SGLang's ``unload_lora_adapter``); returns the uid it had.

        Raises:
            ValueError: ``name`` is not loaded.
        """
        uid = self.uid_of(name)
        self.pool.remove_adapter(uid)
        del self._name_to_uid[name], self._name_to_path[name]
        return uid

    def reload_adapter(
        self,
        name: str,
        path: str | os.PathLike[str] | None = None,
        *,
        pinned: bool | None = None,
    ) -> LoraUid:
        """Replace a loaded adapter by a fresh read of ``path`` (default: its current path).

        The new load gets a new uid; a pinned adapter re-pinned in place counts once against
        the pin limit (``pinned=None`` keeps the pin state).

        Raises:
            ValueError: ``name`` is not loaded, or as :meth:`load_adapter`.
            FileNotFoundError / LoraFormatError: as :meth:`load_adapter`.
            Nothing changes when it raises (the old load stays).
        """
        old = self.uid_of(name)
        path = self._name_to_path[name] if path is None else path
        adapter = self._read(name, path)
        uid = self.pool.replace_adapter(old, adapter, pinned=pinned)
        self._name_to_uid[name] = uid
        self._name_to_path[name] = os.fspath(path)
        return uid

    def pin_adapter(self, name: str) -> None:
        """Pin ``name`` (loads it into a slot now); see ``LoraMemoryPool.pin``."""
        self.pool.pin(self.uid_of(name))

    def unpin_adapter(self, name: str) -> None:
        """Unpin ``name``; see ``LoraMemoryPool.unpin``."""
        self.pool.unpin(self.uid_of(name))

    # ------------------------------------------------------------------ internals
    def _read(self, name: str, path: object) -> LoraAdapter:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or path, got {type(path).__name__}")
        adapter = read_adapter(path)
        self._check_base_modules(name, adapter)
        return adapter

    def _check_base_modules(self, name: str, adapter: LoraAdapter) -> None:
        unknown = sorted(adapter.modules.difference(self.base_modules))
        if unknown:
            raise ValueError(
                f"adapter {name!r} targets {unknown}, which are not modules of the base model "
                f"({sorted(self.base_modules)})"
            )

    def _resolve_targets(self, initial: list[LoraAdapter]) -> frozenset[str]:
        given = self.args.lora_target_modules
        if given == "all":
            return frozenset(self.base_modules)
        if given is None:
            return frozenset().union(*(a.modules for a in initial))
        unknown = sorted(set(given).difference(self.base_modules))  # type: ignore[arg-type]
        if unknown:
            raise ValueError(
                f"lora_target_modules names {unknown}, which are not modules of the base "
                f"model ({sorted(self.base_modules)})"
            )
        return frozenset(given)  # type: ignore[arg-type]

    def _check_loaded_name(self, name: object) -> str:
        name = _check_str(name, "name")
        if name not in self._name_to_uid:
            raise ValueError(
                f"adapter {name!r} is not loaded (loaded: {sorted(self._name_to_uid)})"
            )
        return name


def _check_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value
