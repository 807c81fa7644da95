"""The SGLang-shaped prefix cache: SGLang 0.5.23's tree-cache interface over one RadixCache.

    scheduler (SGLang's calls)          this front end                library (RadixCache)
    --------------------------          --------------                --------------------
    match_prefix(MatchPrefixParams) --> key -> tokens + namespace --> match_prefix
                                    <-- MatchResult(device_prefix_len, last_device_node, ...)
    lock(node) / unlock(lock)       --> TreeLock(receipt = the library's lock token)
    insert(InsertParams)            --> mamba_value -> state_slot --> insert
                                        frees the caller's duplicates in [prev_prefix_len,
                                        prefix_len) (the unified cache's rule)
    evict(EvictParams)              --> one walk per target (KV, SWA, states) --> evict*
    checkpoint / release_kv_cache   --> radix.sglang.requests (req_to_token rows)

Every answer comes from the one library tree; this layer only translates names, units and
call shapes. Node handles are :class:`radix.sglang.node.TreeNode` views (SGLang 0.5.23's
unified cache hands out node ids; ``resolve_node_handle`` accepts both a view and an id).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

from components.eviction.gds import GDS_WALKS
from hicache.storage.keys import chain_seed, page_hashes
from radix.cache import RadixCache as LibraryCache
from radix.checks import check_count
from radix.config import CacheConfig
from radix.node import TreeNode as LibNode
from radix.sglang import requests, session
from radix.sglang.key import RadixKey, as_radix_key
from radix.sglang.node import NodeViews, TreeNode
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
from radix.sglang.simulated import SimulatedAllocator

_EMPTY = torch.empty(0, dtype=torch.int64)

#: Slot dtypes an engine may pass as ``InsertParams.value`` (read as int64).
_SLOT_DTYPES = (torch.int32, torch.int64)


def session_hint(session_id: Any, name: str) -> dict[str, Any] | None:
    """The library's hint (``radix.hints``) for a request's session: ``{"session_id": ...}``,
    or ``None`` without one.

    Raises:
        TypeError: ``session_id`` not a ``str`` / ``int`` (``bool`` refused), naming ``name``.
    """
    if session_id is None:
        return None
    if isinstance(session_id, bool) or not isinstance(session_id, (str, int)):
        raise TypeError(f"{name} must be a str or an int (the request's session), got "
                        f"{type(session_id).__name__}")
    return {"session_id": session_id}


class UnifiedRadixCache:
    """SGLang 0.5.23's ``UnifiedRadixCache`` interface over the library's tree.

    The variant follows what it is given, as SGLang's component list does: full KV always;
    recurrent state (``supports_mamba``) when ``req_to_token_pool.mamba_pool`` is a state
    pool; SWA (``supports_swa``) with ``sliding_window_size``; the host tier with
    ``params.hicache``.

    Args:
        params: :class:`~radix.sglang.params.CacheInitParams`.

    Raises:
        TypeError / ValueError: a bad parameter (the library's messages), EAGLE bigram keys,
            the Mamba extra buffer, ``page_size > 1`` with a state pool (as SGLang 0.5.23), or a GreedyDual-Size policy together with streaming
            sessions on a model with recurrent state (a session resumes from the state it
            holds outside the tree, which GDS's costs and stamps never see).
    """

    #: SGLang's ``insert`` of the unified cache frees the caller's duplicate slots.
    frees_duplicates = True

    def __init__(self, params: CacheInitParams, *, simulated: bool | None = None) -> None:
        """``simulated``: no pools (``create_simulated``); default: when
        ``token_to_kv_pool_allocator`` is ``None``."""
        if not isinstance(params, CacheInitParams):
            raise TypeError(f"params must be a CacheInitParams, got {type(params).__name__}")
        if params.is_eagle:
            raise ValueError("is_eagle=True: EAGLE bigram keys are not supported")
        if params.enable_mamba_extra_buffer:
            raise ValueError("enable_mamba_extra_buffer=True: the ping-pong track buffer is "
                             "not supported (states are checkpointed at the insert's end)")
        self.disable = bool(params.disable)
        self.req_to_token_pool = params.req_to_token_pool
        self.page_size = params.page_size
        self.params = params
        alloc = params.token_to_kv_pool_allocator
        self.simulated = alloc is None if simulated is None else bool(simulated)
        offset = 0
        if self.simulated:
            alloc = SimulatedAllocator(params.page_size, alloc)
            offset = params.page_size
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        state_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
        if state_pool is not None and params.page_size != 1:
            # A state is valid after the request's last token; at page > 1 the tree keeps
            # only whole pages, so the node a state would land on ends before it. SGLang
            # 0.5.23 refuses this combination too.
            raise ValueError(
                f"page_size={params.page_size} with a recurrent-state pool "
                "(req_to_token_pool.mamba_pool): a hybrid cache needs page_size=1 (a state sits "
                "at the request's last token, which a page > 1 may end past)")
        policy = "lru" if self.disable else params.eviction_policy
        config = CacheConfig(
            page_size=params.page_size,
            radix_eviction_policy=policy,
            radix_eviction_policy_config=None if self.disable else params.eviction_policy_config,
            sliding_window_size=params.sliding_window_size,
            enable_kv_cache_events=bool(params.enable_kv_cache_events) and not self.disable,
            state_recency=params.state_recency,
            stateless_leaf=params.stateless_leaf,
            match_recency=params.match_recency,
        )
        if (params.enable_streaming_session and state_pool is not None
                and config.policy.state_walk in GDS_WALKS):
            raise ValueError(
                f"eviction_policy={policy!r} with enable_streaming_session on a model with "
                "recurrent state: a streaming session resumes from the state it holds outside "
                "the tree, so GreedyDual-Size would price and age the tree's states on resumes "
                "it never sees; use lru with sessions, or no sessions")
        self.eviction_policy = config.policy.name
        self.sliding_window_size = params.sliding_window_size
        self.enable_kv_cache_events = bool(params.enable_kv_cache_events)
        self.cache = LibraryCache(config, kv_allocator=alloc, state_allocator=state_pool,
                                  hicache=params.hicache)
        if self.cache.kv_events is not None and params.kv_event_lora_names:
            self.cache.kv_events.lora_names = dict(params.kv_event_lora_names)
        #: The KV slot allocator the tree frees into (the engine's, or the simulated one).
        self.slot_allocator = alloc
        #: The recurrent-state pool (``req_to_token_pool.mamba_pool``), or ``None``.
        self.state_pool = state_pool
        self.device = self.cache.device
        self.views = NodeViews(params.page_size, offset, self._page_hashes,
                               self.cache.device_slots)
        self.session = session.StreamingSessions(self) if params.enable_streaming_session else None
        self.cache_controller = None
        self.metrics_collector = None

    @classmethod
    def create_simulated(cls, disable: bool = False, mock_allocator: Any = None,
                         page_size: int = 1, enable_kv_cache_events: bool = False,
                         **kwargs: Any) -> UnifiedRadixCache:
        """A cache without memory pools: values are opaque ints >= 0 (a ``mock_allocator``,
        when given, sees every ``free``)."""
        return cls(CacheInitParams(disable=disable, req_to_token_pool=None,
                                   token_to_kv_pool_allocator=mock_allocator,
                                   page_size=page_size,
                                   enable_kv_cache_events=enable_kv_cache_events, **kwargs),
                   simulated=True)

    # ================================================================ predicates
    def supports_mamba(self) -> bool:
        return self.cache.hybrid

    def supports_swa(self) -> bool:
        return self.cache.has_swa

    def supports_auxiliary_swa(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def supports_fast_match_prefix(self) -> bool:
        return False

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    # ================================================================ nodes
    @property
    def root_node(self) -> TreeNode:
        return self.views.get(self.cache.root)

    def root_node_handle(self, extra_key: Any = None) -> TreeNode:
        return self.root_node

    def resolve_node_handle(self, node_handle: Any, name: str = "node") -> TreeNode:
        """A view, or a node id of this cache, -> the view.

        Raises:
            TypeError: neither a ``TreeNode`` nor an int id (``name`` says which argument).
            ValueError: an id not in the tree.
        """
        if isinstance(node_handle, TreeNode):
            return node_handle
        if isinstance(node_handle, bool) or not isinstance(node_handle, int):
            raise TypeError(f"{name} must be a TreeNode this cache handed out or a node id "
                            f"(int), got {type(node_handle).__name__}")
        for n in [self.cache.root, *self.cache.tree.iter_nodes()]:
            if n.id == node_handle:
                return self.views.get(n)
        raise ValueError(f"{name}: no node with id {node_handle} in this cache")

    def check_node(self, node: Any, name: str) -> None:
        """Raise as :meth:`lib_node` unless ``node`` is a node of this cache or a streaming
        session's stand-in."""
        if not session.is_virtual_node(node):
            self.lib_node(node, name)

    def is_root(self, node: Any) -> bool:
        return self.lib_node(node) is self.cache.root

    def lib_node(self, node: Any, name: str = "node") -> LibNode:
        """The library node behind a handle (a view or an id).

        Raises:
            TypeError: not a node of a cache (a hand-built ``TreeNode``, another object).
            ValueError: an id not in the tree, or a node of another cache.
        """
        view = self.resolve_node_handle(node, name)
        lib = view.library_node
        if lib is None:
            raise TypeError(f"{name} must be a node this cache handed out, not a TreeNode built "
                            "by hand")
        if not self.cache.holds(lib):
            raise ValueError(f"{name} (node {lib.id}) is not in this cache (removed, reset, or "
                             "another cache's)")
        return lib

    def _page_hashes(self, node: LibNode) -> list[str]:
        seed = chain_seed("", node.extra_key)
        if seed is None:
            return []
        path = list(reversed(node.path_to_root()))
        prev = seed
        out: list[bytes] = []
        for n in path:
            out = page_hashes(prev, n.key, self.page_size)
            prev = out[-1] if out else prev
        return [h.hex() for h in out]

    # ================================================================ matching
    def _empty_match(self) -> MatchResult:
        root = self.root_node
        return MatchResult(0, root, root, root, device_indices=_EMPTY)

    def match_prefix(self, params: MatchPrefixParams | RadixKey | Sequence[int]) -> MatchResult:
        """Longest usable prefix of ``params.key`` (a ``RadixKey`` or token ids are accepted
        for ``params``); with ``cow_mamba`` the matched state is copied into
        ``params.req``'s own state slot (allocated, evicting one state when the pool is
        empty). The copy is done here: there is no forward stream to defer it to."""
        if not isinstance(params, MatchPrefixParams):
            params = MatchPrefixParams(key=as_radix_key(params))
        if params.cow_mamba and self.cache.hybrid and not isinstance(
                getattr(params.req, "kv", None), requests.ReqKvInfo):
            raise TypeError("cow_mamba=True needs params.req: the request (with its kv record) "
                            f"whose state slot receives the copy, got {type(params.req).__name__}")
        if self.session is not None:
            lent = self.session.try_match_prefix(params)
            if lent is not None:
                return lent
        key = as_radix_key(params.key)
        if self.disable or len(key) == 0:
            return self._empty_match()
        hint = (None if params.req is None
                else session_hint(getattr(params.req, "session_id", None),
                                  "params.req.session_id"))
        m = self.cache.match_prefix(key.tokens(), key.namespace, extra=hint)
        views = self.views
        last = views.get(m.last_device_node)
        host_node = m.last_host_node if m.last_host_node is not None else m.last_device_node
        best = views.get(host_node)
        result = MatchResult(
            device_prefix_len=m.prefix_len, last_device_node=last, last_host_node=best,
            best_match_node=best, host_hit_length=m.host_hit_length,
            swa_host_hit_length=m.swa_host_hit_length,
            mamba_host_hit_length=m.state_host_hit_length,
            mamba_branching_seqlen=m.branching_seqlen if self.cache.hybrid else None,
            full_kv_hit_length=m.kv_hit_length,
            device_indices=cast("torch.Tensor", views.out_slots(m.device_indices)))
        if params.cow_mamba and m.state_slot is not None:
            requests.copy_matched_state(self, params.req, m.last_device_node, m.state_slot)
        return result

    def touch_prefix(self, key: RadixKey) -> None:
        """Refresh recency along ``key``'s cached path (a match whose answer is dropped)."""
        key = as_radix_key(key)
        if not self.disable and len(key):
            self.cache.match_prefix(key.tokens(), key.namespace)

    def path_device_indices(self, node: Any) -> torch.Tensor:
        """The device KV slots on the path from the root to ``node``."""
        return cast("torch.Tensor", self.views.out_slots(self.cache.path_slots(self.lib_node(node))))

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        return self.path_device_indices(req.last_node)[: req.prefix_len]

    # ================================================================ inserting
    def insert(self, params: InsertParams | RadixKey | Sequence[int],
               value: torch.Tensor | None = None) -> Any:
        """Insert ``params.key`` with KV slots ``params.value`` (and ``mamba_value``).

        Two call shapes: ``insert(InsertParams(...)) -> InsertResult`` (SGLang 0.5.23) and
        ``insert(key, value) -> prefix_len`` (SGLang's releases before the params
        objects). The key is cut to whole pages and ``value`` to the key; ``value=None``
        uses the token ids as slots (SGLang's test fallback; simulated caches). The caller's
        slots in ``[prev_prefix_len, prefix_len)`` that the tree already holds are freed
        here (the unified cache's rule); ``mamba_exist`` says the state was not taken.

        Raises:
            TypeError / ValueError: the library's checks (slots not handed out by the
                allocator, a missing state on a hybrid cache, ...); nothing changed.
        """
        legacy = not isinstance(params, InsertParams)
        if legacy:
            params = InsertParams(key=as_radix_key(params), value=value)
        assert isinstance(params, InsertParams)
        res = self.insert_keeping(params, False, self.frees_duplicates)
        return res.prefix_len if legacy else res

    def insert_keeping(self, params: InsertParams, keep_live_swa: bool,
                       free_duplicates: bool = True) -> InsertResult:
        """:meth:`insert` (its ``InsertParams`` shape); with ``keep_live_swa`` a running
        request's live SWA copies over tombstones are not freed as duplicates (the library's
        ``RadixCache.swa_kept_mask``): ``radix.sglang.requests`` checkpoints through it.
        ``free_duplicates``: free the caller's duplicates in ``[prev_prefix_len, prefix_len)``
        (a checkpoint always does, as SGLang's ``checkpoint`` does for every tree cache;
        :meth:`insert` only where the class's ``insert`` does: ``frees_duplicates``)."""
        if self.disable:
            return InsertResult(prefix_len=0)
        if params.key is None:
            raise TypeError("params.key must be a RadixKey, got None")
        key = as_radix_key(params.key).page_aligned(self.page_size)
        tokens = key.tokens()
        value = params.value
        if value is None:
            value = torch.tensor(tokens.tolist(), dtype=torch.int64)
        elif not isinstance(value, torch.Tensor) or value.dtype not in _SLOT_DTYPES:
            # (SGLang passes req_to_token rows, int32, as its own caches take them; a float
            # or bool tensor would be truncated into slots without a word)
            got = type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype
            raise TypeError(f"params.value must be a 1-D int32 or int64 tensor of KV slots, "
                            f"got {got}")
        value = value[: len(tokens)].to(torch.int64)
        slots = value + self.views.slot_offset if self.views.slot_offset else value
        state = None
        mv = params.mamba_value
        if mv is not None:
            if not isinstance(mv, torch.Tensor) or mv.numel() != 1 or mv.dtype not in _SLOT_DTYPES:
                shown = type(mv).__name__ if not isinstance(mv, torch.Tensor) else (
                    f"{mv.dtype} of {mv.numel()} elements")
                raise TypeError(f"params.mamba_value must be tensor([slot]) (one int64 state "
                                f"slot) or None, got {shown}")
            state = int(mv.reshape(-1)[0])
        prev = check_count(params.prev_prefix_len, "params.prev_prefix_len")
        priority = params.priority or 0
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"params.priority must be an int, got {type(priority).__name__}")
        hint = session_hint(params.session_id, "params.session_id")
        res = self.cache.insert(tokens, slots.to(self.device), key.namespace, state_slot=state,
                                priority=priority, extra=hint)
        p0 = min(prev, res.prefix_len)
        if free_duplicates and p0 < res.prefix_len:
            caller = slots[p0:res.prefix_len]
            tree = (self.cache.device_slots(res.tree_values)[p0:res.prefix_len]
                    if res.tree_values
                    else caller)
            mask = caller != tree
            if keep_live_swa:
                mask &= ~self.cache.swa_kept_mask(caller, tree)
            dup = caller[mask]
            if len(dup):
                self.slot_allocator.free(dup)
        return InsertResult(prefix_len=res.prefix_len, total_len=res.inserted_len,
                            last_device_node=self.views.get(res.last_node),
                            mamba_exist=state is not None and not res.state_adopted)

    # ================================================================ locks
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Lock ``node`` for one request; ``delta`` is the change of ``evictable_size``."""
        if self.disable:
            return IncLockRefResult(delta=0)
        lib = self.lib_node(node)
        before = self.cache.evictable_size()
        lock = self.cache.inc_lock_ref(lib)
        return IncLockRefResult(delta=self.cache.evictable_size() - before, node_id=lib.id,
                                lock=lock)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Release one lock on ``node``: the receipt's lock, or (no receipt, a cache whose
        locks carry nothing) the node's own.

        Raises:
            ValueError: no such lock held (the library's check), or no receipt on an SWA
                cache (its locks record where their window starts).
        """
        if params is not None and not isinstance(params, DecLockRefParams):
            raise TypeError(f"params must be the DecLockRefParams of inc_lock_ref's receipt "
                            f"(to_dec_params()) or None, got {type(params).__name__}")
        if self.disable:
            return DecLockRefResult(delta=0)
        lib = self.lib_node(node)
        lock = params.lock if params is not None and params.lock is not None else lib
        before = self.cache.evictable_size()
        self.cache.dec_lock_ref(lock)
        return DecLockRefResult(delta=self.cache.evictable_size() - before)

    def lock(self, node: Any) -> TreeLock | None:
        """A lock for one holder (``None`` for a streaming session's stand-in node)."""
        if session.is_virtual_node(node):
            return None
        return TreeLock(node, self.inc_lock_ref(node).to_dec_params())

    def unlock(self, lock: TreeLock | None) -> None:
        """Release a :meth:`lock` (``None``: nothing). Raises ``TypeError`` for anything else."""
        if lock is None:
            return
        if not isinstance(lock, TreeLock):
            raise TypeError(f"lock must be a TreeLock from lock() or None, got {type(lock).__name__}")
        self.dec_lock_ref(lock.node, lock.receipt)

    # ================================================================ eviction
    def evict(self, params: EvictParams | int | None = None, *,
              full_num_tokens: int | None = None, swa_num_tokens: int | None = None,
              ) -> EvictResult:
        """Free at least the asked full KV tokens, SWA tokens and states, in that order
        (each its own walk: leaves by policy; an internal node loses only its SWA KV or its
        state); what a walk frees on the way counts towards the later targets, as in
        SGLang's tracker. ``evict(n)`` and ``evict(full_num_tokens=, swa_num_tokens=)`` are the call
        shapes of SGLang's earlier releases.

        Raises:
            TypeError / ValueError: a count that is not an int >= 0 (naming it: ``1.5`` is
                not truncated, ``-1`` is not ignored); nothing evicted then.
        """
        if isinstance(params, EvictParams):
            targets = [check_count(params.num_tokens, "params.num_tokens"),
                     check_count(params.swa_num_tokens, "params.swa_num_tokens"),
                     check_count(params.mamba_num, "params.mamba_num")]
        else:
            # (no truncation: evict(1.5) is refused, not evict(1))
            full = params if params is not None else full_num_tokens
            targets = [0 if full is None else check_count(full, "num_tokens"),
                     0 if swa_num_tokens is None else check_count(swa_num_tokens,
                                                                   "swa_num_tokens"), 0]
        if self.disable:
            return EvictResult()
        c = self.cache
        total = [0, 0, 0]  # full tokens, SWA tokens, states freed so far
        runs: list[tuple[Any, int, int]] = [(c.evict, targets[0], 0)]
        if c.has_swa:
            runs.append((c.evict_swa, targets[1], 1))
        if c.hybrid:
            runs.append((c.evict_states, targets[2], 2))
        for fn, asked, i in runs:
            # what an earlier walk freed on the way (a leaf's state, its SWA KV) counts
            if asked > total[i]:
                r = fn(asked - total[i])
                total[0] += r.num_tokens
                total[1] += r.num_swa_tokens
                total[2] += r.num_states
        return EvictResult(*total)

    # ================================================================ sizes
    def evictable_size(self) -> int:
        return 0 if self.disable else self.cache.evictable_size()

    def protected_size(self) -> int:
        return 0 if self.disable else self.cache.protected_size()

    full_evictable_size = evictable_size
    full_protected_size = protected_size

    def swa_evictable_size(self) -> int:
        return self.cache.swa_evictable_size()

    def swa_protected_size(self) -> int:
        return self.cache.swa_protected_size()

    def mamba_evictable_size(self) -> int:
        return self.cache.state_evictable_size()

    def mamba_protected_size(self) -> int:
        return self.cache.state_protected_size()

    def total_size(self) -> int:
        """Full KV tokens the tree holds on device."""
        return self.cache.total_size()

    def all_values_flatten(self) -> torch.Tensor:
        """Every device KV slot the tree holds (parents before children)."""
        vals = [n.kv_value for n in self.cache.tree.iter_nodes() if n.kv_value is not None]
        return cast("torch.Tensor", self.views.out_slots(
            self.cache.device_slots(vals) if vals else _EMPTY))

    def all_mamba_values_flatten(self) -> torch.Tensor:
        slots = [n.state_slot for n in self.cache.tree.iter_nodes() if n.state_slot is not None]
        return torch.tensor(slots, dtype=torch.int64)

    def available_and_evictable_str(self) -> str:
        c = self.cache
        alloc = self.slot_allocator
        full_avail = (alloc.full_available_size() if c.has_swa
                      else alloc.available_size())
        lines = [f"Available full tokens: {full_avail + c.evictable_size()} "
                 f"(full_available_size={full_avail} + full_evictable_size_={c.evictable_size()})"]
        if c.has_swa:
            a = alloc.swa_available_size()
            lines.append(f"Available swa: {a + c.swa_evictable_size()} (available_size={a} + "
                         f"component_evictable_size_={c.swa_evictable_size()})")
        if self.state_pool is not None:
            a = self.state_pool.available_size()
            lines.append(f"Available mamba: {a + c.state_evictable_size()} (available_size={a} "
                         f"+ component_evictable_size_={c.state_evictable_size()})")
        return "\n".join(lines) + "\n"

    # ================================================================ events, checks
    @property
    def kv_events(self) -> Any:
        """The library's event recorder (``components.events``), or ``None``."""
        return self.cache.kv_events

    def take_events(self) -> list[Any]:
        """KV events since the last call (``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``); ``[]`` unless built with ``enable_kv_cache_events``.

        With msgspec installed (as with SGLang), SGLang's msgspec structs
        (``radix.sglang.kv_events``), which SGLang's own publisher encodes as its decoders
        require, state checkpoints left out; without it, the library's events
        (``components.events``)."""
        events = self.cache.take_events()
        try:
            from components.event_wire import to_wire
        except ImportError:
            return list(events)
        return [w for w in (to_wire(e, "map", state_group=False) for e in events)
                if w is not None]

    def reset(self) -> None:
        """Empty the tree (every slot back to its allocator); one ``AllBlocksCleared``.
        Open streaming sessions end first (as SGLang's reset drops them): their locks, rows,
        slots and states go back too.

        Raises:
            ValueError: a request still holds a lock (the library's check); nothing changed.
        """
        held = [] if self.session is None else list(self.session.slots.values())
        locks = [slot.lock for slot in held]
        # (read while the tree is there; freed once the reset went through)
        kept = [requests.kept_slots(self, slot.kv, None if lock is None else lock.node)
                if slot.kv.holds_kv else _EMPTY for slot, lock in zip(held, locks, strict=True)]
        for slot in held:
            self.unlock(slot.lock)
            slot.lock = None
        try:
            self.cache.reset()
        except ValueError:
            for slot, lock in zip(held, locks, strict=True):
                slot.lock = None if lock is None else self.lock(lock.node)
            raise
        for own in kept:
            if len(own):
                self.slot_allocator.free(own)
        if self.session is not None:
            for sid in list(self.session.slots):
                self.session.release_session(sid)  # (lock released, kept slots freed above)

    def sanity_check(self) -> None:
        """The library's full invariant check (raises ``AssertionError``)."""
        self.cache.sanity_check()

    def pretty_print(self) -> None:
        self.cache.pretty_print(file=sys.stdout)

    # ================================================================ HiCache
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, TreeNode] | None:
        """Load what ``best_match_node`` holds only on host (its host-only KV chain, its
        state, its SWA KV) to device, all or nothing; returns the tokens the request's
        device prefix grew by and the device node it now ends at, as SGLang's scheduler
        reads them: ``(params.host_hit_length, best_match_node)`` once loaded (that count
        includes device KV that was behind a host-only state: the library's
        ``load_back`` returns only the KV tokens it copied), else ``(0, params.req.last_node)``
        (``best_match_node`` without a request).

        Raises:
            TypeError: ``params`` is not an :class:`InitLoadBackParams`, or its
                ``best_match_node`` not a node; ``ValueError``: a node not in this cache.
        """
        if not isinstance(params, InitLoadBackParams):
            raise TypeError(f"params must be an InitLoadBackParams, got {type(params).__name__}")
        check_count(params.host_hit_length, "params.host_hit_length")
        self.lib_node(params.best_match_node, "params.best_match_node")
        if not self.cache.has_host_tier or params.host_hit_length <= 0:
            return 0, params.best_match_node
        lib = self.lib_node(params.best_match_node)
        states_before = self.cache.stats()["load_back_states"]
        # (a load of the node's own state or SWA KV alone copies no KV token: counted apart)
        if self.cache.load_back(lib) or self.cache.stats()["load_back_states"] > states_before:
            return params.host_hit_length, self.views.get(lib)
        before = getattr(params.req, "last_node", None)
        return 0, params.best_match_node if before is None else before

    def check_hicache_events(self) -> None:
        self.cache.poll_transfers()

    def ready_to_load_host_cache(self) -> int:
        return 0

    def flush_pending_backups(self) -> None:
        self.cache.poll_transfers()

    def evict_host(self, num_tokens: int) -> int:
        return self.cache.evict_host(num_tokens)

    def is_backuped(self, node: Any) -> bool:
        return self.lib_node(node).host_value is not None

    # ================================================================ requests
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert ``req``'s tokens up to row position ``up_to``, repoint its row onto the
        tree's slots, move its lock (``radix.sglang.requests.checkpoint``)."""
        if self.session is not None and self.session.try_checkpoint(req, up_to=up_to):
            return
        requests.checkpoint_into_tree(self, req, up_to)

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        requests.checkpoint_into_tree(self, req, up_to)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """A running request's tokens so far go into the tree (SGLang's name before 0.5.23:
        ``checkpoint`` up to ``req.extend_end``, or every fill id)."""
        up_to = req.extend_end if getattr(req, "extend_end", None) else len(requests.fill_ids(req))
        self.checkpoint(req, up_to=up_to)

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """A finished request: insert it (``is_insert``), free its row, release its lock
        (SGLang's name before 0.5.23 for ``release_kv_cache``)."""
        requests.release_kv_cache(self, req, checkpoint=is_insert)

    def release_kv_cache(self, req: Any, *, checkpoint: bool = True) -> None:
        requests.release_kv_cache(self, req, checkpoint=checkpoint)

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        requests.free_kv_row(self, kv, ranges)

    def maybe_hand_to_session(self, req: Any) -> None:
        if self.session is not None:
            self.session.take(req)

    def claim_kv_row(self, req: Any) -> bool:
        return self.session is not None and self.session.try_cache_finished_req(req)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        if not checkpointed:
            requests.free_request_state(self, req)

    def release_session(self, session_id: str) -> None:
        """End a streaming session: its lock, KV row and state go back."""
        if self.session is not None:
            self.session.release_session(session_id)

    def session_records(self) -> dict[str, Any]:
        return {} if self.session is None else self.session.records()

    def evict_sliding_windows(self, req: Any, pre_len: int, **kwargs: Any) -> None:
        """Free the SWA KV of ``req``'s own tokens that slid out of its window."""
        requests.release_out_of_window(self, req, pre_len)


class RadixCache(UnifiedRadixCache):
    """SGLang's ``RadixCache`` (full KV only): its ``insert`` leaves the caller's duplicate
    slots to the caller, as SGLang's does; its ``checkpoint`` (and the request calls over it)
    frees them."""

    frees_duplicates = False

    def __init__(self, params: CacheInitParams, *, simulated: bool | None = None) -> None:
        super().__init__(params, simulated=simulated)
        if self.cache.hybrid or self.cache.has_swa:
            raise ValueError("RadixCache holds full KV only; use UnifiedRadixCache for "
                             "recurrent-state or sliding-window models")
