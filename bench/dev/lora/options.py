"""The options of ``python -m bench lora-load``.

Parsers only, without torch: ``python -m bench COMMAND --help`` builds them alone
(:data:`bench.cli.COMMANDS`); the commands' modules import the library where they run."""

from __future__ import annotations

import argparse

from bench.cli import new_parser, output_path, positive

__all__ = ["lora_load_parser"]


def lora_load_parser() -> argparse.ArgumentParser:
    p = new_parser("lora-load", "Load time and bytes of real PEFT adapters.")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--layers", type=positive, default=4, help="decoder layers (default 4)")
    p.add_argument("--ranks", type=positive, nargs="+", default=[8, 16, 64], help="LoRA ranks")
    p.add_argument("--repeats", type=positive, default=5, help="timed repeats, median (default 5)")
    p.add_argument("--json", type=output_path, default=None, help="also write the rows as JSON to this file")
    return p
