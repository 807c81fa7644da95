"""The engine model of the trace replay : one trace request at a time,
driving a :class:`radix.RadixCache` the way a serving engine would, without a model.

Per request, in trace order (``L`` = prompt tokens, ``U`` = usable cached prefix)::

    prompt  |<------------- U ------------->|<---------- L - U ----------->|
            [ tree slots (m.device_indices) ][ new prompt slots ][pad]     [ output slots ]
            0                               U                  F    L    (separate pages)
                                                  F = L // page_size * page_size

1. ``m = cache.match_prefix(prompt[:-1])`` (an engine recomputes at least one token to get
   logits) and ``inc_lock_ref(m.last_device_node)``. With a host tier (``hicache_ratio``), a
   match that reaches host-only data (``m.host_hit_length > 0``) first loads it back
   (``cache.load_back(m.last_host_node)``: KV and state, or only a state) and, when that
   loaded anything, matches again.
2. One state slot for the request (copy-on-write: ``state_pool.copy(m.state_slot, slot)``),
   then one KV allocation for the uncached prompt tokens and the output tokens, each rounded
   up to whole pages. On a shortfall: ``cache.evict_states`` / ``cache.evict``, then finish
   the oldest running request, then give up and count the request as skipped.
3. Prefill from ``U`` in chunks of ``chunk_size``: at each chunk end ``< L`` and at
   ``m.branching_seqlen`` (when ``U < b < L``), both aligned down to a page, a fresh state
   slot receives a copy of the running state and ``cache_unfinished_req`` inserts the prefix
   so far with it (the request keeps its lock). No slot to be had -> the checkpoint is skipped.
4. At most ``concurrency`` requests run; admitting one more first finishes the oldest.
   Finishing calls ``cache_finished_req(req, state_slot=slot, upto=keep)`` with ``keep`` the
   prompt's last full trace block (``end_checkpoint="block"``) or the whole prompt
   (``"exact"``), aligned down to a page; then the engine frees the output slots and the
   partial last prompt page, which it never hands to the cache.

On a device (``EngineConfig.device``, e.g. ``"cuda"``) the engine keeps what a GPU engine keeps:
slot tensors on the device (``alloc`` results, ``m.device_indices``), request rows built with
``allocators.cat_slots`` (which keeps their host mirrors), and a state slot as the one-element
tensor the state pool handed out; it never reads a device value on the host itself.

Output KV is allocated together with the prompt's (one ``alloc`` call) but kept apart from
``CacheRequest.kv_indices``: the traces carry no output token ids, so output is never cached.
``kv_indices`` covers whole pages only (``[0, F)``): the cache frees its unkept tail, and a
paged allocator frees whole pages only. No KV data is written (allocators without pools);
state slots are real but tiny (1 layer, 1-element tensors) so copies cost microseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch

from allocators import (
    KVPool,
    MambaStatePool,
    PagedAllocator,
    SWAAllocator,
    TokenAllocator,
    cat_slots,
)
from allocators.arena import ArenaKVAllocator
from allocators.free_list import free_list_bytes
from allocators.memory import MemoryBudgetError, available_host_memory
from bench.engine.metrics import RequestLog
from bench.engine.presets import ArenaLayout
from bench.traces.loader import TraceRequest
from components.state import StateWalkFactory
from hicache import HiCacheConfig
from radix import CacheConfig, CacheRequest, EvictResult, RadixCache, RadixKey
from radix.config import SWA_RELEASE_EXTRA_PAGES

__all__ = ["EndCheckpoint", "EngineConfig", "EngineCounters", "MemoryBudgetError", "ReplayEngine"]

EndCheckpoint = Literal["block", "exact"]

#: Bytes a pool's free list takes per entry (``allocators.free_list``: the int64 ring, the
#: free flag, the int32 / int64 release stamp): the least an entry of any pool costs.
FREE_LIST_BYTES = 13

#: Bytes of one slot of the engine's state pool: one float32 conv and one float32 SSM element
#: of its one layer (the replay copies states but never reads them).
STATE_SLOT_BYTES = 8


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Memory sizes and engine knobs of one replay.

    Attributes:
        policy: radix eviction policy name (``lru``, ``gds``, ...).
        policy_config: the policy's knobs, or ``None``.
        kv_tokens: KV pool size [tokens] (rounded down to whole pages).
        state_slots: recurrent-state pool size [slots]; 0 models a KV-only (attention) model.
        page_size: tokens per KV page; the cache matches and stores whole pages.
        chunk_size: prefill chunk [tokens]; a state checkpoint at every chunk end.
        concurrency: requests in flight at most.
        end_checkpoint: where a finished prompt's state is cached (see module docstring).
        sliding_window: SWA window [tokens]; 0 = no sliding-window layers.
        swa_tokens: SWA pool size [tokens] (with a window); the full pool is ``kv_tokens``.
        swa_release_extra_pages: ``CacheConfig.swa_release_extra_pages`` (pages kept live past
            the window when a request releases its out-of-window SWA KV).
        hicache_ratio: host (L2) pools of this many times the device pools; 0 = no host tier.
        hicache_write_policy: ``write_through``, ``write_through_selective`` or ``write_back``.
        hicache_mem_layout: the host pools' layout (``HiCacheConfig.hicache_mem_layout``).
        device: where the pools and slot tensors live (``"cpu"``, ``"cuda"``); with a host tier
            on a device the KV allocator gets a one-layer, one-head KV pool so that backups
            and load-backs move real data.
        kv_events: ``"off"``; ``"on"`` the cache records KV events (``components.events``)
            and the replay takes them after every request, as an engine publishes them;
            ``"check"`` also rebuilds the page set from them (``bench.engine.kv_events``).
        arena: ``None`` (two pools of fixed sizes), or the unified arena's counts
            (``bench.engine.presets.arena_layout``): one budget for KV pages and states whose
            boundary moves at run time (``bench.engine.arena.ArenaReplayEngine``, built by
            ``bench.engine.arena.make_engine``; ``bench.engine.presets.engine_sizes``); then ``policy`` is ``"unified"``,
            ``kv_tokens`` / ``state_slots`` are the arena's split at the start
            (``arena.kv_tokens`` / ``arena.state_chunks``), and there is no sliding window or
            host tier.
        session_hint: pass each request's ``TraceRequest.session`` to the cache as the hint
            ``extra={"session_id": ...}`` (:mod:`radix.hints`), as an engine that carries a
            conversation / agent id would; requests without a session carry none.
    """

    policy: str = "lru"
    policy_config: dict[str, Any] | None = None
    kv_tokens: int = 16_000_000
    state_slots: int = 512
    page_size: int = 1
    chunk_size: int = 8192
    concurrency: int = 32
    end_checkpoint: EndCheckpoint = "block"
    sliding_window: int = 0
    swa_tokens: int = 0
    swa_release_extra_pages: int = SWA_RELEASE_EXTRA_PAGES
    hicache_ratio: float = 0.0
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "page_first"
    device: str = "cpu"
    kv_events: str = "off"
    arena: ArenaLayout | None = None
    session_hint: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.session_hint, bool):
            raise TypeError(f"session_hint must be a bool, got {type(self.session_hint).__name__}")
        if self.arena is not None:
            self._check_arena(self.arena)
        for name in ("kv_tokens", "page_size", "chunk_size", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.state_slots < 0:
            raise ValueError(f"state_slots must be >= 0, got {self.state_slots}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0 = no SWA layers), got {self.sliding_window}")
        if self.sliding_window and not self.page_size <= self.swa_tokens <= self.kv_tokens:
            raise ValueError(
                f"swa_tokens ({self.swa_tokens}) must be in [page_size, kv_tokens] with a sliding window"
            )
        if self.kv_tokens < self.page_size:
            raise ValueError(f"kv_tokens ({self.kv_tokens}) must hold one page ({self.page_size})")
        if self.end_checkpoint not in ("block", "exact"):
            raise ValueError(
                f"end_checkpoint must be 'block' or 'exact', got {self.end_checkpoint!r}"
            )
        if self.kv_events not in ("off", "on", "check"):
            raise ValueError(f"kv_events must be 'off', 'on' or 'check', got {self.kv_events!r}")
        if self.hicache_ratio:
            self.hicache_config()  # validates ratio and write policy (ValueError / TypeError)
        avail = available_host_memory()
        if avail is not None and self.min_bytes() > avail:
            states = self.arena is None and self.state_slots > 0
            raise MemoryBudgetError(
                f"kv_tokens={self.kv_tokens:,} (page {self.page_size}"
                + (f", swa_tokens={self.swa_tokens:,}" if self.sliding_window else "")
                + (f", host {self.hicache_ratio:g}x" if self.hicache_ratio else "")
                + (f"), state_slots={self.state_slots:,}" if states else ")")
                + f": the pools' free lists alone need {_gib(self.min_bytes())} "
                f"({FREE_LIST_BYTES} bytes per page"
                + (f", {FREE_LIST_BYTES + STATE_SLOT_BYTES} per state slot" if states else "")
                + f"), more than the {_gib(avail)} this machine has available")

    def _check_arena(self, arena: ArenaLayout) -> None:
        """The fields an arena fixes agree with it (``ValueError`` naming the field)."""
        if not isinstance(arena, ArenaLayout):
            raise TypeError(f"arena must be an ArenaLayout or None, got {type(arena).__name__}")
        wrong = [(name, got, want) for name, got, want in (
            ("policy", self.policy, "unified"), ("kv_tokens", self.kv_tokens, arena.kv_tokens),
            ("state_slots", self.state_slots, arena.state_chunks),
            ("sliding_window", self.sliding_window, 0), ("hicache_ratio", self.hicache_ratio, 0))
            if got != want]
        if wrong:
            name, got, want = wrong[0]
            raise ValueError(f"{name}={got!r} with a unified arena: expected {want!r}")
        if arena.tokens_per_chunk % self.page_size:
            raise ValueError(f"arena.tokens_per_chunk={arena.tokens_per_chunk} is not a multiple "
                             f"of page_size={self.page_size}")

    def min_bytes(self) -> int:
        """The least the pools of this configuration allocate [bytes]: :data:`FREE_LIST_BYTES`
        per page of the KV pool and the SWA pool, and per state slot its free-list entry and
        :data:`STATE_SLOT_BYTES` (two pools, not an arena); the host tier's pools on top."""
        pages = self.kv_tokens // self.page_size
        if self.sliding_window:
            pages += self.swa_tokens // self.page_size
        per_tier = FREE_LIST_BYTES * pages
        if self.arena is None and self.state_slots:
            per_tier += free_list_bytes(self.state_slots) \
                + STATE_SLOT_BYTES * (self.state_slots + 1)
        return int(per_tier * (1 + self.hicache_ratio))

    def hicache_config(self) -> HiCacheConfig | None:
        """The cache's host tier, or ``None`` when ``hicache_ratio`` is 0."""
        if not self.hicache_ratio:
            return None
        return HiCacheConfig(
            hicache_ratio=self.hicache_ratio, hicache_write_policy=self.hicache_write_policy,
            hicache_mem_layout=self.hicache_mem_layout,
        )


@dataclass(slots=True)
class EngineCounters:
    """What the engine did besides serving requests (all counts, not rates).

    ``evicted_*`` sum the engine's own ``evict`` / ``evict_states`` calls (a leaf's state
    leaves with its KV and vice versa, so both calls may free both). ``checkpoints`` counts
    ``cache_unfinished_req`` calls (chunk ends and branch points; KV-only inserts on a
    KV-only model), ``skipped_checkpoints`` those dropped for want of a state slot, and
    ``forced_finishes`` running requests finished early to free memory.
    """

    evicted_kv_tokens: int = 0
    evicted_states: int = 0
    evicted_swa_tokens: int = 0
    checkpoints: int = 0
    skipped_checkpoints: int = 0
    forced_finishes: int = 0


@dataclass(slots=True)
class _Running:
    """One admitted request: the cache's record plus what the engine itself holds."""

    req: CacheRequest
    state_slot: int | torch.Tensor | None  # the running state (None on a KV-only model)
    own_slots: torch.Tensor  # output pages + partial last prompt page: the engine frees them
    keep_len: int  # tokens to cache at finish (before clamping to what is already cached)


@dataclass
class ReplayEngine:
    """Replays trace requests through one fresh :class:`RadixCache`.

    Call :meth:`admit` per request in trace order, then :meth:`drain`; read :attr:`log`
    and :attr:`counters` afterwards. ``cache``, ``kv_allocator`` and ``state_pool`` are
    exposed for checks (``cache.sanity_check()``).
    """

    config: EngineConfig
    log: RequestLog = field(default_factory=RequestLog)
    counters: EngineCounters = field(default_factory=EngineCounters)
    state_walk: StateWalkFactory | None = None
    """Passed to ``RadixCache(state_walk=...)``: a replay-side state walk (``bench.policies.strategies``)."""

    def __post_init__(self) -> None:
        cfg = self.config
        ps = cfg.page_size
        num_slots = cfg.kv_tokens // ps * ps
        dev = cfg.device
        pool = swa_pool = None
        swa_slots = cfg.swa_tokens // ps * ps
        if cfg.hicache_ratio and dev != "cpu":  # a host tier on a device copies real rows
            pool = KVPool(num_slots, 1, 1, 1, torch.float16, dev, page_size=ps)
            if cfg.sliding_window:
                swa_pool = KVPool(swa_slots, 1, 1, 1, torch.float16, dev, page_size=ps)
        self.kv_allocator: TokenAllocator | PagedAllocator | SWAAllocator | ArenaKVAllocator
        if cfg.sliding_window:
            self.kv_allocator = SWAAllocator(num_slots, swa_slots, ps, full_pool=pool,
                                             swa_pool=swa_pool, device=dev)
        elif ps == 1:
            self.kv_allocator = TokenAllocator(num_slots, pool=pool, device=dev)
        else:
            self.kv_allocator = PagedAllocator(num_slots, ps, pool=pool, device=dev)
        self.state_pool: MambaStatePool | None = None
        if cfg.state_slots:
            self.state_pool = MambaStatePool(
                cfg.state_slots, num_layers=1, conv_state_shape=(1,), ssm_state_shape=(1,),
                device=dev,
            )
        cache_cfg = CacheConfig(
            page_size=ps,
            radix_eviction_policy=cfg.policy,
            radix_eviction_policy_config=cfg.policy_config,
            sliding_window_size=cfg.sliding_window or None,
            swa_release_extra_pages=cfg.swa_release_extra_pages,
            enable_kv_cache_events=cfg.kv_events != "off",
        )
        self.cache = RadixCache(
            cache_cfg,
            kv_allocator=self.kv_allocator,
            state_allocator=self.state_pool,
            hicache=cfg.hicache_config(),
            state_walk=self.state_walk,
        )
        self._running: deque[_Running] = deque()
        self._empty = self.cache.empty_slots
        self._on_cpu = self.kv_allocator.device.type == "cpu"

    # ------------------------------------------------------------------ public
    def drain(self) -> None:
        """Finish every running request (oldest first)."""
        while self._running:
            self._finish(self._running.popleft())

    def finish(self, rid: object) -> bool:
        """Finish the running request ``rid`` now (for a scheduler that decides completion
        order). False when it is not running (already finished to free memory, or skipped)."""
        for i, run in enumerate(self._running):
            if run.req.rid == rid:
                del self._running[i]
                self._finish(run)
                return True
        return False

    def admit(self, tr: TraceRequest, rid: object = None, extra_key: Any = None) -> bool:
        """Serve one request: match, allocate, prefill with checkpoints; it then runs until
        the window pushes it out (or :meth:`finish`). Returns False when it had to be skipped
        (memory). ``extra_key``: the request's namespace (a LoRA adapter's uid), or ``None``."""
        cfg = self.config
        if len(self._running) >= cfg.concurrency:
            self._finish(self._running.popleft())
        tokens = RadixKey(tr.token_array, extra_key)  # validated once, reused by every cache call
        prompt_len = len(tokens)
        cache = self.cache
        hint = {"session_id": tr.session} if cfg.session_hint and tr.session is not None else None
        m = cache.match_prefix(tokens[:-1], extra=hint)
        if m.host_hit_length > 0:
            host = m.last_host_node
            assert host is not None  # set whenever host_hit_length > 0
            # Re-match when KV, or only the node's state, came back (a skipped or failed load
            # changes nothing, and a second match would count the same host hit twice).
            if cache.load_back(host) > 0 or host.state_slot is not None:
                m = cache.match_prefix(tokens[:-1], extra=hint)
        node = m.last_device_node
        lock = cache.inc_lock_ref(node)
        usable = m.prefix_len

        slot = None
        pool = self.state_pool
        if pool is not None:
            slot = self._alloc_state(finish_running=True)
            if slot is None:
                return self._skip(lock)
            if m.state_slot is not None:
                pool.copy(m.state_slot, slot)

        ps = cfg.page_size
        full_len = prompt_len // ps * ps  # whole pages of the prompt: what kv_indices covers
        prompt_alloc = -(-(prompt_len - usable) // ps) * ps
        out_alloc = -(-tr.output_length // ps) * ps
        kv = self._alloc_kv(prompt_alloc + out_alloc)
        if kv is None:
            if pool is not None and slot is not None:
                if isinstance(slot, torch.Tensor):
                    pool.free(slot)
                else:
                    pool.free_slot(slot)
            return self._skip(lock)
        own = kv[full_len - usable :]
        req = CacheRequest(
            key=tokens,
            kv_indices=cat_slots((m.device_indices, kv[: full_len - usable]))
            if usable
            else kv[: full_len - usable],
            cached_len=usable,
            last_node=node,
            rid=rid,
            lock=lock,
            extra=hint,
        )
        self.log.record(prompt_len, usable, m.kv_hit_length, m.swa_miss_tokens)
        self._prefill_checkpoints(req, slot, usable, prompt_len, m.branching_seqlen)
        keep = prompt_len if cfg.end_checkpoint == "exact" else tr.num_full_blocks * tr.block_size
        self._running.append(_Running(req, slot, own, min(keep, prompt_len) // ps * ps))
        return True

    # ------------------------------------------------------------------ steps
    def _prefill_checkpoints(
        self,
        req: CacheRequest,
        slot: int | torch.Tensor | None,
        usable: int,
        prompt_len: int,
        branching: int | None,
    ) -> None:
        """Insert the prefix computed so far at each chunk end and at the branch point."""
        cfg = self.config
        ps = cfg.page_size
        points = set(range(usable + cfg.chunk_size, prompt_len, cfg.chunk_size))
        if branching is not None and usable < branching < prompt_len:
            points.add(branching)
        pool = self.state_pool
        for pos in sorted({p // ps * ps for p in points}):
            if pos <= req.cached_len:  # aligned down onto what is already cached
                continue
            snap = None
            if pool is not None:
                assert slot is not None  # a hybrid request always holds its running state
                snap = self._alloc_state(finish_running=False)
                if snap is None:
                    self.counters.skipped_checkpoints += 1
                    continue
                pool.copy(slot, snap)  # the running state at ``pos`` (notionally)
            if self.config.sliding_window:
                self.cache.release_swa(req, pos)  # SWA KV that slid out of the window
            self.cache.cache_unfinished_req(req, state_slot=snap, upto=pos)
            self.counters.checkpoints += 1

    def _finish(self, run: _Running) -> None:
        """Cache the prompt up to its end checkpoint, release the lock, free the rest."""
        req = run.req
        keep = max(run.keep_len, req.cached_len)
        if self.config.sliding_window:
            self.cache.release_swa(req, keep)  # same boundary as the insert below
        self.cache.cache_finished_req(req, state_slot=run.state_slot, upto=keep)
        if run.own_slots.numel():
            self.kv_allocator.free(run.own_slots)

    def _skip(self, lock: Any) -> bool:
        self.cache.dec_lock_ref(lock)
        self.log.skip()
        return False

    def _finish_oldest(self) -> bool:
        if not self._running:
            return False
        self._finish(self._running.popleft())
        self.counters.forced_finishes += 1
        return True

    # ------------------------------------------------------------------ memory
    def _count(self, res: EvictResult) -> None:
        c = self.counters
        c.evicted_kv_tokens += res.num_tokens
        c.evicted_states += res.num_states
        c.evicted_swa_tokens += res.num_swa_tokens

    def _alloc_kv(self, n: int) -> torch.Tensor | None:
        """``n`` KV slots (a page multiple), evicting and then finishing running requests."""
        if n == 0:
            return self._empty
        alloc = self.kv_allocator
        while True:
            kv = alloc.alloc(n)
            if kv is not None:
                return kv
            self._make_kv_room(n)
            kv = alloc.alloc(n)
            if kv is not None:
                return kv
            if not self._finish_oldest():
                return None

    def _make_kv_room(self, n: int) -> None:
        """Evict cached KV so that ``n`` KV slots may fit (the shortfall of ``_alloc_kv``)."""
        alloc = self.kv_allocator
        res: EvictResult | None
        if isinstance(alloc, SWAAllocator):
            res = self.cache.evict(max(n - alloc.full_available_size(), 0))
            self._count(res)
            short = n - alloc.swa_available_size()
            res = self.cache.evict_swa(short) if short > 0 else None
        else:
            res = self.cache.evict(n - alloc.available_size())
        if res is not None:
            self._count(res)

    def _alloc_state(self, *, finish_running: bool) -> int | torch.Tensor | None:
        """One state slot, evicting a state if needed; then (if allowed) finishing requests.
        An ``int`` on the CPU; on a device the one-element tensor ``alloc`` returned (an engine
        there never reads it on the host)."""
        pool = self.state_pool
        assert pool is not None
        take = pool.alloc_slot if self._on_cpu else partial(pool.alloc, 1)
        while True:
            t = take()
            if t is not None:
                return t
            self._make_state_room()
            t = take()
            if t is not None:
                return t
            if not finish_running or not self._finish_oldest():
                return None

    def _make_state_room(self) -> None:
        """Evict a cached state so that one state slot may fit (the shortfall of
        ``_alloc_state``)."""
        self._count(self.cache.evict_states(1))
