"""SGLang-shaped tree nodes: a view of a library node with the attributes the scheduler reads.

One view per library node while anyone holds it (``NodeViews``), so ``is`` compares nodes
as SGLang's code does. The view reads through to the library node: ``key`` (a
:class:`~radix.sglang.key.RadixKey` of the node's own tokens), ``value`` (its device KV slots,
``None`` once evicted), ``children`` (SGLang's child keys: the first token, or the first
page as a tuple, prefixed by ``extra_key`` when there is one), ``parent``, ``lock_ref``
(requests holding the node's KV: the node or a descendant locked), ``last_access_time``,
``creation_time`` (logical clock stamps), ``hit_count``, ``priority``, ``host_value``,
``mamba_value`` (``tensor([slot])`` or ``None``), ``hash_value`` (the L3 page hashes, hex).

``TreeNode()`` built by hand is a detached node with its own fields (SGLang's node unit
tests build them so); a view of a library node refuses assignment to the fields the tree
owns.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from components.kv import slot_tensor
from radix.sglang.key import RadixKey

if TYPE_CHECKING:
    from radix.node import TreeNode as LibNode


class TreeNode:
    """A node of the tree as SGLang's scheduler sees it (see the module docstring).

    Args:
        id: the node id (``None``: the next value of ``TreeNode.counter``).
        priority: request priority (detached nodes only).
    """

    counter = 0

    def __init__(self, id: int | None = None, priority: int = 0) -> None:
        self._node: LibNode | None = None
        self._views: NodeViews | None = None
        self._own: dict[str, Any] = {
            "children": {}, "parent": None, "key": None, "value": None, "lock_ref": 0,
            "hit_count": 0, "host_value": None, "hash_value": None, "priority": priority,
            "last_access_time": TreeNode.counter, "creation_time": TreeNode.counter,
            "mamba_value": None,
        }
        self.id = TreeNode.counter if id is None else id
        TreeNode.counter += 1
        self.host_ref_counter = 0

    @classmethod
    def _view(cls, views: NodeViews, node: LibNode) -> TreeNode:
        v = cls.__new__(cls)
        v._node = node
        v._views = views
        v._own = {}
        v.id = node.id
        v.host_ref_counter = 0
        return v

    # ----------------------------------------------------------------- fields
    def _get(self, name: str) -> Any:
        return self._own[name]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWNED:
            if self._node is not None:
                raise AttributeError(f"{name} of a tree node belongs to the cache")
            self._own[name] = value
            return
        object.__setattr__(self, name, value)

    @property
    def is_attached(self) -> bool:
        """A view of a node of a cache (not one built by hand)."""
        return self._node is not None

    @property
    def library_node(self) -> LibNode | None:
        """The library node (``radix.node.TreeNode``) this view reads, or ``None`` for a node
        built by hand."""
        return self._node

    @property
    def key(self) -> RadixKey | None:
        n = self._node
        if n is None:
            return self._get("key")
        return RadixKey(n.key, n.extra_key)

    @property
    def value(self) -> Any:
        n, views = self._node, self._views
        if n is None or views is None:
            return self._get("value")
        if n.parent is None:
            return []
        value = n.kv_value
        if value is None:
            return views.out_slots(None)
        return views.out_slots(slot_tensor(value) if views.device_slots is None
                               else views.device_slots([value]))

    @property
    def children(self) -> dict[Any, TreeNode]:
        n, views = self._node, self._views
        if n is None or views is None:
            return self._get("children")  # type is the caller's
        return {views.child_key(c): views.get(c) for c in n.children.values()}

    @property
    def parent(self) -> TreeNode | None:
        n, views = self._node, self._views
        if n is None or views is None:
            return self._get("parent")
        return None if n.parent is None else views.get(n.parent)

    @property
    def lock_ref(self) -> int:
        n = self._node
        if n is None:
            return int(self._get("lock_ref"))
        return 1 if n.parent is None else n.kv_lock

    @property
    def hit_count(self) -> int:
        n = self._node
        return int(self._get("hit_count")) if n is None else n.hit_count

    @property
    def priority(self) -> int:
        n = self._node
        return int(self._get("priority")) if n is None else n.priority

    @property
    def last_access_time(self) -> int:
        n = self._node
        return int(self._get("last_access_time")) if n is None else n.last_access_time

    @property
    def creation_time(self) -> int:
        n = self._node
        return int(self._get("creation_time")) if n is None else n.creation_time

    @property
    def host_value(self) -> Any:
        n = self._node
        return self._get("host_value") if n is None else n.host_value

    @property
    def mamba_value(self) -> torch.Tensor | None:
        n = self._node
        if n is None:
            return self._get("mamba_value")
        s = n.state_slot
        return None if s is None else torch.tensor([s], dtype=torch.int64)

    @property
    def hash_value(self) -> list[str] | None:
        n, views = self._node, self._views
        if n is None or views is None:
            return self._get("hash_value")
        return None if n.parent is None else views.page_hashes(n)

    @property
    def evicted(self) -> bool:
        """No device KV (host-only, or a detached node without a value)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """A host copy exists."""
        return self.host_value is not None

    def get_last_hash_value(self) -> str | None:
        hv = self.hash_value
        return hv[-1] if hv else None

    def protect_host(self) -> None:
        """One more holder of the host copy (a counter, as SGLang's)."""
        self.host_ref_counter += 1

    def release_host(self) -> None:
        """Raises ``RuntimeError`` when no holder is left."""
        if self.host_ref_counter <= 0:
            raise RuntimeError("Host reference counter is already zero.")
        self.host_ref_counter -= 1

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        state = "attached" if self._node is not None else "detached"
        return f"TreeNode(id={self.id}, {state}, key={self.key!r})"


_OWNED = frozenset({"children", "parent", "key", "value", "lock_ref", "hit_count",
                    "host_value", "hash_value", "priority", "last_access_time",
                    "creation_time", "mamba_value"})


class NodeViews:
    """The views of one cache's nodes: one per node while held, weakly kept.

    Args:
        page_size: tokens per page (SGLang's child keys).
        slot_offset: added to the caller's slot ids on the way in, subtracted on the way out
            (the simulated cache, whose opaque values may be 0: the library's slot ids start
            at the first page).
        page_hashes: node -> the node's L3 page hashes (hex), or ``None``.
        device_slots: node values -> one slot tensor on the KV device (what a node view's
            ``value`` is built with), or ``None`` (a view of the value on the host).
    """

    def __init__(self, page_size: int, slot_offset: int = 0,
                 page_hashes: Any = None, device_slots: Any = None) -> None:
        self.page_size = page_size
        self.slot_offset = slot_offset
        #: node values -> one slot tensor on the KV device (``KVComponent.device_slots``;
        #: ``None``: ``slot_tensor`` of the one value, on the host)
        self.device_slots = device_slots
        self._hashes = page_hashes
        self._views: weakref.WeakValueDictionary[tuple[int, int], TreeNode] = (
            weakref.WeakValueDictionary())

    def get(self, node: LibNode) -> TreeNode:
        """The view of ``node`` (the same object while it is held)."""
        k = (node.owner, node.id)
        v = self._views.get(k)
        if v is None or v._node is not node:
            v = TreeNode._view(self, node)
            self._views[k] = v
        return v

    def child_key(self, node: LibNode) -> Any:
        """SGLang's key of ``node`` in its parent's ``children``."""
        t = node.key
        plain: Any = int(t[0]) if self.page_size == 1 else tuple(t[: self.page_size].tolist())
        return plain if node.extra_key is None else (node.extra_key, plain)

    def out_slots(self, value: torch.Tensor | None) -> torch.Tensor | None:
        """Library slots -> the caller's."""
        if value is None or not self.slot_offset:
            return value
        return value - self.slot_offset

    def page_hashes(self, node: LibNode) -> list[str] | None:
        return None if self._hashes is None else self._hashes(node)
