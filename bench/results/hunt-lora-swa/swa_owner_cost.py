"""Cost of SWAAllocator's inverse map: alloc(n) + free_swa + free, old module beside new.

Usage (repository root): ``PYTHONPATH=. python bench/results/hunt-lora-swa/swa_owner_cost.py
OLD_SWA_PY`` where ``OLD_SWA_PY`` is ``git show 23c32f3:allocators/swa.py`` saved to a file.
Prints the best and the median of 15 interleaved rounds of 200 cycles, in microseconds.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from typing import Any

from allocators.swa import SWAAllocator as New


def load_old(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("allocators.swa_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["allocators.swa_old"] = mod
    spec.loader.exec_module(mod)
    return mod.SWAAllocator


def cycle_us(cls: Any, n: int, reps: int = 200) -> float:
    a = cls(1 << 20, 1 << 18, 1)
    t0 = time.perf_counter()
    for _ in range(reps):
        v = a.alloc(n)
        a.free_swa(v)
        a.free(v)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    old = load_old(sys.argv[1])
    for n in (1, 64, 4096):
        res: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(15):
            for name, cls in (("old", old), ("new", New)):
                res[name].append(cycle_us(cls, n))
        print(f"n={n}: best old {min(res['old']):.1f} us, new {min(res['new']):.1f} us; "
              f"median old {statistics.median(res['old']):.1f}, "
              f"new {statistics.median(res['new']):.1f}")


if __name__ == "__main__":
    main()
