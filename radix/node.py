"""The radix tree node.

A node owns one key segment (a run of token ids, a whole number of pages long) and, per
component, the value for exactly those tokens. Fields are plain slots so the hot paths
(``match_prefix``/``insert``) touch attributes, not dictionaries.

Token positions are half-open: a node covers ``[start, end)`` of every key that passes through
it, where ``end = node.depth`` and ``start = node.depth - len(node.key)``::

    root ── A [0, 4) ── B [4, 8)     B.depth == 8, len(B.key) == 4
               └────── C [4, 6)      a split at a page multiple, never at 0
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from components.kv import KVValue

#: The key of a node that holds no tokens yet (the root): shared, never mutated.
_NO_TOKENS = array("q")


class _NoChildren(dict[Any, Any]):
    """The ``children`` of every leaf: one shared, empty dict that refuses writes.

    A leaf holds no dict of its own (about 80 bytes per leaf; most nodes are leaves): it
    points at :data:`NO_CHILDREN` until its first child is filed, when the tree gives it a
    dict of its own (``RadixTree.add_leaf`` / ``split``), and it points back at it when its
    last child leaves (``RadixTree.remove_leaf``). Reads (``get``, ``in``, ``len``,
    iteration, the C walk's ``PyDict_GetItem``) see an empty dict; a write raises
    ``TypeError`` instead of filing the child under every leaf at once. A dict subclass, so
    the C walk (``radix/_match.c``), which requires a dict, reads it as one.
    """

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "node.children of a leaf is the shared empty NO_CHILDREN: give the node a dict "
            "of its own (node.children = {...}) or add children through the tree"
        )

    __setitem__ = __delitem__ = __ior__ = _refuse
    setdefault = update = pop = popitem = clear = _refuse

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles are the shared one
        return (_no_children, ())


def _no_children() -> _NoChildren:
    return NO_CHILDREN


#: The children of every leaf (see :class:`_NoChildren`): compare with ``is``.
NO_CHILDREN = _NoChildren()


class TreeNode:
    """One node of the radix tree.

    Attributes (units in brackets):
        owner: id of the tree holding the node; 0 once removed (handles are checked in O(1)).
        key: token ids of this segment, ``array('q')`` [tokens]; a whole number of pages.
        children: first page of a child's key -> child. At the root the page is prefixed by the
            request's ``extra_key``: ``(extra_key, page)``. A leaf's is the shared, read-only
            :data:`NO_CHILDREN` (the tree swaps in a dict of its own with the first child).
        parent: ``None`` only for the root.
        depth: tokens from the root to the end of this node (the position of its last token + 1).
        kv_value: KV slot indices, one int64 per token of ``key`` (``None`` at the root and on a
            host-only node), owned by the KV component (``components.kv.KVValue``): an
            ``array('q')`` of the node's own on the host (on every device), never resized or
            written after it is attached (a split slices it into two new arrays). Read it as a
            tensor on the KV device through ``KVComponent.slots(node)``.
        kv_lock: requests holding this node's KV (the node or a descendant is locked).
        lock_ref: requests that locked exactly this node (``inc_lock_ref`` handles).
        state_slot: recurrent-state checkpoint valid after ``depth`` tokens, or ``None``.
        state_lock: requests that locked exactly this node (protects its state).
        swa_tombstone: the SWA KV of these tokens was freed while the full KV stays.
        swa_lock: requests whose sliding window covers this node (protects its SWA KV).
        swa_lock_starts: for locks taken on exactly this node, SWA lock start -> count.
        last_access_time: logical clock stamp of the last match/insert passing through.
        state_access_time: logical clock stamp of the last use of this node's state.
        hit_count: requests whose insert walked through or created this node.
        priority: max priority of the requests that inserted through this node.
        creation_time: logical clock stamp at creation.
        history_len: deepest depth ever reached below this node (``tlru``; never shrinks).
        host_value: host-pool indices when backed up (HiCache), else ``None``.
        host_state_slot: the host copy of the state at this node's end, or ``None``.
        host_swa_value: host SWA-pool indices of these tokens' SWA KV (a host copy of a live
            node's sliding-window KV), or ``None``.
        ext: one extension slot for plug-in components (``components.base.Component``
            added by the caller): ``None`` or a dict, component name -> its value (the
            built-in components keep slots of their own, for speed).
        gds_prio / gds_ver / gds_stamp: this state's GreedyDual-Size heap entry (priority,
            version) and the watermark at its last use (``components.gds``).
    """

    __slots__ = (
        "id",
        "owner",
        "key",
        "children",
        "parent",
        "depth",
        "extra_key",
        "kv_value",
        "kv_lock",
        "state_slot",
        "state_lock",
        "swa_tombstone",
        "swa_lock",
        "swa_lock_starts",
        "last_access_time",
        "state_access_time",
        "hit_count",
        "lock_ref",
        "priority",
        "creation_time",
        "history_len",
        "host_value",
        "host_state_slot",
        "host_swa_value",
        "ext",
        "gds_prio",
        "gds_stamp",
        "gds_ver",
        "__weakref__",
    )

    def __init__(self, node_id: int, clock: int, owner: int = 0) -> None:
        self.id = node_id
        self.owner = owner
        self.key: array = _NO_TOKENS  # replaced, never mutated in place
        self.children: dict[Any, TreeNode] = NO_CHILDREN
        self.parent: TreeNode | None = None
        self.depth = 0
        self.extra_key: Any = None
        self.kv_value: KVValue | None = None
        self.kv_lock = 0
        self.state_slot: int | None = None
        self.state_lock = 0
        self.swa_tombstone = False
        self.swa_lock = 0
        self.swa_lock_starts: dict[int, int] | None = None
        self.last_access_time = clock
        self.state_access_time = clock
        self.hit_count = 0
        self.lock_ref = 0
        self.priority = 0
        self.creation_time = clock
        self.history_len = 0
        self.host_value: torch.Tensor | None = None
        self.host_state_slot: int | None = None
        self.host_swa_value: torch.Tensor | None = None
        self.ext: dict[str, Any] | None = None
        self.gds_prio = 0.0
        self.gds_stamp = 0.0
        self.gds_ver = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def start(self) -> int:
        """Position of this node's first token [tokens]."""
        return self.depth - len(self.key)

    def path_to_root(self) -> list[TreeNode]:
        """Nodes from this one up to (excluding) the root, deepest first."""
        out: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out

    def __repr__(self) -> str:
        head = self.key[:4].tolist()
        more = "..." if len(self.key) > 4 else ""
        return (
            f"TreeNode(id={self.id}, span=[{self.start},{self.depth}), key={head}{more}, "
            f"state={self.state_slot}, kv_lock={self.kv_lock}, state_lock={self.state_lock})"
        )
