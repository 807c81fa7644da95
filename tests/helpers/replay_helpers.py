"""Running a trace through the replay engine, checked, and reading its per-request log."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from bench.engine.core import EngineConfig, ReplayEngine
from bench.traces.loader import TraceRequest


def assert_usage_error(main: Callable[[list[str]], int], argv: Sequence[str]) -> None:
    """``main(argv)`` (a command's entry point) stops with exit status 2: an argument error,
    refused before anything runs."""
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2


def replay(trace: list[TraceRequest], **kw: Any) -> ReplayEngine:
    """Admit every request of ``trace`` (request id = position) into a ``ReplayEngine`` built
    from ``EngineConfig(concurrency=1, **kw)``, with ``sanity_check()`` after each admission
    and after the drain; return the drained engine."""
    engine = ReplayEngine(EngineConfig(**{"concurrency": 1, **kw}))
    for i, tr in enumerate(trace):
        engine.admit(tr, rid=i)
        engine.cache.sanity_check()
    engine.drain()
    engine.cache.sanity_check()
    return engine


def rows(engine: ReplayEngine) -> list[tuple[int, int, int]]:
    """Per request: (prompt length, usable prefix length, KV hit length) [tokens]."""
    log = engine.log
    return list(zip(log.prompt_len, log.usable_len, log.kv_hit_len, strict=True))
