"""The router's side of KV events in a replay: rebuild the cache's page set from its events
alone and compare it with the tree's (``python -m bench replay --kv-events check``).

A cache-aware router (SGLang's router, Dynamo, llm-d) keeps the pages each instance holds
from ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. :class:`EventConsumer` does the
same, strictly: a store of a page already held, a store whose parent is not held, or a
removal of a page not held is a disagreement. :func:`tree_pages` recomputes the page set
from the tree itself (every node's pages hashed from the root, device KV as ``GPU``, host
copies as ``CPU_PINNED``, in group 0; the last page of a node holding a recurrent state as
``GPU`` in group 1), independently of the recorder's incremental bookkeeping;
:func:`disagreements` counts the pages the two sets do not share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from components.events import (
    CPU,
    GPU,
    KV_GROUP,
    STATE_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hash,
    event_seed,
)
from hicache.storage.keys import page_hashes

if TYPE_CHECKING:
    from radix import RadixCache

#: ``(block hash, medium, group_idx)``.
Page = tuple[int, str, int]


@dataclass
class EventConsumer:
    """A router's page set for one cache, rebuilt from its events."""

    pages: set[Page] = field(default_factory=set)
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    events: int = 0
    redundant: int = 0

    def apply(self, events: list[Any]) -> None:
        for ev in events:
            self.events += 1
            if isinstance(ev, AllBlocksCleared):
                self.cleared += 1
                self.pages = set()
            elif isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                g = ev.group_idx
                for h in ev.block_hashes:
                    if g == KV_GROUP and parent is not None and (
                            parent, GPU, g) not in self.pages and (parent, CPU, g) not in self.pages:
                        self.redundant += 1  # an orphan page: its parent is not held
                    page = (h, str(ev.medium), g)
                    if page in self.pages:
                        self.redundant += 1
                    self.pages.add(page)
                    self.stored += 1
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    page = (h, str(ev.medium), ev.group_idx)
                    if page not in self.pages:
                        self.redundant += 1
                    self.pages.discard(page)
                    self.removed += 1

    def summary(self) -> dict[str, int]:
        return {"events": self.events, "pages_stored": self.stored,
                "pages_removed": self.removed, "all_cleared": self.cleared,
                "pages_held": len(self.pages), "redundant_events": self.redundant}

    def usable_prefix(self, hashes: list[int], hybrid: bool) -> tuple[int, int]:
        """What a router holding this page set predicts for a prompt whose page chain is
        ``hashes``: ``(held, usable)`` pages, ``held`` the device KV pages from the start,
        ``usable`` those up to the deepest page with a device state checkpoint (group 1)
        when ``hybrid``, else all of them."""
        pages = self.pages
        held = 0
        while held < len(hashes) and (hashes[held], GPU, KV_GROUP) in pages:
            held += 1
        usable = held
        if hybrid:
            while usable and (hashes[usable - 1], GPU, STATE_GROUP) not in pages:
                usable -= 1
        return held, usable


def prompt_hashes(tokens: Any, page_size: int, tag: str = "") -> list[int]:
    """The published hashes of the whole pages of ``tokens[:-1]`` (what the replay matches),
    default namespace."""
    n = (len(tokens) - 1) // page_size * page_size
    return [block_hash(d) for d in page_hashes(event_seed(tag, None), tokens[:n], page_size)]


@dataclass
class EventCounter:
    """Counts events and pages, as a publisher would see them (``--kv-events on``)."""

    events: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0

    def apply(self, events: list[Any]) -> None:
        self.events += len(events)
        for ev in events:
            if isinstance(ev, BlockStored):
                self.stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.removed += len(ev.block_hashes)
            else:
                self.cleared += 1

    def summary(self) -> dict[str, int]:
        return {"events": self.events, "pages_stored": self.stored,
                "pages_removed": self.removed, "all_cleared": self.cleared}


def tree_pages(cache: RadixCache, tag: str = "") -> set[Page]:
    """``(block hash, medium)`` of every page the tree holds, recomputed from the root."""
    ps = cache.page_size
    out: set[Page] = set()
    stack: list[tuple[Any, bytes]] = [(c, event_seed(tag, c.extra_key))
                                      for c in cache.root.children.values()]
    while stack:
        node, prev = stack.pop()
        digests = page_hashes(prev, node.key, ps)
        hashes = [block_hash(d) for d in digests]
        if node.kv_value is not None:
            out.update((h, GPU, KV_GROUP) for h in hashes)
        if node.host_value is not None:
            out.update((h, CPU, KV_GROUP) for h in hashes)
        if node.state_slot is not None and hashes:
            out.add((hashes[-1], GPU, STATE_GROUP))
        last = digests[-1] if digests else prev
        stack.extend((c, last) for c in node.children.values())
    return out


def disagreements(consumer: EventConsumer, cache: RadixCache) -> int:
    """Pages in exactly one of the rebuilt set and the tree's (redundant events are counted
    apart, in ``consumer.redundant``)."""
    return len(consumer.pages ^ tree_pages(cache))
