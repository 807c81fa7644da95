"""HiCache L3 inside the one tree: page backups after host backups, prefetch on a miss.

::

    device ──write──> host ──(copy landed)──> L3 pages      backup: per write policy, pages
                        ^                        |          already in L3 are not sent again
                        └──── prefetch ──────────┘          match: key continues past the tree

The tier names no component: the host tier's primary component (KV) stores its host copy a
record per page, every other component with host copies its sections in one record at a
node's end (the state valid there, a plug-in's value); each packs and unpacks its own bytes
(``components.base``: ``l3_layout``, ``l3_sections``, ``pack_pages`` / ``unpack_pages``,
``pack_end`` / ``unpack_end``), and the layout tag joins their ``l3_layout`` parts. An end
component may cover the last ``l3_span()`` tokens before the end (the SWA component: the SWA
KV of its window, whole pages): a chain read back is attached as two host-only nodes, the
part above the span without that component's value (SWA tombstones), the span with it.

* Backup (:meth:`StorageTier.backup`): when a node's host copy has landed (and when another
  component's copy joins a backed-up node), the node's pages (and, once every end component
  has a host copy there, the record at its end) are packed from the host pools and queued for
  the writer thread; the writer stores only missing records. An end record is packed only
  when no device -> host copy is in flight (an end section may read a copy issued after the
  node's own: another component's, an ancestor's SWA KV within the span); else it waits for
  the next landing, match or flush.
* Prefetch (:meth:`StorageTier.before_match`, at the start of ``match_prefix``): the key's
  whole pages past the tree's match are hashed and looked up in L3; the leading run found
  (with end components: up to the deepest page whose end record is stored) is read, verified,
  copied into fresh host slots and attached as one host-only node below the match (two when
  an end component's span cuts it), so the match reports it as a host hit
  (``last_host_node``) and ``load_back`` brings it to device.
  The lookup runs on the prefetch thread. ``best_effort``: its pages join at a later
  ``match_prefix`` / :meth:`StorageTier.poll`; ``wait_complete``: the match waits for it,
  ``hicache_storage_timeout_s`` at most in all; ``timeout``: ``hicache_prefetch_timeout_s`` at
  most, or SGLang's ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024``
  when the extra config sets them. One deadline per prefetch, set when it starts: the store's retries and later matches
  of the same key (which find the same prefetch running) wait only for what is left of it;
  past it the prefetch goes on as best_effort (``l3_prefetch_timeouts``).
* Faults never reach the engine: every L3 step is guarded; a fault is logged, counted
  (``stats()["l3_faults"]``, backend ``l3_backend_errors`` / ``_timeouts`` / ``_corrupt``)
  and is a miss. Only verified pages are attached, and the tree is changed on the engine
  thread only.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from components.base import l3_components
from hicache.storage import (
    PrefetchJob,
    StorageController,
    end_key,
    layout_tag_of,
    make_backend,
    page_hashes,
    page_key,
)

if TYPE_CHECKING:
    from hicache.storage import Page
    from radix.core import CacheCore
    from radix.node import TreeNode
    from radix.tiers.host import HostTier
    from radix.tree import Walk

log = logging.getLogger("hicache.storage")

#: Prefetch jobs in flight at once (a new miss beyond this is not looked up).
MAX_JOBS = 64
#: Nodes whose end record waits for host copies in flight (beyond this: not written).
MAX_DEFERRED = 4096


class StorageTier:
    """The L3 tier of one cache, below its host tier (``hicache_storage_backend``).

    Args:
        core: the cache's tree and components.
        host: the host tier whose pools the pages are packed from and unpacked into.

    Attributes:
        controller: the ``hicache.storage.StorageController`` (backend, writer thread,
            counters).
    """

    def __init__(self, core: CacheCore, host: HostTier) -> None:
        self.core = core
        self.host = host
        self._hashes: weakref.WeakKeyDictionary[TreeNode, list[bytes]] = (
            weakref.WeakKeyDictionary()
        )
        self._jobs: dict[str, PrefetchJob] = {}
        #: Nodes whose end record waits until no host copy is in flight (see
        #: :meth:`_backup_node`), oldest first.
        self._deferred: weakref.WeakKeyDictionary[TreeNode, None] = weakref.WeakKeyDictionary()
        hc = host.controller
        cfg = hc.config
        self.page_size = core.page_size
        #: The primary component (its host copy: a record per page) and the components with
        #: sections in the record at a node's end, in order (``components.base``: raises
        #: ``ValueError`` naming a component whose host copies L3 cannot carry).
        self.primary, self.ends = l3_components(host.parts)
        #: How many end sections each end component has (its share of an end record).
        self._end_counts = tuple(len(c.l3_sections()) for c in self.ends)
        parts = [c.l3_layout() for c in (self.primary, *self.ends)]
        tag = layout_tag_of(cfg.hicache_storage_model, self.page_size,
                            [p for p in parts if p is not None])
        backend = make_backend(cfg, tag)
        assert backend is not None
        #: Each end component's span (``Component.l3_span``: tokens before a record's end
        #: its sections cover; 0: the value at the end).
        self._spans = tuple(c.l3_span() for c in self.ends)
        for c, span in zip(self.ends, self._spans, strict=True):
            if span < 0 or span % self.page_size:
                raise ValueError(f"component {c.name!r}: l3_span() must be a multiple of "
                                 f"page_size={self.page_size} >= 0, got {span}")
        page = tuple(self.primary.l3_sections())
        if len(page) != 2:
            raise ValueError(f"component {self.primary.name!r}: l3_sections() of the primary "
                             f"must be two page sections, got {page}")
        ends = tuple(n for c in self.ends for n in c.l3_sections())
        self.controller = StorageController(backend, self.page_size, tag, (page[0], page[1]),
                                            ends, cfg.hicache_storage_prefetch_policy,
                                            cfg.hicache_prefetch_timeout_s)
        #: How long a match waits for its prefetch in all, retries and re-matches included
        #: [s], by the prefetch's tokens (``HiCacheConfig.prefetch_wait_s``; ``None``: not at
        #: all).
        self._wait_s = cfg.prefetch_wait_s

    def reset(self) -> None:
        """The tree was emptied: forget the memoised hashes and the prefetches (their pages
        would attach to a tree that no longer holds their prefix)."""
        self._hashes = weakref.WeakKeyDictionary()
        self._jobs = {}
        self._deferred = weakref.WeakKeyDictionary()

    def _fault(self, op: str, exc: BaseException) -> None:
        self.controller.count("faults")
        log.warning("L3 %s failed (%s: %s); treated as a miss", op, type(exc).__name__,
                    self.controller.backend.redact(str(exc)))

    # ---------------------------------------------------------------- hashes
    def _node_hashes(self, node: TreeNode) -> list[bytes] | None:
        """Chain hashes of ``node``'s pages (memoised per node; a split node keeps the suffix
        of its list). ``None`` when the namespace cannot be stored."""
        assert self.controller is not None
        memo, ps = self._hashes, self.page_size
        chain: list[TreeNode] = []
        n = node
        prev: bytes | None = None
        while n.parent is not None:
            cached = memo.get(n)
            if cached is not None:
                npages = len(n.key) // ps
                if len(cached) != npages:  # split: this node kept the lower pages
                    cached = memo[n] = cached[-npages:]
                prev = cached[-1]
                break
            chain.append(n)
            n = n.parent
        if prev is None:
            prev = self.controller.seed(node.extra_key)
            if prev is None:
                return None
        for m in reversed(chain):
            hs = page_hashes(prev, m.key, ps)
            memo[m] = hs
            prev = hs[-1]
        return memo[node]

    def _hash_at(self, walk: Walk, extra_key: Any) -> bytes | None:
        """The chain hash at the end of ``walk``'s match (the seed at 0)."""
        assert self.controller is not None
        if walk.partial is not None:
            hs = self._node_hashes(walk.partial)
            return None if hs is None else hs[walk.partial_len // self.page_size - 1]
        if walk.path:
            hs = self._node_hashes(walk.path[-1])
            return None if hs is None else hs[-1]
        return self.controller.seed(extra_key)

    # ---------------------------------------------------------------- backup
    def backup(self, node: TreeNode) -> None:
        """Hook: ``node``'s host copy (the primary's, or another component's that joined it)
        is complete; its pages (and the record at its end) go to L3. Never raises."""
        try:
            self._backup_node(node)
            self._retry_deferred()
        except Exception as exc:
            self._fault("backup", exc)

    def _retry_deferred(self) -> None:
        """Pack the deferred end records once no host copy is in flight."""
        if not self._deferred or self.host.controller.writes_landing():
            return
        nodes = list(self._deferred.keys())
        self._deferred = weakref.WeakKeyDictionary()
        for n in nodes:
            self._backup_node(n)

    def _backup_node(self, node: TreeNode) -> None:
        st = self.controller
        hv = self.primary.host_copy(node)
        if node.parent is None or hv is None:
            return
        hashes = self._node_hashes(node)
        if hashes is None:
            return
        ps = self.page_size
        keys = [page_key(h) for h in hashes]
        todo = [i for i, k in enumerate(keys) if not st.is_known(k)]
        st.count("backup_known_skipped", len(keys) - len(todo))
        items = []
        if todo:
            slots = hv if len(todo) == len(keys) else torch.cat([hv[i * ps:(i + 1) * ps] for i in todo])
            for i, (a, b) in zip(todo, self.primary.pack_pages(slots), strict=True):
                items.append((keys[i], a, b))
        ends = self.ends
        if ends and all(c.host_copy(node) is not None for c in ends):
            ek = end_key(hashes[-1])
            if st.is_known(ek):
                st.count("backup_known_skipped")
            elif self.host.controller.writes_landing():
                # an end section may read host copies still in flight (another component's
                # copy issued after this node's, an ancestor's SWA KV within the span): packed
                # at a later landing, match or flush, once every copy has landed
                if len(self._deferred) < MAX_DEFERRED:
                    self._deferred[node] = None
                else:
                    st.count("backup_dropped")
            else:
                packed = [c.pack_end(node) for c in ends]
                if all(p is not None for p in packed):
                    items.append((ek, *st.end_record([s for p in packed if p for s in p])))
        st.submit_writes(items)

    # -------------------------------------------------------------- prefetch
    def before_match(self, key: Any, extra_key: Any) -> None:
        """Hook at the start of ``match_prefix``: attach finished prefetches, then look the
        key's continuation past the tree up in L3 (per the prefetch policy). Never raises."""
        try:
            self._retry_deferred()
            self._harvest()
            self._prefetch(key, extra_key)
        except Exception as exc:
            self._fault("prefetch", exc)

    def _prefetch(self, key: Any, extra_key: Any) -> None:
        st = self.controller
        ps = self.page_size
        end = len(key) - len(key) % ps
        walk = self.core.tree.walk(key, end, extra_key)
        m = walk.matched_len
        npages = min(end - m, self.primary.host_allocator.size) // ps
        if npages <= 0:
            return
        prev = self._hash_at(walk, extra_key)
        if prev is None:
            return
        upto = m + npages * ps
        hashes = page_hashes(prev, key[m:upto], ps)
        jk = page_key(hashes[0])
        job = self._jobs.get(jk)
        if job is None:
            if len(self._jobs) >= MAX_JOBS:
                st.count("prefetch_in_flight_skipped")
                return
            job = PrefetchJob(key[:upto], extra_key, m, hashes, bool(self.ends))
            wait = self._wait_s(npages * ps)
            if wait is not None:
                job.deadline = time.monotonic() + wait
            self._jobs[jk] = job
            st.start(job)
        if job.deadline is not None and not job.done.is_set():
            left = job.deadline - time.monotonic()
            if left <= 0 or not job.done.wait(left):
                if not job.timed_out:  # counted once; later matches do not wait again
                    job.timed_out = True
                    st.count("prefetch_timeouts")
                job.deadline = None
        self._harvest()

    def _harvest(self) -> int:
        """Attach the pages prefetch jobs have brought so far; return the tokens attached."""
        got = 0
        for jk, job in list(self._jobs.items()):
            pages, end, finished = job.snapshot()
            if finished:
                del self._jobs[jk]
            if pages and (finished or not job.want_end):
                got += self._attach(job, pages, end)
        return got

    def _attach(self, job: PrefetchJob, pages: list[Page], end: Page | None) -> int:
        """Attach ``pages`` (from ``job.start``) as a chain of host-only nodes below what the
        tree already holds of ``job.tokens`` (one node, cut where an end component's span
        begins); returns the tokens attached (0: dropped)."""
        st = self.controller
        if not pages or (job.want_end and end is None):
            return 0
        ps = self.page_size
        upto = job.start + len(pages) * ps
        walk = self.core.tree.walk(job.tokens, upto, job.extra_key)
        m = walk.matched_len
        if m >= upto:
            return 0  # the engine computed (or another job brought) these pages meanwhile
        if m < job.start:
            st.count("prefetch_dropped", len(pages))  # the prefix left the tree meanwhile
            return 0
        first = (m - job.start) // ps
        now = self.core.tick()
        if walk.partial is not None:
            anchor = self.core.split_touched(walk.partial, walk.partial_len, now)
        else:
            anchor = walk.path[-1] if walk.path else self.core.root
        primary = self.primary
        if anchor is not self.core.root and primary.host_copy(anchor) is None and (
                not self.host.backup_chain(anchor)):
            st.count("prefetch_dropped", len(pages) - first)  # backed-up nodes form a prefix
            return 0
        tokens = upto - m
        ends, spans = (self.ends, self._spans) if end is not None else ((), ())
        asks = [(primary.host_allocator, tokens),
                *((c.host_allocator, min(s, tokens) if s else 1)
                  for c, s in zip(ends, spans, strict=True))]
        got = self._alloc_host(anchor, tokens, asks)
        if got is None:
            st.count("prefetch_dropped", len(pages) - first)
            return 0
        host_slots = got[0]
        try:  # the pages land before the tree changes
            primary.unpack_pages(host_slots, pages[first:])
            sections = st.end_parts(end) if end is not None else []
        except BaseException:  # nothing attached: give the host units back
            for (alloc, _), idx in zip(asks, got, strict=True):
                alloc.free(idx)
            raise
        # the chain [m, upto), cut where a span before its end begins (SWA: the window)
        bounds = sorted({m, upto, *(upto - s for s in spans if 0 < s < tokens)})
        tree, nodes = self.core.tree, []
        parent = anchor
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            parent = tree.add_leaf(parent, job.tokens[lo:hi], job.extra_key, now)
            primary.adopt_host(parent, host_slots[lo - m:hi - m])
            nodes.append(parent)
        done = 0
        try:
            o = 0
            for c, k, host in zip(ends, self._end_counts, got[1:], strict=True):
                c.unpack_end(nodes, host, sections[o:o + k])
                o += k
                done += 1
        except BaseException:  # an end component failed: the chain leaves, units given back
            for n in nodes:
                for c in (primary, *ends[:done]):
                    c.drop_host(n)
            for (alloc, _), idx in zip(asks[1 + done:], got[1 + done:], strict=True):
                alloc.free(idx)
            for n in reversed(nodes):
                tree.remove_leaf(n)
                self.core.detached(n)
            if anchor is not self.core.root:
                self.core.refresh(anchor)
            raise
        self.host.host_tokens += tokens
        hashes = job.hashes[first:len(pages)]
        for n in nodes:
            lo = (n.depth - len(n.key) - m) // ps
            self._hashes[n] = hashes[lo:lo + len(n.key) // ps]
        st.mark_known([page_key(h) for h in hashes] + ([end_key(hashes[-1])] if end else []))
        for n in nodes:
            self.core.refresh(n)
        if anchor is not self.core.root:
            self.core.refresh(anchor)
        st.count_prefetched(len(pages) - first, tokens, end is not None)
        return tokens

    def _alloc_host(self, anchor: TreeNode, tokens: int, asks: list[tuple[Any, int]]
                    ) -> list[torch.Tensor] | None:
        """Host units for a prefetched chain (``asks``: the primary component's ``tokens``,
        one per end component with an end record), all or nothing, evicting host-only leaves
        (never ``anchor``)."""
        hc = self.host.controller
        got = hc.alloc_parts(asks)
        if got is not None:
            return got
        if anchor is self.core.root:
            self.host.evict_host(tokens)
        else:  # the leaf goes below anchor: making room must leave it in the tree
            with self.host.pinned(anchor):
                self.host.evict_host(tokens)
        return hc.alloc_parts(asks)

    # ---------------------------------------------------------------- public
    def poll(self) -> int:
        """Attach the pages finished prefetches brought (host-only nodes); return the tokens
        attached. Never raises (a fault is counted and is a miss)."""
        try:
            self._retry_deferred()
            return self._harvest()
        except Exception as exc:
            self._fault("prefetch", exc)
            return 0

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued L3 writes and running prefetches (at most ``timeout_s``), then
        attach what the prefetches brought. Returns whether everything finished."""
        self.host.poll()
        try:
            self._retry_deferred()
        except Exception as exc:
            self._fault("backup", exc)
        done = self.controller.flush(timeout_s)
        self.poll()
        return done

    def close(self) -> None:
        """Finish queued writes and close the backend."""
        self.controller.close()

    def stats(self) -> dict[str, Any]:
        st = self.controller
        out = {f"l3_{k}": v for k, v in st.counters_now().items()}
        out.update({f"l3_backend_{k}": v for k, v in st.backend.stats.items()})
        return out
