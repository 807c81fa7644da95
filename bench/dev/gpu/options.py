"""The options of ``python -m bench sync-counts``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import ArgumentParser, prog

__all__ = ["MODEL_NAMES", "sync_counts_parser"]

MODEL_NAMES = ("kv", "hybrid", "swa", "hicache")
"""The engine models of :data:`bench.dev.gpu.sync_counts.MODELS` (checked equal by the tests)."""


def sync_counts_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog("sync-counts"),
        description=(
            "Host synchronisations per request and per operation of the replay's "
            "engine on a simulated CUDA device."
        ),
    )
    p.add_argument("--requests", type=int, default=160, help="requests per model (160)")
    p.add_argument("--trace", default=None,
                   help="replay this trace file's first --requests instead of the seeded "
                        "conversations (e.g. bench/traces/...jsonl)")
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV page (1)")
    p.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p
