"""RadixCache: the engine-facing prefix cache composing the tree and its components.

One request's path (DESIGN.md)::

    match_prefix -> walk (page aligned) -> KV rule, state rule -> MatchResult
    inc_lock_ref -> lock the KV path and the matched node's state
    insert       -> new leaf / split / state checkpoint -> InsertResult (which slots to free)
    evict        -> KV leaves by policy (their states go with them)
    evict_states -> states by GDS or LRU (internal: state only; leaf: whole leaf)

Every public method validates its arguments before mutating anything: a refused call leaves
the tree and every pool exactly as before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from components.gds import GDS_WALKS
from components.kv import KVComponent
from components.state import StateComponent, StateWalkFactory, check_state_walk_factory
from components.swa import SWAComponent
from hicache import HiCacheConfig, HiCacheController
from radix.config import CacheConfig
from radix.diagnostics import Diagnostics
from radix.host_tier import HostTier
from radix.node import TreeNode
from radix.request_helpers import RequestHelpers
from radix.results import EvictResult, InsertResult, MatchResult
from radix.storage_tier import StorageTier  # L3 (hicache_storage_backend)
from radix.tree import RadixTree, Walk, resolve_key

if TYPE_CHECKING:
    from allocators import MambaStatePool, SlotAllocator


#: Request ids whose hit-count depth is remembered (``insert(rid=...)``), most recent kept.
MAX_TRACKED_RIDS = 65536


class RadixCache(StorageTier, HostTier, RequestHelpers, Diagnostics):
    """A radix-tree prefix cache with a full-attention KV component and, for hybrid models, a
    recurrent-state component.

    Args:
        config: page size and radix eviction policy (validated when built).
        kv_allocator: KV slot allocator; its ``page_size`` must equal ``config.page_size``.
        state_allocator: recurrent-state pool, or ``None`` for a KV-only cache.
        hicache: host tier (HiCache L2), or ``None``.
        state_walk: a factory ``is_candidate -> walk`` building the recurrent-state eviction
            walk (``components.state.StateWalk``) in place of the policy's; the policy still
            orders KV leaves. ``reset()`` calls it again for a fresh walk. Meant for replay
            baselines and experiments (``bench.sim_policies``); engines pick walks by name.

    Raises:
        TypeError / ValueError: bad config, mismatched page sizes, a ``state_walk`` that is
            not callable (``TypeError``) or given without a state allocator.
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        kv_allocator: SlotAllocator,
        state_allocator: MambaStatePool | None = None,
        hicache: HiCacheConfig | None = None,
        state_walk: StateWalkFactory | None = None,
    ) -> None:
        config = config if config is not None else CacheConfig()
        check_state_walk_factory(state_walk)
        if state_walk is not None and state_allocator is None:
            raise ValueError("state_walk needs a state_allocator (a hybrid cache)")
        self._state_walk = state_walk
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        alloc_ps = getattr(kv_allocator, "page_size", None)
        if alloc_ps != config.page_size:
            raise ValueError(
                f"kv_allocator.page_size ({alloc_ps}) must equal config.page_size ({config.page_size})"
            )
        self.config = config
        self.page_size = config.page_size
        self.policy = config.policy
        self.device = torch.device(getattr(kv_allocator, "device", "cpu"))
        self._cpu = self.device.type == "cpu"
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
        if hicache is not None and config.sliding_window_size is not None:
            raise ValueError("hicache with sliding_window_size is not supported yet (no host SWA pool)")
        self.kv = KVComponent(kv_allocator, self.policy.kv_key, host_tier=hicache is not None)
        self.hicache = (
            HiCacheController(kv_allocator, state_allocator, hicache) if hicache is not None else None
        )
        self.state: StateComponent | None = None
        if state_allocator is not None:
            self.state = self._new_state_component(state_allocator)
            self._adopt_kv_order()
        self.swa: SWAComponent | None = None
        if config.sliding_window_size is not None:
            if not (hasattr(kv_allocator, "free_swa") and hasattr(kv_allocator, "has_swa")):
                raise TypeError(
                    "sliding_window_size needs an SWA allocator (allocators.SWAAllocator) as "
                    f"kv_allocator, got {type(kv_allocator).__name__}"
                )
            self.swa = SWAComponent(kv_allocator, config.sliding_window_size)  # type: ignore[arg-type]
        self._clock = 0
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._init_tree()
        self._init_storage()  # L3 hook: no-op without hicache_storage_backend

    def _new_state_component(self, allocator: MambaStatePool) -> StateComponent:
        walk = self.policy.state_walk
        gds = (self.policy.knobs["d"], self.policy.knobs["e"]) if walk in GDS_WALKS else None
        return StateComponent(allocator, walk, gds, self._state_walk)

    def _adopt_kv_order(self) -> None:
        """A state walk that orders KV leaves too (its ``kv_leaves``, with the interface of
        ``radix.ordered.OrderedNodeSet``) replaces the policy's KV key on an empty cache."""
        walk = self.state.gds if self.state is not None else None
        leaves = getattr(walk, "kv_leaves", None)
        if leaves is not None and not self.kv.host_tier:
            self.kv.leaves = leaves

    def _init_tree(self) -> None:
        self.tree = RadixTree(self.page_size, self._on_split)
        self.root = self.tree.root
        self._stats = {
            "match_calls": 0,
            "match_tokens": 0,
            "hit_tokens": 0,
            "kv_hit_tokens": 0,
            "evicted_tokens": 0,
            "evicted_states": 0,
            "inserted_tokens": 0,
            "inserted_states": 0,
            "evicted_swa_tokens": 0,
            "revived_swa_tokens": 0,
            "backup_tokens": 0,
            "demoted_tokens": 0,
            "host_evicted_tokens": 0,
            "load_back_tokens": 0,
            "load_back_states": 0,
            "host_hit_tokens": 0,
        }
        self._init_host()
        self._last_watermark = 0.0
        self._rid_depth: OrderedDict[object, int] = OrderedDict()

    @property
    def hybrid(self) -> bool:
        return self.state is not None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _on_split(self, upper: TreeNode, lower: TreeNode, split_len: int) -> None:
        self.kv.on_split(upper, lower, split_len)
        if self.state is not None:
            self.state.on_split(upper, lower, split_len)
        if self.swa is not None:
            self.swa.on_split(upper, lower, split_len)
        if self.hicache is not None:
            self._host_split(upper, lower, split_len)

    def _refresh(self, node: TreeNode) -> None:
        """``node``'s leaf status or locks changed: re-file it in every component's order."""
        self.kv.refresh(node)
        if self.state is not None:
            self.state.refresh(node)
        if self.swa is not None:
            self.swa.refresh(node)
        if self.hicache is not None:
            self._host_refresh(node)

    def _split_touched(self, node: TreeNode, split_len: int, now: int) -> TreeNode:
        """Split a node the walk entered; the walk passed through it, so both halves carry
        the new stamp (as SGLang's RadixCache stamps the node before splitting it)."""
        node.last_access_time = now
        upper = self.tree.split(node, split_len)
        self._refresh(node)
        return upper

    # =============================================================== matching
    def match_prefix(self, key: Any, extra_key: Any = None) -> MatchResult:
        """Longest usable cached prefix of ``key``.

        Args:
            key: a :class:`RadixKey` (validated once) or token ids (list of int >= 0, or a 1-D
                integer tensor/array, validated on each call). Only whole pages are matched.
            extra_key: namespace; keys with different ``extra_key`` never share nodes.

        Returns:
            :class:`MatchResult`. Splits a node when the KV match ends inside it (at a page
            multiple); stamps every matched node and only the consumed state.

        Raises:
            TypeError / ValueError: bad token ids. Complexity: O(matched nodes + key length).
        """
        key, extra_key = resolve_key(key, extra_key)
        if self.hicache is not None:
            self.poll_transfers()
            self._l3_before_match(key, extra_key)  # L3 hook: prefetch past the tree; never raises
        ps = self.page_size
        end = len(key) - len(key) % ps
        walk = self.tree.walk(key, end, extra_key)
        full_path = walk.path
        now = self._tick()
        if walk.partial is not None:
            full_path.append(self._split_touched(walk.partial, walk.partial_len, now))
        kv_hit = walk.matched_len
        for n in full_path:
            n.last_access_time = now
        path = full_path
        if self.hicache is not None:  # the device part: a prefix of the path
            dev = 0
            while dev < len(full_path) and full_path[dev].kv_value is not None:
                dev += 1
            path = full_path[:dev]
            for n in full_path[dev:]:
                self._host_refresh(n)
        if path:
            self.kv.refresh(path[-1])
        state = self.state
        if state is not None and state.walk == "joint":
            for n in path:
                if n.state_slot is not None:
                    state.refresh(n)

        usable = len(path)
        state_slot = None
        if state is not None:
            while usable > 0 and path[usable - 1].state_slot is None:
                usable -= 1
        swa_miss = 0
        if self.swa is not None:
            swa_ok = self.swa.usable_ends(path)
            state_ok_len = path[usable - 1].depth if usable else 0
            while usable > 0 and not (
                swa_ok[usable - 1] and (state is None or path[usable - 1].state_slot is not None)
            ):
                usable -= 1
            swa_miss = state_ok_len - (path[usable - 1].depth if usable else 0)
        if self.swa is not None:
            for n in path:  # stamps moved: re-file live nodes in the SWA order
                self.swa.refresh(n)
        if state is not None:
            # the walk sees where the KV match ended before the consumed state's hit
            state.match_end(path[-1] if path else None, path[usable - 1] if usable else None,
                            key, end)
        if state is not None and usable > 0:
            node = path[usable - 1]
            state_slot = node.state_slot
            state.use(node, now)
        last = path[usable - 1] if usable else self.root
        prefix_len = last.depth if usable else 0
        if usable == 0:
            indices = self._empty
        elif usable == 1:
            kv0 = path[0].kv_value
            assert kv0 is not None  # a usable (device) node holds KV slots
            indices = kv0
        else:
            indices = torch.cat([n.kv_value for n in path[:usable]])  # type: ignore[misc]
        last_host, host_hit = last, 0
        if self.hicache is not None:
            h = len(full_path)
            if state is not None:
                while h > usable and full_path[h - 1].state_slot is None and (
                    full_path[h - 1].host_state_slot is None
                ):
                    h -= 1
            if h > usable:
                last_host = full_path[h - 1]
                host_hit = last_host.depth - prefix_len
                self._stats["host_hit_tokens"] += host_hit
        branching = None
        if state is not None and kv_hit > prefix_len:
            # Where the key leaves the tree past the usable prefix (a fork, or the end of the
            # cached path): a checkpoint there serves every later key sharing that prefix.
            branching = kv_hit
        st = self._stats
        st["match_calls"] += 1
        st["match_tokens"] += len(key)
        st["hit_tokens"] += prefix_len
        st["kv_hit_tokens"] += kv_hit
        return MatchResult(indices, prefix_len, kv_hit, last, state_slot, branching,  # type: ignore[arg-type]
                           last_host, host_hit, swa_miss)

    # ============================================================== inserting
    def _check_value(self, value: Any, n: int) -> None:
        """Raise unless ``value`` is a 1-D int64 tensor of ``n`` KV slots on the allocator's
        device."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a 1-D torch.int64 tensor of KV slots, got {type(value).__name__}")
        if value.dtype != torch.int64:
            raise TypeError(f"value must have dtype torch.int64, got {value.dtype}")
        if value.shape != (n,):
            if value.dim() != 1:
                raise ValueError(f"value must be 1-D, got shape {tuple(value.shape)}")
            raise ValueError(f"value has {value.shape[0]} slots but key has {n} tokens; lengths must match")
        if value.is_cpu if self._cpu else value.device == self.device:
            return
        raise ValueError(f"value is on {value.device}, the KV allocator on {self.device}")

    def _check_state_slot(self, state_slot: Any) -> None:
        if state_slot is None:
            return
        if self.state is None:
            raise ValueError("state_slot given but this cache has no recurrent-state component")
        if isinstance(state_slot, bool) or not isinstance(state_slot, int):
            raise TypeError(f"state_slot must be an int or None, got {type(state_slot).__name__}")
        size = getattr(self.state.allocator, "size", None)
        if state_slot < 1 or (size is not None and state_slot > size):
            raise ValueError(f"state_slot must be in [1, {size}], got {state_slot}")
        if state_slot in self.state.slot_to_node:
            raise ValueError(f"state_slot {state_slot} is already held by the tree")
        free = self.state.free_mask
        if free is not None and free[state_slot]:
            raise ValueError(
                f"state_slot {state_slot} is free in the state pool: the tree adopts only a slot "
                "the caller got from alloc"
            )

    def insert(
        self,
        key: Any,
        value: torch.Tensor,
        extra_key: Any = None,
        *,
        state_slot: int | None = None,
        priority: int = 0,
        rid: object = None,
    ) -> InsertResult:
        """Cache ``key`` with KV slots ``value`` (and a state checkpoint at its end).

        Args:
            key: a :class:`RadixKey` or token ids; only the leading whole pages are cached.
            value: 1-D int64 tensor of KV slots, ``len(value) == len(key)``, on the allocator's
                device.
            extra_key: namespace (LoRA adapter id, cache salt).
            state_slot: a state slot valid after ``inserted_len`` tokens, owned by the caller
                until adopted. Required on a hybrid cache when new tokens are added (a leaf
                never stays without a state).
            priority: request priority (``priority`` policy: a node keeps the max).
            rid: request id: a request counts once per node in ``hit_count``, also across its
                chunked-prefill re-inserts (the cache remembers how deep each rid counted until
                ``release_rid(rid)`` or ``cache_finished_req``; at most ``MAX_TRACKED_RIDS``).

        Returns:
            :class:`InsertResult`: ``duplicate_indices`` are the caller's to free,
            ``adopted_indices`` now belong to the tree, ``remainder_indices`` stay the caller's,
            ``state_adopted`` says who owns ``state_slot``.

        Raises:
            TypeError / ValueError: bad key or value; a slot the tree would adopt (the new
                tail, or what revival takes) that is outside the pool, free in the allocator,
                held by a node, repeated, or (paged) not whole pages in order; a
                ``state_slot`` that is free in the pool or held by the tree; an unhashable
                ``rid``; a missing state. Nothing changed then.

        Complexity: O(key length) in C (the walk's key comparison, ``radix/_match.c``; the
        adopted slots' checks, marks and copy in one pass, ``components/_claim.c``) plus
        O(matched nodes) in Python.
        """
        key, extra_key = resolve_key(key, extra_key)
        self._check_value(value, len(key))
        if state_slot is not None:
            self._check_state_slot(state_slot)
        if type(priority) is not int and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if rid is not None:
            try:
                hash(rid)
            except TypeError:
                raise TypeError(
                    f"rid must be hashable (an int, a str, an object), got {type(rid).__name__}"
                ) from None
        ps = self.page_size
        end = len(key) - len(key) % ps
        walk = self.tree.walk(key, end, extra_key)
        prefix_len = walk.matched_len
        if self.state is not None and prefix_len < end and state_slot is None:
            raise ValueError(
                "state_slot is required to insert new tokens into a cache with a recurrent-state "
                f"component (the key adds tokens [{prefix_len}, {end}) and a leaf never stays "
                "without a state)"
            )
        # The caller's slots the tree adopts: the new tail (with SWA, only when some of it
        # has live SWA KV) and what revival takes (tombstones, host-only nodes). One
        # vectorised claim validates and marks them: the last check before anything changes.
        if self.swa is not None:  # the SWA map is read at every position below
            self.kv.check_range(value[:end].cpu().numpy())
        plan = None
        if self.swa is not None or self.hicache is not None:
            plan = self._revival_plan(walk, value)
        live_from = prefix_len
        if self.swa is not None and prefix_len < end:
            live_from = self._live_suffix_start(value, prefix_len, end)
        grow = live_from < end
        # (a copy for the new leaf only when the new tail is one leaf)
        own = self._claim(value, plan, prefix_len if grow else end, end, live_from == prefix_len)
        # ---- validated: mutate from here on
        path = walk.path
        now = self._tick()
        if walk.partial is not None:
            path.append(self._split_touched(walk.partial, walk.partial_len, now))
        counted = 0 if rid is None else self._counted_depth(rid, end)
        revived = self._empty
        if self.swa is not None:
            assert plan is not None
            path, revived = self._revive_tombstones(path, value, plan)
        if self.hicache is not None:
            revived = self._revive_host_only(path, value)
        joint = self.state is not None and self.state.walk == "joint"
        for n in path:
            self._touch_insert(n, now, priority, counted, end)
            if joint or self.swa is not None:
                self._refresh(n)
        last = path[-1] if path else self.root
        tree_prefix = [n.kv_value for n in path]
        inserted = end
        if prefix_len < end:
            if not grow:
                inserted = prefix_len  # no live SWA KV at all: nothing worth caching
            else:
                if live_from == prefix_len:  # the common case: one live leaf
                    new: Any = (self._attach_leaf(last, key, value, prefix_len, end, extra_key,
                                                  now, True, own),)
                else:
                    new = self._add_tombstone_and_leaf(last, key, value, prefix_len, live_from,
                                                       end, extra_key, now)
                for n in new:
                    self._touch_insert(n, now, priority, counted, end)
                    last = n
                self._stats["inserted_tokens"] += end - prefix_len
        self._refresh(last)
        adopted = False
        if (
            state_slot is not None
            and self.state is not None
            and inserted == end
            and end > 0
            and last.state_slot is None
        ):
            self.state.set_state(last, state_slot, now)
            self._stats["inserted_states"] += 1
            adopted = True
        if self.hicache is not None:
            self._write_policy_backup(path, last)
        return InsertResult(prefix_len, inserted, last, adopted, revived, value, tree_prefix)  # type: ignore[arg-type]

    @staticmethod
    def _own(value: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """A node's own copy of ``value[lo:hi]`` (on the CPU sliced and copied in numpy: a
        third of torch's cost)."""
        if value.is_cpu:
            return torch.from_numpy(value.numpy()[lo:hi].copy())
        return value[lo:hi].clone()

    def _claim(self, value: torch.Tensor, plan: dict[int, int] | None, lo: int, hi: int,
               one_leaf: bool) -> torch.Tensor | None:
        """Claim (``KVComponent.claim``) the slots the insert adopts: ``value[lo:hi]`` and the
        revival ranges of ``plan``, as one tensor (a slot repeated across them is refused).

        Returns the claimed copy of ``value[lo:hi]`` when that is all the insert adopts, it
        becomes ``one_leaf`` and ``value`` is on the CPU (the common case: the new leaf keeps
        the copy), else ``None`` (the nodes copy their parts, :meth:`_own`)."""
        if not plan and value.is_cpu:  # the common case: only the new tail is adopted
            return self.kv.claim_trusted(value, lo, hi, one_leaf) if lo < hi else None
        ranges = sorted((t, end) for end, t in plan.items()) if plan else []
        if lo < hi:
            ranges.append((lo, hi))
        if ranges:
            parts = [value[a:b] for a, b in ranges]
            self.kv.claim((parts[0] if len(parts) == 1 else torch.cat(parts)).cpu())
        return None

    def _revival_plan(self, walk: Walk, value: torch.Tensor) -> dict[int, int]:
        """Where the insert revives matched nodes with the caller's slots, computed before
        anything changes: node end -> first position it takes from ``value``.

        SWA: a tombstoned, unlocked node whose slots the caller did not get from the tree,
        from the page where the caller's slots are live (``_revive_tombstones``). HiCache: a
        host-only node, whole (``_revive_host_only``). The node the walk ends inside counts
        with its matched part (it is split there first).
        """
        spans = [(n, n.start, n.depth, n.kv_value) for n in walk.path]
        part = walk.partial
        if part is not None:
            lo, kvv = part.start, part.kv_value
            spans.append((part, lo, lo + walk.partial_len,
                          None if kvv is None else kvv[: walk.partial_len]))
        plan: dict[int, int] = {}
        for n, lo, hi, kvv in spans:
            if self.swa is not None:
                if not n.swa_tombstone or n.kv_lock > 0:
                    continue  # live or in use
                assert kvv is not None  # a tombstone keeps its full-attention slots
                if bool((value[lo:hi] == kvv).any()):
                    continue  # the caller got (some of) these slots from the tree
                t = self._live_suffix_start(value, lo, hi)
                if t < hi:
                    plan[hi] = t
            elif kvv is None:
                plan[hi] = lo
        return plan

    def _revive_host_only(self, path: list[TreeNode], value: torch.Tensor) -> torch.Tensor:
        """Insert through host-only nodes: they take the caller's device slots (the caller
        computed those tokens itself; claimed by ``_claim``), keeping their host copy."""
        revived: list[torch.Tensor] = []
        for n in path:
            if n.kv_value is None:
                own = self._own(value, n.start, n.depth)
                self.kv.attach(n, own)  # the node keeps ``own`` itself as its kv_value
                revived.append(own)
        for n in path:
            self._refresh(n)
        if not revived:
            return self._empty
        return revived[0] if len(revived) == 1 else torch.cat(revived)

    def _write_policy_backup(self, path: list[TreeNode], last: TreeNode) -> None:
        """``write_through``: back up what was inserted; ``write_through_selective``: the
        deepest node hit at least twice (and its ancestors); ``write_back``: nothing now."""
        hc = self.hicache
        assert hc is not None
        policy = hc.config.hicache_write_policy
        target: TreeNode | None = None
        if policy == "write_through":
            target = last if last is not self.root else None
        elif policy == "write_through_selective":
            for n in [*path, last]:
                if n is not self.root and n.hit_count >= 2:
                    target = n
        if target is not None:
            if target.host_value is None:
                self._backup_chain(target)
            else:
                self._backup_state(target)
        self.poll_transfers()

    def _add_tombstone_and_leaf(self, parent: TreeNode, key: Any, value: torch.Tensor,
                                start: int, live_from: int, end: int, extra_key: Any,
                                now: int) -> list[TreeNode]:
        """Attach ``key[start:end]`` below ``parent`` as a tombstone ``[start, live_from)`` (its
        SWA KV already released by the caller) above a live leaf ``[live_from, end)`` (when not
        empty). Returns the new nodes, shallowest first."""
        node = parent
        created = []
        if self.swa is not None and live_from > start:
            dead_part = value[start:live_from]
            still = dead_part[self.swa.allocator.has_swa(dead_part)]
            if len(still):  # live slots before released ones: the tombstone owns no SWA KV
                self.swa.allocator.free_swa(still)
        for lo, hi, live in ((start, live_from, False), (live_from, end, True)):
            if lo == hi:
                continue
            node = self._attach_leaf(node, key, value, lo, hi, extra_key, now, live)
            created.append(node)
        return created

    def _attach_leaf(self, parent: TreeNode, key: Any, value: torch.Tensor, lo: int, hi: int,
                     extra_key: Any, now: int, live: bool,
                     own: torch.Tensor | None = None) -> TreeNode:
        """One new leaf for ``key[lo:hi]`` with its own copy of ``value[lo:hi]`` (claimed;
        ``own`` if already made) and, with SWA, live or tombstoned SWA KV; ``parent`` is
        re-filed (no longer a leaf)."""
        child = self.tree.add_leaf(parent, key[lo:hi], extra_key, now)
        self.kv.attach(child, self._own(value, lo, hi) if own is None else own)
        if self.swa is not None:
            self.swa.attach(child, live)
        if parent is not self.root:
            self._refresh(parent)
        return child

    def _live_suffix_start(self, value: torch.Tensor, lo: int, hi: int) -> int:
        """First page-aligned position in ``[lo, hi]`` from which every caller slot of
        ``value[lo:hi]`` still has live SWA KV (``hi`` when the last one has none)."""
        assert self.swa is not None
        live = self.swa.allocator.has_swa(value[lo:hi])
        if bool(live.all()):
            return lo
        dead = (~live).nonzero()
        t = lo + int(dead[-1]) + 1
        ps = self.page_size
        return min(hi, -(-t // ps) * ps)

    def _revive_tombstones(self, path: list[TreeNode], value: torch.Tensor,
                           plan: dict[int, int]) -> tuple[list[TreeNode], torch.Tensor]:
        """Insert over tombstones: where the caller still holds live SWA KV for a tombstoned,
        unlocked node's tokens (its own slots, not the tree's), the node takes the caller's
        slots and comes back to life; the tree frees its old full slots. A node only partly
        covered by live caller slots is split at the page where they start. Which nodes, from
        where: ``plan`` (``_revival_plan``, node end -> first revived position)."""
        swa = self.swa
        assert swa is not None
        out: list[TreeNode] = []
        revived: list[torch.Tensor] = []
        for n in path:
            t = plan.get(n.depth)
            if t is None:
                out.append(n)
                continue
            lo, hi = n.start, n.depth
            if t > lo:
                out.append(self.tree.split(n, t - lo))
            own = self._own(value, t, hi)
            self.kv.replace(n, own)  # the node keeps ``own`` itself as its kv_value
            swa.revive(n)
            revived.append(own)
            self._stats["revived_swa_tokens"] += hi - t
            out.append(n)
        if not revived:
            return out, self._empty
        return out, revived[0] if len(revived) == 1 else torch.cat(revived)

    def _counted_depth(self, rid: object, end: int) -> int:
        """How deep ``rid`` already counted in ``hit_count`` (0 for a new or absent rid);
        records ``end`` for its next insert."""
        if rid is None:
            return 0
        seen = self._rid_depth
        counted = seen.pop(rid, 0)
        seen[rid] = max(counted, end)
        if len(seen) > MAX_TRACKED_RIDS:
            seen.popitem(last=False)
        return counted

    def release_rid(self, rid: object) -> None:
        """Forget ``rid``'s hit-count depth (the request finished)."""
        self._rid_depth.pop(rid, None)

    @staticmethod
    def _touch_insert(n: TreeNode, now: int, priority: int, counted: int, end: int) -> None:
        n.last_access_time = now
        if n.depth > counted:
            n.hit_count += 1
        if priority > n.priority:
            n.priority = priority
        if end > n.history_len:
            n.history_len = end

    # ================================================================== locks
    def _check_node(self, node: Any, device: bool = True) -> TreeNode:
        """Validate a node handle; ``device``: it must also be on device (lockable)."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode from match_prefix/insert, got {type(node).__name__}")
        if not self.tree.is_attached(node):
            raise ValueError(f"node {node.id} is not in this cache (removed, reset, or another cache's)")
        if device and node.parent is not None and node.kv_value is None:
            raise ValueError(f"node {node.id} is host-only; load_back it before locking it")
        return node

    def inc_lock_ref(self, node: TreeNode) -> int | None:
        """Protect ``node``'s KV path, its state, and (SWA) the live nodes covering the last
        ``sliding_window_size`` tokens before it, while a request uses them.

        Returns:
            With an SWA component, the start position [tokens] of the SWA lock: pass it to
            :meth:`dec_lock_ref`; otherwise ``None`` (also for the root).

        Raises:
            TypeError / ValueError: not a node of this cache.
        """
        node = self._check_node(node)
        if node is self.root:
            return None
        node.lock_ref += 1
        self.kv.lock(node)
        if self.state is not None:
            self.state.lock(node)
        start = self.swa.lock(node) if self.swa is not None else None
        self._refresh(node)
        return start

    def dec_lock_ref(self, node: TreeNode, swa_lock_start: int | None = None) -> None:
        """Release one lock taken by :meth:`inc_lock_ref` on ``node``.

        Args:
            swa_lock_start: what ``inc_lock_ref`` returned (required with an SWA component).

        Raises:
            ValueError: ``node`` holds no lock (an unlock without a lock), a missing or wrong
                ``swa_lock_start``, or a node not in this cache. Nothing changes then.
        """
        node = self._check_node(node)
        if node is self.root:
            return
        self._check_unlock(node, swa_lock_start)
        node.lock_ref -= 1
        self.kv.unlock(node)
        if self.state is not None:
            self.state.unlock(node)
        if self.swa is not None:
            self.swa.unlock(node, swa_lock_start)  # type: ignore[arg-type]
        self._refresh(node)
        self._prune(node)

    def _check_unlock(self, node: TreeNode, swa_lock_start: Any, node_name: str = "node",
                      start_name: str = "swa_lock_start") -> None:
        """Raise ``ValueError`` unless :meth:`dec_lock_ref` may release a lock on ``node`` (a
        checked non-root node) with ``swa_lock_start``; the names say where they came from."""
        if node.lock_ref <= 0:
            raise ValueError(
                f"{node_name} {node.id} holds no lock of its own "
                "(pass the node inc_lock_ref was given)"
            )
        if self.swa is not None:
            if isinstance(swa_lock_start, bool) or not isinstance(swa_lock_start, int):
                raise ValueError(
                    f"{start_name} (the int inc_lock_ref returned) is required on an SWA cache, "
                    f"got {swa_lock_start!r}"
                )
            if not self.swa.can_unlock(node, swa_lock_start):
                raise ValueError(
                    f"{start_name}={swa_lock_start} does not match a lock on node {node.id}"
                )

    # =============================================================== eviction
    def _dead_leaf(self, node: TreeNode) -> bool:
        """An unlocked childless node nothing could ever resume from: no state (hybrid) or a
        tombstone (SWA)."""
        return (
            node.parent is not None
            and not node.children
            and node.kv_lock == 0
            and (
                (self.state is not None and node.state_slot is None and node.host_state_slot is None)
                or (self.swa is not None and node.swa_tombstone)
            )
        )

    def _remove_leaf(self, node: TreeNode) -> tuple[int, int, int]:
        """Remove a leaf whole, then the ancestors it leaves as dead leaves.

        Returns (full KV tokens, states, live SWA tokens) freed.
        """
        tokens = states = swa_tokens = 0
        state, swa = self.state, self.swa
        while True:
            tokens += len(node.key)
            if state is not None and node.state_slot is not None:
                states += 1
                state.on_remove(node)
            if swa is not None:
                if not node.swa_tombstone:
                    swa_tokens += len(node.key)
                swa.on_remove(node)
            self.kv.on_remove(node)
            if self.hicache is not None:
                self._free_host(node)
            parent = self.tree.remove_leaf(node)
            if parent is self.root:
                break
            if self._dead_leaf(parent):
                node = parent
                continue
            self._refresh(parent)
            break
        st = self._stats
        st["evicted_tokens"] += tokens
        if states:
            st["evicted_states"] += states
        if swa_tokens:
            st["evicted_swa_tokens"] += swa_tokens
        return tokens, states, swa_tokens

    def _prune(self, node: TreeNode) -> None:
        if self._dead_leaf(node):
            self._remove_leaf(node)

    @staticmethod
    def _check_count(n: Any, name: str) -> int:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int >= 0, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n}")
        return n

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
            self._check_count(num_tokens, "num_tokens")
        tokens = states = swa = 0
        pending = self._evict_pending
        start = pending[0]
        if self.hicache is None:  # no copies in flight: a leaf leaves whole
            free_leaf = self._remove_leaf
        else:
            free_leaf = self._evict_device_leaf
            # Earlier write-back evictions whose copies land now free their slots in this
            # call: counted in the result, not towards num_tokens (they leave the pending
            # count).
            st = self._stats
            t0, s0 = st["evicted_tokens"], st["evicted_states"]
            self.poll_transfers()
            tokens, states = st["evicted_tokens"] - t0, st["evicted_states"] - s0
        pop = self.kv.leaves.pop_first
        while tokens + pending[0] - start < num_tokens:  # write-back copies in flight count
            node = pop()
            if node is None:
                break
            t, s, w = free_leaf(node)
            tokens += t
            states += s
            swa += w
        return EvictResult(tokens, states, swa)

    def evict_states(self, num_states: int) -> EvictResult:
        """Free ``num_states`` recurrent states in the state walk's order (GDS or LRU).

        An internal node loses only its state (its KV stays); a leaf leaves whole.

        Raises:
            ValueError: the cache has no state component, or a bad count.
        """
        self._check_count(num_states, "num_states")
        state = self.state
        if state is None:
            raise ValueError("evict_states on a cache without a recurrent-state component")
        tokens = states = swa = 0
        pending = self._evict_pending
        start = pending[1]
        while states + pending[1] - start < num_states:  # write-back copies in flight count
            node = state.pop_victim()
            if node is None:
                break
            if node.children:
                state.remove_state(node)
                states += 1
                self._stats["evicted_states"] += 1
            else:
                t, s, w = self._evict_device_leaf(node)
                tokens += t
                states += s
                swa += w
                if node.state_slot is not None and node.owner:  # copy in flight: state stays
                    state.requeue(node)
        return EvictResult(tokens, states, swa)

    def evict_swa(self, num_tokens: int) -> EvictResult:
        """Free at least ``num_tokens`` SWA KV tokens, least recently used live nodes first:
        an internal node becomes a tombstone (its full KV stays), a leaf leaves whole.

        Raises:
            ValueError: the cache has no SWA component, or a bad count.
        """
        self._check_count(num_tokens, "num_tokens")
        swa_c = self.swa
        if swa_c is None:
            raise ValueError("evict_swa on a cache without a sliding-window component")
        tokens = states = swa = 0
        while swa < num_tokens:
            node = swa_c.pop_victim()
            if node is None:
                break
            if node.children:
                swa_c.tombstone(node)
                swa += len(node.key)
                self._stats["evicted_swa_tokens"] += len(node.key)
            else:
                t, s, w = self._remove_leaf(node)
                tokens += t
                states += s
                swa += w
        return EvictResult(tokens, states, swa)

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

    def state_evictable_size(self) -> int:
        """States [slots] held by the tree that no request locks (0 without a state component)."""
        return self.state.evictable_size() if self.state is not None else 0

    def state_protected_size(self) -> int:
        return self.state.protected_size() if self.state is not None else 0

    def swa_evictable_size(self) -> int:
        """Live SWA KV tokens no request's window protects (0 without an SWA component)."""
        return self.swa.evictable_size() if self.swa is not None else 0

    def swa_protected_size(self) -> int:
        return self.swa.protected_size() if self.swa is not None else 0

    @property
    def watermark(self) -> float:
        """The GDS watermark ``L`` (0.0 under the LRU walks; a custom walk's ``watermark``)."""
        return self.state.gds.watermark if self.state is not None and self.state.gds is not None else 0.0

    # ============================================================ maintenance
    def reset(self) -> None:
        """Free every cached slot and state back to the allocators and empty the tree.

        Raises:
            ValueError: a request still holds a lock (its slots would be freed under it).
        """
        if self.hicache is not None:
            self.poll_transfers()
        nodes = self.tree.iter_nodes()
        if any(n.kv_lock or n.lock_ref or n.swa_lock for n in nodes):
            raise ValueError("reset while requests hold locks or copies are in flight; release them first")
        for n in sorted(nodes, key=lambda x: -x.depth):
            self._remove_leaf_plain(n)
        if self.state is not None:
            self.state = self._new_state_component(self.state.allocator)
        if self.swa is not None:
            self.swa = SWAComponent(self.swa.allocator, self.swa.window)
        self.kv = KVComponent(self.kv.allocator, self.policy.kv_key, self.kv.host_tier)
        self._adopt_kv_order()
        self._init_tree()

    def _remove_leaf_plain(self, node: TreeNode) -> None:
        if self.state is not None and node.state_slot is not None:
            self.state.on_remove(node)
        if self.swa is not None:
            self.swa.on_remove(node)
        if node.kv_value is not None:
            self.kv.on_remove(node)
        if self.hicache is not None:
            self._free_host(node)
        self.tree.remove_leaf(node)

