"""Cache configuration with SGLang's argument names.

``radix_eviction_policy`` defaults to ``None`` and resolves to ``"lru"``; whether the user chose
a policy is kept apart from the value (``policy_explicit``), so a config built from keyword
arguments, a dict, a JSON string or an argparse namespace means the same thing.
Validation happens here, when the cache is **built**, never at the first eviction.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from components.eviction.registry import ResolvedPolicy, resolve_policy

_FIELDS = (
    "page_size",
    "radix_eviction_policy",
    "radix_eviction_policy_config",
    "sliding_window_size",
    "swa_release_extra_pages",
    "enable_kv_cache_events",
    "state_recency",
    "stateless_leaf",
    "match_recency",
)

#: Default of ``CacheConfig.swa_release_extra_pages`` (see ``bench/results/2026-12-02-swa-release-margin.md`` for the
#: measurement behind it).
SWA_RELEASE_EXTRA_PAGES = 0

#: ``state_recency`` values: which states a match or an insert refreshes in the state LRU.
STATE_RECENCY = ("consumed", "path")
#: ``stateless_leaf`` values: what becomes of an unlocked leaf left without a state.
STATELESS_LEAF = ("prune", "keep")
#: ``match_recency`` values: which matched nodes a match moves to most recently used.
MATCH_RECENCY = ("matched", "usable")


@dataclass(frozen=True)
class CacheConfig:
    """Configuration of a :class:`radix.cache.RadixCache`.

    Args:
        page_size: tokens per page (>= 1). Keys are matched and stored in whole pages; a
            trailing partial page is never cached. Must equal the KV allocator's page size.
        radix_eviction_policy: a name from ``components.eviction.registry.POLICY_REGISTRY`` or ``None``
            (resolved to ``"lru"``). ``"gds"`` is opt-in only.
        radix_eviction_policy_config: knobs of that policy (``components.eviction.registry``: each
            policy's knobs, defaults and checks), or ``None``.
        sliding_window_size: tokens an SWA layer attends to (>= 1), or ``None`` for a model
            without sliding-window layers. Needs an ``allocators.SWAAllocator`` as KV allocator.
        swa_release_extra_pages: pages a request keeps live, beyond ``max(sliding_window_size,
            page_size)`` tokens, before the boundary it releases SWA KV up to
            (``release_swa``): with one more page a later key that diverges inside the last
            cached page (or an engine matching a prompt minus its last token) still finds a
            whole window before its page-aligned match (default 0: exactly the window; ``bench/results/2026-12-02-swa-release-margin.md`` shows the measurement).
        enable_kv_cache_events: record KV events (``RadixCache.take_events``:
            ``components.events``), SGLang's name.
        state_recency: which recurrent states move to most recently used in the state LRU
            (policies whose state walk is ``"lru"``): ``"consumed"`` (default) the state a
            match ends at and the state an insert ends at, as SGLang 0.5.23's
            ``UnifiedRadixCache``; ``"path"`` every state on the matched or inserted path and
            the lower half of a split, as SGLang's ``MambaRadixCache`` (0.5.12 and before).
        stateless_leaf: what becomes of an unlocked leaf left with no state on device or on
            host (its state evicted, or its last child gone): ``"prune"`` (default) removes it
            at once, with the ancestors it leaves childless and stateless; ``"keep"`` keeps it
            as KV only (a match cannot end there) until a KV eviction frees it, as SGLang
            0.5.23 does. Without a recurrent-state component it changes nothing.
        match_recency: which nodes a match stamps as used (the KV order): ``"matched"``
            (default) every node the key's KV match passes; ``"usable"`` only the nodes up to
            where the match may end (the state rule and the window rule applied), as SGLang
            0.5.23's ``UnifiedRadixCache`` (a node split by the match is stamped either way).
            The same without a recurrent-state or sliding-window component.

    Raises:
        TypeError / ValueError: naming the argument, on a bad page size, unknown policy name,
            unknown knob or bad knob value, a bad option, ``state_recency="path"`` with a
            policy whose state walk is not the state LRU (``joint_lru``, the GDS family).
    """

    page_size: int = 1
    radix_eviction_policy: str | None = None
    radix_eviction_policy_config: Mapping[str, Any] | None = None
    sliding_window_size: int | None = None
    swa_release_extra_pages: int = SWA_RELEASE_EXTRA_PAGES
    enable_kv_cache_events: bool = False
    state_recency: str = "consumed"
    stateless_leaf: str = "prune"
    match_recency: str = "matched"
    policy: ResolvedPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ps = self.page_size
        if isinstance(ps, bool) or not isinstance(ps, int):
            raise TypeError(f"page_size must be an int >= 1, got {type(ps).__name__}")
        if ps < 1:
            raise ValueError(f"page_size must be an int >= 1, got {ps}")
        w = self.sliding_window_size
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, int):
                raise TypeError(f"sliding_window_size must be an int >= 1 or None, got {type(w).__name__}")
            if w < 1:
                raise ValueError(f"sliding_window_size must be an int >= 1 or None, got {w}")
        x = self.swa_release_extra_pages
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"swa_release_extra_pages must be an int >= 0, got {type(x).__name__}")
        if x < 0:
            raise ValueError(f"swa_release_extra_pages must be an int >= 0 [pages], got {x}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise TypeError(
                f"enable_kv_cache_events must be a bool, got {type(self.enable_kv_cache_events).__name__}"
            )
        knobs = self.radix_eviction_policy_config
        if isinstance(knobs, Mapping):  # (else resolve_policy refuses it below, naming it)
            # The config's own copy: a later change to the caller's dict would otherwise
            # show in to_dict() but not in the policy resolved here.
            object.__setattr__(self, "radix_eviction_policy_config", dict(knobs))
        _check_choice(self.state_recency, "state_recency", STATE_RECENCY)
        _check_choice(self.stateless_leaf, "stateless_leaf", STATELESS_LEAF)
        _check_choice(self.match_recency, "match_recency", MATCH_RECENCY)
        policy = resolve_policy(self.radix_eviction_policy, self.radix_eviction_policy_config)
        if self.state_recency == "path" and policy.state_walk != "lru":
            raise ValueError(
                f"state_recency='path' needs a policy whose states age in the state LRU; "
                f"{policy.name!r} orders states by {policy.state_walk!r}"
            )
        if policy.name == "unified" and self.sliding_window_size is not None:
            raise ValueError(
                "sliding_window_size is not supported with radix_eviction_policy='unified' "
                "(its byte order covers full-attention KV and recurrent states only)")
        object.__setattr__(self, "policy", policy)

    @property
    def policy_name(self) -> str:
        """The resolved policy name (``"lru"`` when none was chosen)."""
        return self.policy.name

    @property
    def policy_explicit(self) -> bool:
        """True when the user chose a policy, False when the default applies."""
        return self.radix_eviction_policy is not None

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CacheConfig:
        """Build from a mapping with SGLang's keys; unknown keys raise ``ValueError``."""
        if not isinstance(d, Mapping):
            raise TypeError(f"config must be a mapping, got {type(d).__name__}")
        unknown = set(d) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown cache config key(s) {sorted(unknown)}; accepted: {list(_FIELDS)}")
        return cls(**dict(d))

    @classmethod
    def from_json(cls, text: str) -> CacheConfig:
        """Build from a JSON object string (e.g. a config file or CLI flag)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config is not valid JSON: {exc}") from None
        return cls.from_dict(d)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> CacheConfig:
        """Build from an argparse namespace; absent attributes keep their defaults.

        ``radix_eviction_policy_config`` may be a dict or a JSON string there (not JSON:
        ``ValueError`` naming it).
        """
        d: dict[str, Any] = {k: getattr(ns, k) for k in _FIELDS if getattr(ns, k, None) is not None}
        knobs = d.get("radix_eviction_policy_config")
        if isinstance(knobs, str):
            try:
                d["radix_eviction_policy_config"] = json.loads(knobs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"radix_eviction_policy_config is not valid JSON ({exc}); "
                                 f"expected a JSON object of policy knobs, got {knobs!r}") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "radix_eviction_policy": self.radix_eviction_policy,
            "radix_eviction_policy_config": dict(self.radix_eviction_policy_config or {}),
            "sliding_window_size": self.sliding_window_size,
            "swa_release_extra_pages": self.swa_release_extra_pages,
            "enable_kv_cache_events": self.enable_kv_cache_events,
            "state_recency": self.state_recency,
            "stateless_leaf": self.stateless_leaf,
            "match_recency": self.match_recency,
            "resolved_policy": self.policy.name,
            "resolved_knobs": dict(self.policy.knobs),
            "policy_explicit": self.policy_explicit,
        }


def _check_choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {choices}; got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
