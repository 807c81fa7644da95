"""The free helpers of SGLang's ``sglang.srt.mem_cache.common`` (0.5.23) that concern the tree
cache."""

from __future__ import annotations

from typing import Any

__all__ = ["available_and_evictable_str"]


def available_and_evictable_str(tree_cache: Any) -> str:
    """``tree_cache.available_and_evictable_str()``: the available + evictable tokens of each
    pool, one line each (SGLang's log line)."""
    return str(tree_cache.available_and_evictable_str())
