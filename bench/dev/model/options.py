"""The options of ``python -m bench model``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import new_parser

__all__ = ["ARCHITECTURE_NAMES", "WRITE_POLICIES", "model_parser"]

ARCHITECTURE_NAMES = ("bamba", "falcon_h1", "qwen2_swa", "qwen3_next")
"""The tiny models of :data:`bench.dev.model.adapter.ARCHITECTURES` (checked equal by the tests)."""
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
"""``hicache.WRITE_POLICIES`` (checked equal by the tests)."""


def model_parser() -> argparse.ArgumentParser:
    ap = new_parser("model", "Multi-request driver: a real hybrid model served through our cache, "
                             "every request checked.")
    ap.add_argument("--arch", nargs="+", default=list(ARCHITECTURE_NAMES))
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--hicache", choices=WRITE_POLICIES, default=None,
                    help="add the host tier with this write policy (hybrid models only)")
    return ap
