"""``bench.engine.arena.build_arena``: the scaled arena of a layout, or ``ValueError`` when
the layout's chunk is not whole pages (its docstring's promise)."""

from __future__ import annotations

import pytest

from bench.engine.arena import build_arena
from bench.engine.presets import ArenaLayout


def test_build_arena_is_the_layout_or_refuses_it() -> None:
    a = build_arena(ArenaLayout(6, 10, 3), 2)  # 6 tokens = 3 pages of 2 per chunk
    assert (a.tokens_per_chunk, a.num_chunks, a.num_state_chunks) == (6, 10, 3)
    assert (a.pages_per_chunk, a.kv_allocator.owned_size()) == (3, 6 * 6)
    # 5 tokens are not whole pages of 2: the arena would round the chunk up to 6 tokens
    # and hold 8 chunks, not the layout's 10
    with pytest.raises(ValueError, match="tokens_per_chunk=5 .*page_size=2"):
        build_arena(ArenaLayout(5, 10, 3), 2)
