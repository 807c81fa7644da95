"""The offline reference's eviction order (bench/dev/policies/offline.py): ``belady`` weighs a
next use by the tokens its user must prefill again; ``belady_next`` orders by next use alone."""

from __future__ import annotations

from array import array

import pytest

from bench.dev.policies.offline import CostAwareOfflineStrategy, OfflineStrategy
from bench.policies.strategies import NEVER, NextUseIndex
from bench.traces.loader import TraceRequest
from radix.node import TreeNode


def tree_node(nid: int, parent: TreeNode, depth: int, state: bool, stamp: int) -> TreeNode:
    n = TreeNode(nid, stamp)
    n.parent = parent
    n.depth = depth
    n.key = array("q", range(depth - parent.depth))
    n.state_slot = nid if state else None
    n.state_access_time = stamp
    n.last_access_time = stamp
    parent.children = {**parent.children, nid: n}
    return n


class FixedNext(OfflineStrategy):
    """``belady_next`` with next uses given by node id (``fixed``)."""

    fixed: dict[int, int] = {}

    def state_next_use(self, node: TreeNode) -> int:
        return self.fixed[node.id]


class FixedCost(CostAwareOfflineStrategy):
    """``belady`` with next uses given by node id (``fixed``)."""

    fixed: dict[int, int] = {}

    def state_next_use(self, node: TreeNode) -> int:
        return self.fixed[node.id]


def strategies(next_use: dict[int, int], now: int
               ) -> tuple[list[OfflineStrategy], dict[str, TreeNode]]:
    """A document state D (30,000 tokens below the root, next used at request 50), a chat
    state Q below it (300 tokens more, next used at 40), a state E (1,000 tokens, below a
    stateless node at 500, next used at 45) and a state N never used again; both walks with
    their next uses fixed to these, request ``now`` being served."""
    root = TreeNode(0, 0)
    d = tree_node(1, root, 30_000, True, 1)
    q = tree_node(2, d, 30_300, True, 2)
    f = tree_node(3, root, 500, False, 3)
    e = tree_node(4, f, 1_000, True, 4)
    n = tree_node(5, root, 64, True, 5)
    nodes = {"D": d, "Q": q, "E": e, "N": n}
    trace = [TraceRequest(0.0, 8, 1, 4, (0, 1), ((1, 4), (5, 4)))]
    out: list[OfflineStrategy] = []
    for cls in (FixedNext, FixedCost):
        s = cls(lambda _n: True, NextUseIndex(trace, 4))
        s.index = now
        s.fixed = next_use
        out.append(s)
    return out, nodes


def test_cost_aware_rank_is_distance_over_lost_tokens() -> None:
    """At request 10: Q's rank is (40 - 10) / 300 = 0.1 (its nearest stateful ancestor is D);
    D's (50 - 10) / 30,000; E's (45 - 10) / 1,000 (the stateless node above it does not
    count, the root is the base); N never used again ranks NEVER. ``belady_next`` ranks by
    the next use itself."""
    (plain, cost), nodes = strategies({1: 50, 2: 40, 4: 45, 5: NEVER}, now=10)
    assert cost.rank(nodes["Q"]) == pytest.approx(30 / 300)
    assert cost.rank(nodes["D"]) == pytest.approx(40 / 30_000)
    assert cost.rank(nodes["E"]) == pytest.approx(35 / 1_000)
    assert cost.rank(nodes["N"]) == float(NEVER)
    assert [plain.rank(nodes[k]) for k in "DQEN"] == [50.0, 40.0, 45.0, float(NEVER)]


def test_victim_order_never_used_first_then_by_rank() -> None:
    """The next-use-only order evicts N, then the document D (farthest use); the cost-aware
    one evicts N, then the chat state Q (0.1 > 0.035 > 0.0013), keeping the 30,000-token
    document. KV leaves follow the same rank (``kv_pick``)."""
    (plain, cost), nodes = strategies({1: 50, 2: 40, 4: 45, 5: NEVER}, now=10)
    for s in (plain, cost):
        for k in "DQEN":
            s.on_set(nodes[k])
    assert plain.pop_victim() is nodes["N"] and cost.pop_victim() is nodes["N"]
    for s in (plain, cost):
        s.on_remove(nodes["N"])
    assert plain.pop_victim() is nodes["D"]
    assert cost.pop_victim() is nodes["Q"]
    leaves = [nodes["Q"], nodes["E"]]
    assert cost.kv_pick(leaves) == 0 and plain.kv_pick(leaves) == 1
