"""``python -m bench opcodes``: the opcode counter counts what a call executes, and the command
prints one line per cache."""

from __future__ import annotations

import dis
import json
from functools import partial
from pathlib import Path

import pytest

from bench.dev.compare.opcodes import OPERATIONS, count_opcodes, main, measure


def straight(x: int) -> int:
    y = x + 1
    z = y * 2
    return z - x


def loop(n: int) -> int:
    t = 0
    for i in range(n):
        t += i
    return t


def test_a_straight_line_function_counts_each_of_its_instructions_once() -> None:
    # partial is C: only straight's frame runs Python. Its trace starts with the call event,
    # which the frame's RESUME raises, so every instruction after RESUME is counted once.
    executed = [i.opname for i in dis.get_instructions(straight)]
    assert executed[0] == "RESUME"
    assert count_opcodes(partial(straight, 3)) == len(executed) - 1 == 12


def test_each_loop_iteration_costs_the_same_opcodes() -> None:
    a, b, c = (count_opcodes(lambda n=n: loop(n)) for n in (5, 10, 15))
    assert b - a == c - b > 0


def test_the_counts_are_the_same_every_run_and_cover_every_operation() -> None:
    first, second = measure(True, 4), measure(True, 4)
    assert first == second
    assert set(first) == set(OPERATIONS) and all(v > 0 for v in first.values())


def test_the_command_prints_both_caches_and_writes_json(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ops.json"
    assert main(["--reps", "3", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["kv", "kv_state"]
    data = json.loads(out.read_text())
    assert set(data) == {"kv", "kv_state"} and set(data["kv"]) == set(OPERATIONS)


def test_one_rep_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--reps", "1"])
    assert e.value.code == 2 and "--reps must be >= 2" in capsys.readouterr().err


class _Node:
    """A stand-in for a tree node: a cycle with its partner, watched by a weakref."""

    partner: _Node


def test_a_collection_during_the_call_does_not_count_other_codes_callbacks() -> None:
    # Cycles watched by weakrefs with a Python callback (as a dead cache's nodes are by a
    # gds_adaptive duel): a collection that frees them runs the callbacks. Started inside
    # the counted call, they were counted as its own (the full suite's opcodes test then
    # saw two equal runs differ by about 50 opcodes).
    import weakref

    def callback(ref: object) -> None:
        for _ in range(5):
            pass

    watched: list[object] = []

    def allocate() -> int:
        return len([_Node() for _ in range(3000)])  # enough allocations to start collections

    want = count_opcodes(allocate)
    for _ in range(10):
        for _ in range(300):
            a, b = _Node(), _Node()
            a.partner, b.partner = b, a
            watched.append(weakref.ref(a, callback))
        assert count_opcodes(allocate) == want
