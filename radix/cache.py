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

from typing import TYPE_CHECKING, Any

import torch

from components.kv import KVComponent
from components.state import StateComponent
from radix.config import CacheConfig
from radix.node import TreeNode
from radix.results import CacheRequest, EvictResult, InsertResult, MatchResult
from radix.tree import RadixKey, RadixTree, resolve_key

if TYPE_CHECKING:
    from allocators import MambaStatePool, SlotAllocator


class RadixCache:
    """A radix-tree prefix cache with a full-attention KV component and, for hybrid models, a
    recurrent-state component.

    Args:
        config: page size and radix eviction policy (validated when built).
        kv_allocator: KV slot allocator; its ``page_size`` must equal ``config.page_size``.
        state_allocator: recurrent-state pool, or ``None`` for a KV-only cache.

    Raises:
        TypeError / ValueError: bad config or mismatched page sizes.
    """

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        kv_allocator: SlotAllocator,
        state_allocator: MambaStatePool | None = None,
    ) -> None:
        config = config if config is not None else CacheConfig()
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
        self.kv = KVComponent(kv_allocator, self.policy.kv_key)
        self.state: StateComponent | None = None
        if state_allocator is not None:
            self.state = self._new_state_component(state_allocator)
        self._clock = 0
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._init_tree()

    def _new_state_component(self, allocator: MambaStatePool) -> StateComponent:
        walk = self.policy.state_walk
        gds = (self.policy.knobs["d"], self.policy.knobs["e"]) if walk == "gds" else None
        return StateComponent(allocator, walk, gds)

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
        }
        self._last_watermark = 0.0

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

    def _split_touched(self, node: TreeNode, split_len: int, now: int) -> TreeNode:
        """Split a node the walk entered; the walk passed through it, so both halves carry
        the new stamp (as SGLang's RadixCache stamps the node before splitting it)."""
        node.last_access_time = now
        upper = self.tree.split(node, split_len)
        self.kv.refresh(node)
        if self.state is not None and self.state.walk == "joint" and node.state_slot is not None:
            self.state.refresh(node)
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
        ps = self.page_size
        end = len(key) - len(key) % ps
        walk = self.tree.walk(key, end, extra_key)
        path = walk.path
        now = self._tick()
        if walk.partial is not None:
            path.append(self._split_touched(walk.partial, walk.partial_len, now))
        kv_hit = walk.matched_len
        for n in path:
            n.last_access_time = now
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
            if usable > 0:
                node = path[usable - 1]
                state_slot = node.state_slot
                state.use(node, now)
        last = path[usable - 1] if usable else self.root
        prefix_len = last.depth if usable else 0
        if usable == 0:
            indices = self._empty
        elif usable == 1:
            indices = path[0].kv_value
        else:
            indices = torch.cat([n.kv_value for n in path[:usable]])  # type: ignore[misc]
        branching = None
        if state is not None and kv_hit > prefix_len:
            branching = kv_hit
        st = self._stats
        st["match_calls"] += 1
        st["match_tokens"] += len(key)
        st["hit_tokens"] += prefix_len
        st["kv_hit_tokens"] += kv_hit
        return MatchResult(
            device_indices=indices,  # type: ignore[arg-type]
            prefix_len=prefix_len,
            kv_hit_length=kv_hit,
            last_device_node=last,
            state_slot=state_slot,
            branching_seqlen=branching,
            last_host_node=last,
            host_hit_length=prefix_len,
        )

    # ============================================================== inserting
    def _check_value(self, value: Any, n: int) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value must be a 1-D torch.int64 tensor of KV slots, got {type(value).__name__}")
        if value.dtype != torch.int64:
            raise TypeError(f"value must have dtype torch.int64, got {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"value must be 1-D, got shape {tuple(value.shape)}")
        if len(value) != n:
            raise ValueError(f"value has {len(value)} slots but key has {n} tokens; lengths must match")
        if value.device != self.device:
            raise ValueError(f"value is on {value.device}, the KV allocator on {self.device}")
        return value

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
            rid: request id: a request counts once per node in ``hit_count``.

        Returns:
            :class:`InsertResult`: ``duplicate_indices`` are the caller's to free,
            ``adopted_indices`` now belong to the tree, ``remainder_indices`` stay the caller's,
            ``state_adopted`` says who owns ``state_slot``.

        Raises:
            TypeError / ValueError: bad key, value, slot or a missing state; nothing changed.
        """
        key, extra_key = resolve_key(key, extra_key)
        value = self._check_value(value, len(key))
        self._check_state_slot(state_slot)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
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
        # ---- validated: mutate from here on
        path = walk.path
        now = self._tick()
        if walk.partial is not None:
            path.append(self._split_touched(walk.partial, walk.partial_len, now))
        joint = self.state is not None and self.state.walk == "joint"
        for n in path:
            self._touch_insert(n, now, priority, rid, end)
            if joint and n.state_slot is not None:
                self.state.refresh(n)  # type: ignore[union-attr]
        last = path[-1] if path else self.root
        tree_prefix = [n.kv_value for n in path]
        if prefix_len < end:
            leaf = self.tree.add_leaf(last, key[prefix_len:end], extra_key, now)
            self.kv.attach(leaf, value[prefix_len:end])
            self._touch_insert(leaf, now, priority, rid, end)
            if last is not self.root:
                self.kv.refresh(last)
                if self.state is not None:
                    self.state.refresh(last)
            last = leaf
            self._stats["inserted_tokens"] += end - prefix_len
        self.kv.refresh(last)
        adopted = False
        if state_slot is not None and self.state is not None and end > 0 and last.state_slot is None:
            self.state.set_state(last, state_slot, now)
            self._stats["inserted_states"] += 1
            adopted = True
        return InsertResult(
            prefix_len=prefix_len,
            inserted_len=end,
            adopted_indices=value[prefix_len:end],
            remainder_indices=value[end:],
            last_node=last,
            state_adopted=adopted,
            _caller_prefix=value[:prefix_len],
            _tree_prefix=tree_prefix,  # type: ignore[arg-type]
        )

    @staticmethod
    def _touch_insert(n: TreeNode, now: int, priority: int, rid: object, end: int) -> None:
        n.last_access_time = now
        if rid is None or n.last_rid != rid:
            n.hit_count += 1
            n.last_rid = rid
        if priority > n.priority:
            n.priority = priority
        if end > n.history_len:
            n.history_len = end

    # ================================================================== locks
    def _check_node(self, node: Any) -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode from match_prefix/insert, got {type(node).__name__}")
        if not self.tree.is_attached(node):
            raise ValueError(f"node {node.id} is not in this cache (removed, reset, or another cache's)")
        return node

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node``'s KV path and its state from eviction while a request uses them.

        Raises:
            TypeError / ValueError: not a node of this cache.
        """
        node = self._check_node(node)
        if node is self.root:
            return
        self.kv.lock(node)
        if self.state is not None:
            self.state.lock(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one lock taken by :meth:`inc_lock_ref` on ``node``.

        Raises:
            ValueError: ``node`` is not locked (an unlock without a lock), or not in this cache.
        """
        node = self._check_node(node)
        if node is self.root:
            return
        if node.kv_lock <= 0 or (self.state is not None and node.state_lock <= 0):
            raise ValueError(f"dec_lock_ref on node {node.id}, which holds no lock")
        self.kv.unlock(node)
        if self.state is not None:
            self.state.unlock(node)
            self._prune(node)

    # =============================================================== eviction
    def _remove_leaf(self, node: TreeNode) -> tuple[int, int]:
        """Remove a leaf whole and the stateless, childless, unlocked ancestors it leaves.

        Returns (tokens freed, states freed).
        """
        tokens = states = 0
        state = self.state
        while True:
            tokens += len(node.key)
            if state is not None and node.state_slot is not None:
                states += 1
                state.on_remove(node)
            self.kv.on_remove(node)
            parent = self.tree.remove_leaf(node)
            if parent is self.root:
                break
            if state is not None and not parent.children and parent.state_slot is None and parent.kv_lock == 0:
                node = parent
                continue
            self.kv.refresh(parent)
            if state is not None:
                state.refresh(parent)
            break
        self._stats["evicted_tokens"] += tokens
        self._stats["evicted_states"] += states
        return tokens, states

    def _prune(self, node: TreeNode) -> None:
        """A hybrid leaf without a state can never be resumed: drop it once unlocked."""
        if (
            node.parent is not None
            and not node.children
            and node.state_slot is None
            and node.kv_lock == 0
        ):
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
        order (a freed leaf's state goes with it; whole nodes, so it may overshoot).

        Returns what was freed (less than asked when everything left is locked).
        Complexity: O(log n) per freed node.
        """
        self._check_count(num_tokens, "num_tokens")
        tokens = states = 0
        leaves = self.kv.leaves
        while tokens < num_tokens:
            node = leaves.pop_first()
            if node is None:
                break
            t, s = self._remove_leaf(node)
            tokens += t
            states += s
        return EvictResult(tokens, states)

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
        tokens = states = 0
        while states < num_states:
            node = state.pop_victim()
            if node is None:
                break
            if node.children:
                state.remove_state(node)
                states += 1
                self._stats["evicted_states"] += 1
            else:
                t, s = self._remove_leaf(node)
                tokens += t
                states += s
        return EvictResult(tokens, states)

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

    @property
    def watermark(self) -> float:
        """The GDS watermark ``L`` (0.0 when GDS is not the state walk)."""
        return self.state.gds.watermark if self.state is not None and self.state.gds else 0.0

    # ======================================================== request helpers
    def _path_indices(self, node: TreeNode) -> torch.Tensor:
        vals = [n.kv_value for n in reversed(node.path_to_root())]
        if not vals:
            return self._empty
        return vals[0] if len(vals) == 1 else torch.cat(vals)  # type: ignore[arg-type, return-value]

    def _check_req(self, req: Any, upto: Any) -> int:
        if not isinstance(req, CacheRequest):
            raise TypeError(f"req must be a CacheRequest, got {type(req).__name__}")
        n = len(req.kv_indices)
        if upto is None:
            upto = n
        self._check_count(upto, "upto")
        if upto > n or n > len(req.key):
            raise ValueError(
                f"need upto ({upto}) <= len(req.kv_indices) ({n}) <= len(req.key) ({len(req.key)})"
            )
        self._check_node(req.last_node)
        return upto

    def _free_state(self, slot: int | None, adopted: bool) -> None:
        if slot is not None and not adopted and self.state is not None:
            self.state.allocator.free(torch.tensor([slot], dtype=torch.int64))

    def _insert_req(self, req: CacheRequest, state_slot: int | None, upto: int) -> InsertResult:
        """Insert ``req.key[:upto]``; free the request's duplicate slots and an unadopted state.

        The request's slots in ``[cached_len, prefix_len)`` are its own copies of tokens the
        tree already holds (its slots below ``cached_len`` came from the tree): duplicates.
        """
        res = self.insert(req.key[:upto], req.kv_indices[:upto], req.extra_key,
                          state_slot=state_slot, priority=req.priority, rid=req.rid)
        if res.prefix_len > req.cached_len:
            self.kv.allocator.free(req.kv_indices[req.cached_len:res.prefix_len])
        self._free_state(state_slot, res.state_adopted)
        return res

    def cache_unfinished_req(self, req: CacheRequest, state_slot: int | None = None,
                             upto: int | None = None) -> InsertResult:
        """Chunked prefill: cache ``req.key[:upto]`` (default: every computed token) with a
        state checkpoint, keep the request's lock (moved down to the new node).

        Frees the request's duplicate KV slots and rewrites ``req.kv_indices[:inserted_len]``
        to the tree's slots; frees ``state_slot`` itself when the tree does not adopt it.

        Raises:
            TypeError / ValueError: bad request fields, ``upto`` out of range, or a missing
                state on a hybrid cache; nothing changed.
        """
        upto = self._check_req(req, upto)
        res = self._insert_req(req, state_slot, upto)
        n = res.inserted_len
        if res.prefix_len > req.cached_len:
            req.kv_indices = torch.cat([self._path_indices(res.last_node), req.kv_indices[n:]])
        self.inc_lock_ref(res.last_node)
        self.dec_lock_ref(req.last_node)
        req.last_node = res.last_node
        req.cached_len = n
        return res

    def cache_finished_req(self, req: CacheRequest, state_slot: int | None = None,
                           upto: int | None = None) -> InsertResult:
        """Cache ``req.key[:upto]`` (default: every computed token) with a state at its end,
        free duplicates and every computed slot not kept (``req.kv_indices[inserted_len:]``),
        release the request's lock. Frees ``state_slot`` when the tree does not adopt it.

        Raises:
            TypeError / ValueError: as :meth:`cache_unfinished_req`; nothing changed.
        """
        upto = self._check_req(req, upto)
        res = self._insert_req(req, state_slot, upto)
        tail = req.kv_indices[res.inserted_len:]
        if len(tail):
            self.kv.allocator.free(tail)
        self.dec_lock_ref(req.last_node)
        req.last_node = self.root
        req.cached_len = 0
        req.kv_indices = self._empty
        return res

    # ============================================================ maintenance
    def reset(self) -> None:
        """Free every cached slot and state back to the allocators and empty the tree.

        Raises:
            ValueError: a request still holds a lock (its slots would be freed under it).
        """
        nodes = self.tree.iter_nodes()
        if any(n.kv_lock or n.state_lock for n in nodes):
            raise ValueError("reset while requests hold locks; release them first")
        for n in sorted(nodes, key=lambda x: -x.depth):
            self._remove_leaf_plain(n)
        self.kv.leaves.clear()
        if self.state is not None:
            self.state = self._new_state_component(self.state.allocator)
        self.kv = KVComponent(self.kv.allocator, self.policy.kv_key)
        self._init_tree()

    def _remove_leaf_plain(self, node: TreeNode) -> None:
        if self.state is not None and node.state_slot is not None:
            self.state.on_remove(node)
        self.kv.on_remove(node)
        self.tree.remove_leaf(node)

    def stats(self) -> dict[str, Any]:
        """Counters: match calls, requested / usable-hit / KV-hit tokens, evicted tokens and
        states, inserted tokens and states, sizes per component, the watermark."""
        st = dict(self._stats)
        st.update(
            num_nodes=self.tree.num_nodes,
            kv_evictable=self.evictable_size(),
            kv_protected=self.protected_size(),
            state_evictable=self.state_evictable_size(),
            state_protected=self.state_protected_size(),
            watermark=self.watermark,
            policy=self.policy.name,
        )
        return st

    def pretty_print(self, file: Any = None) -> str:
        """Render the tree (one line per node: span, tokens, locks, state); print to ``file``."""
        lines = [f"root  policy={self.policy.name} page_size={self.page_size}"]

        def rec(node: TreeNode, indent: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.id):
                head = child.key[:6].tolist()
                lines.append(
                    f"{'  ' * indent}[{child.start},{child.depth}) id={child.id} "
                    f"key={head}{'...' if len(child.key) > 6 else ''} kv_lock={child.kv_lock} "
                    f"state={child.state_slot} state_lock={child.state_lock} "
                    f"t={child.last_access_time}"
                )
                rec(child, indent + 1)

        rec(self.root, 1)
        text = "\n".join(lines)
        if file is not None:
            print(text, file=file)
        return text

    def sanity_check(self) -> None:
        """Recompute every counter and check every invariant; raise ``AssertionError`` with
        the printed tree on failure."""
        try:
            self._sanity_check()
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.pretty_print()}") from None

    def _sanity_check(self) -> None:
        from radix.invariants import check_cache

        check_cache(self)
