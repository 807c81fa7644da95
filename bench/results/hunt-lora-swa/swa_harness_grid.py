"""The SWA cache's reference-model walk (tests/components/test_cache_swa_random.py) outside
its test grid, and the HiCache SWA random test with more seeds.

Usage (repository root): ``PYTHONPATH=. python bench/results/hunt-lora-swa/swa_harness_grid.py``

The harness's own drain loop finishes requests before it releases its locks; with a full
state pool held by those locks it never ends (a harness stall, not a library one), so this
runner releases the locks first.
"""

from __future__ import annotations

import itertools

from tests.components.test_cache_swa_random import SWAHarness
from tests.hicache.test_hicache_swa import (
    test_random_steps_keep_every_copy_exact_and_every_invariant as hicache_walk,
)


class LocksFirst(SWAHarness):
    def run(self, steps: int) -> None:
        ops = [(self.op_insert, 25), (self.op_match, 14), (self.op_unlock, 10),
               (self.op_evict, 6), (self.op_evict_swa, 8), (self.op_evict_states, 5),
               (self.op_req_start, 8), (self.op_req_step, 12), (self.op_req_finish, 4),
               (self.op_hold, 3), (self.op_release, 3), (self.op_reset, 1)]
        fns = [f for f, _ in ops]
        weights = [w for _, w in ops]
        self.check()
        for _ in range(steps):
            self.rng.choices(fns, weights)[0]()
            self.check()
        while self.locks:
            self.op_unlock()
            self.check()
        for _ in range(1000):
            if not self.reqs:
                break
            if self.cache_req(self.reqs[0], finished=True):
                self.reqs.pop(0)
            else:
                self._evict("evict_states", 1)
            self.check()


def main() -> None:
    runs = stalls = 0
    for ps, window, extra, hybrid, seed in itertools.product(
            [1, 2, 4], [1, 2, 3, 5, 8, 16], [0, 1, 2], [False, True], range(3)):
        if ps == 4 and extra == 2:
            continue
        h = LocksFirst(90000 + seed * 7 + ps * 1000 + window * 13 + extra * 101 + hybrid, ps,
                       hybrid, window, extra_pages=extra)
        h.run(250)
        runs += 1
        stalls += bool(h.reqs)  # requests the drain could not finish (states all held)
    print(f"{runs} walks of 250 steps agreed with the model ({stalls} drains left requests)")
    for seed in range(12, 72):
        for policy in ("write_through", "write_back"):
            hicache_walk(seed, policy)
    print("HiCache SWA random test: seeds 12..71 x 2 policies passed")


if __name__ == "__main__":
    main()
