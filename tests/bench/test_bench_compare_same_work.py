"""``bench compare``'s same-work check (``hit_rate_check``): a pair is ``EQUAL`` only when every
field both sides report agrees run for run; a field one side reports as ``null`` (the Rust
cores do not count their nodes) is left out rather than called a difference."""

from __future__ import annotations

import argparse

from bench.dev.compare.sglang import hit_rate_check

ARGS = argparse.Namespace(workloads=["sysprompt"], impls=["radix", "unified-mamba-rust"],
                          policy="lru", page_size=1)


def run(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {"hit_rate": 0.2606, "final_nodes": 87, "evict_calls": 0,
                               "evicted_tokens": 0, "mamba_evict_calls": 1949}
    base.update(fields)
    return base


def results(ours: list[dict[str, object]], theirs: list[dict[str, object]]) -> dict:
    return {("ours", "sysprompt", (True, "counter")): ours[:1],
            ("ours", "sysprompt", (True, "real")): ours[1:],
            ("sglang", "sysprompt", "unified-mamba-rust"): theirs}


def test_a_null_field_is_not_compared() -> None:
    (line,) = hit_rate_check(results([run(), run()], [run(final_nodes=None)]), ARGS)
    assert line.endswith("-> EQUAL (policy lru, page 1)"), line
    assert "final_nodes" not in line and "mamba_evict_calls 1949 = 1949" in line


def test_a_reported_difference_is_found() -> None:
    (line,) = hit_rate_check(results([run(), run()], [run(mamba_evict_calls=1950)]), ARGS)
    assert "mamba_evict_calls 1949 != 1950" in line and line.endswith(
        "-> DIFFERENT (policy lru, page 1)"), line


def test_runs_of_one_side_that_disagree_are_different() -> None:
    (line,) = hit_rate_check(results([run(), run(hit_rate=0.2605)], [run()]), ARGS)
    assert "hit_rate 0.2605/0.2606 != 0.2606" in line and "DIFFERENT" in line
