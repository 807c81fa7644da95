"""Radix eviction policies: a registry of small key functions, chosen by name.

A policy maps a node to a sort key; the **smaller key is evicted first**. Each policy's
semantics are the ``doc`` of its entry in ``POLICY_REGISTRY`` and its key function below.
Each policy also says which walk its recurrent-state component uses (``lru`` on the state's own
access stamp, or GreedyDual-Size) and whether its key can *decrease* when a node is touched
(a lazy heap is only sound when it cannot; the KV index here is a sorted structure, so every
policy is exact either way, but the flag is kept for readers and for alternative indexes).

Adding a policy is adding one ``PolicySpec`` entry to ``POLICY_REGISTRY``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radix.node import TreeNode

KeyFn = Callable[["TreeNode"], tuple[Any, ...]]

#: GreedyDual-Size cost coefficients ``cost(a, b) = d*(b - a) + e*(b*b - a*a)/2e5``
#: (``components.eviction.gds``), fitted on GLM prefill timings as in the FlashState paper.
GDS_DEFAULT_D = 1.862e-5
GDS_DEFAULT_E = 3.33e-6


@dataclass(frozen=True)
class Knob:
    """One policy knob: its default and a validator returning an error string or ``None``."""

    default: Any
    check: Callable[[Any], str | None]
    doc: str


@dataclass(frozen=True)
class PolicySpec:
    name: str
    make_key: Callable[[Mapping[str, Any]], KeyFn]
    state_walk: str  # "lru" (state stamps), "joint" (node stamps), "gds", "gdsf", ...
    key_can_decrease: bool
    knobs: Mapping[str, Knob] = field(default_factory=dict)
    cross_check: Callable[[Mapping[str, Any]], str | None] | None = None
    doc: str = ""


@dataclass(frozen=True)
class ResolvedPolicy:
    """A validated policy: the name, its knob values (defaults filled in) and its key."""

    name: str
    knobs: Mapping[str, Any]
    kv_key: KeyFn
    state_walk: str
    key_can_decrease: bool


def _finite_nonneg(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a real number, got {type(v).__name__}"
    try:  # (an int past the float range cannot enter the float arithmetic that reads it)
        finite = math.isfinite(v)
    except OverflowError:
        finite = False
    if not finite or v < 0:
        return f"must be finite and >= 0, got {v!r}"
    return None


def _int_at_least(lo: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"must be an int, got {type(v).__name__}"
        if v < lo:
            return f"must be >= {lo}, got {v}"
        return None

    return check


def _gds_cross(k: Mapping[str, Any]) -> str | None:
    if k["d"] == 0 and k["e"] == 0:
        return "'d' and 'e' must not both be 0 (the GDS cost would be 0 for every state)"
    return None


def _tlru_cross(k: Mapping[str, Any]) -> str | None:
    if not k["threshold"] > k["next_prompt_estimate"]:
        return (
            f"'threshold' ({k['threshold']}) must be > 'next_prompt_estimate' "
            f"({k['next_prompt_estimate']})"
        )
    return None


def _lru(_: Mapping[str, Any]) -> KeyFn:
    return lambda n: (n.last_access_time,)


def _lfu(_: Mapping[str, Any]) -> KeyFn:
    return lambda n: (n.hit_count, n.last_access_time)


def _slru(k: Mapping[str, Any]) -> KeyFn:
    t = k["protected_threshold"]
    return lambda n: (1 if n.hit_count >= t else 0, n.last_access_time)


def _priority(_: Mapping[str, Any]) -> KeyFn:
    return lambda n: (n.priority, n.last_access_time)


def _fifo(_: Mapping[str, Any]) -> KeyFn:
    return lambda n: (n.creation_time,)


def _mru(_: Mapping[str, Any]) -> KeyFn:
    return lambda n: (-n.last_access_time,)


def _filo(_: Mapping[str, Any]) -> KeyFn:
    return lambda n: (-n.creation_time,)


def _tlru(k: Mapping[str, Any]) -> KeyFn:
    budget_extra = k["next_prompt_estimate"] - k["threshold"]

    def key(n: TreeNode) -> tuple[Any, ...]:
        # Tail-safe: the depth above the node already covers the budget, so a returning
        # conversation still finds threshold - next_prompt_estimate tokens without it.
        budget = max(n.history_len + budget_extra, 0)
        return (-1 if n.start >= budget else 0, n.last_access_time)

    return key


_D = {
    "d": Knob(GDS_DEFAULT_D, _finite_nonneg, "linear prefill cost per token"),
    "e": Knob(GDS_DEFAULT_E, _finite_nonneg, "quadratic (attention) cost coefficient"),
}

POLICY_REGISTRY: dict[str, PolicySpec] = {
    s.name: s
    for s in (
        PolicySpec("lru", _lru, "lru", False, doc="least recent last_access_time first"),
        PolicySpec("lfu", _lfu, "lru", False, doc="fewest hits, then LRU"),
        PolicySpec(
            "slru",
            _slru,
            "lru",
            False,
            {"protected_threshold": Knob(2, _int_at_least(1), "hits to enter the protected segment")},
            doc="segmented LRU: probation (hit once) before protected (hit again)",
        ),
        PolicySpec("priority", _priority, "lru", False, doc="lowest priority first, then LRU"),
        PolicySpec(
            "tlru",
            _tlru,
            "lru",
            True,
            {
                "threshold": Knob(None, _finite_nonneg, "tokens a returning prompt should still find"),
                "next_prompt_estimate": Knob(0, _finite_nonneg, "expected next prompt growth"),
            },
            cross_check=_tlru_cross,
            doc="tail-optimized LRU (arXiv 2510.15152)",
        ),
        PolicySpec(
            "joint_lru",
            _lru,
            "joint",
            False,
            doc="one recency order (node last_access_time) over KV leaves and states",
        ),
        PolicySpec("gds", _lru, "gds", False, _D, cross_check=_gds_cross,
                   doc="GreedyDual-Size on recurrent states (FlashState); LRU on KV leaves"),
        PolicySpec("gdsf", _lru, "gdsf", False, _D, cross_check=_gds_cross,
                   doc="GreedyDual-Size-Frequency on recurrent states: GDS with the cost x "
                       "(1 + the state's hit count); LRU on KV leaves"),
        PolicySpec("gds_adaptive", _lru, "gds_adaptive", False, _D, cross_check=_gds_cross,
                   doc="GDS with learned reuse weights on recurrent states "
                       "(components.eviction.adaptive); LRU on KV leaves"),
        PolicySpec("unified", _lru, "gds", False, _D, cross_check=_gds_cross,
                   doc="one GreedyDual-Size order per byte freed over KV leaves and recurrent "
                       "states (components.eviction.unified): what a memory arena evicts when "
                       "short (RadixCache.evict_bytes); hybrid caches without SWA or host tier"),
        PolicySpec("fifo", _fifo, "lru", False, doc="oldest creation_time first"),
        PolicySpec("mru", _mru, "lru", True, doc="most recent first"),
        PolicySpec("filo", _filo, "lru", True, doc="newest creation_time first"),
    )
}


def resolve_policy(name: str | None, config: Mapping[str, Any] | None) -> ResolvedPolicy:
    """Validate a policy name and its knobs; fill defaults.

    Args:
        name: a key of ``POLICY_REGISTRY``, or ``None`` for the default ``"lru"``.
        config: knob name -> value, or ``None``.

    Raises:
        TypeError: ``name`` not a str, ``config`` not a mapping.
        ValueError: unknown name, unknown knob, missing required knob, bad value; the message
            names the knob and the accepted values.
    """
    if name is None:
        name = "lru"
    if not isinstance(name, str):
        raise TypeError(f"radix_eviction_policy must be a str, got {type(name).__name__}")
    spec = POLICY_REGISTRY.get(name)
    if spec is None:
        raise ValueError(
            f"radix_eviction_policy={name!r} is unknown; expected one of {sorted(POLICY_REGISTRY)}"
        )
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(
            f"radix_eviction_policy_config must be a dict or None, got {type(config).__name__}"
        )
    unknown = set(config) - set(spec.knobs)
    if unknown:
        accepted = sorted(spec.knobs) or "no knobs"
        raise ValueError(
            f"radix_eviction_policy_config has unknown knob(s) {sorted(unknown)} for "
            f"policy {name!r}; accepted: {accepted}"
        )
    knobs: dict[str, Any] = {}
    for kname, knob in spec.knobs.items():
        value = config.get(kname, knob.default)
        if value is None:
            raise ValueError(f"radix_eviction_policy_config[{kname!r}] is required for {name!r}")
        err = knob.check(value)
        if err:
            raise ValueError(f"radix_eviction_policy_config[{kname!r}] for {name!r} {err}")
        knobs[kname] = value
    if spec.cross_check is not None:
        err = spec.cross_check(knobs)
        if err:
            raise ValueError(f"radix_eviction_policy_config for {name!r}: {err}")
    return ResolvedPolicy(name, knobs, spec.make_key(knobs), spec.state_walk, spec.key_can_decrease)
