"""The engine model's session hint (``EngineConfig.session_hint``, ``--session-hint``): each
request's ``TraceRequest.session`` reaches the cache's walk as ``extra={"session_id": ...}``
on its match and its inserts, and only when the flag is on."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bench.engine.core import EngineConfig, ReplayEngine
from bench.runs.simulate import build_parser, plan_runs
from bench.traces.loader import TraceRequest, runs_from_blocks
from tests.radix.test_cache_hints import HintWalk

B = 4


def req(blocks: list[int], session: str | None) -> TraceRequest:
    length = len(blocks) * B
    return TraceRequest(0.0, length, 2, B, tuple(blocks), runs_from_blocks(blocks, B, length),
                        session)


def replay(hint: bool) -> list[tuple[str, Any]]:
    walks: list[HintWalk] = []

    def factory(ok: Any) -> HintWalk:
        walks.append(HintWalk(ok))
        return walks[-1]

    cfg = EngineConfig(kv_tokens=400, state_slots=8, chunk_size=8, concurrency=1,
                       session_hint=hint)
    eng = ReplayEngine(cfg, state_walk=factory)
    eng.admit(req([1, 2, 3], "chat0"))  # 12 tokens: a checkpoint at 8, the end at 12
    eng.admit(req([1, 2, 3, 4], None))  # finishes the first; resumes from its end
    eng.drain()
    eng.cache.sanity_check()
    return walks[-1].log


def test_session_reaches_the_walk_only_with_the_flag() -> None:
    a = {"session_id": "chat0"}
    assert replay(True) == [
        ("hint", a),  # first request's match: nothing cached
        ("hint", a), ("set", 8),  # its chunk checkpoint
        ("hint", a), ("set", 12),  # admitting the second finishes the first (concurrency 1)
        ("hint", None), ("hit", 12),  # the second request (no session) resumes at 12
        ("hint", None), ("set", 16),  # drained
    ]
    assert all(e[1] is None for e in replay(False) if e[0] == "hint")


def test_session_hint_flag_is_checked_and_parsed() -> None:
    with pytest.raises(TypeError, match="session_hint must be a bool"):
        replace(EngineConfig(), session_hint=1)
    args = build_parser().parse_args(["--policy", "gds_adaptive", "--session-hint",
                                      "--kv-tokens", "1000", "--state-slots", "8"])
    (cfg, _), = plan_runs(args)
    assert cfg.engine.session_hint is True
    args = build_parser().parse_args(["--policy", "gds_adaptive"])
    assert plan_runs(args)[0][0].engine.session_hint is False
