"""Why the eviction index is a heap, not ``sortedcontainers.SortedList`` (pytest-benchmark).

    python -m pytest bench/dev/benchmarks/test_ordered_set.py --benchmark-only \\
        --benchmark-group-by=param:members

The design names a sorted container for the KV leaves' order; ``components.ordered.
OrderedNodeSet`` is a lazy-deletion binary heap instead. Both run the same stream here, the
one an LRU eviction index sees: ``OPS`` rounds of a touch (a member's key rises to the clock:
a match or an insert passing it) and an eviction (pop the least member, insert a new one), over
sets of 1k, 10k and 100k members. ``SortedList`` keeps ``(key, id)`` tuples with a dict of each
member's current tuple (a move is a remove and an add). Both answer the same victims (checked
before timing).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

import pytest

from components.ordered import OrderedNodeSet
from radix.node import TreeNode

sortedcontainers = pytest.importorskip("sortedcontainers")

OPS = 2000


class SortedListSet:
    """The same interface over ``SortedList``: ``update``, ``pop_first``."""

    def __init__(self) -> None:
        self._list = sortedcontainers.SortedList()
        self._entries: dict[int, tuple[int, int]] = {}
        self._nodes: dict[int, TreeNode] = {}

    def update(self, node: TreeNode) -> None:
        entry = (node.last_access_time, node.id)
        old = self._entries.get(node.id)
        if old == entry:
            return
        if old is not None:
            self._list.remove(old)
        self._list.add(entry)
        self._entries[node.id] = entry
        self._nodes[node.id] = node

    def pop_first(self) -> TreeNode | None:
        if not self._list:
            return None
        _, nid = self._list.pop(0)
        del self._entries[nid]
        return self._nodes.pop(nid)


class OrderedSet(Protocol):
    def update(self, node: TreeNode) -> None: ...
    def pop_first(self) -> TreeNode | None: ...


def _key(n: TreeNode) -> tuple[int]:
    return (n.last_access_time,)


IMPLS: dict[str, Callable[[], OrderedSet]] = {
    "heap": lambda: OrderedNodeSet(_key),
    "sortedlist": SortedListSet,
}


def _node(nid: int, stamp: int) -> TreeNode:
    n = TreeNode(nid, 0)
    n.last_access_time = stamp
    return n


State = tuple[OrderedSet, list[TreeNode], dict[int, int], list[tuple[int, int]], list[TreeNode]]


def _prepare(impl: str, members: int, seed: int = 0) -> State:
    """A set of ``members`` nodes (stamps 0..members-1 over shuffled ids), their positions in
    the touch list, ``OPS`` (touched position, clock) pairs and the ``OPS`` nodes inserted
    after each eviction (made here: the timed loop is the set's work)."""
    rng = random.Random(seed)
    nodes = [_node(i, t) for t, i in enumerate(rng.sample(range(members), members))]
    s = IMPLS[impl]()
    for n in nodes:
        s.update(n)
    pos = {n.id: k for k, n in enumerate(nodes)}
    ops = [(rng.randrange(members), members + k) for k in range(OPS)]
    fresh = [_node(members + k, members + k) for k in range(OPS)]
    return s, nodes, pos, ops, fresh


def _play(s: OrderedSet, live: list[TreeNode], pos: dict[int, int],
          ops: list[tuple[int, int]], new: list[TreeNode]) -> list[int]:
    """Each op: touch one member, evict the least, insert a fresh one in its place."""
    victims = []
    for (k, clock), fresh in zip(ops, new, strict=True):
        n = live[k]
        n.last_access_time = clock
        s.update(n)
        v = s.pop_first()
        assert v is not None
        victims.append(v.id)
        s.update(fresh)
        at = pos.pop(v.id)
        live[at] = fresh
        pos[fresh.id] = at
    return victims


@pytest.mark.parametrize("members", [1_000, 10_000, 100_000])
def test_both_evict_the_same_victims(members: int) -> None:
    assert _play(*_prepare("heap", members)) == _play(*_prepare("sortedlist", members))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("members", [1_000, 10_000, 100_000])
def test_touch_and_evict(benchmark: Any, impl: str, members: int) -> None:
    benchmark.pedantic(_play, setup=lambda: (_prepare(impl, members), {}), rounds=15,
                       iterations=1)
