"""SGLang's parameter and result objects of the prefix-cache interface, field for field.

Field names, defaults and units are SGLang 0.5.23's (``sglang.srt.mem_cache.base_prefix_cache``
and ``cache_init_params``): lengths in tokens, ``mamba_*`` counts in state slots, a
``mamba_value`` a 1-element int64 tensor of a state slot. Fields of SGLang's that this front
end has nothing behind (tensor-parallel groups, draft pools, DSV4 sidecars, the external
linker) are left out; a caller passing one gets Python's ``TypeError`` for an unknown
keyword. Additions are marked *(this library)*.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from hicache import HiCacheConfig
    from radix.sglang.key import RadixKey


@dataclasses.dataclass
class CacheInitParams:
    """What a prefix cache is built from (SGLang's ``CacheInitParams``).

    Attributes:
        disable: no prefix sharing: matches miss, inserts keep nothing, nothing is evicted
            (SGLang's ``--disable-radix-cache``).
        req_to_token_pool: the engine's ``req_to_token`` table
            (:class:`radix.sglang.requests.ReqToTokenPool` or one with the same
            ``req_to_token`` / ``write`` / ``free``); its ``mamba_pool`` (a
            ``allocators.MambaStatePool``) makes the cache hybrid (KV + recurrent state).
            ``None``: a simulated cache (``create_simulated``) or one driven through
            ``insert`` / ``match_prefix`` only.
        token_to_kv_pool_allocator: KV slots (``allocators.TokenAllocator``,
            ``PagedAllocator``, ``SWAAllocator``); ``None`` for a simulated cache.
        page_size: tokens per page.
        is_eagle: EAGLE bigram keys; refused (this library keys tokens, not bigrams).
        eviction_policy: ``radix_eviction_policy`` (``lru`` default; every policy of
            ``components.eviction.registry``).
        eviction_policy_config: its knobs.
        enable_kv_cache_events: record KV events (``take_events``).
        enable_mamba_extra_buffer: refused (the ping-pong track buffer is not modelled).
        sliding_window_size: tokens an SWA layer attends to; needs an ``SWAAllocator``.
        hicache: *(this library)* the host tier (``hicache.HiCacheConfig``); SGLang reads it
            from its server arguments.
        enable_streaming_session: *(this library)* keep streaming sessions' KV records and
            recurrent state between turns (:mod:`radix.sglang.session`).
        state_recency / stateless_leaf / match_recency: *(this library)* ``CacheConfig``'s
            options; the defaults are SGLang 0.5.23's rules (``"consumed"``, ``"keep"``,
            ``"usable"``).
        kv_event_lora_names: namespace -> adapter name in the KV events.
    """

    disable: bool
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int
    is_eagle: bool = False
    eviction_policy: str = "lru"
    eviction_policy_config: Mapping[str, Any] | None = None
    enable_kv_cache_events: bool = False
    enable_mamba_extra_buffer: bool = False
    sliding_window_size: int | None = None
    hicache: HiCacheConfig | None = None
    enable_streaming_session: bool = False
    state_recency: str = "consumed"
    stateless_leaf: str = "keep"
    match_recency: str = "usable"
    kv_event_lora_names: Mapping[Any, str] | None = None


@dataclasses.dataclass
class MatchPrefixParams:
    """``match_prefix``'s arguments: the key, and for a hybrid cache the request whose own
    state slot receives a copy of the matched state (``cow_mamba``)."""

    key: RadixKey
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass
class InsertParams:
    """``insert``'s arguments.

    Attributes:
        key / value: the tokens and their KV slots (``None``: the token ids themselves, a
            test fallback of SGLang's).
        mamba_value: ``tensor([slot])``, the state valid at the key's end (hybrid caches).
        prev_prefix_len: the caller's slots below this already belong to the tree; the
            unified cache frees the caller's duplicates in ``[prev_prefix_len, prefix_len)``.
        swa_branching_seqlen: accepted, unused (the SWA component plans its own cuts).
        inserted_len: the request already counted in ``hit_count`` up to here.
        priority: request priority (``priority`` policy).
        session_id: the request's session, handed to the library as its hint
            (``radix.hints``: ``gds_adaptive`` reads it); ``str`` or ``int``.
    """

    key: RadixKey | None = None
    value: torch.Tensor | None = None
    mamba_value: torch.Tensor | None = None
    prev_prefix_len: int = 0
    swa_branching_seqlen: int | None = None
    inserted_len: int = 0
    priority: int = 0
    session_id: str | None = None


@dataclasses.dataclass
class InsertResult:
    """``insert``'s result.

    Attributes:
        prefix_len: leading tokens already cached [tokens].
        total_len: tokens of the key now in the tree *(filled here; SGLang leaves 0)*.
        last_device_node: the node ending at the inserted key.
        mamba_exist: the key's end already had a state: ``mamba_value`` was not taken (the
            caller frees it).
    """

    prefix_len: int
    total_len: int = 0
    last_device_node: Any = None
    mamba_exist: bool = False
    swa_branch_inserted: bool = False


@dataclasses.dataclass
class EvictParams:
    """``evict``'s targets: full KV tokens, SWA KV tokens, recurrent states [slots]."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    """What ``evict`` freed: full KV tokens, SWA KV tokens, states [slots]."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclasses.dataclass
class IncLockRefResult:
    """``inc_lock_ref``'s receipt: ``delta`` the change of ``evictable_size`` [tokens];
    ``lock`` *(this library)* the library's lock token, replayed by ``dec_lock_ref``."""

    delta: int | None = None
    node_id: int | None = None
    lock: Any = None

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(node_id=self.node_id, lock=self.lock)


@dataclasses.dataclass
class DecLockRefParams:
    """``dec_lock_ref``'s receipt (from ``IncLockRefResult.to_dec_params``)."""

    node_id: int | None = None
    lock: Any = None


@dataclasses.dataclass
class DecLockRefResult:
    """``dec_lock_ref``'s result: the change of ``evictable_size`` [tokens]."""

    delta: int | None = None


@dataclasses.dataclass
class TreeLock:
    """A lock for one holder (``lock`` / ``unlock``): the node and the receipt."""

    node: Any
    receipt: DecLockRefParams
    swa_released: bool = False


@dataclasses.dataclass
class InitLoadBackParams:
    """``init_load_back``'s arguments (HiCache)."""

    best_match_node: Any
    host_hit_length: int
    mem_quota: int | None = None
    req: Any = None


class MatchResult(NamedTuple):
    """``match_prefix``'s result, SGLang 0.5.23's fields in order, then one addition.

    Attributes:
        device_prefix_len: the usable prefix on device [tokens].
        last_device_node: the node it ends at (lock it while the request uses it).
        last_host_node / best_match_node: with HiCache, the deepest node usable after a
            load-back (``init_load_back`` starts there); ``last_device_node`` otherwise.
        host_hit_length: tokens a load-back would add.
        swa_host_hit_length / mamba_host_hit_length: SWA tokens / states a load-back adds
            (``mamba_host_hit_length`` 1 when the state at ``best_match_node`` is on host).
        swa_branching_seqlen: where the key left a live SWA window past the usable prefix.
        mamba_branching_seqlen: where the key leaves the tree past the usable prefix, so
            the request checkpoints its state there (hybrid caches).
        cache_protected_len: the prefix a streaming session already holds (its matches).
        full_kv_hit_length: the longest prefix with full KV (device or host) [tokens].
        device_indices: *(SGLang before 0.5.23, and this library)* the matched KV slots,
            ``len == device_prefix_len``; 0.5.23 reads them from ``path_device_indices``.
    """

    device_prefix_len: int
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
    full_kv_hit_length: int = 0
    cache_actions: tuple[Any, ...] = ()
    last_visited_node_id: int | None = None
    full_device_match_len: int | None = None
    device_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
