"""Replay-only state-eviction baselines: a Marconi-style utility and an offline reference.

Neither is offered to engines (they are not in ``radix.policies``): the offline one reads the
future of the trace, and the Marconi one needs its alpha tuned on the trace. Both are
*state walks* (:class:`components.state.StateWalk`: ``on_set`` / ``on_hit`` / ``on_use`` /
``on_remove`` / ``requeue`` / ``pop_victim`` / ``check`` and a ``watermark``), given to a cache
built with the ``gds`` policy through its ``state_walk=`` factory (the replay engine's
``state_walk`` field; :func:`state_walk_factory`). Everything else stays the library's: KV leaves are evicted in LRU order (the ``gds`` policy's KV key), a leaf's
state leaves with it, and a popped leaf state takes its leaf along (``evict_states``).

``marconi`` (Pan et al., MLSys 2025, section 4.2, from its description)::

    S(n) = recency(n) + alpha * flop_efficiency(n)       evict the lowest S

over the evictable states, both terms min-max normalised to ``[0, 1]`` over those candidates
at each eviction (a term with no spread counts 0). ``recency`` is the state's own access stamp
(set when cached or consumed by a hit; a hit refreshes only the state it used, as in
Marconi). ``flop_efficiency = cost(0, depth) / bytes(node)``: the prefill a hit on this prefix
saves (the GDS cost model of ``components.gds``) per byte the node holds (one state slot plus the KV of
its own edge, from a :mod:`bench.engine.presets` model). Nodes with at most one child are preferred,
as Marconi considers only those; branch points go only when nothing else can.
``alpha = 0`` is LRU on state stamps. How alpha is tuned: :mod:`bench.engine.simulator`.

``belady_state`` (the offline reference of the earlier tables; ``belady``, in
:mod:`bench.dev.policies.offline`, supersedes it): evict the state whose prefix is next needed farthest
in the future, states never needed again first (oldest first among those); KV leaves stay LRU. *Needed by request j*
means that request j's match key (its prompt minus the last token, page-aligned) starts with
the node's whole prefix. Next uses come from a trie over the trace's blocks
(:class:`NextUseIndex`); the replay tells the strategy which request it is serving
(``before_admit(i)``). With entries that differ in rebuild cost and depend on each other this
is not a proven bound: a state whose next use is far may be the only one under a long prompt,
and an online cost-aware policy can beat it. It is a reference, read beside the
infinite-memory bounds.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from bench.engine.metrics import COST_D, COST_E
from bench.engine.presets import ModelPreset
from bench.policies.baselines import Baseline, BaselineContext, register
from bench.traces.loader import TraceRequest
from components.state import StateWalk
from radix.node import TreeNode

__all__ = [
    "NEVER",
    "BeladyStrategy",
    "MarconiStrategy",
    "NextUseIndex",
    "PrefixTrieLookup",
    "StateStrategy",
    "minmax",
    "state_walk_factory",
]

NEVER = 1 << 62
"""Next-use index of a prefix no later request needs."""


class StateStrategy(StateWalk, Protocol):
    """A replay-side state walk: a :class:`components.state.StateWalk` that is also told which
    trace request the replay serves next (``before_admit``)."""

    def before_admit(self, index: int) -> None: ...


def state_walk_factory(
    make: Callable[[Callable[[TreeNode], bool]], StateStrategy], built: list[StateStrategy]
) -> Callable[[Callable[[TreeNode], bool]], StateStrategy]:
    """``make`` as a ``state_walk=`` factory that also appends every walk it builds to
    ``built`` (the replay drives the latest one: ``before_admit``, Marconi's alpha)."""

    def factory(is_candidate: Callable[[TreeNode], bool]) -> StateStrategy:
        walk = make(is_candidate)
        built.append(walk)
        return walk

    return factory


def minmax(x: np.ndarray) -> np.ndarray:
    """``(x - min) / (max - min)``; all zeros when ``x`` has no spread (or is empty)."""
    if x.size == 0:
        return x.astype(np.float64)
    lo, hi = float(x.min()), float(x.max())
    if hi <= lo:
        return np.zeros(x.shape, dtype=np.float64)
    return (x - lo) / (hi - lo)


class _LiveSet:
    """The nodes holding a state, in the order their states were set (shared bookkeeping)."""

    watermark = 0.0  # read by ``RadixCache.watermark``; these walks have none

    def __init__(self, is_candidate: Callable[[TreeNode], bool]) -> None:
        self._is_candidate = is_candidate
        self._live: dict[int, TreeNode] = {}
        self.evictions = 0
        self.first_eviction_index: int | None = None  # request being served at the first pop
        self.index = -1  # the request being served (``before_admit``)

    def before_admit(self, index: int) -> None:
        self.index = index

    def on_set(self, node: TreeNode) -> None:
        self._live[node.id] = node

    def on_use(self, node: TreeNode) -> None:
        """Released: nothing to do (recency is the node's own stamp)."""

    def on_hit(self, node: TreeNode) -> None:
        """Consumed: nothing to do (recency is the node's own stamp)."""

    def requeue(self, node: TreeNode) -> None:
        """Popped but kept (write-back copy in flight): tracked again."""
        self.on_set(node)

    def on_remove(self, node: TreeNode) -> None:
        self._live.pop(node.id, None)

    def _count_pop(self) -> None:
        self.evictions += 1
        if self.first_eviction_index is None:
            self.first_eviction_index = self.index

    def check(self, state_nodes: list[TreeNode]) -> None:
        live = {n.id for n in state_nodes}
        assert live == set(self._live), f"live state set differs: {live ^ set(self._live)}"


class MarconiStrategy(_LiveSet):
    """Marconi-style utility walk (module docstring). ``alpha`` may be changed between calls.

    Complexity: O(states) per eviction (the normalisation needs every candidate).
    """

    def __init__(self, is_candidate: Callable[[TreeNode], bool], model: ModelPreset,
                 alpha: float = 0.0, d: float = COST_D, e: float = COST_E) -> None:
        super().__init__(is_candidate)
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.state_bytes = model.state_bytes_per_slot
        self.kv_bytes = model.kv_bytes_per_token
        self.d, self.e = d, e

    def efficiency(self, node: TreeNode) -> float:
        """Prefill cost a hit here saves [cost units] per byte the node holds."""
        b = node.depth
        saved = self.d * b + self.e * b * b / 2e5
        return saved / (self.state_bytes + self.kv_bytes * len(node.key))

    def scores(self, nodes: Sequence[TreeNode]) -> np.ndarray:
        """``minmax(recency) + alpha * minmax(efficiency)`` over ``nodes``."""
        rec = np.fromiter((n.state_access_time for n in nodes), np.float64, len(nodes))
        score = minmax(rec)
        if self.alpha:
            eff = np.fromiter((self.efficiency(n) for n in nodes), np.float64, len(nodes))
            score = score + self.alpha * minmax(eff)
        return score

    def pop_victim(self) -> TreeNode | None:
        ok = self._is_candidate
        cands = [n for n in self._live.values() if ok(n)]
        if not cands:
            return None
        pref = [n for n in cands if len(n.children) <= 1] or cands
        victim = pref[int(np.argmin(self.scores(pref)))] if len(pref) > 1 else pref[0]
        self._count_pop()
        return victim


class NextUseIndex:
    """For any cached prefix, the next request (by trace index) that needs it.

    A trie over the first token of each trace block of every prompt; trie node ``t`` at block
    ``k`` lists the requests whose first ``k + 1`` blocks it covers. Two blocks with the same
    first token have the same content on their common length (block ``h`` of length ``n`` is
    the ids ``h*B+1 .. h*B+n``), so a prefix of ``p`` tokens is shared by exactly the requests
    listed at the trie node of block ``(p - 1) // B``. Request ``j`` needs it when also
    ``p <= cap_j``, the page-aligned length of its match key (``prompt[:-1]``).

    Build: O(total blocks). Query: O(log users) plus the users skipped for being too short.
    """

    def __init__(self, trace: Sequence[TraceRequest], page_size: int = 1) -> None:
        if not trace:
            raise ValueError("NextUseIndex needs a non-empty trace")
        blocks = {r.block_size for r in trace}
        if len(blocks) != 1:
            raise ValueError("all requests of a trace must share one block size")
        self.block = blocks.pop()
        self._child: dict[tuple[int, int], int] = {}
        self._users: list[list[int]] = [[]]
        self.caps = [(r.input_length - 1) // page_size * page_size for r in trace]
        for i, r in enumerate(trace):
            t = 0
            for tok in self.block_first_tokens(r):
                nxt = self._child.get((t, tok))
                if nxt is None:
                    nxt = len(self._users)
                    self._child[(t, tok)] = nxt
                    self._users.append([])
                t = nxt
                self._users[t].append(i)

    def block_first_tokens(self, r: TraceRequest) -> list[int]:
        """The first token id of each block of ``r``'s prompt (``O(blocks)`` from its runs)."""
        out: list[int] = []
        b = self.block
        pos = 0
        for first, length in r.runs:
            k = -(-pos // b) * b  # first block start inside this run
            while k < pos + length:
                out.append(first + k - pos)
                k += b
            pos += length
        return out

    def child(self, trie_node: int, token: int) -> int | None:
        return self._child.get((trie_node, token))

    def next_use(self, trie_node: int, prefix_len: int, now: int,
                 served: np.ndarray | None = None) -> int:
        """The first request ``j > now`` at ``trie_node`` with ``cap_j >= prefix_len`` (and,
        with ``served``, a boolean mask over requests, not served yet)."""
        users = self._users[trie_node]
        caps = self.caps
        for j in range(bisect_right(users, now), len(users)):
            r = users[j]
            if caps[r] >= prefix_len and (served is None or not served[r]):
                return r
        return NEVER

    def users(self, trie_node: int) -> list[int]:
        """The requests listed at ``trie_node``, in trace order (do not modify)."""
        return self._users[trie_node]

    def needs(self, trie_node: int, prefix_len: int, request: int) -> bool:
        """Whether ``request`` is listed at ``trie_node`` and its key holds ``prefix_len``."""
        users = self._users[trie_node]
        k = bisect_left(users, request)
        return k < len(users) and users[k] == request and self.caps[request] >= prefix_len


class PrefixTrieLookup:
    """The trie node of a tree node's prefix in :class:`NextUseIndex` ``uses``, memoised per
    tree node in ``_trie_of`` (for the offline strategies)."""

    uses: NextUseIndex
    _trie_of: dict[int, int | None]

    def trie_node(self, node: TreeNode) -> int | None:
        """The trie node of ``node``'s whole prefix (memoised per tree node: ids are unique
        and a split keeps the lower node's id and depth)."""
        memo = self._trie_of
        chain = []
        n = node
        while n.parent is not None and n.id not in memo:
            chain.append(n)
            n = n.parent
        t: int | None = memo[n.id] if n.parent is not None else 0
        for seg in reversed(chain):
            t = self._walk(t, seg, seg.depth)
            memo[seg.id] = t
        return t

    def _walk(self, t: int | None, seg: TreeNode, end: int) -> int | None:
        """From trie node ``t`` at ``seg``'s start, follow ``seg``'s blocks starting before
        position ``end``."""
        b = self.uses.block
        start = seg.depth - len(seg.key)
        k = -(-start // b) * b
        while t is not None and k < end:
            t = self.uses.child(t, seg.key[k - start])
            k += b
        return t


class BeladyStrategy(_LiveSet, PrefixTrieLookup):
    """Offline walk: evict the state needed farthest in the future (module docstring).

    A max-heap of ``(next use, set order)``; when the replay advances to request ``i``, the
    states whose next use was ``i`` get a fresh entry (their next use moved on), so every
    current entry is exact. Locked states are held back and pushed again after the pop.
    """

    def __init__(self, is_candidate: Callable[[TreeNode], bool], index: NextUseIndex) -> None:
        super().__init__(is_candidate)
        self.uses = index
        self._heap: list[tuple[int, int, int]] = []  # (-next use, seq, node id)
        self._seq = 0
        self._next: dict[int, int] = {}  # node id -> next use of its current entry
        self._due: dict[int, list[int]] = {}  # next use -> node ids
        self._trie_of = {}  # tree node id -> trie node of its prefix

    def next_use(self, node: TreeNode) -> int:
        t = self.trie_node(node)
        return NEVER if t is None else self.uses.next_use(t, node.depth, self.index)

    def _push(self, node: TreeNode) -> None:
        nu = self.next_use(node)
        self._next[node.id] = nu
        self._seq += 1
        heapq.heappush(self._heap, (-nu, self._seq, node.id))
        if nu != NEVER:
            self._due.setdefault(nu, []).append(node.id)

    def before_admit(self, index: int) -> None:
        """Request ``index`` is served now: states it was the next use of get a new entry."""
        self.index = index
        for nid in self._due.pop(index, ()):
            node = self._live.get(nid)
            if node is not None and self._next.get(nid) == index:
                self._push(node)

    def on_set(self, node: TreeNode) -> None:
        super().on_set(node)
        self._push(node)

    def on_remove(self, node: TreeNode) -> None:
        super().on_remove(node)
        self._next.pop(node.id, None)

    def pop_victim(self) -> TreeNode | None:
        heap, live = self._heap, self._live
        held = []
        victim = None
        while heap:
            entry = heapq.heappop(heap)
            node = live.get(entry[2])
            if node is None or self._next.get(node.id) != -entry[0]:
                continue  # stale: removed, or superseded by a newer entry
            if not self._is_candidate(node):
                held.append(entry)
                continue
            victim = node
            break
        for entry in held:
            heapq.heappush(heap, entry)
        if victim is not None:
            self._next.pop(victim.id, None)
            self._count_pop()
        return victim


def _belady_state(ctx: BaselineContext) -> Callable[[Callable[[TreeNode], bool]], StateStrategy]:
    index = ctx.next_use()
    return lambda ok: BeladyStrategy(ok, index)


register(Baseline("belady_state", _belady_state, offline=True))
