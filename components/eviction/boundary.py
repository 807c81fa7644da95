"""Where a memory arena's KV / state boundary should be: an adaptive target learned from ghosts.

One :class:`allocators.arena.MemoryArena` holds KV pages and state slots in chunks of one
size; ``components.eviction.unified.make_room`` moves chunks across the boundary. Moved by
*demand* (a short side takes the other's free chunks), the band of the side that holds the
running requests' locked memory grows until the other side cannot get its chunks back.
Instead ``make_room`` holds the boundary to a target for the state band's bytes, moved by
what each side was seen to lose, as ARC moves its target (Megiddo and Modha, "ARC: A
Self-Tuning, Low Overhead Replacement Cache", FAST 2003: a hit in the ghost list of one side
grows that side's target)::

    state ghost hit:  a match would have used T more tokens had an evicted state (on a node
                      of its KV-matched path, below the state it used; or on a leaf that
                      left with it, the match's key continuing through the leaf's) stayed
                                                              -> target += T * K
    KV ghost hit:     a match would have used G more tokens had an evicted KV leaf with a
                      state (a child of the match's deepest node, its key all matched)
                      stayed                                  -> target -= G * K
    state refused:    make_room could not give n state slots  -> target += n * S
    target clamped to [0, capacity]

``K``: KV bytes per token; ``S``: bytes of one state (the arena's chunk). The ghost steps are
the bytes of KV that the tokens gained are, so the target moves toward the side that lost
more usable tokens, and rests where both lose at the same rate; a refusal (the state band at
its target, every state in use) is short by the refused states' bytes. A KV leaf without a
state is no evidence: a match resumes from a state, and KV past the deepest one is not used.

Ghosts (ARC's bounds: each remembers what the *other* side holds now, ``|B1| <= c - |T1|``;
the band is what the last ``make_room`` saw). Each is a dict in insertion order, oldest
forgotten first; a hit removes its entry (ARC moves a ghost hit out of its list):

* KV: ``(parent id, first page of the leaf's key) -> the leaf's tokens`` (``int64`` copy),
  recorded when an unlocked KV leaf with a state is evicted; at most the state band's bytes
  in KV tokens. A match looks it up with its deepest KV node (the root when none) and the
  key's next page; it is a hit when the key continues with every stored token (``G`` =
  their count).
* State: ``node id -> depth``, recorded when a state leaves a node; at most the KV band's
  bytes in states. (A leaf evicted with its state leaves an entry that never hits; the
  entry ages out.) A match walks from its deepest KV node up to the consumed state's node:
  the first node in the ghost gives ``T = its depth - the usable prefix``.
* Leaf (state side): ``(parent id, first page) -> the leaf's tokens``, recorded when a
  state leaves an unlocked leaf that no KV eviction is removing (the cache then prunes
  the stateless leaf: a loss of the state side that takes KV with it, which neither ghost
  above could see: the node is gone, and the KV order did not choose it); at most the KV
  band's bytes in states. Looked up as the KV ghost, and first: a hit gives ``T = kv_end's
  depth + the leaf's tokens - the usable prefix`` (the node walk is then skipped: the
  leaf's is the deepest state lost). A leaf's key is in at most one of the KV and leaf
  ghosts (recording it in one drops it from the other, as ARC's ghost lists are disjoint).
  A leaf whose parent is pruned with it leaves an entry that never hits (as for the KV
  ghost).

The target starts at the arena's state band when :meth:`BoundaryTarget.observe` first sees
the arena (``make_room``'s first call); nothing is recorded before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from radix.node import TreeNode

__all__ = ["BoundaryTarget"]


def _check_int(name: str, v: object, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


class BoundaryTarget:
    """The adaptive target of a memory arena's state band, in bytes (module docstring).

    Args:
        kv_bytes_per_token: ``K`` (``> 0``) [bytes].
        state_bytes: ``S``, bytes one state occupies (``> 0``; in an arena, its chunk).

    Raises:
        ValueError: an argument that is not a positive int, naming it.

    Attributes:
        target_bytes: the state band's target [bytes]; ``None`` until :meth:`observe`.
        capacity_bytes: the bytes both kinds share, the most the state band can own (the
            target's upper bound; an arena's usable chunks, its padding chunk left out)
            [bytes]; ``None`` until :meth:`observe`.
        band_bytes: the state band at the last :meth:`observe` [bytes].
        kv_ghost_hits / state_ghost_hits: ghost hits [matches]; ``kv_ghost_tokens`` /
            ``state_ghost_tokens``: the tokens they gave [tokens]; ``states_refused``: state
            slots refused [states].

    Complexity: :meth:`on_match` O(nodes between the match's usable prefix and its KV end +
    the hit ghost's tokens); the rest O(1) amortised (:meth:`on_kv_evicted` copies the leaf's
    key).
    """

    def __init__(self, kv_bytes_per_token: int, state_bytes: int) -> None:
        self.kv_bytes_per_token = _check_int("kv_bytes_per_token", kv_bytes_per_token, 1)
        self.state_bytes = _check_int("state_bytes", state_bytes, 1)
        self.page_size = 1
        self.target_bytes: float | None = None
        self.capacity_bytes: int | None = None
        self.band_bytes = 0
        self._root_id: int | None = None
        self._kv_ghost: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self._kv_ghost_tokens = 0
        self._state_ghost: dict[int, int] = {}
        self._leaf_ghost: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self._kv_victim: int | None = None
        self.kv_ghost_hits = self.state_ghost_hits = 0
        self.kv_ghost_tokens = self.state_ghost_tokens = 0
        self.states_refused = 0

    def observe(self, capacity_bytes: int, band_bytes: int, page_size: int) -> None:
        """The arena as ``make_room`` sees it: ``capacity_bytes`` in all, ``band_bytes`` of
        them the states'; KV pages of ``page_size`` tokens. The first call starts the target
        at ``band_bytes`` (capacity and page size are then fixed); every call sets
        :attr:`band_bytes` (the ghosts' bounds).

        Raises:
            ValueError: ``capacity_bytes`` or ``page_size`` not an int ``> 0``,
                ``band_bytes`` not an int in ``[0, capacity_bytes]`` (naming it).
        """
        _check_int("capacity_bytes", capacity_bytes, 1)
        _check_int("page_size", page_size, 1)
        if _check_int("band_bytes", band_bytes, 0) > capacity_bytes:
            raise ValueError(f"band_bytes={band_bytes} exceeds capacity_bytes={capacity_bytes}")
        if self.capacity_bytes is None:
            self.capacity_bytes = capacity_bytes
            self.page_size = page_size
            self.target_bytes = float(band_bytes)
        self.band_bytes = band_bytes

    def target_chunks(self, chunk_bytes: int) -> int:
        """The target in whole chunks of ``chunk_bytes`` (rounded to the nearest).

        Raises:
            RuntimeError: before :meth:`observe`.
        """
        if self.target_bytes is None:
            raise RuntimeError("BoundaryTarget.target_chunks before observe")
        return int(self.target_bytes / chunk_bytes + 0.5)

    # ------------------------------------------------------------------ evidence
    def _move(self, delta_bytes: float) -> None:
        assert self.target_bytes is not None and self.capacity_bytes is not None
        t = self.target_bytes + delta_bytes
        self.target_bytes = min(max(t, 0.0), float(self.capacity_bytes))

    def on_state_refused(self, num_states: int) -> None:
        """``make_room`` could not give ``num_states`` state slots: target ``+= n * S``."""
        if self.target_bytes is None:
            return
        self.states_refused += num_states
        self._move(num_states * self.state_bytes)

    def on_kv_evicted(self, leaf: TreeNode) -> None:
        """An unlocked KV leaf is being evicted (its key, parent and state still set):
        remember its tokens when it has a state."""
        parent = leaf.parent
        self._kv_victim = leaf.id
        if self.capacity_bytes is None or parent is None or leaf.state_slot is None:
            return
        gk, toks = self._leaf_key(leaf, parent)
        self._leaf_ghost.pop(gk, None)  # a lost leaf is in one ghost (ARC's lists are disjoint)
        self._forget_kv(gk)
        ghost = self._kv_ghost
        ghost[gk] = toks
        self._kv_ghost_tokens += len(toks)
        limit = self.band_bytes // self.kv_bytes_per_token
        while self._kv_ghost_tokens > limit and ghost:
            self._kv_ghost_tokens -= len(ghost.pop(next(iter(ghost))))

    def _leaf_key(self, leaf: TreeNode, parent: TreeNode
                  ) -> tuple[tuple[int, tuple[int, ...]], np.ndarray]:
        if parent.parent is None:
            self._root_id = parent.id
        toks = np.array(leaf.key, dtype=np.int64)
        return (parent.id, tuple(toks[: self.page_size].tolist())), toks

    def on_state_removed(self, node: TreeNode) -> None:
        """A state left ``node``: remember where. On an unlocked leaf that a KV eviction
        is not removing, the leaf leaves with it (a stateless leaf is pruned), so its tokens
        are remembered too (the leaf ghost: a state loss that takes KV with it)."""
        if self.capacity_bytes is None:
            return
        kv_victim, self._kv_victim = self._kv_victim, None
        ghost = self._state_ghost
        ghost.pop(node.id, None)
        ghost[node.id] = node.depth
        limit = (self.capacity_bytes - self.band_bytes) // self.state_bytes
        while len(ghost) > limit:
            del ghost[next(iter(ghost))]
        parent = node.parent
        if node.id == kv_victim or parent is None or node.children or node.kv_lock:
            return
        gk, toks = self._leaf_key(node, parent)
        self._forget_kv(gk)
        leaves = self._leaf_ghost
        leaves.pop(gk, None)
        leaves[gk] = toks
        while len(leaves) > limit:
            del leaves[next(iter(leaves))]

    def _forget_kv(self, gk: tuple[int, tuple[int, ...]]) -> None:
        """Drop the KV ghost's entry ``gk`` (and its tokens from the count), if any."""
        old = self._kv_ghost.pop(gk, None)
        if old is not None:
            self._kv_ghost_tokens -= len(old)

    def on_match(self, kv_end: TreeNode | None, consumed: TreeNode | None,
                 key: Sequence[int], end: int) -> None:
        """A match of ``key[:end]`` reached ``kv_end`` (its deepest KV-matched node; ``None``:
        nothing matched) and used the state on ``consumed`` (``None``: none): look both
        ghosts up and move the target (module docstring)."""
        if self.target_bytes is None:
            return
        base = consumed.depth if consumed is not None else 0
        g = self._ghost_hit(self._leaf_ghost, kv_end, key, end)
        if g:  # the deepest state lost: the leaf's, whose KV left with it
            self._state_hit((kv_end.depth if kv_end is not None else 0) + g - base)
        else:
            ghost = self._state_ghost
            n = kv_end
            while ghost and n is not None and n is not consumed and n.depth > base:
                if ghost.pop(n.id, None) is not None:
                    self._state_hit(n.depth - base)
                    break
                n = n.parent
        g = self._ghost_hit(self._kv_ghost, kv_end, key, end)
        if g:
            self._kv_ghost_tokens -= g
            self.kv_ghost_hits += 1
            self.kv_ghost_tokens += g
            self._move(-g * self.kv_bytes_per_token)

    def _state_hit(self, t: int) -> None:
        self.state_ghost_hits += 1
        self.state_ghost_tokens += t
        self._move(t * self.kv_bytes_per_token)

    def _ghost_hit(self, ghost: dict[tuple[int, tuple[int, ...]], np.ndarray],
                   kv_end: TreeNode | None, key: Sequence[int], end: int) -> int:
        """Tokens of the leaf entry of ``ghost`` below ``kv_end`` when ``key[:end]``
        continues with all of them (the entry then leaves ``ghost``), else 0."""
        if not ghost:
            return 0
        depth = kv_end.depth if kv_end is not None else 0
        parent_id = kv_end.id if kv_end is not None else self._root_id
        ps = self.page_size
        if parent_id is None or depth + ps > end:
            return 0
        gk = (parent_id, tuple(int(x) for x in key[depth: depth + ps]))
        toks = ghost.get(gk)
        if toks is None:
            return 0
        g = len(toks)
        if depth + g > end or not np.array_equal(
                np.asarray(key[depth: depth + g], dtype=np.int64), toks):
            return 0
        del ghost[gk]
        return g

    def check(self) -> None:
        """Assert the ghosts' counters and the target's range (bounds hold at each record;
        a later band change moves them, so they are not invariants)."""
        assert self._kv_ghost_tokens == sum(len(v) for v in self._kv_ghost.values())
        if self.capacity_bytes is None:
            assert not self._kv_ghost and not self._state_ghost and self.target_bytes is None
            return
        assert self.target_bytes is not None
        assert 0.0 <= self.target_bytes <= self.capacity_bytes
