"""The replay's speed floor (``bench/engine/floor.py``): the same engine over a minimal
block-level cache. Hit counts worked out by hand, the pools conserved under eviction, and the
token-level replay agreeing with it where every boundary is a block boundary."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bench.engine.core import EngineConfig
from bench.engine.floor import FloorEngine, floor_replay
from bench.runs.replay import replay_one
from bench.traces.loader import TraceRequest, runs_from_blocks

B = 4  # tokens per trace block


def req(blocks: list[int], length: int, output: int = 2) -> TraceRequest:
    return TraceRequest(0.0, length, output, B, tuple(blocks), runs_from_blocks(blocks, B, length))


def tree_slots(engine: FloorEngine) -> list[int]:
    out: list[int] = []
    stack = list(engine.root.children.values())
    while stack:
        n = stack.pop()
        out += n.slots.tolist()
        stack += n.children.values()
    return out


def test_hits_by_hand() -> None:
    # A: blocks 1 2 3 (12 tokens): nothing cached; a chunk checkpoint at 8, the end at 12.
    # B: blocks 1 2 9 + 2 tokens (14): prompt[:-1] = 13 tokens -> whole blocks 1 2 match, 9 does
    #    not; block 2's node holds A's chunk state -> 8 usable tokens.
    # C: blocks 1 2 3 4 (16): 1 2 3 match with A's end state at 12 -> 12 usable.
    trace = [req([1, 2, 3], 12), req([1, 2, 9, 10], 14), req([1, 2, 3, 4], 16)]
    r = floor_replay(trace, kv_tokens=1000, state_slots=8, chunk_size=8, concurrency=1)
    assert (r.prompt_tokens, r.usable_tokens, r.skipped) == (42, 20, 0)
    assert r.token_hit_rate == pytest.approx(20 / 42)
    # KV only: B's KV match is 8 as well; C matches blocks 1 2 3 -> 12.
    r = floor_replay(trace, kv_tokens=1000, state_slots=0, chunk_size=8, concurrency=1)
    assert r.usable_tokens == 20


def test_a_state_is_needed_to_resume() -> None:
    # Without chunk checkpoints (chunk 64) A leaves one state, at its end (12 tokens): B shares
    # only blocks 1 2 of it, a KV hit of 8 with no state there -> 0 usable, and B checkpoints
    # at the branch point (8), so C (blocks 1 2 7) then resumes from 8.
    trace = [req([1, 2, 3], 12), req([1, 2, 9, 10], 14), req([1, 2, 7, 8], 13)]
    r = floor_replay(trace, kv_tokens=1000, state_slots=8, chunk_size=64, concurrency=1)
    assert r.usable_tokens == 0 + 0 + 8


def test_pools_are_conserved_under_pressure() -> None:
    rng = random.Random(0)
    trace = []
    for _ in range(300):
        shared = rng.randrange(6)
        blocks = [100 + i for i in range(rng.randrange(1, 5))] if shared else []
        blocks += [rng.randrange(1000, 10**6) for _ in range(rng.randrange(1, 6))]
        trace.append(req(blocks, len(blocks) * B - rng.randrange(B)))
    cap, states = 120, 5
    engine = FloorEngine(cap, states, B, 8, concurrency=3)
    for tr in trace:
        engine.admit(tr)
        held = [s for run in engine.running for s in run[2].tolist()]
        held += [s for run in engine.running for s in run[1][len(run[0]) * B:].tolist()]
        slots = tree_slots(engine) + held + engine.free_kv[:engine.top].tolist()
        assert sorted(slots) == list(range(cap))  # every slot once: tree, requests, free
    engine.drain()
    assert sorted(tree_slots(engine) + engine.free_kv[:engine.top].tolist()) == list(range(cap))
    used = sum(1 for n in engine.states)
    assert used + len(engine.free_states) == states
    assert engine.usable_tokens > 0


@pytest.mark.parametrize("slots", [0, 512])
def test_the_token_level_replay_serves_the_same_hits(slots: int) -> None:
    # Memory never binds here, every boundary is a block boundary: the token-level replay
    # (lru) and the floor see the same tree, request for request.
    rng = np.random.default_rng(1)
    docs = [list(range(10 * d, 10 * d + 6)) for d in range(1, 6)]
    trace = []
    for i in range(200):
        doc = docs[int(rng.integers(len(docs)))]
        cut = int(rng.integers(1, len(doc) + 1))
        tail = [10**5 + 8 * i + k for k in range(int(rng.integers(1, 4)))]
        blocks = doc[:cut] + tail
        trace.append(req(blocks, len(blocks) * B - int(rng.integers(B))))
    f = floor_replay(trace, kv_tokens=100_000, state_slots=slots, chunk_size=8, concurrency=4)
    r = replay_one(trace, EngineConfig(policy="lru", kv_tokens=100_000, state_slots=slots,
                                       chunk_size=8, concurrency=4), progress=False)
    assert r.metrics.usable_tokens == f.usable_tokens > 0


def test_bad_traces_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        floor_replay([], 100, 0)
    with pytest.raises(ValueError, match="block_size"):
        floor_replay([req([1], 4), TraceRequest(0.0, 4, 1, 2, (1, 2), ((1, 4),))], 100, 0)
