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

Cost: no walk of the tree. The KV component keeps, per chunk, the pages its nodes hold and
those its locked nodes hold, and the node holding each page
(``components.kv_chunks.ChunkHolders``, installed by the first call: ``KVComponent.track_chunks``,
one walk, then kept by the component's hooks), so the chunks are chosen in O(chunks), their
used pages found in O(pages of the chosen chunks) and their holders read off; then O(slots)
of the nodes that move, the copy of the moved pages' bytes and the moved nodes' new arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from allocators import check_int
from allocators.arena import KV, MemoryArena
from components.kv import KVComponent

if TYPE_CHECKING:
    from radix.cache import RadixCache

__all__ = ["compact_kv"]


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
        TypeError: ``cache`` not a radix cache, ``arena`` not a :class:`MemoryArena`.
        TypeError / ValueError: ``num_chunks`` not an int ``>= 0`` (a numpy int is one);
            ``cache`` does not allocate its KV from ``arena`` (ValueError).
    """
    if not isinstance(arena, MemoryArena):
        raise TypeError(f"arena must be a MemoryArena, got {type(arena).__name__}")
    if not isinstance(getattr(cache, "kv", None), KVComponent):
        raise TypeError(f"cache must be a RadixCache, got {type(cache).__name__}")
    num_chunks = check_int(num_chunks, "num_chunks", minimum=0)
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
    kv = cache.kv
    holders = kv.track_chunks(cache.tree, ppc)
    used = ppc - free
    # held by unlocked nodes == used: no page of a locked node, none a request holds
    movable = holders.held - holders.locked
    cand = np.flatnonzero((arena.owner == KV) & (used > 0) & (movable == used))
    if cand.size < num_chunks:
        return False
    order = np.lexsort((-cand, used[cand]))  # fewest used pages, then the highest chunk
    chosen = np.sort(cand[order[:num_chunks]])
    in_chosen = np.zeros(arena.num_chunks, dtype=np.bool_)
    in_chosen[chosen] = True
    # every used page of a chosen chunk, ascending
    span = (chosen[:, None] * ppc + np.arange(ppc, dtype=np.int64)).reshape(-1)
    src = span[~arena.kv_allocator.free_mask[span]]
    # (not into a wholly free chunk either: it is one the states can take already)
    dst = arena.lowest_free_kv_pages(int(src.size), np.flatnonzero(in_chosen | (free == ppc)))
    if dst is None:
        return False
    ps = kv.page_size
    offsets = np.arange(ps, dtype=np.int64)
    moves = []
    # the nodes holding src (ascending: runs of one holder collapse before the sort)
    held_by = holders.holder[src]
    runs = np.flatnonzero(held_by[1:] != held_by[:-1]) + 1
    for node_id in np.unique(held_by[np.concatenate(([0], runs))]).tolist():
        node = holders.nodes[node_id]
        assert node.kv_value is not None and node.kv_lock == 0, node
        pages = holders.ids(node.kv_value)
        hit = in_chosen[pages // ppc]
        ids = pages.copy()
        ids[hit] = dst[np.searchsorted(src, pages[hit])]
        moves.append((node, ids if ps == 1 else (ids[:, None] * ps + offsets).reshape(-1)))
    arena.relocate_kv_pages(src, dst)  # validates first: raises with nothing changed
    kv.relocate(moves, src, dst)
    return True
