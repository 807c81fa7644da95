"""Where a state walk's hits come from: ``python -m bench hit-breakdown``.

Runs one simulator configuration with the policy's state walk wrapped by a recorder, and
sorts the prefill tokens the consumed states saved (their depth) by what an online walk could
have known about each state when it was consumed:

* ``first`` / ``again``: the state's first hit since it was cached, or a later one;
* ``leaf`` / ``below``: whether live states sat below it (a shared or continued prefix);
* the seen-share bucket at its store (``components.eviction.adaptive.seen_bucket``: 0 = under
  30 % of its prefix inserted by another request before, 1 = 30-90 %, 2 = at least 90 %).

A ``first`` hit on a ``leaf`` in bucket 0 is a first reuse with no signal but the bucket's
base rate: a new conversation's first end state that came back. Example::

    python -m bench hit-breakdown --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --policy belady gds_adaptive --state-slots 256 --time-scale 2
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from bench.dev.policies.ideas import live_states_below
from bench.dev.policies.options import hit_breakdown_parser
from bench.engine.simulator import SimConfig, Simulator
from bench.policies import baselines
from bench.policies.strategies import NextUseIndex, StateStrategy
from bench.traces.loader import load_trace, resolve_trace_path
from components.eviction.adaptive import seen_bucket
from components.eviction.gds import GDS_WALKS
from components.eviction.registry import GDS_DEFAULT_D, GDS_DEFAULT_E
from components.state import make_gds_walk
from radix.node import TreeNode

__all__ = ["Recorder", "breakdown", "main"]


class WalkWrapper:
    """A state walk that forwards to ``inner`` what a recording walk does not watch:
    ``on_use``, ``requeue``, ``pop_victim``, ``check``, ``before_admit`` (when ``inner``
    has it), the ``watermark`` (read and set) and any other attribute (a baseline's KV
    order, Marconi's alpha)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def watermark(self) -> float:
        return float(self.inner.watermark)

    @watermark.setter
    def watermark(self, value: float) -> None:
        self.inner.watermark = value

    def on_use(self, node: TreeNode) -> None:
        self.inner.on_use(node)

    def requeue(self, node: TreeNode) -> None:
        self.inner.requeue(node)

    def pop_victim(self) -> TreeNode | None:
        return self.inner.pop_victim()

    def check(self, state_nodes: list[TreeNode]) -> None:
        self.inner.check(state_nodes)

    def before_admit(self, index: int) -> None:
        hook = getattr(self.inner, "before_admit", None)
        if hook is not None:
            hook(index)

    def __getattr__(self, name: str) -> Any:
        """Anything else (a baseline's KV order, Marconi's alpha) is the inner walk's."""
        return getattr(self.inner, name)


class Recorder(WalkWrapper):
    """Wraps a state walk; counts consumed-state tokens by (first/again, leaf/below, bucket)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.live: set[int] = set()
        self.hits: dict[int, int] = {}
        self.bucket: dict[int, int] = {}
        self.tokens: Counter[tuple[str, str, int]] = Counter()
        self.count: Counter[tuple[str, str, int]] = Counter()

    def on_set(self, node: TreeNode) -> None:
        self.live.add(node.id)
        self.hits[node.id] = 0
        self.bucket[node.id] = seen_bucket(node)
        self.inner.on_set(node)

    def _below(self, node: TreeNode) -> bool:
        return next(live_states_below(node, self.live), None) is not None

    def on_hit(self, node: TreeNode) -> None:
        nid = node.id
        key = ("first" if self.hits[nid] == 0 else "again",
               "below" if self._below(node) else "leaf", self.bucket[nid])
        self.tokens[key] += node.depth
        self.count[key] += 1
        self.hits[nid] += 1
        self.inner.on_hit(node)

    def on_remove(self, node: TreeNode) -> None:
        self.live.discard(node.id)
        self.inner.on_remove(node)



def wrapped_walk_factory(policy: str, baseline: Callable[[Callable[[Any], bool]], Any] | None,
                         walks: list[StateStrategy], wrap: Callable[[Any], StateStrategy],
                         tool: str) -> Callable[[Callable[[TreeNode], bool]], StateStrategy]:
    """A simulator's state-walk factory whose walk is ``wrap(inner)``: ``inner`` is the run's
    ``baseline`` walk (``Simulator._state_walk``'s factory) or, when ``None``, ``policy``'s
    GDS-family walk; each wrapped walk is appended to ``walks`` (the simulator's list).

    Raises:
        ValueError: a policy that is neither a baseline nor a GDS-family walk (naming ``tool``).
    """
    if baseline is None and policy not in GDS_WALKS:
        raise ValueError(f"{tool} needs a GDS-family or baseline walk, got {policy!r}")

    def factory(ok: Callable[[TreeNode], bool]) -> StateStrategy:
        inner = baseline(ok) if baseline is not None else \
            make_gds_walk(policy, GDS_DEFAULT_D, GDS_DEFAULT_E, ok)
        rec = wrap(inner)
        walks.append(rec)
        return rec

    return factory


class _RecordingSimulator(Simulator):
    def _state_walk(self, next_use: NextUseIndex | None
                    ) -> Callable[[Callable[[Any], bool]], StateStrategy] | None:
        return wrapped_walk_factory(self.cfg.policy, super()._state_walk(next_use), self._walks,
                                    Recorder, "hit_breakdown")


def breakdown(trace: Sequence[Any], config: SimConfig) -> tuple[float, Recorder]:
    """Token hit rate of the run and its recorder."""
    sim = _RecordingSimulator(trace, config)
    sim.run()
    rec = sim.strategy
    assert isinstance(rec, Recorder)
    return sim.result(0.0).metrics.token_hit_rate, rec


def main(argv: Sequence[str] | None = None) -> int:
    p = hit_breakdown_parser()
    args = p.parse_args(argv)
    configs = []
    for policy in args.policy:
        if baselines.get(policy) is None and policy not in GDS_WALKS:
            p.error(f"--policy {policy!r}: a GDS-family policy or a replay baseline")
    try:  # every run's pools and the trace, before the first run
        configs = [SimConfig.of(policy, kv_tokens=args.kv_tokens, state_slots=args.state_slots,
                                concurrency=args.concurrency, time_scale=args.time_scale)
                   for policy in args.policy]
        trace = load_trace(resolve_trace_path(args.trace), max_requests=args.max_requests)
    except (FileNotFoundError, ValueError) as exc:  # TraceFormatError is a ValueError
        p.error(str(exc))
    for policy, cfg in zip(args.policy, configs, strict=True):
        hit, rec = breakdown(trace, cfg)
        total = sum(rec.tokens.values()) or 1
        print(f"{policy}: token hit rate {hit:.4f}, tokens saved by consumed states {total:,}")
        print("  hit    where  bucket     hits      tokens   share")
        for (first, where, b), tok in sorted(rec.tokens.items(), key=lambda kv: -kv[1]):
            print(f"  {first:6s} {where:5s} {b:6d} {rec.count[first, where, b]:8,} {tok:11,} "
                  f"{tok / total:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
