"""The options of ``python -m bench radix-ops``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import prog

__all__ = ["radix_ops_parser"]


def radix_ops_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog("radix-ops"),
        description="Our RadixCache on the SGLang anchor's seeded workloads (one JSON line).",
    )
    ap.add_argument("--workload", choices=["sysprompt", "multiturn"], default="sysprompt")
    ap.add_argument("--states", action="store_true",
                    help="KV + recurrent state (the anchor's unified-mamba-* impls)")
    ap.add_argument("--requests", type=int, default=2000,
                    help='requests per run (default 2000)')
    ap.add_argument("--req-len", type=int, default=2000,
                    help='sysprompt: tokens per request (default 2000)')
    ap.add_argument("--sys-len", type=int, default=1024,
                    help='sysprompt: system prompt tokens (default 1024)')
    ap.add_argument("--prompts", type=int, default=50,
                    help='sysprompt: distinct system prompts (default 50)')
    ap.add_argument("--new-conv-prob", type=float, default=0.2,
                    help='multiturn: chance a request starts a conversation (default 0.2)')
    ap.add_argument("--turn-len", type=int, default=200,
                    help='multiturn: tokens per turn (default 200)')
    ap.add_argument("--max-len", type=int, default=8000,
                    help='multiturn: longest conversation [tokens] (default 8000)')
    ap.add_argument("--vocab", type=int, default=32000,
                    help='token ids drawn from [0, VOCAB) (default 32000)')
    ap.add_argument("--capacity", type=int, default=200_000,
                    help='KV pool [tokens] (default 200,000)')
    ap.add_argument("--mamba-capacity", type=int, default=64,
                    help='state slots with --states (default 64)')
    ap.add_argument("--no-mamba-branch-checkpoint", dest="mamba_branch_checkpoint",
                    action="store_false")
    ap.add_argument("--mamba-chunk", type=int, default=64,
                    help="grid the branch checkpoint is aligned down to (anchor default 64)")
    ap.add_argument("--page-size", type=int, default=1,
                    help='tokens per KV page (default 1)')
    ap.add_argument("--policy", default="lru",
                    help='eviction policy (default lru)')
    ap.add_argument("--seed", type=int, default=0,
                    help='workload seed (default 0)')
    ap.add_argument("--allocator", choices=["real", "counter"], default="real",
                    help="real: our TokenAllocator / MambaStatePool; counter: the anchor's convention (ids from a counter, frees only counted) (default real)")
    ap.add_argument("--sglang-rules", action="store_true",
                    help="SGLang 0.5.23's tree rules (stateless_leaf='keep', "
                         "match_recency='usable'): the same tree as its caches, request for request")
    ap.add_argument("--check", action="store_true", help="sanity_check() the cache at the end")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile the request loop; print the top N functions (tottime) to stderr")
    return ap
