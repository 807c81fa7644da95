"""Replay-side policies by name: the baselines (``marconi``, ``seglen``, ``belady``,
``belady_state``) and the experimental walks (``idea:*``) that the simulator runs as a state
walk on top of the library's ``gds`` policy.

Each is registered by the module that defines it (:func:`register`); the simulator only looks
names up here (:func:`get`, :func:`names`), and the defining modules are imported on the first
lookup (:data:`PROVIDERS`, then :data:`bench.dev.BASELINES` when the checkout has the developer
instruments), so the core never imports an experiment. A new baseline is one :class:`Baseline`
registered from its own module, plus its module name in :data:`PROVIDERS` (or
:data:`bench.dev.BASELINES`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.policies.strategies import NextUseIndex, StateStrategy
    from bench.traces.loader import TraceRequest

__all__ = ["PROVIDERS", "Baseline", "BaselineContext", "get", "names", "register"]

#: Modules that register baselines, imported on the first lookup.
PROVIDERS: tuple[str, ...] = ("bench.policies.strategies",)


@dataclass(frozen=True)
class BaselineContext:
    """What a baseline's walk may read: the trace, the engine's page size, the model preset's
    name, the prefill cost model and Marconi's fixed alpha (``None``: tuned live), and the
    offline next-use index (built on the first call, shared by the runs of one sweep)."""

    trace: Sequence[TraceRequest]
    page_size: int
    model: str
    cost_d: float
    cost_e: float
    marconi_alpha: float | None
    next_use: Callable[[], NextUseIndex]


@dataclass(frozen=True)
class Baseline:
    """A replay-side policy.

    Attributes:
        name: what ``--policy`` calls it.
        walk: context -> the ``is_candidate -> StateStrategy`` maker of its state walk.
        order_kv: ``(cache, walk)`` -> installs its KV-leaf order on the cache (after the
            cache is built), or ``None``: KV leaves keep the ``gds`` policy's LRU.
        offline: it reads the future (the next-use index): a reference, not a policy.
    """

    name: str
    walk: Callable[[BaselineContext], Callable[[Callable[[Any], bool]], StateStrategy]]
    order_kv: Callable[[Any, Any], None] | None = None
    offline: bool = False


_REGISTRY: dict[str, Baseline] = {}
_loaded = False


def register(baseline: Baseline) -> None:
    """Add ``baseline`` under its name.

    Raises:
        ValueError: the name is taken.
    """
    if baseline.name in _REGISTRY:
        raise ValueError(f"baseline {baseline.name!r} is registered twice")
    _REGISTRY[baseline.name] = baseline


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        modules = list(PROVIDERS)
        if importlib.util.find_spec("bench.dev") is not None:
            modules += importlib.import_module("bench.dev").BASELINES
        for module in modules:
            importlib.import_module(module)


def get(name: str) -> Baseline | None:
    """The baseline called ``name``, or ``None`` (a library policy)."""
    _load()
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered name, in registration order."""
    _load()
    return tuple(_REGISTRY)


def check(name: str, page_size: int = 1) -> None:
    """Refuse ``name`` unless it is a replay baseline or a radix policy, before any run.

    Raises:
        ValueError: the cache's message (which lists the radix policies) plus the baselines.
    """
    if get(name) is not None:
        return
    from radix import CacheConfig

    try:
        CacheConfig(page_size=page_size, radix_eviction_policy=name)
    except ValueError as exc:
        raise ValueError(f"{exc}; or a replay baseline: {', '.join(names())}") from None
