"""Import-time stand-ins for ``triton`` and ``torchvision``, so SGLang's caches import on a
CPU-only machine. Imported by the anchor environment's Python (``.ci/sglang-anchor-up``) before
any ``sglang`` module; never imported by the project itself.

SGLang imports ``triton`` and ``torchvision`` at module level (kernels and multimodal helpers
next to the caches), but the radix-cache paths the tests drive are pure Python (plus SGLang's
bundled Rust tree core): no kernel is compiled or launched. So:

1. torch is asked first whether triton exists (``torch.utils._triton`` caches the answer,
   ``False``), and the inductor modules that SGLang's ``torch.compile`` decorators reach are
   imported then, bound to their no-triton fallbacks.
2. Then every ``triton`` / ``triton.*`` / ``torchvision`` / ``torchvision.*`` import is answered
   by a :class:`StandIn` module: ``triton.jit`` / ``autotune`` / ``heuristics`` return the
   function unchanged, ``triton.cdiv`` / ``next_power_of_2`` compute, and any other name is a
   :class:`Placeholder` (callable, subscriptable, usable as a base class or an annotation).
   ``triton.runtime.driver`` raises on any use, so a caller probing for a GPU takes its CPU
   path. A placeholder is never a kernel: calling one returns another placeholder.

Raises ``RuntimeError`` at import when a real triton is installed (the stand-ins would then
hide it) or when ``triton`` / ``torchvision`` was imported before this module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils._triton as torch_triton

if torch_triton.has_triton_package():
    raise RuntimeError("a real triton is installed in the anchor environment: the CPU stand-ins "
                       "would hide it (build the environment with .ci/sglang-anchor-up)")
torch_triton.has_triton()  # cached False: torch never takes its triton paths afterwards
# Imported now, while ``import triton`` still fails, so they bind to their no-triton fallbacks.
importlib.import_module("torch._inductor.runtime.triton_compat")
importlib.import_module("torch._inductor.compile_fx")

STUBBED = ("triton", "torchvision")


class Placeholder:
    """Any name of a stand-in module: calling it with one function (a decorator) returns the
    function, any other call or attribute or item gives another placeholder."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Placeholder(f"{self._name}()")

    def __getattr__(self, item: str) -> Placeholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return Placeholder(f"{self._name}.{item}")

    def __getitem__(self, item: Any) -> Placeholder:
        return Placeholder(f"{self._name}[]")

    def __or__(self, other: Any) -> Placeholder:
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class NoDriver:
    """``triton.runtime.driver``: there is no GPU driver, so any use raises."""

    def __getattr__(self, item: str) -> Any:
        raise RuntimeError("triton stand-in: no GPU driver on this machine")


def passthrough(fn: Callable[..., Any] | None = None, *args: Any,
                **kwargs: Any) -> Callable[..., Any]:
    """``@triton.jit``, ``@triton.jit(...)``, ``@triton.autotune(...)``: the function itself."""
    if callable(fn) and not args and not kwargs:
        return fn
    return lambda f: f


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class Config:
    """``triton.Config``: accepts and ignores its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _marker(name: str) -> type:
    """A real class where torch or SGLang uses ``isinstance`` against a triton class."""
    return type(name, (), {})


#: Names with a real value, per module (the rest are placeholders).
FIXED: dict[str, dict[str, Any]] = {
    "triton": {"__version__": "3.4.0", "jit": passthrough, "autotune": passthrough, "heuristics": passthrough,
               "cdiv": cdiv, "next_power_of_2": next_power_of_2, "Config": Config},
    "torchvision": {"__version__": "0.28.0"},
    "triton.language": {"constexpr": Placeholder("triton.language.constexpr")},
    "triton.runtime": {"driver": NoDriver()},
    "triton.runtime.jit": {"JITFunction": _marker("JITFunction"),
                           "KernelInterface": _marker("KernelInterface")},
    "triton.runtime.autotuner": {"Autotuner": _marker("Autotuner"),
                                 "Heuristics": _marker("Heuristics")},
}
FIXED["triton.runtime"].update(FIXED["triton.runtime.jit"])
FIXED["triton.runtime"].update(FIXED["triton.runtime.autotuner"])


class StandIn(types.ModuleType):
    """A stand-in module (a package: any submodule imports too); a missing name is a
    :class:`Placeholder`."""

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        return Placeholder(f"{self.__name__}.{item}")


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every import of the :data:`STUBBED` packages and their submodules."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return StandIn(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        for name, value in FIXED.get(module.__name__, {}).items():
            setattr(module, name, value)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` and import the stand-in packages with the
    submodules torch probes by attribute (idempotent)."""
    if any(isinstance(f, StandInFinder) for f in sys.meta_path):
        return
    for name in STUBBED:
        mod = sys.modules.get(name)
        if mod is not None and not isinstance(mod, StandIn):
            raise RuntimeError(f"{name} was imported before the CPU stand-ins")
    sys.meta_path.insert(0, StandInFinder())
    for name in ("triton.language", "triton.language.core", "triton.language.extra",
                 "triton.language.math", "triton.runtime.jit", "triton.runtime.autotuner",
                 "triton.runtime.cache", "triton.compiler.compiler", "triton.backends.compiler",
                 "triton.testing", "triton.tools", "triton._C.libtriton",
                 "torchvision.transforms.functional", "torchvision.transforms.v2.functional",
                 "torchvision.io", "torchvision.ops", "torchvision.models",
                 "torchvision.datasets", "torchvision.utils"):
        importlib.import_module(name)  # binds each submodule as its parent's attribute


install()
