"""The slot-time budget model (``bench/dev/policies/budget.py``) on a trace worked out by hand."""

from __future__ import annotations

import math

import pytest

from bench.dev.policies.budget import (
    EndState,
    by_bucket,
    end_states,
    main,
    offline_tokens,
    online_tokens,
)
from bench.traces.loader import TraceRequest, runs_from_blocks

B = 4


def req(blocks: list[int], length: int) -> TraceRequest:
    return TraceRequest(0.0, length, 1, B, tuple(blocks), runs_from_blocks(blocks, B, length))


# r0 (1 2) is consumed by r2 (its prompt[:-1] covers blocks 1 2), 2 requests later; r1 (5) never;
# r2 (1 2 3) by r3 one request later, with 2 of its 3 blocks seen before (share 0.67: bucket 1);
# r3 (1 2 3 4) never, 3 of 4 seen (bucket 1).
TRACE = [req([1, 2], 8), req([5], 4), req([1, 2, 3], 12), req([1, 2, 3, 4], 16)]
STATES = [EndState(2, 8, 0, 2), EndState(math.inf, 4, 0, 1), EndState(1, 12, 1, 3),
          EndState(math.inf, 16, 1, 4)]


def test_end_states_by_hand() -> None:
    assert end_states(TRACE) == STATES


def test_offline_keeps_the_cheapest_per_saved_token_first() -> None:
    # r2 costs 1 slot-request for 12 tokens, r0 2 for 8
    assert [offline_tokens(STATES, b) for b in (0, 1, 2, 3, 100)] == [0, 12, 12, 20, 20]


def test_online_hold_times_with_and_without_classes() -> None:
    # one class: hold 1 costs 4 (every state held one request) and saves 12; hold 2 costs 7
    # and saves 20; the hull's slopes 3 then 8/3
    assert online_tokens(STATES, 4) == pytest.approx(12)
    assert online_tokens(STATES, 5.5) == pytest.approx(12 + 1.5 / 3 * 8)
    assert online_tokens(STATES, 100) == pytest.approx(20)
    # by bucket: bucket 1 held 1 costs 2 for 12 (slope 6); bucket 0 held 2 costs 4 for 8
    assert online_tokens(STATES, 2, by_bucket) == pytest.approx(12)
    assert online_tokens(STATES, 4, by_bucket) == pytest.approx(16)
    assert online_tokens(STATES, 6, by_bucket) == pytest.approx(20)


def test_the_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--source", "sysprompt", "--cacheable", "8"]) == 0
    out = capsys.readouterr().out
    assert "| C | offline |" in out and "\n| 8 | " in out
    with pytest.raises(SystemExit):
        main(["--cacheable", "0"])
