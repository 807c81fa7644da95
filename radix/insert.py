"""The insert, after ``RadixCache.insert`` has checked its arguments.

Positions are tokens of the key, half-open; ``P`` = prefix already cached, ``E`` = the key cut
to whole pages::

    key    |<---------- P ---------->|<------------ new tail ------------>|  partial page
           [ matched nodes (revived) ][ new node ][ new node ...          ][ not cached ]
           0                          P   cuts (a component's, e.g. SWA)   E
                                                          insert_end <= E (a component may
                                                          keep the new tail out: P)

A component may also lower ``prefix_len`` (with ``insert_end``) to the end of a matched node,
stopping the insert above matched host-only nodes it cannot use: the path ends there, the
caller keeps its slots past it. Cuts below ``prefix_len`` fall inside matched host-only nodes
(where the caller's SWA KV turns live): the host tier revives each piece.

1. Plan (``components.base.InsertPlan``): every component and the host tier validate and plan
   (a state required, SWA tombstones to revive and the live part of the tail, host-only nodes
   to revive). A refusal raises here; nothing has changed.
2. Claim: the KV component checks and marks every caller slot the tree adopts (the new tail,
   the revival ranges) in one pass; the last check before anything changes.
3. Mutate: split where the walk ended inside a node, revive, stamp the path, one new leaf per
   segment of the new tail (each component's ``on_new_node``), then ``on_insert`` (the state
   is adopted at the end) and the tier's write policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from components.base import InsertPlan
from components.kv import to_value
from radix.results import InsertResult
from radix.tree import new_tuple

if TYPE_CHECKING:
    from components.kv import KVComponent, KVValue
    from radix.core import CacheCore
    from radix.node import TreeNode
    from radix.tree import Tokens, Walk

#: The tier hook an insert ends with (``(path, last node) -> None``: the host tier's write
#: policy).
AfterInsert = Callable[[list["TreeNode"], "TreeNode"], None]


class InsertContext:
    """What an insert reads besides its arguments, built once by the facade
    (``RadixCache``) and handed to :func:`insert_key`.

    Attributes:
        core: the tree and the components' hooks (``radix.core.CacheCore``).
        kv: the KV component (claims, attaches and joins slots).
        rid_depths: how deep each request id already counted in ``hit_count``.
        empty_slots: a 0-slot int64 tensor on the KV device (what an empty result holds).
        on_cpu: the KV slots live on the CPU (an insert's checked ``value`` is a CPU tensor).
        after_insert: the tier hook the insert ends with (the host tier's write policy), or
            ``None`` without a host tier.
    """

    __slots__ = ("core", "kv", "rid_depths", "empty_slots", "on_cpu", "after_insert")

    def __init__(self, core: CacheCore, kv: KVComponent, rid_depths: RidDepths,
                 empty_slots: torch.Tensor, on_cpu: bool,
                 after_insert: AfterInsert | None) -> None:
        self.core = core
        self.kv = kv
        self.rid_depths = rid_depths
        self.empty_slots = empty_slots
        self.on_cpu = on_cpu
        self.after_insert = after_insert


def own_copy(value: torch.Tensor, lo: int, hi: int) -> KVValue:
    """A node's own copy of ``value[lo:hi]``: a new ``array('q')`` (``components.kv.to_value``;
    a device tensor's host mirror: no CUDA call). A view would pin the caller's whole tensor
    and see its later writes."""
    return to_value(value[lo:hi])


def insert_key(ctx: InsertContext, key: Tokens, key_len: int, value: torch.Tensor, extra_key: Any,
               state_slot: int | None, priority: int, rid: object,
               trusted: bool = False, values: dict[str, Any] | None = None) -> InsertResult:
    """Insert the checked key ``key[:key_len]`` (see ``RadixCache.insert`` for the contract;
    ``key`` may run past ``key_len``: a prefix ``RadixKey`` is inserted from its base array,
    and the plan's positions stay below ``key_len``); ``trusted``: ``key`` is a ``RadixKey``'s
    token array (its walk may be the one its match remembered); ``values``: the checked
    per-insert values of components (``InsertPlan.value_of``)."""
    core = ctx.core
    ps = core.page_size
    end = key_len
    if ps != 1:
        end -= end % ps
        if state_slot is not None and end != key_len:
            raise ValueError(
                f"state_slot is the state after the key's {key_len} tokens, but the insert ends "
                f"at token {end} (whole pages of page_size={ps}): a state must sit at the end of "
                f"the node it lands on; insert key[:{end}] with the state valid after {end} "
                "tokens")
    tree = core.tree
    walk = tree.walk(key, end, extra_key, trusted)
    if core.unplanned_inserts:  # the plain KV cache: the plan would be the walk's
        return _insert_unplanned(ctx, key, value, extra_key, walk, end, priority, rid)
    plan = InsertPlan(key, value, extra_key, state_slot, walk, end, values)
    for p in core.planners:
        p(plan)
    own = _claim(ctx, plan)
    # ---- validated: mutate from here on
    path = walk.path
    core.clock += 1
    now = core.clock
    if plan.prefix_len < walk.matched_len:  # a component stopped the insert above matched
        path = [n for n in path if n.depth <= plan.prefix_len]  # nodes (host-only ones)
    elif walk.partial is not None:
        path.append(core.split_touched(walk.partial, walk.partial_len, now))
    counted = 0 if rid is None else ctx.rid_depths.counted(rid, plan.insert_end)
    revived = ctx.empty_slots
    if plan.revive:
        path, revived = _revive(ctx, path, plan)
    tree_prefix = _touch_path(path, now, priority, counted, end)
    for touch in core.touch_hooks:
        touch(path)
    last = path[-1] if path else tree.root
    prefix_len = plan.prefix_len
    if prefix_len < plan.insert_end:
        if not plan.cuts:  # the common case: one new leaf (stamped at creation)
            last = _new_leaf(ctx, plan, last, prefix_len, plan.insert_end, own, now)
            _stamp_new_leaf(last, priority, counted, end)
        else:
            new = _new_leaves(ctx, plan, last, now)
            for n in new:  # a new node's priority is its first request's, whatever its sign
                n.priority = priority
            _touch_path(new, now, priority, counted, end)
            if new:
                last = new[-1]
        ctx.kv.inserted += plan.insert_end - prefix_len
    for hook in core.refreshers:
        hook(last)
    adopted = False
    for on_insert in core.insert_hooks:
        adopted = on_insert(plan, last, now) or adopted
    after = ctx.after_insert
    if after is not None:
        after(path, last)
    return new_tuple(InsertResult, (prefix_len, plan.insert_end, last, adopted, revived, value,
                                    tree_prefix))


def _touch_path(path: list[TreeNode], now: int, priority: int, counted: int,
                end: int) -> list[KVValue | None]:
    """Stamp the nodes of an insert's path (its clock, a hit unless ``rid`` counted it
    already, the highest priority, the deepest depth reached) and return their KV values
    (``InsertResult.tree_values``), root side first."""
    tree_prefix = []
    for n in path:
        n.last_access_time = now
        if n.depth > counted:
            n.hit_count += 1
        if priority > n.priority:
            n.priority = priority
        if end > n.history_len:
            n.history_len = end
        tree_prefix.append(n.kv_value)
    return tree_prefix


def _insert_unplanned(ctx: InsertContext, key: Tokens, value: torch.Tensor, extra_key: Any,
                      walk: Walk, end: int, priority: int, rid: object) -> InsertResult:
    """:func:`insert_key` when no component or holder plans an insert, sees its new nodes or
    adopts anything at its end (``CacheCore.unplanned_inserts``: the plain KV cache). The plan
    would be the walk's (the new tail ``key[matched_len:end]``, no cuts, no revival), so none is
    built: the same claim, the same mutations in the same order, the same result (tested
    against the planned path, ``tests/radix/test_insert_unplanned.py``)."""
    core = ctx.core
    lo = walk.matched_len
    own = None
    if lo < end:  # the claim: the last check before anything changes
        kv = ctx.kv
        own = kv.claim_trusted(value, lo, end, True) if ctx.on_cpu \
            else kv.claim_device(value, lo, end, True)
    # ---- validated: mutate from here on
    path = walk.path
    core.clock += 1
    now = core.clock
    if walk.partial is not None:
        path.append(core.split_touched(walk.partial, walk.partial_len, now))
    counted = 0 if rid is None else ctx.rid_depths.counted(rid, end)
    tree_prefix = _touch_path(path, now, priority, counted, end)
    for touch in core.touch_hooks:
        touch(path)
    tree = core.tree
    last = path[-1] if path else tree.root
    refreshers = core.refreshers
    if own is not None:  # one new leaf (as _new_leaf, without a plan: no new-node hooks)
        parent = last
        last = tree.add_leaf(parent, key[lo:end], extra_key, now)
        ctx.kv.attach(last, own)
        if parent.parent is not None:
            for refresh in refreshers:
                refresh(parent)
        _stamp_new_leaf(last, priority, counted, end)
        ctx.kv.inserted += end - lo
    for hook in refreshers:
        hook(last)
    after = ctx.after_insert
    if after is not None:
        after(path, last)
    return new_tuple(InsertResult, (lo, end, last, False, ctx.empty_slots, value, tree_prefix))


class RidDepths:
    """How deep each request id already counted in ``hit_count``, so a request counts once
    per node, also across its chunked-prefill re-inserts; the ``limit`` most recent ids are
    kept (an older one counts again, as a new request would)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._depth: OrderedDict[object, int] = OrderedDict()

    def counted(self, rid: object, end: int) -> int:
        """How deep ``rid`` already counted [tokens] (0 for a new rid); records ``end``."""
        seen = self._depth
        counted = seen.pop(rid, 0)
        seen[rid] = max(counted, end)
        if len(seen) > self.limit:
            seen.popitem(last=False)
        return counted

    def release(self, rid: object) -> None:
        """Forget ``rid`` (the request finished)."""
        self._depth.pop(rid, None)


def _stamp_new_leaf(leaf: TreeNode, priority: int, counted: int, end: int) -> None:
    """A new leaf's stamps (as :func:`_touch_path` on a fresh node, stamped with the clock
    at its creation): its first hit, the insert's priority and the depth reached."""
    if leaf.depth > counted:
        leaf.hit_count = 1
    leaf.priority = priority  # (negative too: the max over the one request that made it)
    leaf.history_len = end


def _claim(ctx: InsertContext, plan: InsertPlan) -> KVValue | None:
    """Claim (``KVComponent.claim``) the slots the insert adopts: the new tail
    ``value[prefix_len:insert_end]`` and the revival ranges, as one tensor (a slot repeated
    across them is refused).

    Returns the claimed copy of the new tail when that is all the insert adopts and it becomes
    one leaf (the common case: the new leaf keeps the copy), else ``None`` (the nodes copy
    their parts, :func:`own_copy`). On a device the slots are read through their host mirror
    (no host synchronisation)."""
    value, lo, hi = plan.value, plan.prefix_len, plan.insert_end
    kv = ctx.kv
    if not plan.revive:  # the common case: only the new tail is adopted
        if lo >= hi:
            return None
        if ctx.on_cpu:  # (checked: the value is on the allocator's device)
            return kv.claim_trusted(value, lo, hi, not plan.cuts)
        return kv.claim_device(value, lo, hi, not plan.cuts)
    ranges = sorted((t, e) for e, (t, _) in plan.revive.items())
    if lo < hi:
        ranges.append((lo, hi))
    host = kv.host_slots(value)
    parts = [host[a:b] for a, b in ranges]
    kv.claim(torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts)))
    return None


def _revive(ctx: InsertContext, path: list[TreeNode], plan: InsertPlan
            ) -> tuple[list[TreeNode], torch.Tensor]:
    """Matched nodes planned for revival take the caller's slots from the planned start (a
    node only partly covered is split there first; a node with a planned revival ending
    inside it is cut there first, each piece revived as planned: a host-only node whose
    caller's SWA KV turns live inside it); the component or tier that planned it does the rest
    (``revive``). Returns the new path and the slots the nodes took: a view of
    the caller's ``value`` when they are one run of it (no CUDA call), else one new tensor on
    the cache's device (``KVComponent.device_slots``: one upload on a device)."""
    out: list[TreeNode] = []
    revived: list[KVValue] = []
    runs: list[tuple[int, int]] = []
    value, tree = plan.value, ctx.core.tree
    revive = plan.revive
    assert revive is not None
    ends = sorted(revive)
    for n in path:
        pieces = []  # a revival ending inside ``n`` cuts it there first: pieces revived apart
        for e in ends:
            if n.start < e < n.depth:
                pieces.append(tree.split(n, e - n.start))  # the upper part; ``n`` the rest
        pieces.append(n)
        for piece in pieces:
            r = revive.get(piece.depth)
            if r is None:
                out.append(piece)
                continue
            t, owner = r
            if t > piece.start:
                out.append(tree.split(piece, t - piece.start))
            own = own_copy(value, t, piece.depth)
            owner.revive(piece, own)
            revived.append(own)
            runs.append((t, piece.depth))
            out.append(piece)
    if not revived:
        return out, ctx.empty_slots
    if all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1)):
        return out, value[runs[0][0]:runs[-1][1]]
    return out, ctx.kv.device_slots(revived)


def _new_leaf(ctx: InsertContext, plan: InsertPlan, parent: TreeNode, lo: int, hi: int,
              own: KVValue | None, now: int) -> TreeNode:
    """A new node for ``key[lo:hi]`` below ``parent``, holding its own copy of the caller's
    slots (``own`` when the claim made it); ``parent`` is re-filed (no longer a leaf)."""
    core = ctx.core
    child = core.tree.add_leaf(parent, plan.key[lo:hi], plan.extra_key, now)
    ctx.kv.attach(child, own if own is not None else own_copy(plan.value, lo, hi))
    for hook in core.new_node_hooks:
        hook(child, plan, lo, hi)
    if parent.parent is not None:
        for refresh in core.refreshers:
            refresh(parent)
    return child


def _new_leaves(ctx: InsertContext, plan: InsertPlan, parent: TreeNode,
                now: int) -> list[TreeNode]:
    """One new node per segment of ``key[prefix_len:insert_end]`` (cut at ``plan.cuts``),
    each below the previous one; returns them, shallowest first."""
    lo = plan.prefix_len
    bounds = [lo, *sorted(c for c in plan.cuts if c > lo), plan.insert_end]
    created = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        parent = _new_leaf(ctx, plan, parent, lo, hi, None, now)
        created.append(parent)
    return created
