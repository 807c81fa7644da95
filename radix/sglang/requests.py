"""What the front end needs from the engine: a duck-typed ``Req`` and a ``req_to_token_pool``,
and the request-level calls of SGLang 0.5.23 over them.

A request's row of the ``req_to_token`` table, in tokens (SGLang's ``ReqKvInfo`` names)::

    row  [ tree's slots (locked via req.lock) ][ the request's own slots ][ over-allocated ]
         0                    kv.cache_protected_len        kv_committed_len   kv_allocated_len

* ``checkpoint_into_tree(req, up_to)`` (the cache's ``checkpoint``): insert ``fill_ids[:up_to]`` (whole pages) with the row's slots;
  the caller's duplicates in ``[cache_protected_len, prefix_len)`` are freed, the row is
  rewritten to the tree's slots, the lock moves to the node the insert ended at, and
  ``cache_protected_len`` becomes the inserted length. A running request's state is copied
  into a fresh slot the tree takes; a finished request hands its own slot over.
* ``release_kv_cache(req, checkpoint=)``: checkpoint (if asked), free the request's own
  slots ``[cache_protected_len, kv_allocated_len)`` (whole pages), release its lock, its row,
  its state when the tree did not take it.

A running SWA request keeps its own slots where the tree holds the same tokens only as a
tombstone (its window still reads them); they are freed when it is released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radix.sglang.key import RadixKey
from radix.sglang.params import InsertParams, TreeLock

if TYPE_CHECKING:
    from allocators import MambaStatePool
    from radix.node import TreeNode as LibNode
    from radix.sglang.cache import UnifiedRadixCache


@dataclass
class ReqKvInfo:
    """The KV a request holds outside the tree (SGLang's ``ReqKvInfo``), in tokens.

    Attributes:
        req_pool_idx: its row of ``req_to_token`` (``None``: no row).
        cache_protected_len: the tree owns ``row[:cache_protected_len]``.
        cache_inserted_len: the request already inserted this much.
        kv_committed_len / kv_allocated_len: KV computed / slots allocated.
        mamba_pool_idx: its own state slot (a 0-d int64 tensor), or ``None``.
        swa_evicted_seqlen: the request freed the SWA KV of ``row[:this]`` (window slid).
    """

    req_pool_idx: int | None = None
    cache_protected_len: int = 0
    cache_inserted_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    mamba_pool_idx: torch.Tensor | None = None
    mamba_cow_src_index: torch.Tensor | None = None
    swa_evicted_seqlen: int = 0

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None


class Req:
    """The attributes of SGLang's scheduler ``Req`` this cache reads and writes.

    Args:
        rid: request id.
        origin_input_ids: prompt token ids.
        extra_key / cache_salt: namespace (LoRA id, salt).
        priority: request priority.
        session: a streaming session handle (``.session_id``, ``.streaming``), or ``None``.
    """

    def __init__(self, rid: Any, origin_input_ids: Any = (), *, extra_key: Any = None,
                 cache_salt: str | None = None, priority: int | None = None,
                 session: Any = None) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.output_ids: list[int] = []
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.priority = priority
        self.session = session
        self.session_id = getattr(session, "session_id", None)
        self.kv = ReqKvInfo()
        self.prefix_len = 0
        self.extend_end: int | None = None
        self.last_node: Any = None
        self.last_host_node: Any = None
        self.best_match_node: Any = None
        self.host_hit_length = 0
        self.lock: TreeLock | None = None
        self.mamba_branching_seqlen: int | None = None
        self.swa_branching_seqlen: int | None = None
        self.finished_reason: Any = None
        self.skip_radix_cache_insert = False
        #: the tree's slots of the protected prefix after a checkpoint (SGLang's field
        #: before ``ReqKvInfo``)
        self.prefix_indices = torch.empty(0, dtype=torch.int64)

    @property
    def full_untruncated_fill_ids(self) -> list[int]:
        """Prompt then output token ids."""
        return self.origin_input_ids + self.output_ids

    fill_ids = full_untruncated_fill_ids

    @property
    def mamba_pool_idx(self) -> torch.Tensor | None:
        """``kv.mamba_pool_idx`` (the flat name of SGLang before ``ReqKvInfo``)."""
        return self.kv.mamba_pool_idx

    @property
    def req_pool_idx(self) -> int | None:
        return self.kv.req_pool_idx

    def finished(self) -> bool:
        return self.finished_reason is not None

    def owned_kv_len(self) -> int:
        """Row positions whose KV the request computed."""
        return self.kv.kv_committed_len

    def radix_key(self, up_to: int | None = None) -> RadixKey:
        ids = self.full_untruncated_fill_ids
        return RadixKey(ids if up_to is None else ids[:up_to], self.extra_key,
                        cache_salt=self.cache_salt)


class ReqToTokenPool:
    """``req_to_token``: ``[size, max_context_len]`` int64 slots, a row per running request,
    and (hybrid models) the state pool requests take their own state slot from.

    Args:
        size: rows.
        max_context_len: positions per row [tokens].
        device: of the table.
        mamba_pool: the recurrent-state pool (``allocators.MambaStatePool``), or ``None``.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu",
                 mamba_pool: MambaStatePool | None = None) -> None:
        if size < 1 or max_context_len < 1:
            raise ValueError(f"size and max_context_len must be >= 1, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64,
                                        device=self.device)
        self.mamba_pool = mamba_pool
        self._free_rows = list(range(size))

    @property
    def mamba_allocator(self) -> MambaStatePool | None:
        return self.mamba_pool

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, reqs: list[Any]) -> list[int] | None:
        """A row for each request (and its own state slot on a hybrid model), all or none."""
        need_state = [r for r in reqs if self.mamba_pool is not None and r.kv.mamba_pool_idx is None]
        if len(reqs) > len(self._free_rows):
            return None
        slots = None
        if need_state:
            assert self.mamba_pool is not None
            slots = self.mamba_pool.alloc(len(need_state))
            if slots is None:
                return None
        rows = [self._free_rows.pop(0) for _ in reqs]
        for r, row in zip(reqs, rows, strict=True):
            r.kv.req_pool_idx = row
        if slots is not None:
            for r, s in zip(need_state, slots, strict=True):
                r.kv.mamba_pool_idx = s.clone()
        return rows

    def write(self, index: Any, values: torch.Tensor) -> None:
        self.req_to_token[index] = values

    def free(self, req: Any) -> None:
        """Give the request's row back (not its state slot: ``free_mamba_cache``)."""
        kv = req.kv
        if kv.req_pool_idx is not None:
            self._free_rows.append(kv.req_pool_idx)
            kv.req_pool_idx = None

    def clear(self) -> None:
        """Every row free again, and the state pool emptied (SGLang's ``flush_cache`` calls
        it after the tree cache's ``reset``; the requests' records are dropped with it)."""
        self._free_rows = list(range(self.size))
        if self.mamba_pool is not None:
            self.mamba_pool.clear()

    def free_mamba_cache(self, req: Any) -> None:
        kv = req.kv
        if kv.mamba_pool_idx is not None and self.mamba_pool is not None:
            self.mamba_pool.free(kv.mamba_pool_idx.reshape(1))
            kv.mamba_pool_idx = None


# ====================================================================== calls
def fill_ids(req: Any) -> list[int]:
    ids = getattr(req, "full_untruncated_fill_ids", None)
    if ids is None:
        ids = list(req.origin_input_ids) + list(req.output_ids)
    return list(ids)


def _need_pools(fe: UnifiedRadixCache) -> Any:
    pool = fe.req_to_token_pool
    if pool is None or not hasattr(pool, "req_to_token"):
        raise TypeError("request calls need a req_to_token_pool (CacheInitParams); a "
                        "simulated cache has none")
    return pool


_LENGTHS = ("cache_protected_len", "kv_committed_len", "kv_allocated_len")


def check_request(fe: UnifiedRadixCache, req: Any, up_to: int | None = None,
                  name: str = "up_to") -> Any:
    """Validate a request before a request call changes anything; returns the
    ``req_to_token`` pool.

    Checks: ``req`` carries a ``kv`` record (:class:`ReqKvInfo`); it holds a row of the pool
    (``kv.req_pool_idx`` an int in ``[0, rows)``); ``0 <= cache_protected_len <=
    kv_committed_len <= kv_allocated_len <= max_context_len`` (ints); ``req.lock`` is ``None``
    or a :class:`TreeLock`; ``req.last_node`` is ``None`` or a node of this cache (or a
    session's stand-in); ``up_to`` an int in ``[0, kv_allocated_len]``.

    Raises:
        TypeError: ``req`` without a ``kv`` record, a length or ``up_to`` not an int, a
            ``req.lock`` that is not a ``TreeLock``, a ``req.last_node`` that is not a node.
        ValueError: no row (``kv.req_pool_idx`` is ``None``: never allocated, or already
            released), a row outside the pool, lengths out of order, ``up_to`` out of range, a
            node of another cache.
    """
    kv = getattr(req, "kv", None)
    if not isinstance(kv, ReqKvInfo):
        raise TypeError(f"req must be a scheduler request with a kv record (ReqKvInfo: "
                        f"req_pool_idx, cache_protected_len, ...), got {type(req).__name__}")
    pool = _need_pools(fe)
    row = kv.req_pool_idx
    if row is None:
        raise ValueError(f"req.kv.req_pool_idx is None: request {getattr(req, 'rid', None)!r} "
                         "holds no req_to_token_pool row (never allocated, or already released)")
    rows = len(pool.req_to_token)
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows:
        raise ValueError(f"req.kv.req_pool_idx must be a row of req_to_token_pool in [0, {rows}), "
                         f"got {row!r}")
    lens = []
    for field in _LENGTHS:
        v = getattr(kv, field)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"req.kv.{field} must be an int [tokens], got {type(v).__name__}")
        lens.append(v)
    width = pool.req_to_token.shape[1]
    if not 0 <= lens[0] <= lens[1] <= lens[2] <= width:
        raise ValueError(
            "need 0 <= req.kv.cache_protected_len <= kv_committed_len <= kv_allocated_len <= "
            f"max_context_len ({width}), got {lens[0]}, {lens[1]}, {lens[2]}")
    if req.lock is not None and not isinstance(req.lock, TreeLock):
        raise TypeError(f"req.lock must be a TreeLock (from lock()) or None, got "
                        f"{type(req.lock).__name__}")
    if req.last_node is not None:
        fe.check_node(req.last_node, "req.last_node")
    if up_to is not None:
        if isinstance(up_to, bool) or not isinstance(up_to, int):
            raise TypeError(f"{name} must be an int [tokens], got {type(up_to).__name__}")
        if not 0 <= up_to <= lens[2]:
            raise ValueError(f"{name} must be in [0, req.kv.kv_allocated_len = {lens[2]}] (row "
                             f"positions with slots), got {up_to}")
    return pool


def _state_pool(fe: UnifiedRadixCache) -> MambaStatePool:
    pool = fe.state_pool
    assert pool is not None
    return pool


def _fresh_state(fe: UnifiedRadixCache, protect: LibNode | None) -> int:
    """A state slot for the tree, evicting one state when the pool is empty (``protect``
    locked meanwhile). Raises ``RuntimeError`` when none can be had."""
    pool = _state_pool(fe)
    got = pool.alloc(1)
    if got is None:
        lock = fe.cache.inc_lock_ref(protect) if protect is not None else None
        try:
            fe.cache.evict_states(1)
        finally:
            if lock is not None:
                fe.cache.dec_lock_ref(lock)
        got = pool.alloc(1)
    if got is None:
        raise RuntimeError("no recurrent-state slot available even after evicting")
    return int(got[0])


def copy_matched_state(fe: UnifiedRadixCache, req: Any, node: LibNode, src: int) -> None:
    """``cow_mamba``: the matched state ``src`` into the request's own slot (allocated when
    it has none)."""
    if req is None:
        raise ValueError("cow_mamba=True needs params.req")
    if req.kv.mamba_pool_idx is None:
        req.kv.mamba_pool_idx = torch.tensor(_fresh_state(fe, node), dtype=torch.int64)
    dst = int(req.kv.mamba_pool_idx)
    _state_pool(fe).copy(src, dst)
    req.kv.mamba_cow_src_index = torch.tensor([src], dtype=torch.int64)


def _lock_of(fe: UnifiedRadixCache, req: Any) -> tuple[LibNode, Any]:
    node = fe.cache.root if req.last_node is None else fe.lib_node(req.last_node)
    lock = req.lock.receipt.lock if isinstance(req.lock, TreeLock) else None
    return node, lock


def checkpoint_into_tree(fe: UnifiedRadixCache, req: Any, up_to: int) -> None:
    """Insert ``fill_ids(req)[:up_to]`` and move the request onto the tree's slots (see the
    module docstring). Raises as :func:`check_request`, ``ValueError`` for an ``up_to``
    past ``req.kv.kv_committed_len``, or as the insert; nothing changed then."""
    pool = check_request(fe, req, up_to)
    if up_to > req.kv.kv_committed_len:
        # (the tree would hand out KV never computed, and cache_protected_len would pass
        # kv_committed_len, which no release accepts)
        raise ValueError(f"up_to must be <= req.kv.kv_committed_len = "
                         f"{req.kv.kv_committed_len} (KV computed so far), got {up_to}")
    finished = req.finished()
    if fe.disable:
        if finished:
            free_request_state(fe, req)
        return
    lib = fe.cache
    kv = req.kv
    ps = fe.page_size
    n = len(fill_ids(req)[:up_to]) // ps * ps
    state = None
    if lib.hybrid:
        src = kv.mamba_pool_idx
        if src is None:
            return  # no state to checkpoint: a hybrid tree takes nothing without one
        if finished:
            state = int(src)
        else:
            state = _fresh_state(fe, _lock_of(fe, req)[0])
            _state_pool(fe).copy(int(src), state)
    row = pool.req_to_token[kv.req_pool_idx]
    value = row[:n].clone()
    protected = kv.cache_protected_len
    params = InsertParams(key=req.radix_key(n), value=value,
                          mamba_value=None if state is None else torch.tensor([state]),
                          prev_prefix_len=protected, priority=req.priority or 0,
                          session_id=getattr(req, "session_id", None))
    keep = lib.has_swa and not finished
    try:
        res = fe.insert_keeping(params, keep)
    except BaseException:
        if state is not None and not finished:  # the copy made for the tree: back in front
            _state_pool(fe).undo_alloc(torch.tensor([state], dtype=torch.int64))
        raise
    if lib.hybrid:
        assert state is not None
        if res.mamba_exist:
            _state_pool(fe).free(torch.tensor([state], dtype=torch.int64))
        if finished:
            kv.mamba_pool_idx = None  # the tree took it, or it was freed just now
    new_len = res.total_len
    tree = fe.path_device_indices(res.last_device_node)[:new_len].to(row.device)
    mine = value[:new_len]
    merged = tree if not keep else torch.where(lib.swa_kept_mask(mine, tree), mine, tree)
    if new_len > protected:
        row[protected:new_len] = merged[protected:]
    if new_len >= protected:
        # (a shorter checkpoint leaves the lock where it is: on the node ending the
        # protected prefix, which the row reads from the tree)
        old = req.lock
        req.lock = fe.lock(res.last_device_node)
        fe.unlock(old)
        req.last_node = res.last_device_node
    kv.cache_protected_len = max(new_len, protected)
    kv.cache_inserted_len = max(kv.cache_inserted_len, new_len)
    req.prefix_indices = row[: kv.cache_protected_len].clone()


def _whole_pages(fe: UnifiedRadixCache, slots: torch.Tensor) -> torch.Tensor:
    """The slots of every page ``slots`` touch, each page once, in first-seen order (what
    SGLang's paged ``free_segment`` releases)."""
    ps = fe.page_size
    if ps == 1 or not len(slots):
        return slots
    pages = torch.unique_consecutive(slots // ps)
    return (pages[:, None] * ps + torch.arange(ps, dtype=slots.dtype)).reshape(-1)


def free_kv_row(fe: UnifiedRadixCache, kv: Any, ranges: list[tuple[int, int]]) -> None:
    """Free the row positions in ``ranges`` (half-open, ascending), whole pages."""
    pool = _need_pools(fe)
    row = pool.req_to_token[kv.req_pool_idx]
    parts = [row[a:b] for a, b in ranges if b > a]
    if parts:
        slots = _whole_pages(fe, torch.cat(parts))
        if len(slots):
            fe.slot_allocator.free(slots.cpu())


def free_request_state(fe: UnifiedRadixCache, req: Any) -> None:
    """The request's own state slot back to the pool (when it still has one)."""
    kv = req.kv
    if kv.mamba_pool_idx is not None and fe.state_pool is not None:
        _state_pool(fe).free(kv.mamba_pool_idx.reshape(1))
        kv.mamba_pool_idx = None


def release_kv_cache(fe: UnifiedRadixCache, req: Any, *, checkpoint: bool) -> None:
    """SGLang's ``release_kv_cache``: checkpoint (if asked and allowed), free the request's
    own slots and over-allocated pages, release its lock, its row and its state.

    Raises:
        TypeError / ValueError: as :func:`check_request` (a request without a row among
            them); releasing an unfinished request into a hybrid tree; nothing changed.
    """
    if fe.claim_kv_row(req):
        return
    pool = check_request(fe, req)
    kv = req.kv
    owned = req.owned_kv_len()
    do = checkpoint and not req.skip_radix_cache_insert
    if do:
        if fe.supports_mamba() and not req.finished():
            raise ValueError(f"releasing unfinished request {req.rid!r} into a hybrid tree")
        fe.checkpoint(req, up_to=owned)
    protected = kv.cache_protected_len
    free_kept_slots(fe, kv, req.last_node)
    free_kv_row(fe, kv, [(protected, owned)])
    fe.unlock(req.lock)
    req.lock = None
    ps = fe.page_size
    start = -(-owned // ps) * ps
    if start < kv.kv_allocated_len:
        free_kv_row(fe, kv, [(start, kv.kv_allocated_len)])
    fe.on_release(req, checkpointed=do)
    pool.free(req)
    kv.kv_allocated_len = 0
    kv.kv_committed_len = 0


def kept_slots(fe: UnifiedRadixCache, kv: ReqKvInfo, last_node: Any) -> torch.Tensor:
    """The record's own slots below ``cache_protected_len`` (kept over tombstones while its
    request ran: where its row differs from the tree's path), a CPU tensor; ``last_node``:
    the node its lock holds (the protected prefix's end; ``None``: nothing protected)."""
    p = kv.cache_protected_len
    if not fe.cache.has_swa or p == 0 or last_node is None:
        return torch.empty(0, dtype=torch.int64)
    row = fe.req_to_token_pool.req_to_token[kv.req_pool_idx]
    tree = fe.path_device_indices(last_node)[:p].to(row.device)
    mine = row[:p]
    return mine[mine != tree].cpu()


def free_kept_slots(fe: UnifiedRadixCache, kv: ReqKvInfo, last_node: Any) -> None:
    """Free :func:`kept_slots` and point the row at the tree's. A request's release and a
    streaming session's end both call it."""
    own = kept_slots(fe, kv, last_node)
    if len(own):
        fe.slot_allocator.free(own)
        row = fe.req_to_token_pool.req_to_token[kv.req_pool_idx]
        p = kv.cache_protected_len
        row[:p] = fe.path_device_indices(last_node)[:p].to(row.device)


def release_out_of_window(fe: UnifiedRadixCache, req: Any, pre_len: int) -> None:
    """Free the SWA KV of the request's own tokens more than a window (and a page) before
    ``pre_len``.

    Raises:
        TypeError / ValueError: as :func:`check_request`; ``ValueError`` for a ``pre_len``
            past ``req.kv.kv_committed_len`` (the window would slide past the tokens the
            request attends to next); nothing freed then.
    """
    if not fe.cache.has_swa:
        return
    check_request(fe, req, pre_len, "pre_len")
    kv = req.kv
    if pre_len > kv.kv_committed_len:
        raise ValueError(f"pre_len must be <= req.kv.kv_committed_len = {kv.kv_committed_len} "
                         f"(the sequence computed so far), got {pre_len}")
    row = fe.req_to_token_pool.req_to_token[kv.req_pool_idx]
    start = max(kv.swa_evicted_seqlen, kv.cache_protected_len)
    upto = fe.cache.release_swa_slots(row[:pre_len].cpu(), start, pre_len)
    if upto > start:
        kv.swa_evicted_seqlen = upto

