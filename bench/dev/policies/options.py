"""The options of ``python -m bench hit-breakdown``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import new_parser, parse_count, positive, positive_float

__all__ = ["hit_breakdown_parser"]


def hit_breakdown_parser() -> argparse.ArgumentParser:
    p = new_parser("hit-breakdown", "Where a state walk's hits come from.")
    p.add_argument("--trace", default=None)
    p.add_argument("--max-requests", type=positive, default=None)
    p.add_argument("--policy", nargs="+", default=["belady", "gds_adaptive"])
    p.add_argument("--kv-tokens", type=positive, default=16_000_000)
    p.add_argument("--state-slots", type=parse_count, default=256)
    p.add_argument("--concurrency", type=positive, default=32)
    p.add_argument("--time-scale", type=positive_float, default=2.0)
    return p
