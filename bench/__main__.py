"""``python -m bench COMMAND [ARGS...]``: see :mod:`bench.cli`."""

from __future__ import annotations

import sys

from bench.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
