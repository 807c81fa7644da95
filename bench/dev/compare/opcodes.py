"""Python opcodes per cache operation: a speed measure that a loaded machine cannot blur.

    python -m bench opcodes [--reps N] [--json FILE]

Wall-clock timings of ``match_prefix`` / ``insert`` / ``evict`` swing 2-3x run to run on a
shared 2-core machine; the number of Python bytecode instructions each call executes does not.
This counts them with ``sys.settrace`` (``frame.f_trace_opcodes``): every opcode of every
Python frame the call runs, the C loops (``radix._match``, ``components._claim``,
``allocators._release``) and torch's C++ not counted. Compare two checkouts by running the same
command in each (``PYTHONPATH=<checkout>``): same seed, same operations.

Per cache (a KV-only cache over a :class:`~allocators.TokenAllocator` of 4,096 slots, and the
same with a :class:`~allocators.MambaStatePool` of 64 tiny states), over ``--reps`` requests
sharing a 32-token prefix, each with two 8-token distinct runs after it:

* ``insert_new``: the first insert (a new branch from the root);
* ``insert_extend``: each later insert (a split of the shared prefix, a new leaf);
* ``match_hit``: ``match_prefix`` of the key just inserted (a whole hit);
* ``match_miss``: ``match_prefix`` of three tokens the tree has never seen;
* ``evict``: ``evict(16)`` on the full tree.

Prints one line per cache: the mean opcodes per call of each operation.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

from bench.cli import new_parser, positive, text_stream, write_json

#: The operations counted, in print order.
OPERATIONS = ("match_hit", "match_miss", "insert_new", "insert_extend", "evict")


def count_opcodes(fn: Callable[[], object]) -> int:
    """Python opcodes that ``fn()`` executes (every frame it runs; C code not counted).

    The cyclic garbage collector is off during the call (its state restored after): a
    collection it started would run the Python callbacks and finalizers of whatever earlier
    code left in cycles (a weakref callback of a dead tree node) inside the traced call,
    counted as the call's own."""
    n = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
        return tracer

    enabled = gc.isenabled()
    gc.disable()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        if enabled:
            gc.enable()
    return n


def measure(states: bool, reps: int = 20) -> dict[str, float]:
    """Mean opcodes per call of each of :data:`OPERATIONS` on a fresh cache (``states``: with
    a state pool), over ``reps`` seeded requests (``reps >= 2``)."""
    import torch

    from allocators import MambaStatePool, TokenAllocator
    from radix import RadixCache

    kv = TokenAllocator(4096)
    sp = (MambaStatePool(64, num_layers=1, conv_state_shape=(2,), ssm_state_shape=(2,))
          if states else None)
    cache = RadixCache(kv_allocator=kv, state_allocator=sp)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 1000, (64,), generator=g).tolist()
    total = dict.fromkeys(OPERATIONS, 0)
    calls = dict.fromkeys(OPERATIONS, 0)

    def insert(key: list[int]) -> None:
        slots = kv.alloc(len(key))
        assert slots is not None  # 4,096 slots hold every request
        slot = None
        if sp is not None:
            got = sp.alloc(1)
            assert got is not None
            slot = int(got[0])
        r = cache.insert(key, slots, state_slot=slot)
        kv.free(r.duplicate_indices)
        if sp is not None and not r.state_adopted:
            sp.free(torch.tensor([slot]))

    for i in range(reps):
        key = base[:32] + [2000 + i] * 8 + [3000 + i] * 8
        op = "insert_new" if i == 0 else "insert_extend"
        total[op] += count_opcodes(partial(insert, key))
        calls[op] += 1
        total["match_hit"] += count_opcodes(partial(cache.match_prefix, key))
        total["match_miss"] += count_opcodes(partial(cache.match_prefix, [9999, 9998, 9997]))
        calls["match_hit"] += 1
        calls["match_miss"] += 1
    total["evict"] = count_opcodes(partial(cache.evict, 16))
    calls["evict"] = 1
    cache.sanity_check()
    return {op: round(total[op] / calls[op], 1) for op in OPERATIONS}


def build_parser() -> argparse.ArgumentParser:
    p = new_parser("opcodes", "Python opcodes per match / insert / evict call (KV-only and "
                   "KV + state caches)")
    p.add_argument("--reps", type=positive, default=20,
                   help="seeded requests per cache (>= 2; default 20)")
    p.add_argument("--json", metavar="FILE", help="also write the counts as JSON ('-': stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps < 2:
        build_parser().error(f"--reps must be >= 2 (one new insert, then extensions), got {args.reps}")
    out = {"kv": measure(False, args.reps), "kv_state": measure(True, args.reps)}
    for name, ops in out.items():
        print(f"{name:9s} " + "  ".join(f"{op} {ops[op]:.1f}" for op in OPERATIONS),
              file=text_stream(args.json))
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
