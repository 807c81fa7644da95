"""The model tests beside an engine's older transformers pin (SGLang 0.5.23:
``transformers==5.19.0``): they skip, saying which version they need, instead of failing to
import; the ``test`` extra does not force a newer one."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from bench.dev.model import MIN_TRANSFORMERS

REPO = Path(__file__).resolve().parents[2]


def test_model_tests_skip_below_the_minimum_transformers(tmp_path: Any) -> None:
    stub = tmp_path / "transformers"
    stub.mkdir()
    (stub / "__init__.py").write_text('__version__ = "5.19.0"\n')
    files = sorted(str(p) for p in (REPO / "tests" / "model").glob("test_model_*.py")
                   if p.name != Path(__file__).name)
    assert len(files) == 3
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *files], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"})
    out = proc.stdout
    assert proc.returncode == 5, out[-3000:]  # pytest: no test ran (all skipped at import)
    assert "3 skipped" in out and "failed" not in out and "error" not in out.lower()
    assert out.count(f"required is: '{MIN_TRANSFORMERS}'") == 3, out[-3000:]


def test_the_test_extra_does_not_force_the_models_transformers() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"transformers>={MIN_TRANSFORMERS}" in extras["model"]
    test = " ".join(extras["test"])
    assert "model" not in test.split("[", 1)[-1].split("]")[0].split(",")
    assert "transformers" in test and f">={MIN_TRANSFORMERS}" not in test
    assert "peft" in test and all("peft" not in d for d in extras["lora"])
