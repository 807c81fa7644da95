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

One JSON line per size: ``impl`` (``"ours"``), ``nodes``, ``build_s``, ``us_per_node`` (median
block), ``us_per_call``, ``nodes_per_call``, ``blocks_us_per_node`` (every block).

``--sglang radix unified-rust`` also times SGLang's KV caches (``radix``: the Python
``RadixCache``; ``unified-python`` / ``unified-rust``: ``UnifiedRadixCache`` with its Python or
Rust tree core) on the same tree, the same tokens and the same timed blocks, each in its own
process of the anchor venv (``.ci/sglang-anchor-up``), through the SGLang-side bench script's
``build`` (``--anchor-script``, as ``python -m bench compare`` runs it; skipped with a message
when the venv or the script is missing). Their allocator is the anchor's counting stub (a free
only counts), so their blocks time the tree alone while ours include the real frees. One more
JSON line per impl and size, with ``ours_speedup`` (their ``us_per_node`` over ours). Sizes above
``--sglang-max-nodes`` (default 100,000) are not run on their side: SGLang's ``evict`` collects
and heapifies every leaf on each call (O(n) per call), so a block at 1M leaves takes minutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from allocators import TokenAllocator
from bench.dev.compare.options import evict_scaling_parser
from bench.dev.compare.sglang import (
    DEFAULT_ANCHOR_PYTHON,
    DEFAULT_ANCHOR_SCRIPT,
    anchor_available,
)
from radix import CacheConfig, RadixCache, RadixKey

__all__ = ["build_tree", "leaf_tokens", "measure", "measure_sglang", "main"]

PREFIXES = 64
PREFIX_LEN = 16


def leaf_tokens(i: int, leaf_len: int) -> list[int]:
    """Leaf ``i``'s whole key: prefix ``i mod 64`` (``PREFIX_LEN`` copies of its number), then a
    token unique among the prefix's children (``64 + i // 64``), then ``i`` repeated."""
    p = i % PREFIXES
    return [p] * PREFIX_LEN + [PREFIXES + i // PREFIXES] + [i] * (leaf_len - 1)


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
    for i in range(nodes):
        p = i % PREFIXES
        toks = leaf_tokens(i, leaf_len)
        new = kv.alloc(leaf_len)
        assert new is not None
        res = cache.insert(RadixKey(toks), torch.cat([prefix_slots[p], new]))
        assert res.prefix_len == PREFIX_LEN, res
    return cache, kv


def evicted_leaves(args: argparse.Namespace) -> int:
    """About how many leaves one size's measurement evicts (``--blocks`` x ``--calls`` calls
    of ``--tokens-per-call`` tokens over leaves of ``--leaf-len``): the tree needs more."""
    return int(args.blocks * args.calls * -(-args.tokens_per_call // args.leaf_len))


def measure(args: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """Build the tree of ``nodes`` leaves and time its eviction blocks (the JSON fields)."""
    leaves = evicted_leaves(args)
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
        "impl": "ours",
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


#: Runs in the anchor venv: ``script impl policy nodes leaf_len tokens_per_call calls blocks``.
#: Builds the tree of :func:`build_tree` in SGLang's cache (the same keys, in the same order,
#: from :func:`leaf_tokens`' formula; fresh slot ids from a counter, the cached prefix's own
#: slots passed again as SGLang's callers do) and times the same blocks; one JSON line.
ANCHOR_CHILD = """
import argparse, gc, importlib.util, json, statistics, sys, time
script, impl, policy, *nums = sys.argv[1:]
nodes, leaf_len, ask, calls, blocks, prefixes, prefix_len = map(int, nums)
spec = importlib.util.spec_from_file_location("sglang_radix_bench_anchor", script)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
import torch
name, version, cache, api = mod.build(argparse.Namespace(impl=impl, page_size=1, policy=policy))
nxt = 1
def fresh(n):
    global nxt
    out = torch.arange(nxt, nxt + n, dtype=torch.int64)
    nxt += n
    return out
def insert(toks, value, cached):
    kw = dict(key=api.key(toks), value=value)
    if api.dedup_in_tree:
        kw["prev_prefix_len"] = cached
    return cache.insert(api.InsertParams(**kw))
t0 = time.perf_counter()
slots = []
for p in range(prefixes):
    slots.append(fresh(prefix_len))
    insert([p] * prefix_len, slots[p], 0)
for i in range(nodes):
    p = i % prefixes
    toks = [p] * prefix_len + [prefixes + i // prefixes] + [i] * (leaf_len - 1)
    insert(toks, torch.cat([slots[p], fresh(leaf_len)]), prefix_len)
build_s = time.perf_counter() - t0
total = prefixes * prefix_len + nodes * leaf_len
if cache.evictable_size() != total:
    raise SystemExit(f"{name} holds {cache.evictable_size()} tokens, expected {total}")
per_node, per_call, freed_nodes = [], [], 0
gc.collect()
for _ in range(blocks):
    before = api.alloc.freed_tokens
    c0 = time.process_time()
    for _ in range(calls):
        cache.evict(api.EvictParams(num_tokens=ask))
    dt = time.process_time() - c0
    freed = (api.alloc.freed_tokens - before) // leaf_len
    freed_nodes += freed
    per_node.append(dt / freed * 1e6)
    per_call.append(dt / calls * 1e6)
print(json.dumps({"impl": impl, "name": name, "sglang": version, "nodes": nodes,
                  "build_s": round(build_s, 1), "tokens_per_call": ask,
                  "nodes_per_call": freed_nodes / (blocks * calls),
                  "us_per_node": round(statistics.median(per_node), 3),
                  "us_per_call": round(statistics.median(per_call), 2),
                  "blocks_us_per_node": [round(x, 3) for x in per_node]}))
"""


def measure_sglang(args: argparse.Namespace, impl: str, nodes: int) -> dict[str, Any]:
    """SGLang's ``impl`` on the tree of ``nodes`` leaves, timed as :func:`measure` times ours
    (in the anchor venv, its own process); the child's JSON line."""
    cmd = [args.anchor_python, "-c", ANCHOR_CHILD, str(args.anchor_script), impl, args.policy,
           *map(str, (nodes, args.leaf_len, args.tokens_per_call, args.calls, args.blocks,
                      PREFIXES, PREFIX_LEN))]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"SGLang {impl} at {nodes} leaves failed (rc {p.returncode}):\n"
                           f"{p.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = evict_scaling_parser()
    args = parser.parse_args(argv)
    try:  # the policy and every tree size, before the first (minutes-long) measurement
        CacheConfig(radix_eviction_policy=args.policy)
    except ValueError as exc:
        parser.error(f"--policy: {exc}")
    leaves = evicted_leaves(args)
    small = [n for n in args.nodes if leaves >= n]
    if small:
        parser.error(f"--nodes {small[0]}: the measurement evicts about {leaves} leaves; use "
                     "more nodes or fewer --blocks / --calls")
    torch.set_num_threads(1)
    args.anchor_python = args.anchor_python or DEFAULT_ANCHOR_PYTHON
    args.anchor_script = args.anchor_script or DEFAULT_ANCHOR_SCRIPT
    impls: list[str] = args.sglang
    if impls:
        why = anchor_available(args)
        if why is not None:
            print(why, file=sys.stderr, flush=True)
            impls = []
    for n in args.nodes:
        ours = measure(args, n)
        print(json.dumps(ours), flush=True)
        for impl in impls:
            if n > args.sglang_max_nodes:
                print(f"SGLang {impl} at {n} leaves skipped (above --sglang-max-nodes "
                      f"{args.sglang_max_nodes}: its evict is O(leaves) per call)",
                      file=sys.stderr, flush=True)
                continue
            theirs = measure_sglang(args, impl, n)
            theirs["ours_speedup"] = round(theirs["us_per_node"] / ours["us_per_node"], 2)
            print(json.dumps(theirs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
