"""The ``unified`` policy: one GreedyDual order over KV leaves and recurrent states, per byte.

With KV pages and state slots drawn from one memory arena (``allocators.arena``), the question
when memory is short is not "which KV leaf" or "which state" but which *bytes* cost the least
to lose. Both kinds are ranked in one GreedyDual-Size order (Cao and Irani, "Cost-Aware WWW
Proxy Caching Algorithms", USENIX USITS 1997: ``H = L + cost / size``), with the recompute
cost of the ``gds`` policy (FlashState's prefill fit, ``components.eviction.gds.gds_cost``)::

    state on node n (depth b):      priority = stamp + cost(a, b)               * MiB / S
    unlocked KV leaf n (depth b):   priority = stamp + cost(a, b) [if n has a state, else 0]
                                                       * MiB / (len(n.key) * K + S [if state])

``a`` is the depth of the nearest shallower device state (0 if none), ``K`` the KV bytes per
token, ``S`` the bytes one state frees (the arena's chunk), ``stamp`` the watermark ``L`` at
the candidate's last use; popping a victim raises ``L`` to its priority (one ``L`` for both
kinds). Costs are normalised per MiB so that priorities stay well above float rounding.

What a victim loses: a state's ``cost(a, b)`` (a request resuming at ``b`` re-prefills from
``a``); a leaf's the same (its state goes with it, under ``stateless_leaf="prune"``) for more
bytes, so a leaf always ranks below its own state; a leaf with no state (``"keep"``) holds
nothing a match can resume from: cost 0.

Lower-bound invariant (as ``gds``): every candidate's current heap entry is <= its true
priority. Stamps only rise; an evicted ancestor state raises ``a``'s cost; a split shortens
a leaf (fewer bytes, higher priority). A new state lowers the cost of the states and leaves
below it, and a leaf losing its state falls to cost 0: those get fresh entries.

``pop_byte_victim`` is what ``CacheCore.evict_bytes`` walks; ``pop_victim`` (states only) and
``kv_leaves.pop_first`` (KV leaves only) keep ``evict_states`` and ``evict`` in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from allocators import check_int
from allocators.arena import MemoryArena
from components.compaction import compact_kv
from components.eviction.boundary import BoundaryTarget
from components.eviction.gds import GDSStrategy, GreedyDualHeap, gds_cost
from components.kv import KVComponent

if TYPE_CHECKING:
    from radix.cache import RadixCache
    from radix.node import TreeNode
    from radix.results import EvictResult

__all__ = ["MIB", "UnifiedKVLeaves", "UnifiedStrategy", "make_room", "unified_bytes"]

#: Bytes per cost-normalisation unit.
MIB = 1 << 20

#: ``pop_byte_victim`` kinds.
KV_VICTIM, STATE_VICTIM = "kv", "state"


def _always(node: TreeNode) -> bool:
    return True


class UnifiedKVLeaves:
    """The unlocked KV leaves in the unified order: the part of the
    ``components.ordered.OrderedNodeSet`` interface ``components.kv.KVComponent`` uses
    (``update``, ``discard``, ``pop_first``, membership, iteration, ``len``, ``clear``,
    ``check``). ``update`` of a leaf whose ``last_access_time`` moved is a use (stamped at
    the watermark)."""

    def __init__(self, owner: UnifiedStrategy) -> None:
        self._owner = owner
        self.heap = GreedyDualHeap("unified-kv", lambda nid: 1.0, owner.leaf_cost)
        self.members: dict[int, TreeNode] = {}
        self._seen: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self.members

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(list(self.members.values()))

    def clear(self) -> None:
        self.heap = GreedyDualHeap("unified-kv", lambda nid: 1.0, self._owner.leaf_cost)
        self.heap.watermark = self._owner.heap.watermark
        self.members.clear()
        self._seen.clear()

    def update(self, node: TreeNode) -> None:
        """File ``node`` (a new leaf at the watermark, a used one stamped again)."""
        nid = node.id
        heap = self.heap
        t = node.last_access_time
        if nid in self.members:
            if self._seen.get(nid) != t:  # a use: the priority rises (the entry stays a
                self._seen[nid] = t       # lower bound); else filed again without one
                heap.touch(node)
            return
        self.members[nid] = node
        self._seen[nid] = t
        heap.add(node)
        if len(heap) > 4 * len(self.members) + 1024:
            heap.compact(self.members)

    def reseed(self, node: TreeNode) -> None:
        """``node``'s cost may have fallen (a state above it, or its own state gone): a fresh
        entry."""
        if node.id in self.members:
            self.heap.reseed(node)

    def discard(self, node: TreeNode) -> None:
        nid = node.id
        if self.members.pop(nid, None) is not None:
            del self._seen[nid]
            self.heap.remove(nid)

    def pop_first(self) -> TreeNode | None:
        """The leaf of least priority, removed; raises the shared watermark."""
        victim = self.heap.pop(self.members, _always, virtual=False)
        if victim is None or isinstance(victim, int):
            return None
        self._owner.raise_watermark(self.heap.watermark)
        self.discard(victim)
        self._owner.boundary.on_kv_evicted(victim)
        return victim

    def check(self) -> None:
        self.heap.check(list(self.members.values()))


class UnifiedStrategy(GDSStrategy):
    """The ``unified`` walk: the state walk of a hybrid cache whose ``kv_leaves`` the cache
    adopts as its KV order (module docstring: the priorities).

    Args:
        d, e: GDS cost coefficients (``components.eviction.registry`` defaults).
        kv_bytes_per_token: ``K``, bytes one KV token frees (``> 0``).
        state_bytes: ``S``, bytes one state frees (``> 0``; in an arena, its chunk).
        is_candidate: whether a node's state may be evicted now (the state component's).

    Raises:
        ValueError: a byte size that is not a positive int (naming it).
    """

    name = "unified"

    def __init__(self, d: float, e: float, kv_bytes_per_token: int, state_bytes: int,
                 is_candidate: Callable[[TreeNode], bool]) -> None:
        for name, v in (("kv_bytes_per_token", kv_bytes_per_token), ("state_bytes", state_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be an int > 0 [bytes], got {v!r}")
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes = state_bytes
        super().__init__(d, e, is_candidate)
        self.kv_leaves = UnifiedKVLeaves(self)
        #: Where an arena's boundary should be (``components.eviction.boundary``), learned
        #: from this walk's evictions and the cache's matches; ``make_room`` binds and reads it.
        self.boundary = BoundaryTarget(kv_bytes_per_token, state_bytes)

    # --------------------------------------------------------------- priority
    def weight(self, nid: int) -> float:
        """``MiB / S``: a state's cost per MiB freed."""
        return MIB / self.state_bytes

    def leaf_cost(self, node: TreeNode) -> float:
        """A KV leaf's cost per MiB freed (module docstring)."""
        own = len(node.key) * self.kv_bytes_per_token
        if node.state_slot is None:
            return 0.0
        cost = gds_cost(self.nearest_shallower_pos(node), node.depth, self.d, self.e)
        return cost * MIB / (own + self.state_bytes)

    def raise_watermark(self, level: float) -> None:
        """One ``L`` for both kinds: the higher of the two heaps' after a pop."""
        top = max(level, self.heap.watermark, self.kv_leaves.heap.watermark)
        self.heap.watermark = top
        self.kv_leaves.heap.watermark = top

    def is_candidate_state(self, node: TreeNode) -> bool:
        """Whether ``node``'s state may be evicted now (the state component's rule)."""
        return node.state_slot is not None and self._is_candidate(node)

    # ------------------------------------------------------------ state events
    def on_set(self, node: TreeNode) -> None:
        """A state was cached: as ``gds``, and the KV leaves below it (down to the next
        state) and ``node`` itself, when a leaf, get fresh entries."""
        super().on_set(node)
        leaves = self.kv_leaves
        leaves.reseed(node)
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            leaves.reseed(n)
            if n.state_slot is None:
                stack.extend(n.children.values())

    def on_remove(self, node: TreeNode) -> None:
        """The state left: a leaf kept without it (``stateless_leaf="keep"``) falls to
        cost 0: a fresh entry."""
        super().on_remove(node)
        self.kv_leaves.reseed(node)
        self.boundary.on_state_removed(node)

    def check(self, state_nodes: Sequence[TreeNode]) -> None:
        super().check(state_nodes)
        self.boundary.check()

    def on_match(self, kv_end: TreeNode | None, consumed: TreeNode | None,
                 key: Sequence[int], end: int) -> None:
        """Every match (``components.state.StateWalk``): the boundary target's ghost
        look-ups (``BoundaryTarget.on_match``)."""
        self.boundary.on_match(kv_end, consumed, key, end)

    def pop_victim(self) -> TreeNode | None:
        victim = super().pop_victim()
        if victim is not None:
            self.raise_watermark(self.heap.watermark)
        return victim

    # --------------------------------------------------------------------- walk
    def pop_byte_victim(self) -> tuple[str, TreeNode] | None:
        """The candidate of least priority over both kinds, removed from its order, with its
        kind (``"kv"``: an unlocked KV leaf, which leaves whole; ``"state"``: a state, on an
        internal node or a leaf); raises ``L`` to its priority. Ties go to the KV leaf (it
        frees more). ``None`` when nothing can go. O(log n) amortised."""
        level = self.heap.watermark
        leaves = self.kv_leaves
        state = self.heap.pop(self._live, self._is_candidate, virtual=False)
        leaf = leaves.heap.pop(leaves.members, _always, virtual=False)
        self.heap.watermark = leaves.heap.watermark = level
        s = state if state is not None and not isinstance(state, int) else None
        k = leaf if leaf is not None and not isinstance(leaf, int) else None
        if s is None and k is None:
            return None
        ps = self.heap.true_priority(s) if s is not None else None
        pk = leaves.heap.true_priority(k) if k is not None else None
        if k is not None and (ps is None or (pk is not None and pk <= ps)):
            if s is not None:
                self.heap.reseed(s)
            assert pk is not None
            self.raise_watermark(pk)
            leaves.discard(k)
            self.boundary.on_kv_evicted(k)
            return KV_VICTIM, k
        assert s is not None and ps is not None
        if k is not None:
            leaves.heap.reseed(k)
        self.raise_watermark(ps)
        return STATE_VICTIM, s


def unified_bytes(kv_allocator: object, state_allocator: object) -> tuple[int, int]:
    """``(K, S)``: KV bytes per token and bytes one state frees, for the ``unified`` policy.

    From the memory arena both allocators are views of (``allocators.arena``: ``S`` is the
    chunk a state occupies), else from the KV allocator's ``pool.bytes_per_token`` and the
    state pool's ``bytes_per_slot``.

    Raises:
        ValueError: neither is known (naming ``kv_allocator`` / ``state_allocator``).
    """
    arena = getattr(kv_allocator, "arena", None)
    shared = getattr(state_allocator, "arena", None) is arena
    if isinstance(arena, MemoryArena) and shared:
        return arena.kv_shape.bytes_per_token, arena.chunk_bytes
    pool = getattr(kv_allocator, "pool", None)
    k = getattr(pool, "bytes_per_token", None)
    if not isinstance(k, int):
        raise ValueError(
            "radix_eviction_policy='unified' weighs bytes: kv_allocator must be a MemoryArena "
            "view or have a pool (KVPool / KVBuffers) that gives bytes_per_token")
    s = getattr(state_allocator, "bytes_per_slot", None)
    if not isinstance(s, int):
        raise ValueError(
            "radix_eviction_policy='unified' weighs bytes: state_allocator must give "
            "bytes_per_slot (a MambaStatePool)")
    return k, s


def make_room(cache: RadixCache, arena: MemoryArena, *, kv_tokens: int = 0,
              states: int = 0, on_evict: Callable[[EvictResult], None] | None = None) -> bool:
    """Make ``arena`` able to hand out ``kv_tokens`` KV tokens and ``states`` state slots at
    once, the boundary held to the walk's learned target (``UnifiedStrategy.boundary``,
    ``components.eviction.boundary``; bound to ``arena`` at the first call, starting at its
    state band). ``band``: the chunks the states own; ``target``: the target in chunks; each
    side's *share* is its side of the target (states ``target`` chunks, KV the rest)::

        KV short      free state chunks move to KV (``MemoryArena.state_to_kv``) down to the
                      target, or below it while KV's locked tokens plus ``kv_tokens`` fit
                      in KV's share or KV owns no chunk (no KV evidence could lower the
                      target then); if states hold such chunks but in use: evict by value
                      (``cache.evict_bytes``); else KV frees its own (``cache.evict``, the
                      unified KV order) or the call fails
        states short  wholly free KV chunks move to the states (``kv_to_state``; free pages
                      scattered over partly used chunks first gathered by
                      ``components.compaction.compact_kv``) while ``band < target``, or past
                      it while the states in use plus ``states`` fit in the target; else,
                      below the target, evict by value; at or past it the states free their
                      own (``cache.evict_states``) or the call fails; a call that fails
                      short of states is a refusal (evidence for the target:
                      ``BoundaryTarget.on_state_refused``)

    Why "fit in its share": what a side took past its share stays evictable, so the other
    side can get back to its target. This call checks it only when it moves the boundary:
    an allocation that succeeds from memory a side already owns does not come here, so a
    side past its share can still lock more than its share (measured, and a guard at
    allocation tried and not kept: ``bench/results/2026-12-05-memory-split-5-guard.md``).
    A side at its share frees its own memory or fails, and an engine
    then finishes a running request (as it does with two pools of fixed sizes) rather than
    grow that side over the other's cached value. ``on_evict``, when given, receives each
    eviction's ``EvictResult`` (an engine counts its evicted tokens and states with it).

    Returns:
        ``True`` when the room is there (nothing allocated: the caller allocates next);
        ``False`` when the rule leaves it short with nothing more to evict (what was evicted
        stays evicted; the boundary is where it was), or at once, nothing evicted and no
        evidence recorded, when the request needs more chunks than the arena has
        (``ceil(kv_tokens / tokens_per_chunk) + states > num_chunks - 1``).

    Raises:
        TypeError: ``cache`` not a radix cache, ``arena`` not a :class:`MemoryArena`.
        TypeError / ValueError: bad counts or ``on_evict``; a cache whose policy is not
            ``"unified"``; an ``arena`` whose views are not the cache's allocators (nothing
            changes).
    """
    if not isinstance(arena, MemoryArena):
        raise TypeError(f"arena must be a MemoryArena, got {type(arena).__name__}")
    if not isinstance(getattr(cache, "kv", None), KVComponent):
        raise TypeError(f"cache must be a RadixCache, got {type(cache).__name__}")
    kv, st = arena.kv_allocator, arena.state_pool
    tpc = arena.tokens_per_chunk
    state = cache.state
    walk = state.gds if state is not None else None
    if state is None or not isinstance(walk, UnifiedStrategy):
        raise ValueError("make_room needs a cache with radix_eviction_policy='unified'")
    kv_tokens = check_int(kv_tokens, "kv_tokens", minimum=0)
    states = check_int(states, "states", minimum=0)
    if on_evict is not None and not callable(on_evict):
        raise TypeError(f"on_evict must be callable or None, got {type(on_evict).__name__}")
    if cache.kv.allocator is not kv or state.allocator is not st:
        raise ValueError("arena: the cache's kv_allocator and state_allocator are not this "
                         "arena's views (its evictions would free nothing here)")
    if -(-kv_tokens // tpc) + states > arena.num_chunks - 1:
        return False  # more chunks than the arena has: no eviction can make the room
    boundary = walk.boundary
    band = arena.num_state_chunks
    # capacity: the usable chunks (the padding chunk is never either kind's)
    boundary.observe((arena.num_chunks - 1) * arena.chunk_bytes, band * arena.chunk_bytes,
                     arena.kv_shape.page_size)
    target = boundary.target_chunks(arena.chunk_bytes)
    while True:
        kv_short = max(0, kv_tokens - kv.available_size())
        spare_states = st.available_size() - states
        if spare_states >= 0:
            need = -(-kv_short // tpc)
            room = band - target  # state chunks KV may take
            if room < need:
                locked = kv.owned_size() - kv.available_size() - cache.evictable_size()
                # (KV owning no chunk passes too: with no KV leaf there is no KV evidence
                # that could lower the target, so it would never get memory back)
                if locked + kv_tokens <= (arena.num_chunks - 1 - target) * tpc \
                        or arena.num_kv_chunks == 0:
                    room = band
            if need == 0 or need <= min(spare_states, room):
                return arena.state_to_kv(need)
            if room > spare_states:  # chunks KV may take, held by states: by value
                res = cache.evict_bytes((kv_short - spare_states * tpc)
                                        * walk.kv_bytes_per_token)
            else:  # KV at its share: it frees its own
                res = cache.evict(kv_short - max(room, 0) * tpc)
        else:
            need = -spare_states
            below = band < target
            in_use = band - st.available_size() - state.evictable_size()
            if (below or in_use + states <= target) \
                    and kv.available_size() - need * tpc >= kv_tokens:
                whole = arena.movable_kv_chunks()
                if whole >= need or compact_kv(cache, arena, need - whole):
                    return arena.kv_to_state(need)
            if below:  # KV past its share: by value
                res = cache.evict_bytes(need * walk.state_bytes
                                        + kv_short * walk.kv_bytes_per_token)
            else:  # states at their share: they free their own
                res = cache.evict_states(need)
        if on_evict is not None:
            on_evict(res)
        if res.num_tokens == 0 and res.num_states == 0:
            if spare_states < 0:
                boundary.on_state_refused(-spare_states)
            return False
