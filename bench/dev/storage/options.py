"""The options of ``python -m bench storage`` and ``python -m bench l3-share``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import new_parser, output_path, parse_count, positive

__all__ = ["SETUPS", "l3_share_parser", "parse_l3", "storage_parser"]

SETUPS = ("none", "private", "shared")
"""The ``l3-share`` setups: no L3, one store per instance, one store shared."""


def parse_l3(text: str) -> tuple[str, str]:
    """``file:DIR``, ``redis://...`` / ``rediss://...`` or ``mooncake://host:port`` ->
    (backend, where)."""
    if text.startswith("file:"):
        return "file", text[5:]
    if text.startswith(("redis://", "rediss://")):
        return "redis", text
    if text.startswith("mooncake://"):
        return "mooncake", text
    raise argparse.ArgumentTypeError(
        f"--l3 must be file:DIR, redis://host:port or mooncake://host:port, got {text!r}")


def storage_parser() -> argparse.ArgumentParser:
    p = new_parser("storage", (
        "Page throughput of the L3 backends: pages/s and MiB/s, written and read, batched or not."))
    p.add_argument("--page-bytes", type=positive, default=parse_count("256K"))
    p.add_argument("--pages", type=positive, default=256)
    p.add_argument("--batch", type=positive, nargs="+", default=[1, 32])
    p.add_argument("--redis-url", default=None)
    p.add_argument("--cluster-urls", default=None)
    p.add_argument("--mooncake-url", default=None, help="mooncake://host:port of a master")
    p.add_argument("--repeat", type=positive, default=1,
                   help="runs per row; the best rates and the least CPU time are reported")
    p.add_argument("--mac", choices=("off", "on", "both"), default="off",
                   help="records checksummed (off), sealed with an HMAC-SHA256 under a random "
                        "deployment secret (on), or both, row after row (default off)")
    p.add_argument("--json", type=output_path, default=None)
    return p


def l3_share_parser() -> argparse.ArgumentParser:
    p = new_parser("l3-share", "Engine instances sharing one HiCache L3: hit rate with and without "
                               "sharing.")
    p.add_argument("--trace", default=None, help="JSONL trace (default: the shipped Mooncake trace)")
    p.add_argument("--max-requests", type=positive, default=1000)
    p.add_argument("--instances", type=positive, default=2)
    p.add_argument("--l3", type=parse_l3, default=("file", "/tmp/hpc-l3-share"),
                   help="file:DIR, redis://host:port or mooncake://host:port (default "
                        "file:/tmp/hpc-l3-share)")
    p.add_argument("--mooncake-segment", type=parse_count, default=parse_count("64M"),
                   help="bytes each instance lends Mooncake Store (0: none; default 64M)")
    p.add_argument("--kv-tokens", type=positive, default=parse_count("1M"))
    p.add_argument("--state-slots", type=parse_count, default=64)
    p.add_argument("--page-size", type=positive, default=64)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--authenticated", action="store_true",
                   help="seal every L3 page with a MAC under a random deployment secret")
    p.add_argument("--json", type=output_path, default=None, help="write the rows as JSON here ('-': stdout)")
    return p
