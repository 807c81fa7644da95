"""Argument checks shared by the engine-facing calls."""

from __future__ import annotations

from typing import Any


def check_count(n: Any, name: str) -> int:
    """``n`` if it is an int >= 0; ``TypeError`` / ``ValueError`` naming ``name`` otherwise."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int >= 0, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n}")
    return n
