"""No helper reads another object's private attributes across modules.

The facade's helpers (``radix.insert``, ``radix.requests``, ``radix.diagnostics``,
``radix.checks``), the core, the tiers and the replay engine read other objects through
their public attributes and methods only: every ``x._name`` in those files has ``x`` = ``self``
or ``cls``, a class of the same module, or an imported module (``torch._C``-style names are
another matter). Counted with ``ast``, so a comment or a string never counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["radix/insert.py", "radix/requests.py", "radix/diagnostics.py", "radix/checks.py",
         "radix/cache.py", "radix/core.py", "radix/tiers/host.py", "radix/tiers/storage.py",
         "radix/tiers/base.py", "bench/engine/core.py"]


def private_reads(source: str) -> list[str]:
    """``x._attr`` occurrences whose ``x`` is not ``self`` / ``cls``, a class defined in the
    module, or an imported module (``self.cache._empty`` counts: the cache's private)."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    modules = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in n.names}
    allowed = {"self", "cls"} | own | modules
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__")):
            continue
        if isinstance(n.value, ast.Name) and n.value.id in allowed:
            continue
        out.append(f"{ast.unparse(n.value)}.{n.attr} (line {n.lineno})")
    return out


def test_the_counter_sees_a_private_read_and_ignores_self_and_modules() -> None:
    src = ("import torch\nclass A:\n    def f(self, cache):\n"
           "        return self._x, cache._empty, torch._C, A._y, self.cache._cat\n")
    assert sorted(private_reads(src)) == ["cache._empty (line 4)", "self.cache._cat (line 4)"]


def test_no_helper_reads_another_objects_privates() -> None:
    found = {f: private_reads((ROOT / f).read_text()) for f in FILES}
    assert {f: r for f, r in found.items() if r} == {}
