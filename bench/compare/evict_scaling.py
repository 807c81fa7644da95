"""Per-node cost of ``evict`` against tree size: is it flat up to a million nodes?

    python -m bench evict-scaling [--nodes 10000 100000 1000000] [--leaf-len 8]
        [--tokens-per-call 64] [--calls 100] [--blocks 5] [--policy lru]

For each size N: a KV-only ``RadixCache`` over a real ``TokenAllocator`` (the library's own
frees: held marks, free ring, free mask) holding 64 shared 16-token prefixes and N leaves of
``--leaf-len`` tokens below them (leaf i under prefix i mod 64, first token unique among its
siblings, so the tree has exactly 64 + N nodes). Then ``--blocks`` blocks of ``--calls``
``evict(--tokens-per-call)`` calls are timed on the process CPU clock (``time.process_time``,
one reading per block: robust on a shared machine); each block's cost per freed node is its
time over the nodes it freed, and the median block is reported. The tree loses
``blocks * calls * tokens_per_call / leaf_len`` leaves over the measurement (4,000 by default:
40 % of the 10k tree, 0.4 % of the 1M one). At the end ``sanity_check`` and the allocator's
``check`` run (outside the timers), and the allocator must hold exactly the tree's slots.

One JSON line per size: ``nodes``, ``build_s``, ``us_per_node`` (median block), ``us_per_call``,
``nodes_per_call``, ``blocks_us_per_node`` (every block).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch

from allocators import TokenAllocator
from bench.compare.options import evict_scaling_parser
from radix import CacheConfig, RadixCache, RadixKey

__all__ = ["build_tree", "measure", "main"]

PREFIXES = 64
PREFIX_LEN = 16


def build_tree(nodes: int, leaf_len: int, policy: str) -> tuple[RadixCache, TokenAllocator]:
    """A cache of ``PREFIXES`` prefixes and ``nodes`` leaves below them (see the module doc),
    its allocator sized to exactly the tree's tokens (so every free is a real ring write)."""
    size = PREFIXES * PREFIX_LEN + nodes * leaf_len
    kv = TokenAllocator(size)
    cache = RadixCache(CacheConfig(radix_eviction_policy=policy), kv_allocator=kv)
    prefix_slots = []
    for p in range(PREFIXES):
        key = RadixKey([p] * PREFIX_LEN)
        slots = kv.alloc(PREFIX_LEN)
        assert slots is not None
        cache.insert(key, slots)
        prefix_slots.append(slots)
    base = PREFIXES
    for i in range(nodes):
        p = i % PREFIXES
        toks = [p] * PREFIX_LEN + [base + i // PREFIXES] + [i] * (leaf_len - 1)
        new = kv.alloc(leaf_len)
        assert new is not None
        res = cache.insert(RadixKey(toks), torch.cat([prefix_slots[p], new]))
        assert res.prefix_len == PREFIX_LEN, res
    return cache, kv


def measure(args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """Build the tree of ``nodes`` leaves and time its eviction blocks (the JSON fields)."""
    leaves = args.blocks * args.calls * -(-args.tokens_per_call // args.leaf_len)
    if leaves >= nodes:
        raise SystemExit(f"--nodes {nodes}: the measurement evicts about {leaves} leaves; "
                         "use more nodes or fewer --blocks / --calls")
    t0 = time.perf_counter()
    cache, kv = build_tree(nodes, args.leaf_len, args.policy)
    build_s = time.perf_counter() - t0
    total = cache.core.tree.num_nodes
    per_node: list[float] = []
    per_call: list[float] = []
    freed_nodes = 0
    ask = args.tokens_per_call
    gc.collect()
    for _ in range(args.blocks):
        before = kv.used_size()
        c0 = time.process_time()
        for _ in range(args.calls):
            cache.evict(ask)
        dt = time.process_time() - c0
        freed = (before - kv.used_size()) // args.leaf_len
        freed_nodes += freed
        per_node.append(dt / freed * 1e6)
        per_call.append(dt / args.calls * 1e6)
    cache.sanity_check()
    kv.check()
    if kv.used_size() != cache.total_size():
        raise AssertionError(f"allocator holds {kv.used_size()} slots, tree {cache.total_size()}")
    return {
        "nodes": nodes,
        "tree_nodes": total,
        "leaf_len": args.leaf_len,
        "policy": args.policy,
        "build_s": round(build_s, 1),
        "tokens_per_call": ask,
        "nodes_per_call": freed_nodes / (args.blocks * args.calls),
        "us_per_node": round(statistics.median(per_node), 3),
        "us_per_call": round(statistics.median(per_call), 2),
        "blocks_us_per_node": [round(x, 3) for x in per_node],
    }


def main(argv: list[str] | None = None) -> int:
    args = evict_scaling_parser().parse_args(argv)
    torch.set_num_threads(1)
    for n in args.nodes:
        print(json.dumps(measure(args, n)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
