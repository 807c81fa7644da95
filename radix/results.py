"""Small immutable results returned to the engine, and the request record of the helpers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from allocators.host_mirror import host_ids, register
from allocators.staging import upload
from components.kv import cat_values, slot_tensor
from radix.node import TreeNode

if TYPE_CHECKING:
    from components.kv import KVValue
    from radix.tree import RadixKey


class MatchResult(NamedTuple):
    """Result of :meth:`RadixCache.match_prefix` (an immutable tuple: cheap to build).

    Attributes:
        device_indices: 1-D int64 tensor of KV slot indices of the usable prefix,
            ``len == prefix_len`` [slots]. **Read-only**: when the prefix ends in the first
            node below the root it is a zero-copy view of that node's own slots (no copy per
            match), so a write would change the tree (``sanity_check`` then fails); copy it
            (``.clone()``, or into the engine's ``req_to_token`` row) before writing.
        prefix_len: usable prefix [tokens]; with a recurrent-state component, truncated to the
            end of the deepest matched node that holds a state.
        kv_hit_length: longest prefix whose KV is cached, ignoring other components [tokens].
        last_device_node: node at ``prefix_len`` (the root when 0): lock it with
            ``inc_lock_ref`` while a request uses the prefix.
        state_slot: the tree's state slot valid after ``prefix_len`` tokens, or ``None``.
            Copy it into the request's own slot before mutating (copy-on-write).
        branching_seqlen: where the key leaves the tree past the usable prefix (a branch point,
            page aligned) so the engine checkpoints its state there; ``None`` when there is
            none or no state component.
        last_host_node / host_hit_length: with HiCache, the deepest matched node usable once
            its host-only chain is loaded back (``RadixCache.load_back``), and the tokens past
            ``prefix_len`` that would add [tokens]; ``last_device_node`` and 0 otherwise.
        swa_miss_tokens: tokens the sliding-window rule alone cut off (a tombstone within a
            window of the end), beyond what the state rule cut [tokens]; 0 without SWA.
        swa_host_hit_length / state_host_hit_length: what a ``load_back(last_host_node)``
            would bring to device besides the full KV: SWA KV tokens (host copies of live
            nodes of the chain) [tokens] and recurrent states (the one at
            ``last_host_node`` when it is on host only) [states]; the host tier's load plan,
            0 without a host hit.
        parts: component name -> that component's part of the match (what its ``match_part``
            returns for ``last_device_node``; ``components.base``), or ``None`` when no
            component of the cache has one (the built-ins report through the fields above).
            Last, so a result built by position without it stays valid.
    """

    device_indices: torch.Tensor
    prefix_len: int
    kv_hit_length: int
    last_device_node: TreeNode
    state_slot: int | None = None
    branching_seqlen: int | None = None
    last_host_node: TreeNode | None = None
    host_hit_length: int = 0
    swa_miss_tokens: int = 0
    swa_host_hit_length: int = 0
    state_host_hit_length: int = 0
    parts: dict[str, Any] | None = None

    @property
    def state_miss_tokens(self) -> int:
        """KV-matched tokens that cannot be used for want of a state [tokens]."""
        return self.kv_hit_length - self.prefix_len


class InsertResult(NamedTuple):
    """Result of :meth:`RadixCache.insert`: exactly what happened to the caller's slots.

    Attributes:
        prefix_len: leading tokens that were already cached [tokens].
        inserted_len: tokens of the key now in the tree (the key cut to whole pages).
        last_node: the node ending at ``inserted_len`` (the root when 0).
        state_adopted: whether the tree took ``state_slot``; when False the caller still owns it.
        revived_indices: the caller's slots the tree took over tombstoned SWA nodes or
            host-only nodes (their old device slots, if any, were freed by the tree); not
            duplicates, not the caller's any more. A view of ``value`` when they are one run
            of it (read-only), else a new tensor on its device.
        value: the caller's slot tensor, as passed.
        tree_values: the tree's nodes' KV values (``node.kv_value``: ``array('q')`` on the
            host, on every device) over ``[0, prefix_len)``, one per node.

    Properties (computed on access): ``tree_slots`` (the same as 1-D int64 tensors, zero-copy
    views of the nodes' own slots, on the host on every device: read-only, as ``MatchResult.device_indices``), ``adopted_indices`` (``value[prefix_len:inserted_len]``,
    now the tree's), ``remainder_indices`` (``value[inserted_len:]``, the partial-page tail,
    still the caller's), ``duplicate_indices`` (the caller's slots in ``[0, prefix_len)`` that
    differ from the tree's: the caller frees them; slots it got from the tree are not listed).
    """

    prefix_len: int
    inserted_len: int
    last_node: TreeNode
    state_adopted: bool
    revived_indices: torch.Tensor
    value: torch.Tensor
    tree_values: list[KVValue]

    @property
    def tree_slots(self) -> list[torch.Tensor]:
        return [slot_tensor(v) for v in self.tree_values]

    @property
    def adopted_indices(self) -> torch.Tensor:
        return self.value[self.prefix_len : self.inserted_len]

    @property
    def remainder_indices(self) -> torch.Tensor:
        return self.value[self.inserted_len :]

    @property
    def duplicate_indices(self) -> torch.Tensor:
        caller = self.value[: self.prefix_len]
        if self.prefix_len == 0:
            return caller
        ts = self.tree_values
        if caller.is_cpu:
            tree = slot_tensor(ts[0]) if len(ts) == 1 else cat_values(ts)
            return caller[caller != tree]
        # on a device: compared on the host copies, the result uploaded (no host sync)
        host = host_ids(caller, "value")
        tree_h = np.concatenate([host_ids(slot_tensor(t), "tree slots") for t in ts])
        dup = host[host != tree_h]
        return register(upload(dup, caller.device), dup)


class EvictResult(NamedTuple):
    """What one eviction call freed: full KV tokens [tokens], recurrent states [slots] and
    SWA KV tokens [tokens] (tombstoned or removed with their node), and ``other``: ``(field,
    units)`` for each other component of the cache with an ``evict_field`` (a plug-in's units),
    in component order (``()`` when there is none). An immutable tuple, like
    :class:`MatchResult` and :class:`InsertResult`: the cache builds it in about 0.1 us, where
    the frozen dataclass it was took about 0.65 us of every ``evict`` call."""

    num_tokens: int = 0
    num_states: int = 0
    num_swa_tokens: int = 0
    other: tuple[tuple[str, int], ...] = ()

    def units(self, field: str) -> int:
        """The units freed of ``field``: one of the three fields above, or another
        component's ``evict_field`` listed in ``other``.

        Raises:
            KeyError: ``field`` is neither (naming what this result has).
        """
        if field in ("num_tokens", "num_states", "num_swa_tokens"):
            return int(getattr(self, field))
        for name, n in self.other:
            if name == field:
                return n
        raise KeyError(f"no eviction field {field!r} in this result; it has num_tokens, "
                       f"num_states, num_swa_tokens{''.join(', ' + f for f, _ in self.other)}")


@dataclass
class CacheRequest:
    """The request record used by ``cache_unfinished_req`` / ``cache_finished_req``.

    A plain value holder the engine fills; the cache reads and writes only these fields.

    Attributes:
        key: the request's token ids (prompt, and output when it is to be cached).
        kv_indices: 1-D int64 KV slots of the tokens computed so far (``req_to_token`` row).
        cached_len: leading tokens whose slots belong to the tree (locked through
            ``last_node``) [tokens].
        last_node: the node this request holds locked (root when nothing is).
        extra_key: namespace (LoRA id, cache salt).
        priority: request priority (``priority`` policy).
        rid: request id; a request counts once per node in ``hit_count``.
        lock: what ``inc_lock_ref(last_node)`` returned; ``None`` lets ``last_node`` stand
            for its own lock, which a cache whose locks carry data (a sliding-window
            component) refuses. The helpers keep it up to date as they move the lock.
        swa_evicted_seqlen: leading tokens whose SWA KV this request already released
            (they slid out of its window) [tokens].
        extra: the request's hints (:mod:`radix.hints`, e.g. ``{"session_id": sid}``), passed
            to every insert of the helpers; never part of the key.
    """

    key: list[int] | RadixKey | torch.Tensor | np.ndarray
    kv_indices: torch.Tensor
    cached_len: int
    last_node: TreeNode
    extra_key: Any = None
    priority: int = 0
    rid: object = None
    lock: TreeNode | LockRef | None = None
    swa_evicted_seqlen: int = 0
    extra: Mapping[str, Any] | None = None


class LockRef:
    """A lock :meth:`RadixCache.inc_lock_ref` took on a cache whose components keep data per
    lock (the sliding-window component: where its window lock starts). Opaque to the engine:
    hand it back to :meth:`RadixCache.dec_lock_ref` exactly once. Caches without such data
    return the node itself as its lock.

    Attributes:
        node: the locked node.
        released: whether ``dec_lock_ref`` already released it.
    """

    __slots__ = ("node", "_parts", "released")

    def __init__(self, node: TreeNode, parts: dict[str, Any]) -> None:
        self.node = node
        self._parts = parts
        self.released = False

    def part(self, component: str) -> Any:
        """What component ``component``'s lock recorded (the SWA lock's start position
        [tokens] for ``"swa"``).

        Raises:
            KeyError: no such component keeps data in this lock.
        """
        return self._parts[component]

    @property
    def parts(self) -> dict[str, Any]:
        """Component name -> what its lock recorded (a copy)."""
        return dict(self._parts)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"LockRef(node={self.node.id}, {self._parts}, {state})"
