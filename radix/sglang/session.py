"""Streaming sessions as SGLang 0.5.23 keeps them: a session holds its KV and state between
turns and gives them back when it ends.

A session takes its first turn's KV record (the ``req_to_token`` row, its lengths, its own
state slot) and tree lock when the row is allocated (``take``, the cache's
``maybe_hand_to_session``); every later turn borrows them::

    turn 1   match (tree) -> lock -> row -> take: the slot owns row, lock, state
             checkpoints publish the prompt into the tree (the lock follows the insert)
             finish: the slot keeps the row up to the output (nothing else inserted)
    turn k   match: lent the slot's record, prefix = what the session computed so far
             (cache_protected_len = the published prompt); checkpoints publish nothing
             finish: the slot keeps the row again
    close    release_session: the lock, the row's own slots, the row and the state go back

The request's handle is ``req.session`` with ``session_id`` and ``streaming`` (SGLang's
session object); ``req.last_node`` is the slot's stand-in node while it borrows, whose
``lock`` is ``None`` (the slot already holds the real lock).

Differences from SGLang: no retraction, speculative overshoot or multimodal bookkeeping; an
aborted turn (``req.finished_reason.is_abort``) hands the record and lock back to the
request, which is then released as any request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radix.sglang.params import MatchPrefixParams, MatchResult, TreeLock
from radix.sglang.requests import ReqKvInfo, free_kept_slots

if TYPE_CHECKING:
    from radix.sglang.cache import UnifiedRadixCache


class VirtualNode:
    """A session slot's stand-in node: locking it is a no-op."""

    def __repr__(self) -> str:
        return "VirtualNode()"


def is_virtual_node(node: Any) -> bool:
    return isinstance(node, VirtualNode)


def _is_streaming(req: Any) -> bool:
    s = getattr(req, "session", None) if req is not None else None
    return s is not None and bool(getattr(s, "streaming", False))


@dataclass
class SessionSlot:
    """A session's KV record and the tree lock on its published prefix."""

    virtual_node: VirtualNode = field(default_factory=VirtualNode)
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    lock: TreeLock | None = None
    publishes_prompt: bool = False


class StreamingSessions:
    """The streaming sessions of one cache (``UnifiedRadixCache.session``)."""

    def __init__(self, cache: UnifiedRadixCache) -> None:
        self.cache = cache
        self.slots: dict[str, SessionSlot] = {}

    def records(self) -> dict[str, ReqKvInfo]:
        """The KV records sessions own, by session id."""
        return {sid: s.kv for sid, s in self.slots.items() if s.kv.holds_kv}

    def borrowed_slot(self, req: Any) -> SessionSlot | None:
        """The slot whose record ``req`` runs on."""
        if not _is_streaming(req):
            return None
        slot = self.slots.get(req.session.session_id)
        return slot if slot is not None and slot.kv is req.kv else None

    def try_match_prefix(self, params: MatchPrefixParams) -> MatchResult | None:
        """A turn of a session holding KV borrows its record: the prefix is what the
        session computed (cut to the key); the row past it is freed. ``None``: not a
        streaming turn with a record (the tree is matched instead)."""
        req = params.req
        if not _is_streaming(req):
            return None
        slot = self.slots.get(req.session.session_id)
        if slot is None or not slot.kv.holds_kv:
            return None
        prefix_len = min(slot.kv.kv_committed_len, len(params.key))
        if prefix_len < slot.kv.cache_protected_len:
            # (refused before the request borrows the record: nothing changed)
            raise ValueError(f"streaming session {req.session.session_id!r}: the prefix shrank "
                             f"below what it published ({prefix_len} < "
                             f"{slot.kv.cache_protected_len}); sessions are append-only")
        req.kv = slot.kv
        self._free_tail(slot.kv, prefix_len)
        node = slot.virtual_node
        return MatchResult(prefix_len, node, node, node,
                           cache_protected_len=slot.kv.cache_protected_len)

    def take(self, req: Any) -> None:
        """A streaming turn's first row allocation: the session takes the request's record
        and lock; the request borrows them from now on."""
        if not _is_streaming(req) or self.borrowed_slot(req) is not None:
            return
        sid = req.session.session_id
        if sid in self.slots:
            raise ValueError(f"session {sid!r} already has a slot")
        slot = SessionSlot(kv=req.kv, publishes_prompt=True)
        self._lock_to_slot(req, slot)
        self.slots[sid] = slot

    def try_checkpoint(self, req: Any, *, up_to: int) -> bool:
        """A session turn publishes only the first prompt (its lock follows the insert);
        returns whether the session handled the checkpoint."""
        slot = self.borrowed_slot(req)
        if slot is None:
            return False
        if slot.publishes_prompt:
            req.lock, slot.lock = slot.lock, None
            req.last_node = self._node_of(req)
            try:
                self.cache.checkpoint_into_tree(req, up_to=up_to)
            finally:
                # (also when the checkpoint raises: the lock is the session's)
                self._lock_to_slot(req, slot)
        return True

    def try_cache_finished_req(self, req: Any) -> bool:
        """A finished turn leaves its record in the slot (returns ``True``: nothing else to
        release); an aborted one gets the record and lock back (``False``)."""
        if not _is_streaming(req):
            return False
        slot = self.borrowed_slot(req)
        if slot is None:
            return False
        sid = req.session.session_id
        if getattr(req.finished_reason, "is_abort", False):
            del self.slots[sid]
            req.lock, slot.lock = slot.lock, None
            req.last_node = self._node_of(req)
            return False
        target = len(req.origin_input_ids) + len(req.output_ids)
        kv = slot.kv
        self._free_kv_aligned(kv, target, kv.kv_allocated_len)
        kv.kv_allocated_len = min(kv.kv_allocated_len, -(-target // self.cache.page_size)
                                  * self.cache.page_size)
        kv.kv_committed_len = min(target, kv.kv_allocated_len)
        slot.publishes_prompt = False
        req.kv = ReqKvInfo()
        return True

    def release_session(self, session_id: str) -> None:
        """The session ends: its lock, its row's own slots, its row and its state go back."""
        slot = self.slots.pop(session_id, None)
        if slot is None:
            return
        cache = self.cache
        kv = slot.kv
        if kv.holds_kv:
            # (its own slots kept over tombstones below the protected prefix, while the
            # lock still holds the prefix's path)
            free_kept_slots(cache, kv, None if slot.lock is None else slot.lock.node)
        cache.unlock(slot.lock)
        if kv.holds_kv:
            cache.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
            cache.req_to_token_pool.free(slot)
        pool = cache.req_to_token_pool
        if kv.mamba_pool_idx is not None and getattr(pool, "mamba_pool", None) is not None:
            pool.mamba_pool.free(kv.mamba_pool_idx.reshape(1))
            kv.mamba_pool_idx = None

    # ------------------------------------------------------------------ helpers
    def _node_of(self, req: Any) -> Any:
        lock = req.lock
        return lock.node if isinstance(lock, TreeLock) else self.cache.root_node

    def _lock_to_slot(self, req: Any, slot: SessionSlot) -> None:
        slot.lock, req.lock = req.lock, None
        req.last_node = slot.virtual_node

    def _free_tail(self, kv: ReqKvInfo, prefix_len: int) -> None:
        """Free ``[prefix_len, allocated)`` (stale slots past the prefix) before the turn
        allocates over them."""
        ps = self.cache.page_size
        self._free_kv_aligned(kv, prefix_len, kv.kv_allocated_len)
        kv.kv_allocated_len = min(kv.kv_allocated_len, -(-prefix_len // ps) * ps)
        kv.kv_committed_len = min(kv.kv_committed_len, prefix_len)

    def _free_kv_aligned(self, kv: ReqKvInfo, target: int, end: int) -> None:
        """Free ``[ceil_align(target), end)``: whole pages; a partial page stays until the
        session ends."""
        ps = self.cache.page_size
        start = -(-target // ps) * ps
        if end > start:
            self.cache.free_kv_row(kv, [(start, end)])
