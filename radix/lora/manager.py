"""The serving-side surface of the LoRA pool: names, PEFT adapter directories, SGLang's arguments.

:class:`LoraManager` turns :class:`~allocators.lora.LoraArgs` into a
:class:`~allocators.lora.LoraMemoryPool`: it reads the initial ``lora_paths`` (PEFT
directories), infers ``max_lora_rank`` and ``lora_target_modules`` from them when they are
not given, as SGLang does, and then serves dynamic ``load_adapter`` / ``unload_adapter`` /
``reload_adapter`` and pinning by name. The batch path (``prepare_batch``, ``apply``) is the
pool's, in uids: ``manager.pool.prepare_batch(...)``.

Inference (SGLang's rule, on the adapters' tensors)::

    max_lora_rank        = the largest rank of any module of any initial adapter
    lora_target_modules  = the leaf names of the modules the initial adapters have weights
                           for (``q_proj``, ``v_proj``, ...)

and the pool gets a slot buffer for every base-model module whose path matches one of the
names (that module in every layer, whatever layers the initial adapters touched). An adapter
loaded later with a larger rank or another module is refused, naming the argument to raise.

Names are the serving names (``lora_name``); each load issues a new :class:`LoraUid`, so
a request resolved to a uid keeps meaning exactly the weights it was resolved against.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import cast

import torch

from allocators.lora import (
    LoraAdapter,
    LoraMemoryPool,
    LoraUid,
    check_module_shapes,
    leaf_name,
    matches_module_name,
)
from radix.lora.peft_adapter import read_peft_adapter
from radix.lora.serving_args import LoraArgs, LoraPathSpec

__all__ = ["LoraManager"]


class LoraManager:
    """Adapters by name over one :class:`LoraMemoryPool`.

    Args:
        args: validated serving arguments (``enable_lora`` must be true).
        base_modules: every module of the base model a LoRA could target (linear modules,
            ``lm_head`` included, and ``embed_tokens`` as ``(vocab_size, hidden_size)``),
            path -> ``(in_features, out_features)`` (:func:`~allocators.lora.linear_module_shapes`
            of a torch model); ``lora_target_modules="all"`` means all of these.
        dtype, device: of the pool's buffers (see :class:`LoraMemoryPool`).

    Attributes:
        max_lora_rank: the slots' rank (given or inferred).
        lora_target_modules: the target-module names (given, inferred, or the leaf names of
            every base module for ``"all"``).

    Raises:
        TypeError / ValueError: a bad argument; ``lora_target_modules`` naming a module the
            base model lacks; an initial adapter that does not fit the base model or the
            arguments (the message names the argument to raise).
        FileNotFoundError / LoraFormatError: an initial adapter directory is missing or invalid.
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
        initial = [(spec, self._read(spec.name, spec.path)) for spec in specs]
        rank = args.max_lora_rank
        if rank is None:
            rank = max(adapter.rank for _, adapter in initial)
        self.max_lora_rank: int = rank
        self.lora_target_modules: frozenset[str] = self._resolve_names(
            [adapter for _, adapter in initial]
        )
        targets = [
            m
            for m in self.base_modules
            if any(matches_module_name(m, n) for n in self.lora_target_modules)
        ]
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
            self._check_targets(spec.name, adapter)
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
        """The directory the current load of ``name`` was read from."""
        return self._name_to_path[self._check_loaded_name(name)]

    # ------------------------------------------------------------------ dynamic loading
    def load_adapter(
        self, name: str, path: str | os.PathLike[str], *, pinned: bool = False
    ) -> LoraUid:
        """Read the PEFT directory ``path`` and load it as ``name`` (SGLang's
        ``load_lora_adapter``).

        Raises:
            TypeError: bad argument types.
            ValueError: ``name`` already loaded (unload it or use :meth:`reload_adapter`), a
                module the base model lacks or of another shape, a module outside
                ``lora_target_modules``, a rank above ``max_lora_rank``, ``max_loaded_loras``
                reached, or the pin limit (as ``LoraMemoryPool.add_adapter``).
            FileNotFoundError / LoraFormatError: the directory is missing or not an adapter.
            Nothing changes when it raises.
        """
        name = _check_str(name, "name")
        if name in self._name_to_uid:
            raise ValueError(
                f"adapter {name!r} is already loaded ({self._name_to_uid[name]}); unload it "
                "first or use reload_adapter"
            )
        return self._install(name, path, lambda a: self.pool.add_adapter(name, a, pinned=pinned))

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
        return self._install(name, path, lambda a: self.pool.replace_adapter(old, a, pinned=pinned))

    def pin_adapter(self, name: str) -> None:
        """Pin ``name`` (loads it into a slot now); see ``LoraMemoryPool.pin``."""
        self.pool.pin(self.uid_of(name))

    def unpin_adapter(self, name: str) -> None:
        """Unpin ``name``; see ``LoraMemoryPool.unpin``."""
        self.pool.unpin(self.uid_of(name))

    # ------------------------------------------------------------------ internals
    def _install(self, name: str, path: str | os.PathLike[str],
                 put: Callable[[LoraAdapter], LoraUid]) -> LoraUid:
        """Read and check the adapter at ``path``, hand it to ``put`` (the pool's add or
        replace) and record ``name``'s new uid and path; raises as ``load_adapter``."""
        adapter = self._read(name, path)
        self._check_targets(name, adapter)
        uid = put(adapter)
        self._name_to_uid[name] = uid
        self._name_to_path[name] = os.fspath(path)
        return uid

    def _read(self, name: str, path: object) -> LoraAdapter:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path must be a str or path, got {type(path).__name__}")
        adapter = read_peft_adapter(path, base_vocab_size=self._base_vocab_size())
        self._check_base_modules(name, os.fspath(path), adapter)
        return adapter

    def _base_vocab_size(self) -> int | None:
        """The vocabulary size of the base model's ``embed_tokens`` (its ``in_features``), or
        ``None`` when the base modules have none (every added token then counts)."""
        for module, (in_f, _) in self.base_modules.items():
            if leaf_name(module) == "embed_tokens":
                return in_f
        return None

    def _check_base_modules(self, name: str, path: str, adapter: LoraAdapter) -> None:
        unknown = sorted(adapter.modules.difference(self.base_modules))
        if unknown:
            raise ValueError(
                f"adapter {name!r} targets {_preview(unknown)}, which are not modules of the "
                f"base model ({_preview(sorted(self.base_modules))}); read from {path!r}"
            )
        for module, (a, b) in sorted(adapter.weights.items()):
            in_f, out_f = self.base_modules[module]
            if a.shape[1] != in_f or b.shape[0] != out_f:
                raise ValueError(
                    f"adapter {name!r} ({path!r}): {module!r} has lora_A {list(a.shape)} / "
                    f"lora_B {list(b.shape)}, which do not fit the base model's module "
                    f"(in_features={in_f}, out_features={out_f})"
                )

    def _check_targets(self, name: str, adapter: LoraAdapter) -> None:
        extra = sorted(adapter.modules.difference(self.pool.target_modules))
        if extra:
            leaves = sorted({leaf_name(m) for m in extra})
            raise ValueError(
                f"adapter {name!r} targets {leaves}, not in lora_target_modules="
                f"{sorted(self.lora_target_modules)}; start with lora_target_modules including "
                "them (or 'all')"
            )

    def _resolve_names(self, initial: Sequence[LoraAdapter]) -> frozenset[str]:
        given = self.args.lora_target_modules
        if given == "all":
            return frozenset(leaf_name(m) for m in self.base_modules)
        if given is None:
            return frozenset(leaf_name(m) for a in initial for m in a.modules)
        names = frozenset(cast(frozenset[str], given))
        unknown = sorted(
            n for n in names if not any(matches_module_name(m, n) for m in self.base_modules)
        )
        if unknown:
            raise ValueError(
                f"lora_target_modules names {unknown}, which are not modules of the base "
                f"model ({_preview(sorted(self.base_modules))})"
            )
        return names

    def _check_loaded_name(self, name: object) -> str:
        name = _check_str(name, "name")
        if name not in self._name_to_uid:
            raise ValueError(
                f"adapter {name!r} is not loaded (loaded: {sorted(self._name_to_uid)})"
            )
        return name


def _preview(names: Sequence[str], limit: int = 8) -> str:
    """``names`` as a list, cut to ``limit`` entries with a count of the rest."""
    if len(names) <= limit:
        return repr(list(names))
    return f"{list(names[:limit])!r} and {len(names) - limit} more"


def _check_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value
