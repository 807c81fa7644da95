"""Random walk over SWAAllocator with map_swa (valid and invalid maps): check() after every
step while no SWA slot is taken unmapped, both pools whole at the end.

Usage (repository root): ``PYTHONPATH=. python bench/results/hunt-lora-swa/swa_map_walk.py``
"""

from __future__ import annotations

import random

import torch

from allocators import SWAAllocator


def t(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def walk(ps: int, seed: int, steps: int = 300) -> None:
    rng = random.Random(seed * 10 + ps)
    a = SWAAllocator(32, 16, ps)
    live: list[list[int]] = []  # full pages with an SWA page
    tomb: list[list[int]] = []  # full pages without one
    loose: list[list[int]] = []  # SWA pages taken from swa_side, not mapped
    for _ in range(steps):
        op = rng.random()
        if op < 0.25:
            n = rng.choice([1, 2, 3]) * ps
            r = a.alloc(n)
            if r is not None:
                s = r.tolist()
                live += [s[i:i + ps] for i in range(0, n, ps)]
        elif op < 0.4 and live:
            pg = live.pop(rng.randrange(len(live)))
            a.free_swa(t(pg))
            tomb.append(pg)
        elif op < 0.55 and (live or tomb):
            pool = live if (live and (not tomb or rng.random() < 0.5)) else tomb
            a.free(t(pool.pop(rng.randrange(len(pool)))))
        elif op < 0.65:
            r = a.swa_side.alloc(ps)
            if r is not None:
                loose.append(r.tolist())
        elif op < 0.8 and tomb and loose:
            f = tomb.pop(rng.randrange(len(tomb)))
            a.map_swa(t(f), t(loose.pop(rng.randrange(len(loose)))))
            live.append(f)
        elif op < 0.9 and (live or tomb) and loose:
            f = rng.choice(live + tomb)
            w = rng.choice(live + tomb + loose)
            if not (f in tomb and w in loose) and w not in loose:
                before = a.snapshot()
                try:
                    a.map_swa(t(f), t(w))
                except ValueError:
                    assert a.snapshot() == before
                else:
                    raise AssertionError(f"map_swa took {f} -> {w}")
        elif loose:
            a.swa_side.free(t(loose.pop(rng.randrange(len(loose)))))
        if not loose:
            a.check()
    for pg in live + tomb:
        a.free(t(pg))
    for w in loose:
        a.swa_side.free(t(w))
    a.check()
    assert (a.full_available_size(), a.swa_available_size()) == (32, 16)


if __name__ == "__main__":
    for ps in (1, 2, 4):
        for seed in range(40):
            walk(ps, seed)
    print("120 walks of 300 steps: check() held, both pools whole")
