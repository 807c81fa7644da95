"""Compaction of a memory arena's KV band: empty whole chunks so the states can take them.

In a :class:`~allocators.arena.MemoryArena` a chunk changes hands only when wholly free, and
KV pages freed by eviction lie wherever their leaves lay. Without compaction, free KV pages
scattered over partly used chunks cannot become a state slot, so the boundary moves towards
KV and stays there (a ratchet). :func:`compact_kv` moves the live pages of the chunks that
are cheapest to empty into free pages of other KV chunks and rewrites the slot ids the radix
tree's nodes hold::

    before   chunk 3: [a . b .]   chunk 5: [. . c .]   chunk 6: [. . . .]  (a, b, c: node pages)
    n = 1    chunk 5 holds the fewest used pages -> c moves to the lowest free page (chunk 3)
    after    chunk 3: [a c b .]   chunk 5: [. . . .]   (wholly free: kv_to_state can take it)

Which chunks: KV chunks each of whose used pages is held by an *unlocked* tree node (a page
of a locked node, or one a request holds outside the tree, is never moved), fewest used pages
first (least copying; ties: the highest chunk, next to the state band). Where to: the lowest
free KV pages of the other partly used chunks. All or nothing: the plan is made and checked before
anything changes (``MemoryArena.relocate_kv_pages`` validates, copies the bytes, updates the
free list; ``KVComponent.relocate`` gives the nodes new arrays and moves their held marks).

Cost: one walk of the tree's nodes, O(nodes + the chunks each touches) with the chunk counts
of each node's array computed once per array (``_ChunkCounts``), then O(slots) of the nodes
that move, the copy of the moved pages' bytes and the moved nodes' new arrays.
"""

from __future__ import annotations

import weakref
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np

from allocators.arena import KV, MemoryArena
from components.kv import KVValue, cat_values

if TYPE_CHECKING:
    from radix.cache import RadixCache
    from radix.node import TreeNode

__all__ = ["compact_kv"]


class _ChunkCounts:
    """Per node array, the chunks its pages lie in and how many in each: computed once per
    array (a node's ``array('q')`` is never written: ``components.kv``), kept while the
    array lives (a weak reference tells a reused ``id`` apart), dropped when no node
    held it at the last walk. Makes a walk O(nodes + chunks touched), not O(cached tokens)."""

    def __init__(self, pages_per_chunk: int, page_size: int) -> None:
        self.ppc = pages_per_chunk
        self.ps = page_size
        self.entries: dict[int, tuple[weakref.ref[Any], np.ndarray, np.ndarray]] = {}

    def pages(self, value: KVValue) -> np.ndarray:
        """The page ids of a node value (int64, in token order)."""
        slots = cat_values([value]).numpy()
        return slots if self.ps == 1 else slots[:: self.ps] // self.ps

    def of(self, value: KVValue) -> tuple[np.ndarray, np.ndarray]:
        """``(chunks, counts)`` of ``value``'s pages (ascending chunk ids)."""
        key = id(value)
        got = self.entries.get(key)
        if got is not None and got[0]() is value:
            return got[1], got[2]
        chunks, counts = np.unique(self.pages(value) // self.ppc, return_counts=True)
        if type(value) is array:
            self.entries[key] = (weakref.ref(value), chunks, counts)
        return chunks, counts

    def keep_only(self, values: list[KVValue]) -> None:
        """Drop the entries of arrays not in ``values``."""
        old = self.entries
        self.entries = {id(v): old[id(v)] for v in values if id(v) in old}


#: One :class:`_ChunkCounts` per arena (derived facts only: dropping it changes no result).
_COUNTS: weakref.WeakKeyDictionary[MemoryArena, _ChunkCounts] = weakref.WeakKeyDictionary()


def _counts_for(arena: MemoryArena, page_size: int) -> _ChunkCounts:
    got = _COUNTS.get(arena)
    if got is None or got.ps != page_size:
        got = _COUNTS[arena] = _ChunkCounts(arena.pages_per_chunk, page_size)
    return got


def compact_kv(cache: RadixCache, arena: MemoryArena, num_chunks: int) -> bool:
    """Make ``num_chunks`` more KV chunks of ``arena`` wholly free by moving the pages of
    unlocked tree nodes (module docstring: which chunks, where to), so that
    ``arena.kv_to_state`` can hand them to the states.

    Args:
        cache: the radix cache whose KV allocator is ``arena.kv_allocator``.
        arena: the memory arena.
        num_chunks: chunks to empty (``>= 0``), beyond those wholly free already.

    Returns:
        ``True`` when moved (or nothing to do); ``False``, nothing changed, when too few
        chunks can be emptied (pinned pages) or the other chunks lack the free pages.

    Raises:
        ValueError: ``cache`` does not allocate its KV from ``arena``; a bad ``num_chunks``.
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 0:
        raise ValueError(f"num_chunks must be an int >= 0, got {num_chunks!r}")
    if cache.kv.allocator is not arena.kv_allocator:
        raise ValueError("cache: its KV allocator is not this arena's kv_allocator")
    if num_chunks == 0:
        return True
    ppc = arena.pages_per_chunk
    free = arena.kv_free_per_chunk
    room = int(free.sum()) - arena.movable_kv_chunks() * ppc  # free pages, partly used chunks
    if room < num_chunks * ppc:
        return False  # the other chunks could not take the pages
    if cache.kv.evictable_size() == 0:
        return False  # every cached page is locked: nothing may move (no walk needed)
    counts = _counts_for(arena, cache.kv.page_size)
    n = arena.num_chunks
    nodes: list[TreeNode] = []
    values: list[KVValue] = []
    values_of: list[KVValue] = []  # the unlocked nodes' values
    touched: list[np.ndarray] = []
    held: list[np.ndarray] = []
    locked: list[np.ndarray] = []
    for node in cache.tree.iter_nodes():
        value = node.kv_value
        if value is None:
            continue
        chunks, k = counts.of(value)
        values.append(value)
        if node.kv_lock:
            locked.append(chunks)
        else:
            nodes.append(node)
            values_of.append(value)
            touched.append(chunks)
            held.append(k)
    counts.keep_only(values)
    pinned = np.zeros(n, dtype=np.bool_)
    if locked:
        pinned[np.concatenate(locked)] = True
    movable = np.zeros(n, dtype=np.int64)
    all_touched = np.concatenate(touched) if touched else np.empty(0, dtype=np.int64)
    if touched:
        np.add.at(movable, all_touched, np.concatenate(held))
    used = ppc - free
    cand = np.flatnonzero((arena.owner == KV) & ~pinned & (used > 0) & (movable == used))
    if cand.size < num_chunks:
        return False
    order = np.lexsort((-cand, used[cand]))  # fewest used pages, then the highest chunk
    chosen = np.sort(cand[order[:num_chunks]])
    in_chosen = np.zeros(n, dtype=np.bool_)
    in_chosen[chosen] = True
    owner = np.repeat(np.arange(len(touched)), [len(c) for c in touched])
    hit_nodes = [(nodes[i], counts.pages(values_of[i]))
                 for i in np.unique(owner[in_chosen[all_touched]]).tolist()]
    src = np.sort(np.concatenate([p[in_chosen[p // ppc]] for _, p in hit_nodes]))
    # (not into a wholly free chunk either: it is one the states can take already)
    dst = arena.lowest_free_kv_pages(int(src.size), np.flatnonzero(in_chosen | (free == ppc)))
    if dst is None:
        return False
    ps = cache.kv.page_size
    offsets = np.arange(ps, dtype=np.int64)
    moves = []
    for node, pages in hit_nodes:
        hit = in_chosen[pages // ppc]
        ids = pages.copy()
        ids[hit] = dst[np.searchsorted(src, pages[hit])]
        moves.append((node, ids if ps == 1 else (ids[:, None] * ps + offsets).reshape(-1)))
    arena.relocate_kv_pages(src, dst)  # validates first: raises with nothing changed
    cache.kv.relocate(moves, src, dst)
    return True
