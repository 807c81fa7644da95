"""The README's Python examples run as written and print what the README says they print.

Every fenced ``python`` block of ``README.md`` is executed in a fresh namespace; when a fenced
``text`` block follows it directly, the block's standard output must equal that text.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def _examples() -> list[tuple[int, str, str | None]]:
    """(line, python source, expected output or None) for each python block."""
    text = README.read_text()
    blocks = [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, m.end())
              for m in _BLOCK.finditer(text)]
    out = []
    for i, (lang, body, line, end) in enumerate(blocks):
        if lang != "python":
            continue
        expected = None
        if i + 1 < len(blocks):
            nxt_lang, nxt_body, _, _ = blocks[i + 1]
            gap = text[end:text.index("```" + nxt_lang + "\n", end)]
            if nxt_lang == "text" and not gap.strip():
                expected = nxt_body
        out.append((line, body, expected))
    return out


def test_the_readme_has_python_examples() -> None:
    assert _examples(), "README.md lost its examples"


@pytest.mark.parametrize(("line", "source", "expected"), _examples(),
                         ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_example_runs_as_written(line: int, source: str, expected: str | None) -> None:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(source, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    if expected is not None:
        assert buf.getvalue() == expected
