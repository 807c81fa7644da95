"""The tree core: keys, page-aligned walks, splits, leaves. No tensors, pools or policies.

Contract: ``tokens -> (matched length, path of nodes)``; ``split`` at a page multiple (never
at 0); ``add_leaf``; ``remove_leaf``. Per-component values are split by a hook the cache passes
in, so this module knows nothing of what the values are.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from radix.node import NO_CHILDREN, TreeNode

SplitHook = Callable[[TreeNode, TreeNode, int], None]

Tokens = array  # array('q'): int64 token ids, compact (8 bytes/token) and fast to slice/compare


def as_tokens(key: Any, name: str = "key") -> Tokens:
    """Validate a token sequence and return it as ``array('q')``.

    Accepts a list/tuple of ints, an ``array('q')``, or a 1-D integer numpy array / torch tensor.
    Cost: O(len) in C (about 20 ns/token from a list).

    Raises:
        TypeError: not a sequence of ints (floats, strings, bool or 2-D arrays...).
        ValueError: a negative token id.
    """
    if isinstance(key, array) and key.typecode == "q":
        out = key
    elif isinstance(key, (list, tuple)):
        kinds = set(map(type, key))  # C speed; refuses bool (an int subclass) and floats
        if kinds - {int} and not all(
            issubclass(k, (int, np.integer)) and not issubclass(k, (bool, np.bool_)) for k in kinds
        ):
            bad = next(t for t in key if type(t) not in (int,) and (
                isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))))
            raise TypeError(f"{name} must contain int token ids, found {bad!r}")
        try:
            out = array("q", key)
        except OverflowError:
            raise ValueError(f"{name} has a token id outside the int64 range") from None
    elif isinstance(key, torch.Tensor):
        if key.dim() != 1 or key.dtype.is_floating_point or key.dtype.is_complex or key.dtype == torch.bool:
            raise TypeError(
                f"{name} must be a 1-D integer tensor, got {key.dtype} of shape {tuple(key.shape)}"
            )
        out = array("q")
        out.frombytes(key.detach().to("cpu", torch.int64).numpy().tobytes())
    elif isinstance(key, np.ndarray):
        if key.ndim != 1 or key.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array, got {key.dtype} of shape {key.shape}")
        out = array("q")
        out.frombytes(key.astype(np.int64).tobytes())
    else:
        raise TypeError(f"{name} must be a list of int token ids, got {type(key).__name__}")
    if out and int(np.frombuffer(out, dtype=np.int64).min()) < 0:
        raise ValueError(f"{name} must contain token ids >= 0, found {min(out)}")
    return out


class RadixKey:
    """A validated key: token ids plus an optional ``extra_key`` namespace.

    Validation (ints >= 0) runs once, here; ``match_prefix`` / ``insert`` then trust it, so an
    engine that builds one key per request pays for validation once, not on every call.
    Plain sequences are accepted by the cache too and validated on each call.

    A prefix slice (``key[:n]``, ``key[:-1]``, ``key[0:n]``) is O(1): it shares the token array
    of the key it was cut from (:attr:`base`) and records its length (:attr:`end`); the key
    is ``base[:end]``. The cache walks and inserts ``base`` up to ``end`` without copying;
    :attr:`token_ids` makes the key's own array on first use (then keeps it). Any other
    slice copies its ids. A prefix keeps its whole base array alive as long as it lives.
    """

    __slots__ = ("base", "end", "extra_key", "_ids")

    def __init__(self, token_ids: Any, extra_key: Any = None) -> None:
        ids = as_tokens(token_ids, "token_ids")
        if extra_key is not None:
            resolve_key(ids, extra_key)  # hashability check
        #: The token array this key is a prefix of (shared with the keys sliced from it).
        self.base: Tokens = ids
        #: The key's length: it is ``base[:end]``.
        self.end: int = len(ids)
        self.extra_key = extra_key
        self._ids: Tokens | None = ids

    @property
    def token_ids(self) -> Tokens:
        """The key's token ids (``base[:end]``: for a prefix slice, copied once on first
        use)."""
        ids = self._ids
        if ids is None:
            ids = self._ids = self.base[: self.end]
        return ids

    def __len__(self) -> int:
        return self.end

    def __getitem__(self, item: slice) -> RadixKey:
        if not isinstance(item, slice):
            raise TypeError("RadixKey supports slicing only")
        start, stop, step = item.indices(self.end)
        out = RadixKey.__new__(RadixKey)
        out.extra_key = self.extra_key
        if start == 0 and step == 1:  # a prefix: the same array, a shorter end (no copy)
            base = out.base = self.base
            out.end = stop
            out._ids = base if stop == len(base) else None
        else:
            ids = out.base = self.token_ids[item]
            out.end = len(ids)
            out._ids = ids
        return out

    def __repr__(self) -> str:
        return f"RadixKey(len={self.end}, extra_key={self.extra_key!r})"


def namespace_key(extra_key: Any) -> Any:
    """The typed form of a namespace, under which the root files its children.

    Namespaces are equal only when their types and values are: ``None``, ``""``, ``"1"``,
    ``1``, ``True`` and ``1.0`` are six namespaces (Python's ``1 == True == 1.0`` would merge
    three of them). The typing follows the L3 key encoding
    (``hicache.storage.keys.encode_namespace``): ``bool``, ``int``, ``str``, ``bytes``,
    ``float`` (by its hex form, so ``-0.0`` and ``0.0`` differ) and tuples and frozen
    dataclasses of these, element by element, and frozensets of these. ``None`` stays
    ``None`` (the common case costs nothing). Anything else (a tensor, a plain object: hashed
    and compared by identity, so a namespace an engine builds per request would never match)
    raises ``TypeError`` naming ``extra_key``. Subclasses of ``int``
    other than ``bool`` (``IntEnum`` members), of ``str`` (``StrEnum``), ``bytes`` and
    ``float`` are their plain values (``Color.RED`` and ``1`` are one tenant, as ``==`` says);
    a named tuple is a tuple. Dataclass types are told apart by identity: two types of one
    qualified name (made by a factory, or the old class of a reloaded module) are two
    tenants here, and L3 stores neither (``hicache.storage.keys.names_itself``), so every
    namespace L3 stores is one tenant there exactly when it is one here.

    >>> namespace_key(None), namespace_key(1), namespace_key(True)
    (None, ('i', 1), ('b', True))
    """
    if extra_key is None:
        return None
    if isinstance(extra_key, bool):
        return ("b", extra_key)
    if isinstance(extra_key, int):
        return ("i", int(extra_key))
    if isinstance(extra_key, str):
        return ("s", str.__str__(extra_key))
    if isinstance(extra_key, bytes):
        return ("y", bytes(extra_key))
    if isinstance(extra_key, float):
        return ("f", extra_key.hex())
    if isinstance(extra_key, tuple):
        return ("t", tuple(namespace_key(x) for x in extra_key))
    t = type(extra_key)
    if (
        dataclasses.is_dataclass(extra_key)
        and getattr(t, "__dataclass_params__", None) is not None
        and t.__dataclass_params__.frozen
    ):
        fields = tuple(getattr(extra_key, f.name) for f in dataclasses.fields(extra_key))
        return ("d", t, namespace_key(fields))
    if isinstance(extra_key, frozenset):
        return ("z", frozenset(namespace_key(x) for x in extra_key))
    raise TypeError(
        f"extra_key must be a value (None, bool, int, str, bytes, float, or a tuple, frozenset "
        f"or frozen dataclass of these), got {t.__name__}: an object compared by identity (a "
        "tensor, a plain object) would never match a namespace built again per request")


def resolve_key(key: Any, extra_key: Any) -> tuple[Tokens, Any]:
    """``(token ids, extra_key)`` from a :class:`RadixKey` or a plain token sequence.

    Raises:
        TypeError: an unhashable ``extra_key``, or one that is not a value
            (:func:`namespace_key`).
        ValueError: a ``RadixKey`` and a different ``extra_key`` argument (different in type
            or value: see :func:`namespace_key`).
    """
    if extra_key is not None:
        try:
            hash(extra_key)
        except TypeError:
            raise TypeError(
                f"extra_key must be hashable (str, int, tuple...), got {type(extra_key).__name__}"
            ) from None
        namespace_key(extra_key)  # a value, not an object compared by identity
    if isinstance(key, RadixKey):
        if extra_key is not None and namespace_key(extra_key) != namespace_key(key.extra_key):
            raise ValueError(
                f"extra_key={extra_key!r} conflicts with the RadixKey's {key.extra_key!r}"
            )
        return key.token_ids, key.extra_key
    return as_tokens(key), extra_key


def _common_prefix_len_py(seg: Tokens, key: Tokens, pos: int, limit: int) -> int:
    """Length of the common prefix of ``seg[:limit]`` and ``key[pos:pos+limit]`` [tokens].

    Binary search over slice comparisons (each a C loop): O(limit) work in C and
    O(log limit) Python steps, instead of a Python loop per token. The reference for (and the
    fallback of) the C version, ``radix/_match.c``: one memcmp, no slice copies.
    """
    if seg[:limit] == key[pos : pos + limit]:
        return limit
    lo, hi = 0, limit  # seg[:lo] matches, seg[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if seg[lo:mid] == key[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    return lo


try:  # one memcmp (radix/_match.c), built by ``pip install``
    from radix._match import common_prefix_len
except ImportError:  # pragma: no cover - no compiler at install time
    common_prefix_len = _common_prefix_len_py


def _walk_from_py(child: TreeNode | None, key: Tokens, end: int,
                  ps: int) -> tuple[list[TreeNode], TreeNode | None, int, int]:
    """The walk of ``key[:end]`` from ``child``, the root's child filed under the key's first
    page: ``(path, partial, partial_len, matched_len)`` as in :class:`Walk`. The reference for
    (and the fallback of) ``radix._match.walk_from``, which runs this loop in C."""
    path: list[TreeNode] = []
    pos = 0
    while child is not None:
        seg = child.key
        seg_len = len(seg)
        n = common_prefix_len(seg, key, pos, seg_len if pos + seg_len <= end else end - pos)
        if n != seg_len:
            n -= n % ps  # >= one page: the child's first page matched its index key
            return path, child, n, pos + n
        path.append(child)
        pos += seg_len
        if pos >= end:
            break
        child = child.children.get(key[pos] if ps == 1 else key[pos : pos + ps].tobytes())
    return path, None, 0, pos


try:  # the walk's loop in C (radix/_match.c)
    from radix._match import walk_from
except ImportError:  # pragma: no cover - no compiler at install time
    walk_from = _walk_from_py


class Walk(NamedTuple):
    """A read-only walk of a key (a tuple: built twice per request, so no dataclass).

    ``path``: nodes matched whole, root excluded, shallowest first. ``partial``: the node the
    key leaves inside its segment (``None`` if it left at a node boundary); ``partial_len``:
    tokens of ``partial`` matched (a page multiple > 0). ``matched_len``: tokens matched.
    """

    path: list[TreeNode]
    partial: TreeNode | None
    partial_len: int
    matched_len: int


#: Builds a named tuple from a tuple of all its fields, in C (the generated ``__new__`` is a
#: Python call): ``new_tuple(Walk, (path, partial, partial_len, matched_len))``. The hot
#: paths build their results (``Walk``, ``MatchResult``, ``InsertResult``) with it.
new_tuple = tuple.__new__


class RadixTree:
    """Nodes over page-aligned token keys, namespaced by ``extra_key`` at the root."""

    _next_uid = 0

    def __init__(self, page_size: int, split_hook: SplitHook) -> None:
        self.page_size = page_size
        self._split_hook = split_hook
        self.reset()

    def reset(self) -> None:
        """Start empty under a new identity: nodes of before are no longer attached (their
        handles fail :meth:`is_attached`), node ids start at 0 again."""
        RadixTree._next_uid += 1
        self.uid = RadixTree._next_uid
        self._next_id = 0
        self.root = self.new_node(0)
        self.num_nodes = 0  # excluding the root
        #: Bumped by every change of the structure (split, leaf added or removed, reset): a
        #: walk recorded at one version is the walk of the same key at that version.
        self.version = getattr(self, "version", 0) + 1
        #: The last walk of a trusted key: (tokens, end, typed namespace, version, walk).
        self._memo: tuple[Tokens, int, Any, int, Walk] | None = None

    def new_node(self, clock: int) -> TreeNode:
        node = TreeNode(self._next_id, clock, self.uid)
        self._next_id += 1
        return node

    def page_key(self, key: Tokens, pos: int) -> Any:
        """Child-index key of the page starting at ``pos``: the token (page size 1) or the
        page's bytes."""
        if self.page_size == 1:
            return key[pos]
        return key[pos : pos + self.page_size].tobytes()

    def child_key(self, parent: TreeNode, key: Tokens, pos: int, extra_key: Any) -> Any:
        """Child-index key of the page at ``pos`` below ``parent``; at the root it is prefixed
        by the typed namespace (:func:`namespace_key`)."""
        pk = key[pos] if self.page_size == 1 else key[pos : pos + self.page_size].tobytes()
        return pk if parent is not self.root else (namespace_key(extra_key), pk)

    def walk(self, key: Tokens, end: int, extra_key: Any, trusted: bool = False) -> Walk:
        """Match ``key[:end]`` (``end`` a page multiple) against the tree; mutates nothing.

        ``trusted``: ``key`` is the token array of a :class:`RadixKey`, never changed after
        it was built. The last trusted walk is remembered, and a walk of the same array
        object, ``end`` and namespace while the tree's structure is unchanged
        (:attr:`version`) returns it again without walking: an engine's ``match_prefix``
        and ``insert`` of one request walk the same key over the same tree. A remembered
        walk is shared: its ``path`` list may be extended only together with a change of
        the structure (the split where a walk ended inside a node), which retires it.
        """
        ns = None if extra_key is None else namespace_key(extra_key)
        if trusted:
            m = self._memo
            if m is not None and m[0] is key and m[3] == self.version and m[1] == end \
                    and m[2] == ns:
                return m[4]
        ps = self.page_size
        child = None
        if end > 0:  # the root files its children under (namespace, first page)
            child = self.root.children.get((ns, key[0] if ps == 1 else key[0:ps].tobytes()))
        if child is None:
            w = new_tuple(Walk, ([], None, 0, 0))
        else:
            w = new_tuple(Walk, walk_from(child, key, end, ps))
        if trusted:
            self._memo = (key, end, ns, self.version, w)
        return w

    def split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Split ``node`` after ``split_len`` tokens; return the new upper node.

        The upper node takes ``key[:split_len]`` and the node's KV lock count, access stamps,
        hit count and priority; the lower part keeps its identity (and any state, which is
        valid at its end). ``split_len`` must be a page multiple in ``(0, len(node.key))``.
        """
        ps = self.page_size
        assert 0 < split_len < len(node.key) and split_len % ps == 0, (split_len, node)
        parent = node.parent
        assert parent is not None
        upper = self.new_node(node.creation_time)
        upper.key = node.key[:split_len]
        upper.depth = node.depth - len(node.key) + split_len
        upper.extra_key = node.extra_key
        upper.parent = parent
        upper.kv_lock = node.kv_lock
        upper.last_access_time = node.last_access_time
        upper.state_access_time = node.last_access_time
        upper.hit_count = node.hit_count
        upper.priority = node.priority
        upper.history_len = node.history_len
        ck = self.child_key(parent, node.key, 0, node.extra_key)
        parent.children[ck] = upper
        node.key = node.key[split_len:]
        node.parent = upper
        upper.children = {self.page_key(node.key, 0): node}  # (a new node: NO_CHILDREN)
        self.num_nodes += 1
        self.version += 1
        self._split_hook(upper, node, split_len)
        return upper

    def add_leaf(self, parent: TreeNode, seg: Tokens, extra_key: Any, clock: int) -> TreeNode:
        """Attach a new leaf holding ``seg`` (a page multiple, first page new under ``parent``)."""
        leaf = TreeNode(self._next_id, clock, self.uid)
        self._next_id += 1
        leaf.key = seg
        leaf.depth = parent.depth + len(seg)
        leaf.extra_key = extra_key
        leaf.parent = parent
        pk = seg[0] if self.page_size == 1 else seg[: self.page_size].tobytes()  # (child_key)
        if parent is self.root:
            pk = (namespace_key(extra_key), pk)
        children = parent.children
        if children is NO_CHILDREN:  # its first child: a dict of its own
            parent.children = children = {}
        children[pk] = leaf
        self.num_nodes += 1
        self.version += 1
        return leaf

    def remove_leaf(self, node: TreeNode) -> TreeNode:
        """Detach a leaf; return its former parent. The node is marked detached."""
        assert not node.children and node.parent is not None, node
        parent = node.parent
        children = parent.children
        del children[self.child_key(parent, node.key, 0, node.extra_key)]
        if not children:  # a leaf again: back to the shared empty children
            parent.children = NO_CHILDREN
        node.parent = None
        node.depth = -1
        node.owner = 0
        self.num_nodes -= 1
        self.version += 1
        return parent

    def is_attached(self, node: TreeNode) -> bool:
        """Whether ``node`` is in this tree (not removed, not from another cache). O(1)."""
        return node.owner == self.uid

    def iter_nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
