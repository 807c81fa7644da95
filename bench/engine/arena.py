"""The engine model over one memory arena: ``EngineConfig(arena=...)``.

A :class:`bench.engine.core.ReplayEngine` whose KV allocator and state pool are the two views
of one :class:`allocators.arena.MemoryArena` (``radix_eviction_policy="unified"``): on a
shortfall the engine calls :func:`components.eviction.unified.make_room` (free chunks cross
the boundary as far as its learned target allows, ``components.eviction.boundary``; then the
cache evicts, by value or within the side at its share) before it finishes a running request. :func:`make_engine` builds the engine a config
asks for; the replay (``python -m bench replay``), the simulator (``python -m bench
simulate``) and ``python -m bench memory-split`` all build theirs through it.

The arena is built from the layout's *counts* (``bench.engine.presets.arena_layout``), not
its bytes: 4 bytes per KV token and one chunk's worth per state (the replay writes no KV or
state data), so a 100 GB budget costs megabytes here while every chunk, page and boundary
move is the real arena's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from allocators.arena import KVShape, MemoryArena, StateShape
from bench.engine.core import EngineConfig, ReplayEngine
from bench.engine.presets import ArenaLayout
from components.eviction.unified import make_room
from components.state import StateWalkFactory
from radix import CacheConfig, RadixCache

__all__ = ["ArenaReplayEngine", "build_arena", "make_engine"]


def build_arena(layout: ArenaLayout, page_size: int) -> MemoryArena:
    """The scaled arena of ``layout`` (module docstring): ``num_chunks`` chunks of
    ``tokens_per_chunk`` tokens x 4 B (the padding chunk included: the budget is the
    others'), ``state_chunks`` of them states.

    Raises:
        ValueError: ``tokens_per_chunk`` not a multiple of ``page_size``.
    """
    if layout.tokens_per_chunk % page_size:  # (the arena would round the chunk up)
        raise ValueError(f"layout.tokens_per_chunk={layout.tokens_per_chunk} is not a multiple "
                         f"of page_size={page_size}")
    kv = KVShape(1, 1, 1, torch.float16, page_size)  # 4 B per token (K and V)
    st = StateShape(1, (1,), (layout.tokens_per_chunk - 1,), torch.float32)  # one chunk
    return MemoryArena((layout.num_chunks - 1) * layout.tokens_per_chunk * 4, kv, st,
                       state_slots=layout.state_chunks)


@dataclass
class ArenaReplayEngine(ReplayEngine):
    """:class:`ReplayEngine` over a :class:`MemoryArena` built from ``config.arena``.

    Attributes:
        arena: the arena (its views are ``kv_allocator`` and ``state_pool``).
        state_chunks: ``[fewest, most]`` chunks the states owned over the run.
    """

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg.arena is None:
            raise ValueError("ArenaReplayEngine needs config.arena (an ArenaLayout)")
        self.arena = build_arena(cfg.arena, cfg.page_size)
        self.kv_allocator = self.arena.kv_allocator
        self.state_pool = self.arena.state_pool
        self.cache = RadixCache(CacheConfig(page_size=cfg.page_size,
                                            radix_eviction_policy="unified",
                                            enable_kv_cache_events=cfg.kv_events != "off"),
                                kv_allocator=self.kv_allocator, state_allocator=self.state_pool,
                                state_walk=self.state_walk)
        self._running = deque()
        self._empty = self.cache.empty_slots
        self._on_cpu = True
        n = self.arena.num_state_chunks
        self.state_chunks = [n, n]

    def _note(self) -> None:
        n = self.arena.num_state_chunks
        self.state_chunks = [min(self.state_chunks[0], n), max(self.state_chunks[1], n)]

    def _make_kv_room(self, n: int) -> None:
        if make_room(self.cache, self.arena, kv_tokens=n, on_evict=self._count):
            self._note()

    def _make_state_room(self) -> None:
        if make_room(self.cache, self.arena, states=1, on_evict=self._count):
            self._note()


def make_engine(config: EngineConfig, state_walk: StateWalkFactory | None = None
                ) -> ReplayEngine:
    """The engine ``config`` asks for: :class:`ArenaReplayEngine` with ``config.arena``, else
    :class:`ReplayEngine` (two pools of fixed sizes)."""
    cls = ReplayEngine if config.arena is None else ArenaReplayEngine
    return cls(config, state_walk=state_walk)
