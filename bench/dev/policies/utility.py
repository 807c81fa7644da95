"""Normalised-utility baselines that order KV leaves as well as states (replay only).

SGLang's two cost-aware proposals for hybrid models score *every* eviction candidate by a
recency term plus a weighted efficiency term, both min-max normalised over the candidates at
each eviction, and apply the score to both pools (full-KV leaves and Mamba states):

* ``seglen`` (SGLang PR 22172, from its description): efficiency = the replay length to the
  nearest ancestor holding a state (``depth - a``), weight ``--seglen-eff-weight`` 0.85 there::

      score(n) = minmax(recency)(n) + 0.85 * minmax(depth - a)(n)

  A hit refreshes only the matched last node (this library's state rule already does).
* ``marconi`` (PR 21862, and the paper's section 4.2): efficiency = FLOPs saved per byte
  held (``bench.policies.strategies.MarconiStrategy.efficiency``), weight alpha tuned on replayed
  windows; here the state walk is :class:`bench.policies.strategies.MarconiStrategy` and this module
  adds its KV side (the same score over KV leaves).

Evict the lowest score. Recency is the state's own access stamp for states and the node's
``last_access_time`` for KV leaves. :class:`ScanLeafSet` stands in for the cache's ordered
KV-leaf set (``bench.policies.strategies.install_kv_order``'s contract): it keeps the members and
scans them at each pop, O(leaves) per eviction, like the PRs' own scans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from bench.engine.presets import get_preset
from bench.policies.baselines import Baseline, BaselineContext, register
from bench.policies.strategies import MarconiStrategy, StateStrategy, _LiveSet, minmax
from radix.node import TreeNode

__all__ = ["SEGLEN_WEIGHT", "ScanLeafSet", "SeglenStrategy", "install_scan_kv", "seglen"]

SEGLEN_WEIGHT = 0.85
"""The efficiency weight of SGLang's ``seglen`` example command (``--seglen-eff-weight``)."""

Score = Callable[[Sequence[TreeNode]], np.ndarray]


def seglen(node: TreeNode) -> int:
    """Replay length [tokens] from the nearest ancestor holding a device state (0: root)."""
    n = node.parent
    while n is not None and n.parent is not None:
        if n.state_slot is not None:
            return node.depth - n.depth
        n = n.parent
    return node.depth


class ScanLeafSet:
    """The KV-leaf candidates of a cache, popped by the lowest ``score`` over all of them
    (``score``: nodes -> one float each), or by ``pick`` (nodes -> the victim's index).

    The interface the KV component uses of ``radix.ordered.OrderedNodeSet``: ``update``,
    ``discard``, ``pop_first``, ``first``, membership, ``len``, iteration, ``check``.
    """

    def __init__(self, score: Score | None = None,
                 pick: Callable[[Sequence[TreeNode]], int] | None = None) -> None:
        if (score is None) == (pick is None):
            raise ValueError("ScanLeafSet needs exactly one of score and pick")
        if pick is None:
            assert score is not None
            by_score = score

            def pick(nodes: Sequence[TreeNode]) -> int:
                return int(np.argmin(by_score(nodes)))

        self._pick = pick
        self._nodes: dict[int, TreeNode] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self._nodes

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(list(self._nodes.values()))

    def update(self, node: TreeNode) -> None:
        self._nodes[node.id] = node

    def discard(self, node: TreeNode) -> None:
        self._nodes.pop(node.id, None)

    def first(self) -> TreeNode | None:
        nodes = list(self._nodes.values())
        if not nodes:
            return None
        return nodes[self._pick(nodes)] if len(nodes) > 1 else nodes[0]

    def pop_first(self) -> TreeNode | None:
        node = self.first()
        if node is not None:
            del self._nodes[node.id]
        return node

    def clear(self) -> None:
        self._nodes.clear()

    def check(self) -> None:
        """Nothing to keep in step: the order is recomputed at every pop."""


def utility(recency: Callable[[TreeNode], float], efficiency: Callable[[TreeNode], float],
            weight: Callable[[], float]) -> Score:
    """``minmax(recency) + weight() * minmax(efficiency)`` over the given nodes."""

    def score(nodes: Sequence[TreeNode]) -> np.ndarray:
        n = len(nodes)
        out = minmax(np.fromiter((recency(x) for x in nodes), np.float64, n))
        w = weight()
        if w:
            out = out + w * minmax(np.fromiter((efficiency(x) for x in nodes), np.float64, n))
        return out

    return score


def install_scan_kv(cache: Any, score: Score | None = None,
                    pick: Callable[[Sequence[TreeNode]], int] | None = None) -> ScanLeafSet:
    """Make an empty ``cache`` pop KV leaves by ``score`` or ``pick`` (:class:`ScanLeafSet`).

    Raises:
        ValueError: the cache already holds KV.
    """
    if cache.total_size():
        raise ValueError("install_scan_kv needs an empty cache")
    leaves = ScanLeafSet(score, pick)
    cache.kv.leaves = leaves
    return leaves


class SeglenStrategy(_LiveSet):
    """The ``seglen`` state walk (module docstring); ``weight`` = the efficiency weight."""

    def __init__(self, is_candidate: Callable[[TreeNode], bool],
                 weight: float = SEGLEN_WEIGHT) -> None:
        super().__init__(is_candidate)
        self.weight = float(weight)
        self._score = utility(lambda n: n.state_access_time, seglen, lambda: self.weight)

    def kv_score(self) -> Score:
        """The same score over KV leaves (recency = the node's last access)."""
        return utility(lambda n: n.last_access_time, seglen, lambda: self.weight)

    def pop_victim(self) -> TreeNode | None:
        ok = self._is_candidate
        cands = [n for n in self._live.values() if ok(n)]
        if not cands:
            return None
        victim = cands[int(np.argmin(self._score(cands)))] if len(cands) > 1 else cands[0]
        self._count_pop()
        return victim


def _marconi(ctx: BaselineContext) -> Callable[[Callable[[TreeNode], bool]], StateStrategy]:
    preset, alpha = get_preset(ctx.model), ctx.marconi_alpha or 0.0
    return lambda ok: MarconiStrategy(ok, preset, alpha, ctx.cost_d, ctx.cost_e)


def _marconi_kv(cache: Any, walk: Any) -> None:
    install_scan_kv(cache, utility(lambda n: n.last_access_time, walk.efficiency,
                                   lambda: walk.alpha))


def _seglen_kv(cache: Any, walk: Any) -> None:
    install_scan_kv(cache, walk.kv_score())


register(Baseline("marconi", _marconi, _marconi_kv))
register(Baseline("seglen", lambda ctx: SeglenStrategy, _seglen_kv))
