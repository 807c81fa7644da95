"""An SGLang-compatible front end: SGLang 0.5.23's prefix-cache interface over this library.

Mirrors the tree-cache interface of SGLang **0.5.23** (``sglang.srt.mem_cache``:
``base_prefix_cache``, ``cache_init_params``, ``radix_cache``, ``unified_radix_cache``, the
scheduler's calls in ``common`` and ``session/streaming_session``) so that a scheduler written
against it can hold this cache as its tree cache. It imports nothing from SGLang. One
library ``RadixCache`` answers every call; this package only translates names, units and
call shapes:

* ``UnifiedRadixCache(CacheInitParams(...))`` / ``RadixCache`` (full KV only) /
  ``create_simulated(...)`` (no pools); the variant follows the pools given: KV only,
  KV + Mamba state (``req_to_token_pool.mamba_pool``), SWA (``sliding_window_size``),
  HiCache (``hicache``), and ``disable``.
* predicates ``supports_mamba`` / ``supports_swa`` / ``supports_prefix_sharing`` /
  ``is_tree_cache``...; ``MatchPrefixParams`` / ``InsertParams`` / ``EvictParams`` in,
  ``MatchResult`` (``device_prefix_len``, ``best_match_node``, ``mamba_branching_seqlen``,
  ``cache_protected_len``, ``full_kv_hit_length``...) / ``InsertResult`` (``mamba_exist``)
  / ``EvictResult`` (``num_tokens_evicted``, ``swa_num_tokens_evicted``,
  ``mamba_num_evicted``) / ``IncLockRefResult`` / ``TreeLock`` out.
* ``checkpoint(req, up_to=)``, ``release_kv_cache(req, checkpoint=)``, ``free_kv_row``
  over ``req_to_token_pool`` (0.5.23), and the names of SGLang's earlier releases
  ``cache_unfinished_req(req, chunked=False)`` / ``cache_finished_req(req, is_insert=True)``.
* a request's session (``MatchPrefixParams.req.session_id``, ``InsertParams.session_id``,
  which ``checkpoint`` fills from the request) goes to the library as its hint
  (``radix.hints``: ``extra={"session_id": ...}``, which ``gds_adaptive`` reads).
* list-like :class:`RadixKey`, SGLang-shaped :class:`TreeNode` views, ``take_events()``
  (the library's KV events), streaming sessions (``enable_streaming_session``).
* ``evict_policy`` (SGLang's eviction-strategy classes, ordering as the library's policies),
  ``common.available_and_evictable_str``, and SGLang 0.5.12's class names ``MambaRadixCache``
  / ``SWARadixCache`` (aliases of ``UnifiedRadixCache``).

What the engine provides: a duck-typed ``Req`` (``radix.sglang.requests.Req`` lists the
attributes read and written) and a ``req_to_token_pool``
(``radix.sglang.requests.ReqToTokenPool``), plus the library's allocators.

Where it differs from SGLang 0.5.23, by design or for want of the engine around it:

* node handles are node views, not node ids (``resolve_node_handle`` accepts both);
* the state rules default to SGLang's (``state_recency="consumed"``,
  ``stateless_leaf="keep"``); the library's own default for the second is ``"prune"``;
* ``cow_mamba`` copies the state at match time (no forward stream to defer it to);
* ``MatchResult.device_indices`` (the field of SGLang's earlier releases) is filled;
* the hash chain of KV events and ``hash_value`` is the library's L3 chain;
* not modelled: EAGLE bigram keys, the Mamba extra (ping-pong) buffer, tensor/pipeline
  parallel groups, the external linker, LMCache / FlexKV, the session radix cache's
  session-tagged eviction, retraction backups; eviction follows the library's policies.
"""

from __future__ import annotations

from radix.sglang.cache import RadixCache, UnifiedRadixCache
from radix.sglang.key import RadixKey
from radix.sglang.node import TreeNode
from radix.sglang.params import (
    CacheInitParams,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from radix.sglang.requests import Req, ReqKvInfo, ReqToTokenPool

#: The SGLang release whose interface this package mirrors.
SGLANG_VERSION = "0.5.23"

#: SGLang 0.5.12's class names for the hybrid caches the unified cache replaced.
MambaRadixCache = UnifiedRadixCache
SWARadixCache = UnifiedRadixCache

__all__ = [
    "SGLANG_VERSION",
    "CacheInitParams",
    "DecLockRefParams",
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "IncLockRefResult",
    "InitLoadBackParams",
    "InsertParams",
    "InsertResult",
    "MambaRadixCache",
    "MatchPrefixParams",
    "MatchResult",
    "RadixCache",
    "RadixKey",
    "Req",
    "ReqKvInfo",
    "ReqToTokenPool",
    "SWARadixCache",
    "TreeLock",
    "TreeNode",
    "UnifiedRadixCache",
]
