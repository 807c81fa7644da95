"""Where the SGLang anchor environment is: the tests that run SGLang 0.5.23's (and 0.5.12's)
own classes next to this library's, each in a subprocess of the anchor's Python.

``.ci/sglang-anchor-up`` builds the environment (CPU torch, SGLang without its GPU stack,
0.5.12 unpacked beside it) and prints the two variables read here:

* ``HPC_SGLANG_ANCHOR_PYTHON``: its interpreter (default ``/tmp/sglang-anchor/bin/python``,
  the script's default environment);
* ``HPC_SGLANG_ANCHOR_DIR``: the folder holding ``sglang_cpu_shim.py`` (the import-time
  stand-ins for triton / torchvision) and ``sglang_driver.py`` (default: this repository's
  ``tests/sglang/anchor``).

Without the environment the anchor tests skip, saying why (:func:`anchor_missing`).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ANCHOR_PY = Path(os.environ.get("HPC_SGLANG_ANCHOR_PYTHON", "/tmp/sglang-anchor/bin/python"))
ANCHOR_DIR = Path(os.environ.get("HPC_SGLANG_ANCHOR_DIR", REPO / "tests" / "sglang" / "anchor"))
#: Where ``.ci/sglang-anchor-up`` unpacks SGLang 0.5.12 (its legacy ``MambaRadixCache``).
LEGACY_DIR = ANCHOR_PY.parents[1] / "older" / "x_0.5.12"
BUILD = 'eval "$(bash .ci/sglang-anchor-up)"'


def anchor_missing() -> str | None:
    """Why SGLang 0.5.23 cannot be run here (the reason a test skips with), or ``None``."""
    if not ANCHOR_PY.exists():
        return f"the SGLang anchor environment is not built ({ANCHOR_PY} missing: run {BUILD})"
    if not (ANCHOR_DIR / "sglang_cpu_shim.py").exists():
        return (f"the anchor's CPU stand-ins are missing ({ANCHOR_DIR / 'sglang_cpu_shim.py'}; "
                "set HPC_SGLANG_ANCHOR_DIR)")
    return None


def legacy_missing() -> str | None:
    """Why SGLang 0.5.12 cannot be run here, or ``None``."""
    if (why := anchor_missing()) is not None:
        return why
    if not LEGACY_DIR.is_dir():
        return f"SGLang 0.5.12 is not unpacked in the anchor environment ({LEGACY_DIR} missing: run {BUILD})"
    return None
