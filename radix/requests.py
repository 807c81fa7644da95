"""Request-level helpers: a thin layer over the value-level API of ``RadixCache``.

They read and write only the fields of :class:`radix.results.CacheRequest`, never an engine's
own request object, and call the cache's public API (``insert``, the locks); what else they
read (the core's validation of nodes and locks, the KV, state and SWA components) comes in a
:class:`RequestContext` the cache builds once. A request's slots, in tokens::

    req.kv_indices  [ tree's slots (locked via last_node) ][ the request's own slots ]
                    0                                   cached_len            len(kv_indices)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radix.checks import check_count, check_lock, check_node
from radix.node import TreeNode
from radix.results import CacheRequest, InsertResult, LockRef
from radix.tree import RadixKey

if TYPE_CHECKING:
    from components.kv import KVComponent
    from components.swa import SWAComponent
    from radix.cache import RadixCache
    from radix.core import CacheCore

#: No slots, on the host.
_NONE = torch.empty(0, dtype=torch.int64)


class RequestContext:
    """What the request helpers read besides the cache's public API, built once by the facade
    (``RadixCache``).

    Attributes:
        core: the tree, its clock and the lock checks (``radix.core.CacheCore``).
        kv: the KV component (slot views, its allocator).
        state_allocator: the recurrent-state pool an unadopted state goes back to, or ``None``.
        swa: the sliding-window component (what a running request keeps, its releases), or
            ``None``.
    """

    __slots__ = ("core", "kv", "state_allocator", "swa")

    def __init__(self, core: CacheCore, kv: KVComponent, state_allocator: Any,
                 swa: SWAComponent | None) -> None:
        self.core = core
        self.kv = kv
        self.state_allocator = state_allocator
        self.swa = swa


def _path_indices(ctx: RequestContext, node: TreeNode) -> torch.Tensor:
    """The tree's KV slots on the path from the root to ``node`` [one per token], on the host
    (``KVComponent.host_path_slots``: a CPU tensor on every device)."""
    path = node.path_to_root()
    if not path:
        return _NONE
    path.reverse()
    return ctx.kv.host_path_slots(path)


def _check_req(ctx: RequestContext, req: Any, upto: Any) -> int:
    """:func:`_check_full` with the common case first: a :class:`CacheRequest` with a
    :class:`RadixKey` key, fields of the exact types, and the lock the node's own on a cache
    whose locks carry no data. That case makes the same checks as scalar compares; anything
    else (including every failure) goes through :func:`_check_full`, which raises."""
    if type(req) is CacheRequest and (upto is None or type(upto) is int):
        idx, node, cached = req.kv_indices, req.last_node, req.cached_len
        if type(idx) is torch.Tensor and type(node) is TreeNode and type(cached) is int \
                and type(req.key) is RadixKey:
            n = len(idx)
            end = n if upto is None else upto
            core = ctx.core
            ps = core.page_size
            if 0 <= end <= n <= len(req.key) and node.owner == core.tree.uid \
                    and 0 <= cached <= min(n, node.depth) \
                    and (ps == 1 or (cached % ps == 0 and n % ps == 0)):
                if node.parent is None:
                    return end
                lock = req.lock
                if node.kv_value is not None and (lock is None or lock is node) \
                        and node.lock_ref > 0 and not core.lock_data and not core.unlock_checks:
                    return end
    return _check_full(ctx, req, upto)


def _check_full(ctx: RequestContext, req: Any, upto: Any) -> int:
    """Validate a request record before anything changes; returns ``upto``.

    Checks the types of ``req``, ``req.key`` and ``req.kv_indices``, ``upto <=
    len(kv_indices) <= len(key)``, (paged) whole pages in ``kv_indices`` but a partial last
    one, a ``cached_len`` of whole pages, that ``req.last_node`` is a device node of this cache
    holding a lock that ``req.lock`` (or the node itself) can release, and ``0 <= req.cached_len <=
    min(len(kv_indices), last_node's depth)``: the leading slots that came from the tree
    lie under the request's lock (a wrong ``cached_len`` would make the request free the
    tree's slots, or leak its own).
    """
    if not isinstance(req, CacheRequest):
        raise TypeError(f"req must be a CacheRequest, got {type(req).__name__}")
    try:
        key_len = len(req.key)
    except TypeError:
        raise TypeError(
            "req.key must be token ids (a list of int, a RadixKey, a 1-D integer tensor or "
            f"array), got {type(req.key).__name__}"
        ) from None
    if not isinstance(req.kv_indices, torch.Tensor):
        raise TypeError(
            "req.kv_indices must be a 1-D torch.int64 tensor of KV slots, got "
            f"{type(req.kv_indices).__name__}"
        )
    n = len(req.kv_indices)
    if upto is None:
        upto = n
    check_count(upto, "upto")
    if upto > n or n > key_len:
        raise ValueError(
            f"need upto ({upto}) <= len(req.kv_indices) ({n}) <= len(req.key) ({key_len})"
        )
    node = check_node(ctx.core, req.last_node, name="req.last_node")
    if node.parent is not None:
        lock = req.lock
        if lock is not None and lock is not node and not (
            isinstance(lock, LockRef) and lock.node is node
        ):
            raise ValueError(
                f"req.lock must be what inc_lock_ref returned for req.last_node (node "
                f"{node.id}) or None, got {lock!r}"
            )
        check_lock(ctx.core, node if lock is None else lock, "req.lock")
    cached = req.cached_len
    if isinstance(cached, bool) or not isinstance(cached, int):
        raise TypeError(f"req.cached_len must be an int, got {type(cached).__name__}")
    limit = min(n, node.depth)
    if not 0 <= cached <= limit:
        raise ValueError(
            f"req.cached_len must be in [0, {limit}] (the leading tokens whose slots came "
            f"from the tree: at most len(req.kv_indices) = {n} and the depth of "
            f"req.last_node = {node.depth}), got {cached}"
        )
    ps = ctx.core.page_size
    if ps != 1:
        if cached % ps:
            raise ValueError(f"req.cached_len must be whole pages of page_size={ps} (the "
                             f"tree's slots end at a page), got {cached}")
        part = n % ps
        if part:
            last = ctx.kv.host_slots(req.kv_indices[n - part:])
            if last[0] % ps or not (last[1:] == last[:-1] + 1).all():
                raise ValueError(
                    f"req.kv_indices must be whole pages of page_size={ps} in order, the last "
                    f"one possibly partial (its first {part} slots); got a last page of "
                    f"{last.tolist()}")
    return upto


def _whole_pages(ctx: RequestContext, slots: torch.Tensor) -> torch.Tensor:
    """``slots`` (the request's own, from a page start) with its partial last page completed:
    the request holds that whole page (an allocator hands out whole pages), as SGLang's paged
    ``free`` releases it."""
    ps = ctx.core.page_size
    part = len(slots) % ps
    if ps == 1 or not part:
        return slots
    host = ctx.kv.host_slots(slots)
    first = int(host[len(host) - part])
    return torch.from_numpy(np.concatenate([host, np.arange(first + part, first + ps)]))


def _free_state(ctx: RequestContext, slot: int | torch.Tensor | None, adopted: bool) -> None:
    allocator = ctx.state_allocator
    if slot is None or adopted or allocator is None:
        return
    if isinstance(slot, torch.Tensor):
        allocator.free(slot.reshape(-1))
    elif type(slot) is int and hasattr(allocator, "free_slot"):  # a state pool: no tensor
        allocator.free_slot(slot)
    else:
        allocator.free(torch.tensor([slot], dtype=torch.int64))


def _insert_req(cache: RadixCache, ctx: RequestContext, req: CacheRequest, state_slot: int | torch.Tensor | None, upto: int,
                unfinished: bool) -> tuple[InsertResult, torch.Tensor | None]:
    """Insert ``req.key[:upto]``; free the request's duplicate slots and an unadopted state.

    Returns the insert result and, when the request's slots below ``prefix_len`` changed and
    it is ``unfinished``, what they must become (the tree's slots, except the request's own
    copies it keeps; a CPU tensor on every device: the caller joins it with the rest of the
    request's row in one upload, ``RadixCache.cat_slots``).

    Fast path (no SWA, no HiCache): the request's slots in ``[cached_len, prefix_len)`` are
    its own copies of tokens the tree already holds (its slots below ``cached_len`` came
    from the tree), so they are the duplicates. With SWA or HiCache the tree may have taken
    some of the request's slots (revival), so duplicates are found by comparing slots; and
    a running request keeps its own live copy where the tree only has a tombstone (it still
    needs that SWA KV for its window; it frees the copy when it finishes). The comparisons
    run on the slots' host copies (``KVComponent.host_slots``), never on the device.
    """
    key = req.key if upto == len(req.key) else req.key[:upto]  # (a RadixKey's: O(1))
    res = cache.insert(key, req.kv_indices[:upto], req.extra_key,
                       state_slot=state_slot, priority=req.priority, rid=req.rid,
                       extra=req.extra)
    _free_state(ctx, state_slot, res.state_adopted)
    p = res.prefix_len
    kv = ctx.kv
    alloc = kv.allocator
    if not ctx.core.revives:  # nothing below prefix_len can have taken the request's slots
        if p <= req.cached_len:
            return res, None
        alloc.free(req.kv_indices[req.cached_len:p])
        return res, _path_indices(ctx, res.last_node)[:p] if unfinished else None
    if p == 0:
        return res, None
    tree = _path_indices(ctx, res.last_node)[:p]
    caller_h = kv.host_slots(req.kv_indices)[:p]
    tree_h = kv.host_slots(tree)
    dup = caller_h != tree_h
    if not dup.any():  # the request holds the tree's slots already: its row is unchanged
        return res, None
    merged = tree
    if unfinished and ctx.swa is not None:
        keep = ctx.swa.request_keeps(caller_h, tree_h, dup)
        if keep.any():
            dup &= ~keep
            merged_h = np.where(keep, caller_h, tree_h)
            merged = torch.from_numpy(merged_h)
    if dup.any():
        alloc.free(torch.from_numpy(caller_h[dup]))
    return res, merged


def cache_unfinished_req(cache: RadixCache, ctx: RequestContext, req: CacheRequest,
                         state_slot: int | torch.Tensor | None = None,
                         upto: int | None = None) -> InsertResult:
    """Chunked prefill: cache ``req.key[:upto]`` (default: every computed token) with a
    state checkpoint, keep the request's lock (moved down to the new node).

    Frees the request's duplicate KV slots and rewrites ``req.kv_indices[:inserted_len]``
    to the tree's slots; frees ``state_slot`` itself when the tree does not adopt it.

    Raises:
        TypeError / ValueError: bad request fields (``req.cached_len`` outside
            ``[0, min(upto, len(req.kv_indices), depth of req.last_node)]``, a
            ``req.last_node`` without a lock, a ``req.lock`` that is not its lock), ``upto`` out
            of range, bad slots, or a missing state on a hybrid cache; nothing changed.
    """
    upto = _check_req(ctx, req, upto)
    if req.cached_len > upto:
        raise ValueError(
            f"req.cached_len ({req.cached_len}) > upto ({upto}): a chunk must cover what the "
            "request already holds from the tree (its lock would move above slots it keeps)"
        )
    res, merged = _insert_req(cache, ctx, req, state_slot, upto, unfinished=True)
    n = res.inserted_len
    if merged is not None:
        req.kv_indices = cache.cat_slots([merged, req.kv_indices[res.prefix_len:]])
    lock = cache.inc_lock_ref(res.last_node)
    cache.dec_lock_ref(req.last_node if req.lock is None else req.lock)
    req.last_node = res.last_node
    req.lock = lock
    req.cached_len = n
    return res


def cache_finished_req(cache: RadixCache, ctx: RequestContext, req: CacheRequest,
                       state_slot: int | torch.Tensor | None = None,
                       upto: int | None = None) -> InsertResult:
    """Cache ``req.key[:upto]`` (default: every computed token) with a state at its end,
    free duplicates and every computed slot not kept (``req.kv_indices[inserted_len:]``, its
    partial last page whole: ``req.kv_indices`` may end inside a page, as an engine's row
    does), release the request's lock. Frees ``state_slot`` when the tree does not adopt it.

    Returns:
        the insert's :class:`InsertResult`. Its ``last_node`` is informational: once the
        lock is released the node may already be gone (a dead leaf, e.g. an SWA tombstone
        nothing can resume from, is pruned at once); match again before locking anything.

    Raises:
        TypeError / ValueError: as :meth:`cache_unfinished_req` (``upto`` may end before
            ``req.cached_len`` here: the tree keeps those slots); nothing changed.
    """
    upto = _check_req(ctx, req, upto)
    res, _ = _insert_req(cache, ctx, req, state_slot, upto, unfinished=False)
    # The request's own slots past what the tree kept; below cached_len they are the
    # tree's (upto may end before them), never the request's to free.
    tail = req.kv_indices[max(res.inserted_len, req.cached_len):]
    if len(tail):
        ctx.kv.allocator.free(_whole_pages(ctx, tail))
    cache.dec_lock_ref(req.last_node if req.lock is None else req.lock)
    cache.release_rid(req.rid)
    req.last_node = cache.root
    req.lock = None
    req.cached_len = 0
    req.kv_indices = cache.empty_slots
    return res


def release_swa(ctx: RequestContext, req: CacheRequest, seq_len: int) -> int:
    """Free the SWA KV of the request's own tokens that slid out of its window.

    Keeps the last ``max(sliding_window_size, page_size)`` tokens before the end of
    ``seq_len``'s whole pages live (what an insert up to ``seq_len`` caches; so a page larger
    than the window never tombstones the leaf the request will insert, and the cached end has
    a window of live tokens), plus
    ``CacheConfig.swa_release_extra_pages`` pages (so a later match ending one page earlier
    still has its window: ``components.swa.SWAComponent.release_margin``); call it with the
    boundary the next ``cache_*_req`` will use (its ``upto``). Tokens below
    ``req.cached_len`` belong to the tree, which tombstones them itself.

    Returns the tokens released now. Raises ``ValueError`` without an SWA component or
    with ``seq_len`` outside ``[0, len(req.kv_indices)]``; ``TypeError`` when ``req`` is not
    a :class:`CacheRequest`.
    """
    swa = ctx.swa
    if swa is None:
        raise ValueError("release_swa on a cache without a sliding-window component")
    if not isinstance(req, CacheRequest):
        raise TypeError(f"req must be a CacheRequest, got {type(req).__name__}")
    check_count(seq_len, "seq_len")
    if seq_len > len(req.kv_indices):
        raise ValueError(f"seq_len ({seq_len}) > len(req.kv_indices) ({len(req.kv_indices)})")
    start = max(req.swa_evicted_seqlen, req.cached_len)
    upto = swa.release(req.kv_indices, start, seq_len)
    if upto <= start:
        return 0
    req.swa_evicted_seqlen = upto
    return upto - start
