"""The SWA cache's reference-model walk (tests/components/test_cache_swa_random.py) outside
its test grid, and the HiCache SWA random test with more seeds.

Usage (repository root): ``PYTHONPATH=. python bench/results/hunt-lora-swa/swa_harness_grid.py``

The harness's own drain loop finishes requests before it releases its locks; with a full
state pool held by those locks it never ends (a harness stall, not a library one), so this
runner releases the locks first.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

# (imported by name: the test modules are not part of the type-checked packages)
SWAHarness: Any = importlib.import_module("tests.components.test_cache_swa_random").SWAHarness
hicache_walk: Any = importlib.import_module(
    "tests.hicache.test_hicache_swa").test_random_steps_keep_every_copy_exact_and_every_invariant


def run_locks_first(h: Any, steps: int) -> None:
    """``SWAHarness.run`` with the locks released before the requests are drained."""
    ops = [(h.op_insert, 25), (h.op_match, 14), (h.op_unlock, 10), (h.op_evict, 6),
           (h.op_evict_swa, 8), (h.op_evict_states, 5), (h.op_req_start, 8),
           (h.op_req_step, 12), (h.op_req_finish, 4), (h.op_hold, 3), (h.op_release, 3),
           (h.op_reset, 1)]
    fns = [f for f, _ in ops]
    weights = [w for _, w in ops]
    h.check()
    for _ in range(steps):
        h.rng.choices(fns, weights)[0]()
        h.check()
    while h.locks:
        h.op_unlock()
        h.check()
    for _ in range(1000):
        if not h.reqs:
            break
        if h.cache_req(h.reqs[0], finished=True):
            h.reqs.pop(0)
        else:
            h.evict("evict_states", 1)
        h.check()


def main() -> None:
    runs = stalls = 0
    for ps, window, extra, hybrid, seed in itertools.product(
            [1, 2, 4], [1, 2, 3, 5, 8, 16], [0, 1, 2], [False, True], range(3)):
        if ps == 4 and extra == 2:
            continue
        h = SWAHarness(90000 + seed * 7 + ps * 1000 + window * 13 + extra * 101 + hybrid, ps,
                       hybrid, window, extra_pages=extra)
        run_locks_first(h, 250)
        runs += 1
        stalls += bool(h.reqs)  # requests the drain could not finish (states all held)
    print(f"{runs} walks of 250 steps agreed with the model ({stalls} drains left requests)")
    for seed in range(12, 72):
        for policy in ("write_through", "write_back"):
            hicache_walk(seed, policy)
    print("HiCache SWA random test: seeds 12..71 x 2 policies passed")


if __name__ == "__main__":
    main()
