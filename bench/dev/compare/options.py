"""The options of ``python -m bench radix-ops`` and ``python -m bench evict-scaling``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import new_parser, parse_count, positive, probability, seed

__all__ = ["evict_scaling_parser", "radix_ops_parser"]


def radix_ops_parser() -> argparse.ArgumentParser:
    ap = new_parser("radix-ops", (
        "Our RadixCache on the SGLang anchor's seeded workloads (one JSON line)."))
    ap.add_argument("--workload", choices=["sysprompt", "multiturn"], default="sysprompt")
    ap.add_argument("--states", action="store_true",
                    help="KV + recurrent state (the anchor's unified-mamba-* impls)")
    ap.add_argument("--requests", type=positive, default=2000,
                    help='requests per run (default 2000)')
    ap.add_argument("--req-len", type=positive, default=2000,
                    help='sysprompt: tokens per request (default 2000)')
    ap.add_argument("--sys-len", type=positive, default=1024,
                    help='sysprompt: system prompt tokens (default 1024)')
    ap.add_argument("--prompts", type=positive, default=50,
                    help='sysprompt: distinct system prompts (default 50)')
    ap.add_argument("--new-conv-prob", type=probability, default=0.2,
                    help='multiturn: chance a request starts a conversation (default 0.2)')
    ap.add_argument("--turn-len", type=positive, default=200,
                    help='multiturn: tokens per turn (default 200)')
    ap.add_argument("--max-len", type=positive, default=8000,
                    help='multiturn: longest conversation [tokens] (default 8000)')
    ap.add_argument("--vocab", type=positive, default=32000,
                    help='token ids drawn from [0, VOCAB) (default 32000)')
    ap.add_argument("--capacity", type=positive, default=200_000,
                    help='KV pool [tokens] (default 200,000)')
    ap.add_argument("--mamba-capacity", type=positive, default=64,
                    help='state slots with --states (default 64)')
    ap.add_argument("--no-mamba-branch-checkpoint", dest="mamba_branch_checkpoint",
                    action="store_false")
    ap.add_argument("--mamba-chunk", type=positive, default=64,
                    help="grid the branch checkpoint is aligned down to (anchor default 64)")
    ap.add_argument("--page-size", type=positive, default=1,
                    help='tokens per KV page (default 1)')
    ap.add_argument("--policy", default="lru",
                    help='eviction policy (default lru)')
    ap.add_argument("--seed", type=seed, default=0,
                    help='workload seed (default 0)')
    ap.add_argument("--allocator", choices=["real", "counter"], default="real",
                    help="real: our TokenAllocator / MambaStatePool; counter: the anchor's convention (ids from a counter, frees only counted) (default real)")
    ap.add_argument("--sglang-rules", action="store_true",
                    help="SGLang 0.5.23's tree rules (stateless_leaf='keep', "
                         "match_recency='usable'): the same tree as its caches, request for request")
    ap.add_argument("--check", action="store_true", help="sanity_check() the cache at the end")
    ap.add_argument("--profile", type=parse_count, default=0, metavar="N",
                    help="cProfile the request loop; print the top N functions (tottime) to stderr")
    return ap


def evict_scaling_parser() -> argparse.ArgumentParser:
    ap = new_parser("evict-scaling", (
        "Per-node cost of evict() against tree size (KV only, real allocator, CPU clock): one JSON "
        "line per size."))
    ap.add_argument("--nodes", type=positive, nargs="+", default=[10_000, 100_000, 1_000_000],
                    help="leaves of each tree (default 10,000 100,000 1,000,000)")
    ap.add_argument("--leaf-len", type=positive, default=8,
                    help="tokens per leaf (default 8)")
    ap.add_argument("--tokens-per-call", type=positive, default=64,
                    help="tokens each evict() call asks for (default 64: 8 leaves)")
    ap.add_argument("--calls", type=positive, default=100,
                    help="evict() calls per timed block (default 100)")
    ap.add_argument("--blocks", type=positive, default=5,
                    help="timed blocks per tree; the median block is reported (default 5)")
    ap.add_argument("--policy", default="lru", help="eviction policy (default lru)")
    ap.add_argument("--sglang", nargs="+", default=[], metavar="IMPL",
                    choices=["radix", "unified-python", "unified-rust"],
                    help="also time SGLang's KV caches on the same tree, in the anchor venv: "
                         "radix, unified-python, unified-rust (default: none)")
    ap.add_argument("--sglang-max-nodes", type=positive, default=100_000,
                    help="largest tree SGLang's side runs on (its evict is O(leaves) per "
                         "call; default 100,000)")
    ap.add_argument("--anchor-python", default=None,
                    help="the anchor venv's python (default $HPC_SGLANG_ANCHOR_PYTHON, else "
                         "/tmp/sglang-anchor/bin/python)")
    ap.add_argument("--anchor-script", default=None,
                    help="the SGLang-side bench script whose build() the child calls (not "
                         "in this repository; default $HPC_SGLANG_ANCHOR_SCRIPT)")
    return ap
