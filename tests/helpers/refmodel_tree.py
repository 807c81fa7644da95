"""The page trie both brute-force reference models stand on, sharing no code with the library.

One entry per cached page-aligned prefix ``(extra_key, tokens)``. Where the library would have
a node end (the end of an inserted key, a split point, a branch point, ...) the page is marked
``boundary``; a library node is the run of pages from just after the previous boundary down to
a boundary page. Every structural question (parent, children, the pages of a node, the path
from the root) is answered by scanning or slicing prefixes, never by keeping links.

``tests/helpers/refmodel.py`` (KV + recurrent state) and ``tests/helpers/refmodel_swa.py`` (KV + sliding
window + state) each subclass :class:`PageTrie` with their own page record and rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Prefix = tuple  # (extra_key, tuple of token ids)


@dataclass
class Page:
    """What both models keep per page; each model's record adds its own fields."""

    slots: list[int]
    t: int
    boundary: bool = False
    lock: int = 0
    state: int | None = None
    state_lock: int = 0
    state_t: int = 0


@dataclass
class MatchOut:
    prefix_len: int
    kv_hit_length: int
    device_indices: list[int]
    state_slot: int | None
    branching_seqlen: int | None
    node: Prefix | None  # boundary prefix at prefix_len, None for the root


@dataclass
class InsertOut:
    prefix_len: int
    inserted_len: int
    duplicate_indices: list[int]
    adopted_indices: list[int]
    remainder_indices: list[int]
    state_adopted: bool
    node: Prefix | None


@dataclass
class EvictOut:
    num_tokens: int = 0
    num_states: int = 0
    freed_slots: list[int] = field(default_factory=list)  # full side, in the order freed
    freed_states: list[int] = field(default_factory=list)


P = TypeVar("P", bound=Page)


def pick_tied(tied: list[Prefix], choose: Callable[..., Prefix] | None, what: str,
              *args: Any) -> Prefix:
    """The only victim in ``tied``, or ``choose(tied, *args)`` when several tie (the caller
    resolves a tie by what the library did); the pick must be one of ``tied``."""
    if len(tied) == 1:
        return tied[0]
    assert choose is not None, f"model: tied {what} victims {tied}"
    victim = choose(tied, *args)
    assert victim in tied, f"{victim} is not one of the minimal {what} victims {tied}"
    return victim


class PageTrie(Generic[P]):
    """The pages, the logical clock and the structural queries over them.

    Args:
        page_size: tokens per page.
        hybrid: whether nodes carry recurrent states.
    """

    def __init__(self, page_size: int, hybrid: bool) -> None:
        self.ps = page_size
        self.hybrid = hybrid
        self.pages: dict[Prefix, P] = {}
        self.clock = 0

    # ------------------------------------------------------------------ structure
    def parent(self, p: Prefix) -> Prefix | None:
        extra, toks = p
        return None if len(toks) == self.ps else (extra, toks[: -self.ps])

    def children(self, p: Prefix) -> list[Prefix]:
        extra, toks = p
        n = len(toks) + self.ps
        return [q for q in self.pages if q[0] == extra and len(q[1]) == n and q[1][: len(toks)] == toks]

    def has_children(self, p: Prefix) -> bool:
        extra, toks = p
        n = len(toks) + self.ps
        return any(q[0] == extra and len(q[1]) == n and q[1][: len(toks)] == toks for q in self.pages)

    def segment(self, end: Prefix) -> list[Prefix]:
        """Pages of the node ending at boundary ``end``, deepest first."""
        out = [end]
        p = self.parent(end)
        while p is not None and not self.pages[p].boundary:
            out.append(p)
            p = self.parent(p)
        return out

    def node_ends(self) -> list[Prefix]:
        return [p for p, pg in self.pages.items() if pg.boundary]

    def path(self, p: Prefix) -> list[Prefix]:
        """Pages from the first one down to ``p``."""
        out = []
        q: Prefix | None = p
        while q is not None:
            out.append(q)
            q = self.parent(q)
        return out[::-1]

    def node_slots(self, end: Prefix) -> list[int]:
        """The slots of the node ending at ``end``, in position order."""
        return [x for p in reversed(self.segment(end)) for x in self.pages[p].slots]

    def held_slots(self) -> list[int]:
        return [s for pg in self.pages.values() for s in pg.slots]

    def held_states(self) -> list[int]:
        return [pg.state for pg in self.pages.values() if pg.state is not None]

    def kv_leaves(self) -> list[Prefix]:
        """Node ends that are KV-unlocked and childless (the KV eviction candidates)."""
        return [p for p in self.node_ends() if self.pages[p].lock == 0 and not self.has_children(p)]

    def state_candidates(self) -> list[Prefix]:
        """Unlocked states whose node may lose it: internal, or a KV-unlocked leaf."""
        return [
            p
            for p in self.node_ends()
            if self.pages[p].state is not None
            and self.pages[p].state_lock == 0
            and (self.has_children(p) or self.pages[p].lock == 0)
        ]

    # ------------------------------------------------------------------ walks
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _walk(self, key: list[int], extra: object) -> tuple[int, int]:
        """(cached whole-page prefix length, key length cut to whole pages)."""
        end = len(key) - len(key) % self.ps
        k = 0
        while k < end and (extra, tuple(key[: k + self.ps])) in self.pages:
            k += self.ps
        return k, end

    def _split_at(self, p: Prefix, now: int | None) -> None:
        """Make ``p`` a node end. A walk that ends inside a node entered it, so when ``now`` is
        given both halves carry that stamp (SGLang stamps the node before splitting it)."""
        if self.pages[p].boundary:
            return
        end = p
        while not self.pages[end].boundary:
            (end,) = self.children(end)
        if now is not None:
            for q in self.segment(end):
                self.pages[q].t = now
        self.pages[p].boundary = True

    def _stamp_walk(self, key: list[int], extra: object, k: int, now: int) -> None:
        """Split where a walk of ``k`` tokens ends and stamp every page it passed ``now``."""
        if k:
            self._split_at((extra, tuple(key[:k])), now)
        for j in range(self.ps, k + 1, self.ps):
            self.pages[(extra, tuple(key[:j]))].t = now

    def _slots_to(self, key: list[int], extra: object, k: int) -> list[int]:
        """The slots the tree holds for ``key[:k]`` (``k`` cached, whole pages)."""
        return [s for j in range(self.ps, k + 1, self.ps) for s in self.pages[(extra, tuple(key[:j]))].slots]

    # ------------------------------------------------------------------ removal
    def _new_out(self) -> EvictOut:
        """An empty eviction record of the model's own kind."""
        return EvictOut()

    def _free_page(self, page: P, out: EvictOut) -> None:
        """Account for one page leaving the tree (a model adds its own sides)."""
        out.num_tokens += self.ps
        out.freed_slots.extend(page.slots)

    def _parent_goes(self, par: Prefix) -> bool:
        """Whether a parent left childless by a removal goes with it (the model's rule)."""
        raise NotImplementedError

    def _remove_leaf(self, end: Prefix, out: EvictOut) -> None:
        """Remove the leaf node ending at ``end`` (its state too), then every ancestor that
        ``_parent_goes`` says follows it."""
        while True:
            seg = self.segment(end)
            pg = self.pages[end]
            if pg.state is not None:
                out.num_states += 1
                out.freed_states.append(pg.state)
            for p in reversed(seg):  # the node's slots in position order
                self._free_page(self.pages.pop(p), out)
            par = self.parent(seg[-1])
            if par is None or not self._parent_goes(par):
                return
            end = par

    def evict(self, num_tokens: int, choose: Callable[..., Prefix] | None = None) -> EvictOut:
        """Evict KV leaves, least recent first; ``choose(tied, out_so_far)`` picks among leaves
        with the same stamp (one walk stamps both halves of a node it splits)."""
        out = self._new_out()
        while out.num_tokens < num_tokens:
            leaves = self.kv_leaves()
            if not leaves:
                break
            best = min(self.pages[p].t for p in leaves)
            tied = [p for p in leaves if self.pages[p].t == best]
            self._remove_leaf(pick_tied(tied, choose, "KV", out), out)
        return out

    def _drop_state(self, victim: Prefix, out: EvictOut) -> None:
        """An internal node gives up its state and keeps its KV."""
        pg = self.pages[victim]
        assert pg.state is not None
        out.num_states += 1
        out.freed_states.append(pg.state)
        pg.state = None
