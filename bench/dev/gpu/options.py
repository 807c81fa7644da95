"""The options of ``python -m bench sync-counts``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import output_path, prog

__all__ = ["MODEL_NAMES", "sync_counts_parser"]

MODEL_NAMES = ("kv", "hybrid", "swa", "hicache")
"""The engine models of :data:`bench.dev.gpu.sync_counts.MODELS` (checked equal by the tests)."""


def sync_counts_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("sync-counts"),
        description=(
            "Host synchronisations, kernel launches and memcpys per request and per "
            "operation of the replay's engine on a simulated CUDA device; with --device "
            "cuda, us/request on a real GPU against the CPU, the counts from the profiler."
        ),
    )
    p.add_argument("--requests", type=int, default=160, help="requests per model (160)")
    p.add_argument("--trace", default=None,
                   help="replay this trace file's first --requests instead of the seeded "
                        "conversations (e.g. bench/traces/...jsonl)")
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV page (1)")
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    p.add_argument("--policy", default="lru", help="radix eviction policy (lru)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool size [tokens] (default: the models' 30,000; a trace's long "
                        "prompts want more, e.g. 16000000)")
    p.add_argument("--json", nargs="?", const="-", default=None, type=output_path,
                   metavar="FILE",
                   help="write the counts as JSON to FILE (no FILE or '-': print them instead "
                        "of the table)")
    p.add_argument("--device", choices=("sim", "cuda"), default="sim",
                   help="sim: the simulated device (default); cuda: a real GPU (us/request "
                        "on cuda and cpu, counts from torch.profiler, stats() equality)")
    return p
