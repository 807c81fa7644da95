"""The LoRA options of ``python -m bench replay`` (all inert unless ``--adapters`` > 0).

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

__all__ = ["add_lora_arguments"]


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """The LoRA options of ``bench.runs.replay`` (all inert unless ``--adapters`` > 0)."""
    g = p.add_argument_group("LoRA adapters (on with --adapters)")
    g.add_argument(
        "--adapters",
        nargs="+",
        default=None,
        metavar="N|DIR",
        help="N generated adapters, or PEFT adapter directories as PATH, NAME=PATH or JSON "
        '{"lora_name", "lora_path"} (default: off)',
    )
    g.add_argument(
        "--adapter-skew",
        default="zipf:1.1",
        help="adapter popularity: zipf:S or uniform (default zipf:1.1)",
    )
    g.add_argument("--max-loras-per-batch", type=int, default=8, help="adapter slots (default 8)")
    g.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="adapters in host memory (default: all); fewer means re-reading adapter directories",
    )
    g.add_argument(
        "--lora-eviction-policy",
        nargs="+",
        default=["lru", "fifo"],
        help="slot eviction policies, side by side (default: lru fifo)",
    )
    g.add_argument(
        "--lora-drain-wait-threshold",
        type=float,
        default=0.0,
        help="seconds a request may wait for a non-resident adapter before one running "
        "adapter drains (default 0: off)",
    )
    g.add_argument(
        "--base-fraction",
        type=float,
        default=0.0,
        help="share of sessions on the base model (default 0)",
    )
    g.add_argument(
        "--decode-step-ms", type=float, default=20.0, help="simulated decode step (default 20 ms)"
    )
    g.add_argument("--lora-seed", type=int, default=0, help="adapter assignment and weights seed")
