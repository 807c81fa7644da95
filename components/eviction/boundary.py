"""Where a memory arena's KV / state boundary should be: an adaptive target learned from ghosts.

One :class:`allocators.arena.MemoryArena` holds KV pages and state slots in chunks of one
size; ``components.eviction.unified.make_room`` moves free chunks across the boundary. Moving
them by *demand* (whichever side is short takes the other's free chunks) lets the band of the
side that holds the running requests' locked memory grow without bound. Instead the boundary
follows a target for the state band's bytes, moved by the value each side was seen to lose,
as ARC moves its target (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST 2003: a hit in the ghost list of one side grows that side's target)::

    ghost hit on the state side:  T tokens a match would have used had an evicted state
                                  (still on the matched path) stayed   -> target += T * K
    ghost hit on the KV side:     G tokens a match would have matched had an evicted KV
                                  leaf (a child of the match's deepest node) stayed
                                                                       -> target -= G * K
    target clamped to [0, capacity]

``K`` is the KV bytes per token: both steps are the bytes of KV those tokens are, so the
target moves toward the side that lost more tokens per match, and stops moving when both lose
at the same rate. No step size or rate is a tuned constant; the only sizes are the ghosts'
bounds, ARC's: each ghost remembers at most the arena's bytes of what it lost (KV tokens
``* K``, states ``* S``), the oldest forgotten first.

Ghost entries (each dict in insertion order, the oldest first; a hit removes its entry, as
ARC moves a ghost hit out of its ghost list):

* KV: ``(parent id, first page of the leaf's key) -> the leaf's tokens`` (a copy, ``int64``),
  recorded when an unlocked KV leaf is evicted; at a match, looked up with the match's deepest
  KV node and the key's next page; ``G`` is the common prefix of the stored tokens and the
  key's rest, cut to whole pages.
* State: ``node id -> depth``, recorded when a state leaves a node; at a match, the deepest
  node of the KV-matched path below the consumed state that is in the ghost gives
  ``T = its depth - the usable prefix``.

The target starts at the arena's state band when :meth:`BoundaryTarget.bind` first sees the
arena (``make_room`` binds it); evidence before that is not recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["BoundaryTarget"]


class BoundaryTarget:
    """The adaptive target of a memory arena's state band, in bytes (module docstring).

    Args:
        kv_bytes_per_token: ``K`` (``> 0``) [bytes].
        state_bytes: ``S``, bytes one state occupies (``> 0``; in an arena, its chunk).

    Raises:
        ValueError: an argument that is not a positive int, naming it.

    Attributes:
        target_bytes: the state band's target [bytes]; ``None`` until bound.
        capacity_bytes: the arena's bytes (the target's upper bound, each ghost's bound);
            ``None`` until bound.
        kv_ghost_hits / state_ghost_hits: ghost hits seen [matches]; ``kv_ghost_tokens`` /
            ``state_ghost_tokens`` the tokens they gave [tokens].
    """

    def __init__(self, kv_bytes_per_token: int, state_bytes: int) -> None:
        for name, v in (("kv_bytes_per_token", kv_bytes_per_token),
                        ("state_bytes", state_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be an int > 0, got {v!r}")
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes = state_bytes
        self.page_size = 1
        self._root_id: int | None = None
        self.target_bytes: float | None = None
        self.capacity_bytes: int | None = None
        self._kv_ghost: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self._kv_ghost_tokens = 0
        self._state_ghost: dict[int, int] = {}
        self.kv_ghost_hits = self.state_ghost_hits = 0
        self.kv_ghost_tokens = self.state_ghost_tokens = 0
        self.states_refused = 0
        self.band_bytes = 0

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has been called."""
        return self.capacity_bytes is not None

    def bind(self, capacity_bytes: int, state_band_bytes: int, page_size: int) -> None:
        """Start learning: the target starts at ``state_band_bytes``, clamped to
        ``[0, capacity_bytes]``; ghost keys use the first page of ``page_size`` tokens. A
        second call changes nothing.

        Raises:
            ValueError: ``capacity_bytes`` or ``page_size`` not an int ``> 0``,
                ``state_band_bytes`` not an int ``>= 0`` (naming it).
        """
        for name, v, low in (("capacity_bytes", capacity_bytes, 1),
                             ("state_band_bytes", state_band_bytes, 0),
                             ("page_size", page_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.capacity_bytes is None:
            self.capacity_bytes = capacity_bytes
            self.page_size = page_size
            self.target_bytes = float(min(state_band_bytes, capacity_bytes))

    def target_chunks(self, chunk_bytes: int) -> int:
        """The target in whole chunks of ``chunk_bytes`` (rounded to the nearest); raises
        ``RuntimeError`` before :meth:`bind`."""
        if self.target_bytes is None:
            raise RuntimeError("BoundaryTarget.target_chunks before bind")
        return int(self.target_bytes / chunk_bytes + 0.5)

    # ------------------------------------------------------------------ evidence
    def move(self, tokens: int) -> None:
        """Move the target by ``tokens * K`` bytes (``> 0``: toward states), clamped."""
        if self.target_bytes is None or self.capacity_bytes is None:
            return
        t = self.target_bytes + tokens * self.kv_bytes_per_token
        self.target_bytes = min(max(t, 0.0), float(self.capacity_bytes))

    def on_state_refused(self, num_states: int) -> None:
        """``num_states`` states were refused for want of a slot (the band at its target, every
        state in use): the band lacked their bytes, ``num_states * S``."""
        if self.target_bytes is None or self.capacity_bytes is None:
            return
        self.states_refused += num_states
        t = self.target_bytes + num_states * self.state_bytes
        self.target_bytes = min(t, float(self.capacity_bytes))

    def on_kv_evicted(self, leaf: TreeNode) -> None:
        """An unlocked KV leaf is leaving (its key and parent still set): remember its tokens."""
        parent = leaf.parent
        if self.capacity_bytes is None or parent is None or leaf.state_slot is None:
            return
        if parent.parent is None:
            self._root_id = parent.id
        toks = np.array(leaf.key, dtype=np.int64)
        gk = (parent.id, tuple(toks[: self.page_size].tolist()))
        old = self._kv_ghost.pop(gk, None)
        if old is not None:
            self._kv_ghost_tokens -= len(old)
        self._kv_ghost[gk] = toks
        self._kv_ghost_tokens += len(toks)
        limit = self.band_bytes // self.kv_bytes_per_token
        ghost = self._kv_ghost
        while self._kv_ghost_tokens > limit and ghost:
            self._kv_ghost_tokens -= len(ghost.pop(next(iter(ghost))))

    def on_state_removed(self, node: TreeNode) -> None:
        """A state left ``node``: remember where."""
        if self.capacity_bytes is None:
            return
        ghost = self._state_ghost
        ghost.pop(node.id, None)
        ghost[node.id] = node.depth
        limit = (self.capacity_bytes - self.band_bytes) // self.state_bytes
        while len(ghost) > limit:
            del ghost[next(iter(ghost))]

    def on_match(self, kv_end: TreeNode | None, consumed: TreeNode | None,
                 key: Sequence[int], end: int) -> None:
        """A match of ``key[:end]`` reached ``kv_end`` (deepest KV-matched node, ``None``:
        nothing) and used the state on ``consumed`` (``None``: none): look both ghosts up
        and move the target (module docstring). O(nodes between the two + a ghost's
        tokens)."""
        if self.capacity_bytes is None:
            return
        base = consumed.depth if consumed is not None else 0
        if kv_end is not None and self._state_ghost:
            n: TreeNode | None = kv_end
            ghost = self._state_ghost
            while n is not None and n is not consumed and n.depth > base:
                if n.id in ghost:
                    del ghost[n.id]
                    t = n.depth - base
                    self.state_ghost_hits += 1
                    self.state_ghost_tokens += t
                    self.move(t)
                    break
                n = n.parent
        if not self._kv_ghost:
            return
        depth = kv_end.depth if kv_end is not None else 0
        parent_id = kv_end.id if kv_end is not None else self._root_id
        ps = self.page_size
        if depth + ps > end or parent_id is None:
            return
        page = tuple(int(x) for x in key[depth: depth + ps])
        gk = (parent_id, page)
        toks = self._kv_ghost.pop(gk, None)
        if toks is None:
            return
        self._kv_ghost_tokens -= len(toks)
        n_cmp = min(len(toks), end - depth)
        rest = np.asarray(key[depth: depth + n_cmp], dtype=np.int64)
        diff = np.flatnonzero(rest != toks[:n_cmp])
        g = len(toks) if diff.size == 0 and n_cmp == len(toks) else 0
        if g > 0:
            self.kv_ghost_hits += 1
            self.kv_ghost_tokens += g
            self.move(-g)

    def check(self) -> None:
        """Assert the ghosts' counters and bounds and the target's range."""
        assert self._kv_ghost_tokens == sum(len(v) for v in self._kv_ghost.values())
        if self.capacity_bytes is None:
            assert not self._kv_ghost and not self._state_ghost and self.target_bytes is None
            return
        assert self.target_bytes is not None and 0.0 <= self.target_bytes <= self.capacity_bytes
        assert self._kv_ghost_tokens <= self.capacity_bytes // self.kv_bytes_per_token
        assert len(self._state_ghost) <= self.capacity_bytes // self.state_bytes
