"""RadixCache: the engine-facing prefix cache over one tree and its components.

One request's path::

    match_prefix  tier.before_match -> tree walk (page aligned, split where the match ends
                  inside a node) -> stamps -> tier.device_part -> every component's usable
                  rule (fixpoint: the minimum over components) -> on_hit -> MatchResult
    inc_lock_ref  every component's lock (KV path, the node's state, the SWA window) -> token
    insert        check -> plan (every component; refusals change nothing) -> KV claim ->
                  split / revive / new leaves (each component's on_new_node) -> on_insert
                  (state adoption) -> tier.after_insert (write policy) -> InsertResult
    evict*        one component's eviction walk (CacheCore.evict) -> EvictResult
    dec_lock_ref  every component's unlock -> prune what is left dead

The cache holds its components as a tuple (KV first, then recurrent state and sliding-window
KV as the model has them, then any the caller adds) and loops over them through the hooks of
``components.base.Component``; it names a component only where the engine-facing API does
(``state_slot``, ``evict_states``, ``evict_swa``, ``release_swa``). The host tier (HiCache L2)
and the storage tier below it (L3) are objects it holds (``radix.tiers``), called through a
few named hooks. Every public method validates its arguments before mutating anything: a
refused call leaves the tree and every pool exactly as before.

Threading: engine calls are single-threaded: one thread at a time calls the cache and the
allocators and pools it was built over (an engine's scheduler loop); the cache takes no lock.
The library's own threads (the L3 writer and prefetch threads) never touch the tree: they move
bytes the engine thread packed or will attach, and device -> host copies are finished on the
engine thread (``poll_transfers``, and at every match). An engine that calls from several
threads wraps the cache in ``radix.locked.LockedCache`` (one lock around every call).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from operator import attrgetter
from time import perf_counter
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from allocators import as_index_tensor, check_range
from allocators.host_mirror import cat_mirrored, host_int, register
from components.base import Component, tier_components
from components.events import KVEvent, KVEventRecorder
from components.eviction.gds import GDS_WALKS
from components.eviction.unified import UnifiedStrategy, unified_bytes
from components.kv import KVComponent, cat_values
from components.state import StateComponent, StateWalkFactory, check_state_walk_factory
from components.swa import SWAComponent
from hicache import HiCacheConfig, HiCacheController
from hicache.storage.base import check_wait
from radix import diagnostics, requests
from radix.checks import check_count, check_lock, check_node
from radix.config import CacheConfig
from radix.core import NO_PARTS, CacheCore
from radix.durations import Durations
from radix.hints import check_extra
from radix.insert import InsertContext, RidDepths, insert_key
from radix.node import TreeNode
from radix.results import CacheRequest, EvictResult, InsertResult, LockRef, MatchResult
from radix.tiers.host import HostTier
from radix.tiers.storage import StorageTier
from radix.tree import RadixKey, new_tuple, resolve_key

if TYPE_CHECKING:
    from allocators import MambaStatePool, SlotAllocator
    from allocators.swa import SWAAllocator
    from components.kv import KVValue
    from hicache.storage import StorageController

#: A node's KV value (``node.kv_value``), read in C.
_KV_VALUE = attrgetter("kv_value")

#: Request ids whose hit-count depth is remembered (``insert(rid=...)``), most recent kept.
MAX_TRACKED_RIDS = 65536

#: Every key ``stats()`` reports, with its value when the component or tier is absent.
_STAT_DEFAULTS: dict[str, Any] = dict.fromkeys(
    ("match_calls", "match_tokens", "hit_tokens", "kv_hit_tokens", "evicted_tokens",
     "evicted_states", "inserted_tokens", "inserted_states", "evicted_swa_tokens",
     "revived_swa_tokens", "backup_tokens", "demoted_tokens", "host_evicted_tokens",
     "load_back_tokens", "load_back_states", "host_hit_tokens", "kv_evictable",
     "kv_protected", "state_evictable", "state_protected", "swa_evictable", "swa_protected",
     "host_tokens"), 0) | {"watermark": 0.0}


class RadixCache:
    """A radix-tree prefix cache with a full-attention KV component and, as the model needs,
    recurrent-state and sliding-window components, and a host tier.

    Args:
        config: page size, radix eviction policy, sliding window (validated when built).
        kv_allocator: KV slot allocator; its ``page_size`` must equal ``config.page_size``
            (an ``allocators.SWAAllocator`` with ``config.sliding_window_size``).
        state_allocator: recurrent-state pool, or ``None`` for a model without recurrent
            layers.
        hicache: host tier (HiCache L2, and L3 below it), or ``None``.
        state_walk: a factory ``is_candidate -> walk`` building the recurrent-state eviction
            walk (``components.state.StateWalk``) in place of the policy's; the policy still
            orders KV leaves. ``reset()`` calls it again for a fresh walk. Meant for replay
            baselines and experiments; engines pick walks by name.
        components: further components (``components.base.Component`` instances, names not
            taken), after the built-in ones: they take every hook, and their usable rules
            bound matches like the built-in ones.

    Raises:
        TypeError / ValueError: bad config, mismatched page sizes, a ``state_walk`` that is
            not callable (``TypeError``) or given without a state allocator, a component that
            is not a ``Component``.
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        kv_allocator: SlotAllocator,
        state_allocator: MambaStatePool | None = None,
        hicache: HiCacheConfig | None = None,
        state_walk: StateWalkFactory | None = None,
        components: Sequence[Component] = (),
    ) -> None:
        config = config if config is not None else CacheConfig()
        check_state_walk_factory(state_walk)
        if state_walk is not None and state_allocator is None:
            raise ValueError("state_walk needs a state_allocator (a hybrid cache)")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        alloc_ps = getattr(kv_allocator, "page_size", None)
        if alloc_ps != config.page_size:
            raise ValueError(
                f"kv_allocator.page_size ({alloc_ps}) must equal config.page_size ({config.page_size})"
            )
        if state_allocator is not None and not (
            callable(getattr(state_allocator, "alloc", None))
            and callable(getattr(state_allocator, "free", None))
        ):
            raise TypeError(
                "state_allocator must be a recurrent-state pool (allocators.MambaStatePool, or "
                f"an allocator of state slots with alloc / free) or None, got "
                f"{type(state_allocator).__name__}"
            )
        if hicache is not None and not isinstance(hicache, HiCacheConfig):
            raise TypeError(f"hicache must be a HiCacheConfig or None, got {type(hicache).__name__}")
        extra = tuple(components)
        for c in extra:
            if not isinstance(c, Component):
                raise TypeError(
                    f"components must be components.base.Component instances, got {type(c).__name__}"
                )
        self.config = config
        self.page_size = config.page_size
        self.policy = config.policy
        policy = self.policy
        self.kv = KVComponent(kv_allocator, policy.kv_key, host_tier=hicache is not None)
        self.device = self.kv.device
        built: list[Component] = [self.kv]
        if policy.name == "unified":  # one byte order over KV leaves and states
            state_walk = _unified_walk(kv_allocator, state_allocator, hicache, state_walk,
                                       policy.knobs)
        self.state: StateComponent | None = None
        if state_allocator is not None:
            gds = (policy.knobs["d"], policy.knobs["e"]) if policy.state_walk in GDS_WALKS else None
            self.state = StateComponent(state_allocator, policy.state_walk, gds, state_walk,
                                        recency=config.state_recency,
                                        stateless_leaf=config.stateless_leaf)
            built.append(self.state)
        self.swa: SWAComponent | None = None
        if config.sliding_window_size is not None:
            self.swa = SWAComponent(cast("SWAAllocator", kv_allocator),
                                    config.sliding_window_size, self.kv,
                                    config.swa_release_extra_pages)
            built.append(self.swa)
        #: Wall time of eviction passes, load-backs and backups (``radix.durations``).
        self.durations = Durations()
        self.kv_events: KVEventRecorder | None = None
        if config.enable_kv_cache_events:
            self.kv_events = KVEventRecorder(self.page_size, host_tier=hicache is not None,
                                             states=self.state is not None)
            if self.state is not None:
                self.state.on_state_change = self.kv_events.state_changed
            built.append(self.kv_events)
        self.core = core = CacheCore(self.page_size, tuple(built) + extra)
        self.hicache: HiCacheController | None = None
        self._host: HostTier | None = None
        self._storage: StorageTier | None = None
        if hicache is not None:
            demands = [d for c in tier_components(core.components)
                       if (d := c.host_demand()) is not None]
            self.hicache = HiCacheController(kv_allocator, state_allocator, hicache, demands)
            self._host = host = HostTier(core, self.hicache)
            host.durations = self.durations
            core.add_per_node(host)
            core.free_leaf = host.free_leaf
            if hicache.hicache_storage_backend is not None:
                self._storage = host.storage = StorageTier(core, host)
        #: ``match_recency="usable"``: a match stamps only its usable prefix.
        self._stamp_usable = config.match_recency == "usable"
        #: A 0-slot index tensor on the KV device (mirrored): what an empty result holds.
        self.empty_slots = register(torch.empty(0, dtype=torch.int64, device=self.device),
                               np.empty(0, dtype=np.int64))
        #: The KV slots live on the CPU (an insert's checked ``value`` is then a CPU tensor).
        self.on_cpu = self.device.type == "cpu"
        #: ``torch.cat`` of slot tensors (node values are joined by ``components.kv.cat_values``);
        #: on a device joined on the host and uploaded once, mirrored.
        self.cat_slots = torch.cat if self.on_cpu else partial(cat_mirrored, device=self.device)
        #: Node values joined into one slot tensor on the KV device (``cat_values`` on the CPU;
        #: on a device one upload, ``KVComponent.device_slots``).
        self._join = cat_values if self.on_cpu else self.kv.device_slots
        #: What ``radix.requests`` reads besides the public API (the components, the core).
        self._request_ctx = requests.RequestContext(core, self.kv, state_allocator, self.swa)
        self._adopt_kv_order()
        self._init_counters()

    def _adopt_kv_order(self) -> None:
        """A state walk that orders KV leaves too (its ``kv_leaves``, with the interface of
        ``components.ordered.OrderedNodeSet``) replaces the policy's KV order, on an empty
        cache without a host tier (whose demotions keep the policy's order)."""
        walk = self.state.gds if self.state is not None else None
        leaves = getattr(walk, "kv_leaves", None)
        if leaves is not None and self.hicache is None:
            self.kv.leaves = leaves

    def _init_counters(self) -> None:
        self._match = {"match_calls": 0, "match_tokens": 0, "hit_tokens": 0, "kv_hit_tokens": 0}
        #: The watermark the last ``sanity_check`` saw (it never falls).
        self.checked_watermark = 0.0
        self.rid_depths = RidDepths(MAX_TRACKED_RIDS)
        #: What ``radix.insert`` reads besides an insert's arguments (the tier hook it ends
        #: with: the host tier's write policy).
        self._insert_ctx = InsertContext(
            self.core, self.kv, self.rid_depths, self.empty_slots, self.on_cpu,
            self._host.after_insert if self._host is not None else None)

    # ================================================================= views
    @property
    def tree(self) -> Any:
        """The radix tree (``radix.tree.RadixTree``)."""
        return self.core.tree

    @property
    def root(self) -> TreeNode:
        return self.core.tree.root

    @property
    def components(self) -> tuple[Component, ...]:
        """The components, KV first, in hook order."""
        return self.core.components

    @property
    def hybrid(self) -> bool:
        return self.state is not None

    @property
    def storage(self) -> StorageController | None:
        """The L3 storage controller (backend, writer thread, counters), or ``None``."""
        return self._storage.controller if self._storage is not None else None

    @property
    def host_leaves(self) -> Any:
        """Host-only leaves in host-eviction order (empty without a host tier)."""
        return self._host.host_leaves if self._host is not None else ()

    @property
    def has_swa(self) -> bool:
        """Whether the cache has a sliding-window component (``sliding_window_size``)."""
        return self.swa is not None

    @property
    def has_host_tier(self) -> bool:
        """Whether the cache has a host tier (HiCache L2, ``hicache=``)."""
        return self._host is not None

    def holds(self, node: Any) -> bool:
        """Whether ``node`` is a node of this cache's tree now (the root included; a removed
        node, one of another cache or of before a ``reset``, or any other object: ``False``)."""
        return type(node) is TreeNode and self.core.tree.is_attached(node)

    def device_slots(self, values: Sequence[KVValue]) -> torch.Tensor:
        """Node KV values (``node.kv_value``, ``InsertResult.tree_values``) joined into one 1-D
        int64 tensor of slots on the KV device, in order (one upload on a device, mirrored;
        ``empty_slots`` for none). Read-only: it may be a view of a node's own slots."""
        return self._join(list(values)) if values else self.empty_slots

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """The device KV slots [one per token] from the root to ``node``, on the KV device
        (``node``'s device part: a host-only node's chain adds none). 1-D int64, read-only.

        Raises:
            TypeError / ValueError: ``node`` is not a node of this cache.
        """
        checked = check_node(self.core, node, device=False)
        vals = [n.kv_value for n in reversed(checked.path_to_root()) if n.kv_value is not None]
        return self.device_slots(vals)

    def swa_kept_mask(self, caller: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
        """Where a running request keeps its own slot over the tree's: of two slot tensors
        for the same tokens (``caller``: the request's, ``tree``: the tree's, equal length,
        1-D int64 on any device), the positions where they differ and the request's copy
        has live SWA KV while the tree's is a tombstone (the request's window still reads
        it; it frees the copy when it finishes). Returns a 1-D bool CPU tensor over
        ``caller``; all ``False`` without an SWA component.

        Raises:
            TypeError: not a tensor, or not ``torch.int64``.
            ValueError: not 1-D, a slot outside ``[0, size + page_size)``, or ``caller`` and
                ``tree`` differ in length.
        """
        high = self.kv.allocator.size + self.page_size
        for name, x in (("caller", caller), ("tree", tree)):
            check_range(as_index_tensor(x, name), name, low=0, high=high)
        if len(caller) != len(tree):
            raise ValueError(f"caller ({len(caller)} slots) and tree ({len(tree)} slots) must "
                             "cover the same tokens")
        if self.swa is None:
            return torch.zeros(len(caller), dtype=torch.bool)
        caller_h, tree_h = self.kv.host_slots(caller), self.kv.host_slots(tree)
        return torch.from_numpy(self.swa.request_keeps(caller_h, tree_h, caller_h != tree_h))

    def release_swa_slots(self, slots: torch.Tensor, start: int, seq_len: int) -> int:
        """Free the SWA KV of ``slots[start:upto]`` (a request's own KV slots [one per token],
        1-D int64): the tokens that slid out of its window before ``seq_len``, ``upto``
        keeping the last ``max(sliding_window_size, page_size)`` tokens before the end of
        ``seq_len``'s whole pages and
        ``swa_release_extra_pages`` pages live (page aligned; as :meth:`release_swa`, for an
        engine that keeps its own request record). Returns ``upto`` (``<= start``: nothing
        freed).

        Raises:
            ValueError: no SWA component, ``start < 0`` or not a multiple of ``page_size``
                (the release frees whole pages), ``seq_len`` not in ``[0, len(slots)]``,
                ``slots`` not 1-D; ``TypeError``: counts that are not ints, ``slots`` not an
                int64 tensor.
        """
        swa = self.swa
        if swa is None:
            raise ValueError("release_swa_slots on a cache without a sliding-window component")
        as_index_tensor(slots, "slots")
        check_count(start, "start")
        check_count(seq_len, "seq_len")
        if start % self.page_size:
            raise ValueError(f"start={start} is not a multiple of page_size={self.page_size} "
                             "(the SWA KV is released in whole pages)")
        if seq_len > len(slots):
            raise ValueError(f"seq_len ({seq_len}) > len(slots) ({len(slots)})")
        return swa.release(slots, start, seq_len)

    # =============================================================== matching
    def match_prefix(self, key: Any, extra_key: Any = None, *,
                     extra: Mapping[str, Any] | None = None) -> MatchResult:
        """Longest usable cached prefix of ``key``.

        Args:
            key: a :class:`RadixKey` (validated once) or token ids (list of int >= 0, or a 1-D
                integer tensor/array, validated on each call). Only whole pages are matched.
            extra_key: namespace; keys with different ``extra_key`` never share nodes.
            extra: the request's hints (:mod:`radix.hints`: ``{"session_id": ...}``), evidence
                for the eviction walk only: never part of the key, no effect on the result.

        Returns:
            :class:`MatchResult`. Splits a node when the KV match ends inside it (at a page
            multiple); stamps every matched node (``match_recency="usable"``: the nodes up
            to the usable prefix) and only the consumed state.

        Raises:
            TypeError / ValueError: bad token ids; ``extra`` not a valid hint mapping
                (:func:`radix.hints.check_extra`). Complexity: O(matched nodes + key length).
        """
        trusted = type(key) is RadixKey
        if trusted and extra_key is None:  # (resolve_key's answer, without the call; a
            # prefix slice is read in its base array up to its end: no copy)
            key_len, extra_key, key = key.end, key.extra_key, key.base
        else:
            key, extra_key = resolve_key(key, extra_key)
            key_len = len(key)
        core = self.core
        if core.hint_hooks or extra is not None:
            self._hint(extra)
        host = self._host
        if host is not None:
            host.before_match(key if key_len == len(key) else key[:key_len], extra_key)
        ps = self.page_size
        end = key_len - key_len % ps
        tree = core.tree
        walk = tree.walk(key, end, extra_key, trusted)
        full_path = walk.path
        core.clock += 1
        now = core.clock
        if walk.partial is not None:
            full_path.append(core.split_touched(walk.partial, walk.partial_len, now))
        kv_hit = walk.matched_len
        stamp_all = not self._stamp_usable
        if stamp_all:
            for n in full_path:
                n.last_access_time = now
        else:  # host-only nodes keep the host tier's order; device ones wait for the rule
            for n in full_path:
                if n.kv_value is None:
                    n.last_access_time = now
        path = full_path if host is None else host.device_part(full_path)
        if stamp_all:
            if path:
                self.kv.refresh(path[-1])  # the only node of the path that can be a KV leaf
            for touch in core.touch_hooks:
                touch(path)
        usable = len(path)
        misses = None
        rule = core.one_rule
        if rule is not None:
            usable = rule(path, usable)
        elif core.rules:
            usable, misses = core.usable(path, usable)
        if not stamp_all:  # match_recency="usable": only what the match may end within
            used = path[:usable]
            for n in used:
                n.last_access_time = now
            if used and usable == len(path):  # else the deepest stamped node has a child
                self.kv.refresh(used[-1])
            for touch in core.touch_hooks:
                touch(used)
        for on_match in core.match_hooks:
            on_match(path, usable, key, end)
        if usable:
            last = path[usable - 1]
            for hit in core.hit_hooks:
                hit(last, now)
            prefix_len = last.depth
            if usable == 1:  # the node's own slots (a view of its array on the CPU)
                indices = self.kv.slots(last)
            else:
                # (one C pass over the nodes: no comprehension frame, no slice when whole)
                indices = self._join(list(map(_KV_VALUE, path if usable == len(path)
                                              else path[:usable])))
            state_slot = last.state_slot
        else:
            last = tree.root
            prefix_len = 0
            indices = self.empty_slots
            state_slot = None
        # Where the key leaves the tree past the usable prefix (a fork, or the end of the
        # cached path): a checkpoint there serves every later key sharing that prefix.
        branching = kv_hit if kv_hit > prefix_len and core.checkpoints else None
        st = self._match
        st["match_calls"] += 1
        st["match_tokens"] += key_len
        st["hit_tokens"] += prefix_len
        st["kv_hit_tokens"] += kv_hit
        swa_miss = 0
        if misses is not None:
            for field, m in zip(core.miss_fields, misses, strict=True):
                if field == "swa_miss_tokens":
                    swa_miss = m
        parts = None
        if core.part_hooks:
            parts = {name: part(last) for name, part in core.part_hooks}
        if host is None:  # no host hit: the last host node is the last device node
            return new_tuple(MatchResult, (indices, prefix_len, kv_hit, last, state_slot,
                                           branching, last, 0, swa_miss, 0, 0, parts))
        last_host, host_hit = host.host_hit(full_path, usable, last, prefix_len)
        swa_host = state_host = 0
        if host_hit:  # what its load-back would bring besides the full KV
            sizes = host.load_sizes(last_host)
            swa_host, state_host = sizes.get("swa", 0), sizes.get("state", 0)
        return new_tuple(MatchResult, (indices, prefix_len, kv_hit, last, state_slot, branching,
                                       last_host, host_hit, swa_miss, swa_host, state_host, parts))

    # ============================================================== inserting
    def insert(
        self,
        key: Any,
        value: torch.Tensor,
        extra_key: Any = None,
        *,
        state_slot: int | torch.Tensor | None = None,
        priority: int = 0,
        rid: object = None,
        component_values: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> InsertResult:
        """Cache ``key`` with KV slots ``value`` (and a state checkpoint at its end).

        Args:
            key: a :class:`RadixKey` or token ids; only the leading whole pages are cached.
            value: 1-D int64 tensor of KV slots, ``len(value) == len(key)``, on the allocator's
                device.
            extra_key: namespace (LoRA adapter id, cache salt).
            state_slot: a state slot valid after the key's last token (``len(key)``, so at
                ``page_size > 1`` the key must be whole pages: the state lands on the node
                ending there), owned by the caller until adopted: an ``int``, or the
                one-element tensor the state pool's ``alloc`` returned (read through its host
                mirror: no host synchronisation). Required on a hybrid cache when new tokens
                are added (a leaf never stays without a state).
            priority: request priority (``priority`` policy: a node keeps the max).
            rid: request id: a request counts once per node in ``hit_count``, also across its
                chunked-prefill re-inserts (the cache remembers how deep each rid counted until
                ``release_rid(rid)`` or ``cache_finished_req``; at most ``MAX_TRACKED_RIDS``).
            component_values: component name -> a per-insert value for it, for a component
                that takes one (it implements ``check_value``: a plug-in's value valid at the
                key's end, say; the state component's is ``state_slot``). Each is checked
                before anything changes; the component reads it while inserting
                (``InsertPlan.value_of``) and says in its own docs who owns it afterwards.
            extra: the request's hints (:mod:`radix.hints`), as in :meth:`match_prefix`.

        Returns:
            :class:`InsertResult`: ``duplicate_indices`` are the caller's to free,
            ``adopted_indices`` now belong to the tree, ``remainder_indices`` stay the caller's,
            ``state_adopted`` says who owns ``state_slot``.

        Raises:
            TypeError / ValueError: bad key or value; a slot the tree would adopt (the new
                tail, or what revival takes) that is outside the pool, free in the allocator,
                held by a node, repeated, or (paged) not whole pages in order; a
                ``state_slot`` that is free in the pool or held by the tree, or given with a
                key that ends inside a page (``ValueError`` naming ``state_slot``); an unhashable
                ``rid``; a missing state; ``component_values`` not a mapping, naming a
                component that takes no value, or a value its ``check_value`` refuses;
                ``extra`` not a valid hint mapping. Nothing changed then.

        Complexity: O(key length) in C (the walk, ``radix/_match.c``; the adopted slots'
        checks, marks and copy in one pass, ``components/_claim.c``) plus O(matched nodes) in
        Python.
        """
        trusted = type(key) is RadixKey
        if trusted and extra_key is None:  # (resolve_key's answer, without the call; a
            # prefix slice is read in its base array up to its end: no copy)
            n, extra_key, key = key.end, key.extra_key, key.base
        else:
            key, extra_key = resolve_key(key, extra_key)
            n = len(key)
        if isinstance(state_slot, torch.Tensor):
            state_slot = host_int(state_slot, "state_slot")
        for check in self.core.insert_checks:
            check(n, value, state_slot)
        if state_slot is not None and self.state is None:
            raise ValueError("state_slot given but this cache has no recurrent-state component")
        if type(priority) is not int and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if rid is not None:
            try:
                hash(rid)
            except TypeError:
                raise TypeError(
                    f"rid must be hashable (an int, a str, an object), got {type(rid).__name__}"
                ) from None
        values = None
        if component_values is not None:
            values = self._check_values(component_values, n)
        if self.core.hint_hooks or extra is not None:
            self._hint(extra)
        return insert_key(self._insert_ctx, key, n, value, extra_key, state_slot, priority, rid,
                          trusted, values)

    def _hint(self, extra: Any) -> None:
        """Check ``extra`` and hand it to the components that read hints."""
        checked = check_extra(extra)
        for hint in self.core.hint_hooks:
            hint(checked)

    def _check_values(self, values: Mapping[str, Any], n: int) -> dict[str, Any] | None:
        """``insert``'s ``component_values``, checked by each named component."""
        if not isinstance(values, Mapping):
            raise TypeError("component_values must be a mapping of component name -> value, "
                            f"got {type(values).__name__}")
        checks = self.core.value_checks
        for name, v in values.items():
            check = checks.get(name) if isinstance(name, str) else None
            if check is None:
                raise ValueError(
                    f"component_values names {name!r}, which takes no per-insert value; the "
                    f"components that take one: {sorted(checks)} (a component implementing "
                    "check_value; the state's value is state_slot=)")
            check(n, v)
        return dict(values) if values else None

    def release_rid(self, rid: object) -> None:
        """Forget ``rid``'s hit-count depth (the request finished).

        Raises:
            TypeError: ``rid`` is unhashable (naming ``rid``; ``insert`` refuses it too).
        """
        try:
            self.rid_depths.release(rid)
        except TypeError:
            raise TypeError(
                f"rid must be hashable (an int, a str, an object), got {type(rid).__name__}"
            ) from None

    # ================================================================== locks
    def inc_lock_ref(self, node: TreeNode) -> TreeNode | LockRef:
        """Protect ``node``'s KV path, its state, and (SWA) the live nodes covering the last
        ``sliding_window_size`` tokens before it, while a request uses them.

        Returns:
            The lock, to hand back to :meth:`dec_lock_ref` once: a :class:`LockRef` on a cache
            whose components record data per lock (a sliding-window component: where its
            window lock starts, ``lock.part("swa")``), else ``node`` itself (also the root,
            whose lock is a no-op).

        Raises:
            TypeError / ValueError: not a node of this cache, or a host-only node.
        """
        core = self.core
        if type(node) is not TreeNode or node.owner != core.tree.uid or node.kv_value is None:
            node = check_node(self.core, node)  # raises, unless it is the root
            if node.parent is None:
                return node
        return core.lock(node)

    def dec_lock_ref(self, lock: TreeNode | LockRef) -> None:
        """Release one lock taken by :meth:`inc_lock_ref`.

        Args:
            lock: what ``inc_lock_ref`` returned (a node stands for its own lock only on a
                cache whose locks carry no data).

        Raises:
            TypeError / ValueError: ``lock`` is not a lock of this cache, was released
                already, or is a node where the cache needs the :class:`LockRef`; the node
                holds no lock. Nothing changes then.
        """
        core = self.core
        if (type(lock) is TreeNode and not core.lock_data and lock.lock_ref > 0
                and lock.owner == core.tree.uid and lock.kv_value is not None
                and not core.unlock_checks):
            core.unlock(lock, NO_PARTS)  # the common case, every check passed
            return
        node, parts = check_lock(self.core, lock, "lock")
        if node.parent is None:
            return
        core.unlock(node, parts)
        if isinstance(lock, LockRef):
            lock.released = True

    # =============================================================== eviction
    def evict(self, num_tokens: int) -> EvictResult:
        """Free at least ``num_tokens`` evictable KV tokens, unlocked leaves first in policy
        order (a freed leaf's state and SWA KV go with it; whole nodes, so it may overshoot).

        Returns exactly what this call freed on device (less than asked when everything left
        is locked). Under ``write_back`` a victim's device slots are freed when its host copy
        lands: a copy still in flight counts towards ``num_tokens`` but not in the result,
        which counts it in the call during which it lands.
        Complexity: O(log n) per freed node.
        """
        if type(num_tokens) is not int or num_tokens < 0:
            check_count(num_tokens, "num_tokens")
        t0 = perf_counter()
        landed = self._host.collect_landed() if self._host is not None else None
        res = self.core.evict(self.kv, num_tokens)
        self.durations.observe("eviction", perf_counter() - t0)
        if landed is not None and any(landed):
            return self.core.merge(res, landed)
        return res

    def evict_states(self, num_states: int) -> EvictResult:
        """Free ``num_states`` recurrent states in the state walk's order (GDS or LRU).

        An internal node loses only its state (its KV stays); a leaf leaves whole.

        Raises:
            ValueError: the cache has no state component, or a bad count.
        """
        check_count(num_states, "num_states")
        if self.state is None:
            raise ValueError("evict_states on a cache without a recurrent-state component")
        t0 = perf_counter()
        res = self.core.evict(self.state, num_states)
        self.durations.observe("eviction", perf_counter() - t0)
        return res

    def evict_swa(self, num_tokens: int) -> EvictResult:
        """Free at least ``num_tokens`` SWA KV tokens, least recently used live nodes first:
        an internal node becomes a tombstone (its full KV stays), a leaf leaves whole.

        Raises:
            ValueError: the cache has no SWA component, or a bad count.
        """
        check_count(num_tokens, "num_tokens")
        if self.swa is None:
            raise ValueError("evict_swa on a cache without a sliding-window component")
        t0 = perf_counter()
        res = self.core.evict(self.swa, num_tokens)
        self.durations.observe("eviction", perf_counter() - t0)
        return res

    def evict_bytes(self, num_bytes: int) -> EvictResult:
        """Free at least ``num_bytes`` bytes of KV tokens and recurrent states together, the
        candidate of least recompute cost per byte first (``radix_eviction_policy="unified"``:
        ``components.eviction.unified``): unlocked KV leaves leave whole (their state with
        them), states of internal nodes alone. Bytes: ``num_tokens * K + num_states * S``
        (KV bytes per token, bytes a state frees). Stops early when nothing more can go.

        Raises:
            TypeError / ValueError: a bad count; a cache whose policy is not ``"unified"``.
        """
        num_bytes = check_count(num_bytes, "num_bytes")
        state = self.state
        walk = state.gds if state is not None else None
        if state is None or not isinstance(walk, UnifiedStrategy):
            raise ValueError("evict_bytes needs radix_eviction_policy='unified' (a hybrid cache "
                             f"ordering KV and states by bytes); this cache's is {self.policy.name!r}")
        t0 = perf_counter()
        res = self.core.evict_bytes(num_bytes, walk.pop_byte_victim, {
            "kv": (self.kv, walk.kv_bytes_per_token), "state": (state, walk.state_bytes)})
        self.durations.observe("eviction", perf_counter() - t0)
        return res

    def evict_component(self, name: str, n: int) -> EvictResult:
        """Free at least ``n`` of component ``name``'s units in its own eviction order (the
        component's ``evict_field`` names them: an ``EvictResult`` field, or for a component
        beyond KV, state and SWA an entry of ``EvictResult.other``; ``evict``,
        ``evict_states`` and ``evict_swa`` are this for ``"kv"``, ``"state"`` and ``"swa"``).

        Raises:
            ValueError: a bad count, no component ``name``, or one without an eviction walk
                (no ``evict_field``).
        """
        check_count(n, "n")
        if name == "kv":
            return self.evict(n)
        comp = self.core.by_name.get(name)
        if comp is None or comp not in self.core.components:
            raise ValueError(f"evict_component: no component {name!r}; have "
                             f"{[c.name for c in self.core.components]}")
        t0 = perf_counter()
        res = self.core.evict(comp, n)  # raises naming a component without an eviction walk
        self.durations.observe("eviction", perf_counter() - t0)
        return res

    # ================================================================ sizes
    def evictable_size(self) -> int:
        """KV tokens held by the tree that no request locks."""
        return self.kv.evictable_size()

    def protected_size(self) -> int:
        """KV tokens held by the tree under a lock."""
        return self.kv.protected_size()

    def total_size(self) -> int:
        """KV tokens held by the tree."""
        return self.kv.evictable_size() + self.kv.protected_size()

    def _sizes(self, name: str) -> tuple[int, int]:
        c = self.core.by_name.get(name)
        return (c.evictable_size(), c.protected_size()) if c is not None else (0, 0)

    def state_evictable_size(self) -> int:
        """States [slots] held by the tree that no request locks (0 without a state component)."""
        return self._sizes("state")[0]

    def state_protected_size(self) -> int:
        return self._sizes("state")[1]

    def swa_evictable_size(self) -> int:
        """Live SWA KV tokens no request's window protects (0 without an SWA component)."""
        return self._sizes("swa")[0]

    def swa_protected_size(self) -> int:
        return self._sizes("swa")[1]

    @property
    def watermark(self) -> float:
        """The GDS watermark ``L`` (0.0 under the LRU walks; a custom walk's ``watermark``)."""
        return self.state.watermark if self.state is not None else 0.0

    # ============================================================ host tier
    def _need_host(self, op: str) -> HostTier:
        if self._host is None:
            raise ValueError(f"{op} on a cache without HiCache")
        return self._host

    def load_back(self, node: TreeNode) -> int:
        """Bring the host-only chain ending at ``node`` (``MatchResult.last_host_node``) back
        to device, all or nothing, with ``node``'s host state when it has one.

        Skipped (returns 0) below ``load_back_threshold`` tokens or when device memory cannot
        be had even after evicting; otherwise returns the KV tokens copied to device. When
        ``node``'s KV is already on device and only its state is on host, the state alone is
        loaded (returns 0; ``stats()["load_back_states"]`` counts it). Re-match afterwards.
        Evicts on device first when short (the device ancestor of the chain is protected
        meanwhile).

        Raises:
            ValueError: without HiCache, or ``node`` not in this cache.
        """
        host = self._need_host("load_back")
        checked = check_node(self.core, node, device=False)
        t0 = perf_counter()
        got = host.load_back(checked)
        if got:
            self.durations.observe("load_back", perf_counter() - t0)
        return got

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host KV tokens: host-only leaves, least recently used
        first; a parent that becomes a host-only leaf may follow in the same call.

        Returns the host tokens freed. Raises ``ValueError`` without HiCache or on a bad count.
        """
        check_count(num_tokens, "num_tokens")
        return self._need_host("evict_host").evict_host(num_tokens)

    def poll_transfers(self) -> int:
        """Finish completed device -> host copies (unlock, demote); returns how many."""
        return self._host.poll() if self._host is not None else 0

    def host_size(self) -> int:
        """KV tokens backed up on host (0 without HiCache)."""
        return self._host.host_tokens if self._host is not None else 0

    def host_evictable_size(self) -> int:
        """Host tokens of host-only leaves no copy is in flight for."""
        return self._host.host_evictable_size() if self._host is not None else 0

    def poll_storage(self) -> int:
        """Attach the pages finished prefetches brought (host-only nodes); return the tokens
        attached. ``match_prefix`` does this itself; an engine may call it between steps."""
        return self._storage.poll() if self._storage is not None else 0

    def flush_storage(self, timeout_s: float | None = None) -> bool:
        """Wait for queued L3 writes and running prefetches (at most ``timeout_s``; ``None``
        or ``inf``: until done), then attach what the prefetches brought. Returns whether
        everything finished. Raises ``TypeError`` / ``ValueError`` (naming ``timeout_s``) for a
        bound that is not a number of seconds >= 0."""
        timeout_s = check_wait(timeout_s, "timeout_s")
        return self._storage.flush(timeout_s) if self._storage is not None else True

    def close_storage(self) -> None:
        """Finish queued writes and close the backend (``flush_storage`` first to keep
        prefetched pages)."""
        if self._storage is not None:
            self._storage.close()

    # ====================================================== request helpers
    def cache_unfinished_req(self, req: CacheRequest, state_slot: int | torch.Tensor | None = None,
                             upto: int | None = None) -> InsertResult:
        """Chunked prefill: cache ``req.key[:upto]`` (default: every computed token) with a
        state checkpoint, keep the request's lock (moved down to the new node); see
        :func:`radix.requests.cache_unfinished_req`."""
        return requests.cache_unfinished_req(self, self._request_ctx, req, state_slot, upto)

    def cache_finished_req(self, req: CacheRequest, state_slot: int | torch.Tensor | None = None,
                           upto: int | None = None) -> InsertResult:
        """Cache ``req.key[:upto]`` with a state at its end, free what the tree does not keep,
        release the request's lock; see :func:`radix.requests.cache_finished_req`."""
        return requests.cache_finished_req(self, self._request_ctx, req, state_slot, upto)

    def release_swa(self, req: CacheRequest, seq_len: int) -> int:
        """Free the SWA KV of the request's own tokens that slid out of its window; see
        :func:`radix.requests.release_swa`."""
        return requests.release_swa(self._request_ctx, req, seq_len)

    # ============================================================ maintenance
    def reset(self) -> None:
        """Free every cached slot and state back to the allocators and empty the tree.

        Raises:
            ValueError: a request still holds a lock (its slots would be freed under it).
        """
        self.poll_transfers()
        core = self.core
        if any(n.kv_lock or n.lock_ref or n.swa_lock for n in core.tree.iter_nodes()):
            raise ValueError("reset while requests hold locks or copies are in flight; release them first")
        core.reset()
        self._adopt_kv_order()  # the state walk was built anew
        self._init_counters()

    def take_events(self) -> list[KVEvent]:
        """The KV events (``components.events``: ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``) since the last call, oldest first; ``[]`` unless built with
        ``enable_kv_cache_events``."""
        return self.kv_events.take() if self.kv_events is not None else []

    def stats(self) -> dict[str, Any]:
        """Counters: match calls, requested / usable-hit / KV-hit tokens, evicted tokens,
        states and SWA tokens, inserted tokens and states, sizes per component, the watermark,
        the host tier's and L3's counters (every key present; 0 where a component is absent)."""
        st = dict(_STAT_DEFAULTS)
        st.update(self._match)
        for c in self.core.components + self.core.per_node:
            st.update(c.stats())
        st["num_nodes"] = self.core.tree.num_nodes
        st["policy"] = self.policy.name
        return st

    def pretty_print(self, file: Any = None) -> str:
        """Render the tree (one line per node: span, tokens, locks, state, SWA); print it to
        ``file`` when given; return the text."""
        return diagnostics.pretty_print(self, file)

    def sanity_check(self) -> None:
        """Recompute every counter and check every invariant; raise ``AssertionError`` with
        the printed tree on failure."""
        diagnostics.sanity_check(self)


def _unified_walk(kv_allocator: Any, state_allocator: Any, hicache: Any, state_walk: Any,
                  knobs: Mapping[str, Any]) -> StateWalkFactory | None:
    """The state-walk factory of ``radix_eviction_policy="unified"``, after refusing what it
    does not support (``ValueError`` naming the argument); ``None`` without a state pool (the
    KV leaves then follow lru, as under ``gds``)."""
    if hicache is not None:
        raise ValueError("hicache is not supported with radix_eviction_policy='unified' (a "
                         "demoted leaf's bytes stay on host; the byte order is device-only)")
    if state_walk is not None:
        raise ValueError("state_walk cannot replace the walk of radix_eviction_policy='unified'")
    if state_allocator is None:  # nothing to weigh KV against: lru on KV leaves, as gds
        return None
    k, s = unified_bytes(kv_allocator, state_allocator)
    d, e = knobs["d"], knobs["e"]
    return lambda is_candidate: UnifiedStrategy(d, e, k, s, is_candidate)
