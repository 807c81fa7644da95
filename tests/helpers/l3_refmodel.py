"""Reference model for the L3 property test: which pages each engine may serve, and what they
must hold. Shares no code with the library.

A page is ``(namespace, tokens of the whole prefix up to the page's end)``. Every KV slot an
engine fills holds a label computed from its token's whole prefix and namespace, so a page's
bytes are known without asking the cache. The model records every page some engine computed
itself (a page reaches L3, another engine's host pool and device pool only from there). It
answers, for a match: every page the engine serves (device or host) must be one that some
engine of the deployment computed, in the same namespace, with the same whole prefix; and
every slot it hands out holds exactly that page's labels.
"""

from __future__ import annotations

from typing import Any


def label(ns: Any, prefix: tuple[int, ...]) -> float:
    """The K value of the last token of ``prefix`` (exact in float32); V holds its negation."""
    return float(hash(("l3-model", ns, prefix)) % (1 << 20))


class L3Model:
    """Pages computed by the engines of one deployment (one shared store)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.computed: set[tuple[Any, tuple[int, ...]]] = set()
        self.by_engine: dict[int, set[tuple[Any, tuple[int, ...]]]] = {}

    def pages(self, ns: Any, key: list[int], upto: int) -> list[tuple[Any, tuple[int, ...]]]:
        """The whole pages of ``key[:upto]``, each named by its whole prefix."""
        ps = self.page_size
        return [(ns, tuple(key[:end])) for end in range(ps, upto - upto % ps + 1, ps)]

    def compute(self, engine: int, ns: Any, key: list[int], upto: int) -> None:
        """``engine`` computed (and inserted) ``key[:upto]`` itself."""
        got = self.pages(ns, key, upto)
        self.computed.update(got)
        self.by_engine.setdefault(engine, set()).update(got)

    def may_serve(self, ns: Any, key: list[int], upto: int) -> bool:
        """Whether every page of ``key[:upto]`` is one some engine computed."""
        return all(p in self.computed for p in self.pages(ns, key, upto))

    def labels(self, ns: Any, key: list[int], lo: int, hi: int) -> list[float]:
        """What the slots of ``key[lo:hi]`` must hold."""
        return [label(ns, tuple(key[: i + 1])) for i in range(lo, hi)]
