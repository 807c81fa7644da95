"""Code run in a fresh interpreter: what a test cannot do in the pytest process, such as
hiding an optional package (``sys.modules['zmq'] = None``) before the library imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    """Run ``code`` with ``python -c`` at the repository root, this checkout's packages first
    on the path; its stdout. Raises ``subprocess.CalledProcessError`` when it exits non-zero."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout
