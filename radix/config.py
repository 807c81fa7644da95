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

from radix.policies import ResolvedPolicy, resolve_policy

_FIELDS = (
    "page_size",
    "radix_eviction_policy",
    "radix_eviction_policy_config",
    "sliding_window_size",
    "swa_release_extra_pages",
)

#: Default of ``CacheConfig.swa_release_extra_pages`` (see ``bench/README.md`` for the
#: measurement behind it).
SWA_RELEASE_EXTRA_PAGES = 0


@dataclass(frozen=True)
class CacheConfig:
    """Configuration of a :class:`radix.cache.RadixCache`.

    Args:
        page_size: tokens per page (>= 1). Keys are matched and stored in whole pages; a
            trailing partial page is never cached. Must equal the KV allocator's page size.
        radix_eviction_policy: a name from ``radix.policies.POLICY_REGISTRY`` or ``None``
            (resolved to ``"lru"``). ``"gds"`` is opt-in only.
        radix_eviction_policy_config: knobs of that policy (``POLICIES.md``), or ``None``.
        sliding_window_size: tokens an SWA layer attends to (>= 1), or ``None`` for a model
            without sliding-window layers. Needs an ``allocators.SWAAllocator`` as KV allocator.
        swa_release_extra_pages: pages a request keeps live, beyond ``max(sliding_window_size,
            page_size)`` tokens, before the boundary it releases SWA KV up to
            (``release_swa``): with one more page a later key that diverges inside the last
            cached page (or an engine matching a prompt minus its last token) still finds a
            whole window before its page-aligned match (default 1; 0 keeps exactly the window).

    Raises:
        TypeError / ValueError: naming the argument, on a bad page size, unknown policy name,
            unknown knob or bad knob value.
    """

    page_size: int = 1
    radix_eviction_policy: str | None = None
    radix_eviction_policy_config: Mapping[str, Any] | None = None
    sliding_window_size: int | None = None
    swa_release_extra_pages: int = SWA_RELEASE_EXTRA_PAGES
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
        object.__setattr__(
            self,
            "policy",
            resolve_policy(self.radix_eviction_policy, self.radix_eviction_policy_config),
        )

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

        ``radix_eviction_policy_config`` may be a dict or a JSON string there.
        """
        d: dict[str, Any] = {k: getattr(ns, k) for k in _FIELDS if getattr(ns, k, None) is not None}
        knobs = d.get("radix_eviction_policy_config")
        if isinstance(knobs, str):
            d["radix_eviction_policy_config"] = json.loads(knobs)
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "radix_eviction_policy": self.radix_eviction_policy,
            "radix_eviction_policy_config": dict(self.radix_eviction_policy_config or {}),
            "sliding_window_size": self.sliding_window_size,
            "swa_release_extra_pages": self.swa_release_extra_pages,
            "resolved_policy": self.policy.name,
            "resolved_knobs": dict(self.policy.knobs),
            "policy_explicit": self.policy_explicit,
        }
