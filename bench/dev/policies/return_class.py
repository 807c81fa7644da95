"""Which stored states come back: ``python -m bench.dev.policies.return_class``.

Replays one simulator point with the policy's state walk wrapped by a recorder and sorts every
stored state by three classes the cache could see online when the state was stored, then
reports, per class, the share of states *resumed* (consumed by a later match at least once)
before they left the pool (or by the end of the run):

* ``store``: ``end`` (the state of a finished prompt, ``cache_finished_req``) or ``chunk``
  (a prefill checkpoint or branch point of a running request, ``cache_unfinished_req``);
* ``from``: what the storing request's match consumed: ``end`` (another request's prompt-end
  state: the request continued a whole earlier prompt, a conversation's next turn),
  ``chunk`` (a checkpoint: it resumed inside an earlier prompt) or ``fresh`` (no state);
* ``branched``: ``yes`` when a node on the state's path (the root excluded) had two or more
  children when it was stored (another request diverged from this prefix before);
* ``tree guess``: the return class a state walk can assign from its own events alone
  (:func:`return_class`: ``continued``, ``inner``, ``fresh``), an online stand-in for
  ``from`` (a ``gds_adaptive`` weight on it was measured and not kept:
  ``bench/results/2026-12-06-return-class.md``);
* ``bucket``: the seen-share bucket (:func:`components.eviction.adaptive.seen_bucket`).

Under the offline reference (``belady``) the resumed share is what a perfect keeper gets out
of each class; a class whose share differs much from the others is evidence an online walk
could weigh by (issue 39). Example::

    PYTHONPATH=. python -m bench.dev.policies.return_class --sources mooncake_b docqa \\
        --slots 64 256 --policies belady gds_adaptive
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.dev.policies.hit_breakdown import WalkWrapper, wrapped_walk_factory
from bench.dev.policies.ideas import live_states_below
from bench.engine.core import ReplayEngine
from bench.engine.simulator import SimConfig, Simulator
from bench.policies import baselines
from bench.policies.strategies import NextUseIndex, StateStrategy
from bench.runs.robustness import ALL_SOURCES
from components.eviction.adaptive import seen_bucket
from components.eviction.gds import GDS_WALKS
from radix.node import TreeNode

__all__ = ["CONTINUED", "FRESH", "INNER", "RETURN_NAMES", "Classes", "ReturnRecorder", "classify",
           "main", "return_class", "run_point"]

FRESH, CONTINUED, INNER = 0, 1, 2
RETURN_NAMES = ("fresh", "continued", "inner")
"""Return classes of a stored state (:func:`return_class`)."""


def return_class(above_class: int | None, above_consumed: bool, above_was_leaf: bool) -> int:
    """The return class of a state stored below the live state ``above`` (its nearest
    shallower one; ``above_class`` ``None``: there is none), from what a state walk sees:

    * no live state above: :data:`FRESH` (its request resumed from no state);
    * ``above`` consumed since it was stored (so the storing request resumed there):
      :data:`CONTINUED` when ``above`` had no live state below when consumed (the request
      continued another prompt's end), else :data:`INNER` (it resumed at a chunk checkpoint,
      a fork or a shared prefix);
    * ``above`` not consumed: the request that stored ``above`` went on (its next chunk
      checkpoint or its prompt's end): ``above``'s class."""
    if above_class is None:
        return FRESH
    if above_consumed:
        return CONTINUED if above_was_leaf else INNER
    return above_class

Classes = tuple[str, str, str, str, str]
"""(store, from, branched, proxy, bucket): see the module docstring."""


class _Context:
    """What the engine is doing now: the request being admitted and the kind of insert."""

    def __init__(self) -> None:
        self.rid: object = None
        self.store = "chunk"
        self.consumed_from: dict[object, str] = {}


def branched(node: TreeNode) -> bool:
    """Whether a node on ``node``'s path (itself included, the root excluded) has two or
    more children."""
    n: TreeNode | None = node
    while n is not None and n.parent is not None:
        if len(n.children) >= 2:
            return True
        n = n.parent
    return False


class ReturnRecorder(WalkWrapper):
    """Wraps a state walk; per stored state its classes and whether a match consumed it
    before it left. ``ctx``: the engine context the patched engine keeps."""

    def __init__(self, inner: Any, ctx: _Context) -> None:
        super().__init__(inner)
        self.ctx = ctx
        self.open: dict[int, tuple[Classes, int]] = {}  # node id -> (classes, hits)
        self.store_of: dict[int, str] = {}
        self.live: dict[int, TreeNode] = {}
        self.consumed: dict[int, str] = {}  # node id -> "leaf" / "inner" at its last hit
        self.proxy: dict[int, str] = {}
        self.stored: Counter[Classes] = Counter()
        self.resumed: Counter[Classes] = Counter()

    def _close(self, nid: int) -> None:
        rec = self.open.pop(nid, None)
        if rec is None:
            return
        cls, hits = rec
        self.stored[cls] += 1
        if hits:
            self.resumed[cls] += 1

    def _above(self, node: TreeNode) -> TreeNode | None:
        n = node.parent
        while n is not None and n.parent is not None:
            if n.id in self.live:
                return n
            n = n.parent
        return None

    def _proxy(self, node: TreeNode) -> str:
        """The return class (:func:`return_class`), the tree's guess of ``from``, from the
        same events a walk sees."""
        above = self._above(node)
        if above is None:
            return RETURN_NAMES[FRESH]
        how = self.consumed.pop(above.id, None)
        c = return_class(RETURN_NAMES.index(self.proxy[above.id]), how is not None,
                         how == "leaf")
        return RETURN_NAMES[c]

    def on_set(self, node: TreeNode) -> None:
        ctx = self.ctx
        cls = (ctx.store, ctx.consumed_from.get(ctx.rid, "fresh"),
               "yes" if branched(node) else "no", self._proxy(node), str(seen_bucket(node)))
        self.live[node.id] = node
        self.proxy[node.id] = cls[3]
        self._close(node.id)
        self.open[node.id] = (cls, 0)
        self.store_of[node.id] = ctx.store
        self.inner.on_set(node)

    def on_match(self, kv_end: TreeNode | None, consumed: TreeNode | None,
                 key: Sequence[int], end: int) -> None:
        ctx = self.ctx
        ctx.consumed_from[ctx.rid] = "fresh" if consumed is None else \
            self.store_of.get(consumed.id, "fresh")
        hook = getattr(self.inner, "on_match", None)
        if hook is not None:
            hook(kv_end, consumed, key, end)

    def on_hit(self, node: TreeNode) -> None:
        below = next(live_states_below(node, self.live), None)
        self.consumed[node.id] = "leaf" if below is None else "inner"
        rec = self.open.get(node.id)
        if rec is not None:
            self.open[node.id] = (rec[0], rec[1] + 1)
        self.inner.on_hit(node)

    def on_remove(self, node: TreeNode) -> None:
        self._close(node.id)
        self.live.pop(node.id, None)
        self.consumed.pop(node.id, None)
        self.proxy.pop(node.id, None)
        self.store_of.pop(node.id, None)
        self.inner.on_remove(node)

    def finish(self) -> None:
        """Close the states still live at the end of the run."""
        for nid in list(self.open):
            self._close(nid)


def _patch_engine(engine: ReplayEngine, ctx: _Context) -> None:
    """Make ``engine`` tell ``ctx`` which request it serves and how it inserts: its
    ``admit`` and its cache's ``cache_unfinished_req`` (checkpoints) and
    ``cache_finished_req`` (prompt ends) wrapped on the instances."""
    admit = engine.admit
    cache = engine.cache
    unfinished, finished = cache.cache_unfinished_req, cache.cache_finished_req

    def patched_admit(tr: Any, rid: object = None, extra_key: Any = None) -> bool:
        old = ctx.rid
        ctx.rid = rid
        try:
            return admit(tr, rid=rid, extra_key=extra_key)
        finally:
            ctx.rid = old

    def insert_as(store: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def patched(req: Any, *args: Any, **kwargs: Any) -> Any:
            old = ctx.rid, ctx.store
            ctx.rid, ctx.store = req.rid, store
            try:
                return call(req, *args, **kwargs)
            finally:
                ctx.rid, ctx.store = old
        return patched

    vars(engine).update(admit=patched_admit)
    vars(cache).update(cache_unfinished_req=insert_as("chunk", unfinished),
                       cache_finished_req=insert_as("end", finished))


class _Sim(Simulator):
    ctx: _Context

    def _state_walk(self, next_use: NextUseIndex | None
                    ) -> Callable[[Callable[[Any], bool]], StateStrategy] | None:
        return wrapped_walk_factory(self.cfg.policy, super()._state_walk(next_use), self._walks,
                                    lambda inner: ReturnRecorder(inner, self.ctx), "return_class")


def run_point(trace: Sequence[Any], config: SimConfig) -> tuple[float, ReturnRecorder]:
    """Token hit rate of one run and its recorder (every state closed)."""
    ctx = _Context()
    _Sim.ctx = ctx
    sim = _Sim(trace, config)
    _patch_engine(sim.engine, ctx)
    sim.run()
    rec = sim.strategy
    assert isinstance(rec, ReturnRecorder)
    rec.finish()
    return sim.result(0.0).metrics.token_hit_rate, rec


def classify(rec: ReturnRecorder, axes: Sequence[int]
             ) -> Iterator[tuple[tuple[str, ...], int, int]]:
    """(class restricted to ``axes``, the others ``*``; stored, resumed), most stored first."""
    stored: Counter[tuple[str, ...]] = Counter()
    resumed: Counter[tuple[str, ...]] = Counter()
    for cls, n in rec.stored.items():
        key = tuple(cls[a] if a in axes else "*" for a in range(5))
        stored[key] += n
        resumed[key] += rec.resumed[cls]
    for key, n in sorted(stored.items(), key=lambda kv: -kv[1]):
        yield key, n, resumed[key]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="return_class", description=__doc__.split("\n")[0])
    p.add_argument("--sources", nargs="+", default=["mooncake_b", "docqa", "multiturn", "sysprompt"],
                   choices=list(ALL_SOURCES))
    p.add_argument("--slots", nargs="+", type=int, default=[64, 256])
    p.add_argument("--policies", nargs="+", default=["belady", "gds_adaptive"])
    p.add_argument("--kv-tokens", type=int, default=16_000_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--traces-dir", default="../shared/traces")
    p.add_argument("--axes", nargs="+", default=["0", "1", "2", "3", "0,1", "3,4"],
                   help="class axes per table (default: each alone, store x from, tree "
                        "guess x bucket), comma-separated indices of "
                        "(store, from, branched, tree guess, bucket)")
    args = p.parse_args(argv)
    try:
        args.axes = [tuple(int(a) for a in spec.split(",")) for spec in args.axes]
    except ValueError:
        p.error("--axes: comma-separated integers 0-4")
    if any(a not in range(5) for spec in args.axes for a in spec):
        p.error("--axes: indices 0-4")
    for pol in args.policies:
        if baselines.get(pol) is None and pol not in GDS_WALKS:
            p.error(f"--policies {pol!r}: a GDS-family policy or a replay baseline")
    print("| source | slots | policy | hit | store | from | branched | tree guess | bucket | stored | resumed | P(resumed) |")
    print("|---|---:|---|---:|---|---|---|---|---|---:|---:|---:|")
    for name in args.sources:
        src = ALL_SOURCES[name]
        trace = src.load(Path(args.traces_dir))
        if trace is None:
            print(f"{name}: trace missing", file=sys.stderr)
            continue
        for slots in args.slots:
            for pol in args.policies:
                cfg = SimConfig.of(pol, state_slots=slots, kv_tokens=args.kv_tokens,
                                   concurrency=args.concurrency, time_scale=src.time_scale)
                hit, rec = run_point(trace, cfg)
                for axes in args.axes:
                    for key, n, r in classify(rec, axes):
                        print(f"| {name} | {slots} | {pol} | {hit:.4f} | " + " | ".join(key)
                              + f" | {n:,} | {r:,} | {r / n:.3f} |")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
